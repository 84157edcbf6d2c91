"""The host side of a sandboxed batch's `ctx.call`: a Unix socket in the
sandbox's egress dir (bound read-only into that sandbox only, like the
egress proxy's), served while the batch runs and closed, every connection
cut, when it ends (docs/security.md, rule F1).

On it, a job sends one request frame per connection (guest/protocol.py
framing: ten digits, a newline, a JSON object `{"name": ..., "args": {...}}`)
and reads one reply frame. The host reads at most the header and the
announced length, refused past `CallLimits.max_request_bytes` before a byte
of the body is read; each read has a deadline; connections are bounded; the
gate (host_functions.py) decides everything else from the host's records.

A connection belongs to the job in flight when it was accepted: when a job
ends (its processes are dead by then, rule C2) the session calls
`job_ended()`, which closes every connection of that job and every one still
waiting to be accepted, under the lock the accepting thread takes, so no
request a job made can be answered as the next job of the batch.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from pathlib import Path

from tenantq.egress.sockets import bound_socket
from tenantq.guest.protocol import HEADER_BYTES, FrameError, decode_body, encode
from tenantq.host_functions import Caller, CallGate

SOCKET_NAME = "hostfn.sock"


class CallServer:
    def __init__(self, path: Path, gate: CallGate) -> None:
        self.path = path
        self.gate = gate
        self._listener = bound_socket(path)  # non-blocking: accepted only under the lock
        self._lock = threading.Lock()
        # connection -> the generation (one per job) it was accepted in
        self._open: dict[socket.socket, int] = {}
        self._generation = 0
        self._closed = False
        # connections open at once: the calls it may have in flight, and spares
        self._max_open = gate.limits.in_flight_per_batch + gate.limits.spare_connections
        self._thread = threading.Thread(target=self._accept, name="tenantq-hostfn-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        while True:
            poller.poll(200)
            with self._lock:
                if self._closed:
                    return
                try:
                    conn, _ = self._listener.accept()
                except BlockingIOError:
                    continue
                except OSError:
                    return
                if len(self._open) >= self._max_open:
                    conn.close()  # over the bound: the guest sees its connection end
                    continue
                generation = self._open[conn] = self._generation
                # the job this connection belongs to, fixed now (H2)
                caller = self.gate.current()
            threading.Thread(target=self._serve, args=(conn, generation, caller), name="tenantq-hostfn",
                             daemon=True).start()

    def job_ended(self, job_id: int) -> dict[str, object] | None:
        """The running job ended: its connections, accepted or waiting, are
        cut; returns its calls, for its attempt's record."""
        with self._lock:
            self._generation += 1
            stale = [conn for conn, generation in self._open.items() if generation != self._generation]
            while True:
                try:
                    waiting, _ = self._listener.accept()
                except OSError:  # BlockingIOError: none left
                    break
                stale.append(waiting)
        for conn in stale:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            if conn not in self._open:
                conn.close()
        return self.gate.take_job(job_id)

    def _current(self, generation: int) -> bool:
        with self._lock:
            return generation == self._generation and not self._closed

    def _serve(self, conn: socket.socket, generation: int, caller: Caller | None) -> None:
        try:
            conn.settimeout(self.gate.limits.read_timeout)
            reply = self._answer(conn, generation, caller)
            if reply is not None:
                conn.sendall(encode(reply))
        except (OSError, FrameError):
            pass
        finally:
            with self._lock:
                self._open.pop(conn, None)
            conn.close()

    def _answer(self, conn: socket.socket, generation: int,
                caller: Caller | None) -> dict[str, object] | None:
        header = _exactly(conn, HEADER_BYTES)
        if header is None:
            return None
        text = header[:-1]
        if header[-1:] != b"\n" or not text.isdigit() or not text.isascii():
            return self.gate.refuse("refused: a request is a frame: ten digits, a newline, a JSON object",
                                    caller)
        length = int(text)
        limit = self.gate.limits.max_request_bytes
        if length > limit:
            return self.gate.refuse(f"refused: a request of {length} bytes exceeds {limit}", caller)
        body = _exactly(conn, length)
        if body is None:
            return None
        try:
            request = decode_body(body)
        except FrameError as exc:
            return self.gate.refuse(f"refused: {exc}", caller)
        if not self._current(generation):
            # made by a job that has ended since (C2 killed its processes)
            return self.gate.refuse("refused: the job that opened this connection has ended", caller)
        return self.gate.call(request.get("name"), request.get("args"), length, caller=caller)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._open = list(self._open), {}
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)
        self.gate.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _exactly(conn: socket.socket, count: int) -> bytes | None:
    chunks: list[bytes] = []
    while count:
        chunk = conn.recv(min(count, 1 << 16))
        if not chunk:
            return None
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)
