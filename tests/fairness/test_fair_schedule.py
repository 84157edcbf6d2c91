"""Fair scheduling against real Postgres with several workers."""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import tenantq
import tests.apps.basic  # noqa: F401  (registers the test handlers)
from tenantq import JobSpec, Queue
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.store.db import Database
from tenantq.testing import wait_until


def _count(db: Database, where: str, params: dict[str, object] | None = None) -> int:
    with db.connect() as conn:
        row = conn.execute(f"SELECT count(*) AS n FROM jobs WHERE {where}", params or {}).fetchone()  # type: ignore[arg-type]
    assert row is not None
    return int(str(row["n"]))


class WorkerThreads:
    def __init__(self) -> None:
        self.workers: list[tuple[Worker, threading.Thread]] = []

    def start(self, db: Database, **config: object) -> Worker:
        worker = Worker(db, InlineExecutor(tenantq.REGISTRY), WorkerConfig(**config))  # type: ignore[arg-type]
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        self.workers.append((worker, thread))
        return worker

    def stop_all(self) -> None:
        for worker, _ in self.workers:
            worker.stop()
        for _, thread in self.workers:
            thread.join(timeout=30)
            assert not thread.is_alive()


@pytest.fixture
def worker_threads() -> Iterator[WorkerThreads]:
    threads = WorkerThreads()
    try:
        yield threads
    finally:
        threads.stop_all()


def test_small_tenants_finish_within_a_few_rounds_of_a_whale(
    db: Database, queue: Queue, worker_threads: WorkerThreads
) -> None:
    batch = 10
    queue.enqueue_many([JobSpec("whale", "demo.noop", {"i": i}) for i in range(20_000)])
    for _ in range(2):
        worker_threads.start(db, concurrency=4, batch_size=batch, poll_seconds=0.05)
    wait_until(lambda: _count(db, "tenant_id = 'whale' AND status = 'done'") >= 500, timeout=30,
               message="the whale to be under way")
    small = [f"small{i}" for i in range(5)]
    queue.enqueue_many([JobSpec(t, "demo.noop", {"i": i}) for t in small for i in range(20)])
    with db.connect() as conn:
        row = conn.execute("SELECT max(id) AS last FROM jobs").fetchone()
    assert row is not None
    wait_until(lambda: _count(db, "tenant_id LIKE 'small%%' AND status = 'done'") == 100, timeout=30,
               message="the small tenants' jobs")
    with db.connect() as conn:
        row = conn.execute(
            """SELECT count(*) AS n FROM jobs w
               WHERE w.tenant_id = 'whale' AND w.status = 'done'
                 AND w.finished_at > (SELECT min(created_at) FROM jobs WHERE tenant_id LIKE 'small%%')
                 AND w.finished_at <= (SELECT max(finished_at) FROM jobs WHERE tenant_id LIKE 'small%%')"""
        ).fetchone()
        whale_left = _count(db, "tenant_id = 'whale' AND status = 'pending'")
    assert row is not None
    whale_meanwhile = int(str(row["n"]))
    # Each small tenant needs 2 batches (2 rounds); per round the whale gets one
    # batch, plus what the 8 slots had in flight when the small jobs arrived.
    assert whale_meanwhile <= (2 + 8 + 2) * batch, whale_meanwhile
    assert whale_left > 10_000  # the small tenants did not wait for the whale


def _worker_proc(cli_env: dict[str, str], tenantq_cmd: list[str], *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*tenantq_cmd, "worker", "--app", "tests.apps.basic", *args],
        env=cli_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def test_weights_hold_across_two_worker_processes(
    db: Database, queue: Queue, cli_env: dict[str, str], tenantq_cmd: list[str]
) -> None:
    weights = {"w1": 1, "w2": 2, "w3": 3}
    for tenant, weight in weights.items():
        queue.set_tenant(tenant, weight=weight)
    queue.enqueue_many([JobSpec(t, "demo.noop", {"i": i}) for t in weights for i in range(8000)])
    procs = [_worker_proc(cli_env, tenantq_cmd, "--concurrency", "2", "--batch-size", "10",
                          "--poll-seconds", "0.1") for _ in range(2)]
    try:
        wait_until(lambda: _count(db, "status = 'done'") >= 4000, timeout=60, message="4000 jobs done")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            assert p.wait(timeout=30) == 0
    assert _count(db, "tenant_id = 'w3' AND status = 'pending'") > 0  # nobody ran dry
    done = {t: _count(db, "tenant_id = %(t)s AND status = 'done'", {"t": t}) for t in weights}
    total = sum(done.values())
    for tenant, weight in weights.items():
        assert done[tenant] / total == pytest.approx(weight / 6, abs=0.03), done


def test_capped_tenant_never_exceeds_its_cap_and_blocks_nobody(
    db: Database, queue: Queue, tmp_path: Path, cli_env: dict[str, str], tenantq_cmd: list[str]
) -> None:
    queue.set_tenant("capped", max_sandboxes=2)
    payload = {"dir": str(tmp_path), "sleep": 0.02}
    queue.enqueue_many([JobSpec("capped", "demo.track", payload, priority=p)
                        for p in ("interactive", "default", "bulk") for _ in range(40)])
    queue.enqueue_many([JobSpec("free", "demo.track", payload) for _ in range(120)])
    procs = [_worker_proc(cli_env, tenantq_cmd, "--concurrency", "4", "--batch-size", "2",
                          "--poll-seconds", "0.05", "--once") for _ in range(2)]
    try:
        for p in procs:
            assert p.wait(timeout=90) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert _count(db, "status <> 'done'") == 0
    assert int((tmp_path / "capped.max").read_text()) <= 2
    # the capacity was there: the uncapped tenant ran more than 2 at once
    assert int((tmp_path / "free.max").read_text()) > 2
