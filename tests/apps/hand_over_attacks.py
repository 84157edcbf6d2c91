"""A hostile tenant's handlers for tests/adversarial/test_hand_over.py, written
from docs/security.md (rule C1 and the hand-over paragraph after it),
docs/sandbox.md ("One path", the ready pool, kept warm) and the guest code
(src/tenantq/guest/: agent.py, protocol.py, runner.py, supervisor.py) only.
Stdlib only: it runs in the guest.

Every queue sandbox boots with the Sandbox API's agent as its init, which the
host asks to hand over (`{"op": "hand_over"}`) before any tenant is bound: the
agent then execs the guest runner in its own place. An attacker who has read
agent.py tries to find that agent (or anything that still speaks its
protocol), command it, forge the batch protocol around it, leave something
behind in a pooled or kept-warm sandbox for the next tenant, and read another
tenant's secrets from one.

This module is the worker's app: it imports tests.adversarial.attack_app so
that the arena's honest `adv.echo` (and the other adv.* handlers) exist too.
"""

from __future__ import annotations

import base64
import contextlib
import os
import select
import socket
import stat
import sys
import time
from typing import Any

import tenantq
from tests.adversarial import attack_app  # noqa: F401  (registers adv.echo and the other adv.* kinds)
from tests.adversarial.attacks import leftovers
from tests.adversarial.attacks.channel import use_reopened
from tests.adversarial.attacks.tools import (
    FORGED,
    RESULT_FD,
    SCRATCH_DIRS,
    describe_pid,
    errname,
    forged_frames,
    is_open,
    mount_points,
    others,
    pids,
    statvfs,
    walk,
    write_nonblocking,
)

# the capabilities docs/security.md (rule C1) gives the runner under gVisor:
# CAP_SETGID (6), CAP_SETUID (7), CAP_KILL (5), CAP_SYS_ADMIN (21)
RUNNER_CAPS = (1 << 5) | (1 << 6) | (1 << 7) | (1 << 21)
# directories outside the documented scratch space a job might find writable
# (a file left there would survive rule P1's cleaner)
CANDIDATE_DIRS = ("/", "/tenantq", "/var", "/var/tmp", "/var/run", "/run", "/root", "/home", "/etc", "/opt",
                  "/srv", "/mnt", "/media", "/dev", "/dev/pts", "/usr/tmp", "/tmp/wt", "/tmp/wt/src")
# what the agent would have done, had anything executed these frames
PWNED = "tqho-pwned"
TEXT_LIMIT = 2000


def _short(text: str, limit: int = TEXT_LIMIT) -> str:
    return text if len(text) <= limit else text[:limit] + f"...[{len(text)} chars]"


def _read(path: str, limit: int = 16384) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(limit).decode(errors="replace")
    except OSError as exc:
        return f"ERR {errname(exc.errno or 0)}"


def _environ_of(pid: int | str) -> dict[str, str] | str:
    """Another process's initial environment, as /proc shows it."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read(65536)
    except OSError as exc:
        return f"ERR {errname(exc.errno or 0)}"
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        if item:
            key, _, value = item.decode(errors="replace").partition("=")
            out[key] = value
    return out


def _status(pid: int | str) -> dict[str, str]:
    text = _read(f"/proc/{pid}/status")
    fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
    keep = ("Name", "Uid", "Gid", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
    return {k: fields[k].strip() for k in keep if k in fields}


def _cmdline(pid: int | str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read(4096).replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError as exc:
        return f"ERR {errname(exc.errno or 0)}"


def _fd_links(pid: int | str) -> dict[str, str] | str:
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError as exc:
        return f"ERR {errname(exc.errno or 0)}"
    out: dict[str, str] = {}
    for name in sorted(names, key=lambda n: int(n) if n.isdigit() else -1)[:64]:
        try:
            out[name] = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError as exc:
            out[name] = f"ERR {errname(exc.errno or 0)}"
    return out


def _stat_id(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"ERR {errname(exc.errno or 0)}"
    return f"dev={st.st_dev} ino={st.st_ino} mtime={st.st_mtime_ns} ctime={st.st_ctime_ns}"


def facts() -> dict[str, Any]:
    """Who and where this job is: pid 1 (the runner, never an agent), the
    processes around it, and what may tell one sandbox from another."""
    me = os.getpid()
    cmdlines = {str(p): _cmdline(p) for p in pids() if p != me}
    pid1_stat = _read("/proc/1/stat", 4096)
    starttime = pid1_stat.rsplit(")", 1)[-1].split()[19] if ")" in pid1_stat else "?"
    mountinfo = _read("/proc/self/mountinfo", 1 << 20).splitlines()
    work_mounts = [line for line in mountinfo if " /tenantq/" in line or "tq-" in line][:20]
    btime = next((line for line in _read("/proc/stat", 65536).splitlines() if line.startswith("btime")), "?")
    namespaces: dict[str, str] = {}
    for ns in ("mnt", "pid", "net", "uts", "ipc", "user"):
        try:
            namespaces[ns] = os.readlink(f"/proc/self/ns/{ns}")
        except OSError as exc:
            namespaces[ns] = f"ERR {errname(exc.errno or 0)}"
    return {
        "pid": me, "ppid": os.getppid(), "uid": os.getuid(), "euid": os.geteuid(),
        "pid1_cmdline": cmdlines.get("1", _cmdline(1)), "pid1_status": _status(1),
        "ppid_status": _status(os.getppid()), "self_status": _status("self"),
        "cmdlines": cmdlines,
        "pid1_starttime": starttime, "uptime": _read("/proc/uptime", 100).strip(),
        "btime": btime,
        "boot_id": _read("/proc/sys/kernel/random/boot_id", 100).strip(),
        "hostname": socket.gethostname(), "cgroup": _read("/proc/self/cgroup", 4096).strip()[:1000],
        "ns": namespaces, "work_mount": work_mounts, "work_stat": _stat_id("/tenantq/work"),
        "pid1_stderr": _stat_id("/proc/1/fd/2"), "pid1_fds": _fd_links(1),
        "ppid_fds": _fd_links(os.getppid()),
        "mounts": mount_points()[:80],
    }


# -- attack 1: talk to an agent ----------------------------------------------------------


def _python_touch(dirs: list[str], tag: str, how: str) -> str:
    """Python source that, if anything ever ran it, leaves a file in each of `dirs`."""
    return (f"import os\nfor d in {dirs!r}:\n"
            f"    try:\n        open(os.path.join(d, '{PWNED}-{tag}-{how}-%d' % os.getpid()), 'w').write("
            f"'ran as %d' % os.getuid())\n"
            f"    except OSError:\n        pass\n")


def agent_frames(tag: str, host_dir: str, job_id: int) -> bytes:
    """Every op guest/agent.py takes, each asking for something a test can see
    happen (a file in /tmp, the work dir or a host directory); the agent's own
    events (what a host's agent link reads); and the batch protocol both ways."""
    from tenantq.guest.protocol import encode

    dirs = [host_dir, "/tmp", "/tenantq/work"]
    py = sys.executable
    shell = "; ".join(f"echo pwned > {d}/{PWNED}-{tag}-sh" for d in dirs)
    b64 = base64.b64encode(b"written by a forged agent frame\n").decode()
    records: list[dict[str, Any]] = [
        {"op": "env", "env": {"TQHO_INJECTED": tag, "PATH": f"/tmp/{tag}:/usr/bin:/bin"}},
        {"op": "exec", "id": 1, "argv": [py, "-I", "-S", "-c", _python_touch(dirs, tag, "exec")], "cwd": None,
         "env": {"TQHO_INJECTED": tag}, "stdin": None, "keep_stdin": False, "cap": 4096},
        {"op": "exec", "id": 2, "argv": ["/bin/sh", "-c", shell], "cwd": None, "env": {}, "stdin": None,
         "keep_stdin": False, "cap": 4096},
        {"op": "exec", "id": 3, "argv": ["/bin/sh", "-c", shell], "cwd": "/", "env": {},
         "stdin": base64.b64encode(b"x").decode(), "keep_stdin": True, "cap": 4096},
        {"op": "stdin", "id": 3, "data": b64, "eof": True},
        {"op": "kill", "id": 3, "signal": 9},
        {"op": "kill", "id": 0, "signal": 9},
        *({"op": "fs", "rid": 10 + i, "fs": "write", "path": f"{d}/{PWNED}-{tag}-fs", "data": b64}
          for i, d in enumerate(dirs)),
        {"op": "fs", "rid": 20, "fs": "make_dir", "path": f"/tenantq/work/{PWNED}-{tag}-dir"},
        {"op": "fs", "rid": 21, "fs": "read", "path": "/proc/1/environ", "offset": 0, "max_bytes": 65536},
        {"op": "fs", "rid": 22, "fs": "list", "path": "/"},
        {"op": "fs", "rid": 23, "fs": "remove", "path": "/tenantq/work"},
        {"op": "egress", "rid": 30},
        {"op": "hand_over"},
        {"op": "hand_over", "rid": 31, "argv": [py, "-I", "-S", "-c", _python_touch(dirs, tag, "hand_over")],
         "env": {"TQHO_INJECTED": tag}},
        {"op": "quiesce", "rid": 32},
        {"op": "resume", "forget": True},
        # the agent's own events, in case a host reader still takes them
        {"event": "ready", "pid": 1},
        {"event": "reply", "rid": 0, "ok": True},
        {"event": "reply", "rid": 1, "ok": True, "data": b64},
        {"event": "started", "id": 1, "pid": 2},
        {"event": "out", "id": 1, "fd": 1, "data": base64.b64encode(FORGED.encode()).decode()},
        {"event": "exit", "id": 1, "status": 0, "dropped": [0, 0]},
        {"event": "protocol_error", "error": FORGED},
        # the batch protocol, host to guest (a new batch, secrets, jobs) ...
        {"op": "batch", "ttl": 5, "job_uid": 0, "tenant": "acme"},
        {"ACME_TOKEN": FORGED, "TQHO_INJECTED": tag},
        {"op": "job", "seq": 0, "job": {"id": job_id, "kind": "adv.echo", "payload": {"n": 1}, "attempt": 1,
                                        "max_attempts": 1, "actor": FORGED, "meta": {}}},
        *({"op": "cancel", "seq": seq} for seq in range(0, 8)),
        {"op": "end"},
    ]
    # ... and guest to host: job ends for every plausible sequence number
    # (siblings' included), a batch end, boot records
    return b"".join(encode(r) for r in records) + forged_frames(job_id)


def _socket_paths() -> list[str]:
    """Every Unix socket this job can name: files under the directories it
    can see (scratch and /tenantq, /run, /var/run, /dev) and what
    /proc/net/unix lists (abstract ones as '@name')."""
    found: set[str] = set()
    deadline = time.monotonic() + 2.0
    code_mounts = set(mount_points())
    for top in ("/tenantq", "/run", "/var/run", "/dev", "/tmp"):
        stack = [top]
        while stack and time.monotonic() < deadline and len(found) < 200:
            current = stack.pop()
            try:
                entries = list(os.scandir(current))
            except OSError:
                continue
            for entry in entries:
                with contextlib.suppress(OSError):
                    mode = entry.stat(follow_symlinks=False).st_mode
                    if stat.S_ISSOCK(mode):
                        found.add(entry.path)
                    elif stat.S_ISDIR(mode) and entry.path not in code_mounts and entry.path != "/dev/fd":
                        stack.append(entry.path)
    with contextlib.suppress(OSError):
        with open("/proc/net/unix") as fh:
            for line in fh.read().splitlines()[1:]:
                parts = line.split()
                if len(parts) >= 8:
                    found.add(parts[7])
    return sorted(found)[:200]


def _talk_socket(path: str, frames: bytes) -> str:
    """Connect, send agent and batch frames, and report what came back
    (an agent would answer `ready` on connect, and reply to fs ops)."""
    address = "\0" + path[1:] if path.startswith("@") else path
    out = []
    for kind in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET, socket.SOCK_DGRAM):
        try:
            sock = socket.socket(socket.AF_UNIX, kind)
        except OSError:
            continue
        with sock:
            sock.settimeout(0.5)
            try:
                sock.connect(address)
            except OSError as exc:
                out.append(f"{kind.name}: connect {errname(exc.errno or 0)}")
                continue
            sent = 0
            with contextlib.suppress(OSError):
                sent = sock.send(frames[:65536])
            got = b""
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline and len(got) < 4096:
                try:
                    chunk = sock.recv(4096)
                except (TimeoutError, OSError):
                    break
                if not chunk:
                    break
                got += chunk
            out.append(f"{kind.name}: CONNECTED sent {sent}; got {len(got)} bytes {got[:300]!r}")
    return "; ".join(out)


def _evidence(tag: str, host_dir: str) -> list[str]:
    """Files the forged frames asked for, wherever this job can look."""
    seen = []
    for directory in ("/tmp", "/tenantq/work", host_dir):
        with contextlib.suppress(OSError):
            seen += [f"{directory}/{n}" for n in os.listdir(directory) if n.startswith(PWNED)]
    return seen


@tenantq.handler("ho.talk", timeout=30, memory_mb=256)
def talk(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """Rule C1: find an agent and command it. Agent ops, agent events and
    batch records (forged `job_end`s for every sibling's plausible sequence
    number) to every descriptor this job holds, to every /proc/PID/fd/* (and
    task fds) it can open, and to every Unix socket it can name; then watch
    for anything it asked for to happen."""
    tag, host_dir = payload["tag"], payload["host_dir"]
    frames = agent_frames(tag, host_dir, ctx.job_id)
    blob = frames + b"\n\x00" * 64 + frames
    before = facts()
    own: dict[str, str] = {}
    for fd in range(1024):
        if fd == RESULT_FD and not payload.get("result_fd"):
            continue
        if is_open(fd):
            own[str(fd)] = write_nonblocking(fd, blob)
    proc: dict[str, str] = {}
    me = os.getpid()
    for pid in pids():
        if pid == me:
            continue
        bases = [f"/proc/{pid}/fd"]
        with contextlib.suppress(OSError):
            bases += [f"/proc/{pid}/task/{t}/fd" for t in os.listdir(f"/proc/{pid}/task")]
        for base in bases:
            try:
                names = os.listdir(base)
                proc[base] = f"listed {len(names)}"
            except OSError as exc:
                proc[base] = errname(exc.errno or 0)
                names = [str(n) for n in range(8)]  # try them blind
            for name in names:
                path = f"{base}/{name}"
                for label, flags in (("w", os.O_WRONLY | os.O_NONBLOCK), ("r", os.O_RDONLY | os.O_NONBLOCK),
                                     ("rw", os.O_RDWR | os.O_NONBLOCK)):
                    try:
                        fd = os.open(path, flags)
                    except OSError as exc:
                        if exc.errno != 2:  # ENOENT: no such fd
                            proc[f"{path}:{label}"] = errname(exc.errno or 0)
                        continue
                    try:
                        proc[f"{path}:{label}"] = use_reopened(fd, frames)
                    finally:
                        os.close(fd)
    sockets = {path: _talk_socket(path, frames) for path in _socket_paths()}
    # anything that took those frames had two seconds to act on them
    deadline = time.monotonic() + 2.0
    evidence = _evidence(tag, host_dir)
    while not evidence and time.monotonic() < deadline:
        select.select([], [], [], 0.05)
        evidence = _evidence(tag, host_dir)
    after = facts()
    return {"tqho": "talk", "job_id": ctx.job_id, "own": own, "proc": proc, "sockets": sockets,
            "evidence": evidence, "before": before, "after": after,
            "injected_env": os.environ.get("TQHO_INJECTED"), "pid1_environ": _environ_of(1)}


# -- attacks 2 and 3: leave something behind, look for another tenant's --------------------


def _writable_dirs() -> list[str]:
    """Directories outside the scratch space where this job can create a file."""
    found = []
    candidates = [*CANDIDATE_DIRS, *(m for m in mount_points() if m.startswith(("/tenantq", "/run", "/var")))]
    for directory in dict.fromkeys(candidates):
        if directory in SCRATCH_DIRS or not os.path.isdir(directory):
            continue
        probe = os.path.join(directory, f".tqho-probe-{os.getpid()}")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError:
            continue
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)
        found.append(directory)
    return found


@tenantq.handler("ho.leave", timeout=30, memory_mb=256)
def leave(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """Leaves, for whoever runs next in this sandbox: files holding its tag
    and its own secrets in every scratch dir, under the read-only code mounts
    in /tmp and in every other directory it can write; daemons (double fork,
    setsid, a respawner, an exec'd sleep) rewriting files with its secrets;
    System V and POSIX IPC objects; its secrets and tag in its environment."""
    tag, base = payload["tag"], int(payload["ipc_key"])
    secrets = "\n".join(f"{k}={v}" for k, v in ctx.env.items())
    writable = _writable_dirs()
    made: dict[str, str] = {}
    for directory in (*SCRATCH_DIRS, *writable, os.getcwd()):
        for name in (f"{tag}-secrets", f".{tag}-hidden", f"{tag}-dir/sub/secrets"):
            path = os.path.join(directory, name)
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as fh:
                    fh.write(f"{tag}\n{secrets}\n")
                os.chmod(path, 0o644)
                made[path] = "ok"
            except OSError as exc:
                made[path] = errname(exc.errno or 0)
    # /dev's own symlinks, where /dev is writable: a later job's writes to
    # /dev/stdout (or /dev/stderr) would land in a file of this job's
    dev_swaps: dict[str, str] = {}
    if "/dev" in writable:
        for name in ("stdout", "stderr"):
            captured = f"/dev/{tag}-captured-{name}"
            try:
                with open(captured, "w"):
                    pass
                os.chmod(captured, 0o666)
                os.symlink(captured, f"/dev/.{tag}-swap")
                os.replace(f"/dev/.{tag}-swap", f"/dev/{name}")
                dev_swaps[name] = f"ok: -> {os.readlink(f'/dev/{name}')}"
            except OSError as exc:
                dev_swaps[name] = errname(exc.errno or 0)
    os.environ["TQHO_LEFT"] = tag
    os.environ["TQHO_LEFT_SECRETS"] = secrets.replace("\n", ";")
    out: dict[str, Any] = {"tqho": "leave", "job_id": ctx.job_id, "made": made, "writable": writable,
                           "dev_swaps": dev_swaps,
                           "writable_statvfs": {d: statvfs(d) for d in writable},
                           "ipc": leftovers._ipc(base), "processes": leftovers._spawn_orphans(tag),
                           "own_env_keys": sorted(ctx.env)}
    # the daemons keep heartbeat files in /tmp (their names hold the tag):
    # wait until they are up, so that they are running when the job ends
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len([p for p in others() if "tqadv" in describe_pid(p)]) < 3:
        select.select([], [], [], 0.02)
    out["alive_at_end"] = [describe_pid(p) for p in others()]
    out["facts"] = facts()
    return out


def _files_with_heads(top: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for rel in walk(top, 200):
        path = os.path.join(top, rel)
        try:
            if os.path.isfile(path) and not os.path.islink(path):
                out[rel] = _read(path, 300)
            else:
                out[rel] = "(not a regular file)"
        except OSError as exc:
            out[rel] = f"ERR {errname(exc.errno or 0)}"
    return out


def _tree(top: str, depth: int = 3) -> dict[str, str]:
    """A read-only host-owned tree (/tenantq but the work dir): names and the
    heads of small regular files."""
    out: dict[str, str] = {}
    stack = [(top, 0)]
    while stack and len(out) < 200:
        current, level = stack.pop()
        try:
            entries = list(os.scandir(current))
        except OSError as exc:
            out[current + "/"] = f"ERR {errname(exc.errno or 0)}"
            continue
        for entry in entries:
            if entry.path == "/tenantq/work":
                continue
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError as exc:
                out[entry.path] = f"ERR {errname(exc.errno or 0)}"
                continue
            if stat.S_ISDIR(mode):
                out[entry.path + "/"] = "dir"
                if level < depth:
                    stack.append((entry.path, level + 1))
            elif stat.S_ISREG(mode):
                out[entry.path] = _read(entry.path, 300) if os.stat(entry.path).st_size < 4096 else "(large)"
            else:
                out[entry.path] = "socket" if stat.S_ISSOCK(mode) else "other"
    return out


def _readable_fds(pid: int) -> dict[str, str]:
    """What the non-pipe descriptors of `pid` that this job can reopen
    read-only hold (the runner's stderr, docs/security.md: an inert one).
    Pipes are not read: they are the control channel, and reading one
    would be an attack of its own (ho.talk's)."""
    out: dict[str, str] = {}
    links = _fd_links(pid)
    if not isinstance(links, dict):
        return {"": links}
    for name, target in links.items():
        if target.startswith(("pipe:", "ERR")) or name in ("0", "1"):
            continue
        try:
            fd = os.open(f"/proc/{pid}/fd/{name}", os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            out[name] = f"{target}: ERR {errname(exc.errno or 0)}"
            continue
        try:
            data = os.pread(fd, 16384, 0)
            out[name] = f"{target}: {len(data)} bytes: {data[-2000:].decode(errors='replace')}"
        except OSError as exc:
            out[name] = f"{target}: read ERR {errname(exc.errno or 0)}"
        finally:
            os.close(fd)
    return out


def _dev_links() -> dict[str, str]:
    """The symlinks in /dev and where they point (/dev/stdout -> /proc/self/fd/1 ...)."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/dev"):
            if entry.is_symlink():
                with contextlib.suppress(OSError):
                    out[entry.name] = os.readlink(entry.path)
    return out


@tenantq.handler("ho.look", timeout=30, memory_mb=256)
def look(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """Everything a job can see of whoever ran in this sandbox before it:
    its environment and ctx.env, every process's /proc environ and command
    line, the scratch dirs and every other writable directory with the heads
    of the files in them, /tenantq, what the runner's and the supervisor's
    readable descriptors hold, IPC objects and abstract sockets. The test
    looks for the other tenant's secrets and tags in it."""
    base = int(payload.get("ipc_key", 0))
    environs = {str(p): _environ_of(p) for p in pids() if p != os.getpid()}
    unix: list[str] = []
    with contextlib.suppress(OSError):
        with open("/proc/net/unix") as fh:
            unix = [line.split()[-1] for line in fh.read().splitlines()[1:] if len(line.split()) >= 8][:100]
    writable = _writable_dirs()
    return {
        "tqho": "look", "job_id": ctx.job_id, "tenant": ctx.tenant,
        "env": {k: _short(v, 300) for k, v in os.environ.items()}, "ctx_env": dict(ctx.env),
        "environs": environs, "others": [describe_pid(p) for p in others()],
        "scratch": {d: _files_with_heads(d) for d in (*SCRATCH_DIRS, os.getcwd()) if os.path.isdir(d)},
        "writable": {d: _files_with_heads(d) for d in writable},
        "tenantq_tree": _tree("/tenantq"), "dev_links": _dev_links(),
        "runner_fds": _readable_fds(1), "supervisor_fds": _readable_fds(os.getppid()),
        "ipc": leftovers.ipc_seen(base) if base else {}, "unix_sockets": unix,
        "facts": facts(),
    }
