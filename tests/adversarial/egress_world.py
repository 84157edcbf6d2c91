"""A proxy hub driven directly (no sandbox) for tests/adversarial/test_egress_surface.py,
built only the way tests/egress/ builds one (EgressHub, AddressGuard,
EgressPolicy/parse_rules, Injection/parse_rule, TenantCA, upstream_context):
the hostile tenant's batch proxy, with secret KEY injected for the TLS
upstream `localhost:S`, a clear-text upstream it may reach (`A`) and one it
may not (`F`), and a neighbour tenant's proxy on the same hub."""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenantq.egress.inject import Injection
from tenantq.egress.policy import EgressPolicy, parse_rule, parse_rules
from tenantq.egress.proxy import AddressGuard, BatchProxy, EgressHub
from tenantq.egress.tls import TenantCA, upstream_context
from tests.adversarial.egress_upstream import Upstream, UpstreamCA

VALUE = "sk/TqAdv+unit0123456789abcdefZz="
PLACEHOLDER = "tenantq-placeholder-KEY-00112233445566778899aabbccddeeff"
MALLORY_JOB, ACME_JOB = 7, 8


@dataclass
class World:
    hub: EgressHub
    proxy: BatchProxy
    neighbour: BatchProxy
    tenant_ca: TenantCA
    allowed: Upstream
    forbidden: Upstream
    secure: Upstream
    lookups: list[str] = field(default_factory=list)
    closed: set[int] = field(default_factory=set)

    @property
    def a(self) -> int:
        return self.allowed.port

    @property
    def f(self) -> int:
        return self.forbidden.port

    @property
    def s(self) -> int:
        return self.secure.port

    def close(self, proxy: BatchProxy) -> Any:
        if id(proxy) in self.closed:
            return None
        self.closed.add(id(proxy))
        return self.hub.close(proxy)


def build(tmp_path: Path) -> Iterator[World]:
    ca = UpstreamCA(tmp_path / "upstream-ca", ("localhost", "127.0.0.1"))
    allowed, forbidden = Upstream("allowed"), Upstream("forbidden")
    secure = Upstream("secure", ca.server_context())
    hub = EgressHub(AddressGuard(["127.0.0.1/32"]), upstream_context(str(ca.ca_path)))
    tenant_ca = TenantCA(tmp_path / "cas", "mallory")
    injection = Injection("KEY", VALUE, PLACEHOLDER, parse_rule(f"localhost:{secure.port}"),
                          header="Authorization", template="Bearer {value}")
    rules = f"127.0.0.1:{allowed.port},localhost:{allowed.port},localhost:{secure.port}"
    proxy = hub.open(tmp_path / "m.sock", EgressPolicy("mallory", parse_rules(rules)),
                     lambda: (MALLORY_JOB, None), injections=(injection,), ca=tenant_ca)
    neighbour = hub.open(tmp_path / "n.sock", EgressPolicy("acme", parse_rules(f"127.0.0.1:{allowed.port}")),
                         lambda: (ACME_JOB, None))
    world = World(hub, proxy, neighbour, tenant_ca, allowed, forbidden, secure)
    real = hub.loop.getaddrinfo

    async def recording(host: Any, *args: Any, **kwargs: Any) -> Any:
        world.lookups.append(str(host))
        if str(host).lower().rstrip(".").endswith(".invalid"):  # names that cannot resolve, answered here
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return await real(host, *args, **kwargs)

    hub.loop.getaddrinfo = recording  # type: ignore[method-assign]
    try:
        yield world
    finally:
        for p in (proxy, neighbour):
            with contextlib.suppress(Exception):
                world.close(p)
        hub.shutdown()
        for upstream in (allowed, forbidden, secure):
            upstream.stop()


# -- talking to a proxy ---------------------------------------------------------------------


def connect(proxy: BatchProxy, seconds: float = 15.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(seconds)
    s.connect(str(proxy.path))
    return s


def read_until_closed(s: socket.socket, seconds: float) -> tuple[bytes, str]:
    """Everything until EOF; with how it ended: closed, reset, or still open at `seconds`."""
    data, end = b"", time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return data, "open"
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            return data, "open"
        except (ConnectionError, ssl.SSLError, OSError):
            return data, "reset"
        if not chunk:
            return data, "closed"
        data += chunk


def ask(proxy: BatchProxy, data: bytes, seconds: float = 15.0) -> bytes:
    with connect(proxy, seconds) as s:
        try:
            s.sendall(data)
        except OSError:
            return b""
        return read_until_closed(s, seconds)[0]


def head_only(proxy: BatchProxy, data: bytes, seconds: float = 10.0) -> bytes:
    """Send `data`, read until the end of the reply's head (a tunnel stays open after it)."""
    with connect(proxy, seconds) as s:
        got = b""
        with contextlib.suppress(OSError):
            s.sendall(data)
            while b"\r\n\r\n" not in got and (chunk := s.recv(4096)):
                got += chunk
        return got


def status_of(reply: bytes) -> str:
    return reply.split(b"\r\n", 1)[0].decode("latin-1")[:160]


def intercepted(world: World, sni: str = "localhost") -> ssl.SSLSocket:
    """CONNECT to the secret's host, then TLS trusting the tenant's CA."""
    raw = connect(world.proxy)
    try:
        raw.sendall(f"CONNECT localhost:{world.s} HTTP/1.1\r\n\r\n".encode())
        reply = raw.recv(4096)
        assert reply.startswith(b"HTTP/1.1 200"), reply
        ctx = ssl.create_default_context(cadata=world.tenant_ca.cert_pem.decode())
        return ctx.wrap_socket(raw, server_hostname=sni)
    except BaseException:
        raw.close()
        raise


def request(tag: str, port: int, *, path: str = "/m/digest/t", extra: tuple[str, ...] = (),
            close: bool = True) -> bytes:
    lines = [f"GET {path} HTTP/1.1", f"Host: localhost:{port}", f"X-Tqadv-Tag: {tag}",
             f"Authorization: Bearer {PLACEHOLDER}", *extra, *(["Connection: close"] if close else [])]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def vm_hwm_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def reset_hwm() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
