"""The host side of the egress attacks (tests/adversarial/test_egress_*.py),
written from docs/egress.md and docs/security.md (rules E1-E3) only: a test CA
standing in for the public ones, raw HTTP/1.1 upstreams on 127.0.0.1 (TLS or
plain) that record every byte they are sent and answer per the mode named in
the request path (`/m/<mode>/...`), most of them echoing the request back in
some disguise (tests/adversarial/egress_leaks.py judges what came back)."""

from __future__ import annotations

import contextlib
import datetime
import gzip
import hashlib
import ipaddress
import json
import socket
import ssl
import threading
import urllib.parse
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

READ_SECONDS = 20.0
MAX_HEAD = 1 << 20
TAG_HEADER = "x-tqadv-tag"


class UpstreamCA:
    """A CA and one server certificate for `names` (DNS names and IP literals)."""

    def __init__(self, directory: Path, names: tuple[str, ...]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.UTC)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tqadv upstream CA")])
        ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
              .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(hours=1))
              .not_valid_after(now + datetime.timedelta(days=2))
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                           content_commitment=False, key_encipherment=False,
                                           data_encipherment=False, key_agreement=False,
                                           encipher_only=False, decipher_only=False), critical=True)
              .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA256()))
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = []
        for name in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                sans.append(x509.DNSName(name))
        leaf = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                               critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        self.ca_path = directory / "upstream-ca.pem"
        self.ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        self.chain_path = directory / "upstream-chain.pem"
        self.chain_path.write_bytes(
            leaf.public_bytes(serialization.Encoding.PEM)
            + key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()))

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(self.chain_path))
        return ctx


@dataclass
class Received:
    """One request as an upstream read it."""

    conn: int
    head: bytes
    body_raw: bytes = b""
    body: bytes = b""  # de-chunked
    complete: bool = False

    def lines(self) -> list[str]:
        return [line.rstrip("\r") for line in self.head.decode("latin-1").split("\n")]

    def header_values(self, name: str) -> list[str]:
        out = []
        for line in self.lines()[1:]:
            key, sep, value = line.partition(":")
            if sep and key.strip().lower() == name:
                out.append(value.strip())
        return out

    @property
    def tag(self) -> str | None:
        values = self.header_values(TAG_HEADER)
        return values[0] if values else None


@dataclass
class Connection:
    raw: bytearray = field(default_factory=bytearray)
    tls: bool = False


class _Reader:
    def __init__(self, sock: socket.socket, log: bytearray) -> None:
        self.sock, self.log, self.pending = sock, log, b""

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        if not data:
            return False
        self.log += data
        self.pending += data
        return True

    def until(self, mark: bytes, limit: int) -> bytes | None:
        while mark not in self.pending:
            if len(self.pending) > limit or not self._fill():
                return None
        out, _, self.pending = self.pending.partition(mark)
        return out + mark

    def exactly(self, n: int) -> bytes | None:
        while len(self.pending) < n:
            if not self._fill():
                return None
        out, self.pending = self.pending[:n], self.pending[n:]
        return out


class Upstream:
    """A raw HTTP/1.1 server on 127.0.0.1 that records every connection's bytes
    and every request; it answers per `respond` and keeps the connection for
    further requests unless the request said `Connection: close`."""

    def __init__(self, name: str, tls: ssl.SSLContext | None = None) -> None:
        self.name, self.tls = name, tls
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1024)
        self.port: int = self.listener.getsockname()[1]
        self.connections: list[Connection] = []
        self.requests: list[Received] = []
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._stopped = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name=f"upstream-{name}", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                conn = Connection()
                self.connections.append(conn)
                self._open.append(client)
                worker = threading.Thread(target=self._serve, args=(client, conn, len(self.connections) - 1),
                                          daemon=True)
                self._threads.append(worker)
            worker.start()

    def _serve(self, client: socket.socket, conn: Connection, conn_id: int) -> None:
        sock: socket.socket = client
        try:
            client.settimeout(READ_SECONDS)
            # a TLS upstream also records a client that speaks clear text to it
            if self.tls is not None and client.recv(1, socket.MSG_PEEK) == b"\x16":
                sock = self.tls.wrap_socket(client, server_side=True)
                conn.tls = True
                with self._lock:
                    self._open.append(sock)
            reader = _Reader(sock, conn.raw)
            while True:
                head = reader.until(b"\r\n\r\n", MAX_HEAD)
                if head is None:
                    return
                req = Received(conn_id, head)
                with self._lock:
                    self.requests.append(req)
                if not self._read_body(reader, req):
                    return
                req.complete = True
                for piece in respond(req):
                    if piece:
                        sock.sendall(piece)
                    else:  # an empty piece: pace the next write (the value lands in reads of its own)
                        self._stopped.wait(0.005)
                if "close" in ",".join(req.header_values("connection")).lower():
                    return
        except (OSError, ValueError):
            return
        finally:
            with contextlib.suppress(OSError):
                sock.close()
            with contextlib.suppress(OSError):
                client.close()

    @staticmethod
    def _read_body(reader: _Reader, req: Received) -> bool:
        if any("chunked" in v.lower() for v in req.header_values("transfer-encoding")):
            while True:
                size_line = reader.until(b"\r\n", 4096)
                if size_line is None:
                    return False
                req.body_raw += size_line
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (line := reader.until(b"\r\n", MAX_HEAD)) not in (None, b"\r\n"):
                        req.body_raw += line
                    req.body_raw += b"\r\n"
                    return line is not None
                data = reader.exactly(size + 2)
                if data is None:
                    req.body_raw += reader.pending
                    req.body += reader.pending[:size]
                    return False
                req.body_raw += data
                req.body += data[:size]
        lengths = req.header_values("content-length")
        if lengths:
            data = reader.exactly(int(lengths[0]))
            if data is None:
                req.body_raw = req.body = reader.pending
                return False
            req.body_raw = req.body = data
        return True

    def bytes_with_tag(self, tag: str) -> bool:
        """Did any connection carry the request head tagged `tag` (its tag line, whole)?"""
        needle = f"{TAG_HEADER}: {tag}\r\n".encode()
        with self._lock:
            return any(needle in bytes(c.raw).lower() for c in self.connections)

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked in its thread
        with contextlib.suppress(OSError):
            self.listener.close()
        with self._lock:
            for s in self._open:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            threads = list(self._threads)
        self._acceptor.join(timeout=10)
        for t in threads:
            t.join(timeout=10)


# -- the answers ------------------------------------------------------------------------


def _chunked(data: bytes, size: int, trailer: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(data[i:i + size]), data[i:i + size])
                    for i in range(0, len(data), size)) + b"0\r\n" + trailer + b"\r\n"


def _pct(data: bytes, every: int = 1, lower: bool = False) -> bytes:
    fmt = "%{:02x}" if lower else "%{:02X}"
    return b"".join(fmt.format(b).encode() if i % every == 0 else bytes([b]) for i, b in enumerate(data))


def _deflate_raw(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-15)
    return c.compress(data) + c.flush()


# mode -> (extra head lines, body transform); the body is the request as received
ENCODED: dict[str, tuple[list[str], Callable[[bytes], bytes]]] = {
    "echo": ([], lambda b: b),
    "swapcase": ([], lambda b: b.swapcase()),
    "upper": ([], lambda b: b.upper()),
    "lower": ([], lambda b: b.lower()),
    "pct": ([], lambda b: _pct(b)),
    "pct_lower": ([], lambda b: _pct(b, lower=True)),
    "pct_half": ([], lambda b: _pct(b, every=2)),
    "pct_double": ([], lambda b: _pct(_pct(b))),
    "pct_quote": ([], lambda b: urllib.parse.quote(b.decode("latin-1"), safe="").encode()),
    "pct_swapcase": ([], lambda b: _pct(b.swapcase(), every=3)),
    "padded": ([], lambda b: b"x" * 65531 + b),
    "padded_big": ([], lambda b: b"y" * 300_000 + b),
    "gzip": (["Content-Encoding: gzip"], lambda b: gzip.compress(b)),
    "gzip_upper": (["Content-Encoding: GZIP"], lambda b: gzip.compress(b)),
    "x_gzip": (["Content-Encoding: x-gzip"], lambda b: gzip.compress(b)),
    "gzip_gzip": (["Content-Encoding: gzip, gzip"], lambda b: gzip.compress(gzip.compress(b))),
    "gzip_twice_header": (["Content-Encoding: gzip", "Content-Encoding: gzip"],
                          lambda b: gzip.compress(gzip.compress(b))),
    "deflate": (["Content-Encoding: deflate"], lambda b: zlib.compress(b)),
    "deflate_raw": (["Content-Encoding: deflate"], _deflate_raw),
    "br": (["Content-Encoding: br"], lambda b: b),
    "zstd": (["Content-Encoding: zstd"], lambda b: b),
    "unknown": (["Content-Encoding: x-tqadv"], lambda b: b),
    "identity_gzip": (["Content-Encoding: identity, gzip"], lambda b: gzip.compress(b)),
}


def respond(req: Received) -> list[bytes]:
    """What the upstream writes back (pieces written one by one)."""
    path = req.lines()[0].split(" ")[1] if " " in req.lines()[0] else "/"
    parts = path.split("/")
    mode = parts[2] if len(parts) > 2 and parts[1] == "m" else "echo"
    echo = req.head + req.body_raw
    auths = req.header_values("authorization")
    auth = auths[0] if auths else ""
    closing = "close" in ",".join(req.header_values("connection")).lower()
    conn = "Connection: close\r\n" if closing else ""

    def whole(status: str, headers: list[str], body: bytes) -> list[bytes]:
        lines = "".join(f"{h}\r\n" for h in headers)
        return [f"HTTP/1.1 {status}\r\n{lines}Content-Length: {len(body)}\r\n{conn}\r\n".encode("latin-1")
                + body]

    if mode == "digest":
        info = {"auth_sha256": hashlib.sha256("\n".join(auths).encode("latin-1")).hexdigest(),
                "auth_count": len(auths), "names": [ln.split(":")[0].lower() for ln in req.lines()[1:] if ln],
                "body_sha256": hashlib.sha256(req.body).hexdigest(), "body_len": len(req.body)}
        return whole("200 OK", [], json.dumps(info).encode())
    if mode in ENCODED:
        headers, transform = ENCODED[mode]
        return whole("200 OK", headers, transform(echo))
    at = echo.find(auth.encode("latin-1")) + len("Bearer ") if auth else 0
    if mode in ("straddle", "straddle_gzip"):  # the value's first bytes just before the 64 KiB mark
        body = b"x" * max(0, 65536 - 5 - at) + echo
        return whole("200 OK", ["Content-Encoding: gzip"] if mode == "straddle_gzip" else [],
                     gzip.compress(body) if mode == "straddle_gzip" else body)
    if mode == "slow_value":  # the value a byte per TLS record, paced
        return [f"HTTP/1.1 200 OK\r\nContent-Length: {len(echo)}\r\n{conn}\r\n".encode() + echo[:at],
                *(p for i in range(at, len(echo)) for p in (b"", echo[i:i + 1]))]
    if mode == "overflow":  # a body longer than its Content-Length: the echo after the declared end
        return [f"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n{conn}\r\nok".encode() + echo]
    if mode == "cl_te":  # both framings: 2 bytes by Content-Length, the echo by chunked
        return [f"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n{conn}\r\n"
                .encode() + _chunked(echo, 9)]
    if mode == "big_head":  # the value after 96 KiB of response head
        pad = "".join(f"X-Pad-{i}: {'p' * 1000}\r\n" for i in range(96))
        return [f"HTTP/1.1 200 OK\r\n{pad}X-Reflect: {auth}\r\nContent-Length: 2\r\n{conn}\r\nok"
                .encode("latin-1")]
    if mode == "slow":
        return [f"HTTP/1.1 200 OK\r\nContent-Length: {len(echo)}\r\n{conn}\r\n".encode(),
                *(echo[i:i + 1] for i in range(len(echo)))]
    if mode == "close_delimited":
        return [b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + echo]
    chunked = f"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n{conn}\r\n".encode()
    if mode == "chunked":
        return [chunked + _chunked(echo, 3)]
    if mode == "chunked_writes":
        return [chunked, *(_chunked(echo, 5)[i:i + 4] for i in range(0, len(_chunked(echo, 5)), 4))]
    if mode == "gzip_chunked":
        return [f"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n{conn}\r\n"
                .encode() + _chunked(gzip.compress(echo), 7)]
    if mode == "te_gzip":
        return [f"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n{conn}\r\n".encode()
                + _chunked(gzip.compress(echo), 64)]
    if mode == "trailer":
        return [chunked + _chunked(b"ok", 2, f"X-Reflect: {auth}\r\n".encode("latin-1"))]
    if mode == "header":
        return whole("200 OK", [f"X-Reflect: {auth}"], b"ok")
    if mode == "header_swapcase":
        return whole("200 OK", [f"x-reflect: {auth.swapcase()}"], b"ok")
    if mode == "header_pct":
        return whole("200 OK", [f"Location: /?a={_pct(auth.encode()).decode()}"], b"ok")
    if mode == "status":
        return whole(f"200 {auth}", [], b"ok")
    if mode == "early_hints":
        return [f"HTTP/1.1 103 Early Hints\r\nLink: <{auth}>\r\n\r\n".encode("latin-1"),
                *whole("200 OK", [], b"ok")]
    return whole("404 Not Found", [], b"no such mode")
