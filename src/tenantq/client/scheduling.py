"""Periodic jobs on `Queue` / `AsyncQueue`: schedules a SaaS creates at run
time, per tenant (store/schedules.py). A mixin, written as steps like
client/operations.py."""

from __future__ import annotations

from typing import Any

from tenantq.client.runner import atomic_operation, operation
from tenantq.domain import validation
from tenantq.domain.schedules import spec as schedule_spec
from tenantq.errors import InvalidInput
from tenantq.store import schedules
from tenantq.store.steps import Steps


def _schedule_id(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**63:
        raise InvalidInput(f"schedule id must be a positive integer, got {value!r}")
    return value


class Scheduling:
    """Schedule operations."""

    @atomic_operation
    def add_schedule(
        self, tenant: str, kind: str, cron: str, *, payload: Any = None, timezone: str = "UTC",
        priority: str = "default", max_attempts: int = 5, name: str | None = None,
    ) -> Steps[dict[str, Any]]:
        """Enqueue a `kind` job for `tenant` at every fire time of `cron`
        (5 fields or @daily...) in `timezone`. With `name`, adding again
        changes that schedule instead of adding another. Returns the
        schedule with its next fire."""
        schedule = schedule_spec(tenant, kind, cron, payload=payload, timezone=timezone,
                                  priority=priority, max_attempts=max_attempts, name=name)
        return (yield from schedules.upsert_steps(schedule, origin="db"))

    @operation
    def schedules(self, tenant: str | None = None) -> Steps[list[dict[str, Any]]]:
        """Every schedule (of one tenant), with its next fire."""
        if tenant is not None:
            validation.tenant_id(tenant)
        return (yield from schedules.list_steps(tenant))

    @operation
    def remove_schedule(self, schedule_id: int) -> Steps[bool]:
        """Delete a schedule; False if there is none with that id. (An app's
        schedule comes back when a worker of that app starts: remove the
        @tenantq.periodic instead.)"""
        return (yield from schedules.remove_steps(_schedule_id(schedule_id)))

    @atomic_operation
    def pause_schedule(self, schedule_id: int, *, paused: bool = True) -> Steps[bool]:
        """Pause (or, paused=False, resume) a schedule; a resumed one fires
        next at its next time from now, not for the fires it missed."""
        return (yield from schedules.set_paused_steps(_schedule_id(schedule_id), paused))
