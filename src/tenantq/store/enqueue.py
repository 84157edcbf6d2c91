"""Writing validated jobs: one statement for a few, COPY for many.

`insert_steps` is one statement (unnest of arrays, one round trip with
autocommit): `enqueue`, small `enqueue_many` calls, schedules, and any
call with idempotency keys (their conflicts need `ON CONFLICT`).

`copy_steps` is the bulk path of `enqueue_many` (`COPY_AT` jobs or more,
none with a key). Where the time of a 20,000-job `insert` went: about a
third in psycopg turning nine Python lists into arrays, a row at a time in
Python; COPY's binary rows are formatted in C. Three statements, which must
run in one transaction (`Queue.enqueue_many` is an atomic operation: its
own transaction, or a savepoint in the caller's):

1. `insert` with a digest of the jobs (one row per tenant, class and kind):
   their wakes are written and the workers notified exactly as for the
   jobs themselves;
2. `reserve_ids`: ids for the jobs from the table's identity sequence, and
   the transaction's clock;
3. `copy_in`: the jobs, with those ids, so the ids come back in input order
   without reading the rows back.

The jobs' fields are checked before the first statement (the digest needs
them); their payloads, the costly part (serialising, sizing), are checked
as COPY writes the rows, so the client's checking overlaps the server's
inserting instead of preceding it (20,000 jobs: 314 -> 228 ms here). A bad
payload then aborts the COPY, and the transaction's rollback leaves nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql as pgsql

from tenantq.domain import validation
from tenantq.domain.records import NewJob
from tenantq.errors import InvalidInput
from tenantq.store.jobs import jsonb_text
from tenantq.store.queries import qualified
from tenantq.store.steps import Copy, Query, Steps

# From this many jobs (without idempotency keys) enqueue_many uses COPY.
# Below some size the two extra round trips cost more than the arrays'
# dumping saves; 1,000 is a round number well above that, not a measured
# crossover (./run bench throughput measures 20,000 and 200,000).
COPY_AT = 1_000

_COPY_TYPES = ("int8", "text", "text", "jsonb", "text", "int4", "timestamptz", "timestamptz", "text", "jsonb")


# a job's payload and meta as the JSON text to store (validation.job_body)
Body = tuple[str, str | None]


def enqueue_steps(
    jobs: Sequence[NewJob], bodies: Iterable[Body], *, schema: str, channel: str, now: datetime | None = None
) -> Steps[list[int]]:
    """Write validated jobs, the fastest way for their number; ids in input
    order. `bodies` are the jobs' payloads and metas, one per job, checked
    as they are read: on the COPY path that is as the rows are written, so
    checking them overlaps the server's work, and a bad one (InvalidInput)
    aborts the COPY. Must run in one transaction (see the module docstring),
    whose rollback then leaves nothing written."""
    if len(jobs) >= COPY_AT and all(job.key is None for job in jobs):
        return (yield from copy_steps(jobs, bodies, schema=schema, channel=channel, now=now))
    whole = [(job if meta is None else job._replace(meta_json=meta), text)
             for job, (text, meta) in zip(jobs, bodies, strict=True)]
    return (yield from insert_steps(whole, schema=schema, channel=channel, now=now))


def _insert_params(jobs: Sequence[tuple[NewJob, str]], *, channel: str,
                   now: datetime | None) -> dict[str, Any]:
    return {
        "tenant_ids": [j.tenant_id for j, _ in jobs],
        "kinds": [j.kind for j, _ in jobs],
        "payloads": [jsonb_text(text) for _, text in jobs],
        "priorities": [j.priority for j, _ in jobs],
        "max_attempts": [j.max_attempts for j, _ in jobs],
        "delays": [j.delay for j, _ in jobs],
        "keys": [j.key for j, _ in jobs],
        "actors": [j.actor for j, _ in jobs],
        "metas": [None if j.meta_json is None else jsonb_text(j.meta_json) for j, _ in jobs],
        "now": now,
        "channel": channel,
        "digest": False,
    }


@contextmanager
def _size_backstop() -> Iterator[None]:
    """Validation mirrors every CHECK; this is the backstop, on both paths,
    for a payload whose jsonb rendering outgrows its JSON text (e.g. 1e300
    spelled out): InvalidInput in one line instead of the database's error."""
    try:
        yield
    except psycopg.errors.CheckViolation as exc:
        if exc.diag.constraint_name not in ("payload_size", "meta_size"):
            raise
        limit = validation.MAX_PAYLOAD_BYTES if exc.diag.constraint_name == "payload_size" \
            else validation.MAX_META_BYTES
        what = exc.diag.constraint_name.split("_")[0]
        raise InvalidInput(f"{what} is over {limit} bytes as stored by Postgres") from None


def insert_one_steps(
    job: NewJob, text: str, *, schema: str, channel: str, now: datetime | None = None
) -> Steps[int]:
    """Insert one validated job (jobs.sql `insert_one`, scalar parameters:
    the cheapest statement); its id, or the existing job's for a key used
    before."""
    with _size_backstop():
        rows = yield Query(qualified("jobs", "insert_one", schema), {
            "tenant_id": job.tenant_id, "kind": job.kind, "payload": jsonb_text(text),
            "priority": job.priority, "max_attempts": job.max_attempts, "delay": float(job.delay),
            "key": job.key, "actor": job.actor,
            "meta": None if job.meta_json is None else jsonb_text(job.meta_json),
            "now": now, "channel": channel, "note": "interactive" if job.priority == "interactive" else "",
        }, plain=True, direct=job.key is None)  # with a key it may wait: a cursor (store/prepared.py)
    if rows:
        return int(str(rows[0]["id"]))
    existing = yield Query(qualified("jobs", "ids_by_key", schema),
                           {"tenant_ids": [job.tenant_id], "keys": [job.key]})
    return int(str(existing[0]["id"]))


def insert_steps(
    jobs: Sequence[tuple[NewJob, str]], *, schema: str, channel: str, now: datetime | None = None
) -> Steps[list[int]]:
    """Insert validated jobs in one statement; returns ids in input order.

    A job whose idempotency key already exists for its tenant is not
    inserted; its existing id is returned in its place. The statements are
    schema-qualified: they also run on a caller's connection, in the
    caller's transaction (whose search_path is the caller's).
    """
    if not jobs:
        return []
    # one statement, so autocommit makes it one round trip and one commit
    params = _insert_params(jobs, channel=channel, now=now)
    with _size_backstop():
        rows = yield Query(qualified("jobs", "insert", schema), params)
    if len(rows) == len(jobs):
        return [int(str(r["id"])) for r in rows]
    by_key: dict[tuple[str, str], int] = {}
    keyed = [(j.tenant_id, j.key) for j, _ in jobs if j.key is not None]
    if keyed:
        existing = yield Query(qualified("jobs", "ids_by_key", schema),
                               {"tenant_ids": [t for t, _ in keyed], "keys": [k for _, k in keyed]})
        by_key = {(str(r["tenant_id"]), str(r["idempotency_key"])): int(str(r["id"])) for r in existing}
    fresh = iter(int(str(r["id"])) for r in rows if r["idempotency_key"] is None)
    ids: list[int] = []
    for job, _ in jobs:
        ids.append(by_key[(job.tenant_id, job.key)] if job.key is not None else next(fresh))
    return ids


def _digest(jobs: Sequence[NewJob]) -> list[tuple[str, str, str, float]]:
    """(tenant, class, kind, delay): a row for the kind's jobs due now (delay
    0) and one with the least delay of its delayed jobs, if it has each;
    `insert` writes one wake per tenant, class and kind from them."""
    due: set[tuple[str, str, str]] = set()
    delayed: dict[tuple[str, str, str], float] = {}
    for job in jobs:
        key = (job.tenant_id, job.priority, job.kind)
        if job.delay <= 0:
            due.add(key)
        elif job.delay < delayed.get(key, float("inf")):
            delayed[key] = job.delay
    return sorted([(*key, 0.0) for key in due] + [(*key, delay) for key, delay in delayed.items()])


def copy_steps(
    jobs: Sequence[NewJob], bodies: Iterable[Body], *, schema: str, channel: str, now: datetime | None = None
) -> Steps[list[int]]:
    """The bulk path (module docstring): jobs without idempotency keys, and
    their bodies (`enqueue_steps`), read as the rows are written."""
    assert all(job.key is None for job in jobs), "copy_steps writes jobs without idempotency keys"
    digest = _digest(jobs)
    # the digest's columns; unnest pads the ones it lacks with NULLs
    params: dict[str, Any] = {key: [] for key in ("payloads", "max_attempts", "keys", "actors", "metas")}
    params.update(tenant_ids=[d[0] for d in digest], priorities=[d[1] for d in digest],
                  kinds=[d[2] for d in digest], delays=[d[3] for d in digest],
                  now=now, channel=channel, digest=True)
    yield Query(qualified("jobs", "insert", schema), params)
    table = pgsql.Identifier(schema, "jobs").as_string()
    reserved = yield Query(qualified("jobs", "reserve_ids", schema), {"n": len(jobs), "now": now,
                                                                      "jobs_table": table})
    clock: datetime = reserved[0]["now"]
    ids: list[int] = reserved[0]["ids"]
    with _size_backstop():
        yield Copy(qualified("jobs", "copy_in", schema), _COPY_TYPES, _rows(jobs, bodies, ids, clock))
    return ids


def _rows(jobs: Sequence[NewJob], bodies: Iterable[Body], ids: list[int],
          clock: datetime) -> Iterator[tuple[Any, ...]]:
    for job_id, job, (text, meta) in zip(ids, jobs, bodies, strict=True):
        run_after = clock if job.delay <= 0 else clock + timedelta(seconds=job.delay)
        yield (job_id, job.tenant_id, job.kind, jsonb_text(text), job.priority, job.max_attempts, run_after,
               clock, job.actor, None if meta is None else jsonb_text(meta))
