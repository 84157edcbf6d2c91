"""AsyncQueue against the real database: the same operations as Queue (one
implementation, driven by the async runner), with the same results, the
transactional ones (retry_dead, reap, prune, set_tenant) included."""

from __future__ import annotations

import asyncio
from typing import Any

from tenantq import AsyncQueue, Queue
from tenantq.store import jobs
from tenantq.store.db import Database
from tests.integration.test_wait import settle

KIND = "demo.hello"


def _kill_next(db: Database, tenant: str) -> None:
    """The tenant's next pending job claimed and settled dead, as a worker would."""
    with db.connect() as conn:
        batch = jobs.claim(conn, tenant_id=tenant, priority="default", limit=10, worker_id="w-test",
                           driver="test", lease_seconds=30)
        assert batch is not None
        settle(conn, batch, "dead", error="boom")


def _sync(db: Database, tenant: str) -> dict[str, Any]:
    with Queue(db.dsn, schema=db.schema) as q:
        first = q.enqueue(tenant, KIND, {"a": 1}, actor="usr_1", meta={"request_id": "r-1"})
        second = q.enqueue(tenant, KIND, max_attempts=1)
        info = q.job(first)
        out: dict[str, Any] = {
            "job": (info.status, info.actor, info.meta, info.payload),
            "status": [r["pending"] for r in q.status(tenant)],
            "set_tenant": q.set_tenant(tenant, weight=3)["weight"],
            "tenants": [t["weight"] for t in q.tenants(tenant)],
            "cancel": q.cancel(first, by="ops"),
            "wait": q.wait(first, timeout=10).status,
        }
        _kill_next(db, tenant)
        out["dead"] = [(r["id"] == second) for r in q.dead_jobs(tenant)]
        out["retry"] = q.retry_dead([second]) == [second]
        out["reap"] = q.reap()
        out["prune"] = sorted(q.prune(dry_run=True))
        out["schedule"] = q.add_schedule(tenant, KIND, "@daily")["cron"]
        out["paused"] = q.pause_tenant(tenant)["paused_at"] is not None
        return out


async def _async(db: Database, tenant: str) -> dict[str, Any]:
    async with AsyncQueue(db.dsn, schema=db.schema) as q:
        first = await q.enqueue(tenant, KIND, {"a": 1}, actor="usr_1", meta={"request_id": "r-1"})
        second = await q.enqueue(tenant, KIND, max_attempts=1)
        info = await q.job(first)
        out: dict[str, Any] = {
            "job": (info.status, info.actor, info.meta, info.payload),
            "status": [r["pending"] for r in await q.status(tenant)],
            "set_tenant": (await q.set_tenant(tenant, weight=3))["weight"],
            "tenants": [t["weight"] for t in await q.tenants(tenant)],
            "cancel": await q.cancel(first, by="ops"),
            "wait": (await q.wait(first, timeout=10)).status,
        }
        await asyncio.to_thread(_kill_next, db, tenant)
        out["dead"] = [(r["id"] == second) for r in await q.dead_jobs(tenant)]
        out["retry"] = await q.retry_dead([second]) == [second]
        out["reap"] = await q.reap()
        out["prune"] = sorted(await q.prune(dry_run=True))
        out["schedule"] = (await q.add_schedule(tenant, KIND, "@daily"))["cron"]
        out["paused"] = (await q.pause_tenant(tenant))["paused_at"] is not None
        return out


def test_async_queue_does_what_queue_does_on_the_database(db: Database) -> None:
    sync = _sync(db, "acme")
    asynchronous = asyncio.run(_async(db, "globex"))
    assert sync == asynchronous
    assert sync["job"] == ("pending", "usr_1", {"request_id": "r-1"}, {"a": 1})
    assert sync["cancel"] is True and sync["wait"] == "cancelled" and sync["dead"] == [True]
    assert sync["retry"] is True and sync["paused"] is True and sync["set_tenant"] == 3
