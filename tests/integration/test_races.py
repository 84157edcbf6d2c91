"""Concurrency: several workers drain a shared backlog with every job
settled exactly once; concurrent claims never hand out a job twice; and
enqueues racing the scheduler's has_work bookkeeping never strand a job."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import tests.apps.basic  # noqa: F401  (registers the demo.* handlers)
from tenantq import REGISTRY, Queue
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.domain.records import Settlement
from tenantq.fairness import ClaimRequest, claim_next
from tenantq.store import jobs, wakes
from tenantq.store.db import Database
from tenantq.testing import drain, wait_until
from tests.integration.helpers import fetch_all, fetch_one, running, scalar, status_counts


def _start_together(targets: list[Any], timeout: float = 60) -> None:
    """Run callables in threads released by one barrier; re-raise the first error."""
    barrier = threading.Barrier(len(targets))
    errors: list[BaseException] = []

    def wrap(fn: Any) -> None:
        try:
            barrier.wait(timeout=10)
            fn()
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=wrap, args=(fn,), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a racing thread hung"
    if errors:
        raise errors[0]


def test_workers_drain_a_shared_backlog_exactly_once(queue: Queue, db: Database, tmp_path: Path) -> None:
    log = tmp_path / "executions.log"
    tenants = [f"tenant-{i:02d}" for i in range(20)]
    ids = queue.enqueue_many(
        [{"tenant": tenants[i % 20], "kind": "demo.record", "payload": {"log": str(log)}}
         for i in range(3000)]
    )
    workers = [
        Worker(db, InlineExecutor(REGISTRY), WorkerConfig(
            concurrency=3, batch_size=10, lease_seconds=30, poll_seconds=0.2, worker_id=f"racer-{n}"))
        for n in range(4)
    ]
    with running(*workers) as threads:
        wait_until(lambda: scalar(db, "SELECT count(*) FROM jobs WHERE status = 'done'") == 3000,
                   timeout=45, interval=0.1, message="3000 jobs done")
    stats = [t.stats for t in threads]
    assert all(s is not None for s in stats)

    # every job done, with its own result, on its first attempt
    rows = fetch_all(db, "SELECT id, status, attempts, result, batch_id FROM jobs ORDER BY id")
    assert [r["id"] for r in rows] == ids
    assert all(r["status"] == "done" and r["attempts"] == 1 and r["batch_id"] is None for r in rows)
    assert all(r["result"] == {"job": r["id"]} for r in rows)
    # settled exactly once: the workers' accepted settlements add up to the
    # backlog and none was refused
    totals = Counter[str]()
    for s in stats:
        assert s is not None
        totals.update(s.snapshot())
    assert totals["done"] == 3000
    assert totals["refused"] == 0 and totals["retried"] == 0 and totals["dead"] == 0
    assert sum(1 for s in stats if s is not None and s.done > 0) >= 2, "the work was shared"
    # executed once each (no lease was lost, so at-least-once means once)
    executions = Counter(int(line.split()[0]) for line in log.read_text().splitlines())
    assert set(executions) == set(ids)
    assert max(executions.values()) == 1
    # every lease ended cleanly and covered each job once
    leases = fetch_one(
        db,
        "SELECT count(*) FILTER (WHERE ended_at IS NULL) AS live, "
        "count(*) FILTER (WHERE outcome <> 'ok') AS not_ok, sum(job_count) AS jobs FROM batches",
    )
    assert leases == {"live": 0, "not_ok": 0, "jobs": 3000}


def test_concurrent_claim_next_never_hands_out_a_job_twice(queue: Queue, db: Database) -> None:
    ids = queue.enqueue_many(
        [{"tenant": f"t{i % 12}", "kind": "demo.noop"} for i in range(1200)]
    )
    claimed: list[list[int]] = []
    lock = threading.Lock()

    def claimer(n: int) -> None:
        mine: list[int] = []
        request = ClaimRequest(worker_id=f"claimer-{n}", driver="test", batch_size=7, lease_seconds=60)
        with db.connect() as conn:
            while (batch := claim_next(conn, request, "default")) is not None:
                assert len({j.tenant_id for j in batch.jobs}) == 1
                mine.extend(j.id for j in batch.jobs)
        with lock:
            claimed.append(mine)

    _start_together([lambda n=n: claimer(n) for n in range(8)])
    every = [i for mine in claimed for i in mine]
    assert len(every) == len(set(every)), "a job was leased twice"
    assert sorted(every) == ids
    assert status_counts(db) == {"running": 1200}
    batches = scalar(db, "SELECT count(*) FROM batches")
    assert scalar(db, "SELECT count(DISTINCT batch_id) FROM jobs") == batches


def test_concurrent_store_claims_of_one_tenant_skip_locked_rows(queue: Queue, db: Database) -> None:
    """The claim statement alone (no scheduler lock in front of it): SKIP
    LOCKED keeps concurrent leases of one tenant's jobs disjoint."""
    ids = queue.enqueue_many([{"tenant": "acme", "kind": "demo.noop"} for _ in range(1000)])
    with db.connect() as conn:
        wakes.fold(conn)  # the tenant's row, which its batches reference
    claimed: list[list[int]] = []
    lock = threading.Lock()

    def claimer(n: int) -> None:
        mine: list[int] = []
        with db.connect() as conn:
            while (batch := jobs.claim(conn, tenant_id="acme", priority="default", limit=5,
                                       worker_id=f"raw-{n}", driver="test", lease_seconds=60)) is not None:
                mine.extend(j.id for j in batch.jobs)
        with lock:
            claimed.append(mine)

    _start_together([lambda n=n: claimer(n) for n in range(8)])
    every = [i for mine in claimed for i in mine]
    assert len(every) == len(set(every)), "a job was leased twice"
    assert sorted(every) == ids
    assert scalar(db, "SELECT count(*) FROM jobs WHERE attempts <> 1") == 0


def _stranded(db: Database) -> list[dict[str, Any]]:
    """Queues with a runnable pending job that the scheduler cannot see."""
    return fetch_all(
        db,
        """
        SELECT j.tenant_id, j.priority, count(*) AS pending, q.has_work, q.next_run_at
        FROM jobs j LEFT JOIN queues q USING (tenant_id, priority)
        WHERE j.status = 'pending'
        GROUP BY j.tenant_id, j.priority, q.has_work, q.next_run_at
        HAVING q.has_work IS NOT TRUE OR q.next_run_at > min(j.run_after)
        """,
    )


def test_enqueue_racing_the_scheduler_never_strands_a_job(db: Database) -> None:
    rounds, producers, consumers, per_producer = 40, 3, 3, 6
    request = ClaimRequest(worker_id="drainer", driver="test", batch_size=2, lease_seconds=60)
    queues = [Queue(db.dsn, schema=db.schema) for _ in range(producers)]
    total = 0
    try:
        for round_no in range(rounds):
            producing = threading.Event()
            producing.set()
            finished = [0]
            lock = threading.Lock()

            def producer(q: Queue, round_no: int = round_no) -> None:
                for i in range(per_producer):
                    q.enqueue("acme", "demo.noop", {"round": round_no, "i": i})

            def consumer(producing: threading.Event = producing, finished: list[int] = finished,
                         lock: threading.Lock = lock) -> None:
                with db.connect() as conn:
                    while True:
                        still_producing = producing.is_set()
                        batch = claim_next(conn, request, "default")
                        if batch is None:
                            if not still_producing:
                                return  # nothing left after the producers were done
                            continue
                        jobs.settle(conn, batch.batch_id, [Settlement(j.id, "done") for j in batch.jobs],
                                    end_outcome="ok")
                        with lock:
                            finished[0] += len(batch.jobs)

            def producers_then_flag(producing: threading.Event = producing) -> None:
                inner = [threading.Thread(target=producer, args=(q,)) for q in queues]
                for t in inner:
                    t.start()
                for t in inner:
                    t.join()
                producing.clear()

            _start_together([producers_then_flag] + [consumer] * consumers)
            total += producers * per_producer
            # the scheduler's view must agree with the table before anyone repairs it
            assert _stranded(db) == [], f"round {round_no}: a pending job is invisible to the scheduler"
            assert status_counts(db).get("pending", 0) == 0, f"round {round_no}: jobs left behind"
            assert finished[0] == producers * per_producer
    finally:
        for q in queues:
            q.close()

    assert status_counts(db) == {"done": total}
    drain(db)
    assert status_counts(db) == {"done": total}


def test_enqueue_into_an_emptied_queue_racing_its_clear(queue: Queue, db: Database) -> None:
    """The sharpest form of the race: queues that say has_work but hold no
    pending job (their last job was cancelled), so every probe takes the
    clear path, while one enqueue per queue lands at the same moment."""
    rounds, tenants_per_round, consumers = 25, 8, 3
    request = ClaimRequest(worker_id="clearer", driver="test", batch_size=5, lease_seconds=60)
    producer_queues = [Queue(db.dsn, schema=db.schema) for _ in range(tenants_per_round)]
    enqueued: list[int] = []
    try:
        for round_no in range(rounds):
            tenants = [f"r{round_no:02d}-t{i}" for i in range(tenants_per_round)]
            for tenant in tenants:
                assert queue.cancel(queue.enqueue(tenant, "demo.noop")) is True
            ids_lock = threading.Lock()

            def producer(q: Queue, tenant: str, ids_lock: threading.Lock = ids_lock) -> None:
                job_id = q.enqueue(tenant, "demo.noop")
                with ids_lock:
                    enqueued.append(job_id)

            def consumer() -> None:
                with db.connect() as conn:
                    for _ in range(3):
                        batch = claim_next(conn, request, "default")
                        if batch is not None:
                            jobs.settle(conn, batch.batch_id, [Settlement(j.id, "done") for j in batch.jobs],
                                        end_outcome="ok")

            _start_together(
                [lambda q=q, t=t: producer(q, t) for q, t in zip(producer_queues, tenants, strict=True)]
                + [consumer] * consumers
            )
            assert _stranded(db) == [], f"round {round_no}: a pending job is invisible to the scheduler"
    finally:
        for q in producer_queues:
            q.close()

    # whatever the consumers did not take is still visible: claims alone finish it
    with db.connect() as conn:
        while (batch := claim_next(conn, request, "default")) is not None:
            done = [Settlement(j.id, "done") for j in batch.jobs]
            jobs.settle(conn, batch.batch_id, done, end_outcome="ok")
    counts = status_counts(db)
    assert counts == {"done": len(enqueued), "cancelled": rounds * tenants_per_round}


def test_concurrent_enqueues_with_one_idempotency_key_make_one_job(db: Database) -> None:
    queues = [Queue(db.dsn, schema=db.schema) for _ in range(8)]
    ids: list[int] = []
    lock = threading.Lock()

    def enqueue(q: Queue) -> None:
        job_id = q.enqueue("acme", "demo.noop", key="only-once")
        with lock:
            ids.append(job_id)

    try:
        _start_together([lambda q=q: enqueue(q) for q in queues])
    finally:
        for q in queues:
            q.close()
    assert len(ids) == 8 and len(set(ids)) == 1
    assert scalar(db, "SELECT count(*) FROM jobs") == 1
