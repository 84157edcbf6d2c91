"""Support for `bench/egress_flood.py`: its test certificates, its wildcard
DNS server, a watch on the files under a directory, and the processes it
starts, each as `python -m bench.egress_flood_support ROLE SPEC_JSON`:

- `dispatcher`: the process holding the egress proxies, built the way the
  sandbox executor builds them (`EgressProxies(registry, data_dir, config,
  secrets)`, `.open(sandbox, batch, running_now, env)`, `.close(proxy)`),
  with two batches open: mallory's (a wildcard rule, an injected secret, so
  every CONNECT is intercepted with mallory's CA) and acme's, the neighbour.
  It runs in a private mount namespace whose /etc/resolv.conf names the
  bench's DNS server, and checks that the names resolve before it opens a
  proxy. Commands on stdin (`close mallory`, `quit`; EOF is `quit`), JSON
  lines on stdout.
- `upstream`: a TLS server on 127.0.0.1 with a certificate for
  `*.flood.test` (signed by the bench's test CA), answering any request with
  a small 200; it exits at EOF on stdin.
- `flood`: mallory's job: CONNECT to a new name (`n<i>.flood.test`) through
  mallory's proxy socket, TLS trusting only mallory's CA (so a handshake that
  succeeds was intercepted), one GET; many at once, paced, until it has tried
  `names` names or `seconds` have passed.

Times are `time.monotonic()` (one clock for every process on Linux).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import queue
import re
import resource
import select
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REQUEST_TIMEOUT = 20.0
UPSTREAM_BODY = b"ok\n"


DOMAIN = "flood.test"


# -- certificates ---------------------------------------------------------------------------------------


def make_certs(directory: Path) -> tuple[Path, Path]:
    """A test CA (the file to give TENANTQ_EGRESS_UPSTREAM_CA) and the
    upstream's key + certificate for `*.flood.test`, signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    now = datetime.now(UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("egress-flood test CA"))
          .issuer_name(name("egress-flood test CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(hours=1))
          .not_valid_after(now + timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(name(f"*.{DOMAIN}")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(hours=1)).not_valid_after(now + timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(f"*.{DOMAIN}")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    ca_path, leaf_path = directory / "test-ca.pem", directory / "upstream.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    leaf_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption())
                          + leaf.public_bytes(serialization.Encoding.PEM))
    return ca_path, leaf_path


# -- wildcard DNS ---------------------------------------------------------------------------------------


def ensure_dnsmasq() -> str:
    """dnsmasq's path, installed from Debian's dnsmasq-base when missing (as
    root, unless TENANTQ_NO_APT is set), like ./run installs runsc."""
    found = shutil.which("dnsmasq") or next((p for p in ("/usr/sbin/dnsmasq",) if os.path.exists(p)), None)
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get") or os.environ.get("TENANTQ_NO_APT"):
        raise RuntimeError("egress-flood needs dnsmasq for its wildcard DNS "
                           "(Debian: apt-get install dnsmasq-base)")
    print("installing dnsmasq-base for the wildcard DNS (set TENANTQ_NO_APT=1 to skip)", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "dnsmasq-base"]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
        subprocess.run(install, env=env, capture_output=True, check=True)
    found = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
    if not os.path.exists(found):
        raise RuntimeError("dnsmasq-base installed but no dnsmasq binary found")
    return found


def free_dns_address() -> str:
    """127.0.0.1 when nothing holds port 53 there, else another loopback
    address (a resolv.conf names a server's address, never its port)."""
    for address in ["127.0.0.1", *(f"127.53.0.{i}" for i in range(1, 20))]:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, \
                    socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                udp.bind((address, 53))
                tcp.bind((address, 53))
            return address
        except OSError:
            continue
    raise RuntimeError("no loopback address with port 53 free for the bench's DNS server")


def dns_answer(server: str, name: str, timeout: float = 0.5) -> str | None:
    """The first A record `server` gives for `name` (a bare DNS query)."""
    query = struct.pack(">HHHHHH", 0x4242, 0x0100, 1, 0, 0, 0) + b"".join(
        bytes([len(label)]) + label.encode() for label in name.split(".")) + b"\0" + struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.sendto(query, (server, 53))
            reply = sock.recv(512)
        except OSError:
            return None
    if len(reply) < 16 or reply[3] & 0x0F or struct.unpack(">H", reply[6:8])[0] == 0:
        return None
    return socket.inet_ntoa(reply[-4:])


def dnsmasq_argv(binary: str, address: str) -> list[str]:
    # --local: AAAA questions get an empty answer (not REFUSED, which resolvers retry)
    argv = [binary, f"--address=/{DOMAIN}/127.0.0.1", f"--local=/{DOMAIN}/", "--no-resolv", "--no-hosts",
            "--port=53", f"--listen-address={address}", "--bind-interfaces", "--keep-in-foreground",
            "--conf-file=/dev/null", "--pid-file=", "--user=nobody", "--cache-size=0", "--log-facility=-"]
    # killed with this process even if the bench itself is killed
    return ["setpriv", "--pdeathsig", "KILL", "--", *argv] if shutil.which("setpriv") else argv


def namespace_argv(resolv_conf: Path, nsswitch_conf: Path | None, argv: list[str]) -> list[str]:
    """`argv` in a private mount namespace where /etc/resolv.conf (and
    /etc/nsswitch.conf: hosts from files, then DNS) are the bench's files;
    the namespace ends with the process."""
    script = ('mount --bind "$1" /etc/resolv.conf || exit 97; '
              'if [ -n "$2" ]; then mount --bind "$2" /etc/nsswitch.conf || exit 97; fi; shift 2; exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script, "sh",
            str(resolv_conf), str(nsswitch_conf or ""), *argv]


# -- files written under a directory (inotify) ----------------------------------------------------------

_IN_MODIFY, _IN_CLOSE_WRITE, _IN_MOVED_TO, _IN_CREATE = 0x2, 0x8, 0x80, 0x100
_IN_Q_OVERFLOW, _IN_ISDIR = 0x4000, 0x40000000


class DirWatch:
    """Every file created, written or moved in under `root` (and its
    subdirectories, new ones too) from now on, with the time: a file
    written and removed between two looks is counted too."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._dirs: dict[int, Path] = {}
        self.created: list[tuple[float, str]] = []  # (monotonic time, path under root)
        self.writes = 0
        self.overflowed = False
        self._stop_r, self._stop_w = os.pipe()
        self._fds: tuple[int, ...] = (self.fd, self._stop_r, self._stop_w)
        for path in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            self._watch(path)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _watch(self, path: Path) -> None:
        mask = _IN_MODIFY | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE
        wd = self._libc.inotify_add_watch(self.fd, str(path).encode(), mask)
        if wd >= 0:
            self._dirs[wd] = path

    def _loop(self) -> None:
        while True:
            ready, _, _ = select.select([self.fd, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                continue
            at, offset = time.monotonic(), 0
            while offset + 16 <= len(data):
                wd, mask, _cookie, length = struct.unpack_from("iIII", data, offset)
                name = data[offset + 16:offset + 16 + length].rstrip(b"\0").decode(errors="replace")
                offset += 16 + length
                if mask & _IN_Q_OVERFLOW:
                    self.overflowed = True
                    continue
                path = self._dirs.get(wd, self.root) / name
                if mask & _IN_ISDIR:
                    if mask & (_IN_CREATE | _IN_MOVED_TO):
                        self._watch(path)
                elif mask & (_IN_CREATE | _IN_MOVED_TO):
                    self.created.append((at, str(path.relative_to(self.root))))
                elif mask & (_IN_MODIFY | _IN_CLOSE_WRITE):
                    self.writes += 1

    def close(self) -> None:
        if self._thread.is_alive():
            os.write(self._stop_w, b"x")
            self._thread.join(timeout=5)
        fds, self._fds = self._fds, ()
        for fd in fds:
            os.close(fd)


def files_under(root: Path) -> dict[str, int]:
    """path under root -> size, of every file there now."""
    out: dict[str, int] = {}
    for path in root.rglob("*") if root.exists() else ():
        with contextlib.suppress(OSError):
            if path.is_file():
                out[str(path.relative_to(root))] = path.stat().st_size
    return out


# -- a child process speaking JSON lines ----------------------------------------------------------------


class Child:
    """A process whose stdout is JSON lines (read by a thread, so a wait has a
    deadline), stdin its commands (EOF: finish), stderr a file."""

    def __init__(self, name: str, argv: list[str], err: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.err = name, err
        with err.open("wb") as errfile:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errfile,
                                         text=True, cwd=ROOT, env=env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def event(self, timeout: float) -> dict[str, Any]:
        """The next JSON line (an "error" event raises)."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.name}: nothing in {timeout:.0f} s{self._tail()}") from None
        if line is None:
            self.proc.wait(timeout=10)
            raise RuntimeError(f"{self.name} exited ({self.proc.returncode}){self._tail()}")
        event: dict[str, Any] = json.loads(line)
        if event.get("event") == "error":
            raise RuntimeError(f"{self.name}: {event['error']}")
        return event

    def stderr_tail(self, lines: int = 20) -> list[str]:
        text = self.err.read_text(errors="replace").strip() if self.err.exists() else ""
        return text.splitlines()[-lines:]

    def _tail(self) -> str:
        tail = self.stderr_tail(5)
        return ": " + " | ".join(tail) if tail else ""

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self, timeout: float = 15.0) -> None:
        """Close its stdin (it finishes), then terminate, then kill it."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        for signal_it in (None, self.proc.terminate, self.proc.kill):
            if signal_it is not None:
                with contextlib.suppress(OSError):
                    signal_it()
            try:
                self.proc.wait(timeout=timeout)
                break
            except subprocess.TimeoutExpired:
                continue
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# -- dispatcher -----------------------------------------------------------------------------------------


@dataclass
class _Box:
    """What the egress proxies use of a sandbox: its egress dir (the socket and
    the CA certificate go there)."""

    id: str
    work_dir: Path
    egress_dir: Path


def dispatcher(spec: dict[str, Any]) -> None:
    from tenantq.dispatch.executors.egress import EgressProxies
    from tenantq.domain.records import Batch, ClaimedJob
    from tenantq.egress.config import CA_NAME, SOCKET_NAME
    from tenantq.registry import Registry
    from tenantq.secrets import FileSecrets

    port = int(spec["port"])
    for name in spec["check_names"]:  # the wildcard DNS, seen from this namespace
        try:
            found = {str(info[4][0]) for info in socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)}
        except OSError as exc:
            found = {f"error: {exc}"}
        if found != {"127.0.0.1"}:
            _emit({"event": "error", "error": f"{name} resolves to {sorted(found)}, not 127.0.0.1"})
            return
    work = Path(spec["work_dir"])
    proxies = EgressProxies(Registry(), Path(spec["data_dir"]), None, FileSecrets(Path(spec["secrets"])))
    tenants: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()
    next_id = iter(range(1, 1_000_000))

    def open_batch(tenant: str) -> Any:
        t = tenants[tenant]
        batch_id = next(next_id)
        job = ClaimedJob(batch_id, tenant, "floodbench.connect", {}, 1, 1)
        batch = Batch(batch_id, tenant, "default", datetime.now(UTC) + timedelta(hours=1), (job,),
                      egress=tuple(t["rules"]))
        proxy, _env = proxies.open(t["box"], batch, lambda: batch_id, {})
        if proxy is None:
            raise RuntimeError(f"no proxy for {tenant}")
        return proxy

    def close_batch(tenant: str) -> None:
        t = tenants[tenant]
        if t["proxy"] is not None:
            used = proxies.close(t["proxy"])
            t["proxy"] = None
            t["batches"].append({"record": used.record, "blocks": [_plain(b) for b in used.blocks]})

    for tenant, rules in spec["rules"].items():
        box = _Box(tenant, work / tenant, work / tenant / "egress")
        box.egress_dir.mkdir(parents=True, mode=0o755)
        tenants[tenant] = {"rules": rules, "box": box, "batches": [], "proxy": None}
        tenants[tenant]["proxy"] = open_batch(tenant)
    stop = threading.Event()

    def rotate() -> None:  # mallory's job spread over a new batch every `batch_seconds`
        while not stop.wait(float(spec["batch_seconds"])):
            with lock:
                if tenants["mallory"]["proxy"] is None:
                    return
                close_batch("mallory")
                tenants["mallory"]["proxy"] = open_batch("mallory")

    if float(spec["batch_seconds"]) > 0:
        threading.Thread(target=rotate, daemon=True).start()
    _emit({"event": "ready", "pid": os.getpid(),
           **{f"{t}_socket": str(v["box"].egress_dir / SOCKET_NAME) for t, v in tenants.items()},
           **{f"{t}_ca": str(v["box"].egress_dir / CA_NAME) for t, v in tenants.items()}})
    for line in sys.stdin:
        command = line.split()
        if command[:1] == ["close"]:
            with lock:
                close_batch(command[1])
            _emit({"event": "closed", "tenant": command[1]})
        elif command[:1] == ["quit"]:
            break
    stop.set()
    with lock:
        for tenant in tenants:
            close_batch(tenant)
    proxies.shutdown()
    _emit({"event": "done", "batches": {t: v["batches"] for t, v in tenants.items()}})


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


# -- upstream -------------------------------------------------------------------------------------------


def upstream(spec: dict[str, Any]) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(spec["cert"])
    served = 0

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        try:
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(UPSTREAM_BODY), UPSTREAM_BODY))
            await writer.drain()
            served += 1
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ssl.SSLError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def main() -> None:
        server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=ctx, backlog=1024)
        _emit({"event": "ready", "port": server.sockets[0].getsockname()[1], "pid": os.getpid()})
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until EOF
        server.close()

    asyncio.run(main())
    _emit({"event": "done", "served": served})


# -- flood ----------------------------------------------------------------------------------------------


def _status(head: bytes) -> tuple[int, str]:
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return 0, line[:200]
    return int(parts[1]), parts[2] if len(parts) > 2 else ""


def flood(spec: dict[str, Any]) -> None:
    ctx = ssl.create_default_context(cafile=spec["ca"])  # mallory's CA only: a handshake = interception
    outcomes: Counter[str] = Counter()
    per_second: Counter[int] = Counter()
    name_re = re.compile(re.escape(spec["prefix"]) + r"\d+\." + re.escape(spec["domain"]))

    async def one(i: int) -> str:
        name = f"{spec['prefix']}{i}.{spec['domain']}"
        for attempt in range(5):  # the socket is briefly absent while mallory's batch is swapped
            try:
                reader, writer = await asyncio.open_unix_connection(spec["socket"], limit=1 << 16)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(0.05 * (attempt + 1))
        else:
            return "error: proxy socket not there"
        try:
            writer.write(f"CONNECT {name}:{spec['port']} HTTP/1.1\r\nHost: {name}:{spec['port']}\r\n\r\n"
                         .encode())
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return "error: closed before answering CONNECT"
            code, reason = _status(head)
            if code != 200:
                reason = name_re.sub("<name>", reason)
                return f"refused {code}: {reason}" if code == 403 else f"error {code}: {reason}"
            try:
                await writer.start_tls(ctx, server_hostname=name)
            except ssl.SSLCertVerificationError as exc:
                return f"error: not intercepted with mallory's CA ({exc.verify_message})"
            writer.write(f"GET / HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            reply = await reader.read()  # to EOF
            if not reply:
                return "error: closed after the TLS handshake, no reply"
            code, reason = _status(reply)
            if code == 200 and reply.endswith(UPSTREAM_BODY):
                return "ok"
            return f"error: upstream answered {code} {name_re.sub('<name>', reason)}"
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def guarded(i: int, sem: asyncio.Semaphore, start: float) -> None:
        try:
            outcome = await asyncio.wait_for(one(i), REQUEST_TIMEOUT)
        except TimeoutError:
            outcome = f"error: no answer in {REQUEST_TIMEOUT:.0f} s"
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            outcome = f"error: {type(exc).__name__}"
        finally:
            sem.release()
        outcomes[outcome] += 1
        per_second[int(time.monotonic() - start)] += 1

    async def main() -> tuple[float, float, int]:
        sem = asyncio.Semaphore(int(spec["concurrency"]))
        rate = float(spec["rate"])
        start = time.monotonic()
        deadline = start + float(spec["seconds"])
        _emit({"event": "start", "t": start})
        tasks = []
        attempted = 0
        for i in range(int(spec["names"])):
            if rate > 0 and start + i / rate > time.monotonic():
                await asyncio.sleep(start + i / rate - time.monotonic())
            await sem.acquire()
            if time.monotonic() >= deadline:
                sem.release()
                break
            tasks.append(asyncio.create_task(guarded(i, sem, start)))
            attempted += 1
        sending_ended = time.monotonic()
        await asyncio.gather(*tasks)
        return start, sending_ended, attempted

    start, sending_ended, attempted = asyncio.run(main())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _emit({"event": "done", "start": start, "sending_ended": sending_ended, "end": time.monotonic(),
           "cpu_seconds": usage.ru_utime + usage.ru_stime,
           "attempted": attempted, "outcomes": dict(outcomes),
           "per_second": [per_second[s] for s in range(max(per_second, default=-1) + 1)]})


ROLES = {"dispatcher": dispatcher, "upstream": upstream, "flood": flood}

if __name__ == "__main__":
    ROLES[sys.argv[1]](json.loads(sys.argv[2]))
