"""A schedule as tenantq stores it: validated once, whether it comes from
`Queue.add_schedule`, the CLI or an app's `@tenantq.periodic`."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from tenantq.domain import validation
from tenantq.domain.cron import cron_expression, time_zone
from tenantq.errors import InvalidInput


@dataclass(frozen=True)
class ScheduleSpec:
    """A validated schedule, ready to store."""

    tenant_id: str
    kind: str
    cron: str
    timezone: str
    payload_json: str
    priority: str
    max_attempts: int
    name: str


def spec(tenant: object, kind: object, cron: object, *, payload: Any = None, timezone: object = "UTC",
         priority: object = "default", max_attempts: object = 5, name: object = None,
         origin: str = "db") -> ScheduleSpec:
    """Validate a schedule (one line per problem). Its name defaults to one
    made of what it does: an app schedule is known again by it."""
    job, text = validation.new_job(tenant, kind, payload, priority_=priority, max_attempts_=max_attempts)
    expression, zone = cron_expression(cron), time_zone(timezone)
    if name is None:
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        name = f"{origin}:{job.kind}:{expression}@{zone}#{digest}"
    elif not isinstance(name, str) or not 1 <= len(name) <= 300 or "\n" in name:
        raise InvalidInput(f"schedule name must be one line of 1-300 characters, got {name!r}")
    return ScheduleSpec(job.tenant_id, job.kind, expression, zone, text, job.priority, job.max_attempts, name)
