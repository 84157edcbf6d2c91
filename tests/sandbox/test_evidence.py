"""Settling by evidence: when a sandbox dies mid-batch, finished jobs keep
their results, the job it died on fails with the classified reason, and jobs
that never started go back without losing an attempt. Also the built-in
`tenantq.python` kind: sandboxed only."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import tests.apps.hostile  # noqa: F401  (registers the box.* handlers in this process too)
from tenantq import JobSpec, Queue
from tenantq.dispatch.executors.contract import Report
from tenantq.dispatch.executors.sandboxed import SandboxExecutor
from tenantq.dispatch.outcome import Backoff
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.domain.records import Batch
from tenantq.registry import REGISTRY
from tenantq.sandbox.driver import SandboxDriver
from tenantq.store.db import Database
from tests.acceptance.helpers import Cli
from tests.sandbox.conftest import HOSTILE_APP, worker_args

TENANT = "acme"
WORKER_TIMEOUT = 120.0


class FirstBatchOnly:
    """Runs one batch on the real SandboxExecutor, then stops the worker
    gracefully, so the test sees the store exactly as that batch left it."""

    def __init__(self, inner: SandboxExecutor) -> None:
        self.inner = inner
        self.name = inner.name
        self.driver = inner.driver
        self.worker: Worker | None = None
        self.batches: list[list[int]] = []

    def run(self, batch: Batch, *, env: Mapping[str, str], report: Report,
            should_stop: Callable[[], bool]) -> None:
        self.batches.append([j.id for j in batch.jobs])
        try:
            self.inner.run(batch, env=env, report=report, should_stop=should_stop)
        finally:
            assert self.worker is not None
            self.worker.stop()


def _config() -> WorkerConfig:
    return WorkerConfig(concurrency=1, batch_size=5, once=True, lease_seconds=30,
                        backoff=Backoff(base_seconds=0.0, cap_seconds=0.0))


def _row(queue: Queue, job_id: int) -> dict[str, Any]:
    info = queue.job(job_id)
    return {"status": info.status, "attempts": info.attempts, "result": info.result,
            "last_error": info.last_error}


def test_a_crashing_job_fails_alone_and_its_batch_goes_on(driver: SandboxDriver, db: Database,
                                                          queue: Queue) -> None:
    """Each job runs in a process of its own: a segfault ends only that job."""
    kinds = ["box.echo", "box.segfault", "box.echo"]
    ids = queue.enqueue_many([JobSpec(tenant=TENANT, kind=k, payload={"n": n}) for n, k in enumerate(kinds)])
    first = FirstBatchOnly(SandboxExecutor(driver, REGISTRY, HOSTILE_APP))
    worker = Worker(db, first, _config())
    first.worker = worker
    worker.run()
    rows = [_row(queue, job_id) for job_id in ids]
    assert rows[0]["status"] == rows[2]["status"] == "done", rows
    assert rows[1]["status"] == "pending" and rows[1]["attempts"] == 1, rows[1]
    assert rows[1]["last_error"].startswith("crashed: SIGSEGV"), rows[1]


def test_a_sandbox_death_mid_batch_settles_each_job_by_evidence(driver: SandboxDriver, db: Database,
                                                                queue: Queue) -> None:
    kinds = ["box.echo", "box.echo", "box.kill_sandbox", "box.echo", "box.echo"]
    ids = queue.enqueue_many([JobSpec(tenant=TENANT, kind=k, payload={"n": n},
                                      max_attempts=2 if k == "box.kill_sandbox" else 5)
                              for n, k in enumerate(kinds)])
    done1, done2, poison, later1, later2 = ids
    executor = SandboxExecutor(driver, REGISTRY, HOSTILE_APP)

    # one batch of five, and the sandbox dies on the third job
    first = FirstBatchOnly(executor)
    worker = Worker(db, first, _config())
    first.worker = worker
    worker.run()
    assert first.batches == [ids]

    before = {job_id: _row(queue, job_id) for job_id in ids}
    for job_id, n in ((done1, 0), (done2, 1)):
        row = before[job_id]
        assert row["status"] == "done" and row["attempts"] == 1, row
        assert row["result"]["payload"] == {"n": n} and row["result"]["tenant"] == TENANT
    crashed = before[poison]
    assert crashed["status"] == "pending" and crashed["attempts"] == 1, crashed
    # the host's own classification of how the sandbox ended (rule H2)
    assert crashed["last_error"].startswith(("oom: exceeded", "killed by signal 9")), crashed
    for job_id in (later1, later2):
        row = before[job_id]
        # never started: released with the attempt the lease counted given back
        assert row == {"status": "pending", "attempts": 0, "result": None, "last_error": None}, row

    # a fresh worker drains the rest: the poison job dies after its own
    # max_attempts; nobody re-runs what had already finished
    stats = Worker(db, executor, _config()).run()
    after = {job_id: _row(queue, job_id) for job_id in ids}
    assert after[done1] == before[done1] and after[done2] == before[done2]
    dead = after[poison]
    assert dead["status"] == "dead" and dead["attempts"] == 2, dead
    assert dead["last_error"].startswith(("oom: exceeded", "killed by signal 9")), dead
    for job_id, n in ((later1, 3), (later2, 4)):
        row = after[job_id]
        assert row["status"] == "done" and row["attempts"] == 1, row
        assert row["result"]["payload"] == {"n": n}
    assert stats.done == 2 and stats.dead == 1, stats.snapshot()


def test_a_poison_job_dies_alone_through_the_cli(driver_name: str, cli: Cli, queue: Queue) -> None:
    ids = queue.enqueue_many([
        JobSpec(tenant=TENANT, kind="box.echo", payload={"n": 0}),
        JobSpec(tenant=TENANT, kind="box.segfault", max_attempts=3),
        JobSpec(tenant=TENANT, kind="box.echo", payload={"n": 2}),
        JobSpec(tenant=TENANT, kind="box.echo", payload={"n": 3}),
    ])
    res = cli.run(*worker_args(HOSTILE_APP, driver_name, "--once", "--concurrency", "1", "--batch-size", "5",
                               "--backoff-base", "0"), timeout=WORKER_TIMEOUT)
    assert res.returncode == 0, res.stderr[-3000:]
    poison = queue.job(ids[1])
    assert poison.status == "dead" and poison.attempts == 3, poison
    assert (poison.last_error or "").startswith("crashed: SIGSEGV"), poison.last_error
    for job_id in (ids[0], ids[2], ids[3]):
        echo = queue.job(job_id)
        # ran exactly once: released jobs get their attempt back, finished ones are never re-run
        assert echo.status == "done" and echo.attempts == 1, echo


def test_tenant_python_runs_in_the_sandbox(driver_name: str, cli: Cli, queue: Queue) -> None:
    summed = queue.enqueue(TENANT, "tenantq.python",
                           {"source": "def transform(x):\n    return sum(x)", "input": [1, 2, 3]})
    sneaky = queue.enqueue(TENANT, "tenantq.python", {
        "source": "import os\ndef transform(x):\n    return [os.getuid(), os.path.exists('/etc/shadow')]",
        "input": None})
    res = cli.run(*worker_args(HOSTILE_APP, driver_name, "--once"), timeout=WORKER_TIMEOUT)
    assert res.returncode == 0, res.stderr[-3000:]
    info = queue.job(summed)
    assert info.status == "done" and info.result == 6, info
    assert queue.job(sneaky).result == [65534, False]


def test_tenant_python_is_refused_inline(cli: Cli, queue: Queue, data_dir: Path) -> None:
    """An inline worker does not take a sandbox-only kind at all: the job
    waits, untouched, for a sandboxed worker."""
    job_id = queue.enqueue(TENANT, "tenantq.python",
                           {"source": "def transform(x):\n    return sum(x)", "input": [1, 2, 3]})
    res = cli.run(*worker_args(HOSTILE_APP, "inline", "--once"), timeout=WORKER_TIMEOUT)
    assert res.returncode == 0, res.stderr[-3000:]
    info = queue.job(job_id)
    assert (info.status, info.attempts, info.last_error, info.result) == ("pending", 0, None, None), info


def test_process_batch_shares_a_process_between_consecutive_jobs_of_its_kind(
        driver: SandboxDriver, db: Database, queue: Queue) -> None:
    plan = [("box.count_shared", {}), ("box.count_shared", {}), ("box.count_shared", {"crash": True}),
            ("box.count_shared", {}), ("box.count_fresh", {}), ("box.count_fresh", {}),
            ("box.count_shared", {})]
    ids = queue.enqueue_many([JobSpec(tenant=TENANT, kind=k, payload=p) for k, p in plan])
    first = FirstBatchOnly(SandboxExecutor(driver, REGISTRY, HOSTILE_APP))
    worker = Worker(db, first, WorkerConfig(concurrency=1, batch_size=10, once=True, lease_seconds=30,
                                            backoff=Backoff(base_seconds=0.0, cap_seconds=0.0)))
    first.worker = worker
    worker.run()
    rows = [queue.job(job_id) for job_id in ids]
    results = [r.result for r in rows]
    # shared: the counter goes on within one process
    assert [results[0]["n"], results[1]["n"]] == [1, 2] and results[0]["pid"] == results[1]["pid"], results
    # its process crashed: that job fails alone, the next one gets a fresh process
    assert rows[2].status == "pending" and (rows[2].last_error or "").startswith("crashed"), rows[2]
    assert results[3]["n"] == 1 and results[3]["pid"] != results[0]["pid"], results
    # the default kind: a fresh process for every job
    assert [results[4]["n"], results[5]["n"]] == [1, 1] and results[4]["pid"] != results[5]["pid"], results
    # another kind came in between: a fresh process again
    assert results[6]["n"] == 1, results
