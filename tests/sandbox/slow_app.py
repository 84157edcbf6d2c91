"""A handler that runs for a few seconds, for killing a dispatcher while its
sandboxes run (test_kill_dispatcher). The short timeout keeps the sandbox's
TTL (sum of timeouts + 15 s start-up + 30 s) small."""

from __future__ import annotations

import os
import time
from typing import Any

import tenantq

SLOW_TIMEOUT = 5


@tenantq.handler("slow.sleep", timeout=SLOW_TIMEOUT, memory_mb=64)
def sleep(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    with open("started", "w") as fh:  # in the work dir: the test sees the job has begun
        fh.write("1")
    time.sleep(float(payload["seconds"]))
    return {"slept": payload["seconds"], "attempt": ctx.attempt, "pid": os.getpid()}


# For cancelling a job while it runs: a timeout far past its sleep, so that a
# loaded machine (the guest's clock runs on while its sandbox waits for a CPU)
# cannot time the job out before the test cancels it.
@tenantq.handler("slow.wait", timeout=60, memory_mb=64)
def wait(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    return sleep(payload, ctx)
