"""The host <-> guest control channel: what crosses it and how it is framed.
Stdlib only (imported inside the sandbox and by the host).

Both directions carry frames: a fixed-size header of ten ASCII digits and a
newline (the body's length in bytes), then a UTF-8 JSON object. Host to
guest, on the guest runner's stdin:

    {"op": "batch", "ttl": s, "job_uid": n}   the parent forks the batch supervisor
    {...secrets...}                           read only by the supervisor
    {"op": "job", "seq": k, "job": {...}}     one at a time, after the previous job_end
    {"op": "end"}                             no more jobs in this batch

Guest to host, on the runner's stdout (written only by the runner's own
processes, never by a job's: see docs/security.md, rule C1):

    {"status": "ready"} | {"status": "fatal", "error": "..."}    boot
    {"status": "batch_ready"}                                     the supervisor has the secrets
    {"status": "job_end", "seq": k, "ok": true, "result": ...}
    {"status": "job_end", "seq": k, "ok": false, "reason": "...", "error": "..."}
    {"status": "batch_end", "exit": n | "signal": n | "timeout": s}

The host hands out one job at a time and attributes the one `job_end` it
then reads to that job, so which job was running is the host's own
bookkeeping, never a line a job wrote.
"""

from __future__ import annotations

import json
import os
from typing import Any

HEADER_BYTES = 11  # b"%010d\n"
# the store's limit on a job's result (dispatch/outcome.py has the same)
MAX_RESULT_BYTES = 1 << 20
# the largest frame either side sends: a job's result (1 MiB of JSON, the
# store's limit) or its payload (256 KiB), plus the envelope
MAX_FRAME_BYTES = (1 << 20) + (64 << 10)
# results and payloads nest at most this deep (JSON decoders recurse)
MAX_JSON_DEPTH = 64
MAX_ERROR_CHARS = 4000
# a ctx.call request (name and args as JSON): the host refuses larger ones
# before reading them (dispatch/executors/host_calls.py)
MAX_CALL_REQUEST_BYTES = 64 << 10
OUTPUT_TAIL_BYTES = 1024
JOB_REASONS = ("exception", "timeout", "oom", "unknown_kind", "crashed", "unstorable", "cancelled")


class FrameError(Exception):
    """A frame that breaks the protocol."""


def encode(value: object) -> bytes:
    body = json.dumps(value, allow_nan=False, default=repr).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return b"%010d\n" % len(body) + body


def parse_header(header: bytes) -> int:
    """The body length a header announces; FrameError unless it is exactly
    ten ASCII digits, a newline, and at most MAX_FRAME_BYTES."""
    if len(header) != HEADER_BYTES or header[-1:] != b"\n" or not header[:-1].isdigit() \
            or not header[:-1].isascii():
        raise FrameError(f"bad frame header {header[:HEADER_BYTES]!r}")
    length = int(header[:-1])
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return length


def json_depth(value: Any) -> int:
    """Nesting depth of a decoded JSON value, without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in item)
    return deepest


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    # 1e400 is valid JSON text that Python reads as infinity
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:40]} is not a finite number")
    return value


def decode_body(body: bytes) -> dict[str, Any]:
    """A frame body as a JSON object; FrameError for anything else (NaN and
    Infinity included, and numbers too large to be finite, like 1e400: they
    are not storable, rule H4)."""
    try:
        value = json.loads(body, parse_constant=_no_constants, parse_float=_finite)
    except (ValueError, RecursionError) as exc:
        raise FrameError(f"frame body is not JSON: {str(exc)[:100]}") from None
    if not isinstance(value, dict):
        raise FrameError(f"frame body is a JSON {type(value).__name__}, not an object")
    return value


class FrameFile:
    """Blocking frame reads from a file descriptor (the guest side). Reads
    in as few system calls as it can: gVisor makes each one expensive."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def _exactly(self, count: int) -> bytes | None:
        chunks: list[bytes] = []
        while count:
            chunk = os.read(self.fd, count)
            if not chunk:
                return None
            chunks.append(chunk)
            count -= len(chunk)
        return b"".join(chunks)

    def read(self) -> dict[str, Any] | None:
        """The next frame, or None at EOF."""
        header = self._exactly(HEADER_BYTES)
        if header is None:
            return None
        body = self._exactly(parse_header(header))
        return None if body is None else decode_body(body)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
