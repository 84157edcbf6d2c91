"""The host side and the guest code of tests/adversarial/test_sandbox_api_egress_templates.py:
Sandbox API egress (docs/sandbox-api.md "Egress", docs/egress.md, rule E1) and
templates (docs/sandbox-api.md "Templates", rule S1) attacked from inside.

Written from the docs and the guest-visible surface only (guest/agent.py,
guest/egress.py, the public `Sandbox` signatures). The host side runs in a
subprocess inside a memory cgroup (`child_main`, started by the test), and every
call it makes into the API is bounded by a deadline in a thread of its own, as in
tests/adversarial/test_sandbox_api.py (both use tests/adversarial/host.py's Host).
This module imports no test fixture, so that subprocess starts fast.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.adversarial.host import HANG_SECONDS
from tests.adversarial.host import Host as HostBase

# a sandbox's egress must answer its own allowed request within this long while a
# neighbour floods the proxy
NEIGHBOUR_SECONDS = 15.0
FORBIDDEN = "tqadv-FORBIDDEN-REACHED"
# the host side's interpreter exit (which deletes what the ready pool holds) must end within this
EXIT_SECONDS = 20.0
# a create (0.4 s on bubblewrap, 1-3 s on gVisor here) that has not returned after this long hangs
CREATE_SECONDS = 12.0
EXIT_HUNG = 3
SOCKET_PATH = "/tenantq/egress/proxy.sock"
GUEST_DIR = "/tqadv"
# postgres answers an SSLRequest with one byte, 'N' or 'S'
SSL_REQUEST = b"\x00\x00\x00\x08\x04\xd2\x16\x2f"

# -- guest code (runs inside the sandbox: python3 from the host's /usr, stdlib only) -----

# argv[1]: a JSON file of requests; each goes to the forwarder ($HTTP_PROXY) or
# straight to the proxy socket; prints one JSON list of what came back
GUEST_PROBE = r"""
import base64, concurrent.futures, json, os, socket, sys, time
cfg = json.load(open(sys.argv[1]))
SOCK = "/tenantq/egress/proxy.sock"
proxy = os.environ.get("HTTP_PROXY", "")

def connect(via):
    if via == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(6)
        s.connect(SOCK)
        return s
    host, port = proxy.rsplit("/", 1)[-1].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=6)

def read(s, buf, until, limit, seconds):
    end = time.monotonic() + seconds
    while not until(buf) and len(buf) < limit:
        left = end - time.monotonic()
        if left <= 0:
            return buf, "timeout"
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            return buf, "timeout"
        except OSError as exc:
            return buf, type(exc).__name__
        if not chunk:
            return buf, "closed"
        buf += chunk
    return buf, None

def content_done(head_body):
    head, _, body = head_body.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            try:
                return len(body) >= int(line.split(b":", 1)[1])
            except ValueError:
                return False
    return False

def one(req):
    started = time.monotonic()
    out = {"label": req["label"]}
    try:
        return one_inner(req, out)
    finally:
        out["seconds"] = round(time.monotonic() - started, 2)

def one_inner(req, out):
    try:
        s = connect(req.get("via", "forwarder"))
    except OSError as exc:
        out["error"] = f"connect: {exc}"
        return out
    with s:
        try:
            s.sendall(base64.b64decode(req["data"]))
        except OSError as exc:
            out["error"] = f"send: {exc}"
        buf, why = read(s, b"", lambda b: b"\r\n\r\n" in b, 65536, 3)
        line = buf.split(b"\r\n", 1)[0]
        parts = line.split()
        out["line"] = line[:200].decode("latin-1")
        out["status"] = int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None
        out["why"] = why
        _, _, body = buf.partition(b"\r\n\r\n")
        if out["status"] == 200 and req.get("then"):
            try:
                s.sendall(base64.b64decode(req["then"]))
                body, why = read(s, body, lambda b: content_done(b) or b in (b"N", b"S"), 8192, 3)
            except OSError as exc:
                why = f"tunnel: {exc}"
            out["tunnel_why"] = why
        elif why is None:
            body, _ = read(s, body, lambda b: content_done(buf.partition(b"\r\n\r\n")[0] + b"\r\n\r\n" + b),
                           8192, 1.5)
        out["body"] = body[:400].decode("latin-1")
    return out

with concurrent.futures.ThreadPoolExecutor(4) as pool:
    print(json.dumps(list(pool.map(one, cfg["requests"]))))
"""

# argv[1]: JSON config; what a command can do about its egress without the proxy:
# the egress dir, mounts, the network, other sockets, other sandboxes' secrets
GUEST_LOCAL = r"""
import ctypes, errno, json, os, socket, stat, sys
cfg = json.load(open(sys.argv[1]))
D = "/tenantq/egress"
rep = {"attempts": {}, "net": {}, "listing": {}, "found_other_secret": []}

def err(exc):
    if isinstance(exc, OSError) and exc.errno:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return f"{type(exc).__name__}: {exc}"[:120]

def attempt(name, fn):
    try:
        got = fn()
        rep["attempts"][name] = "WORKED" + ("" if got is None else f" {got}")
    except Exception as exc:
        rep["attempts"][name] = err(exc)

try:
    for name in os.listdir(D):
        st = os.lstat(os.path.join(D, name))
        rep["listing"][name] = {"mode": oct(st.st_mode), "uid": st.st_uid, "size": st.st_size}
except OSError as exc:
    rep["listing"] = err(exc)

def write(path, data="tqadv"):
    with open(path, "w") as f:
        f.write(data)

def bind(path):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(path)
    finally:
        s.close()

attempt("write_new_file", lambda: write(D + "/tqadv-new"))
attempt("unlink_proxy_sock", lambda: os.unlink(D + "/proxy.sock"))
attempt("rename_proxy_sock", lambda: os.rename(D + "/proxy.sock", D + "/proxy.old"))
attempt("symlink_in_dir", lambda: os.symlink("/tmp/tqadv-evil.sock", D + "/tqadv-link"))
attempt("hardlink_in_dir", lambda: os.link("/tqadv/probe.py", D + "/tqadv-hard"))
attempt("chmod_proxy_sock", lambda: os.chmod(D + "/proxy.sock", 0o700))
attempt("bind_socket_in_dir", lambda: bind(D + "/tqadv.sock"))
attempt("mkdir_in_dir", lambda: os.mkdir(D + "/tqadv"))
attempt("rename_egress_dir", lambda: os.rename(D, "/tenantq/egress.tqadv"))
libc = ctypes.CDLL(None, use_errno=True)

def call(fn, *args):
    if fn(*args) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))

attempt("mount_tmpfs_over_egress", lambda: call(libc.mount, b"none", D.encode(), b"tmpfs", 0, None))
attempt("bind_mount_over_egress", lambda: call(libc.mount, b"/tmp", D.encode(), None, 4096, None))
attempt("umount_egress", lambda: call(libc.umount2, D.encode(), 2))

def in_new_namespaces():
    # a child: unshare a user + mount namespace, then mount over the egress dir
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            call(libc.unshare, 0x10000000 | 0x00020000)
            msg = "unshared"
            try:
                call(libc.mount, b"none", D.encode(), b"tmpfs", 0, None)
                msg += "; mounted over the egress dir"
            except OSError as exc:
                msg += "; mount " + err(exc)
        except OSError as exc:
            msg = "unshare " + err(exc)
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    msg = os.read(r, 4096).decode()
    os.close(r)
    if not msg.startswith("unshared"):
        raise OSError(1, msg)
    return msg

attempt("unshare_then_mount", in_new_namespaces)

def tcp(host, port, family=socket.AF_INET):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(1.5)
    try:
        s.connect((host, port))
        ssl_request = b"\x00\x00\x00\x08\x04\xd2\x16\x2f"
        s.sendall(b"GET /tqadv/direct HTTP/1.0\r\n\r\n" if port != 5432 else ssl_request)
        return "CONNECTED " + repr(s.recv(64))
    except OSError as exc:
        return err(exc)
    finally:
        s.close()

for label, host, port, fam in cfg["tcp"]:
    rep["net"][label] = tcp(host, port, socket.AF_INET6 if fam == 6 else socket.AF_INET)

def udp(host, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(1.0)
    try:
        s.sendto(b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03com\x00\x00\x01\x00\x01",
                 (host, port))
        return "REPLY " + repr(s.recv(64))
    except OSError as exc:
        return err(exc)
    finally:
        s.close()

rep["net"]["udp_dns_8.8.8.8"] = udp("8.8.8.8", 53)
rep["net"]["udp_host"] = udp(cfg["host_ip"], cfg["f_port"])

def unix(path):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(1.5)
    try:
        if len(path) > 100:  # too long for sun_path: from its directory
            os.chdir(os.path.dirname(path))
            path = os.path.basename(path)
        s.connect(path)
        s.sendall(b"GET http://127.0.0.1/ HTTP/1.1\r\n\r\n")
        return "CONNECTED " + repr(s.recv(64))
    except OSError as exc:
        return err(exc)
    finally:
        s.close()

rep["net"]["abstract_host_socket"] = unix("\0" + cfg["abstract"])
for i, path in enumerate(cfg["host_sockets"]):
    rep["net"][f"host_socket_{i}"] = unix(path)
    rep["net"][f"host_socket_{i}_via_proc"] = unix("/proc/1/root" + path)
rep["http_proxy"] = os.environ.get("HTTP_PROXY")
rep["own_secret_in_env"] = os.environ.get("TQADV_SECRET") == cfg["own_secret"]
needle = cfg["other_secret"].encode()
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for what in ("environ", "cmdline"):
            try:
                if needle in open(f"/proc/{pid}/{what}", "rb").read():
                    rep["found_other_secret"].append(f"/proc/{pid}/{what}")
            except OSError:
                pass
for root, dirs, files in os.walk("/tenantq"):
    for name in files:
        try:
            with open(os.path.join(root, name), "rb") as f:
                if needle in f.read(1 << 20):
                    rep["found_other_secret"].append(os.path.join(root, name))
        except OSError:
            pass
print(json.dumps(rep))
"""

# argv[1]: JSON config; opens up to n connections to the proxy socket and keeps
# them half-sent (slowloris), streams an endless header on one, 100,000 header
# lines on another, an absurd Content-Length on a third, for `hold` seconds
GUEST_FLOOD = r"""
import json, os, resource, select, socket, sys, time
cfg = json.load(open(sys.argv[1]))
SOCK = "/tenantq/egress/proxy.sock"
p1 = cfg["p1"]
rep = {"connect_errors": {}}
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
except (OSError, ValueError):
    pass
limit = min(cfg["n"], resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 64)
rep["fd_limit"] = resource.getrlimit(resource.RLIMIT_NOFILE)
def special(head):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(2)
    s.connect(SOCK)
    s.setblocking(False)
    s.send(head)
    return s

t0 = time.monotonic()
streams = {}
for name, head, chunk, cap in (
        ("endless_header", f"GET http://127.0.0.1:{p1}/tqadv/a/big HTTP/1.1\r\nX-Big: ".encode(),
         b"a" * 65536, 256 << 20),
        ("header_lines", f"GET http://127.0.0.1:{p1}/tqadv/a/lines HTTP/1.1\r\n".encode(),
         b"".join(b"X-L%05d: v\r\n" % i for i in range(5000)), 100000 * 12),
        ("absurd_content_length", f"POST http://127.0.0.1:{p1}/tqadv/a/clen HTTP/1.1\r\nHost: x\r\n"
         f"Content-Length: 99999999999999999999999999\r\n\r\n".encode(), b"b" * 65536, 8 << 20)):
    try:
        streams[name] = {"sock": special(head), "chunk": chunk, "cap": cap, "sent": 0, "got": b"",
                         "end": None}
    except OSError as exc:
        rep[name] = f"connect: {exc}"
def open_slow(count, tag):
    # up to `count` half-sent heads (a full backlog: EAGAIN, retried for 1.5 s)
    conns, started, last_ok = [], time.monotonic(), time.monotonic()
    while len(conns) < count and time.monotonic() - started < 10 and time.monotonic() - last_ok < 1.5:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(1)
        try:
            s.connect(SOCK)
            s.setblocking(False)
            s.send(f"GET http://127.0.0.1:{p1}/tqadv/a/slow-{tag}-{len(conns)} HTTP/1.1\r\n".encode())
        except OSError as exc:
            rep["connect_errors"][type(exc).__name__] = rep["connect_errors"].get(type(exc).__name__, 0) + 1
            s.close()
            time.sleep(0.05)
            continue
        last_ok = time.monotonic()
        conns.append(s)
    return conns

# more connections than one process may hold: helpers (a few: gVisor ends a sandbox at ~30 tasks)
per = max(1, limit)
children = []
stop_r, stop_w = os.pipe()
for w in range(min(4, max(0, -(-(cfg["n"] - per) // per)))):
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.close(stop_w)
        mine = open_slow(min(per, cfg["n"] - per * (w + 1)), f"w{w}")
        os.write(wfd, str(len(mine)).encode())
        os.close(wfd)
        while not select.select([stop_r], [], [], 1.0)[0]:
            for s in mine:
                try:
                    s.send(b"X-Drip: 1\r\n")
                except OSError:
                    pass
        os._exit(0)
    os.close(wfd)
    children.append((pid, r))
slow = open_slow(min(per, cfg["n"]), "main")
helpers = 0
for pid, r in children:
    got = os.read(r, 64)
    os.close(r)
    helpers += int(got or 0)
rep["opened"] = len(slow) + helpers
rep["helpers"] = len(children)
rep["open_seconds"] = round(time.monotonic() - t0, 2)

open("/tqadv/flood-holding", "w").close()
# poll, not select: there are more than FD_SETSIZE descriptors
closed_by_proxy, answers = 0, {}
live = {s.fileno(): s for s in slow}
by_fd = {st["sock"].fileno(): st for st in streams.values()}
poller = select.poll()
for fd in live:
    poller.register(fd, select.POLLIN)
for fd in by_fd:
    poller.register(fd, select.POLLIN | select.POLLOUT)
end = time.monotonic() + cfg["hold"]
next_drip = time.monotonic() + 1
while time.monotonic() < end:
    for fd, ev in poller.poll(200):
        st = by_fd.get(fd)
        if st is None:
            s = live.pop(fd, None)
            if s is None:
                continue
            poller.unregister(fd)
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if data:
                line = data.split(b"\r\n", 1)[0][:60].decode("latin-1")
                answers[line] = answers.get(line, 0) + 1
            closed_by_proxy += 1
            continue
        if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
            try:
                data = st["sock"].recv(4096)
            except OSError as exc:
                data, st["end"] = b"", type(exc).__name__
            st["got"] += data
            if not data:
                st["end"] = st["end"] or "closed"
                poller.unregister(fd)
                del by_fd[fd]
                continue
        if ev & select.POLLOUT:
            if st["sent"] >= st["cap"]:
                poller.modify(fd, select.POLLIN)
                continue
            try:
                st["sent"] += st["sock"].send(st["chunk"])
            except BlockingIOError:
                pass
            except OSError as exc:
                st["end"] = type(exc).__name__
                poller.unregister(fd)
                del by_fd[fd]
    if time.monotonic() >= next_drip:
        next_drip += 1
        for fd, s in list(live.items()):
            try:
                s.send(b"X-Drip: 1\r\n")
            except BlockingIOError:
                pass
            except OSError:
                poller.unregister(fd)
                del live[fd]
                closed_by_proxy += 1
os.close(stop_w)
for pid, _ in children:
    os.waitpid(pid, 0)
rep["slow_closed_by_proxy"] = closed_by_proxy
rep["slow_answers"] = answers
for name, st in streams.items():
    rep[name] = {"sent_mb": round(st["sent"] / 1048576, 1), "end": st["end"],
                 "answer": st["got"].split(b"\r\n", 1)[0][:80].decode("latin-1")}
    st["sock"].close()
for s in slow:
    s.close()
rep["seconds"] = round(time.monotonic() - t0, 1)
print(json.dumps(rep))
"""

# the template's warmup package (written on the host, copied into the layer):
# a state file on the writable layer and a daemon that holds a value
WARMUP_SOURCE = r'''
"""A template warmup for the adversarial suite."""
import os
import socket
import time

MARK = "{mark}"
STATE = "/opt/tqadv/state"
SOCK = "/opt/tqadv/daemon.sock"


def serve():
    value = "warm-" + MARK
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(SOCK)
    srv.listen(16)
    while True:
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(5)
            try:
                line = conn.recv(4096).decode(errors="replace").strip()
                if line.startswith("SET "):
                    value = line[4:]
                conn.sendall(value.encode())
            except OSError:
                pass


def warm():
    os.makedirs("/opt/tqadv", exist_ok=True)
    with open(STATE, "w") as f:
        f.write("warm-" + MARK)
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork():
            os._exit(0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        try:
            serve()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    deadline = time.monotonic() + 10
    while not os.path.exists(SOCK) and time.monotonic() < deadline:
        time.sleep(0.01)
'''

GUEST_TPL_COMMON = r"""
import contextlib, ctypes, errno, hashlib, importlib, importlib.util, json, os, signal, socket, sys, time
cfg = json.loads(sys.argv[1])
STATE, SOCK = "/opt/tqadv/state", "/opt/tqadv/daemon.sock"

def err(exc):
    if isinstance(exc, OSError) and exc.errno:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return f"{type(exc).__name__}: {exc}"[:120]

def ask(line):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    try:
        s.connect(SOCK)
        s.sendall(line.encode())
        return s.recv(4096).decode(errors="replace")
    except OSError as exc:
        return "ERROR " + err(exc)
    finally:
        s.close()

def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        return "ERROR " + err(exc)

mod = importlib.import_module(cfg["module"])
D = os.path.dirname(mod.__file__)
PY_DIRS = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p and os.path.isdir(p)]

def _mounts():
    found = {}
    with contextlib.suppress(OSError):
        for line in open("/proc/self/mounts"):
            parts = line.split()
            if len(parts) >= 4:
                found[parts[1].replace("\\040", " ")] = "ro" in parts[3].split(",")
    return found

MOUNTS = _mounts()

def read_only(path):
    # the mount it is on (the longest mount point above it): gVisor's statvfs does not say
    path = os.path.realpath(path)
    best = max((m for m in MOUNTS if path == m or path.startswith(m.rstrip("/") + "/")), key=len, default="/")
    return MOUNTS.get(best, False)
"""

# a sibling's view: the state, the daemon, the layer, and any trace of the needles
GUEST_TPL_CHECK = (
    GUEST_TPL_COMMON
    + r"""
rep = {"state": read(STATE), "daemon": ask("GET"), "module_mark": getattr(mod, "MARK", None),
       "module_file": mod.__file__, "pwn_env": os.environ.get("TQADV_PWN"), "hits": []}
with open(mod.__file__, "rb") as f:
    rep["module_sha"] = hashlib.sha256(f.read()).hexdigest()
rep["layer"] = {p: sorted(os.listdir(p)) for p in PY_DIRS}
rep["package"] = sorted(os.listdir(D))
spec = importlib.util.find_spec("sitecustomize")
rep["sitecustomize"] = getattr(spec, "origin", None)
needles = [n.encode() for n in cfg["needles"]]
seen = 0
TOPS = ("/opt", "/tmp", "/root", "/etc", "/var/tmp", "/dev/shm", "/run", "/home", "/srv", "/tenantq/work")
for top in TOPS:
    for root, dirs, files in os.walk(top):
        # nothing of a sandbox can be on a read-only mount (the Python installation, the layer)
        dirs[:] = [d for d in dirs if not MOUNTS.get(os.path.join(root, d), False)]
        for name in files:
            seen += 1
            if seen > 20000:
                break
            path = os.path.join(root, name)
            if any(n in path.encode() for n in needles):
                rep["hits"].append(path)
                continue
            try:
                if not os.path.isfile(path) or os.path.islink(path):
                    continue
                with open(path, "rb") as f:
                    data = f.read(1 << 20)
            except OSError:
                continue
            if any(n in data for n in needles):
                rep["hits"].append(path)
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        for what in ("cmdline", "environ"):
            with contextlib.suppress(OSError):
                if any(n in open(f"/proc/{pid}/{what}", "rb").read() for n in needles):
                    rep["hits"].append(f"/proc/{pid}/{what}")
rep["processes"] = sorted(open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:80]
                          for p in os.listdir("/proc")
                          if p.isdigit() and os.path.exists(f"/proc/{p}/cmdline"))
print(json.dumps(rep))
"""
)

# sandbox 1 of the template: tries to change the template for the next sandboxes
GUEST_TPL_ATTACK = (
    GUEST_TPL_COMMON
    + r"""
tok = cfg["token"]
rep = {"attempts": {}, "own": {}, "pythonpath": [[p, read_only(p)] for p in PY_DIRS]}

def attempt(name, fn):
    try:
        got = fn()
        rep["attempts"][name] = "WORKED" + ("" if got is None else f" {got}")
    except Exception as exc:
        rep["attempts"][name] = err(exc)

def write(path, data, mode="w"):
    with open(path, mode) as f:
        f.write(data)

def replace(path, data):
    write(path + ".tqadv", data)
    os.rename(path + ".tqadv", path)

evil = f"import os\nos.environ['TQADV_PWN'] = {tok!r}\nMARK = {tok!r}\n"
attempt("append_to_module", lambda: write(mod.__file__, "\n" + evil, "a"))
attempt("replace_module", lambda: replace(mod.__file__, evil))
attempt("new_file_in_package", lambda: write(D + "/tqadv_evil.py", evil))
attempt("unlink_module", lambda: os.unlink(mod.__file__))
attempt("rename_package", lambda: os.rename(D, D + ".tqadv"))
attempt("chmod_module", lambda: os.chmod(mod.__file__, 0o777))
attempt("utime_module", lambda: os.utime(mod.__file__, (0, 0)))
attempt("symlink_in_package", lambda: os.symlink("/tmp/tqadv-evil.py", D + "/tqadv_link.py"))
for i, p in enumerate(PY_DIRS):
    attempt(f"sitecustomize_in_pythonpath_{i}", lambda p=p: write(p + "/sitecustomize.py", evil))
    pth = f"import os; os.environ['TQADV_PWN'] = {tok!r}\n"
    attempt(f"pth_in_pythonpath_{i}", lambda p=p: write(p + "/tqadv-evil.pth", pth))
    attempt(f"shadow_stdlib_json_in_pythonpath_{i}", lambda p=p: os.makedirs(p + "/json"))
    attempt(f"package_in_pythonpath_{i}", lambda p=p: os.makedirs(p + "/tqadv_evil_pkg"))
libc = ctypes.CDLL(None, use_errno=True)

def call(fn, *args):
    if fn(*args) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))

os.makedirs("/tmp/tqadv-evil-dir", exist_ok=True)
write("/tmp/tqadv-evil-dir/__init__.py", evil)
attempt("mount_tmpfs_over_package", lambda: call(libc.mount, b"none", D.encode(), b"tmpfs", 0, None))
EVIL_DIR = b"/tmp/tqadv-evil-dir"
attempt("bind_mount_over_package", lambda: call(libc.mount, EVIL_DIR, D.encode(), None, 4096, None))
attempt("remount_layer_rw", lambda: call(libc.mount, None, D.encode(), None, 32 | 4096, None))
attempt("umount_layer", lambda: call(libc.umount2, D.encode(), 2))

def in_new_namespaces():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            call(libc.unshare, 0x10000000 | 0x00020000)
            msg = "unshared"
            try:
                call(libc.mount, b"/tmp/tqadv-evil-dir", D.encode(), None, 4096, None)
                msg += "; bind-mounted over the package"
            except OSError as exc:
                msg += "; mount " + err(exc)
        except OSError as exc:
            msg = "unshare " + err(exc)
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    msg = os.read(r, 4096).decode()
    os.close(r)
    if not msg.startswith("unshared"):
        raise OSError(1, msg)
    return msg

attempt("unshare_then_mount", in_new_namespaces)
# its own writable layer and daemon (must not reach a sibling)
rep["own"]["state"] = (write(STATE, "s1-" + tok), read(STATE))[1]
rep["own"]["daemon"] = ask("SET s1-" + tok)
for path in ("/tmp/tqadv-s1", "/root/tqadv-s1", "/etc/tqadv-s1", "/var/tmp/tqadv-s1", "/dev/shm/tqadv-s1",
             "/opt/tqadv/s1", "/tenantq/work/tqadv-s1"):
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write(path, tok)
# leave a daemon that outlives the command: setsid, ignores SIGTERM/SIGHUP, holds the token
daemon = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          "signal.signal(signal.SIGHUP, signal.SIG_IGN); time.sleep(3600)  # " + tok)
pid = os.fork()
if pid == 0:
    os.setsid()
    if os.fork():
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.execv(sys.executable, [sys.executable, "-c", daemon])
os.waitpid(pid, 0)
print(json.dumps(rep))
"""
)

# -- the host side (tests/adversarial/host.py) ------------------------------------------


class Host(HostBase):
    """The attacked host process (tests/adversarial/host.py's Host), whose creates
    are bounded (a hang raises), and a few calls of its own."""

    error_chars = 200
    show_values = False
    create_seconds = HANG_SECONDS
    gone = "Gone"
    strict = False

    def sandbox_id(self, sbx: Any) -> str | None:
        found = self.info(sbx)
        return str(found.id) if found else None

    def run_json(self, label: str, sbx: Any, argv: list[str], timeout: float = 60) -> Any:
        """A guest script's one line of JSON, or None (a problem says why)."""
        out = self.bounded(label, lambda: sbx.run(argv, timeout_seconds=timeout), timeout + 30)
        if not out.ok:
            self.problem(f"{label}: {out.describe()}")
            return None
        result = out.value
        try:
            return json.loads(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            self.problem(
                f"{label}: the guest script did not report ({result.reason}): "
                f"{result.stdout[-300:]!r} {result.stderr[-1200:]!r}"
            )
            return None

    def write(self, sbx: Any, path: str, text: str) -> bool:
        out = self.bounded(f"write {path}", lambda: sbx.filesystem.write(path, text))
        return self.expect(out.ok, f"writing {path} into a sandbox: {out.describe()}")


def sandbox_ids(data: Path) -> set[str]:
    """Ids of the sandboxes on the host now (their host dirs; the pool's included)."""
    found: set[str] = set()
    with contextlib.suppress(OSError):
        for driver_dir in (data / "sandboxes").iterdir():
            if driver_dir.is_dir() and not driver_dir.name.startswith(("rootfs-", ".rootfs-")):
                found |= {p.name for p in driver_dir.iterdir() if p.name.startswith("tq-")}
    return found


def host_sockets(root: Path) -> list[str]:
    found = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                if os.lstat(path).st_mode & 0o170000 == 0o140000:
                    found.append(path)
    return sorted(found)


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        threading.Event().wait(interval)


# -- egress ----------------------------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def get(target: str, path: str, host: str | None = None, extra: str = "") -> bytes:
    """An absolute-URI GET for a proxy (`target` is host:port as in a URL)."""
    return (
        f"GET http://{target}{path} HTTP/1.1\r\nHost: {host or target}\r\n{extra}Connection: close\r\n\r\n"
    ).encode()


def connect(target: str, extra: str = "") -> bytes:
    return f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{extra}\r\n".encode()


def inner_get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: tunnel\r\nConnection: close\r\n\r\n".encode()


Request = dict[str, Any]


def req(
    label: str,
    data: bytes,
    expect: str,
    *,
    then: bytes | None = None,
    via: str = "forwarder",
    statuses: tuple[int, ...] = (403,),
) -> Request:
    """expect: "ok:<upstream marker>" (a positive control), "deny" (a status in
    `statuses`), "any" (whatever, but never a forbidden listener or Postgres)."""
    return {
        "label": label,
        "data": b64(data),
        "then": b64(then) if then else None,
        "via": via,
        "expect": expect,
        "statuses": list(statuses),
    }


def requests_a(p1: int, p2: int, p3: int, mark_a: str) -> list[Request]:
    """Sandbox A may reach 127.0.0.1:p1 and localhost:p1. p2 is a forbidden
    listener on every host address, p3 is B's upstream, 5432 the host's Postgres."""
    ok = f"ok:{mark_a}"
    a1, a2, a3 = f"127.0.0.1:{p1}", f"127.0.0.1:{p2}", f"127.0.0.1:{p3}"
    pg = "127.0.0.1:5432"
    t = "/tqadv/a"
    return [
        req("control GET 127.0.0.1:p1", get(a1, f"{t}/get"), ok),
        req("control CONNECT 127.0.0.1:p1", connect(a1), ok, then=inner_get(f"{t}/tunnel")),
        req("control GET localhost:p1", get(f"localhost:{p1}", f"{t}/name"), ok),
        req(
            "control CONNECT localhost:p1", connect(f"localhost:{p1}"), ok, then=inner_get(f"{t}/tunnel-name")
        ),
        req("control GET via the socket", get(a1, f"{t}/socket"), ok, via="socket"),
        req("B's upstream GET", get(a3, f"{t}/b-upstream"), "deny"),
        req("B's upstream CONNECT", connect(a3), "deny", then=inner_get(f"{t}/b-tunnel")),
        req("other port GET", get(a2, f"{t}/p2"), "deny"),
        req("other port CONNECT", connect(a2), "deny", then=inner_get(f"{t}/p2-tunnel")),
        req("other port CONNECT by name", connect(f"localhost:{p2}"), "deny", then=inner_get(f"{t}/p2-name")),
        req("other port GET via the socket", get(a2, f"{t}/p2-socket"), "deny", via="socket"),
        req("postgres CONNECT", connect(pg), "deny", then=SSL_REQUEST),
        req("postgres CONNECT by name", connect("localhost:5432"), "deny", then=SSL_REQUEST),
        req("postgres CONNECT via the socket", connect(pg), "deny", then=SSL_REQUEST, via="socket"),
        req("postgres GET", get(pg, f"{t}/pg"), "deny"),
        req("redis CONNECT", connect("127.0.0.1:6379"), "deny", then=b"PING\r\n"),
        req("other name GET", get("example.com", f"{t}/example"), "deny"),
        req("other name CONNECT", connect("pastebin.com:443"), "deny"),
        req("metadata name GET", get("metadata.google.internal", "/computeMetadata/v1/"), "deny"),
        req("metadata address GET", get("169.254.169.254", "/latest/meta-data/"), "deny"),
        # the target is p2 whatever else the request says
        req("CONNECT p2, Host header p1", connect(a2, f"Host: {a1}\r\n"), "deny"),
        req("GET p2, Host header p1", get(a2, f"{t}/host-mismatch", host=a1), "deny"),
        req("CONNECT p1@p2", connect(f"{a1}@{a2}"), "any", then=inner_get(f"{t}/userinfo")),
        req("CONNECT 0-padded p2", connect(f"127.0.0.1:0{p2}"), "any", then=inner_get(f"{t}/pad")),
        req("CONNECT +p2", connect(f"127.0.0.1:+{p2}"), "any", then=inner_get(f"{t}/plus")),
        req("CONNECT p1:p2", connect(f"{a1}:{p2}"), "any", then=inner_get(f"{t}/two-ports")),
        req("CONNECT [127.0.0.1]:p2", connect(f"[127.0.0.1]:{p2}"), "any", then=inner_get(f"{t}/brackets")),
        req("CONNECT trailing dot p2", connect(f"localhost.:{p2}"), "any", then=inner_get(f"{t}/dot")),
        req(
            "CONNECT p2 lowercase method",
            f"connect {a2} HTTP/1.1\r\n\r\n".encode(),
            "any",
            then=inner_get(f"{t}/lower"),
        ),
        req("GET userinfo p1@p2", get(f"{a1}@{a2}", f"{t}/userinfo-get"), "any"),
        req("GET p2#@p1", get(f"{a2}#@{a1}", f"{t}/fragment"), "any"),
        req("GET p2?@p1", get(f"{a2}?@{a1}", f"{t}/query"), "any"),
        req("GET p1\\@p2", get(f"{a1}\\@{a2}", f"{t}/backslash"), "any"),
        req("GET p1:p2", get(f"{a1}:{p2}", f"{t}/two-ports-get"), "any"),
        req(
            "GET HTTP:// uppercase p2",
            f"GET HTTP://{a2}{t}/upper HTTP/1.1\r\nHost: {a2}\r\n\r\n".encode(),
            "any",
        ),
        req("GET https:// p2", f"GET https://{a2}{t}/https HTTP/1.1\r\nHost: {a2}\r\n\r\n".encode(), "any"),
        req("origin-form, Host p2", f"GET {t}/origin HTTP/1.1\r\nHost: {a2}\r\n\r\n".encode(), "any"),
        req("origin-form, Host p1", f"GET {t}/origin-ok HTTP/1.1\r\nHost: {a1}\r\n\r\n".encode(), "any"),
        req("bare LF line ends p2", f"GET http://{a2}{t}/lf HTTP/1.1\nHost: {a2}\n\n".encode(), "any"),
        req(
            "CR-injected Host", f"GET http://{a1}{t}/cr HTTP/1.1\r\nX: a\rHost: {a2}\r\n\r\n".encode(), "any"
        ),
        req(
            "pipelined p1 then p2",
            get(a1, f"{t}/first").replace(b"Connection: close\r\n", b"") + get(a2, f"{t}/pipelined"),
            "any",
        ),
        req(
            "smuggled CL+TE",
            (
                f"POST http://{a1}{t}/smuggle HTTP/1.1\r\nHost: {a1}\r\nContent-Length: 4\r\n"
                f"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            ).encode()
            + get(a2, f"{t}/smuggled"),
            "any",
        ),
        req(
            "CONNECT inside a tunnel", connect(a1), "any", then=connect(a2) + inner_get(f"{t}/inner-connect")
        ),
        req(
            "TLS ClientHello as a request",
            b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + os.urandom(32) + b"\r\n\r\n",
            "deny",
            via="socket",
            statuses=(400, 403),
        ),
        req("no target", b"GET\r\n\r\n", "deny", via="socket", statuses=(400, 403)),
        req("CONNECT without target", b"CONNECT\r\n\r\n", "deny", via="socket", statuses=(400, 403)),
    ]


def e1_targets(p2: int, host_ips: list[str]) -> list[tuple[str, list[tuple[str, bytes, bytes | None]]]]:
    """Rules B is given that name non-global addresses (rule E1 must refuse every
    one), with the requests that use them. The operator's allowed network is
    127.0.0.1/32, so loopback outside it (127.0.0.2, ::1, 0.0.0.0) is not allowed."""
    out: list[tuple[str, list[tuple[str, bytes, bytes | None]]]] = []

    def v4(rule: str, target: str) -> None:
        out.append(
            (
                rule,
                [
                    (f"E1 GET {target}", get(target, "/tqadv/b/e1"), None),
                    (f"E1 CONNECT {target}", connect(target), inner_get("/tqadv/b/e1-tunnel")),
                ],
            )
        )

    def v6(address: str) -> None:
        out.append(
            (
                address,
                [
                    (f"E1 GET [{address}]:80", get(f"[{address}]:80", "/tqadv/b/e1"), None),
                    (f"E1 CONNECT [{address}]:443", connect(f"[{address}]:443"), None),
                ],
            )
        )

    for address in ("127.0.0.2", "0.0.0.0", *[a for a in host_ips if ":" not in a]):
        v4(f"{address}:{p2}", f"{address}:{p2}")
    # names that only getaddrinfo turns into 127.0.0.2 (decimal, hex, short forms)
    for name in ("2130706434", "0x7f000002", "127.2"):
        v4(f"{name}:{p2}", f"{name}:{p2}")
    out.append(
        (
            "169.254.169.254",
            [
                ("E1 GET metadata", get("169.254.169.254", "/latest/meta-data/"), None),
                ("E1 CONNECT metadata", connect("169.254.169.254:443"), None),
            ],
        )
    )
    out.append(
        ("100.100.100.200", [("E1 GET alibaba metadata", get("100.100.100.200", "/latest/meta-data/"), None)])
    )
    for address in ("10.0.0.1", "224.0.0.1", "255.255.255.255"):
        v4(address, f"{address}:80")
    for address in (
        "::1",
        "::",
        "::ffff:127.0.0.2",
        "::ffff:169.254.169.254",
        "::127.0.0.2",
        "2002:a9fe:a9fe::1",
        "64:ff9b::a9fe:a9fe",
        "2001::5601:5601",
        "fe80::1",
        *[a for a in host_ips if ":" in a],
    ):
        v6(address)
    out.append((f"[::1]:{p2}", [(f"E1 CONNECT [::1]:{p2}", connect(f"[::1]:{p2}"), None)]))
    return out


def requests_b(
    p1: int, p3: int, mark_b: str, e1: list[tuple[str, list[tuple[str, bytes, bytes | None]]]]
) -> list[Request]:
    ok = f"ok:{mark_b}"
    b3 = f"127.0.0.1:{p3}"
    reqs = [
        req("control GET 127.0.0.1:p3", get(b3, "/tqadv/b/get"), ok),
        req("control CONNECT 127.0.0.1:p3", connect(b3), ok, then=inner_get("/tqadv/b/tunnel")),
        req("A's upstream GET", get(f"127.0.0.1:{p1}", "/tqadv/b/a-upstream"), "deny"),
        req("A's upstream CONNECT", connect(f"127.0.0.1:{p1}"), "deny", then=inner_get("/tqadv/b/a-tunnel")),
        req("A's upstream by name", connect(f"localhost:{p1}"), "deny", then=inner_get("/tqadv/b/a-name")),
    ]
    for _, items in e1:
        reqs += [req(label, data, "deny", then=then, statuses=(400, 403)) for label, data, then in items]
    return reqs


def requests_child(p1: int, p2: int, p3: int, mark_a: str) -> list[Request]:
    a1 = f"127.0.0.1:{p1}"
    return [
        req("child control GET p1", get(a1, "/tqadv/c/get"), f"ok:{mark_a}"),
        req("child control CONNECT p1", connect(a1), f"ok:{mark_a}", then=inner_get("/tqadv/c/tunnel")),
        req("child B's upstream", get(f"127.0.0.1:{p3}", "/tqadv/c/b-upstream"), "deny"),
        req("child other port", connect(f"127.0.0.1:{p2}"), "deny", then=inner_get("/tqadv/c/p2")),
        req("child postgres", connect("127.0.0.1:5432"), "deny", then=SSL_REQUEST),
        req("child 127.0.0.2", get(f"127.0.0.2:{p2}", "/tqadv/c/e1"), "deny", statuses=(400, 403)),
    ]


def judge(h: Host, who: str, reqs: list[Request], results: Any, marks: dict[str, str]) -> None:
    if not isinstance(results, list):
        return
    by_label = {str(r.get("label")): r for r in results if isinstance(r, dict)}
    for rq in reqs:
        r = by_label.get(rq["label"], {})
        body = str(r.get("body", ""))
        got = (
            f"status {r.get('status')} ({r.get('line', '')!r}, {r.get('why') or r.get('error')}), "
            f"body {body[:120]!r}"
        )
        h.expect(
            FORBIDDEN not in body, f"egress: {who}'s {rq['label']!r} reached a forbidden listener: {got}"
        )
        h.expect(
            body not in ("N", "S"),
            f"egress: {who}'s {rq['label']!r} reached Postgres (it answered an "
            f"SSLRequest with {body!r}): {got}",
        )
        h.expect("PONG" not in body, f"egress: {who}'s {rq['label']!r} reached redis: {got}")
        expect = str(rq["expect"])
        if expect.startswith("ok:"):
            h.expect(
                r.get("status") == 200 and expect[3:] in body,
                f"egress: positive control {who}'s {rq['label']!r} did not reach its allowed upstream "
                f"(the negative results prove nothing without it): {got}",
            )
        elif expect == "deny":
            others = [m for n, m in marks.items() if n != who]
            h.expect(
                r.get("status") in rq["statuses"] and not any(m in body for m in marks.values()),
                f"egress: {who}'s {rq['label']!r} must be refused with {rq['statuses']} "
                f"(docs/egress.md: refusals are 403, malformed requests 400; rule E1), got {got}",
            )
            h.expect(
                not any(m in body for m in others),
                f"egress: {who}'s {rq['label']!r} reached another sandbox's upstream: {got}",
            )
        else:
            others = [m for n, m in marks.items() if n != who]
            h.expect(
                not any(m in body for m in others),
                f"egress: {who}'s {rq['label']!r} reached another sandbox's upstream: {got}",
            )
    slow = [
        f"{r.get('label')} {r.get('seconds')} s ({r.get('why')})"
        for r in results
        if isinstance(r, dict) and float(r.get("seconds") or 0) > 2
    ]
    if slow:
        h.note(f"{who}: slow answers: {slow}")
    refused = [r for r in results if isinstance(r, dict) and r.get("status") == 403]
    if refused:
        h.note(f"{who}: {len(refused)} refusals, e.g. {refused[0].get('line')!r}")


def probe(h: Host, who: str, sbx: Any, reqs: list[Request], marks: dict[str, str]) -> Any:
    name = f"{GUEST_DIR}/probe-{who}-{uuid.uuid4().hex[:6]}.json"
    h.write(sbx, name, json.dumps({"requests": reqs}))
    results = h.run_json(f"{who} probe", sbx, ["python3", f"{GUEST_DIR}/probe.py", name], timeout=90)
    judge(h, who, reqs, results, marks)
    return results


def create_with_rules(h: Host, role: str, rules: list[str], **kwargs: Any) -> tuple[Any, list[str]]:
    """Sandbox.create with `rules`, dropping the ones refused as invalid (a
    stricter syntax than the docs say is not a hole; it is noted)."""
    from tenantq import InvalidInput

    rules = list(rules)
    for _ in range(len(rules) + 1):
        try:
            # refused "before anything is made": a bad rule costs no sandbox
            return h.create(role, egress=rules, **kwargs), rules
        except RuntimeError as exc:
            cause = str(exc)
            if "InvalidInput" not in cause:
                raise
            bad = [
                r
                for r in rules
                if repr(r) in cause or f" {r} " in cause or f"{r}:" in cause or cause.rstrip().endswith(r)
            ]
            if not bad:
                raise
            h.note(f"{role}: egress rule {bad[0]!r} refused at create: {cause[:200]}")
            rules.remove(bad[0])
    raise InvalidInput(f"{role}: every egress rule was refused")


def attack_egress(
    h: Host,
    driver: str,
    p1: int,
    p2: int,
    p3: int,
    marks: dict[str, str],
    secrets: dict[str, str],
    abstract: str,
    host_path: str,
    data: str,
    host_ips: list[str],
    flood_n: int,
    hold: float,
) -> None:
    data_dir = Path(data)
    a = h.create(
        "egress-a",
        driver=driver,
        tenant="tqadv-a",
        secrets={"TQADV_SECRET": secrets["a"]},
        egress=[f"127.0.0.1:{p1}", f"localhost:{p1}"],
    )
    a_id = h.sandbox_id(a)
    for name, code in (("probe.py", GUEST_PROBE), ("local.py", GUEST_LOCAL), ("flood.py", GUEST_FLOOD)):
        h.write(a, f"{GUEST_DIR}/{name}", code)
    h.start_memory()
    probe(h, "a", a, requests_a(p1, p2, p3, marks["a"]), marks)
    # meanwhile the ready pool (TENANTQ_POOL_SIZE=1) booted one more of A's kind (docs: the
    # kind is template, driver, memory_mb, cpus): B, with other rules, may be handed it
    pooled = wait_for(lambda: sandbox_ids(data_dir) - {a_id}, 10)
    h.step(f"pool: {sorted(pooled) if pooled else 'nothing booted in 10 s'}")
    e1 = e1_targets(p2, host_ips)
    b, rules_b = create_with_rules(
        h,
        "egress-b",
        [f"127.0.0.1:{p3}", *[rule for rule, _ in e1]],
        driver=driver,
        tenant="tqadv-b",
        secrets={"TQADV_SECRET": secrets["b"]},
    )
    b_id = h.sandbox_id(b)
    h.note(
        f"B {b_id} {'was handed out by the ready pool' if b_id in (pooled or set()) else 'was booted'}; "
        f"its rules: {rules_b}"
    )
    for name, code in (("probe.py", GUEST_PROBE), ("local.py", GUEST_LOCAL)):
        h.write(b, f"{GUEST_DIR}/{name}", code)
    probe(h, "b", b, requests_b(p1, p3, marks["b"], e1), marks)
    h.step("probes done")

    socks = host_sockets(data_dir)
    h.note(f"host sockets under the data dir told to the guests: {len(socks)}")
    host_ip4 = next((ip for ip in host_ips if ":" not in ip), "127.0.0.1")
    for who, sbx, own, other in (("a", a, secrets["a"], secrets["b"]), ("b", b, secrets["b"], secrets["a"])):
        tcp = [
            ["postgres on the sandbox's loopback", "127.0.0.1", 5432, 4],
            ["A's upstream port on the sandbox's loopback", "127.0.0.1", p1, 4],
            ["forbidden listener, host address", host_ip4, p2, 4],
            ["postgres, host address", host_ip4, 5432, 4],
            ["metadata", "169.254.169.254", 80, 4],
            ["IPv6 loopback postgres", "::1", 5432, 6],
            ["IPv6 loopback forbidden", "::1", p2, 6],
            *[[f"host v6 {ip}", ip, p2, 6] for ip in host_ips if ":" in ip],
        ]
        cfg = {
            "tcp": tcp,
            "host_ip": host_ip4,
            "f_port": p2,
            "abstract": abstract,
            "host_sockets": [*socks, host_path],
            "own_secret": own,
            "other_secret": other,
        }
        name = f"{GUEST_DIR}/local-{who}.json"
        h.write(sbx, name, json.dumps(cfg))
        rep = h.run_json(f"{who} local", sbx, ["python3", f"{GUEST_DIR}/local.py", name])
        if not isinstance(rep, dict):
            continue
        h.note(f"{who} local: {json.dumps(rep)[:2500]}")
        for attempt, result in rep.get("attempts", {}).items():
            if not str(result).startswith("WORKED"):
                continue
            if attempt == "unshare_then_mount" and driver == "gvisor":
                h.note(f"{who}: {attempt}: {result} (gVisor: a namespace of its own, inside the sentry)")
                continue
            h.problem(
                f"egress dir: {who}'s command could {attempt} ({result}): the egress dir is bound "
                f"read-only (docs/sandbox-api.md, Egress; P2 under bubblewrap)"
            )
        for label, result in rep.get("net", {}).items():
            h.expect(
                not str(result).startswith(("CONNECTED", "REPLY")),
                f"egress: {who}'s command reached {label} without the proxy: {result} "
                f"(docs: 'a command that ignores the proxy variables reaches nothing')",
            )
        h.expect(bool(rep.get("http_proxy")), f"egress: {who}'s commands have no HTTP_PROXY")
        h.expect(bool(rep.get("own_secret_in_env")), f"secrets: {who}'s own secret is not in its environment")
        h.expect(
            not rep.get("found_other_secret"),
            f"secrets: {who} found the other sandbox's secret in {rep.get('found_other_secret')}",
        )
    h.check_memory("egress probes")

    # -- a flood of the proxy from A while B uses its own egress --
    flood_cfg = {"n": flood_n, "hold": hold, "p1": p1}
    h.write(a, f"{GUEST_DIR}/flood.json", json.dumps(flood_cfg))
    threads_before = len(os.listdir("/proc/self/task"))
    fds_before = len(os.listdir("/proc/self/fd"))
    flood = h.bounded(
        "start flood",
        lambda: a.exec(
            ["python3", f"{GUEST_DIR}/flood.py", f"{GUEST_DIR}/flood.json"],
            background=True,
            timeout_seconds=hold + 60,
        ),
    )
    if not h.expect(flood.ok, f"flood: {flood.describe()}"):
        return
    holding = h.bounded(
        "flood holding",
        lambda: wait_for(lambda: a.filesystem.exists(f"{GUEST_DIR}/flood-holding"), 30, 0.2),
        40,
    )
    h.expect(holding.ok and bool(holding.value), "flood: the flood never reached its hold phase")
    peak_threads = len(os.listdir("/proc/self/task"))
    peak_fds = len(os.listdir("/proc/self/fd"))
    # a new sandbox of this host process while A holds that many connections to its proxy (a kind
    # the ready pool holds none of: booted now)
    started = time.monotonic()
    try:
        new: Any = h.create("egress-c-during", CREATE_SECONDS, driver=driver, memory_mb=320)
    except RuntimeError as exc:
        new = None
        h.problem(
            f"egress: while A held {peak_fds - fds_before} connections to its egress proxy (the host "
            f"process then had {peak_fds} fds), the host process could not make another sandbox "
            f"({time.monotonic() - started:.1f} s): {exc}"
        )
    if new is not None:
        echo = h.bounded("echo in the new sandbox", lambda: new.run("echo tqadv-ok", timeout_seconds=30))
        h.expect(
            echo.ok and echo.value.ok and "tqadv-ok" in echo.value.stdout,
            f"egress: a sandbox made while A flooded its proxy does not run commands: {echo.describe()}",
        )
    b_ok = [req("B during the flood", get(f"127.0.0.1:{p3}", "/tqadv/b/during"), f"ok:{marks['b']}")]
    h.bounded(
        "write b during",
        lambda: b.filesystem.write(f"{GUEST_DIR}/during.json", json.dumps({"requests": b_ok})),
    )
    started = time.monotonic()
    during = h.run_json(
        "B during A's flood", b, ["python3", f"{GUEST_DIR}/probe.py", f"{GUEST_DIR}/during.json"]
    )
    took = time.monotonic() - started
    judge(h, "b", b_ok, during, marks)
    h.expect(
        took <= NEIGHBOUR_SECONDS,
        f"egress: B's allowed request took {took:.1f} s while A flooded the "
        f"proxy (limit {NEIGHBOUR_SECONDS:.0f} s)",
    )
    h.note(
        f"B's request during A's flood: {took:.1f} s; host-side threads {threads_before} -> {peak_threads}, "
        f"fds {fds_before} -> {peak_fds}"
    )
    done = h.bounded("flood wait", lambda: flood.value.wait(timeout=hold + 90), hold + 100)
    if done.ok:
        result = done.value
        h.note(f"flood ({result.reason}): {result.stdout.strip()[-1500:]} {result.stderr[-500:]}")
        with contextlib.suppress(ValueError, IndexError):
            rep = json.loads(result.stdout.strip().splitlines()[-1])
            h.expect(
                all(
                    isinstance(rep.get(k), dict)
                    for k in ("endless_header", "header_lines", "absurd_content_length")
                ),
                f"flood: the header attacks could not connect: {rep}",
            )
            h.note(f"flood: the proxy took {rep.get('opened')} of {flood_n} half-sent heads at once")
    h.check_memory("egress flood")
    # the proxy survived: both sandboxes' allowed requests work again
    after_a = [req("A after the flood", get(f"127.0.0.1:{p1}", "/tqadv/a/after"), f"ok:{marks['a']}")]
    after_b = [req("B after the flood", get(f"127.0.0.1:{p3}", "/tqadv/b/after"), f"ok:{marks['b']}")]
    probe(h, "a", a, after_a, marks)
    probe(h, "b", b, after_b, marks)
    settled = wait_for(lambda: len(os.listdir("/proc/self/fd")) <= fds_before + 16, 15, 0.2)
    h.note(
        f"host-side fds after the flood: {len(os.listdir('/proc/self/fd'))} (before {fds_before}), "
        f"threads {len(os.listdir('/proc/self/task'))}"
    )
    h.expect(
        bool(settled),
        f"egress: the host process still holds {len(os.listdir('/proc/self/fd'))} fds 15 s "
        f"after the flood ended (before: {fds_before})",
    )

    if driver == "gvisor":
        fork = h.bounded("fork A", lambda: a.fork(ttl_seconds=90))
        if h.expect(fork.ok, f"fork: {fork.describe()}"):
            child = fork.value
            h.made.append(child)
            h.step(f"forked A in {fork.seconds:.1f} s")
            child_marks = {"c": marks["a"], "b": marks["b"]}
            probe(h, "c", child, requests_child(p1, p2, p3, marks["a"]), child_marks)
            gone = h.bounded("delete A", a.delete)
            h.expect(gone.ok, f"delete A: {gone.describe()}")
            probe(
                h,
                "c",
                child,
                [
                    req(
                        "child after the parent's deletion",
                        get(f"127.0.0.1:{p1}", "/tqadv/c/after"),
                        f"ok:{marks['a']}",
                    )
                ],
                child_marks,
            )
    h.check_memory("egress end")


# -- templates ----------------------------------------------------------------------------


def template_list(cli: list[str]) -> dict[str, Any]:
    out = subprocess.run(
        [*cli, "template", "list", "--json"], capture_output=True, text=True, timeout=60, check=False
    )
    try:
        value: dict[str, Any] = json.loads(out.stdout)
    except ValueError:
        return {"error": f"rc {out.returncode}: {out.stdout[-300:]} {out.stderr[-300:]}"}
    return value


def template_view(listing: dict[str, Any], name: str) -> dict[str, Any]:
    """What must not change: the template's entry and its checkpoints (but when they were last used)."""
    entry = [t for t in listing.get("templates", []) if t.get("name") == name]
    points = sorted(
        (
            ({k: v for k, v in c.items() if k != "last_used"})
            for c in listing.get("checkpoints", [])
            if name in str(c.get("of"))
        ),
        key=json.dumps,
    )
    return {"template": entry, "checkpoints": points}


def attack_templates(
    h: Host, driver: str, name: str, module: str, mark: str, tokens: dict[str, str], cli: list[str]
) -> None:
    check = ["python3", "-c", GUEST_TPL_CHECK]

    def args(**extra: Any) -> str:
        return json.dumps({"module": module, **extra})

    def pristine(who: str, rep: Any, needles: list[str], state: bool = True) -> None:
        if not isinstance(rep, dict):
            return
        if state:
            h.expect(
                rep.get("state") == f"warm-{mark}",
                f"template: {who}'s state file is {rep.get('state')!r}, not the warmup's",
            )
            h.expect(
                rep.get("daemon") == f"warm-{mark}",
                f"template: {who}'s warmup daemon answers {rep.get('daemon')!r}, not the warmup's value",
            )
        h.expect(
            rep.get("module_mark") == mark and rep.get("module_sha") == baseline.get("module_sha"),
            f"template: {who} imports a changed warmup module: MARK {rep.get('module_mark')!r}, sha "
            f"{rep.get('module_sha')} (was {baseline.get('module_sha')})",
        )
        h.expect(
            rep.get("layer") == baseline.get("layer") and rep.get("package") == baseline.get("package"),
            f"template: {who}'s layer differs from the first sandbox's before its attack: "
            f"{rep.get('layer')} {rep.get('package')} vs {baseline.get('layer')} {baseline.get('package')}",
        )
        h.expect(
            not rep.get("pwn_env") and rep.get("sitecustomize") == baseline.get("sitecustomize"),
            f"template: code planted by another sandbox ran in {who}: TQADV_PWN={rep.get('pwn_env')!r}, "
            f"sitecustomize {rep.get('sitecustomize')}",
        )
        h.expect(
            not rep.get("hits"), f"template: {who} sees another sandbox's data ({needles}): {rep.get('hits')}"
        )

    s1 = h.create("tpl-s1", driver=driver, template=name, tenant="tqadv-t1", memory_mb=512)
    h.start_memory()
    baseline = h.run_json("s1 baseline", s1, [*check, args(needles=[tokens["s1"]])]) or {}
    h.expect(
        baseline.get("state") == f"warm-{mark}" and baseline.get("daemon") == f"warm-{mark}",
        f"template: positive control: the first sandbox does not hold the warmup's state and daemon "
        f"({baseline.get('state')!r}, {baseline.get('daemon')!r}); what follows proves nothing",
    )
    listing_before = template_list(cli)
    attack = h.run_json(
        "s1 attack",
        s1,
        ["python3", "-c", GUEST_TPL_ATTACK, json.dumps({"module": module, "token": tokens["s1"]})],
    )
    if isinstance(attack, dict):
        h.note(f"s1 attack: {json.dumps(attack)[:2500]}")
        pythonpath = attack.get("pythonpath", [])
        for what, result in attack.get("attempts", {}).items():
            if str(result).startswith("WORKED"):
                index = what.rsplit("_", 1)[-1]
                if "_in_pythonpath_" in what and index.isdigit() and not pythonpath[int(index)][1]:
                    # not the template's layer: a dir of the sandbox's own writable root (the siblings'
                    # checks below show whether it stays there)
                    h.note(f"s1: {what}: {result}, in {pythonpath[int(index)][0]} (writable, not read-only)")
                    continue
                if what == "unshare_then_mount" and driver == "gvisor":
                    h.note(f"s1: {what}: {result} (its own namespace inside the sentry)")
                    continue
                h.problem(
                    f"template: the first sandbox's command could {what} ({result}): the template's "
                    f"layer is mounted read-only (docs/sandbox-api.md, Templates; P2 under bubblewrap)"
                )
        h.expect(
            attack.get("own", {}).get("daemon") == f"s1-{tokens['s1']}",
            f"template: positive control: s1 could not change its own daemon: {attack.get('own')}",
        )
    # positive control for the detector: s1 itself sees its own traces
    own = h.run_json("s1 own check", s1, [*check, args(needles=[tokens["s1"]])]) or {}
    h.expect(
        bool(own.get("hits")) and own.get("state") == f"s1-{tokens['s1']}",
        f"template: positive control: the check does not find s1's own traces in s1: {own.get('hits')} "
        f"{own.get('state')!r}",
    )
    s2 = h.create("tpl-s2", driver=driver, template=name, tenant="tqadv-t2", memory_mb=512)
    pristine(
        "s2 (made after s1's attack, s1 alive)",
        h.run_json("s2 check", s2, [*check, args(needles=[tokens["s1"]])]),
        [tokens["s1"]],
    )
    # written by s1 after s2 exists
    later = h.bounded(
        "s1 later",
        lambda: s1.run(
            f"echo s1later-{tokens['s1later']} > /opt/tqadv/state; "
            f"echo {tokens['s1later']} > /tmp/tqadv-later; "
            f'python3 -c "import socket; s = socket.socket(socket.AF_UNIX); '
            f"s.connect('/opt/tqadv/daemon.sock'); "
            f"s.sendall(b'SET s1later-{tokens['s1later']}'); print(s.recv(99))\"",
            timeout_seconds=30,
        ),
    )
    h.expect(
        later.ok and later.value.ok,
        f"s1's later write: {later.describe()} {getattr(later.value, 'stderr', '')[-300:]}",
    )
    pristine(
        "s2 (after s1 wrote more)",
        h.run_json("s2 check 2", s2, [*check, args(needles=[tokens["s1"], tokens["s1later"]])]),
        [tokens["s1later"]],
    )
    if driver == "gvisor":
        fork = h.bounded("fork s2", lambda: s2.fork(ttl_seconds=90))
        if h.expect(fork.ok, f"fork s2: {fork.describe()}"):
            child = fork.value
            h.made.append(child)
            h.step(f"forked s2 in {fork.seconds:.1f} s")
            wrote = h.bounded(
                "s2 after fork",
                lambda: s2.run(
                    f"echo s2after-{tokens['s2after']} > /opt/tqadv/state; "
                    f"echo {tokens['s2after']} > /tmp/tqadv-s2",
                    timeout_seconds=30,
                ),
            )
            h.expect(wrote.ok and wrote.value.ok, f"s2's write after the fork: {wrote.describe()}")
            pristine(
                "the fork child of s2 (after s2 wrote)",
                h.run_json(
                    "child check",
                    child,
                    [*check, args(needles=[tokens["s1"], tokens["s1later"], tokens["s2after"]])],
                ),
                [tokens["s2after"]],
            )
            cw = h.bounded(
                "child write",
                lambda: child.run(
                    f"echo {tokens['child']} > /tmp/tqadv-child; echo {tokens['child']} > /opt/tqadv/child",
                    timeout_seconds=30,
                ),
            )
            h.expect(cw.ok and cw.value.ok, f"the child's write: {cw.describe()}")
            rep = h.run_json("s2 check 3", s2, [*check, args(needles=[tokens["child"]])])
            pristine("s2 (after its fork child wrote)", rep, [tokens["child"]], state=False)
    # s1 ends itself: SIGINT ends the agent (its init); nothing a sandbox does may remove the template (S1)
    end = h.bounded("s1 ends itself", lambda: s1.run("kill -INT 1; sleep 20", timeout_seconds=30), 60)
    h.note(
        f"s1 after SIGINT to its agent: {end.describe()} "
        f"{getattr(end.value, 'reason', '') if end.value is not None else ''}"
    )
    gone = wait_for(lambda: not s1.is_running(), 15, 0.2)
    h.note(f"s1 {'ended' if gone else 'still running'} after its agent's SIGINT")
    started = time.monotonic()
    s3 = h.create("tpl-s3", driver=driver, template=name, tenant="tqadv-t1", memory_mb=512)
    h.note(f"s3 created {time.monotonic() - started:.1f} s after s1's death")
    pristine(
        "s3 (made after s1 died)",
        h.run_json("s3 check", s3, [*check, args(needles=[tokens["s1"], tokens["s1later"]])]),
        [tokens["s1"]],
    )
    listing_after = template_list(cli)
    before, after = template_view(listing_before, name), template_view(listing_after, name)
    h.expect(
        bool(before["template"]) and before == after,
        f"template: what the host lists for {name} changed while its sandboxes attacked it and one "
        f"died (rule S1: removed only on host-observed corruption):\nbefore {before}\nafter  {after}",
    )
    h.check_memory("templates")


# -- the subprocess --------------------------------------------------------------------------

ATTACKS: dict[str, Callable[..., None]] = {"egress": attack_egress, "templates": attack_templates}


def child_main(args_file: str, report_file: str) -> None:
    args = json.loads(Path(args_file).read_text())
    # the interpreter's exit deletes what the ready pool holds (docs/sandbox-api.md,
    # Ready pool), so this process ends normally; a hang in that is cut short
    Host(Path(report_file)).run(ATTACKS, args)
    sys.stdout.flush()
    sys.stderr.flush()
    killer = threading.Timer(EXIT_SECONDS, lambda: os._exit(EXIT_HUNG))
    killer.daemon = True
    killer.start()
    sys.exit(0)
