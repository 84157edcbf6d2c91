"""Handlers of the demo app: small real workloads (hashing, JSON), a flaky
one and a poison one."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import tenantq


@tenantq.handler("demo.import_row", isolation="inline")
def import_row(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """A bulk-import row: normalise and fingerprint it."""
    row = {k.lower(): str(v).strip() for k, v in payload.items()}
    digest = hashlib.sha256(json.dumps(row, sort_keys=True).encode()).hexdigest()
    return {"fingerprint": digest[:16]}


@tenantq.handler("demo.render_report", isolation="inline")
def render_report(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """An interactive report: a few thousand rounds of hashing (~ms of CPU)."""
    h = hashlib.sha256(f"{ctx.tenant}:{payload.get('month')}".encode())
    for _ in range(int(payload.get("rounds", 2000))):
        h = hashlib.sha256(h.digest())
    return {"pages": 3, "checksum": h.hexdigest()[:12]}


@tenantq.handler("demo.flaky_webhook", isolation="inline")
def flaky_webhook(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """Fails on its first attempt, then succeeds: a retry with backoff."""
    if ctx.attempt < 2:
        raise ConnectionError("upstream answered 503")
    return {"delivered_on_attempt": ctx.attempt}


@tenantq.handler("demo.poison", isolation="inline")
def poison(payload: dict[str, Any], ctx: tenantq.JobContext) -> None:
    """Always fails: ends in the dead-letter list after its attempts."""
    raise ValueError(f"cannot parse invoice {payload.get('invoice')!r}")
