"""Handlers and host functions for `./run bench host-connections`.

Imported in the sandbox too: the host function's database work happens only
when it runs, on the host."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import tenantq


@tenantq.host_function("hold.query", timeout=30)
def hold_query(args: dict[str, Any], ctx: tenantq.HostContext) -> bool:
    """A slow tenant-scoped query: it holds an app-database connection.
    Returns whether the bench asked the jobs to stop (a file on the host)."""
    # the bench counts the batches calling at once from these (host-side) marks
    Path(os.environ["HOSTCONN_MARK_DIR"], str(ctx.job_id)).touch()
    with ctx.db() as conn:
        conn.execute("SELECT pg_sleep(%s)", (float(args.get("seconds", 0.05)),))
    return Path(os.environ["HOSTCONN_STOP_FILE"]).exists()


@tenantq.handler("hostconn.hold", host_functions=["hold.query"], timeout=600, memory_mb=128)
def hold(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """Calls the slow host function back to back until the host says stop
    (or the wall-clock moment `until`), so that every batch's calls overlap."""
    ok = errors = 0
    while time.time() < float(payload["until"]):
        try:
            stop = ctx.call("hold.query", {"seconds": float(payload.get("seconds", 0.05))})
            ok += 1
        except tenantq.HostFunctionError:
            errors += 1
            continue
        if stop:
            break
    return {"ok": ok, "errors": errors}


@tenantq.handler("hostconn.quick", timeout=60, memory_mb=128)
def quick(payload: Any, ctx: tenantq.JobContext) -> int:
    """Calls nothing: its settle needs only the store's own connections."""
    return 1
