"""Rule E2 (docs/security.md) and docs/egress.md "Host-side credentials",
attacked from inside real sandboxes on both drivers by a tenant (`mallory`)
whose secret `KEY` is injected by the host into `Authorization: Bearer
{value}` for one host (`localhost:P`, an HTTPS upstream on 127.0.0.1 signed
by a test CA). Every upstream records everything it is sent and most echo it
back (tests/adversarial/egress_upstream.py); the worker runs in a memory
cgroup next to an honest neighbour (tests/adversarial/harness.py).

Requests (test_*_requests): the placeholder in the URL path and query, in
another header, in a second Authorization header, in the body (identity,
chunked, split across chunks and across 1- to 5-byte writes), in upper,
lower and mixed case and percent-encoded (once, twice, partly), to another
allowed host, over plain HTTP, with the SNI or an absolute URI naming the
secret's host on another host's tunnel, and in a pipelined second request.
Responses (test_*_responses): an upstream that sends the Authorization header
back in its body (identity, chunked with the value split across chunks,
written a byte at a time, gzip/deflate though nobody asked, twice gzipped),
in a response header, a status line, a trailer, an early-hints response, in
mixed case, percent-encoded, after 64 KiB or 300 KB of padding, and bodies in
encodings the proxy cannot read (br, zstd, unknown).

What must hold is listed in tests/adversarial/egress_scene.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.adversarial import harness
from tests.adversarial.egress_scene import Attack, Scene
from tests.adversarial.harness import Arena

APP = "tests.adversarial.egress_app"
WORKER = ("--concurrency", "3", "--batch-size", "3")


@pytest.fixture
def scene(arena: Arena, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Scene]:
    monkeypatch.setattr(harness, "APP", APP)
    stage = Scene.build(arena, tmp_path)
    try:
        yield stage
    finally:
        stage.stop()


def request_attacks(s: Scene) -> None:
    s.add(_get(s, "normal-urllib"))
    s.tunnel("normal-raw-split", "ok", split=1, via="socket")
    # the placeholder in the head, out of its header
    for form in ("PH", "PH_UPPER", "PH_LOWER", "PH_SWAP", "PH_PCT", "PH_PCT_LOWER", "PH_PCT2", "PH_PCT_HALF"):
        s.tunnel(f"path-{form}", "head", path=f"/m/digest/{{{form}}}")
    for form in ("PH", "PH_PCT2", "PH_PCT_SWAP"):
        s.tunnel(f"query-{form}", "head", path=f"/m/digest/t?k={{{form}}}")
    s.tunnel("x-debug", "head", extra=("X-Debug: {PH}",))
    s.tunnel("x-debug-lower", "head", extra=("X-Debug: {PH_LOWER}",))
    s.tunnel("x-debug-pct", "head", extra=("X-Debug: {PH_PCT}",))
    s.tunnel("x-debug-split", "head", extra=("X-Debug: {PH}",), split=1)
    s.tunnel("x-debug-no-auth", "head", auth=None, extra=("X-Debug: {PH}",))
    s.tunnel("cookie", "head", extra=("Cookie: session={PH_SWAP}",))
    # more Authorization headers, obs-fold, bare CR, NUL: nothing may leak
    s.tunnel("second-auth", "safe", extra=("Authorization: {PH}",))
    s.tunnel("auth-case-dupes", "safe", auth="authorization: Bearer {PH}",
             extra=("AUTHORIZATION: Basic {PH}",))
    s.tunnel("auth-obs-fold", "safe", extra=("\t{PH}",))
    s.tunnel("x-debug-obs-fold", "safe", extra=("X-Debug: x", " {PH}"))
    s.tunnel("bare-cr", "safe", extra=("X-Debug: x\rX-Leak: {PH}",))
    s.tunnel("nul", "safe", extra=("X-Debug: x{NUL}{PH}",))
    # the placeholder in the body
    for form in ("PH", "PH_UPPER", "PH_LOWER", "PH_SWAP", "PH_PCT", "PH_PCT_LOWER", "PH_PCT2", "PH_PCT_HALF",
                 "PH_PCT_SWAP"):
        s.tunnel(f"body-{form}", "body", body=f"a=1&b={{{form}}}&c=2", method="POST")
    s.tunnel("body-split1", "body", body="a=1&b={PH}&c=2", split=1, method="POST")
    s.tunnel("body-split5", "body", body="a=1&b={PH}&c=2", split=5, method="POST")
    s.tunnel("body-json", "body", body='{"k": "{PH}"}', extra=("Content-Type: application/json",),
             method="POST")
    s.tunnel("body-chunked", "body", chunks=["a=1&b=", "{PH}", "&c=2"], method="POST")
    s.tunnel("body-chunk-straddle", "body", chunks=["a=1&b={PH_HEAD}", "{PH_TAIL}&c=2"], method="POST")
    s.tunnel("body-chunk-straddle-split", "body", chunks=["a={PH_HEAD}", "{PH_TAIL}"], split=3, method="POST")
    s.tunnel("body-overflow", "safe", body="a=1", after="&b={PH}", method="POST")
    s.tunnel("body-chunk-extension", "safe", extra=("Transfer-Encoding: chunked",), method="POST",
             raw_body="3;x={PH}\r\na=1\r\n0\r\n\r\n")
    s.tunnel("body-chunk-trailer", "safe", extra=("Transfer-Encoding: chunked",), method="POST",
             raw_body="3\r\na=1\r\n0\r\nX-Trailer: {PH}\r\n\r\n")
    smuggled = "GET /m/echo/t HTTP/1.1\r\nHost: x\r\nX-Tqadv-Tag: smuggled\r\nX-Debug: {PH}\r\n\r\n"
    s.tunnel("smuggle-cl-te", "safe", extra=("Content-Length: 5", "Transfer-Encoding: chunked"),
             method="POST", raw_body="0\r\n\r\n" + smuggled)
    s.tunnel("smuggle-te-cl", "safe", method="POST", raw_body=smuggled,
             extra=("Transfer-Encoding: chunked", f"Content-Length: {len(smuggled)}"))
    s.tunnel("header-name", "head", extra=("X-{PH}: 1",))
    s.tunnel("host-header", "head", host="{PH}")
    # another allowed host, plain HTTP
    s.tunnel("other-auth", "head", to="other")
    s.tunnel("other-x-debug", "head", to="other", auth=None, extra=("X-Debug: {PH}",))
    s.tunnel("other-body", "body", to="other", body="b={PH}", method="POST")
    s.tunnel("other-nothing", "safe", to="other", auth=None)
    s.tunnel("other-sni-is-secret-host", "safe", to="other", sni="localhost", insecure=True,
             host=s.inject_host)
    s.tunnel("other-absolute-uri", "safe", to="other",
             path=f"https://{s.inject_host}/m/digest/t", host=s.inject_host)
    s.clear("plain-auth", "head", s.plain_host)
    s.clear("plain-to-secret-host", "head", s.inject_host)
    s.clear("plain-x-debug", "head", s.plain_host, auth=None, extra=("X-Debug: {PH_UPPER}",))
    s.clear("plain-path", "head", s.plain_host, path="/m/digest/{PH_PCT}", auth=None)
    s.clear("plain-body", "body", s.plain_host, auth=None, body="b={PH}", method="POST")
    s.clear("plain-body-split", "body", s.plain_host, auth=None, body="b={PH}", method="POST", split=2,
            via="socket")
    # one request per connection: a second one must not reach upstream with injection
    second = "\r\n".join(s.head("pipe-auth-second", path="/m/echo/t")) + "\r\n\r\n"
    s.tunnel("pipe-auth", "safe", close=False, after=second)
    second = "\r\n".join(s.head("pipe-x-debug-second", path="/m/echo/t", extra=("X-Debug: {PH}",)))
    s.tunnel("pipe-x-debug", "safe", close=False, after=second + "\r\n\r\n")
    second = "\r\n".join(s.head("keepalive-second", path="/m/echo/t")) + "\r\n\r\n"
    s.tunnel("keepalive", "safe", close=False, second=second)


def _get(s: Scene, name: str) -> Attack:
    return Attack(name, "ok", {"url": f"https://{s.inject_host}/m/digest/t",
                               "headers": {"Authorization": "Bearer {PH}", "X-Tqadv-Tag": name}},
                  kind="egx.get")


RESPONSE_MODES = ("echo", "chunked", "chunked_writes", "slow", "close_delimited", "gzip", "gzip_upper",
                  "gzip_chunked", "x_gzip", "gzip_gzip", "gzip_twice_header", "identity_gzip", "deflate",
                  "deflate_raw", "te_gzip", "header", "header_swapcase", "header_pct", "status", "trailer",
                  "early_hints", "swapcase", "upper", "lower", "pct", "pct_lower", "pct_half", "pct_double",
                  "pct_quote", "pct_swapcase", "padded", "padded_big", "straddle", "straddle_gzip",
                  "slow_value", "overflow", "cl_te", "big_head")
OPAQUE_MODES = ("br", "zstd", "unknown")


def response_attacks(s: Scene) -> None:
    s.add(_get(s, "normal-urllib"))
    for mode in RESPONSE_MODES:
        s.tunnel(f"resp-{mode}", "response", path=f"/m/{mode}/t")
    s.tunnel("resp-gzip-asked", "response", path="/m/gzip/t", extra=("Accept-Encoding: gzip",))
    for mode in OPAQUE_MODES:
        s.tunnel(f"resp-{mode}", "response", path=f"/m/{mode}/t", opaque=True,
                 extra=("Accept-Encoding: br, zstd, gzip",))


def _fight(scene: Scene) -> None:
    arena = scene.arena
    # the attack is enqueued once the hostile tenant's own sibling job is done (the worker is up);
    # the neighbour's jobs are fed all along
    arena.sibling(1)
    arena.run(*WORKER, once=False, timeout=420, stages=[lambda a: scene.enqueue()])
    scene.judge()
    arena.verdict()


@pytest.mark.timeout(600)
def test_placeholder_out_of_place_is_refused_and_never_sent(scene: Scene) -> None:
    request_attacks(scene)
    _fight(scene)


@pytest.mark.timeout(600)
def test_a_response_that_echoes_the_secret_is_cut(scene: Scene) -> None:
    response_attacks(scene)
    _fight(scene)
