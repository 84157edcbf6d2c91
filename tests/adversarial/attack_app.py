"""A hostile tenant's handlers, written from docs/security.md and the
guest-visible code (src/tenantq/guest/) only: what an attacker who has read
tenantq's source runs inside a sandbox. Stdlib only (it runs in the guest).

Every attack catches its own errors and reports what happened, so one job can
try many things and return one report; the tests decide what the report, the
job rows, the host marker file and the worker must look like afterwards.
`adv.echo` is the honest job (the neighbour tenant's, and the hostile
tenant's own sibling "billing" job whose result matters to the operator).
"""

from __future__ import annotations

import os
from typing import Any

import tenantq
from tests.adversarial.attacks import channel, files, leftovers, procs  # noqa: F401  (register the adv.* handlers)
from tests.adversarial.attacks.tools import (
    FORGED,
    SCRATCH_DIRS,
    STATE,
    billing,
    describe_pid,
    nested,
    others,
    walk,
)

__all__ = ["FORGED", "billing", "nested"]


@tenantq.handler("adv.echo", timeout=20, memory_mb=128)
def echo(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    """An honest job (the neighbour's, and the hostile tenant's own billing
    job): a result the test can recompute, and what it saw around it."""
    n = int(payload["n"]) if isinstance(payload, dict) else 0
    return {"tenant": ctx.tenant, "n": n, "billing": billing(n), "attempt": ctx.attempt, "uid": os.getuid(),
            "scratch": {d: walk(d, 20) for d in SCRATCH_DIRS if os.path.isdir(d)},
            "others": [describe_pid(p) for p in others()], "pristine": STATE.get("pristine")}
