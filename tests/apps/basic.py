"""Handlers used by the integration and acceptance tests."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import tenantq


@tenantq.handler("demo.hello", isolation="inline")
def hello(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    return {"hello": ctx.tenant, "job": ctx.job_id, "attempt": ctx.attempt, "payload": payload}


@tenantq.handler("demo.noop", isolation="inline")
def noop(payload: Any, ctx: tenantq.JobContext) -> None:
    return None


@tenantq.handler("demo.fail", isolation="inline")
def fail(payload: Any, ctx: tenantq.JobContext) -> None:
    raise RuntimeError(f"boom on attempt {ctx.attempt}")


@tenantq.handler("demo.flaky", isolation="inline")
def flaky(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, int]:
    if ctx.attempt < int(payload["succeed_on"]):
        raise RuntimeError(f"flaky failure on attempt {ctx.attempt}")
    return {"succeeded_on": ctx.attempt}


@tenantq.handler("demo.record", isolation="inline")
def record(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, int]:
    """Append one line per execution to a file, so tests can count executions
    (a job settled once may still run twice: at-least-once)."""
    with open(payload["log"], "a") as fh:
        fh.write(f"{ctx.job_id} {os.getpid()}\n")
    if payload.get("sleep"):
        time.sleep(float(payload["sleep"]))
    return {"job": ctx.job_id}


@tenantq.handler("demo.block", isolation="inline")
def block(payload: dict[str, Any], ctx: tenantq.JobContext) -> None:
    """Signal that it started (a file), then wait until a release file appears."""
    Path(payload["started"]).write_text(str(os.getpid()))
    release = Path(payload["release"])
    deadline = time.monotonic() + float(payload.get("max_seconds", 60))
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


@tenantq.handler("demo.bad_result", isolation="inline")
def bad_result(payload: Any, ctx: tenantq.JobContext) -> object:
    return object()


@tenantq.handler("demo.track", isolation="inline")
def track(payload: dict[str, Any], ctx: tenantq.JobContext) -> None:
    """Keep a per-tenant high-water mark of concurrently running jobs in
    files under payload["dir"] (an flock makes it exact across processes)."""
    import fcntl

    folder = Path(payload["dir"])
    current, highest = folder / f"{ctx.tenant}.cur", folder / f"{ctx.tenant}.max"

    def bump(delta: int) -> None:
        with open(folder / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            now = int(current.read_text() or 0) if current.exists() else 0
            now += delta
            current.write_text(str(now))
            top = int(highest.read_text() or 0) if highest.exists() else 0
            if now > top:
                highest.write_text(str(now))

    bump(+1)
    try:
        time.sleep(float(payload.get("sleep", 0.01)))
    finally:
        bump(-1)


@tenantq.handler("demo.sleep", isolation="inline")
def sleep(payload: dict[str, Any], ctx: tenantq.JobContext) -> None:
    time.sleep(float(payload.get("seconds", 0.05)))
