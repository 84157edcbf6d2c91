"""examples/fastapi_app, for real: the app under uvicorn (a subprocess on a
free port), requests over HTTP, `tenantq worker --app
examples.fastapi_app.jobs` as a subprocess. The app's tables are in a schema
of this module's own (its connections' search_path), tenantq's in another."""

from __future__ import annotations

import os
import signal
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

import httpx
import pytest

from tenantq import Queue
from tenantq.store.db import Database
from tests.conftest import ROOT
from tests.examples.helpers import Processes, free_port, rows, schemas, wait_for_http, with_search_path

WORKER = [sys.executable, "-m", "tenantq.cli", "worker", "--app", "examples.fastapi_app.jobs",
          "--sandbox", "inline", "--concurrency", "2"]


@dataclass
class App:
    http: httpx.Client
    tq: Database
    app_dsn: str
    env: dict[str, str]
    procs: Processes
    queue: Queue

    def orders(self, tenant: str) -> list[dict[str, object]]:
        return rows(self.app_dsn, "SELECT * FROM orders WHERE tenant = %s ORDER BY id", [tenant])


@pytest.fixture(scope="module")
def app(server_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    procs = Processes(tmp_path_factory.mktemp("fastapi_app"))
    with schemas(server_dsn, "fastapi") as (tq, app_schema):
        app_dsn = with_search_path(server_dsn, app_schema)
        env = {**os.environ, "DATABASE_URL": app_dsn, "TENANTQ_DATABASE_URL": server_dsn,
               "TENANTQ_SCHEMA": tq.schema, "PYTHONPATH": str(ROOT)}
        env.pop("PYTEST_ADDOPTS", None)
        port = free_port()
        server = procs.start("uvicorn", [
            sys.executable, "-m", "uvicorn", "examples.fastapi_app.app:app",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
        ], cwd=ROOT, env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_for_http(f"{base}/openapi.json", server, procs)
            with httpx.Client(base_url=base, timeout=60.0) as http, Queue(server_dsn, schema=tq.schema) as q:
                yield App(http, tq, app_dsn, env, procs, q)
            # uvicorn re-raises the SIGTERM it handled once its shutdown (the lifespan's) is done
            assert procs.stop(server) in (0, -signal.SIGTERM), procs.log(server)
            assert "Traceback" not in procs.log(server), procs.log(server)
        finally:
            procs.cleanup()


@pytest.fixture
def worker(app: App) -> Iterator[None]:
    """A real `tenantq worker` on the app's handlers, stopped (SIGTERM) after the test."""
    proc = app.procs.start("worker", WORKER, cwd=ROOT, env=app.env)
    yield
    assert app.procs.stop(proc) == 0, app.procs.log(proc)


def _tenant() -> str:
    return f"shop-{uuid.uuid4().hex[:8]}"


@pytest.mark.usefixtures("worker")
def test_an_order_and_its_job_commit_together_and_the_wait_endpoint_returns_the_receipt(app: App) -> None:
    tenant = _tenant()
    created = app.http.post("/orders", json={"tenant": tenant, "item": "teapot", "amount_cents": 2450},
                            headers={"X-User": "ada@example.com", "X-Request-ID": "req-1"})
    assert created.status_code == 201, created.text
    order_id, job_id = created.json()["order_id"], created.json()["job_id"]

    # committed together: the app's row names the job, the job names the order
    [order] = app.orders(tenant)
    assert order["id"] == order_id and order["receipt_job"] == job_id
    job = app.queue.job(job_id)
    assert (job.tenant_id, job.kind, job.payload) == (tenant, "receipts.send", {"order_id": order_id})
    assert (job.actor, job.meta) == ("ada@example.com", {"request_id": "req-1"})

    answer = app.http.get(f"/orders/{order_id}/receipt", params={"timeout": 30})
    assert answer.status_code == 200, answer.text
    receipt = answer.json()["receipt"]
    assert receipt["order_id"] == order_id
    assert receipt["to"] == "ada@example.com"  # ctx.actor
    assert receipt["request_id"] == "req-1"  # ctx.meta
    assert receipt["text"] == "teapot: 24.50"
    # the async handler wrote to the app's table, on a connection of its own
    [order] = app.orders(tenant)
    assert order["receipt_sent_at"] is not None
    assert order["receipt_sent_at"] == datetime.fromisoformat(receipt["sent_at"])
    assert app.queue.job(job_id).status == "done"


def test_a_failure_after_the_enqueue_rolls_back_both_the_order_and_the_job(app: App) -> None:
    tenant = _tenant()
    failed = app.http.post("/orders", json={"tenant": tenant, "item": "kettle", "amount_cents": 900,
                                            "fail": True})
    assert failed.status_code == 402, failed.text
    assert app.orders(tenant) == []
    assert rows(app.tq.dsn, f'SELECT id FROM "{app.tq.schema}".jobs WHERE tenant_id = %s', [tenant]) == []

    # the same request without the failure commits both
    ok = app.http.post("/orders", json={"tenant": tenant, "item": "kettle", "amount_cents": 900})
    assert ok.status_code == 201, ok.text
    assert [o["id"] for o in app.orders(tenant)] == [ok.json()["order_id"]]
    jobs = rows(app.tq.dsn, f'SELECT id FROM "{app.tq.schema}".jobs WHERE tenant_id = %s', [tenant])
    assert [j["id"] for j in jobs] == [ok.json()["job_id"]]


def test_a_tenant_id_enqueue_refuses_rolls_back_the_order(app: App) -> None:
    item = f"mug-{uuid.uuid4().hex[:8]}"
    refused = app.http.post("/orders", json={"tenant": "no spaces allowed", "item": item, "amount_cents": 1})
    assert refused.status_code == 422, refused.text
    assert "tenant" in refused.json()["detail"]
    assert rows(app.app_dsn, "SELECT id FROM orders WHERE item = %s", [item]) == []


def test_the_wait_endpoint_times_out_until_a_worker_has_run_the_job(app: App) -> None:
    tenant = _tenant()
    created = app.http.post("/orders", json={"tenant": tenant, "item": "cup", "amount_cents": 300})
    assert created.status_code == 201, created.text
    order_id = created.json()["order_id"]

    pending = app.http.get(f"/orders/{order_id}/receipt", params={"timeout": 0.2})
    assert pending.status_code == 504, pending.text
    assert "not ready after 0.2 s" in pending.json()["detail"]

    drained = app.procs.run([*WORKER, "--once"], cwd=ROOT, env=app.env)
    assert drained.returncode == 0, drained.stderr[-3000:]
    answer = app.http.get(f"/orders/{order_id}/receipt", params={"timeout": 5})
    assert answer.status_code == 200, answer.text
    assert answer.json()["receipt"]["text"] == "cup: 3.00"
