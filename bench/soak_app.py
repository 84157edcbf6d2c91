"""The soak benchmark's handler: a no-op, run inline by its workers."""

import tenantq


@tenantq.handler("soak.noop", isolation="inline")
def noop(payload: dict, ctx: tenantq.JobContext) -> None:
    return None
