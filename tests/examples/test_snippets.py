"""Every snippet under examples/snippets/ runs against the real database: the
order and its job commit together, and an error after the enqueue (inside
the caller's transaction) leaves neither. The app's `orders` table is in a
schema of this module's own (the connections' search_path), tenantq's
tables in another."""

from __future__ import annotations

import ast
import asyncio
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from examples.snippets import asyncio_wait, psycopg_async, psycopg_sync, sqlalchemy_async, sqlalchemy_sync
from examples.snippets.tables import ORDERS
from psycopg_pool import AsyncConnectionPool
from sqlalchemy import create_engine, make_url
from sqlalchemy.ext.asyncio import create_async_engine

import tenantq
from tenantq.store.db import Database
from tests.conftest import ROOT
from tests.examples.helpers import Processes, rows, schemas, with_search_path


class Boom(Exception):
    """What fails after the enqueue, inside the caller's transaction."""


class FailsAfterEnqueue:
    """A Queue whose enqueue writes the job in the caller's transaction, then raises."""

    def __init__(self, queue: tenantq.Queue) -> None:
        self.queue = queue

    def enqueue(self, *args: Any, **kwargs: Any) -> int:
        self.queue.enqueue(*args, **kwargs)
        raise Boom

    def enqueue_many(self, *args: Any, **kwargs: Any) -> list[int]:
        self.queue.enqueue_many(*args, **kwargs)
        raise Boom


class AsyncFailsAfterEnqueue:
    def __init__(self, queue: tenantq.AsyncQueue) -> None:
        self.queue = queue

    async def enqueue(self, *args: Any, **kwargs: Any) -> int:
        await self.queue.enqueue(*args, **kwargs)
        raise Boom


@dataclass
class Env:
    tq: Database
    url: str  # the app's: search_path is its schema, where `orders` is

    def orders(self, tenant: str) -> list[int]:
        return [int(r["id"]) for r in rows(self.url, "SELECT id FROM orders WHERE tenant = %s ORDER BY id",
                                           [tenant])]

    def jobs(self, tenant: str) -> list[dict[str, Any]]:
        return rows(self.tq.dsn, f'SELECT id, payload, priority FROM "{self.tq.schema}".jobs '
                                 "WHERE tenant_id = %s ORDER BY id", [tenant])

    def assert_committed(self, tenant: str, order_ids: list[int], job_ids: list[int]) -> None:
        assert self.orders(tenant) == order_ids
        jobs = self.jobs(tenant)
        assert [j["id"] for j in jobs] == job_ids
        assert [j["payload"] for j in jobs] == [{"order_id": o} for o in order_ids]

    def assert_nothing(self, tenant: str) -> None:
        assert self.orders(tenant) == []
        assert self.jobs(tenant) == []


@pytest.fixture(scope="module")
def env(server_dsn: str) -> Iterator[Env]:
    with schemas(server_dsn, "snippets") as (tq, app_schema):
        url = with_search_path(server_dsn, app_schema)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(ORDERS)
        yield Env(tq, url)


@pytest.fixture
def queue(env: Env) -> Iterator[tenantq.Queue]:
    with tenantq.Queue(env.url, schema=env.tq.schema) as q:
        yield q


@pytest.fixture
def sql_engine(env: Env) -> Iterator[Any]:
    engine = create_engine(make_url(env.url).set(drivername="postgresql+psycopg"))
    yield engine
    engine.dispose()


def _tenant() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


SYNC_SQLALCHEMY = [sqlalchemy_sync.place_order, sqlalchemy_sync.place_order_autobegin,
                   sqlalchemy_sync.place_order_core]


@pytest.mark.parametrize("place_order", SYNC_SQLALCHEMY, ids=lambda f: f.__name__)
def test_sqlalchemy_sync(env: Env, queue: tenantq.Queue, sql_engine: Any,
                         place_order: Callable[..., tuple[int, int]]) -> None:
    tenant = _tenant()
    order_id, job_id = place_order(sql_engine, queue, tenant, "teapot")
    env.assert_committed(tenant, [order_id], [job_id])

    failing = _tenant()
    with pytest.raises(Boom):
        place_order(sql_engine, FailsAfterEnqueue(queue), failing, "teapot")
    env.assert_nothing(failing)


def test_sqlalchemy_enqueue_many(env: Env, queue: tenantq.Queue, sql_engine: Any) -> None:
    tenant = _tenant()
    job_ids = sqlalchemy_sync.import_orders(sql_engine, queue, tenant, ["a", "b", "c"])
    env.assert_committed(tenant, env.orders(tenant), job_ids)
    assert len(job_ids) == 3 and {j["priority"] for j in env.jobs(tenant)} == {"bulk"}

    failing = _tenant()
    with pytest.raises(Boom):
        sqlalchemy_sync.import_orders(sql_engine, FailsAfterEnqueue(queue), failing, ["a", "b"])
    env.assert_nothing(failing)


def test_psycopg_sync(env: Env, queue: tenantq.Queue) -> None:
    tenant = _tenant()
    order_id, job_id = psycopg_sync.place_order(env.url, queue, tenant, "teapot")
    env.assert_committed(tenant, [order_id], [job_id])

    failing = _tenant()
    with pytest.raises(Boom):
        psycopg_sync.place_order(env.url, FailsAfterEnqueue(queue), failing, "teapot")
    env.assert_nothing(failing)


def test_sqlalchemy_async(env: Env) -> None:
    async def scenario() -> tuple[str, int, int, str]:
        engine = create_async_engine(make_url(env.url).set(drivername="postgresql+psycopg"))
        try:
            async with tenantq.AsyncQueue(env.url, schema=env.tq.schema) as queue:
                tenant = _tenant()
                order_id, job_id = await sqlalchemy_async.place_order(engine, queue, tenant, "teapot")
                failing = _tenant()
                with pytest.raises(Boom):
                    await sqlalchemy_async.place_order(engine, AsyncFailsAfterEnqueue(queue), failing, "x")
                return tenant, order_id, job_id, failing
        finally:
            await engine.dispose()

    tenant, order_id, job_id, failing = asyncio.run(scenario())
    env.assert_committed(tenant, [order_id], [job_id])
    env.assert_nothing(failing)


def test_psycopg_async(env: Env) -> None:
    async def scenario() -> tuple[str, int, int, str]:
        async with AsyncConnectionPool(env.url, min_size=1, max_size=2, open=False) as pool, \
                tenantq.AsyncQueue(env.url, schema=env.tq.schema) as queue:
            tenant = _tenant()
            order_id, job_id = await psycopg_async.place_order(pool, queue, tenant, "teapot")
            failing = _tenant()
            with pytest.raises(Boom):
                await psycopg_async.place_order(pool, AsyncFailsAfterEnqueue(queue), failing, "x")
            return tenant, order_id, job_id, failing

    tenant, order_id, job_id, failing = asyncio.run(scenario())
    env.assert_committed(tenant, [order_id], [job_id])
    env.assert_nothing(failing)


@pytest.mark.parametrize("main", [psycopg_sync.main, sqlalchemy_sync.main,
                                  lambda: asyncio.run(psycopg_async.main()),
                                  lambda: asyncio.run(sqlalchemy_async.main())],
                         ids=["psycopg_sync", "sqlalchemy_sync", "psycopg_async", "sqlalchemy_async"])
def test_every_snippet_runs_as_a_script(env: Env, main: Callable[[], None], monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DATABASE_URL", env.url)
    monkeypatch.setenv("TENANTQ_SCHEMA", env.tq.schema)
    before = len(env.orders("acme"))
    main()
    order_id, job_id = ast.literal_eval(capsys.readouterr().out)  # it prints (order_id, job_id)
    assert env.orders("acme")[before:] == [order_id]
    assert env.jobs("acme")[-1]["id"] == job_id


def test_asyncio_wait_times_out_and_cancels_the_job(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENANTQ_SCHEMA", env.tq.schema)
    tenant = _tenant()

    async def scenario() -> None:
        async with tenantq.AsyncQueue() as queue:
            await asyncio_wait.render(queue, tenant, 9, timeout=0.2)

    with pytest.raises(tenantq.WaitTimeout):  # no worker runs: it times out, and cancels the job
        asyncio.run(scenario())
    [job] = env.jobs(tenant)
    with tenantq.Queue(schema=env.tq.schema) as q:
        assert q.job(job["id"]).status == "cancelled"


def test_asyncio_wait_returns_the_results_of_a_real_worker(env: Env, monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    monkeypatch.setenv("TENANTQ_SCHEMA", env.tq.schema)
    procs = Processes(tmp_path)
    child = {**os.environ, "PYTHONPATH": str(ROOT)}
    child.pop("PYTEST_ADDOPTS", None)
    worker = procs.start("worker", [sys.executable, "-m", "tenantq.cli", "worker", "--app",
                                    "examples.snippets.jobs", "--sandbox", "inline"], cwd=ROOT, env=child)
    try:
        reports = asyncio.run(asyncio_wait.quarter(_tenant()))
        assert reports == [{"month": m, "pages": 3} for m in (1, 2, 3)]
        assert procs.stop(worker) == 0, procs.log(worker)
    finally:
        procs.cleanup()
