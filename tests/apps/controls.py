"""Handlers for the tests of tenantq's controls (periodic jobs, cancelling
running jobs): an app module for worker subprocesses and for the sandbox.

Periodic: `controls.tick` is declared `@tenantq.periodic` only when the
environment says so (TQ_CONTROLS_PERIODIC="CRON;tenant,tenant,..."), so a
test can start workers of "the same app" that declare the schedule, then
ones that no longer do; importing this module in the test process declares
nothing (no schedule of it ever reaches another test's schema).

Sandboxed kinds (the default isolation): `controls.nap` sleeps (the job a
cancel kills), `controls.quick` returns at once, and two that say
"cancelled" on their own, which the host must not believe (docs/security.md,
rule H2): one raises an exception with that text, one forges the result
frame of a cancelled job on its result pipe.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import tenantq

PERIODIC_ENV = "TQ_CONTROLS_PERIODIC"
NAP_TIMEOUT = 90


def tick(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    """A scheduled job: says which fire it ran for; with payload["log"], appends
    one line per execution (job id, pid) so a test counts runs across processes."""
    log = (payload or {}).get("log")
    if log:
        with open(log, "a") as fh:
            fh.write(f"{ctx.job_id} {os.getpid()}\n")
    return {"tenant": ctx.tenant, "job": ctx.job_id, "fire_time": ctx.meta.get("fire_time"),
            "schedule_id": ctx.meta.get("schedule_id")}


_declared = os.environ.get(PERIODIC_ENV, "")
if _declared:
    _cron, _, _tenants = _declared.partition(";")
    tick = tenantq.periodic(_cron, tenant=[t for t in _tenants.split(",") if t],
                            payload={"log": os.environ.get("TQ_CONTROLS_LOG", "")})(tick)
tick = tenantq.handler("controls.tick", isolation="inline")(tick)


@tenantq.handler("controls.nap", timeout=NAP_TIMEOUT, memory_mb=64)
def nap(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """Say it started (a file in the sandbox's work dir, which the test sees
    from the host), then sleep: only a kill stops it early."""
    Path("started").write_text(str(ctx.job_id))
    time.sleep(float(payload["seconds"]))
    return {"slept": payload["seconds"]}


@tenantq.handler("controls.quick", timeout=20, memory_mb=64)
def quick(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    return {"quick": ctx.job_id}


@tenantq.handler("controls.raise_cancelled", timeout=20, memory_mb=64)
def raise_cancelled(payload: Any, ctx: tenantq.JobContext) -> None:
    raise RuntimeError("cancelled")


@tenantq.handler("controls.forge_cancelled", timeout=20, memory_mb=64)
def forge_cancelled(payload: Any, ctx: tenantq.JobContext) -> None:
    """Write what the supervisor writes for a cancelled job, as this job's
    one result frame, and leave: the guest then reports reason "cancelled"."""
    from tenantq.guest.jobs import RESULT_FD
    from tenantq.guest.protocol import encode, write_all

    write_all(RESULT_FD, encode({"ok": False, "reason": "cancelled", "error": "cancelled while running"}))
    os._exit(0)
