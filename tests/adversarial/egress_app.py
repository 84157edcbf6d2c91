"""The guest side of the egress attacks (tests/adversarial/test_egress_*.py):
a hostile tenant's handlers, written from docs/egress.md, docs/security.md and
guest/egress.py only. Stdlib only (it runs in the guest). `adv.echo` (the
honest neighbour) comes with tests.adversarial.attack_app.

`egx.raw` sends exactly the bytes the test describes, with the batch's
placeholder (the sandbox's `KEY`) substituted in many disguises, through the
forwarder on the sandbox's loopback ($HTTPS_PROXY) or straight to the proxy's
socket, over a tunnel it intercepts (TLS trusting /tenantq/egress/ca.pem) or in
clear text; it returns what came back, base64, for the test to judge.
"""

from __future__ import annotations

import base64
import os
import select
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import tenantq
from tests.adversarial import attack_app  # noqa: F401  (registers adv.echo)

SOCKET_PATH = "/tenantq/egress/proxy.sock"
CA_PATH = "/tenantq/egress/ca.pem"


def placeholder() -> str:
    return os.environ.get("KEY", "")


def _pct(text: str, every: int = 1, lower: bool = False) -> str:
    fmt = "%{:02x}" if lower else "%{:02X}"
    return "".join(fmt.format(ord(c)) if i % every == 0 else c for i, c in enumerate(text))


def disguises(ph: str) -> dict[str, str]:
    swap = "".join(c.upper() if i % 2 else c.lower() for i, c in enumerate(ph))
    return {"{PH}": ph, "{PH_UPPER}": ph.upper(), "{PH_LOWER}": ph.lower(), "{PH_SWAP}": swap,
            "{PH_PCT}": _pct(ph), "{PH_PCT_LOWER}": _pct(ph, lower=True), "{PH_PCT2}": _pct(_pct(ph)),
            "{PH_PCT_HALF}": _pct(ph, every=2), "{PH_PCT_SWAP}": _pct(swap, every=3),
            "{PH_HEAD}": ph[:12], "{PH_TAIL}": ph[12:], "{NUL}": "\x00"}


def substitute(text: str, ph: str) -> bytes:
    for token, form in disguises(ph).items():
        text = text.replace(token, form)
    return text.encode("latin-1")


def build(payload: dict[str, Any], ph: str) -> bytes:
    head = "\r\n".join(payload["head"])
    body = b""
    if payload.get("raw_body") is not None:  # verbatim (its framing headers are the test's own)
        body = substitute(payload["raw_body"], ph)
    elif payload.get("chunks") is not None:
        head += "\r\nTransfer-Encoding: chunked"
        body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (substitute(x, ph) for x in payload["chunks"]))
        body += b"0\r\n\r\n"
    elif payload.get("body") is not None:
        body = substitute(payload["body"], ph)
        head += f"\r\nContent-Length: {len(body)}"
    return substitute(head, ph) + b"\r\n\r\n" + body + substitute(payload.get("after", ""), ph)


def open_proxy(via: str) -> socket.socket:
    if via == "socket":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(15)
        s.connect(SOCKET_PATH)
        return s
    host, port = os.environ["HTTPS_PROXY"].rsplit("/", 1)[-1].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=15)


def read_head(s: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def read_all(s: socket.socket, seconds: float, limit: int = 1 << 20) -> tuple[bytes, str]:
    data, end = b"", time.monotonic() + seconds
    while len(data) < limit:
        left = end - time.monotonic()
        if left <= 0:
            return data, "timeout (the connection stayed open)"
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            return data, "timeout (the connection stayed open)"
        except (OSError, ssl.SSLError) as exc:
            return data, f"{type(exc).__name__}: {exc}"[:200]
        if not chunk:
            return data, "closed"
        data += chunk
    return data, "limit"


def read_one_response(s: socket.socket) -> bytes:
    """One response with a Content-Length (the first of a keep-alive exchange)."""
    data = read_head(s)
    head = data.split(b"\r\n\r\n")[0].lower()
    length = 0
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    while len(data) - len(head) - 4 < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def send(s: socket.socket, data: bytes, split: int) -> str | None:
    try:
        if split <= 0:
            s.sendall(data)
        else:
            for i in range(0, len(data), split):
                s.sendall(data[i:i + split])
    except (OSError, ssl.SSLError) as exc:
        return f"{type(exc).__name__}: {exc}"[:200]
    return None


@tenantq.handler("egx.raw", timeout=60, memory_mb=128)
def raw(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    ph = placeholder()
    out: dict[str, Any] = {"tag": payload.get("tag"), "placeholder": ph}
    data = build(payload, ph)
    try:
        s = open_proxy(payload.get("via", "forwarder"))
    except OSError as exc:
        out["error"] = f"proxy: {exc}"
        return out
    try:
        target = payload.get("connect")
        if target:
            s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
            reply = read_head(s)
            out["connect"] = reply.split(b"\r\n")[0].decode("latin-1")
            if b" 200" not in reply.split(b"\r\n")[0]:
                return out
            if payload.get("tls", True):
                tls = ssl.create_default_context(cafile=CA_PATH)
                if payload.get("insecure"):  # an attacker need not check what it is shown
                    tls.check_hostname = False
                    tls.verify_mode = ssl.CERT_NONE
                s = tls.wrap_socket(s, server_hostname=payload.get("sni") or target.rsplit(":", 1)[0])
        out["send_error"] = send(s, data, int(payload.get("split", 0)))
        if payload.get("second") is not None:
            first = read_one_response(s)
            out["send_error"] = send(s, substitute(payload["second"], ph), 0)
            got, out["end"] = read_all(s, float(payload.get("read_seconds", 10)))
            got = first + got
        else:
            got, out["end"] = read_all(s, float(payload.get("read_seconds", 10)))
        out["raw_b64"] = base64.b64encode(got).decode()
        out["status"] = got.split(b"\r\n")[0].decode("latin-1")[:200]
    except (OSError, ssl.SSLError, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        s.close()
    return out


@tenantq.handler("egx.get", timeout=60, memory_mb=128)
def get(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """An ordinary client (urllib through $HTTPS_PROXY, the CA in $SSL_CERT_FILE)."""
    ph = placeholder()
    headers = {k: substitute(v, ph).decode("latin-1") for k, v in payload.get("headers", {}).items()}
    request = urllib.request.Request(payload["url"], headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=15) as resp:
            return {"status": resp.status, "body": resp.read().decode("latin-1"), "placeholder": ph}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "error": f"{exc.code} {exc.reason}", "placeholder": ph}
    except (urllib.error.URLError, OSError) as exc:
        return {"status": None, "error": str(getattr(exc, "reason", exc))[:300], "placeholder": ph}


def _connect_once(name: str, port: int, tls: bool, results: list[str], i: int) -> None:
    try:
        s = open_proxy("socket")
    except OSError as exc:
        results[i] = f"proxy: {exc}"
        return
    try:
        s.sendall(f"CONNECT {name}:{port} HTTP/1.1\r\n\r\n".encode())
        status = read_head(s).split(b"\r\n")[0].decode("latin-1")
        results[i] = status[:300]
        if tls and " 200" in status:
            with ssl.create_default_context(cafile=CA_PATH).wrap_socket(s, server_hostname=name) as t:
                t.sendall(f"GET /m/digest HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n".encode())
                got, _ = read_all(t, 10)
                results[i] += " | " + got.split(b"\r\n")[0].decode("latin-1")
    except (OSError, ssl.SSLError) as exc:
        results[i] += f" | {type(exc).__name__}"
    finally:
        s.close()


@tenantq.handler("egx.names", timeout=170, memory_mb=128)
def names(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """CONNECT to many distinct names under a wildcard rule, in order (one at
    a time, so that "the 257th" is well defined), then again to the first."""
    pattern, count, port = payload["pattern"], int(payload["count"]), int(payload["port"])
    results = [""] * (count + 1)
    started = time.monotonic()
    for i in range(count):
        _connect_once(pattern.format(i), port, bool(payload.get("tls")), results, i)
    _connect_once(pattern.format(0), port, bool(payload.get("tls")), results, count)
    return {"results": results, "seconds": time.monotonic() - started}


@tenantq.handler("egx.conns", timeout=90, memory_mb=128)
def conns(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """Open `count` connections to the proxy at once and hold them: those past
    the proxy's bound must be closed at once (docs/egress.md: 256)."""
    count, held, refused = int(payload["count"]), [], 0
    for _ in range(count):
        try:
            held.append(open_proxy(payload.get("via", "socket")))
        except OSError:  # the proxy's listening socket refused it (its backlog full): closed at once too
            refused += 1
    # watch for 3 s which of them the proxy closes (a bounded watch, not a wait)
    closed: set[int] = set()
    end = time.monotonic() + 3.0
    while (left := end - time.monotonic()) > 0:
        readable, _, _ = select.select([s for s in held if s.fileno() not in closed], [], [], left)
        for s in readable:
            try:
                if s.recv(1) == b"":
                    closed.add(s.fileno())
            except OSError:
                closed.add(s.fileno())
    threads = [threading.Thread(target=s.close) for s in held]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after: list[str] = [""]
    _connect_once(payload["after_name"], int(payload["after_port"]), False, after, 0)
    return {"opened": len(held), "refused": refused, "closed_by_proxy": len(closed), "after": after[0]}
