"""What both host-side drivers share: the sandbox directory, the work dir's
quota, the cgroup box, TTL bookkeeping, started processes and their
channel, idempotent destroy.

The host never opens, reads, writes, chowns or stats anything inside the
work dir (docs/security.md, rule H1): it is a tmpfs of its own, mounted
with its size (the quota: the guest gets ENOSPC and sees it in statvfs),
owner and mode by options, and unmounted, contents and all, on destroy.
What the guest says reaches the host only over the runner's stdout pipe;
its stderr goes to a host file that only the runner's own processes write,
read back only as a bounded tail."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tenantq.sandbox.cgroups import CgroupBox
from tenantq.sandbox.channel import Channel, wait_fd
from tenantq.sandbox.spec import TAIL_BYTES, End, ProcessResult, SandboxSpec, classify_exit

META_FILE = "sandbox.json"
# in the sandbox's egress dir (host-owned, read-only inside at
# /tenantq/egress): the deadline an API sandbox's agent enforces by itself
DEADLINE_FILE = "deadline"
# the runner's stderr file: past this the sandbox is killed (only tenantq's
# own guest code writes there, so a flood means something is very wrong)
MAX_STDERR_BYTES = 8 << 20


class HostSandbox:
    """A sandbox's host-side state under <data_dir>/sandboxes/<driver>/<id>."""

    def __init__(self, sandbox_id: str, path: Path, spec: SandboxSpec, driver_name: str,
                 existing: dict[str, object] | None = None) -> None:
        """`existing`: the metadata of a sandbox another process made, which
        this object now drives (Sandbox.connect): nothing is written."""
        self.id = sandbox_id
        self.path = path
        self.spec = spec
        self.work_dir = path / "work"
        self.egress_dir = path / "egress"
        self.driver_name = driver_name
        self.deadline = time.time() + spec.ttl_seconds
        self.box = CgroupBox(sandbox_id)
        self.destroyed = False
        self.work_mounted = False
        self.runs = 0
        self._proc: subprocess.Popen[bytes] | None = None
        if existing is not None:
            self.deadline = float(str(existing["deadline"]))
            self.work_mounted = os.path.ismount(self.work_dir)
            return
        (path / META_FILE).write_text(json.dumps({
            "id": sandbox_id, "driver": driver_name, "tenant": spec.tenant, "deadline": self.deadline,
            "labels": spec.labels, "created": time.time(), "dispatcher_pid": os.getpid(),
            "memory_mb": spec.memory_mb, "cpus": spec.cpus, "writable_root": spec.writable_root,
        }))
        self._write_deadline()

    def _write_deadline(self) -> None:
        if not self.spec.writable_root:
            return  # only an API sandbox's agent reads it
        # written to a new file and renamed: the guest reads it whole or not at all
        staging = self.egress_dir.parent / f".{DEADLINE_FILE}"
        staging.write_text(f"{self.deadline:.3f}\n")
        os.chmod(staging, 0o644)
        os.replace(staging, self.egress_dir / DEADLINE_FILE)

    def oom_killed(self) -> bool:
        """Did the memory cgroup kill something here for exceeding the limit?"""
        return self.box.oom_killed(self.spec.memory_mb << 20)

    def remaining_ttl(self) -> float:
        return max(0.0, self.deadline - time.time())

    def start(self, argv: list[str], *, env: dict[str, str] | None = None,
              self_limiting: bool = False, supervisor: bool = False) -> HostProcess:
        raise NotImplementedError

    def destroy(self) -> None:
        raise NotImplementedError

    def run(self, argv: list[str], *, timeout: float, stdin: bytes = b"",
            env: dict[str, str] | None = None, self_limiting: bool = False) -> ProcessResult:
        """start(), feed stdin and close it, wait up to the budget (killing on
        overrun) and classify the end."""
        running = self.start(argv, env=env, self_limiting=self_limiting)
        try:
            running.write(stdin)
            running.close_stdin()
            budget = min(timeout, self.remaining_ttl())
            deadline = time.monotonic() + budget
            while time.monotonic() < deadline:
                running.drain_stdout()  # bounded: a tail is kept
                result = running.wait(min(0.05, max(0.0, deadline - time.monotonic())))
                if result is not None:
                    return result
            return running.stop(f"after {budget:g} s")
        finally:
            running.close()

    def extend_deadline(self, seconds: float) -> None:
        """Move the deadline (what the reaper and an API sandbox's agent read)
        to `seconds` from now: a kept-warm sandbox lives on, set_ttl()."""
        self.deadline = time.time() + seconds
        self.update_meta(deadline=self.deadline)
        self._write_deadline()

    def update_meta(self, **values: object) -> None:
        meta = read_meta(self.path) or {}
        meta.update(values)
        staging = self.path / f".{META_FILE}"
        staging.write_text(json.dumps(meta))
        os.replace(staging, self.path / META_FILE)

    def mount_work_dir(self, owner: int) -> None:
        """The work dir as a tmpfs of its own: the quota is its size."""
        options = f"size={self.spec.work_mb}m,mode=0700,uid={owner},gid={owner},nosuid,nodev"
        command = ["mount", "-t", "tmpfs", "-o", options, f"tenantq-{self.id}", str(self.work_dir)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise OSError(f"cannot mount the sandbox work dir (tmpfs, needs root): {done.stderr.strip()}")
        self.work_mounted = True

    def _remove_host_state(self) -> None:
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()
        self.box.remove()
        unmount_work_dir(self.work_dir)
        shutil.rmtree(self.path, ignore_errors=True)


class HostProcess:
    """A process started in a sandbox: its stdin and stdout pipes are the
    control channel (a warm guest runner gets batch after batch on them)."""

    def __init__(self, sandbox: HostSandbox, proc: subprocess.Popen[bytes], err_path: Path,
                 kill: Callable[[], None]) -> None:
        self.sandbox = sandbox
        self.proc = proc
        self.err_path = err_path
        # the host's own fd of the stderr file: tails are read from it, never
        # by reopening a path
        self._err_fd = os.open(err_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._kill = kill
        assert proc.stdin is not None and proc.stdout is not None
        self.channel = Channel(proc.stdin.fileno(), proc.stdout.fileno(), self.alive)
        self._out_tail = b""

    def write(self, data: bytes) -> bool:
        """False when the process no longer reads its stdin (it is gone)."""
        assert self.proc.stdin is not None
        try:
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(self.proc.stdin.fileno(), view):]
                except BlockingIOError:
                    wait_fd(self.proc.stdin.fileno(), select.POLLOUT, 0.1)
                    if not self.alive():
                        return False
        except (BrokenPipeError, ValueError, OSError):
            return False
        return True

    def close_stdin(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self.proc.stdin.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr_size(self) -> int:
        return os.fstat(self._err_fd).st_size

    def stderr(self) -> str:
        """The last TAIL_BYTES of stderr, read from the end (bounded)."""
        size = self.stderr_size()
        data = os.pread(self._err_fd, TAIL_BYTES, max(0, size - TAIL_BYTES))
        return data.decode("utf-8", errors="replace")

    def drain_stdout(self) -> None:
        """Read what the process wrote on stdout, keeping only a tail (for
        one-shot commands, whose stdout is not a channel)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        os.set_blocking(fd, False)
        with contextlib.suppress(BlockingIOError, OSError):
            while chunk := os.read(fd, 1 << 16):
                self._out_tail = (self._out_tail + chunk)[-TAIL_BYTES:]

    def wait(self, timeout: float) -> ProcessResult | None:
        """The classified end, or None if it still runs after `timeout`."""
        status = wait_exit(self.proc, timeout)
        return None if status is None else self._result(status, classify_exit(status))

    def stop(self, detail: str) -> ProcessResult:
        """Kill it (it overran) and return the end as a timeout."""
        self._kill()
        returncode = self.proc.wait(timeout=30)
        return self._result(returncode, End("timeout", exit_code=returncode, detail=detail))

    def _result(self, returncode: int, end: End) -> ProcessResult:
        self.close_stdin()
        self.drain_stdout()
        if end.kind == "signal" and end.signal == 9 and self.sandbox.oom_killed():
            end = End("oom", exit_code=returncode, detail=f"exceeded {self.sandbox.spec.memory_mb} MiB")
        return ProcessResult(exit_code=returncode, stdout=self._out_tail.decode("utf-8", errors="replace"),
                          stderr=self.stderr(), end=end)

    def close(self) -> None:
        self.close_stdin()
        with contextlib.suppress(OSError):
            os.close(self._err_fd)
        if self.proc.stdout is not None:
            with contextlib.suppress(OSError):
                self.proc.stdout.close()


def start_process(sandbox: HostSandbox, command: list[str], env: dict[str, str] | None,
                  kill: Callable[[], None], *, new_session: bool = False,
                  kind: type[HostProcess] | None = None, pass_fds: tuple[int, ...] = ()) -> HostProcess:
    """Popen with the channel pipes and an append-mode stderr file in the
    sandbox's host-only dir (runsc needs a file it can hand over, not a pipe
    nobody drains)."""
    sandbox.runs += 1
    err_path = sandbox.path / f"run{sandbox.runs}.err"
    with open(err_path, "ab") as err:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                env=env, start_new_session=new_session, pass_fds=pass_fds)
    return (kind or HostProcess)(sandbox, proc, err_path, kill)


def unmount_work_dir(work_dir: Path) -> None:
    """Detach the work dir's tmpfs (its contents go with it) if mounted."""
    if os.path.ismount(work_dir):
        subprocess.run(["umount", "-l", str(work_dir)], capture_output=True, timeout=30)


def read_meta(path: Path) -> dict[str, object] | None:
    try:
        return dict(json.loads((path / META_FILE).read_text()))
    except (OSError, ValueError):
        return None


def spec_from_meta(meta: dict[str, object]) -> SandboxSpec:
    """The spec of a sandbox another process made, as far as the host's own
    metadata file records it (its mounts are this host's guest Python)."""
    from tenantq.sandbox.layout import guest_python

    labels = meta.get("labels")
    return SandboxSpec(tenant=str(meta.get("tenant") or ""), memory_mb=int(str(meta.get("memory_mb", 512))),
                       cpus=float(str(meta.get("cpus", 1.0))), mounts=guest_python().mounts,
                       labels={str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {},
                       writable_root=bool(meta.get("writable_root")))


def owner_alive(meta: dict[str, object] | None) -> bool:
    """Is the dispatcher that created this sandbox still running (on this host)?"""
    if not meta:
        return False
    try:
        os.kill(int(str(meta["dispatcher_pid"])), 0)
    except (KeyError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def expired_dirs(base: Path, *, grace: float = 5.0) -> list[Path]:
    """Sandbox dirs whose TTL (plus grace) has passed, or that lost their
    metadata (a crash between mkdir and writing it)."""
    if not base.is_dir():
        return []
    now = time.time()
    out: list[Path] = []
    for path in base.iterdir():
        if not path.is_dir():
            continue
        meta = read_meta(path)
        deadline = float(str(meta["deadline"])) if meta else path.stat().st_mtime + 3600
        if now > deadline + grace:
            out.append(path)
    return out


def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """The process's exit status, or None if it still runs after `timeout`.

    Popen.wait(timeout) polls with sleeps of up to 50 ms, which would add
    tens of milliseconds to every batch; a pidfd wakes us the moment the
    process exits.
    """
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # old kernel, or the process is gone
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(max(0.0, timeout) * 1000):
            return None
    finally:
        os.close(fd)
    return proc.wait()
