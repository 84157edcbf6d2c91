"""Finding jobs (`Queue.find_jobs`) and the bulk actions on a filtered set
(`cancel_jobs`, `retry_dead_jobs`), on real Postgres: every filter, keyset
pages that neither skip nor repeat a job, chunked bulk statements that wake
`wait()`ers and workers, and bad input that changes nothing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

import tenantq
import tests.apps.basic  # noqa: F401  (registers the demo.* handlers)
from tenantq import AsyncQueue, JobSpec, Queue
from tenantq.client import listener as listener_module
from tenantq.errors import InvalidInput
from tenantq.store import search
from tenantq.store.db import Database
from tenantq.store.steps import execute
from tenantq.testing import drain
from tests.integration.helpers import db_now, fetch_all, fetch_one, status_counts

# a notification-driven wake takes milliseconds; this only separates "woken"
# from "never woken" on a loaded 2-core machine
WAKE_SECONDS = 3.0


def stop_listener(db: Database) -> None:
    """Stop and forget this process's completion listener for `db` (as
    tests/integration/test_wait.py does): a test leaves nothing running."""
    with listener_module._listeners_lock:
        found = listener_module._listeners.pop((db.dsn, db.schema), (None, 0))[0]
    if found is None:
        return
    found._stop.set()
    if found._thread is not None:
        found._thread.join(listener_module.IDLE_SECONDS + listener_module.RECONNECT_SECONDS[1] + 5)
        assert not found._thread.is_alive(), "the tenantq-waits thread did not stop"


@pytest.fixture(autouse=True)
def _stop_listener(db: Database) -> Iterator[None]:
    yield
    stop_listener(db)


def _all_pages(queue: Queue, limit: int, **filters: Any) -> list[int]:
    ids: list[int] = []
    before: str | None = None
    while True:
        page = queue.find_jobs(**filters, limit=limit, before=before)
        ids += [int(j["id"]) for j in page.jobs]
        assert len(page.jobs) <= limit
        if page.next_before is None:
            return ids
        assert len(page.jobs) == limit
        before = page.next_before


def _notifications(conn: psycopg.Connection[Any], *, until_payloads: int = 1) -> list[str]:
    return [n.payload for n in conn.notifies(timeout=WAKE_SECONDS, stop_after=until_payloads)]


def _count_statements(monkeypatch: pytest.MonkeyPatch, block: str) -> list[int]:
    """The rows each `block` statement changed, as the runner executes them."""
    from tenantq.client import runner

    changed: list[int] = []
    real = runner.execute

    def execute(conn: psycopg.Connection[Any], step: Any) -> list[dict[str, Any]]:
        rows = real(conn, step)
        if step.text == search.statement(block):
            changed.append(int(rows[0]["changed"]))
        return rows

    monkeypatch.setattr(runner, "execute", execute)
    return changed


def _listen(db: Database, channel: str) -> psycopg.Connection[Any]:
    conn = db.connect()
    conn.execute(pgsql.SQL("LISTEN {}").format(pgsql.Identifier(channel)))
    return conn


# -- finding -------------------------------------------------------------------


def test_every_filter_selects_and_rows_carry_the_table_fields(queue: Queue, db: Database) -> None:
    now = db_now(db)
    old = queue.enqueue("acme", "reports.render", {"n": 0}, actor="user-1", meta={"plan": "pro", "n": 1},
                        now=now - timedelta(days=3))
    new = queue.enqueue("acme", "reports.render", {"n": 1}, actor="user-2", meta={"plan": "pro", "n": 2})
    mail = queue.enqueue("acme", "mail.send", {"n": 2}, actor="user-1")
    other = queue.enqueue("globex", "reports.render", {"n": 3}, actor="user-1", meta={"plan": "pro"})

    def ids(**filters: Any) -> list[int]:
        return [int(j["id"]) for j in queue.find_jobs(**filters).jobs]

    assert ids() == [other, mail, new, old]
    assert ids(tenant="acme") == [mail, new, old]
    assert ids(tenant="acme", kind="reports.render") == [new, old]
    assert ids(kind="reports.render") == [other, new, old]
    assert ids(tenant="acme", actor="user-1") == [mail, old]
    assert ids(actor="user-1") == [other, mail, old]
    assert ids(meta={"plan": "pro"}) == [other, new, old]
    assert ids(tenant="acme", meta=["plan=pro"]) == [new, old]  # KEY=VALUE items match strings
    assert ids(tenant="acme", meta={"n": 2}) == [new]  # a dict matches any JSON value
    assert ids(tenant="acme", meta='{"n": 1, "plan": "pro"}') == [old]
    assert ids(tenant="acme", meta=["plan=pro", "n=2"]) == []  # "2" is not 2
    assert ids(tenant="acme", since="1d") == [mail, new]
    assert ids(since=timedelta(days=4)) == [other, mail, new, old]
    assert ids(tenant="acme", status="pending", since=3600.0) == [mail, new]
    assert ids(tenant="acme", status="dead") == []
    assert ids(tenant="nobody") == []

    row = queue.find_jobs(tenant="acme", limit=1).jobs[0]
    assert set(row) == {"id", "tenant_id", "kind", "priority", "status", "attempts", "max_attempts", "actor",
                        "meta", "created_at", "error_line"}
    assert (row["id"], row["actor"], row["meta"], row["status"]) == (mail, "user-1", None, "pending")


def test_error_line_is_the_first_line_of_the_last_error(queue: Queue, db: Database) -> None:
    dead = queue.enqueue("acme", "demo.fail", {}, max_attempts=1)
    drain(db, tenantq.REGISTRY)
    [row] = queue.find_jobs(tenant="acme", status="dead").jobs
    assert row["id"] == dead and row["error_line"] == "RuntimeError: boom on attempt 1"
    assert "\n" in (queue.job(dead).last_error or "")


def test_pages_are_keyset_newest_first_and_never_skip_or_repeat(queue: Queue, db: Database) -> None:
    # seven jobs of one statement share one created_at: the id breaks the tie
    tied = queue.enqueue_many([JobSpec("acme", "demo.noop", {"n": n}) for n in range(7)])
    later = [queue.enqueue("acme", "demo.noop", {"n": n}) for n in range(4)]
    expected = sorted([*tied, *later], reverse=True)
    for limit in (1, 2, 3, 7, 11, 50):
        assert _all_pages(queue, limit, tenant="acme") == expected, limit
        assert _all_pages(queue, limit) == expected, limit
    # jobs enqueued between two pages do not shift the next page
    first = queue.find_jobs(tenant="acme", limit=4)
    queue.enqueue_many([JobSpec("acme", "demo.noop", {}) for _ in range(3)])
    second = queue.find_jobs(tenant="acme", limit=4, before=first.next_before)
    assert [j["id"] for j in second.jobs] == expected[4:8]
    # the cursor names the last job shown
    assert first.next_before == search.cursor_of(first.jobs[-1])
    assert queue.find_jobs(tenant="acme", limit=100, before=first.next_before).next_before is None


def test_bad_filters_raise_one_line_invalid_input(queue: Queue) -> None:
    queue.enqueue("acme", "demo.noop", {})
    bad: list[dict[str, Any]] = [
        {"tenant": "no/such"}, {"tenant": "x" * 200}, {"kind": "9kind"}, {"status": "zombie"},
        {"status": "PENDING"}, {"actor": "a\nb"}, {"actor": "x" * 201}, {"meta": ["novalue"]},
        {"meta": ["=v"]}, {"meta": "[1, 2]"}, {"meta": ["a=1", "a=2"]}, {"meta": {"k": "\x00"}},
        {"meta": {"deep": [[[[[[[[[[1]]]]]]]]]]}}, {"since": "1y"}, {"since": "0s"}, {"since": -5},
        {"since": "99999999d"}, {"since": float("nan")}, {"limit": 0}, {"limit": 1001}, {"limit": True},
        {"limit": "ten"}, {"before": "junk"}, {"before": "1.0"}, {"before": "999999999999999999.5"},
    ]
    for filters in bad:
        with pytest.raises(InvalidInput) as caught:
            queue.find_jobs(**filters)
        assert "\n" not in str(caught.value), filters


def test_async_queue_finds_and_acts_with_the_same_operations(db: Database) -> None:
    async def main() -> None:
        async with AsyncQueue(db.dsn, schema=db.schema) as aq:
            ids = await aq.enqueue_many([JobSpec("acme", "demo.noop", {}, actor="u") for _ in range(5)])
            page = await aq.find_jobs(tenant="acme", actor="u", limit=3)
            rest = await aq.find_jobs(tenant="acme", actor="u", limit=3, before=page.next_before)
            assert [j["id"] for j in page.jobs + rest.jobs] == sorted(ids, reverse=True)
            assert await aq.actionable_counts(tenant="acme") == {"pending": 5, "dead": 0}
            assert await aq.cancel_jobs(tenant="acme", actor="u") == 5
            assert await aq.retry_dead_jobs(tenant="acme") == 0

    asyncio.run(main())


# -- cancelling a filtered set -------------------------------------------------


def test_cancel_jobs_cancels_only_the_matching_pending_jobs_in_chunks(
    queue: Queue, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(search, "CHUNK", 4)  # 11 jobs: three statements
    target = queue.enqueue_many([JobSpec("acme", "reports.render", {"n": n}, actor="u1", delay=60)
                                 for n in range(11)])
    kept = [queue.enqueue("acme", "reports.render", {}, actor="u2"),  # another actor
            queue.enqueue("acme", "mail.send", {}, actor="u1"),  # another kind
            queue.enqueue("globex", "reports.render", {}, actor="u1")]  # another tenant
    done = queue.enqueue("acme", "reports.render", {"done": True}, actor="u1", delay=0)
    with db.connect() as conn:
        conn.execute("UPDATE jobs SET status = 'done', finished_at = now() WHERE id = %(id)s", {"id": done})
    assert queue.actionable_counts(tenant="acme", kind="reports.render", actor="u1") == {"pending": 11,
                                                                                         "dead": 0}
    chunks = _count_statements(monkeypatch, "cancel_chunk")
    count = queue.cancel_jobs(tenant="acme", kind="reports.render", actor="u1")
    assert count == 11
    assert chunks == [4, 4, 3]  # one UPDATE per chunk, until a chunk comes back short
    rows = fetch_all(db, "SELECT id, status, finished_at FROM jobs ORDER BY id")
    by_id = {int(r["id"]): r for r in rows}
    assert {by_id[i]["status"] for i in target} == {"cancelled"}
    assert all(by_id[i]["finished_at"] is not None for i in target)
    assert {by_id[i]["status"] for i in kept} == {"pending"}
    assert by_id[done]["status"] == "done"
    assert queue.cancel_jobs(tenant="acme", kind="reports.render", actor="u1") == 0


def test_cancel_jobs_wakes_waiters_with_ids_and_with_star_past_the_payload_limit(
    queue: Queue, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    few = queue.enqueue_many([JobSpec("acme", "demo.noop", {}, delay=60) for _ in range(3)])
    listen = _listen(db, db.done_channel)
    try:
        assert queue.cancel_jobs(tenant="acme") == 3
        [payload] = _notifications(listen)
        assert sorted(int(i) for i in payload.split(",")) == sorted(few)
        # 1,000 ids of 11 digits are past NOTIFY's 7,900 characters: '*'
        with db.connect() as conn:
            conn.execute("ALTER TABLE jobs ALTER COLUMN id RESTART WITH 10000000000")
        many = queue.enqueue_many([JobSpec("globex", "demo.noop", {}, delay=60) for _ in range(1000)])
        assert queue.cancel_jobs(tenant="globex") == len(many)
        assert _notifications(listen) == ["*"]
    finally:
        listen.close()


def test_a_waiter_returns_when_a_bulk_cancel_ends_its_job(queue: Queue, db: Database,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = queue.enqueue("acme", "reports.render", {}, delay=3600, actor="u9")
    listener = queue._listener()
    blocked, woken = threading.Event(), []
    real_wait = listener.wait

    def wait(waiter: Any, timeout: float | None) -> bool:
        blocked.set()
        woken.append(real_wait(waiter, timeout))
        return woken[-1]

    monkeypatch.setattr(listener, "wait", wait)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(queue.wait, job_id, timeout=30)
        assert blocked.wait(10), "the wait did not block"
        with Queue(db.dsn, schema=db.schema) as other:
            assert other.cancel_jobs(tenant="acme", actor="u9") == 1
        info = future.result(timeout=WAKE_SECONDS + 10)
    assert info.status == "cancelled"
    assert woken[-1] is True  # woken by the notification, not by its timeout


def test_a_bulk_action_without_a_filter_needs_everything(queue: Queue) -> None:
    ids = queue.enqueue_many([JobSpec(t, "demo.noop", {}, delay=60) for t in ("acme", "globex")])
    with pytest.raises(InvalidInput, match="no filter"):
        queue.cancel_jobs()
    with pytest.raises(InvalidInput, match="no filter"):
        queue.retry_dead_jobs()
    with pytest.raises(InvalidInput, match="since"):
        queue.cancel_jobs(tenant="acme", since="soon")
    assert {queue.job(i).status for i in ids} == {"pending"}
    assert queue.cancel_jobs(everything=True) == 2


def test_a_job_enqueued_after_the_action_started_is_not_chased(queue: Queue, db: Database) -> None:
    """The action acts on the jobs that existed when it began (id <= max id then)."""
    first = queue.enqueue("acme", "demo.noop", {}, delay=60)
    steps = queue.__class__.cancel_jobs.steps(queue, tenant="acme")
    with db.connect() as conn:
        bounds = execute(conn, next(steps))
        late = queue.enqueue("acme", "demo.noop", {}, delay=60)  # after the action's bounds
        chunk = execute(conn, steps.send(bounds))
        with pytest.raises(StopIteration) as done:
            steps.send(chunk)
    assert done.value.value == 1
    assert queue.job(first).status == "cancelled" and queue.job(late).status == "pending"


# -- replaying a filtered set ----------------------------------------------------


def test_retry_dead_jobs_replays_like_retry_dead_and_wakes_queue_and_workers(
    queue: Queue, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(search, "CHUNK", 2)
    dead = queue.enqueue_many([JobSpec("acme", "demo.fail", {"n": n}, max_attempts=1, priority="interactive",
                                       actor="u1") for n in range(5)])
    other = queue.enqueue("globex", "demo.fail", {}, max_attempts=1, actor="u1")
    drain(db, tenantq.REGISTRY)
    assert status_counts(db) == {"dead": 6}
    queue_row = fetch_one(db, "SELECT has_work FROM queues WHERE tenant_id = 'acme' "
                              "AND priority = 'interactive'")
    assert queue_row["has_work"] is False  # the scheduler found it empty
    assert queue.actionable_counts(tenant="acme", actor="u1") == {"pending": 0, "dead": 5}

    workers = _listen(db, db.notify_channel)
    try:
        assert queue.retry_dead_jobs(tenant="acme", actor="u1", kind="demo.fail") == 5
        assert "interactive" in _notifications(workers)  # interactive work came back
    finally:
        workers.close()
    for job_id in dead:
        info = queue.job(job_id)
        assert (info.status, info.attempts, info.replays, info.finished_at) == ("pending", 0, 1, None)
        # the last error is kept until it runs again
        assert (info.last_error or "").startswith("RuntimeError: boom on attempt 1")
    assert queue.job(other).status == "dead"
    woken = fetch_one(db, "SELECT has_work, kinds FROM queues WHERE tenant_id = 'acme' AND priority = "
                          "'interactive'")
    assert woken["has_work"] is True and woken["kinds"] == ["demo.fail"]
    # and a worker runs them again: the history says which replay each attempt was
    drain(db, tenantq.REGISTRY)
    replays = fetch_all(db, "SELECT replay FROM attempts WHERE tenant_id = 'acme' ORDER BY id")
    assert [r["replay"] for r in replays] == [0] * 5 + [1] * 5
    assert queue.retry_dead_jobs(tenant="acme", since="1h") == 5


def test_retry_dead_jobs_leaves_jobs_that_are_not_dead(queue: Queue, db: Database) -> None:
    pending = queue.enqueue("acme", "demo.noop", {}, delay=60)
    done = queue.enqueue("acme", "demo.hello", {})
    drain(db, tenantq.REGISTRY)
    assert queue.retry_dead_jobs(tenant="acme") == 0
    assert queue.job(pending).status == "pending" and queue.job(done).status == "done"
    assert queue.job(done).replays == 0


def test_concurrent_bulk_cancels_cancel_each_job_once(queue: Queue, db: Database,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """SKIP LOCKED: two bulk cancels of the same set never wait on each
    other's chunk, and between them every job is cancelled exactly once."""
    monkeypatch.setattr(search, "CHUNK", 50)
    ids = queue.enqueue_many([JobSpec("acme", "demo.noop", {}, delay=60) for _ in range(600)])
    counts: list[int] = []
    lock = threading.Lock()

    def cancel() -> None:
        with Queue(db.dsn, schema=db.schema) as q:
            n = q.cancel_jobs(tenant="acme")
        with lock:
            counts.append(n)

    threads = [threading.Thread(target=cancel) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    # a chunk that skipped the other's locked rows may end an action early;
    # a last pass picks up whatever both left
    counts.append(queue.cancel_jobs(tenant="acme"))
    assert sum(counts) == len(ids)
    assert status_counts(db) == {"cancelled": 600}
