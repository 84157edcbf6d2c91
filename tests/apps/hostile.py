"""Handlers for the sandbox tests: well-behaved ones and hostile ones.
All run sandboxed (the default isolation)."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any

import tenantq


@tenantq.handler("box.echo", timeout=10, memory_mb=128)
def echo(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    return {"tenant": ctx.tenant, "payload": payload, "uid": os.getuid(), "pid": os.getpid()}


@tenantq.handler("box.env", timeout=10, memory_mb=128)
def env(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    """Prints its whole environment: only this tenant's secrets may show."""
    return {"environ": dict(os.environ), "ctx_env": dict(ctx.env)}


@tenantq.handler("box.alloc", timeout=20, memory_mb=256)
def alloc(payload: dict[str, Any], ctx: tenantq.JobContext) -> int:
    block = bytearray(int(payload["mb"]) * 1024 * 1024)
    return len(block)


@tenantq.handler("box.forkbomb", timeout=10, memory_mb=128)
def forkbomb(payload: Any, ctx: tenantq.JobContext) -> None:
    children = []
    while True:
        pid = os.fork()
        if pid == 0:
            while True:
                os.fork()
        children.append(pid)


@tenantq.handler("box.segfault", timeout=10, memory_mb=128)
def segfault(payload: Any, ctx: tenantq.JobContext) -> None:
    import ctypes

    ctypes.string_at(0)


@tenantq.handler("box.spin", timeout=2, memory_mb=128)
def spin(payload: Any, ctx: tenantq.JobContext) -> None:
    while True:
        pass


@tenantq.handler("box.spin_c", timeout=2, memory_mb=128)
def spin_c(payload: Any, ctx: tenantq.JobContext) -> None:
    """Blocks signals, so only the host's budget can stop it."""
    import signal

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    while True:
        pass


@tenantq.handler("box.fill_tmp", timeout=20, memory_mb=128)
def fill_tmp(payload: Any, ctx: tenantq.JobContext) -> None:
    with open("/tmp/fill", "wb") as fh:
        chunk = b"x" * (1024 * 1024)
        while True:
            fh.write(chunk)
            fh.flush()


@tenantq.handler("box.read", timeout=10, memory_mb=128)
def read(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, str]:
    """Try to read host paths; report what happened for each."""
    out: dict[str, str] = {}
    for path in payload["paths"]:
        try:
            p = Path(path)
            out[path] = "DIR:" + ",".join(sorted(os.listdir(p))[:20]) if p.is_dir() else \
                "READ:" + p.read_text(errors="replace")[:200]
        except OSError as exc:
            out[path] = f"{type(exc).__name__}: {exc.strerror}"
    return out


@tenantq.handler("box.connect", timeout=10, memory_mb=128)
def connect(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, str]:
    out: dict[str, str] = {}
    for host, port in payload["targets"]:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(3)
        try:
            s.connect((host, int(port)))
            out[f"{host}:{port}"] = "CONNECTED"
        except OSError as exc:
            out[f"{host}:{port}"] = f"{type(exc).__name__}: {exc}"
        finally:
            s.close()
    return out


@tenantq.handler("box.write_work", timeout=10, memory_mb=128)
def write_work(payload: Any, ctx: tenantq.JobContext) -> list[str]:
    Path("left-behind.txt").write_text("from batch")
    return sorted(os.listdir("."))


@tenantq.handler("box.kill_sandbox", timeout=20, memory_mb=128)
def kill_sandbox(payload: Any, ctx: tenantq.JobContext) -> None:
    """Ends its batch, not only its own process: kills the batch supervisor
    where it may (bubblewrap: same uid), else exhausts the sandbox's memory
    cgroup (gVisor then kills the whole sandbox)."""
    import resource
    import signal

    with contextlib.suppress(OSError):
        os.kill(os.getppid(), signal.SIGKILL)
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    blocks = []
    while True:
        blocks.append(b"x" * (64 << 20))


COUNTS = {"n": 0}


@tenantq.handler("box.count_shared", timeout=10, memory_mb=128, process="batch")
def count_shared(payload: Any, ctx: tenantq.JobContext) -> dict[str, int]:
    """process="batch": consecutive jobs of this kind share one process."""
    COUNTS["n"] += 1
    if payload.get("crash"):
        os._exit(9)
    return {"n": COUNTS["n"], "pid": os.getpid()}


@tenantq.handler("box.count_fresh", timeout=10, memory_mb=128)
def count_fresh(payload: Any, ctx: tenantq.JobContext) -> dict[str, int]:
    """The default: every job a fresh process."""
    COUNTS["n"] += 1
    return {"n": COUNTS["n"], "pid": os.getpid()}
