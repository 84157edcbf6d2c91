"""The egress proxy: one per sandboxed batch, listening on a Unix socket that
is bound into that batch's sandbox only (the sandbox itself has no network).

It speaks the two forms HTTP clients use through a proxy: `CONNECT host:port`
(HTTPS, tunnelled) and plain HTTP with an absolute URI. Each request is
checked against the batch's policy (its tenant's rules, narrowed by the
running job's handler) BEFORE any name is resolved, so a disallowed name
never reaches DNS; an allowed name is resolved here and every address it
resolves to that is not globally routable unicast is refused (`guard.py`: no
SSRF into the host, its Postgres or the cloud metadata service, however the
address is spelled), unless the operator explicitly allowed that network. A
refusal is a `403` whose reason names the host, which the job sees in its
client's error.

All proxies of a dispatcher share one asyncio event loop on one thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tenantq.egress.guard import AddressGuard as AddressGuard  # re-exported: callers import it from here
from tenantq.egress.inject import Injection, inject_head, request_guard, response_guard, smuggled
from tenantq.egress.policy import EgressPolicy, Rule, normalise_host, valid_host
from tenantq.egress.sockets import bound_socket
from tenantq.egress.stream_guard import Found, StreamGuard
from tenantq.egress.tls import TenantCA, upstream_context

HEADER_LIMIT = 64 * 1024
# connections one proxy (one sandbox) holds open at once: past it a new one
# is closed at once, so a guest cannot spend the host process's descriptors
# (rule H3; found holding 20,000 of them without it)
MAX_OPEN_STREAMS = 256
HEADER_TIMEOUT_SECONDS = 10.0
CONNECT_TIMEOUT_SECONDS = 10.0
MAX_RECORDED_BLOCKS = 50
# distinct host names one batch may ask for (rule E3); TENANTQ_EGRESS_MAX_NAMES_PER_BATCH
MAX_NAMES_PER_BATCH = 256
CHUNK = 64 * 1024
_PRINTABLE = re.compile(r"[^\x21-\x7e]")
# (job id, the handler's narrowing rules or None) of the job running now
CurrentJob = Callable[[], tuple[int | None, tuple[Rule, ...] | None]]


@dataclass
class EgressStats:
    """What one batch's sandbox did on the network."""

    allowed: int = 0
    blocked: int = 0
    bytes_out: int = 0  # sandbox -> destination
    bytes_in: int = 0
    blocks: list[dict[str, Any]] = field(default_factory=list)

    def record(self) -> dict[str, int]:
        return {"allowed": self.allowed, "blocked": self.blocked, "bytes_out": self.bytes_out,
                "bytes_in": self.bytes_in}


class BatchProxy:
    def __init__(self, path: Path, policy: EgressPolicy, guard: AddressGuard, current_job: CurrentJob,
                 on_event: Callable[[str, str, int], None] | None = None,
                 injections: tuple[Injection, ...] = (), ca: TenantCA | None = None,
                 upstream_tls: ssl.SSLContext | None = None, max_names: int = MAX_NAMES_PER_BATCH,
                 tls_pool: Executor | None = None) -> None:
        self.path = path
        # with injected secrets every CONNECT is intercepted (TLS terminated
        # with the tenant's CA), so no request can smuggle a placeholder
        self.injections = injections
        self.ca = ca if injections else None
        self.upstream_tls = upstream_tls
        self.policy = policy
        self.guard = guard
        self.current_job = current_job
        self.stats = EgressStats()
        self.on_event = on_event  # (outcome, direction-or-host, amount) for metrics
        self.server: asyncio.AbstractServer | None = None
        # open streams, cut when the batch ends (a later batch never inherits one)
        self.streams: set[asyncio.StreamWriter] = set()
        # the distinct host names this batch asked for (rule E3: at most max_names)
        self.names: set[str] = set()
        self.max_names = max_names
        # where leaf certificates are made: never on the loop all proxies share
        self.tls_pool = tls_pool

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.streams) >= MAX_OPEN_STREAMS:
            writer.close()
            return
        self.streams.add(writer)
        try:
            await self._handle(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            pass
        finally:
            self.streams.discard(writer)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEADER_TIMEOUT_SECONDS)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            await _reply(writer, 400, "tenantq egress: malformed or oversized request head")
            return
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        target = _parse_target(parts)
        if target is None:
            await _reply(writer, 400, "tenantq egress: expected CONNECT host:port or an absolute http:// URI")
            return
        method, host, port, path = target
        job_id, narrowed = self.current_job()
        shown = _PRINTABLE.sub("?", f"{host}:{port}")[:200]
        if not self.policy.allows(host, port, narrowed):
            scope = "its handler" if self.policy.allows(host, port) else f"tenant {self.policy.tenant}"
            await self._block(writer, job_id, shown, f"{shown} is not allowed for {scope}")
            return
        if host not in self.names:
            if len(self.names) >= self.max_names:
                # before DNS and before a certificate is made (rule E3)
                await self._block(writer, job_id, shown, f"{shown}: more than {self.max_names} host names in "
                                                         "one batch")
                return
            self.names.add(host)
        try:
            infos = await asyncio.wait_for(
                asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM),
                CONNECT_TIMEOUT_SECONDS)
        except (OSError, TimeoutError):
            await _reply(writer, 502, f"tenantq egress: cannot resolve {shown}")
            return
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        usable = [a for a in addresses if self.guard.refusal(a) is None]
        if not usable:
            reason = self.guard.refusal(addresses[0]) if addresses else "no address"
            await self._block(writer, job_id, shown, f"{shown} resolves to a {reason}")
            return
        if method == "CONNECT" and self.ca is not None:
            await self._intercept(reader, writer, host, port, usable, job_id, shown)
            return
        out_guard = None
        if method != "CONNECT" and self.injections:
            reason = smuggled(self.injections, head, host, port, tls=False)
            try:
                # a tenant with injected secrets: the body may not carry a
                # placeholder either; a head whose body cannot be framed is
                # refused before anything of it goes upstream
                out_guard = request_guard(self.injections, head)
            except Found as found:
                reason = reason or str(found)
            if reason is not None:
                await self._block(writer, job_id, shown, reason)
                return
        upstream = await self._connect(usable, port)
        if upstream is None:
            await _reply(writer, 502, f"tenantq egress: cannot connect to {shown}")
            return
        up_reader, up_writer = self._allowed(upstream)
        if method == "CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            origin = _origin_form(method, path, lines[1:])
            up_writer.write(origin)
            self._sent(origin)
        await self._relay(reader, writer, up_reader, up_writer, job_id, shown, out_guard, None)

    def _allowed(self, upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Count a request that got through, and track its upstream stream."""
        self.streams.add(upstream[1])
        self.stats.allowed += 1
        if self.on_event:
            self.on_event("allowed", "", 1)
        return upstream

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     up_reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter, job_id: int | None,
                     shown: str, out_guard: StreamGuard | None, in_guard: StreamGuard | None) -> None:
        """Copy both ways until both ends close; a guard that finds what must
        not pass cuts both (rule E2) and the batch gets an egress block."""
        tasks = {asyncio.ensure_future(self._pipe(reader, up_writer, "out", out_guard)),
                 asyncio.ensure_future(self._pipe(up_reader, writer, "in", in_guard))}
        try:
            while tasks:
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    reason = task.result()
                    if reason is not None:
                        # recorded first: the job may look as soon as its connection ends
                        await self._record_block(job_id, shown, reason)
                        writer.close()
                        up_writer.close()
        finally:
            for task in tasks:
                task.cancel()
            self.streams.discard(up_writer)
            up_writer.close()

    async def _intercept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str,
                         port: int, usable: list[str], job_id: int | None, shown: str) -> None:
        """Terminate the tunnel's TLS with the tenant's CA, inject secrets
        into their headers, and forward over verified TLS, both directions
        guarded (rule E2)."""
        assert self.ca is not None
        # made off the loop every batch's proxy shares (rule E3), before the
        # client may start its handshake
        loop = asyncio.get_running_loop()
        context = await loop.run_in_executor(self.tls_pool, self.ca.server_context, host)
        # the ClientHello must reach the TLS layer, not this stream's buffer
        transport = writer.transport
        assert isinstance(transport, asyncio.ReadTransport)
        transport.pause_reading()
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        # one deadline for the handshake and the head after it: a client that
        # never finishes its ClientHello holds a connection no longer than a
        # slow head does
        async with asyncio.timeout(HEADER_TIMEOUT_SECONDS):
            await writer.start_tls(context, ssl_handshake_timeout=HEADER_TIMEOUT_SECONDS)
            head = await reader.readuntil(b"\r\n\r\n")
        injected = inject_head(self.injections, head, host, port)
        if isinstance(injected, str):
            await self._block(writer, job_id, shown, injected)
            return
        try:
            # before anything goes upstream: a head whose body cannot be framed
            # (Content-Length and chunked, two lengths) is refused (rule E2)
            guards = request_guard(self.injections, injected), response_guard(self.injections, host, port)
        except Found as found:
            await self._block(writer, job_id, shown, str(found))
            return
        upstream = await self._connect(usable, port, tls_host=host)
        if upstream is None:
            await _reply(writer, 502, f"tenantq egress: cannot connect to {shown} over verified TLS")
            return
        up_reader, up_writer = self._allowed(upstream)
        up_writer.write(injected)
        self._sent(injected)
        await self._relay(reader, writer, up_reader, up_writer, job_id, shown, *guards)

    async def _connect(self, addresses: list[str], port: int, *, tls_host: str | None = None,
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        for address in addresses:
            try:
                if tls_host is None:
                    opened = asyncio.open_connection(address, port)
                else:
                    tls = self.upstream_tls or upstream_context()
                    opened = asyncio.open_connection(address, port, ssl=tls, server_hostname=tls_host)
                return await asyncio.wait_for(opened, CONNECT_TIMEOUT_SECONDS)
            except (OSError, TimeoutError, ssl.SSLError):
                continue
        return None

    def _sent(self, head: bytes) -> None:
        """Count a request head the proxy wrote upstream itself."""
        self.stats.bytes_out += len(head)
        if self.on_event:
            self.on_event("bytes", "out", len(head))

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: str,
                    guard: StreamGuard | None = None) -> str | None:
        """Copy until EOF; with a guard, stop (returning why, `dst` left open
        for the caller to record it first) at what must not pass."""
        try:
            while True:
                chunk = await src.read(CHUNK)
                if direction == "out":
                    self.stats.bytes_out += len(chunk)
                else:
                    self.stats.bytes_in += len(chunk)
                if self.on_event and chunk:
                    self.on_event("bytes", direction, len(chunk))
                try:
                    passing = chunk if guard is None else guard.feed(chunk) if chunk else guard.end()
                except Found as found:
                    return found.reason
                if passing:
                    dst.write(passing)
                    await dst.drain()
                if not chunk:
                    break
        except (OSError, asyncio.IncompleteReadError):
            pass
        with contextlib.suppress(OSError, RuntimeError, AttributeError):
            if dst.can_write_eof():
                dst.write_eof()
            else:  # TLS cannot half-close: the other side learns of the end by a close
                dst.close()
        return None

    async def _block(self, writer: asyncio.StreamWriter, job_id: int | None, host: str, reason: str) -> None:
        await self._record_block(job_id, host, reason)
        await _reply(writer, 403, f"tenantq egress: {reason}")

    async def _record_block(self, job_id: int | None, host: str, reason: str) -> None:
        self.stats.blocked += 1
        if len(self.stats.blocks) < MAX_RECORDED_BLOCKS:
            self.stats.blocks.append({"job_id": job_id, "host": host, "reason": reason, "at": time.time()})
        if self.on_event:
            self.on_event("blocked", host, 1)


def _parse_target(parts: list[str]) -> tuple[str, str, int, str] | None:
    """(method, host, port, origin-form path) of a proxy request line."""
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return None
    method, target = parts[0], parts[1]
    if not method.isalpha() or not method.isupper():
        return None
    if method == "CONNECT":
        host, sep, port_text = target.rpartition(":")
        # isascii: "²".isdigit() is true and int("²") raises (found by fuzz/proxy_head.py)
        if not sep or not (port_text.isascii() and port_text.isdigit()) or len(port_text) > 5 \
                or not 0 < int(port_text) < 65536:
            return None
        return _named(method, normalise_host(host), int(port_text), "")
    try:
        url = urlsplit(target)
        port = url.port or 80
    except ValueError:
        return None
    if url.scheme != "http" or not url.hostname:
        return None
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    return _named(method, normalise_host(url.hostname), port, path)


def _named(method: str, host: str, port: int, path: str) -> tuple[str, str, int, str] | None:
    # an empty or over-long label is a 400 here, not an encoding error inside
    # getaddrinfo that would close the connection without a reply
    if host.startswith("*.") or not valid_host(host):
        return None
    return method, host, port, path


def _origin_form(method: str, path: str, header_lines: list[str]) -> bytes:
    kept = [h for h in header_lines if h and not h.lower().startswith(("proxy-", "connection:"))]
    head = "\r\n".join([f"{method} {path} HTTP/1.1", *kept, "Connection: close"])
    return (head + "\r\n\r\n").encode("latin-1")


async def _reply(writer: asyncio.StreamWriter, status: int, message: str) -> None:
    # the reason phrase carries the message: clients put it in their error
    reason = message.replace("\r", " ").replace("\n", " ")[:300]
    body = (message + "\n").encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nX-Tenantq-Egress: refused\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    writer.write(head.encode("latin-1", "replace") + body)
    with contextlib.suppress(OSError):
        await writer.drain()


class EgressHub:
    """One event loop thread serving every batch proxy of this dispatcher."""

    def __init__(self, guard: AddressGuard | None = None, upstream_tls: ssl.SSLContext | None = None,
                 max_names: int = MAX_NAMES_PER_BATCH) -> None:
        self.guard = guard or AddressGuard()
        self.upstream_tls = upstream_tls
        self.max_names = max_names
        # leaf certificates are made here, not on the loop (rule E3)
        self.tls_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tenantq-egress-tls")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tenantq-egress", daemon=True)
        self._thread.start()

    def open(self, path: Path, policy: EgressPolicy, current_job: CurrentJob,
             on_event: Callable[[str, str, int], None] | None = None,
             injections: tuple[Injection, ...] = (), ca: TenantCA | None = None) -> BatchProxy:
        """Listen on `path` (a new socket the sandbox's uid may connect to)."""
        proxy = BatchProxy(path, policy, self.guard, current_job, on_event, injections, ca, self.upstream_tls,
                           self.max_names, self.tls_pool)

        async def start() -> None:
            proxy.server = await asyncio.start_unix_server(proxy.handle, sock=bound_socket(path),
                                                           limit=HEADER_LIMIT)

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(timeout=10)
        return proxy

    def close(self, proxy: BatchProxy) -> EgressStats:
        """Stop listening and cut every connection of this batch."""

        async def stop() -> None:
            if proxy.server is not None:
                proxy.server.close()
            for stream in list(proxy.streams):
                stream.close()
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=10)
        with contextlib.suppress(FileNotFoundError):
            proxy.path.unlink()
        return proxy.stats

    def shutdown(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()
        self.tls_pool.shutdown(wait=False, cancel_futures=True)
