"""A pick decides under the class's cursor lock and claims after that
lock is released (fairness/picker.py `claim_next`): what each half keeps,
and what the claim gives back when it gets less than it was charged for."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest

from tenantq import Queue
from tenantq.domain.records import Batch
from tenantq.fairness import ClaimRequest, claim_next
from tenantq.fairness.drr import MAX_CREDIT, Mode
from tenantq.fairness.picker import add_to_deficits
from tenantq.store import wakes
from tenantq.store.db import Conn, Database
from tenantq.testing import wait_until
from tests.integration.helpers import db_now, fetch_one


def _request(batch_size: int = 10, *, fair_by: Mode = Mode.JOBS, worker: str = "w") -> ClaimRequest:
    return ClaimRequest(worker_id=worker, driver="test", batch_size=batch_size, lease_seconds=30,
                        fair_by=fair_by, quantum_seconds=1.0)


@pytest.fixture
def conn(db: Database) -> Iterator[Conn]:
    with db.connect() as c:
        yield c


@pytest.fixture
def t0(db: Database) -> datetime:
    return db_now(db)


def _deficit(db: Database, tenant: str) -> float:
    row = fetch_one(db, "SELECT deficit FROM queues WHERE tenant_id = %(t)s AND priority = 'default'",
                    {"t": tenant})
    return float(row["deficit"])


def test_the_claim_runs_after_the_cursor_lock_is_released(queue: Queue, db: Database, conn: Conn,
                                                          t0: datetime) -> None:
    # One pick's claim is held up (its tenant's row is locked by someone
    # else, so its cap check waits). Another pick of the same class must
    # decide and claim meanwhile: with the claim under the cursor lock it
    # would wait for the first pick's commit, and its lock_timeout would
    # fail it.
    queue.set_tenant("a-capped", max_sandboxes=5)
    queue.enqueue_many([{"tenant": "a-capped", "kind": "demo.noop"}] * 3, now=t0)
    queue.enqueue_many([{"tenant": "b-free", "kind": "demo.noop"}] * 3, now=t0)
    now = t0 + timedelta(seconds=1)
    got: dict[str, Batch | BaseException | None] = {}
    with db.connect(autocommit=False) as holder, db.connect() as other:
        # the lock another pick's cap check takes (tenants.sql lock_for_cap)
        holder.execute("SELECT 1 FROM tenants WHERE tenant_id = 'a-capped' FOR NO KEY UPDATE")

        def first() -> None:
            try:
                got["first"] = claim_next(conn, _request(worker="first"), "default", now=now)
            except BaseException as exc:  # reported to the test thread
                got["first"] = exc

        thread = threading.Thread(target=first)
        thread.start()
        try:
            pid = conn.info.backend_pid
            wait_until(lambda: fetch_one(db, "SELECT wait_event_type AS w, query FROM pg_stat_activity "
                                             "WHERE pid = %(pid)s", {"pid": pid})["w"] == "Lock",
                       timeout=10, message="the first pick waiting in its claim")
            other.execute("SET lock_timeout = '3s'")
            second = claim_next(other, _request(worker="second"), "default", now=now)
            assert second is not None and second.tenant_id == "b-free"
            assert "first" not in got, "the first pick is still waiting"
        finally:
            holder.rollback()
            thread.join(30)
    first_batch = got["first"]
    assert isinstance(first_batch, Batch) and first_batch.tenant_id == "a-capped"
    assert len(first_batch.jobs) == 3


def test_a_claim_short_of_its_charge_leaves_a_dry_queue_no_credit(queue: Queue, db: Database, conn: Conn,
                                                                  t0: datetime) -> None:
    # weight 3, batch 10: the decision credits 30 and charges a full batch
    # (20 left, the turn stays open); the claim finds 4 jobs, so the queue
    # is dry and keeps no credit, as deficit round robin resets an emptied
    # queue
    queue.set_tenant("heavy", weight=3)
    queue.enqueue_many([{"tenant": "heavy", "kind": "demo.noop"}] * 4, now=t0)
    batch = claim_next(conn, _request(), "default", now=t0 + timedelta(seconds=1))
    assert batch is not None and len(batch.jobs) == 4
    assert _deficit(db, "heavy") == 0.0
    # a full claim keeps the rest of its turn's credit
    queue.enqueue_many([{"tenant": "heavy", "kind": "demo.noop"}] * 25, now=t0)
    batch = claim_next(conn, _request(), "default", now=t0 + timedelta(seconds=2))
    assert batch is not None and len(batch.jobs) == 10
    assert _deficit(db, "heavy") == 20.0


def test_runtime_mode_charges_the_estimate_of_the_jobs_claimed(queue: Queue, db: Database, conn: Conn,
                                                               t0: datetime) -> None:
    # runtime mode, no history: a batch of 10 is estimated at one quantum
    # (0.1 s a job). The decision charges 10 estimates; the claim takes 4
    # and gives 6 back, up to 0: the dry queue keeps no credit, and the
    # batch carries the charge of the 4 it has.
    queue.enqueue_many([{"tenant": "acme", "kind": "demo.noop"}] * 4, now=t0)
    batch = claim_next(conn, _request(fair_by=Mode.RUNTIME), "default", now=t0 + timedelta(seconds=1))
    assert batch is not None and len(batch.jobs) == 4
    charged = fetch_one(db, "SELECT charged_seconds FROM batches WHERE batch_id = %(b)s",
                        {"b": batch.batch_id})
    assert charged["charged_seconds"] == pytest.approx(0.4)
    assert _deficit(db, "acme") == 0.0


def test_a_claim_that_finds_nothing_gives_its_whole_charge_back(queue: Queue, db: Database, conn: Conn,
                                                                t0: datetime) -> None:
    # every runnable job of "locked" is row-locked by someone else, so the
    # claim (SKIP LOCKED) gets none: its charge is repaid exactly, and the
    # pick goes on to the next queue instead
    queue.set_tenant("a-locked", weight=2)
    queue.enqueue_many([{"tenant": "a-locked", "kind": "demo.noop"}] * 3, now=t0)
    queue.enqueue_many([{"tenant": "b-open", "kind": "demo.noop"}] * 3, now=t0)
    before = _deficit(db, "a-locked")
    with db.connect(autocommit=False) as holder:
        holder.execute("SELECT 1 FROM jobs WHERE tenant_id = 'a-locked' FOR UPDATE")
        batch = claim_next(conn, _request(), "default", now=t0 + timedelta(seconds=1))
        holder.rollback()
    assert batch is not None and batch.tenant_id == "b-open"
    assert _deficit(db, "a-locked") == before


def test_deficits_are_only_added_to_bounded_and_capped(db: Database, queue: Queue) -> None:
    # the decision, the repayments and the batch-end charge all add to a
    # deficit (so they commute when they overlap); an addition is bounded
    # at +-1e12 (MAX_CREDIT), a ceiling caps the result, and a delta that
    # is not a finite number changes nothing
    queue.enqueue("acme", "demo.noop")
    with db.connect() as c:
        wakes.fold(c)  # the queue row, as a worker looking for work makes it

        def add(delta: float, ceiling: float = MAX_CREDIT) -> None:
            with c.transaction():
                add_to_deficits(c, "default", {"acme": delta}, ceiling=ceiling)

        add(5.0)
        add(-2.0)
        assert _deficit(db, "acme") == 3.0
        add(4.0, ceiling=0.0)
        assert _deficit(db, "acme") == 0.0
        add(1e300)
        assert _deficit(db, "acme") == MAX_CREDIT
        for hostile in (float("nan"), float("inf"), float("-inf")):
            add(hostile)
            assert _deficit(db, "acme") == MAX_CREDIT
        add(-3e12)
        assert _deficit(db, "acme") == -MAX_CREDIT


def test_the_decisions_commit_mode_never_leaks_into_a_callers_transaction(queue: Queue, db: Database,
                                                                          t0: datetime) -> None:
    # the decision commits without waiting for the WAL flush only when it is
    # a transaction of its own; inside a caller's (a savepoint) the caller's
    # commit must stay synchronous, and on its own the setting ends with it
    queue.enqueue_many([{"tenant": "acme", "kind": "demo.noop"}] * 2, now=t0)
    with db.connect() as c:
        wakes.fold(c)  # claim_next folds only on a connection with no transaction open

    def mode(c: Conn) -> str:
        return str(c.execute("SHOW synchronous_commit").fetchone()["synchronous_commit"])  # type: ignore[index]

    with db.connect() as c:
        with c.transaction():
            assert claim_next(c, _request(batch_size=1), "default", now=t0 + timedelta(seconds=1)) is not None
            assert mode(c) == "on"
        assert claim_next(c, _request(batch_size=1), "default", now=t0 + timedelta(seconds=1)) is not None
        assert mode(c) == "on"
