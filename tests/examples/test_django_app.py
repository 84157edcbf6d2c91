"""examples/django_app, for real: the views through Django's test client
against the real database (in this process: no test database is created
or dropped; the project's tables are migrated into a schema of this
module's own, its connection's search_path), and the worker as
`python manage.py tenantq_worker` and as a plain `tenantq worker --app
shop.jobs`, both subprocesses. The views commit for real (no TestCase
transaction around them), so the worker sees what they wrote."""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pytest

from tenantq import Queue
from tenantq.store.db import Database
from tests.conftest import ROOT
from tests.examples.helpers import Processes, rows, schemas, with_search_path

PROJECT = ROOT / "examples" / "django_app"


@dataclass
class Shop:
    client: Any  # django.test.Client
    tq: Database
    env: dict[str, str]
    procs: Processes
    queue: Queue

    def order(self, order_id: int) -> Any:
        from shop.models import Order

        return Order.objects.get(pk=order_id)

    def orders(self, tenant: str) -> list[Any]:
        from shop.models import Order

        return list(Order.objects.filter(tenant=tenant).order_by("id"))

    def jobs(self, tenant: str) -> list[int]:
        found = rows(self.tq.dsn, f'SELECT id FROM "{self.tq.schema}".jobs WHERE tenant_id = %s ORDER BY id',
                     [tenant])
        return [int(r["id"]) for r in found]

    def post_order(self, tenant: str, item: str, amount_cents: int, **extra: Any) -> Any:
        return self.client.post("/orders", json.dumps({"tenant": tenant, "item": item,
                                                       "amount_cents": amount_cents, **extra}),
                                content_type="application/json",
                                headers={"X-User": "grace@example.com", "X-Request-ID": f"req-{item}"})


@pytest.fixture(scope="module")
def shop(server_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shop]:
    django = pytest.importorskip("django")
    from django.conf import settings

    if settings.configured:
        pytest.fail("Django was configured by another test in this process: "
                    "the example needs its own settings")
    procs = Processes(tmp_path_factory.mktemp("django_app"))
    with schemas(server_dsn, "django") as (tq, app_schema), pytest.MonkeyPatch.context() as mp:
        env = {"DATABASE_URL": with_search_path(server_dsn, app_schema), "TENANTQ_SCHEMA": tq.schema,
               "DJANGO_SETTINGS_MODULE": "mysite.settings"}
        for name, value in env.items():
            mp.setenv(name, value)
        mp.syspath_prepend(str(PROJECT))
        django.setup()
        from django.core.management import call_command
        from django.db import connections
        from django.test import Client
        from django.test.utils import setup_test_environment, teardown_test_environment
        from shop.queue import queue as project_queue

        setup_test_environment()
        try:
            call_command("migrate", verbosity=0)
            child_env = {**os.environ, "PYTHONPATH": str(ROOT)}
            child_env.pop("PYTEST_ADDOPTS", None)
            with Queue(server_dsn, schema=tq.schema) as q:
                yield Shop(Client(), tq, child_env, procs, q)
        finally:
            teardown_test_environment()
            project_queue.close()
            connections.close_all()
            procs.cleanup()


def _tenant() -> str:
    return f"shop-{uuid.uuid4().hex[:8]}"


def test_the_view_commits_the_order_and_its_job_and_the_management_command_runs_it(shop: Shop) -> None:
    tenant = _tenant()
    created = shop.post_order(tenant, "teapot", 2450)
    assert created.status_code == 201, created.content
    order_id, job_id = created.json()["order_id"], created.json()["job_id"]

    # committed together: the project's row names the job, the job names the order
    order = shop.order(order_id)
    assert (order.tenant, order.receipt_job, order.receipt_sent_at) == (tenant, job_id, None)
    job = shop.queue.job(job_id)
    assert (job.status, job.kind, job.payload) == ("pending", "receipts.send", {"order_id": order_id})
    assert (job.actor, job.meta) == ("grace@example.com", {"request_id": "req-teapot"})

    # the management command, with the database from Django's settings (no TENANTQ_DATABASE_URL)
    env = {k: v for k, v in shop.env.items() if k != "TENANTQ_DATABASE_URL"}
    ran = shop.procs.run([sys.executable, "manage.py", "tenantq_worker", "--once", "--sandbox", "inline"],
                         cwd=PROJECT, env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads(ran.stderr.strip().splitlines()[-1])["done"] >= 1, ran.stderr[-3000:]

    job = shop.queue.job(job_id)
    assert job.status == "done", job.last_error
    assert job.result["to"] == "grace@example.com" and job.result["text"] == "teapot: 24.50"
    order = shop.order(order_id)
    assert order.receipt_sent_at == datetime.fromisoformat(job.result["sent_at"])

    answer = shop.client.get(f"/orders/{order_id}/receipt", {"timeout": "5"})
    assert answer.status_code == 200, answer.content
    assert answer.json() == {"order_id": order_id, "receipt": job.result}


def test_a_failure_inside_atomic_rolls_back_the_order_and_the_job(shop: Shop) -> None:
    tenant = _tenant()
    failed = shop.post_order(tenant, "kettle", 900, fail=True)
    assert failed.status_code == 402, failed.content
    assert shop.orders(tenant) == []
    assert shop.jobs(tenant) == []

    # the connection is usable after the rollback: the same order without the failure commits
    ok = shop.post_order(tenant, "kettle", 900)
    assert ok.status_code == 201, ok.content
    assert [o.id for o in shop.orders(tenant)] == [ok.json()["order_id"]]
    assert shop.jobs(tenant) == [ok.json()["job_id"]]


def test_a_tenant_id_enqueue_refuses_rolls_back_the_order(shop: Shop) -> None:
    refused = shop.post_order("no spaces allowed", f"mug-{uuid.uuid4().hex[:8]}", 100)
    assert refused.status_code == 422, refused.content
    assert shop.orders("no spaces allowed") == []


def test_the_wait_view_times_out_then_a_plain_tenantq_worker_ends_the_wait(shop: Shop) -> None:
    tenant = _tenant()
    created = shop.post_order(tenant, "cup", 300)
    assert created.status_code == 201, created.content
    order_id = created.json()["order_id"]

    pending = shop.client.get(f"/orders/{order_id}/receipt", {"timeout": "0.2"})
    assert pending.status_code == 504, pending.content

    # `tenantq worker --app shop.jobs` in the project's directory: shop/jobs.py sets Django up
    worker = shop.procs.start("worker", [sys.executable, "-m", "tenantq.cli", "worker", "--app", "shop.jobs",
                                         "--sandbox", "inline", "--concurrency", "1"],
                              cwd=PROJECT, env=shop.env)
    try:
        answer = shop.client.get(f"/orders/{order_id}/receipt", {"timeout": "30"})  # woken when it ends
        assert answer.status_code == 200, (answer.content, shop.procs.log(worker))
        assert answer.json()["receipt"]["text"] == "cup: 3.00"
        assert shop.order(order_id).receipt_sent_at is not None
    finally:
        assert shop.procs.stop(worker) == 0, shop.procs.log(worker)


def test_the_management_command_takes_the_workers_options_and_reports_its_errors(shop: Shop) -> None:
    help_ = shop.procs.run([sys.executable, "manage.py", "tenantq_worker", "--help"],
                           cwd=PROJECT, env=shop.env)
    assert help_.returncode == 0 and "--concurrency" in help_.stdout, help_.stderr
    bad = shop.procs.run([sys.executable, "manage.py", "tenantq_worker", "--concurrency", "0"],
                         cwd=PROJECT, env=shop.env)
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1].startswith("error:"), bad.stderr


