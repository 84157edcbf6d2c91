"""Enqueue in a plain psycopg (3) transaction."""

import os

import psycopg

import tenantq


def place_order(database_url: str, queue: tenantq.Queue, tenant: str, item: str) -> tuple[int, int]:
    with psycopg.connect(database_url) as conn, conn.transaction():
        order_id = conn.execute("INSERT INTO orders (tenant, item) VALUES (%s, %s) RETURNING id",
                                (tenant, item)).fetchone()[0]
        job_id = queue.enqueue(tenant, "receipts.send", {"order_id": order_id}, conn=conn)
    # committed: both rows exist, and a worker was woken; an exception in the block rolls both back
    return order_id, job_id


def main() -> None:
    with tenantq.Queue(os.environ["DATABASE_URL"]) as queue:
        print(place_order(os.environ["DATABASE_URL"], queue, "acme", "teapot"))


if __name__ == "__main__":
    main()
