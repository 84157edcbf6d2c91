"""The Sandbox API (docs/sandbox-api.md) under attack from inside its own
sandboxes (docs/security.md, rule S1, with H1, H3 and H4), on both drivers.

Written from the promise and the guest-visible surface only (guest/agent.py,
guest/agent_files.py, guest/protocol.py, the public `Sandbox` signatures):
the attacker controls every command the API runs and has read the agent.

Each test runs its host side (the process calling the Sandbox API) in a
subprocess of its own, inside a 1 GiB memory cgroup (tests/adversarial/host.py)
and under a wall-clock bound, so a regression takes down that process and not
the machine; the subprocess measures its own peak RSS (VmHWM, reset through
/proc/self/clear_refs once its sandboxes are up) and every host call is made
in a thread with a deadline, so a hang is reported, not waited for. The
subprocess writes a JSON report; the test asserts it holds no problem, and
checks the host marker, the host's files and the processes itself.

1. paths: symlinks to the host marker (absolute, climbing, through
   /proc/1/root), its dir, the victim dir, /etc/shadow, every host file of
   the data dir, /dev/zero and /dev/urandom, a self-loop, a FIFO with a writer,
   a bound socket, a 100 GiB sparse file, a growing file, 4,000 long names,
   names that are not UTF-8, a dir 1,200 deep; then every `filesystem` call
   on them and through them. No host file is read, written or created.
2. forged frames: a command prints protocol frames on its own output; under
   gVisor (where a command can open the agent's /proc/1/fd/1) a daemon writes
   forged `exit`/`out`/`reply` frames, unknown events and ids, a header of
   10 GB, a frame at and over the limit, non-JSON, non-base64, a truncated
   frame and garbage into the agent's stdout, or steals the agent's frames.
   The host never hangs, stays bounded, keeps its own timeout (a forged exit
   after the timeout changes nothing), and a bystander sandbox of the same
   process never notices. A forged exit *before* the timeout is the guest's
   claim (rule S1): it is reported as a note, not failed.
3. floods: 200 MB on stdout (twice the host side's memory-growth limit,
   200 times the cap) and 50 MB on stderr, 100 MB on both at once, binary
   output, 100,000 two-byte writes, a tiny cap, an orphan holding the pipes,
   and a background flood while other execs run.
4. TTL: commands write/chmod/rename the deadline file, ptrace the agent, start
   daemons (setsid, signals ignored), spin on the CPU, fill /tmp, and send the
   agent SIGSTOP/SIGTSTP/SIGTTIN/SIGTTOU (last: a stopped agent answers
   nothing); in a second sandbox the host reads
   a file the guest made a FIFO (docs' /work/output.json), which blocks the
   agent itself. Each sandbox is gone (not listed, no host process) within
   TTL_GRACE_SECONDS of its deadline, and the FIFO read returns within
   HANG_SECONDS.
5. isolation: two sandboxes of one process (and a fork child on gVisor): /proc,
   /tmp, /dev/shm, abstract and path Unix sockets, System V shm, the control
   dir, kill(-1); nothing crosses.
6. secrets: visible to commands; in no host file under the data dir (a watcher
   scans it every 50 ms throughout, and inflates gVisor checkpoint images, so
   a fork's image of the parent's memory counts), in no fresh file under /tmp,
   /var/tmp, /dev/shm, /run, and in no host process's command line or
   environment.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import json
import os
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.adversarial import host_side
from tests.adversarial.host import HANG_SECONDS, MIB, Host, Marker, MemoryCgroup, Outcome, short
from tests.adversarial.host_side import show
from tests.sandbox.conftest import processes_mentioning
from tests.sandbox_api.conftest import data_dir, driver_name  # noqa: F401

# a sandbox must be gone (unlisted, no host process) this long after its deadline
TTL_GRACE_SECONDS = 10.0
TTL_SECONDS = 12.0
DEFAULT_CAP = 1 << 20
FORGED = "tqadv-forged"
PWN = "tqadv-pwn"

# -- the host side, in a memory-limited subprocess (tests/adversarial/host.py) ------


def run_host_side(attack: str, args: dict[str, Any], *, cgroup: MemoryCgroup, tmp_path: Path,
                  timeout: float = 165.0) -> dict[str, Any]:
    """Run ATTACKS[attack](**args) in a subprocess inside `cgroup`; its report."""
    return host_side.run_host_side("tests.adversarial.test_sandbox_api", attack, args, cgroup=cgroup,
                                   tmp_path=tmp_path, timeout=timeout)


def child_main(args_file: str, report_file: str) -> None:
    args = json.loads(Path(args_file).read_text())
    Host(Path(report_file)).run(ATTACKS, args)
    sys.stdout.flush()
    sys.stderr.flush()
    # a daemon thread may still be blocked in a host call: do not wait for it
    os._exit(0)


# -- guest code (runs inside the sandbox; python3 from the host's /usr) ---------------

GUEST_PLANT = r"""
import json, os, socket, sys
marker, victim, data = sys.argv[1:4]
host_files = json.loads(sys.argv[4])
base = "/work/tqadv"
os.makedirs(base, exist_ok=True)
links = {"marker": marker, "marker_dir": os.path.dirname(marker), "victim": victim, "data": data,
         "climb": "../" * 16 + marker.lstrip("/"), "proc_root_marker": "/proc/1/root" + marker,
         "shadow": "/etc/shadow", "zero": "/dev/zero", "urandom": "/dev/urandom", "self": base + "/self",
         "proc_cwd": "/proc/1/cwd", "root": "/"}
links.update({f"host{i}": p for i, p in enumerate(host_files)})
for name, target in links.items():
    os.symlink(target, os.path.join(base, name))
os.mkfifo(base + "/fifo_writer")
sock = socket.socket(socket.AF_UNIX)
sock.bind(base + "/sock")
with open(base + "/huge", "wb") as f:
    try:
        f.truncate(100 << 30)
    except OSError:
        f.truncate(4 << 30)
    huge = os.fstat(f.fileno()).st_size
os.mkdir(base + "/many")
for i in range(4000):
    open(f"{base}/many/{'n' * 200}{i:05d}", "w").close()
os.mkdir(base + "/weird")
for name in [b"line\nbreak", b"\xff\xfe-not-utf8", b'quote"back\\slash', b"ansi\x1b[31m-tab\t"]:
    open(os.path.join(base.encode() + b"/weird", name), "w").close()
os.mkdir(base + "/deep")
fd = os.open(base + "/deep", os.O_RDONLY)
for _ in range(1200):
    os.mkdir("d", dir_fd=fd)
    nfd = os.open("d", os.O_RDONLY, dir_fd=fd)
    os.close(fd)
    fd = nfd
print(json.dumps({"huge": huge, "links": len(links)}))
"""

# keeps rewriting a file that grows 64 KiB at a time, up to 32 MiB, from the start
GUEST_GROW = r"""
import os
fd = os.open("/work/tqadv/grow", os.O_WRONLY | os.O_CREAT, 0o644)
chunk = b"g" * 65536
while True:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, 0)
    for _ in range(512):
        os.write(fd, chunk)
"""

# writes raw frames (guest/protocol.py framing) where it is told; argv:
# variant, delay (s) before writing, ids (JSON), then "stay" to keep running
GUEST_FORGE = r"""
import base64, errno, json, os, sys, threading, time
variant, delay, ids, stay = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4] == "stay"
FORGED = "tqadv-forged"
MAX = (1 << 20) + (64 << 10)

def raw(body):
    return b"%010d\n" % len(body) + body

def frame(obj):
    return raw(json.dumps(obj).encode())

b64 = base64.b64encode(FORGED.encode() * 8).decode()
exits = b"".join(frame({"event": "exit", "id": i, "status": 0, "dropped": [0, 0]}) for i in ids)
outs = b"".join(frame({"event": "out", "id": i, "fd": 1, "data": b64}) for i in ids)
frames = {
    "own_output": exits + outs + b"9999999999\n",
    "exit_ok": outs + exits,
    "unknown_event": frame({"event": "tqadv-bogus", "id": 1, "data": b64}),
    "unknown_id": frame({"event": "exit", "id": 987654321, "status": 0, "dropped": [0, 0]})
                  + frame({"event": "reply", "rid": 987654321, "ok": True, "data": b64, "size": 1}),
    "bad_b64": b"".join(frame({"event": "out", "id": i, "fd": 1, "data": "!!not*base64!!"}) for i in ids),
    "huge_header": b"9999999999\n" + b"{" * 65536,
    "max_frame": b"%010d\n" % MAX + b"[" * MAX,
    "over_max": b"%010d\n" % (MAX + 1) + b"{" * 4096,
    "not_json": raw(b"{not json at all" + b"\xff" * 100) + raw(b'{"event": "exit", "id": 1, "status": NaN}')
                + raw(b"[1, 2, 3]"),
    "truncated": b"%010d\n" % 1000 + b'{"event": "out", "id": ',
}

def report(what):
    print(json.dumps(what), flush=True)

def open_agent_out():
    try:
        return os.open("/proc/1/fd/1", os.O_WRONLY | os.O_CLOEXEC), "opened"
    except OSError as exc:
        return None, f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror}"

if variant == "own_output":
    os.write(1, frames["own_output"])
    os.write(2, frames["own_output"])
    report({"own_output": True})
    sys.exit(3)

fd, how = open_agent_out()
proc_fds = {}
for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
        continue
    with __import__("contextlib").suppress(OSError):
        for name in os.listdir(f"/proc/{pid}/fd"):
            path = f"/proc/{pid}/fd/{name}"
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                proc_fds[path] = "WRITABLE"
            except OSError as exc:
                proc_fds[path] = errno.errorcode.get(exc.errno, str(exc.errno))
report({"agent_out": how, "pid": os.getpid(), "proc_fds": proc_fds})
if fd is not None:
    os.close(fd)
if variant == "probe" or how != "opened":
    sys.exit(0 if not stay else 5)

if os.fork() == 0:  # the forger: out of the command's process group, so a timeout kill misses it
    os.setsid()
    if os.fork():
        os._exit(0)
    null = os.open("/dev/null", os.O_RDWR)
    for i in (0, 1, 2):
        os.dup2(null, i)
    time.sleep(delay)
    if variant in ("steal", "garbage"):
        def drain(path):
            try:
                f = os.open(path, os.O_RDONLY)
            except OSError:
                return
            while True:
                os.read(f, 1 << 16)
        if variant == "steal":
            for path in ("/proc/1/fd/1", "/proc/1/fd/0"):
                threading.Thread(target=drain, args=(path,), daemon=True).start()
            time.sleep(600)
        out = os.open("/proc/1/fd/1", os.O_WRONLY)
        end = time.monotonic() + 8
        junk = os.urandom(1 << 16)
        while time.monotonic() < end:
            os.write(out, junk)
        time.sleep(600)
    out = os.open("/proc/1/fd/1", os.O_WRONLY)
    data = frames[variant]
    view = memoryview(data)
    while view:
        view = view[os.write(out, view[:65536]):]
    time.sleep(600)
    os._exit(0)
os.wait()
if stay:
    time.sleep(60)
"""

GUEST_TTL_STALL = r"""
import contextlib, ctypes, errno, json, os, signal, sys, time
rep = {}
argv = open("/proc/1/cmdline", "rb").read().split(b"\0")
rep["init"] = [a.decode(errors="replace") for a in argv if a]
deadline = argv[argv.index(b"--deadline-file") + 1].decode() if b"--deadline-file" in argv else None
rep["deadline_file"] = deadline

def attempt(name, fn):
    try:
        fn()
        rep[name] = "WORKED"
    except Exception as exc:
        rep[name] = f"{type(exc).__name__}: {exc}"[:160]

def overwrite(path, mode):
    with open(path, mode) as f:
        f.write("99999999999")

if deadline:
    attempt("read_deadline", lambda: rep.__setitem__("deadline", open(deadline).read()))
    attempt("write_deadline", lambda: overwrite(deadline, "w"))
    attempt("append_deadline", lambda: overwrite(deadline, "a"))
    attempt("chmod_deadline", lambda: os.chmod(deadline, 0o666))
    attempt("utime_deadline", lambda: os.utime(deadline, (0, 0)))
    attempt("rename_deadline", lambda: os.rename(deadline, deadline + ".x"))
    attempt("unlink_deadline", lambda: os.unlink(deadline))
    attempt("new_file_in_control_dir", lambda: overwrite(os.path.dirname(deadline) + "/deadline.tqadv", "w"))
    attempt("symlink_in_control_dir", lambda: os.symlink("/work/x", os.path.dirname(deadline) + "/tqadv"))
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]

def ptrace(request, pid):
    if libc.ptrace(request, pid, None, None) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))

attempt("ptrace_seize_agent", lambda: ptrace(0x4206, 1))
attempt("ptrace_interrupt_agent", lambda: ptrace(0x4207, 1))
attempt("ptrace_attach_agent", lambda: ptrace(16, 1))

def agent_state():
    with contextlib.suppress(OSError):
        return [l.strip() for l in open("/proc/1/status") if l.startswith(("State", "TracerPid"))]

# report first (the agent forwards it), then stop the agent: SIGINT would end it, the
# opposite of keeping the sandbox alive
print(json.dumps(rep), flush=True)
time.sleep(1)
for sig in (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
    attempt(f"kill_agent_{sig.name}", lambda sig=sig: os.kill(1, sig))
time.sleep(0.2)
print(json.dumps({"after_stop_signals": agent_state()}), flush=True)
"""

# daemons that outlive their command (own session, signals ignored): 4 spin, 6 sleep; then 24 MiB
# in /tmp. Few: measured here, under gVisor 14 or more such loops (about 30 processes) end the
# whole sandbox at once ("the guest closed its channel"), which ends it early, not late
GUEST_TTL_BOMB = r"""
i=0
while [ $i -lt 10 ]; do
    if [ $i -lt 4 ]; then body='while :; do :; done'; else body='while :; do sleep 5; done'; fi
    setsid sh -c "trap '' HUP INT TERM QUIT USR1 USR2; $body" </dev/null >/dev/null 2>&1 &
    i=$((i + 1))
done
head -c 25165824 /dev/zero > /tmp/tqadv-fill && echo "daemons $i, /tmp filled"
"""

GUEST_HOLDER = r"""
import contextlib, ctypes, os, select, socket, sys
token = sys.argv[1]
for d in ("/tmp", "/dev/shm", "/work"):
    with contextlib.suppress(OSError):
        os.makedirs(d, exist_ok=True)
        with open(f"{d}/tqadv-A-{token}", "w") as f:
            f.write(token)
libc = ctypes.CDLL(None, use_errno=True)
shmid = libc.shmget(0x7451AD, 4096, 0o1666)
listeners = []
for address in ("\0tqadv-" + token, f"/tmp/tqadv-sock-{token}"):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(address)
    s.listen(64)
    listeners.append(s)
count = 0
with open("/work/holder-conns", "w") as f:
    f.write("0")
with open("/work/holder-ready", "w") as f:
    f.write(str(shmid))
while True:
    ready, _, _ = select.select(listeners, [], [])
    for s in ready:
        conn, _ = s.accept()
        conn.close()
        count += 1
        with open("/work/holder-conns", "w") as f:
            f.write(str(count))
"""

GUEST_PROBE = r"""
import contextlib, ctypes, errno, json, os, signal, socket, sys
token, secret, a_id, a_pid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
needles = [token.encode(), secret.encode(), a_id.encode()]
rep = {"hits": [], "pids": []}

def err(exc):
    return errno.errorcode.get(getattr(exc, "errno", None), type(exc).__name__)

for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
        continue
    rep["pids"].append(int(pid))
    for what in ("cmdline", "environ", "maps", "mountinfo", "status"):
        with contextlib.suppress(OSError):
            data = open(f"/proc/{pid}/{what}", "rb").read()
            if any(n in data for n in needles):
                rep["hits"].append(f"/proc/{pid}/{what}")
for path in ("/proc/net/unix", "/proc/mounts", "/proc/self/mountinfo"):
    with contextlib.suppress(OSError):
        if any(n in open(path, "rb").read() for n in needles):
            rep["hits"].append(path)
for path in (f"/tmp/tqadv-A-{token}", f"/dev/shm/tqadv-A-{token}", f"/work/tqadv-A-{token}",
             f"/tmp/tqadv-sock-{token}"):
    if os.path.lexists(path):
        rep["hits"].append(path)
for address in ("\0tqadv-" + token, f"/tmp/tqadv-sock-{token}"):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(address)
        rep["hits"].append(f"connected to {address!r}")
    except OSError as exc:
        rep[f"connect {address!r}"] = err(exc)
    finally:
        s.close()
libc = ctypes.CDLL(None, use_errno=True)
shmid = libc.shmget(0x7451AD, 0, 0)
rep["sysv_shmget"] = shmid if shmid >= 0 else errno.errorcode.get(ctypes.get_errno())
if shmid >= 0:
    rep["hits"].append(f"System V shm key 0x7451AD is visible (id {shmid})")
argv = open("/proc/1/cmdline", "rb").read().split(b"\0")
control = None
if b"--deadline-file" in argv:
    control = os.path.dirname(argv[argv.index(b"--deadline-file") + 1].decode())
rep["control_dir"] = control
seen = []
for top in filter(None, {control, "/tenantq", "/tenantq/egress", "/run", "/"}):
    for dirpath, dirnames, filenames in os.walk(top):
        if dirpath.startswith(("/proc", "/sys", "/usr", "/dev")) or dirpath.count("/") > 3:
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            seen.append(path)
            if a_id in name or token in name:
                rep["hits"].append(f"name {path}")
            with contextlib.suppress(OSError):
                if name.endswith(".sock") or __import__("stat").S_ISSOCK(os.lstat(path).st_mode):
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.settimeout(2)
                    try:
                        s.connect(path)
                        rep.setdefault("connected", []).append(path)
                    except OSError as exc:
                        rep.setdefault("refused", []).append(f"{path}: {err(exc)}")
                    finally:
                        s.close()
rep["control_entries"] = sorted(p for p in seen if control and p.startswith(control))
try:
    os.kill(a_pid, 0)
    rep["kill_0_a_pid"] = "exists (a process of this sandbox with the same number)"
except OSError as exc:
    rep["kill_0_a_pid"] = err(exc)
print(json.dumps(rep), flush=True)
with contextlib.suppress(OSError):
    os.kill(-1, signal.SIGKILL)
"""


# -- 1. paths ------------------------------------------------------------------------


def attack_paths(h: Host, driver: str, marker: str, victim: str, data: str, leaks: list[str]) -> None:
    sbx = h.create("paths", driver=driver)
    fs = sbx.filesystem
    base = "/work/tqadv"
    # every host file this sandbox has under the data dir, as the attacker would guess them
    host_files = sorted(str(p) for p in Path(data).rglob("*") if p.is_file() and not p.is_symlink())[:40]
    host_bytes = {}
    for p in host_files:
        with contextlib.suppress(OSError):
            host_bytes[p] = Path(p).read_bytes()[:1 << 20]
    h.start_memory()
    plant = sbx.run(["python3", "-c", GUEST_PLANT, marker, victim, data, json.dumps(host_files)],
                    timeout_seconds=120)
    if not h.expect(plant.ok, f"planting failed: {plant.reason}: {plant.stderr[-1500:]}"):
        return
    huge = json.loads(plant.stdout.strip().splitlines()[-1])["huge"]
    h.step(f"planted ({huge >> 30} GiB sparse file, {len(host_files)} host-file links)")
    writer = sbx.exec(["sh", "-c", f"exec 3>{base}/fifo_writer; sleep 600"], background=True)
    grower = sbx.exec(["python3", "-c", GUEST_GROW], background=True)
    leak_bytes = [s.encode() for s in leaks if s]

    def check_data(out: Outcome, max_bytes: int) -> None:
        if isinstance(out.value, bytes):
            for secret in leak_bytes:
                h.expect(secret not in out.value, f"rule H1: {out.label} returned host content "
                                                  f"({secret[:24]!r}...)")
            for path, content in host_bytes.items():
                h.expect(not content or out.value[:len(content)] != content,
                         f"rule H1: {out.label} returned the content of the host file {path}")
            h.expect(len(out.value) <= max_bytes, f"{out.label}: returned {len(out.value)} bytes, over "
                                                  f"max_bytes={max_bytes}")

    def read(label: str, path: str, max_bytes: int = 64 * MIB) -> Outcome:
        out = h.bounded(label, lambda: fs.read(path, max_bytes=max_bytes))
        check_data(out, max_bytes)
        h.note(f"read {label}: {out.describe()}")
        return out

    def call(label: str, fn: Callable[[], Any]) -> Outcome:
        out = h.bounded(label, fn)
        h.note(f"{label}: {out.describe()}")
        return out

    for name in ("marker", "climb", "proc_root_marker", "marker_dir", "victim/canary", "shadow", "self",
                 "sock", "fifo_writer", "data", "proc_cwd", "root", "marker_dir/marker",
                 *(f"host{i}" for i in range(len(host_files)))):
        read(name, f"{base}/{name}")
    # absolute host paths too: they must not exist in the sandbox
    for path in (marker, f"{victim}/canary", *host_files[:5]):
        read(f"host path {path}", path)
    for name in ("marker", "climb", "proc_root_marker", "victim/canary", "shadow", "data", "sock",
                 "fifo_writer"):
        call(f"exists {name}", lambda name=name: fs.exists(f"{base}/{name}"))
    h.expect(call("exists(victim/canary)", lambda: fs.exists(f"{base}/victim/canary")).value is not True,
             "rule H1: the host's victim/canary exists through a guest symlink")
    h.expect(call("exists(host marker)", lambda: fs.exists(marker)).value is not True,
             "rule H1: the host marker's path exists inside the sandbox")

    # listings: through links to host dirs, and of the planted dirs themselves
    host_names = {"marker_dir": {"marker"}, "victim": {"canary"}, "data": set(os.listdir(data))}
    for name, names in host_names.items():
        out = call(f"list {name}", lambda name=name: fs.list(f"{base}/{name}"))
        if out.ok:
            seen = {e.name for e in out.value}
            h.expect(not (seen & names), f"rule H1: listing {base}/{name} shows host names {seen & names}")
    out = call("list planted dir", lambda: fs.list(base))
    if out.ok:
        kinds = {e.name: e.type for e in out.value}
        for link in ("marker", "victim", "data", "zero", "self", "shadow"):
            h.expect(kinds.get(link) == "symlink", f"list: {link} is listed as {kinds.get(link)!r}, not a "
                                                   f"symlink (symlinks are not followed)")
        sizes = {e.name: e.size for e in out.value}
        h.note(f"list planted dir: types {kinds.get('fifo_writer')}/{kinds.get('sock')}/{kinds.get('huge')}, "
               f"huge size {sizes.get('huge')}")
    out = call("list 4000 long names", lambda: fs.list(f"{base}/many"))
    if out.ok:
        h.expect(len(out.value) <= 4000, f"list returned {len(out.value)} entries for 4000 files")
    call("list non-UTF-8 names", lambda: [e.name for e in fs.list(f"{base}/weird")])
    call("list 1200 deep", lambda: fs.list(f"{base}/deep/" + "d/" * 1199))

    # sizes: /dev/zero never ends, the sparse file is 100 GiB, the growing file changes under the read
    read("zero (max 4 MiB)", f"{base}/zero", 4 * MIB)
    read("urandom (max 4 MiB)", f"{base}/urandom", 4 * MIB)
    read("/dev/zero (max 4 MiB)", "/dev/zero", 4 * MIB)
    read("huge (max 1 MiB)", f"{base}/huge", MIB)
    read("grow (max 8 MiB)", f"{base}/grow", 8 * MIB)
    h.check_memory("paths: reads")
    # the promise: a read costs the host at most max_bytes, whatever the file's size. Measured
    # here: a refused 64 MiB read peaks at 1.5-2.5x that (base64 and copies), so the bound is on
    # the order of max_bytes, not of the 100 GiB the file claims
    big_limit = 3 * 64 * MIB
    for label, path in (("huge (default max_bytes, 64 MiB)", f"{base}/huge"),
                        ("zero (default max_bytes, 64 MiB)", f"{base}/zero")):
        out = read(label, path)
        h.expect(out.error is not None, f"{label}: a read over the default max_bytes was not refused")
        h.check_memory(f"paths: {label}", limit=big_limit)
    h.note(f"ODDITY: a default-max read of the 100 GiB file (the agent's first reply says its size) "
           f"streams 64 MiB before it is refused: it took the host "
           f"{h.memory.get('paths: huge (default max_bytes, 64 MiB)')} of peak RSS")

    # writes, dirs and removes through the links: they happen in the sandbox or fail
    for name in ("marker", "climb", "proc_root_marker", "marker_dir/tqadv-pwn", "victim/tqadv-pwn",
                 "victim/canary", "data/tqadv-pwn", "sock", "self", "shadow",
                 *(f"host{i}" for i in range(len(host_files)))):
        call(f"write {name}", lambda name=name: fs.write(f"{base}/{name}", PWN.encode()))
    for path in (marker, f"{victim}/{PWN}", f"{data}/{PWN}", f"/usr/{PWN}", f"/usr/lib/{PWN}"):
        call(f"write host path {path}", lambda path=path: fs.write(path, PWN))
    for name in ("victim/tqadv-pwn-dir", "data/tqadv-pwn-dir", "marker_dir/tqadv-pwn-dir"):
        call(f"make_dir {name}", lambda name=name: fs.make_dir(f"{base}/{name}"))
    call("make_dir /usr/tqadv-pwn-dir", lambda: fs.make_dir(f"/usr/{PWN}-dir"))
    for name in ("victim/canary", "marker_dir/marker", "data/sandboxes", "host0", "marker", "victim"):
        call(f"remove {name}", lambda name=name: fs.remove(f"{base}/{name}"))
    h.check_memory("paths: writes")
    writer.kill()
    grower.kill()

    # depth: the agent recurses (os.makedirs, shutil.rmtree); whatever it does, the host gets an
    # answer, and at worst this sandbox breaks
    call("make_dir 100 more below 1200 deep", lambda: fs.make_dir(f"{base}/deep/" + "d/" * 1200 + "x/" * 100))
    removed = call("remove the 1300-deep tree", lambda: fs.remove(f"{base}/deep"))
    alive = call("exists / after the deep remove", lambda: fs.exists("/"))
    if not alive.ok:
        h.note(f"ODDITY: remove() of a guest-planted 1300-deep tree ended the sandbox: {removed.describe()}; "
               f"then {alive.describe()}; is_running={sbx.is_running()}")
    h.check_memory("paths: deep remove")
    # a path the host itself writes, 1500 parents deep (no attacker needed)
    other = h.create("paths-deep-write", driver=driver)
    wrote = call("write under 1500 new parents",
                 lambda: other.filesystem.write("/work/q/" + "q/" * 1500 + "f", "x"))
    alive = call("exists / after the deep write", lambda: other.filesystem.exists("/"))
    if not alive.ok:
        h.note(f"ODDITY: write() of a path 1500 new dirs deep ended the sandbox: {wrote.describe()}; then "
               f"{alive.describe()}")
    h.check_memory("paths: deep write")


# -- 2. forged frames ------------------------------------------------------------------

# (name, frames to forge, exec timeout_seconds, delay before the forger writes, the command stays
# running). Ids: the host numbers a link's commands 1, 2, ... (observed); the forging exec is the
# sandbox's second, so the forged frames name id 2, its own
FORGE_VARIANTS = [
    ("late_exit", "exit_ok", 2.0, 4.0, True),     # forged exit 0 after the host's own timeout fired
    ("early_exit", "exit_ok", 4.0, 0.5, True),    # forged exit 0 while the command still runs
    ("unknown_event", "unknown_event", 3.0, 0.3, True),
    ("unknown_id", "unknown_id", 3.0, 0.3, True),
    ("bad_b64", "bad_b64", 3.0, 0.3, True),
    ("huge_header", "huge_header", 3.0, 0.3, True),
    ("max_frame", "max_frame", 3.0, 0.3, True),
    ("over_max", "over_max", 3.0, 0.3, True),
    ("not_json", "not_json", 3.0, 0.3, True),
    ("truncated", "truncated", 3.0, 0.3, True),
    ("garbage", "garbage", 10.0, 0.3, False),
    ("steal", "steal", 10.0, 0.3, False),
]
OWN_ID = 2


def attack_forge(h: Host, driver: str) -> None:
    bystander = h.create("bystander", driver=driver)
    ticker = bystander.exec(["sh", "-c", "while :; do echo tick; sleep 0.2; done"], background=True,
                            output_cap=4096)
    h.start_memory()

    def bystander_ok(when: str) -> None:
        out = h.bounded(f"bystander after {when}",
                        lambda: bystander.run("echo still-here", timeout_seconds=20))
        h.expect(out.ok and out.value.ok and out.value.stdout == "still-here\n",
                 f"a bystander sandbox of the same process broke after {when}: {out.describe()}")

    # the command's own output: protocol-looking bytes are its data
    sbx = h.create("forge-own", driver=driver)
    ids = list(range(0, 12))
    out = h.bounded("own_output", lambda: sbx.run(["python3", "-c", GUEST_FORGE, "own_output", "0",
                                                   json.dumps(ids), "no"], timeout_seconds=20))
    if out.ok:
        r = out.value
        h.expect(r.exit_code == 3 and r.reason == "exit code 3",
                 f"frames printed by a command changed its result: {r.reason!r} exit {r.exit_code}")
        h.expect("9999999999" in r.stdout and '"event": "exit"' in r.stdout and "9999999999" in r.stderr,
                 f"the forged frames a command printed are not its output: {r.stdout[:200]!r}")
    after = h.bounded("own_output: next exec", lambda: sbx.run("echo after", timeout_seconds=20))
    h.expect(after.ok and after.value.stdout == "after\n", f"after own_output: {after.describe()}")
    probe = h.bounded("probe /proc/1/fd/1", lambda: sbx.run(["python3", "-c", GUEST_FORGE, "probe", "0", "[]",
                                                             "no"], timeout_seconds=30))
    report = json.loads(probe.value.stdout.splitlines()[0]) if probe.ok and probe.value.stdout else {}
    opened = report.get("agent_out") == "opened"
    writable = sorted(p for p, v in report.get("proc_fds", {}).items() if v == "WRITABLE")
    h.note(f"a command opening the agent's /proc/1/fd/1 for writing: {report.get('agent_out')}; "
           f"writable /proc/*/fd: {writable}")
    sbx.delete()
    bystander_ok("own_output")
    if not opened:
        h.note("the agent's stdout cannot be reopened from a command here: no frame can be injected")
        variants = []
    else:
        variants = FORGE_VARIANTS
    # the bystander answers throughout, while the attacked sandboxes break (4 at a time)
    stop = threading.Event()
    bystander_runs: list[str] = []

    def watch_bystander() -> None:
        while not stop.wait(0.5):
            out = h.bounded("bystander exec", lambda: bystander.run("echo still-here", timeout_seconds=20))
            bystander_runs.append("ok" if out.ok and out.value.ok and out.value.stdout == "still-here\n"
                                  else out.describe())

    watcher = threading.Thread(target=watch_bystander, daemon=True)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        for future in [pool.submit(forge_variant, h, driver, *v) for v in variants]:
            out = h.bounded("variant", future.result, seconds=120)
            if out.error is not None:
                h.problem(f"a forge variant raised {type(out.error).__name__}: {out.error}")
    stop.set()
    watcher.join(timeout=30)
    bystander_ok("every forge variant")
    bad = [r for r in bystander_runs if r != "ok"]
    h.expect(not bad, f"the bystander sandbox failed while its siblings were attacked: {bad[:3]}")
    h.note(f"bystander: {len(bystander_runs)} execs during the attacks, {len(bad)} failed")
    killed = ticker.kill()
    result = h.bounded("bystander ticker wait", lambda: ticker.wait(timeout=30))
    h.expect(killed is True, f"the bystander's background ticker had ended early (kill() -> {killed})")
    if result.ok:
        lines = set(result.value.stdout.splitlines())
        h.expect(lines <= {"tick"}, f"the bystander's output holds something else: {sorted(lines)[:5]}")
    h.check_memory("forged frames")


def forge_variant(h: Host, driver: str, variant: str, frames: str, timeout: float, delay: float,
                  stay: bool) -> None:
    sbx = h.create(f"forge-{variant}", driver=driver)
    pre = sbx.run("echo pre", timeout_seconds=20)
    h.expect(pre.ok, f"{variant}: a first exec failed: {pre.reason}")
    started = time.monotonic()
    out = h.bounded(f"{variant}: forging exec", lambda: sbx.run(
        ["python3", "-c", GUEST_FORGE, frames, str(delay), json.dumps([OWN_ID]), "stay" if stay else "no"],
        timeout_seconds=timeout))
    what = out.describe() if not out.ok else (f"reason {out.value.reason!r} exit {out.value.exit_code}")
    report: dict[str, Any] = {}
    with contextlib.suppress(ValueError, IndexError, AttributeError):
        report = json.loads(out.value.stdout.splitlines()[0])
    if out.ok and variant == "late_exit":
        h.expect(out.value.reason.startswith("timeout after"),
                 f"late_exit: the host's own timeout (2 s) was overridden: {what}")
    h.expect(out.seconds <= timeout + 10,
             f"{variant}: the exec with timeout {timeout} s took {out.seconds:.1f} s")
    if out.ok and variant == "early_exit" and out.value.reason == "ok":
        alive = h.bounded("early_exit: is the command still running", lambda: sbx.run(
            f"kill -0 {report.get('pid')} && echo still-running", timeout_seconds=10))
        h.note(f"FINDING early_exit: a forged exit status 0, written into the agent's stdout 0.5 s after the "
               f"command started, was taken as the command's exit: {what} after {out.seconds:.1f} s "
               f"(timeout 4 s); the command (pid {report.get('pid')}) then: {alive.describe()}")
    # the forger writes `delay` after the command started: the next calls come after that
    wait = started + delay + 1.0 - time.monotonic()
    if wait > 0:
        threading.Event().wait(wait)
    follow = h.bounded(f"{variant}: next exec", lambda: sbx.run("echo after", timeout_seconds=5), seconds=40)
    fs_follow = h.bounded(f"{variant}: next file op", lambda: sbx.filesystem.exists("/"), seconds=40)
    running = h.bounded(f"{variant}: is_running", sbx.is_running, seconds=20)
    h.note(f"forge {variant}: forging exec {what} ({out.seconds:.1f} s); next exec {follow.describe()}; "
           f"next fs op {fs_follow.describe()}; is_running {running.describe()}")
    if follow.ok:
        h.expect(FORGED not in follow.value.stdout, f"{variant}: forged output reached a later command")
    h.expect(follow.seconds <= 15, f"{variant}: the next exec (timeout 5 s) took {follow.seconds:.1f} s")
    deleted = h.bounded(f"{variant}: delete", sbx.delete, seconds=40)
    h.expect(not deleted.hung, f"{variant}: delete hung")


# -- 3. floods -------------------------------------------------------------------------


def attack_floods(h: Host, driver: str) -> None:
    from tenantq.errors import InvalidInput

    sbx = h.create("floods", driver=driver)
    h.start_memory()

    def run(label: str, cmd: Any, **kwargs: Any) -> Any:
        out = h.bounded(label, lambda: sbx.run(cmd, **{"timeout_seconds": 120, **kwargs}), seconds=150)
        h.note(f"{label}: {out.describe() if not out.ok else repr(out.value.reason)} in {out.seconds:.1f} s")
        if not h.expect(out.ok, f"{label}: {out.describe()}"):
            return None
        return out.value

    r = run("200 MB stdout, then 50 MB stderr",
            "yes tqadv-flood-line | head -c 200000000; yes tqadv-err | head -c 50000000 >&2")
    if r is not None:
        h.expect(r.ok, f"200 MB flood: reason {r.reason!r}")
        h.expect(r.stdout == ("tqadv-flood-line\n" * 70000)[:DEFAULT_CAP] and r.stdout_truncated,
                 f"200 MB flood: stdout kept {len(r.stdout)} chars, truncated={r.stdout_truncated} "
                 f"(want the first {DEFAULT_CAP} bytes and the flag)")
        h.expect(r.stderr == ("tqadv-err\n" * 120000)[:DEFAULT_CAP] and r.stderr_truncated,
                 f"50 MB stderr: kept {len(r.stderr)} chars, truncated={r.stderr_truncated}")
    h.check_memory("200 MB flood")
    r = run("100 MB on both streams at once",
            "(yes e | head -c 100000000 >&2) & yes o | head -c 100000000; wait")
    if r is not None:
        h.expect(len(r.stdout) == DEFAULT_CAP and len(r.stderr) == DEFAULT_CAP and r.stdout_truncated
                 and r.stderr_truncated, f"both streams: kept {len(r.stdout)}/{len(r.stderr)}, truncated "
                                         f"{r.stdout_truncated}/{r.stderr_truncated}")
    r = run("50 MB of random bytes", "head -c 50000000 /dev/urandom")
    if r is not None:
        h.expect(r.stdout_truncated and len(r.stdout) <= DEFAULT_CAP,
                 f"binary flood: kept {len(r.stdout)} chars, truncated={r.stdout_truncated}")
    chunks: list[int] = []
    r = run("100,000 two-byte writes",
            ["python3", "-c", "import os\nfor _ in range(100000):\n    os.write(1, b'x\\n')"],
            on_stdout=lambda text: chunks.append(len(text)))
    if r is not None:
        h.expect(r.ok and r.stdout == "x\n" * 100000 and not r.stdout_truncated,
                 f"tiny writes: {r.reason!r}, kept {len(r.stdout)} chars (want 200000)")
        h.expect(sum(chunks) == len(r.stdout), f"on_stdout got {sum(chunks)} chars, stdout {len(r.stdout)}")
        h.note(f"tiny writes: on_stdout called {len(chunks)} times")
    chunks.clear()
    r = run("cap 100", "yes | head -c 10000000", output_cap=100,
            on_stdout=lambda text: chunks.append(len(text)))
    if r is not None:
        h.expect(r.stdout == "y\n" * 50 and r.stdout_truncated and sum(chunks) == 100,
                 f"output_cap=100: kept {r.stdout[:120]!r}, truncated={r.stdout_truncated}, "
                 f"callbacks {sum(chunks)}")
    over = h.bounded("output_cap over 64 MiB", lambda: sbx.run("true", output_cap=(64 << 20) + 1))
    h.note(f"output_cap=64 MiB + 1: {over.describe()}")
    h.expect(isinstance(over.error, InvalidInput), f"output_cap over its 64 MiB maximum: {over.describe()}")
    # an orphan keeps the command's pipes open and floods into them
    r = run("orphan holding the pipes", "setsid sh -c 'yes tqadv-orphan' & sleep 0.5; exit 7",
            timeout_seconds=30)
    if r is not None:
        h.expect(r.exit_code == 7 and r.reason == "exit code 7" and len(r.stdout) <= DEFAULT_CAP,
                 f"a command whose orphan floods its pipes: {r.reason!r}, kept {len(r.stdout)}")
    h.check_memory("floods")

    # a background flood that never ends, while other execs run in the same sandbox
    bg = sbx.exec("yes tqadv-bg-flood", background=True)
    for i in range(5):
        r = run(f"exec {i} during the background flood", f"echo ok-{i}", timeout_seconds=30)
        if r is not None:
            h.expect(r.ok and r.stdout == f"ok-{i}\n", f"exec {i} during a flood: {r.reason!r} {r.stdout!r}")
    wrote = h.bounded("write during the flood", lambda: sbx.filesystem.write("/work/f", "x" * 100000))
    back = h.bounded("read during the flood", lambda: sbx.filesystem.read("/work/f"))
    h.expect(back.ok and back.value == b"x" * 100000, f"files during a flood: {wrote.describe()} / "
                                                      f"{back.describe()}")
    killed = bg.kill()
    res = h.bounded("wait for the killed flood", lambda: bg.wait(timeout=30))
    h.expect(killed is True and res.ok, f"killing the background flood: kill() -> {killed}, "
                                        f"wait {res.describe()}")
    if res.ok:
        h.note(f"background flood: {res.value.reason!r}, kept {len(res.value.stdout)}, "
               f"truncated {res.value.stdout_truncated}")
        h.expect(len(res.value.stdout) <= DEFAULT_CAP and res.value.stdout_truncated,
                 f"background flood kept {len(res.value.stdout)} chars, "
                 f"truncated={res.value.stdout_truncated}")
    h.check_memory("background flood")


# -- 4. TTL ------------------------------------------------------------------------------


def attack_ttl(h: Host, driver: str, ttl: float) -> None:
    from tenantq import Sandbox

    stall = h.create("ttl-stall", driver=driver, ttl_seconds=ttl, cpus=1.0, memory_mb=512)
    fifo = h.create("ttl-fifo", driver=driver, ttl_seconds=ttl)
    h.start_memory()
    boxes = {"stall": stall, "fifo": fifo}
    infos = {name: h.info(sbx) for name, sbx in boxes.items()}
    for name, info in infos.items():
        if not h.expect(info is not None, f"{name}: Sandbox.list does not list a sandbox just made"):
            return
        away = info.deadline - time.time()
        h.expect(away <= ttl + 1, f"{name}: deadline {away:.1f} s away for a {ttl} s TTL")
        h.expect(bool(processes_mentioning(info.id)), f"{name}: no host process mentions {info.id} (the "
                                                      f"process check below would be vacuous)")
    # the host reads a file the guest made: a FIFO without a writer (the agent blocks opening it)
    planted = fifo.run(["python3", "-c", "import os; os.mkfifo('/work/output.json')"], timeout_seconds=10)
    h.expect(planted.ok, f"mkfifo: {planted.reason} {planted.stderr[-300:]}")
    fifo_read: dict[str, Any] = {}

    def read_fifo() -> None:
        started = time.monotonic()
        try:
            fifo_read["value"] = fifo.filesystem.read_text("/work/output.json")
        except Exception as exc:
            fifo_read["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        fifo_read["seconds"] = time.monotonic() - started

    reader = threading.Thread(target=read_fifo, daemon=True)
    read_started = time.monotonic()
    reader.start()
    # the daemons first (they outlive their command), then the probe, which ends by stopping the agent
    bomb = stall.exec(GUEST_TTL_BOMB, background=True)
    bombed = h.bounded("the daemons' command", lambda: bomb.wait(timeout=ttl / 3), seconds=30)
    h.note(f"ttl-stall daemons: {bombed.describe()}")
    probe = h.bounded("the ttl-stall probe", lambda: stall.run(["python3", "-c", GUEST_TTL_STALL],
                                                               timeout_seconds=4))
    rep: dict[str, Any] = {}
    lines = probe.value.stdout.strip().splitlines() if probe.ok else []
    with contextlib.suppress(ValueError, IndexError):
        rep = json.loads(lines[0])
    h.note(f"ttl-stall probe: {probe.describe() if not probe.ok else repr(probe.value.reason)}; "
           f"{json.dumps(rep)[:2500]}; then {lines[1:]}")
    h.expect(bool(rep), f"the ttl-stall probe did not report: {probe.describe()}")
    for key, value in rep.items():
        if (key.endswith("_deadline") and not key.startswith("read")) or key.endswith("_control_dir") \
                or key.startswith("ptrace"):
            h.expect(value != "WORKED", f"rule S1: a command could {key.replace('_', ' ')} (host-owned, "
                                        f"read-only; the agent is non-dumpable)")
    h.step("attacks running; watching the TTLs")
    gone: dict[str, dict[str, float]] = {name: {} for name in boxes}
    watch_until = max(i.deadline for i in infos.values()) + TTL_GRACE_SECONDS + 5
    while time.time() < watch_until:
        listed = {i.id for i in Sandbox.list(metadata=None)}
        for name, info in infos.items():
            late = time.time() - info.deadline
            if "unlisted" not in gone[name] and info.id not in listed:
                gone[name]["unlisted"] = late
            if "no_process" not in gone[name] and not processes_mentioning(info.id):
                gone[name]["no_process"] = late
        if all(len(g) == 2 for g in gone.values()) and not reader.is_alive():
            break
        threading.Event().wait(0.25)
    h.note(f"seconds past the deadline when gone: {json.dumps(gone)}")
    for name, info in infos.items():
        for what in ("unlisted", "no_process"):
            late = gone[name].get(what)
            gone_text, left_text = {"unlisted": ("left Sandbox.list", "was still listed"),
                                    "no_process": ("had no host process", "still had host processes")}[what]
            h.expect(late is not None and late <= TTL_GRACE_SECONDS,
                     f"TTL: {name} sandbox {info.id} " +
                     (f"{gone_text} only {late:.1f} s after its deadline" if late is not None else
                      f"{left_text} {watch_until - info.deadline:.0f} s past its deadline") +
                     f" (bound {TTL_GRACE_SECONDS:.0f} s)" +
                     (f"; processes {[c[:100] for _, c in processes_mentioning(info.id)][:4]}"
                      if what == "no_process" and late is None else ""))
    # the FIFO read ends with the sandbox (its TTL), or at the latest when the sandbox is deleted;
    # past HANG_SECONDS it would be a hang (measured before: the host gives up after its own 60 s)
    if reader.is_alive():
        h.note(f"the FIFO read was still blocked {time.monotonic() - read_started:.0f} s after it started, "
               f"past the sandbox's deadline; deleting the sandbox")
        deleted = h.bounded("delete() of the sandbox whose agent is blocked", fifo.delete, seconds=30)
        reader.join(timeout=max(1.0, HANG_SECONDS - (time.monotonic() - read_started)))
        h.note(f"delete() while the FIFO read blocks: {deleted.describe()}")
    h.note(f"fifo read: {json.dumps(fifo_read, default=short)[:300]}")
    h.expect(not reader.is_alive(), f"fs.read_text of a FIFO the guest planted (no writer) was still "
                                    f"blocked after {time.monotonic() - read_started:.0f} s")
    h.expect("value" not in fifo_read or fifo_read["value"] == "", "fs.read of a FIFO returned data")
    after = h.bounded("exec after the TTL", lambda: stall.run("echo alive", timeout_seconds=10), seconds=30)
    h.note(f"exec after the TTL: {after.describe() if not after.ok else repr(after.value.reason)}")
    if after.ok:
        h.expect(not after.value.ok and "alive" not in after.value.stdout,
                 f"a command ran in a sandbox past its TTL: {after.value!r}")
    h.check_memory("ttl")


# -- 5. isolation -------------------------------------------------------------------------


def attack_isolation(h: Host, driver: str, token: str, secret: str) -> None:
    a = h.create("iso-a", driver=driver, secrets={"TQADV_A_SECRET": secret})
    b = h.create("iso-b", driver=driver)
    h.start_memory()
    a_id = h.info(a).id
    holder = a.exec(["python3", "-c", GUEST_HOLDER, token], background=True)
    ready = h.bounded("holder ready", lambda: wait_for(lambda: a.filesystem.exists("/work/holder-ready"), 30))
    if not h.expect(ready.ok and ready.value, f"the holder in A did not start: {ready.describe()}"):
        return

    def probe(label: str, sbx: Any) -> dict[str, Any]:
        r = sbx.run(["python3", "-c", GUEST_PROBE, token, secret, a_id, str(holder.pid)], timeout_seconds=60)
        rep: dict[str, Any] = {}
        with contextlib.suppress(ValueError, IndexError):
            rep = json.loads(r.stdout.splitlines()[0])
        h.note(f"{label} probe ({r.reason}): {json.dumps(rep)[:1500]}")
        h.expect(bool(rep), f"{label}: the probe did not report: {r.reason} {r.stderr[-800:]}")
        return rep

    rep = probe("B", b)
    h.expect(not rep.get("hits"), f"isolation: sandbox B reached sandbox A: {rep.get('hits')}")
    h.expect(not rep.get("connected"), f"isolation: B connected to sockets {rep.get('connected')}")

    def a_intact(after: str) -> None:
        alive = a.run(f"kill -0 {holder.pid} && cat /work/holder-conns /tmp/tqadv-A-{token}",
                      timeout_seconds=20)
        h.expect(alive.ok and alive.stdout == f"0{token}",
                 f"isolation: after {after}, A's holder or its files changed: {alive.reason} "
                 f"{alive.stdout!r} {alive.stderr[-300:]!r}")

    a_intact("B's probe and kill(-1)")
    if driver == "gvisor":
        child = a.fork(ttl_seconds=60)
        h.made.append(child)
        h.step(f"forked A: {getattr(a, 'last_fork', None)}")
        a.run("echo parent > /work/tqadv-parent-after-fork", timeout_seconds=20)
        c = child.run(f"kill -KILL -1; echo child > /work/tqadv-child; echo child > /tmp/tqadv-A-{token}; "
                      "cat /work/tqadv-parent-after-fork 2>&1; true", timeout_seconds=20)
        h.expect("parent" not in c.stdout or "No such file" in c.stdout,
                 f"fork: the parent's write after the fork reached the child: {c.stdout!r}")
        h.expect(not a.filesystem.exists("/work/tqadv-child"), "fork: the child's write reached the parent")
        a_intact("the fork child killed everything and rewrote A's files")
        crep = probe("fork child", child)
        h.note(f"fork child hits (its own copy of A's memory and files: expected): {crep.get('hits')}")
        child.delete()
        a_intact("the child's deletion")
    h.expect(holder.kill() is True, "A's holder was not running at the end")
    h.check_memory("isolation")


def wait_for(predicate: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        threading.Event().wait(0.1)
    return False


# -- 6. secrets ---------------------------------------------------------------------------


class DiskWatch(threading.Thread):
    """Scans every file under `root` that is new or changed, every 0.2 s, for
    the needles (the checkpoint image of a fork included): which file held
    which needle."""

    def __init__(self, root: Path, needles: dict[str, bytes]) -> None:
        super().__init__(name="disk-watch", daemon=True)
        self.root, self.needles = root, needles
        self.seen: dict[str, tuple[int, int]] = {}
        self.hits: dict[str, set[str]] = {}
        self.biggest: dict[str, int] = {}
        self.in_ram: set[str] = set()
        self.stop = threading.Event()

    def scan(self) -> None:
        for path in list(self.root.rglob("*")):
            try:
                if path.is_symlink() or not path.is_file():
                    continue
                st = path.stat()
            except OSError:
                continue
            key = (st.st_size, st.st_mtime_ns)
            if self.seen.get(str(path)) == key:
                continue
            if not on_disk(path):
                # the promise is "never to disk" (docs/sandbox-api.md): a fork's
                # image of the parent's memory is a file on a tmpfs (RAM) while
                # the restores read it, and is reported, not judged
                self.in_ram.add(str(path))
                continue
            self.seen[str(path)] = key
            if st.st_size > 1 * MIB:
                self.biggest[str(path)] = max(st.st_size, self.biggest.get(str(path), 0))
            found = file_needles(path, self.needles) | statefile_needles(path, self.needles)
            if found:
                self.hits.setdefault(str(path), set()).update(found)

    def holding(self, name: str) -> list[str]:
        return sorted(p for p, names in self.hits.items() if name in names)

    def run(self) -> None:
        while not self.stop.wait(0.05):
            with contextlib.suppress(OSError):
                self.scan()


def on_disk(path: Path) -> bool:
    """Is the file on a disk filesystem (not tmpfs/ramfs)? By the longest
    mount point of /proc/mounts that holds it."""
    best, fstype = "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            point = fields[1].replace("\\040", " ")
            inside = str(path) == point or str(path).startswith(point.rstrip("/") + "/")
            if inside and len(point) > len(best):
                best, fstype = point, fields[2]
    return fstype not in ("tmpfs", "ramfs")


def file_needles(path: Path, needles: dict[str, bytes]) -> set[str]:
    """The names of the needles the file's bytes hold."""
    overlap = max(len(n) for n in needles.values())
    found: set[str] = set()
    tail = b""
    try:
        with path.open("rb") as f:
            while chunk := f.read(MIB):
                data = tail + chunk
                found.update(name for name, n in needles.items() if n in data)
                tail = data[-overlap:]
    except OSError:
        pass
    return found


def statefile_needles(path: Path, needles: dict[str, bytes]) -> set[str]:
    """A gVisor checkpoint image ("gVisorSF", then flate-compressed chunks):
    the needles its inflated chunks hold."""
    try:
        with path.open("rb") as f:
            if f.read(8) != b"gVisorSF":
                return set()
            data = f.read(256 * MIB)
    except OSError:
        return set()
    found: set[str] = set()
    tail, i = b"", 0
    while i < len(data):
        inflater = zlib.decompressobj(-15)
        window = data[i:i + 2 * MIB]
        try:
            chunk = inflater.decompress(window)
        except zlib.error:
            i += 1
            continue
        if len(chunk) < 1024 or not inflater.eof:
            i += 1
            continue
        blob = tail + chunk
        found.update(name for name, n in needles.items() if n in blob)
        tail = chunk[-256:]
        i += len(window) - len(inflater.unused_data)
    return found


def fresh_files_containing(roots: list[str], needles: dict[str, bytes], since: float,
                           exclude: str) -> list[str]:
    hits = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            if dirpath.startswith(exclude):
                dirnames[:] = []
                continue
            for name in filenames:
                path = Path(dirpath) / name
                try:
                    st = path.lstat()
                except OSError:
                    continue
                if path.is_symlink() or not path.is_file() or st.st_mtime < since or st.st_size > 512 * MIB:
                    continue
                if file_needles(path, needles):
                    hits.append(str(path))
    return hits


def attack_secrets(h: Host, driver: str, token: str, plain: str, control: str, data: str,
                   exclude: str) -> None:
    from tenantq import Sandbox

    since = time.time() - 1
    secret = {"secret": token.encode(), "secret_b64": base64.b64encode(token.encode())}
    # `plain` is an envs= value (allowed on disk); `control` is only ever in a guest process's memory:
    # if a file holds it, that file holds the sandbox's memory, and the secret's absence means something
    watch = DiskWatch(Path(data), {**secret, "plain": plain.encode(), "control": control.encode()})
    watch.start()
    sbx = h.create("secrets", driver=driver, secrets={"TQADV_SECRET": token}, envs={"TQADV_PLAIN": plain})
    h.start_memory()
    r = sbx.run("printenv TQADV_SECRET TQADV_PLAIN", timeout_seconds=20)
    h.expect(r.ok and r.stdout == f"{token}\n{plain}\n", f"the secret is not in a command's environment: "
                                                        f"{r.reason} {r.stdout!r}")
    r = sbx.run(["sh", "-c", 'printf %s "$TQADV_SECRET" > /work/secret; printf %s "$TQADV_SECRET" >&2; '
                 'printf %s "$TQADV_SECRET"'], timeout_seconds=20)
    h.expect(r.stdout == token and r.stderr == token, f"echoing the secret: {r.stdout!r} {r.stderr!r}")
    h.expect(sbx.filesystem.read_text("/work/secret") == token, "the secret written to a sandbox file")
    holder = sbx.exec(["python3", "-c", f"import time\ncontrol = {control!r} * 3\ntime.sleep(300)"],
                      background=True)
    threading.Event().wait(0.5)
    sbx.set_ttl(120)
    if driver == "gvisor":
        # the parent's memory (the agent's env holds the secret) is checkpointed to the host
        forked = h.bounded("fork", lambda: sbx.fork(ttl_seconds=60), seconds=150)
        h.note(f"fork: {forked.describe()}; {getattr(sbx, 'last_fork', None)}")
        if h.expect(forked.ok, f"fork of the secrets sandbox failed: {forked.describe()}"):
            child = forked.value
            h.made.append(child)
            r = child.run("printenv TQADV_SECRET", timeout_seconds=20)
            h.note(f"fork child: the secret in its commands' env: {r.stdout == token + chr(10)}")
            child.delete()
    attached = Sandbox.connect(h.info(sbx).id, timeout_seconds=30)
    try:
        r = attached.run("printenv TQADV_SECRET", timeout_seconds=20)
        h.expect(r.stdout == token + "\n",
                 f"Sandbox.connect: the secret is not in its commands' env: {r.stdout!r}")
    finally:
        attached.close()
    threading.Event().wait(0.5)
    watch.stop.set()
    watch.join(timeout=30)
    watch.scan()
    h.note(f"disk watch: {len(watch.seen)} host files scanned under the data dir; over 1 MiB: "
           f"{watch.biggest}; the envs= value is in {watch.holding('plain')}, the memory-only control in "
           f"{watch.holding('control')}")
    leaked = sorted(set(watch.holding("secret")) | set(watch.holding("secret_b64")))
    h.expect(not leaked, f"secrets: the secret was written to host files under the data dir: {leaked}")
    procs = processes_mentioning(token)
    h.expect(not procs, f"secrets: a host process's command line holds the secret: "
                        f"{[c[:120] for _, c in procs]}")
    environs = []
    for pid, _ in processes_mentioning(data):
        with contextlib.suppress(OSError):
            if token.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                environs.append(pid)
    h.expect(not environs, f"secrets: host sandbox processes hold the secret in their environment: "
                           f"{environs}")
    fresh = fresh_files_containing(["/tmp", "/var/tmp", "/dev/shm", "/run"], secret, since, exclude)
    h.expect(not fresh, f"secrets: the secret is in host files written during the test: {fresh}")
    # the guest's own choice: it writes its secret into the agent's stderr (a host file, if it can)
    r = sbx.run(["sh", "-c", 'printf "%s\\n" "$TQADV_SECRET" > /proc/1/fd/2 && echo wrote'],
                timeout_seconds=20)
    later = [str(p) for p in Path(data).rglob("*") if p.is_file() and file_needles(p, secret)]
    h.note(f"a command writing its own secret to the agent's stderr: {r.reason} {r.stdout.strip()!r} "
           f"{r.stderr.strip()[:100]!r}; host files holding it then: {later}")
    holder.kill()
    h.expect(sbx.delete() is True, "delete() of the secrets sandbox did not return True")
    left = [str(p) for p in Path(data).rglob("*") if p.is_file() and file_needles(p, secret)]
    h.expect(not left, f"secrets: after delete, host files still hold the secret: {left}")
    h.check_memory("secrets")


ATTACKS: dict[str, Callable[..., None]] = {
    "paths": attack_paths, "forge": attack_forge, "floods": attack_floods, "ttl": attack_ttl,
    "isolation": attack_isolation, "secrets": attack_secrets,
}


# -- the tests ----------------------------------------------------------------------------


def host_files_named(text: str, roots: list[Path], deep: list[Path]) -> list[str]:
    """Host paths whose name holds `text`: top level of `roots`, all of `deep`."""
    found = []
    for root in roots:
        with contextlib.suppress(OSError):
            found += [str(root / n) for n in os.listdir(root) if text in n]
    for root in deep:
        for dirpath, dirnames, filenames in os.walk(root):
            found += [os.path.join(dirpath, n) for n in dirnames + filenames if text in n]
    return found


def test_planted_paths_stay_inside_the_sandbox(driver_name: str, data_dir: Path, tmp_path: Path,  # noqa: F811
                                              memory_cgroup: MemoryCgroup, marker: Marker) -> None:
    shadow = Path("/etc/shadow")
    shadow_before = shadow.stat().st_mtime_ns if shadow.exists() else None
    leaks = [*marker.secrets()]
    if shadow.exists():
        leaks += [line for line in shadow.read_text(errors="replace").splitlines() if "$" in line]
    report = run_host_side("paths", {"driver": driver_name, "marker": str(marker.path),
                                     "victim": str(marker.victim), "data": str(data_dir), "leaks": leaks},
                           cgroup=memory_cgroup, tmp_path=tmp_path)
    problems = show(report)
    problems += marker.changes()
    problems += [f"rule H1: a host path named {PWN!r} appeared: {p}" for p in host_files_named(
        PWN, [Path("/"), Path("/usr"), Path("/usr/lib"), Path("/etc"), Path("/root"), Path("/tmp")],
        [tmp_path, data_dir])]
    if shadow_before is not None and shadow.stat().st_mtime_ns != shadow_before:
        problems.append("/etc/shadow changed during the test")
    assert not problems, "\n".join(problems)


def test_forged_agent_frames_break_only_their_own_sandbox(
        driver_name: str, data_dir: Path, tmp_path: Path, memory_cgroup: MemoryCgroup) -> None:  # noqa: F811
    report = run_host_side("forge", {"driver": driver_name}, cgroup=memory_cgroup, tmp_path=tmp_path)
    problems = show(report)
    assert not problems, "\n".join(problems)


def test_output_floods_are_capped_and_cost_the_host_nothing(
        driver_name: str, data_dir: Path, tmp_path: Path, memory_cgroup: MemoryCgroup) -> None:  # noqa: F811
    report = run_host_side("floods", {"driver": driver_name}, cgroup=memory_cgroup, tmp_path=tmp_path)
    problems = show(report)
    assert not problems, "\n".join(problems)


def test_commands_cannot_keep_a_sandbox_past_its_ttl(driver_name: str, data_dir: Path,  # noqa: F811
                                                     tmp_path: Path, memory_cgroup: MemoryCgroup) -> None:
    report = run_host_side("ttl", {"driver": driver_name, "ttl": TTL_SECONDS}, cgroup=memory_cgroup,
                           tmp_path=tmp_path)
    problems = show(report)
    assert not problems, "\n".join(problems)


def test_nothing_crosses_between_sandboxes(driver_name: str, data_dir: Path, tmp_path: Path,  # noqa: F811
                                           memory_cgroup: MemoryCgroup) -> None:
    stamp = uuid.uuid4().hex
    report = run_host_side("isolation", {"driver": driver_name, "token": f"tqadv-iso-{stamp[:12]}",
                                         "secret": f"tqadv-iso-secret-{stamp[12:]}"},
                           cgroup=memory_cgroup, tmp_path=tmp_path)
    problems = show(report)
    assert not problems, "\n".join(problems)


def test_secrets_reach_commands_but_no_host_file(driver_name: str, data_dir: Path, tmp_path: Path,  # noqa: F811
                                                 memory_cgroup: MemoryCgroup) -> None:
    stamp = uuid.uuid4().hex
    work = tmp_path / "harness"
    report = run_host_side("secrets", {"driver": driver_name, "token": f"tqadv-secret-{stamp}",
                                       "plain": f"tqadv-plain-{stamp[:16]}",
                                       "control": f"tqadv-control-{stamp[16:]}", "data": str(data_dir),
                                       "exclude": str(work)},
                           cgroup=memory_cgroup, tmp_path=tmp_path)
    problems = show(report)
    assert not problems, "\n".join(problems)
