"""The stream guard and the injected request head (rule E2), byte by byte:
whatever the framing, encoding or split, no byte of a needle ever passes,
and a stream without one passes unchanged."""

from __future__ import annotations

import gzip
import itertools
import random
import zlib

import pytest

from tenantq.egress.inject import Injection, inject_head, placeholder_in, request_guard, response_guard
from tenantq.egress.policy import parse_rule
from tenantq.egress.stream_guard import Found, StreamGuard

VALUE = "sk_live_51HxQ9ZkLmNoPqRsTuVwXyZ"
NEEDLES = {VALUE.encode(): "the value"}


def _response(body: bytes, *headers: str) -> bytes:
    head = "\r\n".join(["HTTP/1.1 200 OK", *headers]) + "\r\n\r\n"
    return head.encode() + body


def _chunked(body: bytes, size: int) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]) for i in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\n\r\n"


def _run(data: bytes, cuts: list[int], guard: StreamGuard) -> tuple[bytes, str | None]:
    """Feed `data` split at `cuts`; what passed, and why it was cut (None: it was not)."""
    passed = b""
    edges = [0, *sorted(cuts), len(data)]
    try:
        for a, b in itertools.pairwise(edges):
            passed += guard.feed(data[a:b])
        passed += guard.end()
    except Found as found:
        return passed, found.reason
    return passed, None


def _splits(data: bytes, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    every_byte = list(range(1, len(data)))
    return [[], every_byte, *(sorted(rng.sample(range(1, len(data)), k=min(len(data) - 1, n)))
                              for n in (1, 2, 5, 17))]


def _guard() -> StreamGuard:
    return StreamGuard(NEEDLES, response=True)


@pytest.mark.parametrize("variant", [
    VALUE, VALUE.upper(), VALUE.swapcase(), "".join(f"%{b:02X}" for b in VALUE.encode()),
    "".join(f"%25{b:02x}" for b in VALUE.encode()), VALUE[:5] + "%" + VALUE[5:6].encode().hex() + VALUE[6:],
])
def test_a_response_holding_the_value_is_cut_before_any_of_it(variant: str) -> None:
    body = f'{{"echo": "Bearer {variant}", "pad": "{"x" * 300}"}}'.encode()
    for framing in ("length", "chunked", "gzip", "chunked-gzip", "to-the-end"):
        payload, headers = body, []
        if "gzip" in framing:
            payload, headers = gzip.compress(body), ["Content-Encoding: gzip"]
        if framing.startswith("chunked"):
            payload, headers = _chunked(payload, 7), [*headers, "Transfer-Encoding: chunked"]
        elif framing != "to-the-end":
            headers.append(f"Content-Length: {len(payload)}")
        data = _response(payload, *headers)
        for cuts in _splits(data, seed=len(variant)):
            passed, reason = _run(data, cuts, _guard())
            assert reason == "the value", (framing, cuts)
            assert data.startswith(passed)
            # what passed decodes to a prefix of the body that ends before the value
            shown = _decoded(passed.partition(b"\r\n\r\n")[2], framing)
            assert body.startswith(shown) and len(shown) <= body.index(variant.encode()), (framing, cuts)


def _decoded(payload: bytes, framing: str) -> bytes:
    """The body bytes a client could decode from a (cut) payload."""
    if framing.startswith("chunked"):
        out = b""
        while b"\r\n" in payload:
            size_text, _, rest = payload.partition(b"\r\n")
            size = int(size_text, 16)
            out, payload = out + rest[:size], rest[size + 2:]
            if size == 0 or len(rest) < size:
                break
        payload = out
    if "gzip" in framing:
        return zlib.decompressobj(wbits=47).decompress(payload)
    return payload


def test_the_value_in_a_response_head_is_cut() -> None:
    data = _response(b"ok", f"X-Echo: {VALUE}", "Content-Length: 2")
    for cuts in _splits(data, seed=1):
        passed, reason = _run(data, cuts, _guard())
        assert reason == "the value" and len(passed) < data.index(VALUE.encode())


def test_a_response_without_the_value_passes_unchanged() -> None:
    rng = random.Random(7)
    body = bytes(rng.randrange(256) for _ in range(20_000)) + VALUE[:-1].encode()
    for framing in ("length", "chunked", "gzip", "to-the-end", "continue"):
        payload, headers = body, [f"Content-Length: {len(body)}"]
        if framing == "chunked":
            payload, headers = _chunked(body, 999), ["Transfer-Encoding: chunked"]
        elif framing == "gzip":
            payload = gzip.compress(body)
            headers = ["Content-Encoding: gzip", f"Content-Length: {len(payload)}"]
        elif framing == "to-the-end":
            headers = []
        data = _response(payload, *headers)
        if framing == "continue":
            data = b"HTTP/1.1 100 Continue\r\n\r\n" + data
        for cuts in _splits(data, seed=3)[:4]:
            passed, reason = _run(data, cuts, _guard())
            assert reason is None and passed == data, framing


def test_the_guard_holds_back_a_bounded_amount() -> None:
    guard = _guard()
    data = _response(b"a" * 1_000_000, "Content-Length: 1000000")
    passed = b"".join(guard.feed(data[i:i + 65536]) for i in range(0, len(data), 65536))
    assert len(data) - len(passed) <= guard.keep
    assert passed + guard.end() == data


@pytest.mark.parametrize("headers", [
    ["Content-Encoding: br", "Content-Length: 3"],
    ["Content-Encoding: gzip, br", "Content-Length: 3"],
    ["Transfer-Encoding: chunked", "Content-Length: 3"],
    ["Content-Length: 3", "Content-Length: 4"],
    ["Transfer-Encoding: gzip, chunked"],
])
def test_a_body_that_cannot_be_checked_is_cut_before_its_first_byte(headers: list[str]) -> None:
    passed, reason = _run(_response(b"abc", *headers), [], _guard())
    assert reason is not None and b"abc" not in passed


def test_a_malformed_chunked_body_or_a_gzip_bomb_is_cut() -> None:
    _, reason = _run(_response(b"zz\r\nabc\r\n0\r\n\r\n", "Transfer-Encoding: chunked"), [], _guard())
    assert reason is not None and "malformed" in reason
    bomb = gzip.compress(b"\0" * (300 << 20))
    _, reason = _run(_response(bomb, "Content-Encoding: gzip", f"Content-Length: {len(bomb)}"), [], _guard())
    assert reason is not None and "MiB decoded" in reason


PLACEHOLDER = "tenantq-placeholder-KEY-00112233445566778899aabbccddeeff"
INJ = Injection("KEY", VALUE, PLACEHOLDER, parse_rule("api.example.com"), header="Authorization",
                template="Bearer {value}")


def _head(*lines: str, target: str = "/v1/charges") -> bytes:
    return ("\r\n".join([f"GET {target} HTTP/1.1", "Host: api.example.com", *lines]) + "\r\n\r\n").encode()


def test_the_value_goes_into_its_header_and_nowhere_else() -> None:
    out = inject_head((INJ,), _head(f"Authorization: Bearer {PLACEHOLDER}", "authorization: x",
                                    "Accept-Encoding: br", "Connection: keep-alive"), "api.example.com", 443)
    assert isinstance(out, bytes)
    text = out.decode()
    assert text.count(VALUE) == 1 and f"Authorization: Bearer {VALUE}\r\n" in text
    assert "authorization: x" not in text and PLACEHOLDER not in text
    assert "Accept-Encoding: identity" in text and "br" not in text
    assert text.endswith("Connection: close\r\n\r\n") and "keep-alive" not in text
    # another host: nothing injected
    other = inject_head((INJ,), _head().replace(b"api.example.com", b"other.com"), "other.com", 443)
    assert isinstance(other, bytes) and VALUE.encode() not in other


@pytest.mark.parametrize("head", [
    _head(target=f"/v1/{PLACEHOLDER}"), _head(target=f"/v1?k={PLACEHOLDER.upper()}"),
    _head(target="/v1/" + "".join(f"%{b:02x}" for b in PLACEHOLDER.encode())),
    _head(f"X-Debug: {PLACEHOLDER}"), _head(f"Cookie: a={PLACEHOLDER.swapcase()}"),
    _head("Authorization: Bearer x", f" {PLACEHOLDER}"),  # obs-fold onto the replaced header
    _head("Authorization: Bearer x", f"\t{PLACEHOLDER}"),
])
def test_a_placeholder_anywhere_else_in_the_head_is_refused(head: bytes) -> None:
    out = inject_head((INJ,), head, "api.example.com", 443)
    assert isinstance(out, str), out


def test_a_placeholder_in_a_request_body_is_cut_before_it() -> None:
    bodies = ((f"x={PLACEHOLDER}".encode(), ["Content-Length: {n}"]),
              (_chunked(f"data {PLACEHOLDER.upper()} end".encode(), 5), ["Transfer-Encoding: chunked"]),
              (gzip.compress(PLACEHOLDER.encode()), ["Content-Encoding: gzip", "Content-Length: {n}"]))
    for body, headers in bodies:
        head = _head(*(h.format(n=len(body)) for h in headers)).replace(b"GET", b"POST")
        for cuts in _splits(body, seed=5):
            passed, reason = _run(body, cuts, request_guard((INJ,), head))
            assert reason is not None and "placeholder of secret KEY" in reason
            assert PLACEHOLDER[:8].encode() not in passed.lower()


def test_placeholder_and_response_checks_see_through_encodings() -> None:
    assert placeholder_in((INJ,), f"a%25{PLACEHOLDER.encode()[0]:x}".encode() + PLACEHOLDER[1:].encode())
    assert placeholder_in((INJ,), b"nothing here") is None
    assert response_guard((INJ,), "other.com", 443) is None
    assert response_guard((INJ,), "api.example.com", 443) is not None
