"""Enqueue in a SQLAlchemy AsyncConnection's transaction (for an AsyncSession,
see examples/fastapi_app/app.py)."""

import asyncio
import os

from sqlalchemy import make_url, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import tenantq

INSERT = text("INSERT INTO orders (tenant, item) VALUES (:tenant, :item) RETURNING id")


async def place_order(engine: AsyncEngine, queue: tenantq.AsyncQueue, tenant: str, item: str
                      ) -> tuple[int, int]:
    async with engine.begin() as conn:
        order_id = (await conn.execute(INSERT, {"tenant": tenant, "item": item})).scalar_one()
        job_id = await queue.enqueue(tenant, "receipts.send", {"order_id": order_id}, conn=conn)
    return order_id, job_id


async def main() -> None:
    engine = create_async_engine(make_url(os.environ["DATABASE_URL"]).set(drivername="postgresql+psycopg"))
    async with tenantq.AsyncQueue(os.environ["DATABASE_URL"]) as queue:
        print(await place_order(engine, queue, "acme", "teapot"))
    await engine.dispose()


if __name__ == "__main__":
    asyncio.run(main())
