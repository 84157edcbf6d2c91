"""Enqueue in a psycopg AsyncConnection's transaction, from a pool."""

import asyncio
import os

from psycopg_pool import AsyncConnectionPool

import tenantq


async def place_order(pool: AsyncConnectionPool, queue: tenantq.AsyncQueue, tenant: str, item: str
                      ) -> tuple[int, int]:
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute("INSERT INTO orders (tenant, item) VALUES (%s, %s) RETURNING id",
                                 (tenant, item))
        order_id = (await cur.fetchone())[0]
        job_id = await queue.enqueue(tenant, "receipts.send", {"order_id": order_id}, conn=conn)
    return order_id, job_id


async def main() -> None:
    async with AsyncConnectionPool(os.environ["DATABASE_URL"], open=False) as pool, \
            tenantq.AsyncQueue(os.environ["DATABASE_URL"]) as queue:
        print(await place_order(pool, queue, "acme", "teapot"))


if __name__ == "__main__":
    asyncio.run(main())
