"""Handlers for `./run bench boundary`: an honest job, and jobs that flood
what crosses the sandbox boundary."""

from __future__ import annotations

import os
from typing import Any

import tenantq

GIB = 1 << 30
CHUNK = 1 << 20


@tenantq.handler("boundary.echo", timeout=10, memory_mb=128)
def echo(payload: Any, ctx: tenantq.JobContext) -> Any:
    return payload


@tenantq.handler("boundary.print", timeout=120, memory_mb=128)
def print_a_gib(payload: Any, ctx: tenantq.JobContext) -> int:
    """1 GiB on stdout and on stderr."""
    block = b"x" * CHUNK
    for _ in range(GIB // CHUNK):
        os.write(1, block)
        os.write(2, block)
    return 0


@tenantq.handler("boundary.line", timeout=120, memory_mb=128)
def one_gib_line(payload: Any, ctx: tenantq.JobContext) -> int:
    """A 1 GiB line without a newline on every descriptor it has (the
    result pipe included), written as fast as they take it."""
    block = b"{" * CHUNK
    fds = [fd for fd in range(1, 64) if _is_open(fd)]
    for _ in range(GIB // CHUNK):
        for fd in list(fds):
            try:
                os.write(fd, block)
            except OSError:
                fds.remove(fd)
        if not fds:
            break
    return 0


@tenantq.handler("boundary.result", timeout=60, memory_mb=512)
def huge_result(payload: Any, ctx: tenantq.JobContext) -> str:
    """A 100 MiB result (the store's limit is 1 MiB)."""
    return "x" * (100 << 20)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
