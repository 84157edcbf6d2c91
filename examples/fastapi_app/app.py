"""The web app: POST /orders writes an order and enqueues its receipt job in
one transaction; GET /orders/{id}/receipt waits for the job's result.

    uvicorn examples.fastapi_app.app:app        (from the repository root: README.md)
"""

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

import tenantq
from examples.fastapi_app.models import DATABASE_URL, SQLALCHEMY_URL, Base, Order

engine = create_async_engine(SQLALCHEMY_URL)
Session = async_sessionmaker(engine, expire_on_commit=False)
# one AsyncQueue per event loop (its pool belongs to the loop that first uses it)
queue = tenantq.AsyncQueue(DATABASE_URL)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    await queue.migrate()                          # tenantq's tables: same as `tenantq migrate`
    async with engine.begin() as conn:             # the app's own (a real app has Alembic)
        await conn.run_sync(Base.metadata.create_all)
    yield
    await queue.close()
    await engine.dispose()


app = FastAPI(title="tenantq FastAPI example", lifespan=lifespan)


async def session() -> AsyncIterator[AsyncSession]:
    async with Session() as db:
        yield db


SessionDep = Annotated[AsyncSession, Depends(session)]


@app.exception_handler(tenantq.InvalidInput)
async def invalid_input(request: Request, exc: tenantq.InvalidInput) -> JSONResponse:
    # a bad tenant id, payload or meta: enqueue refused it and wrote nothing
    return JSONResponse({"detail": str(exc)}, status_code=422)


class NewOrder(BaseModel):
    tenant: str
    item: str
    amount_cents: int = Field(gt=0)
    # stands for any step after the enqueue that fails (the card is declined)
    fail: bool = False


@app.post("/orders", status_code=201)
async def create_order(
    new: NewOrder,
    db: SessionDep,
    x_user: Annotated[str | None, Header()] = None,
    x_request_id: Annotated[str | None, Header()] = None,
) -> dict[str, int]:
    async with db.begin():  # one transaction: the order and its receipt job
        order = Order(tenant=new.tenant, item=new.item, amount_cents=new.amount_cents)
        db.add(order)
        await db.flush()  # the order's id
        order.receipt_job = await queue.enqueue(
            new.tenant, "receipts.send", {"order_id": order.id},
            actor=x_user, meta={"request_id": x_request_id or uuid.uuid4().hex},
            conn=db,
        )
        if new.fail:
            # leaving the block with an exception rolls back: no order, no job, no worker woken
            raise HTTPException(402, "payment declined: nothing was saved")
    # committed: the order and the job exist together, and a worker was woken
    return {"order_id": order.id, "job_id": order.receipt_job}


@app.get("/orders/{order_id}/receipt")
async def receipt(
    order_id: int, db: SessionDep, timeout: Annotated[float, Query(ge=0, le=60)] = 10.0
) -> dict[str, Any]:
    async with db.begin():  # over before the wait: no connection is held while waiting
        order = await db.get(Order, order_id)
    if order is None or order.receipt_job is None:
        raise HTTPException(404, f"no order {order_id}")
    try:
        job = await queue.wait(order.receipt_job, timeout=timeout)
    except tenantq.WaitTimeout:
        raise HTTPException(504, f"the receipt is not ready after {timeout:g} s") from None
    if job.status != "done":
        raise HTTPException(502, f"the receipt job ended {job.status}: {job.last_error}")
    return {"order_id": order_id, "receipt": job.result}
