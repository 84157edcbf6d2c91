"""The egress proxy's own parsing and bounds (docs/egress.md "Enforcement" and
"Host-side credentials", docs/security.md rules E1-E3), attacked on real
sockets without a sandbox, through the surface tests/egress/ uses to build a
proxy (tests/adversarial/egress_world.py): malformed, oversized and
header-injected heads, absolute-URI and CONNECT-target tricks (userinfo,
backslashes, fragments, IPv6 literals, ports 0 and 65536, disguised
loopback, trailing dots, upper case, non-ASCII), more connections than the
256 a proxy holds, slowloris heads against the 10 s deadline, a TLS client
that never finishes its handshake, pipelined and keep-alive second requests
on an intercepted connection, and more than 256 host names in one batch.

The oracle for the tricks is a clear-text upstream the tenant may not reach
(`F`, on the allowed host's address): it must never see a connection. Every
reply to a request naming it must be a refusal (400 or 403)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenantq.egress.policy import EgressPolicy, parse_rules
from tests.adversarial.egress_leaks import placeholder_seen, value_leaks
from tests.adversarial.egress_world import (
    PLACEHOLDER,
    VALUE,
    World,
    ask,
    build,
    connect,
    intercepted,
    read_until_closed,
    request,
    reset_hwm,
    status_of,
    vm_hwm_kb,
)

HEAD_SECONDS = 10.0  # docs/egress.md: a request head must arrive within 10 s
MAX_HEAD = 64 << 10  # ... and be at most 64 KiB
MAX_CONNECTIONS = 256
MAX_NAMES = 256
SLACK = 3.0
_ORDINARY = "GET http://127.0.0.1:{a}/m/digest/ok HTTP/1.1\r\nConnection: close\r\n\r\n"


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    yield from build(tmp_path)


def _refused(reply: bytes) -> bool:
    return status_of(reply).split(" ")[1:2] in (["400"], ["403"])


def _judge_forbidden(world: World, replies: dict[str, bytes], *, refusals: bool = True) -> list[str]:
    """F never contacted, no name outside the rules resolved; with `refusals`,
    every reply a 400 or 403 (or, for a head over the bound, the connection cut)."""
    problems = [f"{label!r}: the proxy answered {status_of(r)!r}, not 400/403" for label, r in replies.items()
                if refusals and not (_refused(r) or ("64 KiB" in label and r == b""))]
    if world.forbidden.connections:
        heads = [bytes(c.raw[:120]) for c in world.forbidden.connections]
        problems.append(f"the upstream the tenant may not reach got {len(heads)} connection(s): {heads}")
    lookups = [n for n in world.lookups if n not in ("localhost", "127.0.0.1")]
    if lookups:
        problems.append(f"names no rule allows reached DNS: {lookups}")
    return problems


def test_malformed_and_injected_heads_are_refused_and_reach_nobody(world: World) -> None:
    a, f = world.a, world.f
    heads = {
        "LF only": f"GET http://127.0.0.1:{f}/ HTTP/1.1\nHost: x\n\n".encode(),
        "bare CR smuggles a Host": f"GET http://127.0.0.1:{f}/ HTTP/1.1\rHost: 127.0.0.1:{a}\r\n\r\n"
                                   .encode(),
        "NUL in the authority": f"GET http://127.0.0.1:{f}\x00.ok/ HTTP/1.1\r\n\r\n".encode(),
        "NUL in a CONNECT target": f"CONNECT 127.0.0.1\x00:{f} HTTP/1.1\r\n\r\n".encode(),
        "tabs for spaces": f"GET\thttp://127.0.0.1:{f}/\tHTTP/1.1\r\n\r\n".encode(),
        "two spaces": f"GET  http://127.0.0.1:{f}/  HTTP/1.1\r\n\r\n".encode(),
        "obs-fold request line": f"GET http://127.0.0.1:{f}/\r\n HTTP/1.1\r\n\r\n".encode(),
        "HTTP/0.9": f"GET http://127.0.0.1:{f}/\r\n\r\n".encode(),
        "h2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        "head over 64 KiB": f"GET http://127.0.0.1:{f}/ HTTP/1.1\r\nX: {'a' * MAX_HEAD}\r\n\r\n".encode(),
        "request line over 64 KiB": f"GET http://127.0.0.1:{f}/{'b' * MAX_HEAD} HTTP/1.1\r\n\r\n".encode(),
        "10,000 headers": (f"GET http://127.0.0.1:{f}/ HTTP/1.1\r\n" + "X: y\r\n" * 10_000 + "\r\n").encode(),
    }
    replies = {label: ask(world.proxy, head) for label, head in heads.items()}
    problems = _judge_forbidden(world, replies)
    ok = ask(world.proxy, _ORDINARY.format(a=a).encode())
    if not status_of(ok).startswith("HTTP/1.1 200"):
        problems.append(f"the proxy no longer serves an ordinary request: {status_of(ok)!r}")
    assert not problems, "malformed heads:\n- " + "\n- ".join(problems)


def test_absolute_uri_and_connect_target_tricks_never_reach_a_disallowed_host(world: World) -> None:
    a, f = world.a, world.f
    uris = [f"http://127.0.0.1:{a}@127.0.0.1:{f}/", f"http://127.0.0.1:{f}#@127.0.0.1:{a}/",
            f"http://127.0.0.1:{f}\\@127.0.0.1:{a}/", f"http://127.0.0.1:{f}?@127.0.0.1:{a}/",
            f"http://127.0.0.1:{a}%2f@127.0.0.1:{f}/", f"http://localhost:{a}\\\\@127.0.0.1:{f}/",
            f"http://[::ffff:127.0.0.1]:{f}/", f"http://[::ffff:7f00:1]:{f}/", f"http://[::1]:{a}/",
            f"http://[127.0.0.1]:{f}/", f"http://127.0.0.1:{a}:{f}/", f"http://127.0.0.1:{f}:{a}/",
            "http://127.0.0.1:0/", "http://127.0.0.1:65536/", f"http://127.0.0.1:{65536 + f}/",
            f"http://127.0.0.1:-{f}/", f"http://127.0.0.1:+{f}/", f"http://127.0.0.1: {f}/",
            f"http://127.1:{f}/", f"http://2130706433:{f}/", f"http://0x7f000001:{f}/",
            f"http://0177.0.0.1:{f}/", f"http://LOCALHOST:{f}/", f"http://localhost.:{f}/",
            f"http://loca\u24dbhost:{f}/", f"http://xn--localhost-:{f}/", f"HTTP://127.0.0.1:{f}/",
            f"https://127.0.0.1:{f}/", f"http:/127.0.0.1:{f}/", f"http:\\\\127.0.0.1:{f}\\",
            f"//127.0.0.1:{f}/", f"http://127.0.0.1%3a{f}/", f"ws://127.0.0.1:{f}/"]
    replies = {}
    for uri in uris:
        replies[uri] = ask(world.proxy, f"GET {uri} HTTP/1.1\r\nHost: 127.0.0.1:{a}\r\n"
                                        f"Connection: close\r\n\r\n".encode())
    replies["Host header names F"] = ask(world.proxy, f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{f}\r\n\r\n"
                                                       .encode())
    targets = [f"127.0.0.1:{a}@127.0.0.1:{f}", f"127.0.0.1:{f}@127.0.0.1:{a}", f"127.0.0.1:{a}:{f}",
               f"[::ffff:127.0.0.1]:{f}", f"127.0.0.1:{f}#{a}", f"http://127.0.0.1:{f}/",
               f"127.0.0.1:{a}/../{f}", "127.0.0.1:0", "127.0.0.1:65536", f"127.0.0.1:{f} ",
               f"127.0.0.1:+{f}", "127.0.0.1", f":{f}", f"[127.0.0.1]:{f}", f"localhost.:{f}",
               f"LOCALHOST:{f}", f"127.0.0.1:0{f}", f"127.0.0.1:{f}\t{a}"]
    for target in targets:
        replies[f"CONNECT {target}"] = ask(world.proxy, f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
    # a trick may be read as a request to A (allowed); it must never be one to F
    problems = _judge_forbidden(world, replies, refusals=False)
    ok = ask(world.proxy, _ORDINARY.format(a=a).encode())
    if not status_of(ok).startswith("HTTP/1.1 200"):
        problems.append(f"the proxy no longer serves an ordinary request: {status_of(ok)!r}")
    assert not problems, "URI tricks:\n- " + "\n- ".join(problems)


def test_more_connections_than_the_bound_are_closed_at_once_and_the_neighbour_is_served(world: World) -> None:
    held: list[socket.socket] = []
    refused = 0  # a connect the proxy's listening socket refuses (its backlog full) is closed at once too
    try:
        for _ in range(MAX_CONNECTIONS + 60):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(str(world.proxy.path))
            except BlockingIOError:
                refused += 1
                s.close()
                continue
            held.append(s)
        t0 = time.monotonic()
        closed = refused
        for s in held:
            _, how = read_until_closed(s, max(0.01, t0 + 2.0 - time.monotonic()))
            closed += how != "open"
        t = time.monotonic()
        reply = ask(world.neighbour, f"GET http://127.0.0.1:{world.a}/m/digest/n HTTP/1.1\r\n"
                                     f"Connection: close\r\n\r\n".encode())
        neighbour_seconds = time.monotonic() - t
    finally:
        for s in held:
            s.close()
    problems = []
    if closed < MAX_CONNECTIONS + 60 - MAX_CONNECTIONS:
        problems.append(f"{MAX_CONNECTIONS + 60} connections at once: only {closed} were closed within 2 s "
                        f"(docs: at most {MAX_CONNECTIONS} open, a new one past that closed at once)")
    if not status_of(reply).startswith("HTTP/1.1 200") or neighbour_seconds > 2.0:
        problems.append(f"the neighbour's proxy: {status_of(reply)!r} after {neighbour_seconds:.1f} s")
    # the proxy learns of the closed sockets as its loop reads their EOFs: it must serve again within 2 s
    deadline = time.monotonic() + 2.0
    while True:
        again = ask(world.proxy, f"GET http://127.0.0.1:{world.a}/m/digest/again HTTP/1.1\r\n\r\n".encode())
        if status_of(again).startswith("HTTP/1.1 200") or time.monotonic() > deadline:
            break
        time.sleep(0.05)  # poll within the deadline
    if not status_of(again).startswith("HTTP/1.1 200"):
        problems.append(f"after the flood the proxy does not serve: {status_of(again)!r}")
    assert not problems, "\n".join(problems)


def _trickle(s: socket.socket, data: bytes, stop: threading.Event) -> None:
    for i in range(len(data)):
        if stop.wait(0.4):
            return
        try:
            s.sendall(data[i:i + 1])
        except OSError:
            return


def _closed_within(sockets: list[socket.socket], data: bytes, seconds: float) -> list[float | None]:
    """Trickle `data` a byte at a time into each; when did the proxy close each (None: never)."""
    stop = threading.Event()
    threads = [threading.Thread(target=_trickle, args=(s, data, stop), daemon=True) for s in sockets]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    ends: list[float | None] = []
    for s in sockets:
        _, how = read_until_closed(s, max(0.01, t0 + seconds - time.monotonic()))
        ends.append(None if how == "open" else time.monotonic() - t0)
    stop.set()
    for t in threads:
        t.join(timeout=5)
    return ends


def test_slowloris_heads_are_cut_at_the_head_deadline(world: World) -> None:
    head = f"GET http://127.0.0.1:{world.a}/m/digest/slow HTTP/1.1\r\n" + "X-Pad: y\r\n" * 40
    sockets = [connect(world.proxy) for _ in range(20)]
    inner = intercepted(world)
    try:
        ends = _closed_within([*sockets, inner], head.encode(), HEAD_SECONDS + SLACK)
        reply = ask(world.neighbour, f"GET http://127.0.0.1:{world.a}/m/digest/n HTTP/1.1\r\n\r\n".encode())
    finally:
        for s in [*sockets, inner]:
            s.close()
    outer_open = [e for e in ends[:-1] if e is None]
    assert not outer_open and ends[-1] is not None and status_of(reply).startswith("HTTP/1.1 200"), (
        f"docs/egress.md: a request head must arrive within {HEAD_SECONDS:g} s: {len(outer_open)} of 20 "
        f"slowloris heads to the proxy were still open after {HEAD_SECONDS + SLACK:g} s; the inner head "
        f"of an intercepted tunnel: {'still open' if ends[-1] is None else f'cut after {ends[-1]:.1f} s'}; "
        f"neighbour: {status_of(reply)!r}")


def test_a_tls_client_that_never_finishes_its_handshake_is_dropped(world: World) -> None:
    stalls: list[socket.socket] = []
    try:
        for partial in (b"", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"):
            stalls.append(s := connect(world.proxy))
            s.sendall(f"CONNECT localhost:{world.s} HTTP/1.1\r\n\r\n".encode())
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            s.sendall(partial)
        t0 = time.monotonic()
        ends = [read_until_closed(s, max(0.01, t0 + HEAD_SECONDS + SLACK - time.monotonic()))[1]
                for s in stalls]
    finally:
        for s in stalls:
            s.close()
    assert "open" not in ends, (
        f"an intercepted tunnel whose TLS handshake never finishes was still open after "
        f"{HEAD_SECONDS + SLACK:g} s (nothing sent: {ends[0]}, a partial ClientHello: {ends[1]}): it holds "
        f"one of the proxy's {MAX_CONNECTIONS} connections for the whole batch (docs/egress.md bounds a "
        f"request head to {HEAD_SECONDS:g} s but say nothing of the handshake before it)")


@pytest.mark.parametrize("how", ["pipelined", "keep-alive"])
def test_a_second_request_on_an_intercepted_connection_gets_no_secret(world: World, how: str) -> None:
    first = request(f"{how}-first", world.s, close=False)
    seconds = [request(f"{how}-auth-second", world.s, path="/m/echo/a"),
               request(f"{how}-debug-second", world.s, path="/m/digest/d",
                       extra=(f"X-Debug: {PLACEHOLDER}",))]
    got = []
    for second in seconds:
        with intercepted(world) as tls:
            if how == "pipelined":
                tls.sendall(first + second)
            else:
                tls.sendall(first)
                tls.recv(65536)
                with contextlib.suppress(OSError):
                    tls.sendall(second)
            got.append(read_until_closed(tls, 10)[0])
    problems = [f"{how}: {why} of the value came back to the client" for data in got
                for why in value_leaks(data, VALUE)]
    for req in world.secure.requests:
        injected = VALUE in "".join(req.header_values("authorization"))
        if (req.tag or "").endswith("-second") and injected:
            problems.append(f"{how}: the second request {req.tag} reached upstream with the secret injected "
                            f"(docs/egress.md: one request per connection)")
    if any(placeholder_seen(bytes(c.raw)) for c in world.secure.connections):
        problems.append(f"{how}: the upstream received the placeholder")
    assert not problems, "\n".join(problems)


def test_more_than_256_names_in_a_batch_are_refused_before_dns(world: World, tmp_path: Path) -> None:
    policy = EgressPolicy("mallory", parse_rules("*.flood.invalid:443"))
    proxy = world.hub.open(tmp_path / "flood.sock", policy, lambda: (9, None))
    try:
        replies = [ask(proxy, f"CONNECT n{i}.flood.invalid:443 HTTP/1.1\r\n\r\n".encode(), 20)
                   for i in range(MAX_NAMES + 4)]
        upper = ask(proxy, b"CONNECT N999.FLOOD.INVALID:443 HTTP/1.1\r\n\r\n")
        again = ask(proxy, b"CONNECT n0.flood.invalid:443 HTTP/1.1\r\n\r\n")
    finally:
        world.close(proxy)
    looked_up = {n.lower().rstrip(".") for n in world.lookups} - {"localhost", "127.0.0.1"}
    past = [status_of(r) for r in replies[MAX_NAMES:]] + [status_of(upper)]
    problems = []
    if not all(s.startswith("HTTP/1.1 403") and "256 host names" in s for s in past):
        problems.append(f"a new name past {MAX_NAMES} was not refused with the name bound's reason: {past}")
    resolved_late = sorted(looked_up & {f"n{i}.flood.invalid" for i in range(MAX_NAMES, MAX_NAMES + 4)}
                           | ({"n999.flood.invalid"} & looked_up))
    if resolved_late:
        problems.append(f"names past the bound reached DNS: {resolved_late}")
    if "256 host names" in status_of(again):
        problems.append(f"a name already used in the batch was refused by the bound: {status_of(again)!r}")
    assert not problems, "rule E3:\n- " + "\n- ".join(problems)


def test_an_endless_head_costs_bounded_memory(world: World) -> None:
    """A head that never ends (no CRLFCRLF), 4 MiB on each of 32 connections at once."""
    reset_hwm()
    base = vm_hwm_kb()
    junk = b"GET http://127.0.0.1:%d/ HTTP/1.1\r\nX: " % world.a + b"z" * (4 << 20)
    ends: list[str] = []

    def flood() -> None:
        with connect(world.proxy) as s:
            try:
                s.sendall(junk)
            except OSError:
                ends.append("cut")
                return
            ends.append(read_until_closed(s, HEAD_SECONDS + SLACK)[1])

    threads = [threading.Thread(target=flood) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    growth_mb = (vm_hwm_kb() - base) / 1024
    assert growth_mb < 48 and "open" not in ends, (
        f"32 endless heads of 4 MiB: the process grew {growth_mb:.0f} MB (the proxy should stop reading "
        f"at {MAX_HEAD >> 10} KiB), connections: {sorted(set(ends))}")
