"""Enqueue: ids, bulk insert in one statement, idempotency keys, input
validation that writes nothing, and delays."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import tenantq
from tenantq import JobSpec, Queue
from tenantq.domain.records import NewJob
from tenantq.domain.validation import MAX_PAYLOAD_BYTES
from tenantq.fairness import ClaimRequest, claim_next
from tenantq.store import enqueue
from tenantq.store.db import Database
from tenantq.store.steps import run
from tests.integration.helpers import db_now, fetch_all, fetch_one, scalar, table_counts

REQUEST = ClaimRequest(worker_id="test-claimer", driver="test", batch_size=10, lease_seconds=30)


def test_enqueue_returns_new_ids(queue: Queue, db: Database) -> None:
    first = queue.enqueue("acme", "demo.hello", {"n": 1})
    second = queue.enqueue("acme", "demo.hello", {"n": 2}, priority="interactive", max_attempts=2)
    assert isinstance(first, int) and isinstance(second, int)
    assert second > first
    info = queue.job(second)
    assert (info.tenant_id, info.kind, info.payload, info.priority, info.status) == (
        "acme", "demo.hello", {"n": 2}, "interactive", "pending")
    assert (info.attempts, info.max_attempts, info.result, info.last_error) == (0, 2, None, None)
    queues = fetch_all(db, "SELECT tenant_id, priority, has_work FROM queues ORDER BY priority")
    assert queues == [
        {"tenant_id": "acme", "priority": "default", "has_work": True},
        {"tenant_id": "acme", "priority": "interactive", "has_work": True},
    ]


@pytest.mark.parametrize("copy_at", [10_000, 1_000], ids=["one-statement", "copy"])
def test_enqueue_many_commits_as_one_in_input_order(queue: Queue, db: Database, copy_at: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(enqueue, "COPY_AT", copy_at)
    tenants = [f"tenant-{i}" for i in range(7)]
    specs: list[JobSpec | dict[str, Any]] = []
    for i in range(5000):
        tenant = tenants[(i * 3) % len(tenants)]  # tenants interleaved, not grouped
        if i % 2:
            specs.append(JobSpec(tenant=tenant, kind="demo.noop", payload={"i": i}))
        else:
            specs.append({"tenant": tenant, "kind": "demo.noop", "payload": {"i": i}, "priority": "bulk"})
    ids = queue.enqueue_many(specs)

    assert len(ids) == 5000
    assert len(set(ids)) == 5000
    assert ids == sorted(ids), "ids must come back in input order"
    assert scalar(db, "SELECT count(*) FROM jobs") == 5000
    rows = fetch_all(db, "SELECT id, tenant_id, (payload->>'i')::int AS i FROM jobs ORDER BY id")
    assert [r["id"] for r in rows] == ids
    assert [r["i"] for r in rows] == list(range(5000))
    assert [r["tenant_id"] for r in rows] == [tenants[(i * 3) % 7] for i in range(5000)]
    # one statement (an INSERT, or the COPY): every job carries the same
    # inserting transaction and command id
    same = fetch_one(
        db,
        "SELECT (SELECT count(DISTINCT (xmin::text, cmin::text)) FROM jobs) AS jobs, "
        "(SELECT count(DISTINCT (xmin::text, cmin::text)) FROM jobs j) AS again, "
        "(SELECT count(DISTINCT created_at) FROM jobs) AS clocks",
    )
    assert same == {"jobs": 1, "again": 1, "clocks": 1}
    txids = fetch_all(
        db,
        "SELECT DISTINCT xmin::text AS x FROM jobs UNION SELECT DISTINCT xmin::text FROM wakes",
    )
    assert len(txids) == 1, "the jobs and their wakes must commit together"
    assert scalar(db, "SELECT count(*) FROM tenants") == 7
    assert scalar(db, "SELECT count(*) FROM queues") == 14


def test_enqueue_many_of_nothing(queue: Queue, db: Database) -> None:
    assert queue.enqueue_many([]) == []
    assert table_counts(db)["jobs"] == 0


def test_idempotency_key_returns_the_existing_id_per_tenant(queue: Queue, db: Database) -> None:
    first = queue.enqueue("acme", "demo.hello", {"v": 1}, key="order-42")
    again = queue.enqueue("acme", "demo.hello", {"v": 2}, key="order-42")
    assert again == first
    assert queue.job(first).payload == {"v": 1}, "a repeated key must not overwrite the job"

    other_tenant = queue.enqueue("globex", "demo.hello", {"v": 3}, key="order-42")
    assert other_tenant != first
    assert scalar(db, "SELECT count(*) FROM jobs") == 2

    # mixed call: a known key, a key repeated inside the call, keyless jobs
    ids = queue.enqueue_many([
        {"tenant": "acme", "kind": "demo.hello", "payload": {"n": 1}},
        {"tenant": "acme", "kind": "demo.hello", "payload": {"n": 2}, "key": "order-42"},
        {"tenant": "acme", "kind": "demo.hello", "payload": {"n": 3}, "key": "fresh"},
        {"tenant": "globex", "kind": "demo.hello", "payload": {"n": 4}},
        {"tenant": "acme", "kind": "demo.hello", "payload": {"n": 5}, "key": "fresh"},
        {"tenant": "globex", "kind": "demo.hello", "payload": {"n": 6}, "key": "order-42"},
        {"tenant": "initech", "kind": "demo.hello", "payload": {"n": 7}, "key": "order-42"},
    ])
    assert ids[1] == first
    assert ids[5] == other_tenant
    assert ids[4] == ids[2], "a key repeated inside one call maps to one job"
    new_ids = [ids[0], ids[2], ids[3], ids[6]]
    assert len(set(new_ids)) == 4 and not set(new_ids) & {first, other_tenant}
    assert new_ids == sorted(new_ids)
    assert scalar(db, "SELECT count(*) FROM jobs") == 6
    payloads = {r["id"]: r["payload"] for r in fetch_all(db, "SELECT id, payload FROM jobs")}
    assert [payloads[i] for i in ids] == [{"n": 1}, {"v": 1}, {"n": 3}, {"n": 4}, {"n": 3}, {"v": 3},
                                          {"n": 7}]


def test_repeating_a_whole_keyed_batch_inserts_nothing(queue: Queue, db: Database) -> None:
    specs = [{"tenant": "acme", "kind": "demo.noop", "key": f"k{i}"} for i in range(20)]
    first = queue.enqueue_many(specs)
    before = table_counts(db)
    assert queue.enqueue_many(list(reversed(specs))) == list(reversed(first))
    assert table_counts(db) == before


BAD_INPUTS: list[tuple[dict[str, Any], str]] = [
    ({"tenant": ""}, "tenant id must be a non-empty string"),
    ({"tenant": "t" * 129}, "129 characters; the limit is 128"),
    ({"tenant": "has space"}, "tenant id 'has space' is invalid"),
    ({"tenant": None}, "tenant id must be a non-empty string"),
    ({"payload": {1, 2}}, "payload is not JSON-serialisable"),
    ({"payload": {"x": math.nan}}, "payload is not JSON-serialisable"),
    ({"payload": {"x": math.inf}}, "payload is not JSON-serialisable"),
    ({"payload": {"x": "x" * MAX_PAYLOAD_BYTES}}, f"the limit is {MAX_PAYLOAD_BYTES}"),
    ({"priority": "urgent"}, "unknown priority 'urgent'"),
    ({"max_attempts": 0}, "max_attempts must be between 1 and"),
    ({"max_attempts": True}, "max_attempts must be an integer"),
    ({"delay": -1}, "delay must be between 0 and"),
    ({"delay": math.nan}, "delay must be between 0 and"),
    ({"kind": "bad kind"}, "kind 'bad kind' is invalid"),
    ({"kind": ""}, "kind '' is invalid"),
    ({"kind": "9starts.with.digit"}, "is invalid"),
    ({"key": ""}, "idempotency key must be"),
    ({"key": "k" * 256}, "idempotency key must be"),
]


def _job(**overrides: Any) -> dict[str, Any]:
    job: dict[str, Any] = {"tenant": "acme", "kind": "demo.hello", "payload": {"ok": True}}
    job.update(overrides)
    return job


@pytest.mark.parametrize(("overrides", "message"), BAD_INPUTS)
def test_bad_input_is_rejected_and_writes_nothing(
    queue: Queue, db: Database, overrides: dict[str, Any], message: str
) -> None:
    queue.enqueue("existing", "demo.noop")
    before = table_counts(db)
    job = _job(**overrides)
    with pytest.raises(tenantq.InvalidInput, match=r"^[^\n]+$") as info:
        queue.enqueue(job.pop("tenant"), job.pop("kind"), job.pop("payload"), **job)
    assert message in str(info.value)
    assert table_counts(db) == before


@pytest.mark.parametrize("size", [5, enqueue.COPY_AT + 500], ids=["one-statement", "copy"])
@pytest.mark.parametrize(("overrides", "message"), BAD_INPUTS)
def test_one_bad_job_rejects_the_whole_enqueue_many(
    queue: Queue, db: Database, overrides: dict[str, Any], message: str, size: int
) -> None:
    """On the COPY path a bad payload is found while the rows are being
    written: the COPY is aborted and nothing stays, tenants and queues
    included, as when it is found before the first statement."""
    before = table_counts(db)
    bad = size - 2
    jobs = [_job(payload={"i": i}) for i in range(bad)] + [_job(**overrides)] + [_job(payload={"i": 9})]
    with pytest.raises(tenantq.InvalidInput, match=r"^[^\n]+$") as info:
        queue.enqueue_many(jobs)
    assert str(info.value).startswith(f"job {bad}: ")
    assert message in str(info.value)
    assert table_counts(db) == before


def test_a_bad_bulk_job_on_the_callers_connection_begins_nothing(queue: Queue, db: Database) -> None:
    """With conn=, every payload is checked before the first statement: a
    bad one in a COPY-sized call leaves the caller's connection as it was
    (no transaction begun and aborted under the caller)."""
    jobs = [_job(payload={"i": i}) for i in range(enqueue.COPY_AT + 500)]
    jobs[-1] = _job(payload=[1, 2])
    with psycopg.connect(db.dsn) as conn:  # not autocommit, no transaction open
        last = len(jobs) - 1
        with pytest.raises(tenantq.InvalidInput, match=f"^job {last}: payload must be a JSON object"):
            queue.enqueue_many(jobs, conn=conn)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert table_counts(db)["jobs"] == 0


def test_unknown_field_in_enqueue_many(queue: Queue, db: Database) -> None:
    with pytest.raises(tenantq.InvalidInput, match="job 0: unknown field"):
        queue.enqueue_many([{"tenant": "acme", "kind": "demo.noop", "tenantt": "x"}])
    assert table_counts(db)["jobs"] == 0


def test_payload_size_limit_is_one_consistent_rule(queue: Queue, db: Database) -> None:
    """Near the 256 KiB limit every payload is either stored intact or
    rejected with InvalidInput (nothing written): the validator and the
    database's own CHECK must agree, never surfacing a raw database error.
    Postgres renders jsonb text with ", " and ": ", so a payload of many
    small items is ~1.5x longer there than in compact JSON."""
    # the same size under any rendering: must be stored
    text = {"t": "x" * (MAX_PAYLOAD_BYTES - 9)}  # {"t": "..."} is 9 bytes around the string
    assert queue.job(queue.enqueue("acme", "demo.noop", text)).payload == text
    # comfortably under the limit however it is measured: must be stored
    keyed = {f"k{i:05d}": i for i in range(12_000)}
    assert queue.job(queue.enqueue("acme", "demo.noop", keyed)).payload == keyed
    # 200 KB compact, 300 KB as Postgres renders it: stored or InvalidInput
    many = {"n": [0] * 100_000}
    before = table_counts(db)
    outcome: int | str
    try:
        outcome = queue.enqueue("acme", "demo.noop", many)
    except tenantq.InvalidInput as exc:
        outcome = str(exc)
    if isinstance(outcome, str):
        assert "limit" in outcome
        assert table_counts(db) == before
    else:
        assert queue.job(outcome).payload == many
    # over the limit in any rendering: InvalidInput
    with pytest.raises(tenantq.InvalidInput, match="limit"):
        queue.enqueue("acme", "demo.noop", {"n": [0] * 140_000})


def test_delayed_job_is_not_claimable_until_due(queue: Queue, db: Database) -> None:
    now = db_now(db)
    job_id = queue.enqueue("acme", "demo.noop", delay=60, now=now)
    info = queue.job(job_id)
    assert info.run_after == now + timedelta(seconds=60)
    with db.connect() as conn:
        assert claim_next(conn, REQUEST, "default") is None
        assert claim_next(conn, REQUEST, "default", now=now + timedelta(seconds=59)) is None
        batch = claim_next(conn, REQUEST, "default", now=now + timedelta(seconds=61))
    assert batch is not None
    assert [j.id for j in batch.jobs] == [job_id]


def test_delayed_and_immediate_jobs_of_one_tenant(queue: Queue, db: Database) -> None:
    """A later, immediate enqueue makes the tenant runnable again without
    waiting for the earlier delayed job."""
    now = db_now(db)
    later = queue.enqueue("acme", "demo.noop", delay=3600, now=now)
    with db.connect() as conn:
        assert claim_next(conn, REQUEST, "default", now=now + timedelta(seconds=1)) is None
        soon = queue.enqueue("acme", "demo.noop", now=now + timedelta(seconds=2))
        batch = claim_next(conn, REQUEST, "default", now=now + timedelta(seconds=3))
        assert batch is not None and [j.id for j in batch.jobs] == [soon]
        assert claim_next(conn, REQUEST, "default", now=now + timedelta(seconds=4)) is None
        batch = claim_next(conn, REQUEST, "default", now=now + timedelta(seconds=3601))
        assert batch is not None and [j.id for j in batch.jobs] == [later]


@pytest.mark.parametrize(("payload", "shown"), [([1, 2], "an array"), ("text", "a string"), (3, "a number"),
                                                 (True, "a boolean")])
def test_a_payload_must_be_a_json_object(queue: Queue, db: Database, payload: object, shown: str) -> None:
    before = table_counts(db)
    with pytest.raises(tenantq.InvalidInput, match=f"payload must be a JSON object .*got {shown}$"):
        queue.enqueue("acme", "demo.noop", payload)
    assert table_counts(db) == before
    # a missing payload is the empty object
    assert queue.job(queue.enqueue("acme", "demo.noop")).payload == {}


def _bulk_specs(n: int) -> list[JobSpec]:
    """Jobs that exercise every column and every branch of the queue upsert:
    tenants and classes interleaved, due and delayed jobs (a queue with only
    delayed ones), envelopes, and one queue with more than 64 kinds."""
    specs: list[JobSpec] = []
    for i in range(n):
        tenant = f"t{i % 5}"
        priority = ("default", "bulk", "interactive")[i % 3]
        delay = 30.0 + (i % 7) * 1.5 if tenant == "t4" or (tenant != "t1" and i % 4 == 0) else 0.0
        kind = f"many.k{(i // 15) % 70}" if tenant == "t1" else f"demo.k{i % 3}"
        specs.append(JobSpec(tenant, kind, {"i": i, "s": "tab\there"}, priority=priority, delay=delay,
                             max_attempts=1 + i % 9, actor=f"usr_{i % 3}" if i % 2 else None,
                             meta={"request_id": f"r-{i}"} if i % 5 == 0 else None))
    return specs


_JOB_COLUMNS = ("tenant_id, kind, payload, priority, status, attempts, max_attempts, run_after, batch_id, "
                "last_error, result, idempotency_key, created_at, started_at, finished_at, replays, actor, "
                "meta, cancelled_by, cancel_requested_at")


def _written(db: Database) -> dict[str, list[dict[str, Any]]]:
    return {
        "jobs": fetch_all(db, f"SELECT {_JOB_COLUMNS} FROM jobs ORDER BY id"),
        # all but created_at: the tenant row's default is the server's clock, not `now=`
        "tenants": fetch_all(db, "SELECT to_jsonb(t) - 'created_at' AS row FROM tenants t "
                                 "ORDER BY tenant_id"),
        "queues": fetch_all(db, "SELECT tenant_id, priority, has_work, next_run_at, kinds_due::text,"
                                "       (SELECT array_agg(k ORDER BY k) FROM unnest(kinds) k) AS kinds"
                                " FROM queues ORDER BY tenant_id, priority"),
    }


def test_copy_and_one_statement_write_the_same_rows(queue: Queue, db: Database,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The bulk path (COPY after a digest's upsert) and the one statement
    leave the same jobs, tenants and queues behind, to the microsecond."""
    specs, now = _bulk_specs(1_500), db_now(db)
    written = {}
    for path, copy_at in (("copy", 1_000), ("one statement", 10_000)):
        monkeypatch.setattr(enqueue, "COPY_AT", copy_at)
        ids = queue.enqueue_many(specs, now=now)
        assert ids == sorted(ids) and len(set(ids)) == len(specs)
        assert [queue.job(i).payload["i"] for i in (ids[0], ids[777], ids[-1])] == [0, 777, 1_499]
        written[path] = _written(db)
        with db.connect() as conn:
            conn.execute("TRUNCATE jobs, tenants, queues, wakes CASCADE")
    assert written["copy"] == written["one statement"]
    queues = {(q["tenant_id"], q["priority"]): q for q in written["copy"]["queues"]}
    assert queues[("t1", "default")]["kinds"] is None, "over 64 kinds: the hint says any kind"
    assert queues[("t4", "default")]["next_run_at"] > now, "only delayed jobs: not due yet"
    # due and delayed jobs of one kind: the kind is listed, so its delayed
    # jobs need no later due time (queues.sql, "The kinds hint")
    t0 = queues[("t0", "default")]
    assert (t0["kinds"], t0["kinds_due"]) == (["demo.k0"], "infinity")


def test_a_bulk_enqueue_wakes_workers_once_it_commits(queue: Queue, db: Database) -> None:
    with db.connect() as listen:
        listen.execute(f'LISTEN "{db.notify_channel}"')
        ids = queue.enqueue_many([JobSpec("acme", "demo.noop", {"i": i}) for i in range(2_000)])
        notes = list(listen.notifies(timeout=10, stop_after=1))
    assert notes and notes[0].channel == db.notify_channel
    with db.connect() as conn:
        batch = claim_next(conn, REQUEST, "default")
    assert batch is not None and [j.id for j in batch.jobs] == ids[:10]


def _copy_steps(jobs: list[tuple[NewJob, str]], **kwargs: Any) -> Any:
    bodies = [(text, job.meta_json) for job, text in jobs]
    return enqueue.copy_steps([job for job, _ in jobs], bodies, **kwargs)


@pytest.mark.parametrize("write", [enqueue.insert_steps, _copy_steps], ids=["one-statement", "copy"])
def test_the_size_check_backstop_is_one_line_on_both_paths(db: Database, write: Any) -> None:
    """Validation measures sizes as Postgres renders them, so the jobs'
    CHECKs are a backstop no valid call reaches; fed a job past it
    directly, both paths answer InvalidInput in one line and write nothing."""
    good = [(NewJob("acme", "demo.noop"), "{}") for _ in range(5)]
    huge = (NewJob("acme", "demo.noop"), '{"k": "' + "x" * MAX_PAYLOAD_BYTES + '"}')
    with db.connect() as conn, pytest.raises(tenantq.InvalidInput, match=r"^payload is over 262144 bytes"):
        run(conn, write([*good, huge], schema=db.schema, channel=db.notify_channel), atomic=True)
    assert table_counts(db)["jobs"] == 0
    assert scalar(db, "SELECT count(*) FROM queues") == 0
