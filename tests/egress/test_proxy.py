"""The egress proxy on real sockets (no sandbox): policy before DNS, the
address guard, CONNECT and plain HTTP, accounting, closing, and a fuzz run of
malformed requests. Test servers listen on 127.0.0.1 only; the guard is told
to allow exactly that address (as TENANTQ_EGRESS_ALLOW_NETWORKS would)."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tenantq.egress.policy import EgressPolicy, parse_rules
from tenantq.egress.proxy import AddressGuard, BatchProxy, EgressHub
from tests.egress.servers import serving


@pytest.fixture
def servers() -> Iterator[dict[str, int]]:
    with serving(("alpha", "beta"), echo_path=True) as ports:
        yield ports


@pytest.fixture
def hub() -> Iterator[EgressHub]:
    h = EgressHub(AddressGuard(["127.0.0.1/32"]))
    yield h
    h.shutdown()


def _ask(path: Path, head: bytes, then: bytes = b"") -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(head)
        if then:
            reply = s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 200 Connection established"), reply
            s.sendall(then)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def _open(hub: EgressHub, tmp_path: Path, rules: str, name: str = "p.sock") -> BatchProxy:
    return hub.open(tmp_path / name, EgressPolicy("acme", parse_rules(rules)), lambda: (7, None))


def test_allowed_hosts_pass_and_others_are_refused_by_name(hub: EgressHub, servers: dict[str, int],
                                                          tmp_path: Path) -> None:
    a, b = servers["alpha"], servers["beta"]
    proxy = _open(hub, tmp_path, f"127.0.0.1:{a}")
    plain = _ask(proxy.path, f"GET http://127.0.0.1:{a}/hello HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert plain.startswith(b"HTTP/1.0 200") and plain.endswith(b"alpha /hello"), plain
    tunnel = _ask(proxy.path, f"CONNECT 127.0.0.1:{a} HTTP/1.1\r\n\r\n".encode(),
                  then=b"GET /tunnelled HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert tunnel.endswith(b"alpha /tunnelled"), tunnel
    refused = _ask(proxy.path, f"CONNECT 127.0.0.1:{b} HTTP/1.1\r\n\r\n".encode())
    status_line = refused.split(b"\r\n")[0].decode()
    assert status_line == f"HTTP/1.1 403 tenantq egress: 127.0.0.1:{b} is not allowed for tenant acme"
    stats = hub.close(proxy)
    assert (stats.allowed, stats.blocked) == (2, 1)
    assert stats.bytes_out > 0 and stats.bytes_in > len(b"alpha /hello")
    assert stats.blocks == [{"job_id": 7, "host": f"127.0.0.1:{b}", "reason": stats.blocks[0]["reason"],
                             "at": stats.blocks[0]["at"]}]


def test_a_disallowed_name_is_never_resolved(hub: EgressHub, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    looked_up: list[str] = []
    real = hub.loop.getaddrinfo

    async def recording(host: Any, *args: Any, **kwargs: Any) -> Any:
        looked_up.append(str(host))
        return await real(host, *args, **kwargs)

    monkeypatch.setattr(hub.loop, "getaddrinfo", recording)
    proxy = _open(hub, tmp_path, "localhost:9")
    reply = _ask(proxy.path, b"CONNECT exfil.pastebin.example:443 HTTP/1.1\r\n\r\n")
    assert b"403" in reply.split(b"\r\n")[0]
    reply = _ask(proxy.path, b"GET http://secret.exfil.example/x HTTP/1.1\r\n\r\n")
    assert b"403" in reply.split(b"\r\n")[0]
    assert looked_up == []
    hub.close(proxy)


def test_an_allowed_name_that_resolves_inside_is_refused(tmp_path: Path, servers: dict[str, int]) -> None:
    strict = EgressHub(AddressGuard())  # the default: no internal address allowed
    try:
        proxy = strict.open(tmp_path / "s.sock", EgressPolicy("acme", parse_rules(
            f"localhost:{servers['alpha']},127.0.0.1:5432")), lambda: (None, None))
        for target in (f"localhost:{servers['alpha']}", "127.0.0.1:5432"):
            reply = _ask(proxy.path, f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
            assert reply.split(b"\r\n")[0].decode().startswith(
                f"HTTP/1.1 403 tenantq egress: {target} resolves to a loopback address"), reply
        assert strict.close(proxy).allowed == 0
    finally:
        strict.shutdown()


def test_a_handler_narrowing_applies_to_its_job(hub: EgressHub, servers: dict[str, int],
                                                tmp_path: Path) -> None:
    a, b = servers["alpha"], servers["beta"]
    narrowing = {"rules": parse_rules(f"127.0.0.1:{a}")}
    proxy = hub.open(tmp_path / "n.sock", EgressPolicy("acme", parse_rules(f"127.0.0.1:{a},127.0.0.1:{b}")),
                     lambda: (1, narrowing["rules"]))
    reply = _ask(proxy.path, f"CONNECT 127.0.0.1:{b} HTTP/1.1\r\n\r\n".encode())
    assert b"is not allowed for its handler" in reply.split(b"\r\n")[0]
    narrowing["rules"] = None  # type: ignore[assignment]
    reply = _ask(proxy.path, f"GET http://127.0.0.1:{b}/ HTTP/1.1\r\n\r\n".encode())
    assert reply.endswith(b"beta /")
    hub.close(proxy)


def test_closing_cuts_open_tunnels_and_the_socket_goes(hub: EgressHub, servers: dict[str, int],
                                                       tmp_path: Path) -> None:
    proxy = _open(hub, tmp_path, f"127.0.0.1:{servers['alpha']}")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(proxy.path))
    s.sendall(f"CONNECT 127.0.0.1:{servers['alpha']} HTTP/1.1\r\n\r\n".encode())
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    hub.close(proxy)
    assert s.recv(4096) == b"", "the tunnel outlived its batch"
    s.close()
    assert not proxy.path.exists()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as again, pytest.raises(FileNotFoundError):
        again.connect(str(proxy.path))


def _garbage(rng: random.Random) -> bytes:
    choices = [
        lambda: bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))) + b"\r\n\r\n",
        lambda: b"CONNECT " + bytes(rng.randrange(33, 127) for _ in range(rng.randrange(80))) + b"\r\n\r\n",
        lambda: b"GET " + rng.choice([b"ftp://x/", b"http://", b"http://[::1", b"/relative", b"http://a:99999/"])
                + b" HTTP/1.1\r\n\r\n",
        lambda: b"CONNECT 127.0.0.1:" + str(rng.randrange(-5, 70000)).encode() + b" HTTP/1.1\r\n\r\n",
        lambda: b"GET http://a/ HTTP/1.1\r\n" + b"X: " + b"y" * rng.randrange(60_000, 80_000) + b"\r\n\r\n",
        lambda: b"get http://a/ HTTP/1.1\r\n\r\n",
        lambda: b"CONNECT a:1 HTTP/1.1",  # never finishes its head
        lambda: b"\r\n\r\n",
        lambda: b"GET http://a/ HTTP/9\r\n\r\n",
    ]
    return rng.choice(choices)()


def test_the_proxy_survives_malformed_requests(hub: EgressHub, servers: dict[str, int],
                                               tmp_path: Path) -> None:
    proxy = _open(hub, tmp_path, f"127.0.0.1:{servers['alpha']}")
    rng = random.Random(1234)
    statuses: set[bytes] = set()
    for _ in range(300):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(15)
            s.connect(str(proxy.path))
            try:
                s.sendall(_garbage(rng))
                s.shutdown(socket.SHUT_WR)
                reply = s.recv(4096)
            except OSError:
                continue
            if reply:
                statuses.add(reply.split(b" ")[1])
    assert statuses <= {b"400", b"403", b"502"}, statuses
    assert b"400" in statuses and b"403" in statuses
    ok = _ask(proxy.path, f"GET http://127.0.0.1:{servers['alpha']}/still HTTP/1.1\r\n\r\n".encode())
    assert ok.endswith(b"alpha /still")
    assert hub.close(proxy).allowed == 1
