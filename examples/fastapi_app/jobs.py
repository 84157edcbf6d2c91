"""The handlers: `tenantq worker --app examples.fastapi_app.jobs` imports this
module (and nothing of the web app)."""

from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.pool import NullPool

import tenantq
from examples.fastapi_app.models import SQLALCHEMY_URL, Order


# isolation="inline": trusted first-party code that uses the app's database
# (a sandbox has no network, so it could not reach it)
@tenantq.handler("receipts.send", isolation="inline", timeout=30)
async def send_receipt(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    # an async handler runs on an event loop of its own, a fresh one per job:
    # open connections here, not at import time (they would belong to another loop)
    engine = create_async_engine(SQLALCHEMY_URL, poolclass=NullPool)
    try:
        async with AsyncSession(engine) as db, db.begin():
            # the job exists only if the order's transaction committed: the order is there
            order = await db.get_one(Order, payload["order_id"])
            if order.receipt_sent_at is None:  # at-least-once: a second run sends nothing
                order.receipt_sent_at = datetime.now(UTC)  # (a real app sends the e-mail here)
            return {
                "order_id": order.id,
                "to": ctx.actor,
                "request_id": ctx.meta.get("request_id"),
                "text": f"{order.item}: {order.amount_cents / 100:.2f}",
                "sent_at": order.receipt_sent_at.isoformat(),
            }
    finally:
        await engine.dispose()
