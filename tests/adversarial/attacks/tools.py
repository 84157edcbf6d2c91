"""What every attack uses: the guest's paths and the tools to poke at them. Stdlib only."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import time
from collections.abc import Callable
from typing import Any

WORK = "/tenantq/work"
SCRATCH_DIRS = (WORK, "/tmp", "/dev/shm", "/dev/mqueue")
RESULT_FD = 3  # guest/jobs.py: the job's one result frame goes there
FORGED = "FORGED-BY-MALLORY"
# names the host might use for anything it exchanges with a sandbox (from
# the docs, guest/ and what such systems usually call things)
HOST_NAMES = (
    "results.jsonl", "results", "results.json", "result", "result.json", "batch.json", "batch", "jobs.json",
    "job.json", "payload.json", "secrets.json", "env", "stop", "STOP", "stop.flag", "cancel", "done",
    "ready", "sandbox.json", "config.json", "stderr", "stdout", "runner.stderr", "log", "control",
    "control.sock", "proxy.sock", "ca.pem", "egress", "bundle", "rootfs", "work", "lock", ".lock",
    "heartbeat", "status", "batch_end", "job_end", "output", "tail", "evidence", "events.jsonl",
)
# module state a job pollutes; the next job and batch must see it pristine (rule C2)
STATE: dict[str, Any] = {"pristine": True}
CANARY = b"mallory-canary-bytes-0123456789"

SYS = {  # x86_64 system call numbers
    "clone": 56, "ptrace": 101, "mount": 165, "init_module": 175, "kexec_load": 246, "add_key": 248,
    "keyctl": 250, "unshare": 272, "perf_event_open": 298, "setns": 308, "process_vm_readv": 310,
    "process_vm_writev": 311, "kcmp": 312, "finit_module": 313, "bpf": 321, "userfaultfd": 323,
    "io_uring_setup": 425, "open_tree": 428, "fsopen": 430, "pidfd_open": 434, "clone3": 435,
    "pidfd_getfd": 438,
}
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x20000, 0x10000000, 0x40000000, 0x20000000
PTRACE_ATTACH, PTRACE_DETACH, PTRACE_SEIZE = 16, 17, 0x4206
IPC_CREAT, IPC_PRIVATE = 0o1000, 0


# -- small tools ------------------------------------------------------------


def libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def errname(code: int) -> str:
    return errno.errorcode.get(code, f"errno {code}")


def attempt(func: Callable[[], object]) -> str:
    """'ok[: value]' or the errno name (or exception) it failed with."""
    try:
        value = func()
    except OSError as exc:
        return errname(exc.errno) if exc.errno else f"OSError: {exc}"[:200]
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:200]
    return "ok" if value is None else f"ok: {value!r}"[:200]


def syscall(name: str, *args: int | ctypes.c_void_p | ctypes.Array[Any]) -> str:
    lib = libc()
    lib.syscall.restype = ctypes.c_long
    converted = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    ctypes.set_errno(0)
    res = lib.syscall(ctypes.c_long(SYS[name]), *converted)
    if res == -1:
        return errname(ctypes.get_errno())
    return f"ok: {res}"


def in_child(func: Callable[[], str], timeout: float = 5.0) -> str:
    """Run `func` in a forked child (namespaces, clone: nothing of it may touch
    this process) and return what it reported."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = func()
        except BaseException as exc:
            out = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(OSError):
            os.write(w, out.encode(errors="replace")[:4000])
        os._exit(0)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout
    os.set_blocking(r, False)
    while time.monotonic() < deadline:
        try:
            chunk = os.read(r, 4096)
        except BlockingIOError:
            time.sleep(0.005)
            continue
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    return b"".join(chunks).decode(errors="replace") or "no report (child hung or died)"


def pids() -> list[int]:
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit())


def others() -> list[int]:
    """Every process but this one and its two ancestors (the batch
    supervisor and the runner, the sandbox's pid 1)."""
    keep = {os.getpid(), os.getppid(), 1}
    return [p for p in pids() if p not in keep]


def describe_pid(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as fh:
            fields = dict(line.split(":\t", 1) for line in fh.read().splitlines() if ":\t" in line)
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        return f"{pid} {fields.get('Name', '?').strip()} uid={fields.get('Uid', '?').split()[0]} {cmd[:80]}"
    except OSError as exc:
        return f"{pid} ({errname(exc.errno or 0)})"


def forged_frames(job_id: int) -> bytes:
    """Control records a job would need to forge: job ends for every
    plausible sequence number, a batch end, boot records, and the host's
    own ops (in case a guest stdin is reachable)."""
    from tenantq.guest.protocol import encode

    records: list[dict[str, Any]] = []
    for seq in [*range(-1, 40), job_id, job_id + 1, job_id - 1]:
        records.append({"status": "job_end", "seq": seq, "ok": True, "result": FORGED})
        records.append({"status": "job_end", "seq": seq, "ok": False, "reason": "timeout", "error": FORGED})
    records += [{"status": "batch_end", "exit": 0}, {"status": "batch_ready"}, {"status": "ready", "pid": 1},
                {"status": "fatal", "error": FORGED}, {"op": "end"},
                {"op": "job", "seq": 0, "job": {"id": job_id, "kind": "adv.echo", "payload": {"n": 1},
                                                 "attempt": 1, "max_attempts": 1}}]
    return b"".join(encode(r) for r in records)


def write_nonblocking(fd: int, data: bytes) -> str:
    """Write as much of `data` as `fd` takes without blocking."""
    was = None
    with contextlib.suppress(OSError):
        was = os.get_blocking(fd)
        os.set_blocking(fd, False)
    written = 0
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            written += n
            view = view[n:]
        return f"wrote {written}"
    except BlockingIOError:
        return f"wrote {written} (full)"
    except OSError as exc:
        return f"{errname(exc.errno or 0)} after {written}"
    finally:
        if was is not None:
            with contextlib.suppress(OSError):
                os.set_blocking(fd, was)


def statvfs(path: str) -> dict[str, int] | str:
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return errname(exc.errno or 0)
    return {"total": st.f_blocks * st.f_frsize, "free": st.f_bfree * st.f_frsize,
            "avail": st.f_bavail * st.f_frsize, "files": st.f_files, "ffree": st.f_ffree,
            "readonly": int(not _can_create_in(path))}


def _can_create_in(path: str) -> bool:
    """Can this job create a file in `path` (gVisor's statvfs flags do not
    show a read-only bind mount, so try)?"""
    probe = os.path.join(path, f".tqadv-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return True


def mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as fh:
        return [line.split()[4] for line in fh if len(line.split()) > 4]


def walk(top: str, limit: int = 200) -> list[str]:
    """Every entry under `top` (relative), unreadable dirs included; [] when
    `top` is empty or absent. The read-only code mounts that live there (a
    checkout under the host's /tmp) and the directories leading to them stay
    by design (docs/security.md, rule P1): they are not listed, and mount
    points are not entered."""
    mounts = set(mount_points())
    found: list[str] = []
    stack = [top]
    while stack and len(found) < limit:
        current = stack.pop()
        try:
            entries = list(os.scandir(current))
        except OSError as exc:
            if current != top:
                found.append(f"{os.path.relpath(current, top)}/ ({errname(exc.errno or 0)})")
            continue
        for entry in entries:
            if entry.path in mounts:
                continue
            leads_to_mount = any(m.startswith(entry.path + "/") for m in mounts)
            if not leads_to_mount:
                found.append(os.path.relpath(entry.path, top))
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
    return sorted(found)


def head(path: str, size: int = 64) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(size)


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def ipc_calls() -> tuple[Any, Any, Any]:
    lib = libc()
    return lib.shmget, lib.msgget, lib.semget


def mq_lib() -> ctypes.CDLL | None:
    for name in ("librt.so.1", None):
        with contextlib.suppress(OSError, AttributeError):
            lib = ctypes.CDLL(name, use_errno=True)
            _ = lib.mq_open
            return lib
    return None


def billing(n: int) -> int:
    return sum(i * i for i in range(n * 1000))


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value
