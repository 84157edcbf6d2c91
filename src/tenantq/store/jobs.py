"""Job and lease operations on one connection. Callers own transactions
where several statements must commit together (see the docstrings)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from operator import itemgetter
from typing import Any

from psycopg.rows import tuple_row
from psycopg.types.json import Jsonb

from tenantq.domain.records import Batch, ClaimedJob, JobInfo, Priority, Settlement
from tenantq.errors import JobNotFound, LeaseLost
from tenantq.store.db import Conn
from tenantq.store.history import history_steps, outcome_note
from tenantq.store.queries import composed, sql
from tenantq.store.steps import Query, Steps, run

# a row as the store's connections return it (db.Conn's dict_row)
Row = dict[str, object]


class _RawJson:
    """Already-serialised JSON (validation produced the text once)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def jsonb_text(text: str) -> Jsonb:
    # Jsonb with an identity dumps: the payload was serialised during
    # validation and is not serialised a second time.
    return Jsonb(_RawJson(text), dumps=lambda obj: obj.text)


@dataclass(frozen=True)
class UndecodablePayload:
    """Stands in for the payload of a claimed job whose stored JSON cannot be
    decoded here (nested deeper than Python's recursion limit allows, say).
    The worker fails such a job at once, as dead, without running it."""

    reason: str


def decode_payload(text: str | None) -> Any:
    """A claimed job's payload from its jsonb text; never raises."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except RecursionError:
        return UndecodablePayload("payload cannot be decoded: nested too deeply")
    except (ValueError, MemoryError) as exc:
        return UndecodablePayload(f"payload cannot be decoded: {str(exc)[:200]}")


def _decoded_meta(text: object) -> dict[str, Any] | None:
    """A claimed job's meta (a small object, CHECKed at insert) or None."""
    meta = decode_payload(None if text is None else str(text))
    return meta if isinstance(meta, dict) else None


def claim(
    conn: Conn,
    *,
    tenant_id: str,
    priority: Priority,
    limit: int,
    worker_id: str,
    driver: str,
    lease_seconds: float,
    kinds: Sequence[str] | None = None,
    quotas: Mapping[str, int] | None = None,
    now: datetime | None = None,
) -> Batch | None:
    """Lease up to `limit` runnable jobs of one tenant and class, of the
    given kinds only (None: any kind).

    A job whose payload cannot be decoded is leased like the others, with an
    `UndecodablePayload` as its payload: the claim must not fail on one
    stored row (it would fail again on every claim of that tenant)."""
    rows = claim_rows(conn, tenant_id=tenant_id, priority=priority, limit=limit, worker_id=worker_id,
                      driver=driver, lease_seconds=lease_seconds, kinds=kinds, quotas=quotas, now=now)
    return batch_of(tenant_id, priority, rows) if rows else None


def claim_rows(
    conn: Conn,
    *,
    tenant_id: str,
    priority: Priority,
    limit: int,
    worker_id: str,
    driver: str,
    lease_seconds: float,
    kinds: Sequence[str] | None = None,
    quotas: Mapping[str, int] | None = None,
    now: datetime | None = None,
) -> ClaimedRows:
    """`claim`'s rows as the statement returns them (empty: nothing
    leased). The picker builds the batch (`batch_of`) after the claim's
    commit: the claim's row locks are held until then, and decoding 500
    payloads inside its transaction would hold them ~8 ms longer."""
    params: dict[str, Any] = {
        "tenant_id": tenant_id,
        "priority": priority,
        "limit": limit,
        "worker_id": worker_id,
        "driver": driver,
        "lease_seconds": lease_seconds,
        "kinds": None if kinds is None else list(kinds),
        "now": now,
    }
    if quotas:
        # some kinds are rate limited (rates.py): at most `quotas[kind]` of each
        exhausted = sorted(k for k, n in quotas.items() if n < 1)
        limited = sorted(k for k, n in quotas.items() if n >= 1)
        params.update(exhausted=exhausted, quota_kinds=limited, quotas=[quotas[k] for k in limited],
                      scan=limit * 4)
        statement = composed("jobs", "claim_within_quotas", lease="lease")
    else:
        statement = composed("jobs", "claim", lease="lease")
    cursor = conn.cursor(row_factory=tuple_row)
    return ClaimedRows(cursor.execute(statement, params).fetchall(), cursor.description or ())


class ClaimedRows(list[tuple[Any, ...]]):
    """`claim`'s rows as tuples (a dict per row was 4% of a no-op drain's
    Python time), and where each column is."""

    def __init__(self, rows: Iterable[tuple[Any, ...]], description: Sequence[Any]) -> None:
        super().__init__(rows)
        self.at = {column.name: i for i, column in enumerate(description)}

    def column(self, name: str) -> list[Any]:
        i = self.at[name]
        return [row[i] for row in self]


def batch_of(tenant_id: str, priority: Priority, rows: ClaimedRows) -> Batch:
    """The batch leased by `claim_rows` (non-empty), its jobs in id order.
    The columns have the claim's SQL types (psycopg's ints, floats, str)."""
    at = rows.at
    id_, kind, payload, attempts, max_attempts, waited, actor, meta = (
        at["id"], at["kind"], at["payload_text"], at["attempts"], at["max_attempts"], at["waited"],
        at["actor"], at["meta_text"])
    ordered = sorted(rows, key=itemgetter(id_))
    first = ordered[0]
    return Batch(
        batch_id=first[at["batch_id"]],
        tenant_id=tenant_id,
        priority=priority,
        lease_expires_at=first[at["lease_expires_at"]],
        jobs=tuple(
            ClaimedJob(
                id=r[id_],
                tenant_id=tenant_id,
                kind=r[kind],
                payload=decode_payload(r[payload]),
                attempt=r[attempts],
                max_attempts=r[max_attempts],
                waited=r[waited],
                actor=r[actor],
                meta=None if r[meta] is None else _decoded_meta(r[meta]),
            )
            for r in ordered
        ),
    )


def settle(
    conn: Conn,
    batch_id: int,
    settlements: Sequence[Settlement],
    *,
    release: Iterable[int] = (),
    end_outcome: str | None = None,
    run_seconds: float | None = None,
    ran_jobs: int = 0,
    charge_runtime: bool = False,
    egress: tuple[dict[str, int], Sequence[dict[str, Any]]] | None = None,
    host_calls: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> list[int]:
    """Apply settlements under the batch's fencing token, in one transaction.

    `release` lists jobs that never started: they go back to pending with
    their attempt refunded. With `end_outcome`, the lease ends too. Raises
    LeaseLost (and changes nothing) when the lease is no longer live.
    `run_seconds` is the batch's measured cost; with `charge_runtime` it is
    charged to the queue's DRR deficit (fairness by run time). `egress`: the
    batch's network counts and refused requests, and `host_calls` its
    host-function counts, written with its end.
    """
    release_ids = list(release)
    if run_seconds is not None and not (math.isfinite(run_seconds) and run_seconds >= 0):
        run_seconds = 0.0  # the dispatcher clamps it; the store does not rely on that either
    # Pipelined: BEGIN and every statement go out in one round trip, COMMIT
    # in a second. The statements do not depend on each other's results; if
    # the lease turns out to be lost, raising rolls all of them back.
    with conn.pipeline() as pipeline, conn.transaction():
        live = conn.execute(sql("batches", "lock_live"), {"batch_id": batch_id, "now": now})
        settled = None
        if settlements:
            settled = conn.execute(
                sql("jobs", "settle"),
                {
                    "batch_id": batch_id,
                    "ids": [s.job_id for s in settlements],
                    "statuses": [s.status for s in settlements],
                    "results": [None if s.status != "done" else
                                s.result_json if s.result_json is not None else json.dumps(s.result)
                                for s in settlements],
                    "errors": _column([s.error for s in settlements]),
                    "delays": _column([s.delay if s.status == "pending" else None for s in settlements]),
                    "host_calls": _column([None if s.host_calls is None else Jsonb(s.host_calls)
                                           for s in settlements]),
                    "now": now,
                },
            )
        if release_ids:
            conn.execute(sql("jobs", "release_unstarted"),
                         {"batch_id": batch_id, "ids": release_ids, "now": now})
        if end_outcome is not None:
            conn.execute(sql("batches", "end"), {
                "batch_id": batch_id, "outcome": end_outcome, "run_seconds": run_seconds, "now": now,
                "egress": None if egress is None else Jsonb(egress[0]),
                "host_calls": None if host_calls is None else Jsonb(host_calls),
            })
            if egress is not None and egress[1]:
                blocks = egress[1]
                conn.execute(sql("egress", "record_blocks"), {
                    "batch_id": batch_id, "job_ids": [b.get("job_id") for b in blocks],
                    "hosts": [str(b["host"])[:300] for b in blocks],
                    "reasons": [str(b["reason"])[:1000] for b in blocks],
                    "ats": [_block_time(b.get("at")) for b in blocks],
                    "now": now,
                })
            if charge_runtime and run_seconds is not None:
                conn.execute(sql("queues", "charge"), {"batch_id": batch_id, "jobs": ran_jobs})
        pipeline.sync()
        if live.fetchone() is None:
            raise LeaseLost(f"lease {batch_id} is no longer live; its jobs were or will be re-leased")
        return [int(str(r["id"])) for r in settled.fetchall()] if settled is not None else []


def _column(values: list[Any]) -> list[Any] | None:
    """One of `settle`'s columns, or NULL when each of its values is: unnest
    pads a NULL array with NULLs to the length of the others, and psycopg
    dumps a list element by element in Python (a batch of successes has no
    errors, delays or host calls)."""
    return values if any(v is not None for v in values) else None


# to_timestamp() takes any finite float8, but psycopg reads timestamps only
# up to the year 9999
_LATEST_EPOCH = 253402300799.0


def _block_time(at: object) -> float | None:
    """When a refused request happened (epoch seconds), or None (the batch's
    clock stands in) when it is not a usable time."""
    try:
        seconds = float(at)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return seconds if math.isfinite(seconds) and 0 <= seconds <= _LATEST_EPOCH else None


def wake_queues(conn: Conn, rows: Sequence[dict[str, Any]], *, now: datetime | None = None) -> None:
    """Mark the queues of jobs that went back to pending as having work
    (and as having work of their kinds)."""
    run(conn, wake_steps(rows, now=now))


def wake_steps(rows: Sequence[dict[str, Any]], *, now: datetime | None = None) -> Steps[None]:
    if not rows:
        return
    yield Query(
        sql("jobs", "wake"),
        {
            "tenant_ids": [r["tenant_id"] for r in rows],
            "priorities": [r["priority"] for r in rows],
            "run_afters": [r["run_after"] for r in rows],
            "kinds": [r["kind"] for r in rows],
            "now": now,
        },
    )


def heartbeat(
    conn: Conn, batch_ids: Sequence[int], *, lease_seconds: float, now: datetime | None = None
) -> set[int]:
    """Extend live leases; returns the ids that are not lost (still live, or
    ended by their own slot meanwhile)."""
    if not batch_ids:
        return set()
    rows = conn.execute(
        sql("batches", "heartbeat"),
        {"batch_ids": list(batch_ids), "lease_seconds": lease_seconds, "now": now},
    ).fetchall()
    alive = {int(str(r["batch_id"])) for r in rows}
    missing = [b for b in batch_ids if b not in alive]
    if missing:
        ended = conn.execute(sql("batches", "ended_by_slot"), {"batch_ids": missing}).fetchall()
        alive |= {int(str(r["batch_id"])) for r in ended}
    return alive


def expire_leases(conn: Conn, *, now: datetime | None = None) -> list[dict[str, Any]]:
    """Reap expired leases; returns the jobs put back (or dead-lettered)."""
    return run(conn, expire_steps(now=now), atomic=True)


def expire_steps(*, now: datetime | None = None) -> Steps[list[dict[str, Any]]]:
    """`expire_leases` as steps; run them atomically."""
    rows: list[dict[str, Any]] = yield Query(sql("batches", "expire"), {"now": now})
    yield from wake_steps([r for r in rows if r["status"] == "pending"], now=now)
    return rows


def get_job(conn: Conn, job_id: int) -> JobInfo:
    return run(conn, job_steps(job_id))


def job_steps(job_id: int) -> Steps[JobInfo]:
    found = yield Query(sql("jobs", "get"), {"id": job_id})
    if not found:
        raise JobNotFound(f"no job with id {job_id}")
    row = found[0]
    fields = JobInfo.__dataclass_fields__
    blocked = [{"host": r["host"], "reason": r["reason"], "blocked_at": str(r["blocked_at"]),
                "batch_id": r["batch_id"]}
               for r in (yield Query(sql("egress", "for_job"), {"job_id": job_id}))]
    history = yield from history_steps(str(row["tenant_id"]), job_id)
    info = JobInfo(**{k: v for k, v in row.items() if k in fields},
                   egress_blocked=blocked, attempts_history=history)
    return replace(info, outcome_note=outcome_note(info))


def state_steps(job_id: int) -> Steps[str | None]:
    """A job's status alone (None: no such job), for waiting on it."""
    rows = yield Query(sql("jobs", "status_of"), {"id": job_id})
    return str(rows[0]["status"]) if rows else None


def cancel(conn: Conn, job_id: int, *, by: str | None = None, channel: str = "",
           now: datetime | None = None) -> bool:
    """Cancel a pending job, or ask a running one to stop; False if it has ended."""
    return run(conn, cancel_steps(job_id, by=by, channel=channel, now=now))


def cancel_steps(job_id: int, *, by: str | None = None, channel: str = "",
                 now: datetime | None = None) -> Steps[bool]:
    rows = yield Query(sql("jobs", "cancel"), {"id": job_id, "by": by, "channel": channel, "now": now})
    if not rows:
        raise JobNotFound(f"no job with id {job_id}")
    return rows[0]["was"] in ("pending", "running")


def cancel_requests_steps(batch_ids: Sequence[int]) -> Steps[list[tuple[int, int]]]:
    """(batch_id, job_id) of the cancel requests for jobs of these batches."""
    if not batch_ids:
        return []
    rows = yield Query(sql("jobs", "cancel_requests"), {"batch_ids": list(batch_ids)})
    return [(int(str(r["batch_id"])), int(str(r["id"]))) for r in rows]


def dead_steps(*, tenant_id: str | None = None, limit: int = 100) -> Steps[list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = yield Query(sql("jobs", "dead_list"),
                                             {"tenant_id": tenant_id, "limit": limit})
    return rows


def retry_dead_steps(
    *,
    ids: Sequence[int] | None = None,
    tenant_id: str | None = None,
    channel: str,
    now: datetime | None = None,
) -> Steps[list[int]]:
    """Replay dead jobs (some ids, a tenant's, or all); returns the replayed
    ids. Run atomically."""
    rows = yield Query(
        sql("jobs", "retry_dead"),
        {"ids": list(ids) if ids is not None else None, "tenant_id": tenant_id, "now": now},
    )
    yield from wake_steps(rows, now=now)
    if rows:
        yield Query(sql("jobs", "notify"), {"channel": channel})
    return sorted(int(str(r["id"])) for r in rows)


def prune_steps(*, retention: dict[str, float], older_than: float | None = None, limit: int = 1000,
                dry_run: bool = False, now: datetime | None = None) -> Steps[dict[str, int]]:
    """Delete finished jobs past their retention window (per tenant, else
    `retention`: seconds per final status; `older_than` overrides every
    window), with their attempt history and refused-egress rows; at most
    `limit` per call. Returns how many went (with dry_run: would go), by status."""
    counts, _ = yield from prune_chunk_steps(retention=retention, older_than=older_than, limit=limit,
                                             dry_run=dry_run, now=now)
    return counts


def prune_chunk_steps(*, retention: dict[str, float], older_than: float | None = None, limit: int = 1000,
                      dry_run: bool = False, now: datetime | None = None,
                      after: str = "") -> Steps[tuple[dict[str, int], str]]:
    """prune_steps over the tenants after `after` (in tenant order); also
    the last tenant it reached, where the next chunk starts (maintenance
    goes round the tenants so that no tenant's backlog starves the rest).
    The walk is over tenant rows: a tenant whose row no fold has made yet
    (store/wakes.py) waits for the next round."""
    rows = yield Query(sql("jobs", "prune"), {
        "done": retention["done"], "cancelled": retention["cancelled"], "dead": retention["dead"],
        "older_than": older_than, "limit": limit, "dry_run": dry_run, "now": now, "after": after})
    counts = {str(r["status"]): int(str(r["n"])) for r in rows}
    return counts, max((str(r["last_tenant"]) for r in rows), default="")
