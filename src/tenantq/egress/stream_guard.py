"""Looking for a secret in one direction of an intercepted HTTP exchange
(docs/security.md, rule E2), as the bytes stream through the proxy.

A `StreamGuard` follows one HTTP/1.1 message's framing (a response's head,
then its body: `Content-Length`, `Transfer-Encoding: chunked`, or to the
end; a request's body as its head framed it), decodes the body
(de-chunked; `gzip` and `deflate`), and looks for its needles in two views:
the bytes as sent and the bytes as decoded, each in any letter case and
percent-decoded up to twice. It passes bytes on only once no needle can
begin in them: it holds back the last `5 x the longest needle` decoded bytes
(a needle percent-encoded twice is five times its length), and for an
encoded body the reads whose decoding is still that close to the end. So no
byte of a needle ever passes, and the guard holds at most that much plus
one read.

Everything from the guest or from an upstream is hostile input: a framing
it cannot follow (a malformed chunk size, a body in an encoding it cannot
decode, more than MAX_DECODED_BYTES decoded) ends the stream with a reason,
exactly as a needle does.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from urllib.parse import unquote_to_bytes

HEAD_LIMIT = 64 * 1024
CHUNK_LINE_LIMIT = 4096
MAX_DECODED_BYTES = 256 << 20
DECODE_STEP = 1 << 20


class Found(Exception):
    """Why the stream is cut (a needle, or a framing that cannot be checked)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def views(data: bytes) -> tuple[bytes, bytes, bytes]:
    """`data` in lower case, percent-decoded once and twice (each in lower case)."""
    lower = data.lower()
    once = unquote_to_bytes(lower).lower() if b"%" in lower else lower
    twice = unquote_to_bytes(once).lower() if b"%" in once else once
    return lower, once, twice


@dataclass
class _Window:
    """A scan of one view of the stream: the tail it keeps, and its needles."""

    needles: dict[bytes, str]
    keep: int
    tail: bytes = b""

    def scan(self, data: bytes) -> None:
        text = self.tail + data
        for view in views(text):
            for needle, label in self.needles.items():
                if needle in view:
                    raise Found(label)
        self.tail = text[-self.keep:]


@dataclass
class StreamGuard:
    """One direction of one exchange. `needles`: lower-case bytes -> the
    reason given when one is found; `response`: the stream starts with a
    response head (else: a request body framed by `request_head`)."""

    needles: dict[bytes, str]
    response: bool
    request_head: bytes = b""
    what: str = "the stream"
    # decoded bytes held back before they pass
    keep: int = 0
    _raw: _Window = field(init=False)
    _decoded: _Window = field(init=False)
    _state: str = field(init=False, default="head")
    _buffer: bytes = field(init=False, default=b"")
    _left: int = field(init=False, default=0)
    _chunked: bool = field(init=False, default=False)
    _inflate: zlib._Decompress | None = field(init=False, default=None)
    _decoded_total: int = field(init=False, default=0)
    # raw bytes not passed on yet, each with the decoded total it reaches
    _held: list[tuple[bytes, int]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.needles = {n.lower(): label for n, label in self.needles.items() if n}
        longest = max((len(n) for n in self.needles), default=1)
        self.keep = 5 * longest
        self._raw = _Window(self.needles, self.keep)
        self._decoded = _Window(self.needles, self.keep)
        if not self.response:
            self._frame(self.request_head, request=True)

    # -- the stream --------------------------------------------------------
    def feed(self, raw: bytes) -> bytes:
        """The bytes that may pass now; Found when the stream must be cut."""
        self._raw.scan(raw)
        self._buffer += raw
        self._parse()
        return self._release(final=False)

    def end(self) -> bytes:
        """At the stream's end: what is left, once checked."""
        if self._inflate is not None:
            self._emit(self._inflate.flush())
        return self._release(final=True)

    # -- framing -----------------------------------------------------------
    def _parse(self) -> None:
        while self._buffer:
            if self._state == "head":
                end = self._buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(self._buffer) > HEAD_LIMIT:
                        raise Found(f"{self.what}: a head over {HEAD_LIMIT} bytes")
                    self._hold_raw(b"")
                    return
                head, self._buffer = self._buffer[:end + 4], self._buffer[end + 4:]
                self._hold(head, head)
                self._frame(head, request=False)
            elif self._state == "body":
                take, self._buffer = self._buffer[:self._left], self._buffer[self._left:]
                self._left -= len(take)
                self._body(take)
                if self._left == 0:
                    self._state = "after"
            elif self._state == "chunk-size":
                line_end = self._buffer.find(b"\r\n")
                if line_end < 0:
                    if len(self._buffer) > CHUNK_LINE_LIMIT:
                        raise Found(f"{self.what}: a malformed chunked body")
                    return
                line, self._buffer = self._buffer[:line_end], self._buffer[line_end + 2:]
                self._hold(line + b"\r\n", b"")
                size = line.split(b";", 1)[0].strip()
                try:
                    self._left = int(size, 16)
                except ValueError:
                    raise Found(f"{self.what}: a malformed chunked body") from None
                if self._left < 0 or not size or not all(c in b"0123456789abcdefABCDEF" for c in size):
                    raise Found(f"{self.what}: a malformed chunked body")
                self._state = "chunk-data" if self._left else "trailers"
            elif self._state == "chunk-data":
                take, self._buffer = self._buffer[:self._left], self._buffer[self._left:]
                self._left -= len(take)
                self._body(take)
                if self._left == 0:
                    self._state = "chunk-end"
            elif self._state == "chunk-end":
                if len(self._buffer) < 2:
                    return
                if self._buffer[:2] != b"\r\n":
                    raise Found(f"{self.what}: a malformed chunked body")
                self._hold(self._buffer[:2], b"")
                self._buffer = self._buffer[2:]
                self._state = "chunk-size"
            elif self._state == "trailers":
                end = self._buffer.find(b"\r\n")
                if end < 0:
                    if len(self._buffer) > HEAD_LIMIT:
                        raise Found(f"{self.what}: trailers over {HEAD_LIMIT} bytes")
                    return
                line, self._buffer = self._buffer[:end + 2], self._buffer[end + 2:]
                self._hold(line, line)
                if line == b"\r\n":
                    self._finish_body()
            else:  # "after": the message is over; whatever follows is checked as it is
                data, self._buffer = self._buffer, b""
                self._hold(data, data)

    def _frame(self, head: bytes, *, request: bool) -> None:
        """The body framing the head announces (a response's 1xx is followed by another head)."""
        lines = head.decode("latin-1").split("\r\n")
        headers: dict[str, list[str]] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers.setdefault(name.strip().lower(), []).append(value.strip().lower())
        if not request:
            parts = lines[0].split(" ", 2)
            status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
            if 100 <= status < 200 and status != 101:
                self._state = "head"
                return
            if status in (101, 204, 304) or not (200 <= status < 600) or status == 0:
                self._state = "after"  # no body (or not HTTP any more): checked as it is
                return
        encodings = [e.strip() for v in headers.get("content-encoding", [])
                     for e in v.split(",") if e.strip()]
        for encoding in encodings:
            if encoding in ("gzip", "x-gzip", "deflate") and len(encodings) == 1:
                self._inflate = zlib.decompressobj(wbits=47)
            elif encoding != "identity":
                raise Found(f"{self.what}: a body encoded {encoding!r}, which cannot be checked")
        transfer = [t.strip() for v in headers.get("transfer-encoding", []) for t in v.split(",")]
        lengths = set(headers.get("content-length", []))
        if (transfer and transfer != ["chunked"]) or (transfer and lengths) or len(lengths) > 1:
            raise Found(f"{self.what}: an ambiguous body length")
        if transfer:
            self._state = "chunk-size"
        elif lengths:
            length = lengths.pop()
            if not length.isdigit():
                raise Found(f"{self.what}: an ambiguous body length")
            self._left = int(length)
            self._state = "body" if self._left else "after"
        else:  # a request without a length has no body; a response runs to the end
            self._state = "after" if request else "body"
            self._left = 0 if request else 1 << 62

    # -- bodies --------------------------------------------------------------
    def _body(self, data: bytes) -> None:
        if self._inflate is None:
            self._hold(data, data)
            return
        self._hold_raw(data)
        try:
            out = self._inflate.decompress(data, DECODE_STEP)
            while out:
                self._emit(out)
                out = self._inflate.decompress(self._inflate.unconsumed_tail, DECODE_STEP) \
                    if self._inflate.unconsumed_tail else b""
        except zlib.error:
            raise Found(f"{self.what}: a compressed body that does not decode") from None

    def _finish_body(self) -> None:
        if self._inflate is not None:
            self._emit(self._inflate.flush())
            self._inflate = None
        self._state = "after"

    def _emit(self, decoded: bytes) -> None:
        self._decoded_total += len(decoded)
        if self._decoded_total > MAX_DECODED_BYTES:
            raise Found(f"{self.what}: over {MAX_DECODED_BYTES >> 20} MiB decoded")
        self._decoded.scan(decoded)
        if self._held:
            raw, _ = self._held[-1]
            self._held[-1] = (raw, self._decoded_total)

    # -- holding back ----------------------------------------------------------
    def _hold(self, raw: bytes, decoded: bytes) -> None:
        if decoded:
            self._emit_plain(decoded)
        if raw is decoded and len(raw) > self.keep:
            # as sent is as decoded: all but its last `keep` bytes may go at once
            self._held.append((raw[:-self.keep], self._decoded_total - self.keep))
            raw = raw[-self.keep:]
        self._held.append((raw, self._decoded_total))

    def _hold_raw(self, raw: bytes) -> None:
        if raw:
            self._held.append((raw, self._decoded_total))

    def _emit_plain(self, decoded: bytes) -> None:
        self._decoded_total += len(decoded)
        self._decoded.scan(decoded)

    def _release(self, *, final: bool) -> bytes:
        """Raw bytes whose decoding lies `keep` bytes before the end (all at the end)."""
        if final:
            rest = b"".join(raw for raw, _ in self._held) + self._buffer
            self._held, self._buffer = [], b""
            return rest
        limit = self._decoded_total - self.keep
        out: list[bytes] = []
        while self._held and self._held[0][1] <= limit:
            out.append(self._held.pop(0)[0])
        return b"".join(out)
