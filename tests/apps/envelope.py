"""Handlers for the envelope and async-handler tests: what a job knows
about who asked for it (ctx.actor, ctx.meta), and `async def` handlers.
Each comes in a sandboxed kind (the default isolation) and an inline one,
so one worker shows both paths; the results say where they ran (uid, pid)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import tenantq


def _who(ctx: tenantq.JobContext) -> dict[str, Any]:
    return {"actor": ctx.actor, "meta": dict(ctx.meta), "tenant": ctx.tenant, "job": ctx.job_id,
            "uid": os.getuid(), "pid": os.getpid()}


@tenantq.handler("env.whoami", timeout=20, memory_mb=128)
def whoami(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    return _who(ctx)


@tenantq.handler("env.whoami_inline", isolation="inline")
def whoami_inline(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    return _who(ctx)


async def _double(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    loop = asyncio.get_running_loop()  # raises unless it runs on an event loop
    # real awaiting: a task, a timer and a thread hop through the loop
    halves = await asyncio.gather(asyncio.sleep(0.01, result=payload["x"]),
                                  loop.run_in_executor(None, lambda: payload["x"]))
    return {"doubled": sum(halves), "on_loop": loop.is_running(), **_who(ctx)}


@tenantq.handler("env.async_double", timeout=20, memory_mb=128)
async def async_double(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    return await _double(payload, ctx)


@tenantq.handler("env.async_double_inline", isolation="inline")
async def async_double_inline(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    return await _double(payload, ctx)


@tenantq.handler("env.async_fail", timeout=20, memory_mb=128)
async def async_fail(payload: Any, ctx: tenantq.JobContext) -> None:
    await asyncio.sleep(0)
    raise ValueError(f"async boom for {ctx.actor}")


@tenantq.handler("env.async_fail_inline", isolation="inline")
async def async_fail_inline(payload: Any, ctx: tenantq.JobContext) -> None:
    await asyncio.sleep(0)
    raise ValueError(f"async boom for {ctx.actor}")


@tenantq.handler("env.async_batch", timeout=20, memory_mb=128, process="batch")
async def async_batch(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    """Consecutive jobs of this kind share a process: each still gets a loop of its own."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(0)
    return {"pid": os.getpid(), "loop": id(loop), "closed_before": _seen_loops_closed(loop), **_who(ctx)}


_loops: list[asyncio.AbstractEventLoop] = []


def _seen_loops_closed(current: asyncio.AbstractEventLoop) -> bool:
    """Whether every loop an earlier job of this process ran on is closed now."""
    earlier = list(_loops)
    _loops.append(current)
    return all(loop.is_closed() for loop in earlier)
