"""Handlers for the rate-limit acceptance test
(tests/acceptance/test_rate_limits_two_workers.py): two no-op kinds, so a
tenant limit (on `rated.noop`) and a global kind limit (on `api.call`, a
shared downstream API) can run side by side in one worker fleet. They record
nothing: the test reads created_at, started_at and finished_at from the
jobs table (the database clock, the one the token buckets use)."""

from __future__ import annotations

from typing import Any

import tenantq


@tenantq.handler("rated.noop", isolation="inline")
def noop(payload: Any, ctx: tenantq.JobContext) -> None:
    return None


@tenantq.handler("api.call", isolation="inline")
def api_call(payload: Any, ctx: tenantq.JobContext) -> None:
    """Stands for a call to a downstream API every tenant shares."""
    return None
