"""Host-side credential injection on real sockets (rule E2): the proxy
terminates TLS with the tenant's CA, writes the secret into its header only,
on requests to the secret's host (over TLS it verifies upstream), refuses the
placeholder anywhere else, and cuts a response that echoes the value."""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenantq.egress.inject import Injection
from tenantq.egress.policy import EgressPolicy, parse_rule, parse_rules
from tenantq.egress.proxy import AddressGuard, BatchProxy, EgressHub
from tenantq.egress.tls import TenantCA, upstream_context
from tests.egress.servers import EchoHeaders, serving


class HashedHeaders(EchoHeaders):
    """Echoes the headers it got, the Authorization header as its SHA-256
    (an echo of the value itself is cut by the proxy)."""

    def body(self) -> bytes:
        server = self.server
        headers = dict(self.headers)
        auth = headers.pop("Authorization", None)
        digest = hashlib.sha256(auth.encode()).hexdigest() if auth else None
        return json.dumps({"server": getattr(server, "name", "?"), "headers": headers,
                           "auth_sha256": digest}).encode()

SECRET = "sk_live_real_value_never_in_the_sandbox"
PLACEHOLDER = "tenantq-placeholder-API_KEY-0123456789abcdef"


@pytest.fixture
def upstream_ca(tmp_path: Path) -> TenantCA:
    """Stands in for the public CAs real servers have certificates from."""
    return TenantCA(tmp_path / "public", "upstream")


@pytest.fixture
def https_servers(upstream_ca: TenantCA) -> Iterator[dict[str, int]]:
    tls = upstream_ca.server_context("127.0.0.1")
    with serving(("stripe", "elsewhere"), HashedHeaders, tls=tls) as ports:
        with serving(("echo",), EchoHeaders, tls=tls) as echo:
            yield {**ports, **echo}


@pytest.fixture
def proxy(tmp_path: Path, upstream_ca: TenantCA, https_servers: dict[str, int]) -> Iterator[BatchProxy]:
    hub = EgressHub(AddressGuard(["127.0.0.1/32"]), upstream_context(str(upstream_ca.dir / "ca.pem")))
    stripe, elsewhere = https_servers["stripe"], https_servers["elsewhere"]
    tenant_ca = TenantCA(tmp_path / "cas", "acme")
    injection = Injection("API_KEY", SECRET, PLACEHOLDER, parse_rule(f"127.0.0.1:{stripe}"),
                          header="Authorization", template="Bearer {value}")
    policy = EgressPolicy("acme", parse_rules(f"127.0.0.1:{stripe},127.0.0.1:{elsewhere},"
                                              f"127.0.0.1:{https_servers['echo']}"))
    opened = hub.open(tmp_path / "p.sock", policy, lambda: (3, None), injections=(injection,), ca=tenant_ca)
    opened.tenant_ca = tenant_ca  # type: ignore[attr-defined]
    yield opened
    hub.close(opened)
    hub.shutdown()


def _https_get(proxy: BatchProxy, port: int, headers: dict[str, str]) -> tuple[int, str]:
    """CONNECT through the proxy socket, then TLS trusting only the tenant's CA."""
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.settimeout(10)
    raw.connect(str(proxy.path))
    raw.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
    assert raw.recv(4096).startswith(b"HTTP/1.1 200")
    ctx = ssl.create_default_context(cadata=proxy.tenant_ca.cert_pem.decode())  # type: ignore[attr-defined]
    with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        lines = ["GET /charge HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
        tls.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        with contextlib.suppress(ssl.SSLError, ConnectionResetError):  # a cut response ends abruptly
            while chunk := tls.recv(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]) if head else 0, body.decode()


def test_the_secret_is_written_into_its_header_only(proxy: BatchProxy, https_servers: dict[str, int]) -> None:
    expected = hashlib.sha256(f"Bearer {SECRET}".encode()).hexdigest()
    status, body = _https_get(proxy, https_servers["stripe"], {"Authorization": f"Bearer {PLACEHOLDER}"})
    assert status == 200, body
    assert json.loads(body)["auth_sha256"] == expected, "the header is replaced whole, with the value"
    # without the placeholder the header is still set for that host
    status, body = _https_get(proxy, https_servers["stripe"], {})
    assert json.loads(body)["auth_sha256"] == expected
    assert SECRET not in body


def test_the_placeholder_elsewhere_in_the_head_is_refused(proxy: BatchProxy,
                                                          https_servers: dict[str, int]) -> None:
    for headers in ({"X-Api-Key": PLACEHOLDER}, {"X-Debug": PLACEHOLDER.upper()},
                    {"X-Debug": "".join(f"%{b:02x}" for b in PLACEHOLDER.encode())}):
        status, body = _https_get(proxy, https_servers["stripe"], headers)
        assert status == 403, body
        assert "placeholder of secret API_KEY may only be sent in its Authorization header" in body
    assert SECRET not in json.dumps(proxy.stats.blocks)


def test_a_response_that_echoes_the_value_is_cut(proxy: BatchProxy, https_servers: dict[str, int]) -> None:
    """An upstream that echoes the headers it got (here one the secret's rule
    matches) never hands the value to the sandbox."""
    echo = https_servers["echo"]
    proxy.injections = (*proxy.injections, Injection("ECHOED", SECRET, PLACEHOLDER + "e",
                                                       parse_rule(f"127.0.0.1:{echo}"), header="X-Key"))
    _, body = _https_get(proxy, echo, {})
    assert SECRET not in body
    assert any("held the value of secret ECHOED" in b["reason"] for b in proxy.stats.blocks)


def test_the_placeholder_to_another_host_is_blocked(proxy: BatchProxy, https_servers: dict[str, int]) -> None:
    status, body = _https_get(proxy, https_servers["elsewhere"], {"X-Exfil": PLACEHOLDER})
    assert status == 403
    assert f"placeholder of secret API_KEY may only go to 127.0.0.1:{https_servers['stripe']}" in body
    # and nothing is injected for other hosts
    status, body = _https_get(proxy, https_servers["elsewhere"], {})
    assert status == 200 and "Authorization" not in json.loads(body)["headers"]
    assert proxy.stats.blocks and proxy.stats.blocks[0]["job_id"] == 3


def test_the_placeholder_never_goes_in_clear_text(proxy: BatchProxy, https_servers: dict[str, int]) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(proxy.path))
        url = f"http://127.0.0.1:{https_servers['stripe']}/"
        s.sendall(f"GET {url} HTTP/1.1\r\nX: {PLACEHOLDER}\r\n\r\n".encode())
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 403 tenantq egress: secret API_KEY is injected over HTTPS only")
