"""Pausing a tenant on real Postgres: `Queue.pause_tenant` makes the pick
skip the tenant (queues.sql `candidates`) while everyone else's jobs run;
its jobs wait, pending, and say why (`why_waiting`); enqueueing goes on;
a batch already running when the pause came finishes; resuming lets them
run. Handlers live in a registry of each test's own."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

import tenantq
from tenantq import JobSpec, Queue
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.outcome import Backoff
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.errors import InvalidInput
from tenantq.registry import Registry
from tenantq.store.db import Database
from tenantq.testing import wait_until
from tests.integration.helpers import fetch_all, running

NO_BACKOFF = Backoff(base_seconds=0.0, cap_seconds=0.0)
CLASSES = ("interactive", "default", "bulk")


class Gate:
    """A blocking handler's switches: it says it started, and waits to be let go."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    try:
        yield g
    finally:
        g.release.set()


@pytest.fixture
def registry(gate: Gate) -> Registry:
    reg = Registry()

    @tenantq.handler("p.work", isolation="inline", registry=reg)
    def work(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
        return {"tenant": ctx.tenant, "job": ctx.job_id}

    @tenantq.handler("p.block", isolation="inline", registry=reg)
    def block(payload: Any, ctx: tenantq.JobContext) -> None:
        gate.started.set()
        assert gate.release.wait(15), "the test never let the job go"

    return reg


def _worker(db: Database, registry: Registry, **config: Any) -> Worker:
    settings: dict[str, Any] = {"concurrency": 1, "batch_size": 10, "lease_seconds": 30, "poll_seconds": 0.1,
                                "backoff": NO_BACKOFF}
    settings.update(config)
    return Worker(db, InlineExecutor(registry), WorkerConfig(**settings))


def _statuses(db: Database, ids: list[int]) -> list[tuple[str, int]]:
    rows = fetch_all(db, "SELECT status, attempts FROM jobs WHERE id = ANY(%(ids)s) ORDER BY id",
                     {"ids": ids})
    return [(str(r["status"]), int(r["attempts"])) for r in rows]


def _all_done(queue: Queue, ids: list[int]) -> bool:
    return all(queue.job(j).status == "done" for j in ids)


def test_a_paused_tenant_waits_while_others_run_and_runs_once_resumed(queue: Queue, db: Database,
                                                                      registry: Registry) -> None:
    paused = queue.pause_tenant("a")
    assert paused["tenant_id"] == "a" and paused["paused_at"] is not None
    assert [t["paused_at"] is not None for t in queue.tenants("a")] == [True]
    # a's jobs first, in every class: were they offered, the worker would take them first
    a_jobs = queue.enqueue_many([JobSpec("a", "p.work", priority=p) for p in CLASSES])
    b_jobs = queue.enqueue_many([JobSpec("b", "p.work", priority=p) for p in CLASSES])
    with running(_worker(db, registry)):
        wait_until(lambda: _all_done(queue, b_jobs), timeout=10, message="b's jobs done")
        # and more of b's, enqueued after: the worker is still picking, still passing a by
        more_b = queue.enqueue_many([JobSpec("b", "p.work") for _ in range(5)])
        wait_until(lambda: _all_done(queue, more_b), timeout=10, message="b's later jobs done")
        assert _statuses(db, a_jobs) == [("pending", 0)] * 3, "a's jobs were not claimed"
        for job in a_jobs:
            why = queue.job(job).why_waiting
            assert any("paused" in reason and "tenant a" in reason for reason in why), why
        assert not any("paused" in r for r in queue.job(queue.enqueue("b", "p.work", delay=3600)).why_waiting)

        resumed = queue.pause_tenant("a", paused=False)
        assert resumed["paused_at"] is None
        wait_until(lambda: _all_done(queue, a_jobs), timeout=10, message="a's jobs done once resumed")
    assert all(queue.job(j).attempts == 1 for j in a_jobs)


def test_a_batch_running_when_the_pause_comes_finishes(queue: Queue, db: Database, registry: Registry,
                                                       gate: Gate) -> None:
    with running(_worker(db, registry, batch_size=3)):
        batch = queue.enqueue_many([JobSpec("a", "p.block"), JobSpec("a", "p.work"), JobSpec("a", "p.work")])
        assert gate.started.wait(10), "the batch did not start"
        queue.pause_tenant("a")
        after = queue.enqueue("a", "p.work")  # enqueueing goes on while paused
        gate.release.set()
        wait_until(lambda: _all_done(queue, batch), timeout=10, message="the running batch finished")
        # the batch's unstarted jobs ran too (they were in the batch); the
        # job enqueued after the pause waits
        assert _statuses(db, [after]) == [("pending", 0)]
        assert any("paused" in r for r in queue.job(after).why_waiting)
        queue.pause_tenant("a", paused=False)
        wait_until(lambda: queue.job(after).status == "done", timeout=10, message="the later job, resumed")


def test_pausing_an_unknown_tenant_creates_it_paused_and_bad_names_are_refused(queue: Queue) -> None:
    row = queue.pause_tenant("newcomer")
    assert row["paused_at"] is not None
    assert queue.pause_tenant("newcomer")["paused_at"] == row["paused_at"], "pausing twice keeps the time"
    with pytest.raises(InvalidInput):
        queue.pause_tenant("no spaces allowed")
