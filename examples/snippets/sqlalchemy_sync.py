"""Enqueue in a SQLAlchemy transaction: a Session (with or without an
explicit begin), a Connection, and many jobs at once."""

import os

from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.orm import Session

import tenantq

INSERT = text("INSERT INTO orders (tenant, item) VALUES (:tenant, :item) RETURNING id")


def place_order(engine: Engine, queue: tenantq.Queue, tenant: str, item: str) -> tuple[int, int]:
    with Session(engine) as session, session.begin():  # commits at the end of the block
        order_id = session.execute(INSERT, {"tenant": tenant, "item": item}).scalar_one()
        job_id = queue.enqueue(tenant, "receipts.send", {"order_id": order_id}, conn=session)
    return order_id, job_id


def place_order_autobegin(engine: Engine, queue: tenantq.Queue, tenant: str, item: str) -> tuple[int, int]:
    with Session(engine) as session:
        order_id = session.execute(INSERT, {"tenant": tenant, "item": item}).scalar_one()
        job_id = queue.enqueue(tenant, "receipts.send", {"order_id": order_id}, conn=session)
        session.commit()  # without it, closing the session rolls back the order and the job
    return order_id, job_id


def place_order_core(engine: Engine, queue: tenantq.Queue, tenant: str, item: str) -> tuple[int, int]:
    with engine.begin() as conn:  # a Connection in a transaction, committed at the end of the block
        order_id = conn.execute(INSERT, {"tenant": tenant, "item": item}).scalar_one()
        job_id = queue.enqueue(tenant, "receipts.send", {"order_id": order_id}, conn=conn)
    return order_id, job_id


def import_orders(engine: Engine, queue: tenantq.Queue, tenant: str, items: list[str]) -> list[int]:
    with Session(engine) as session, session.begin():
        order_ids = [session.execute(INSERT, {"tenant": tenant, "item": item}).scalar_one()
                     for item in items]
        return queue.enqueue_many(
            [tenantq.JobSpec(tenant, "receipts.send", {"order_id": order_id}, priority="bulk")
             for order_id in order_ids],
            conn=session,
        )


def main() -> None:
    # the psycopg (3) driver: postgresql+psycopg://, on the database that holds tenantq's schema
    engine = create_engine(make_url(os.environ["DATABASE_URL"]).set(drivername="postgresql+psycopg"))
    with tenantq.Queue(os.environ["DATABASE_URL"]) as queue:
        print(place_order(engine, queue, "acme", "teapot"))
    engine.dispose()


if __name__ == "__main__":
    main()
