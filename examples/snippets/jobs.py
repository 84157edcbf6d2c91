"""Handlers for the snippets: `tenantq worker --app examples.snippets.jobs`."""

import asyncio
from typing import Any

import tenantq


@tenantq.handler("receipts.send", isolation="inline")
def send_receipt(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    return {"order_id": payload["order_id"], "to": ctx.actor}


@tenantq.handler("reports.render", isolation="inline")
async def render_report(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    await asyncio.sleep(0)  # an async handler: awaited on an event loop of its own, one per job
    return {"month": payload["month"], "pages": 3}
