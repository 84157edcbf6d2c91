"""Handlers the chaos benchmark runs (`--app bench.chaos_app`).

`chaos.record` is trusted (inline): it appends one line per execution
(`job_id attempt pid`) to the log named in its payload, before it does its
work, so an execution cut short by kill -9 is counted too. One O_APPEND
write of a short line is atomic, so several workers may share the file.

The rest run sandboxed: `chaos.work` is the healthy tenants' short job; the
poison kinds (OOM, fork bomb, segfault, spin) and `chaos.fill_tmp` are the
hostile tenant's. A sandbox's work dir is private and thrown away, so the
sandboxed scenarios count executions from the jobs' attempts instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import time
from typing import Any

import tenantq


@tenantq.handler("chaos.record", isolation="inline")
def record(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, int]:
    line = f"{ctx.job_id} {ctx.attempt} {os.getpid()}\n".encode()
    fd = os.open(str(payload["log"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    time.sleep(float(payload.get("ms", 3)) / 1000)
    return {"job": ctx.job_id}


@tenantq.handler("chaos.work", timeout=10, memory_mb=128)
def work(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, str]:
    """A healthy job: a few ms of hashing."""
    h = hashlib.sha256(f"{ctx.tenant}:{ctx.job_id}".encode())
    for _ in range(int(payload.get("rounds", 2000)) if isinstance(payload, dict) else 2000):
        h = hashlib.sha256(h.digest())
    return {"checksum": h.hexdigest()[:12]}


@tenantq.handler("chaos.oom", timeout=10, memory_mb=128)
def oom(payload: Any, ctx: tenantq.JobContext) -> int:
    return len(bytearray(1024 * 1024 * 1024))


@tenantq.handler("chaos.forkbomb", timeout=10, memory_mb=128)
def forkbomb(payload: Any, ctx: tenantq.JobContext) -> None:
    children = []
    while True:
        pid = os.fork()
        if pid == 0:
            while True:
                os.fork()
        children.append(pid)


@tenantq.handler("chaos.segfault", timeout=10, memory_mb=128)
def segfault(payload: Any, ctx: tenantq.JobContext) -> None:
    ctypes.string_at(0)


@tenantq.handler("chaos.spin", timeout=2, memory_mb=128)
def spin(payload: Any, ctx: tenantq.JobContext) -> None:
    while True:
        pass


@tenantq.handler("chaos.fill_tmp", timeout=20, memory_mb=128)
def fill_tmp(payload: Any, ctx: tenantq.JobContext) -> None:
    with open(f"/tmp/fill-{ctx.job_id}", "wb") as fh:
        chunk = b"x" * (1024 * 1024)
        while True:
            fh.write(chunk)
            fh.flush()
