"""Pick a queue by deficit round robin, then lease a batch of its jobs.

The cursor row of the priority class is locked FOR UPDATE for the decision
only, so dispatchers on any number of hosts take turns on one shared
schedule: each decision reads the cursor the previous one committed, and
charges the queue it chose before it lets go. The claim runs after that
commit, without the lock, and repays what it did not get (claim_next). The
work per pick is bounded: at most 2 * PROBE_LIMIT candidate queues, read
through the partial index of queues with work, whatever the backlog or the
number of idle tenants.

A worker claims only the kinds its app registers (`ClaimRequest.kinds`).
The candidates are the queues whose kinds hint holds one of them (see
queues.sql, "The kinds hint"), so a tenant with only other kinds of work is
never visited by this worker: it is neither credited nor charged, and the
round robin of the workers that can run it is untouched. A visit whose
claim finds nothing makes that queue's hint exact (`_settle_queue_hint`),
so the next pick does not probe it again.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime

import psycopg

from tenantq.domain.records import Batch, Priority
from tenantq.fairness import drr
from tenantq.store import jobs, rates, wakes
from tenantq.store.db import Conn
from tenantq.store.queries import composed, sql

# Candidate queues read per side of the cursor. A probe only fails for a
# queue whose runnable jobs were all taken since the last look, or a tenant
# at its cap; each failed probe fixes the queue's hint.
PROBE_LIMIT = 32


@dataclass
class PickNotes:
    """What a pick that found nothing learnt: how soon a rate-limited
    tenant it passed over gets a token (the slot waits no longer)."""

    next_token_in: float | None = None
    # The last pick's wait for its class's cursor lock (from BEGIN until the
    # locked row arrived, one round trip included) and how long it then held
    # the lock (until its decision's COMMIT returned), in seconds, summed over
    # the decisions of one claim_next. Every pick of the
    # fleet takes that lock in turn, so 1 / lock_held is the picks per second
    # one class allows (docs/benchmarks.md, "Many workers").
    lock_wait: float = 0.0
    lock_held: float = 0.0

    def token_in(self, seconds: float) -> None:
        self.next_token_in = seconds if self.next_token_in is None else min(self.next_token_in, seconds)


class _LockClock:
    """Adds a decision's cursor lock times to its PickNotes. Entered before
    the decision's transaction and left after it, so the hold ends with the
    COMMIT."""

    def __init__(self, notes: PickNotes) -> None:
        self.notes = notes
        self.started = self.locked = 0.0

    def __enter__(self) -> _LockClock:
        self.started, self.locked = time.perf_counter(), 0.0
        return self

    def lock_taken(self) -> None:
        self.locked = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.locked:
            self.notes.lock_wait += self.locked - self.started
            self.notes.lock_held += time.perf_counter() - self.locked


@dataclass(frozen=True)
class ClaimRequest:
    worker_id: str
    driver: str
    batch_size: int
    lease_seconds: float
    fair_by: drr.Mode = drr.Mode.JOBS
    # credit per visit and unit of weight, in seconds, with fair_by=runtime
    quantum_seconds: float = 1.0
    # the kinds this worker can run, sorted; None: any kind
    kinds: tuple[str, ...] | None = None

    @property
    def quantum(self) -> float:
        # jobs mode: a weight-1 queue may take one full batch per turn
        return float(self.batch_size) if self.fair_by is drr.Mode.JOBS else self.quantum_seconds


# Decisions one claim_next may take when the claims that follow them find
# nothing. Each decision passes over the queues this claim_next already
# tried, as one pick visited each queue at most once when it claimed under
# the lock, so this bound is only a backstop.
MAX_DECISIONS = 2 * PROBE_LIMIT


@dataclass(frozen=True)
class _Decision:
    """Which queue a pick serves and what it charged it, committed under the
    cursor lock before any job is claimed."""

    tenant_id: str
    max_jobs: int
    # what the decision added to the queue's deficit (credit minus the charge
    # for max_jobs): a claim that takes nothing gives exactly this back
    delta: float
    # cost units per job charged: 1 (jobs mode) or the estimate (runtime)
    unit: float
    # the deficit the decision computed: in jobs mode a short claim has
    # something to give back only when it is above 0 (a dry queue keeps none)
    written: float
    rate_limited: bool
    capped: bool
    pending_kinds: list[str] | None
    egress: tuple[str, ...]
    host_functions: tuple[str, ...] | None


def claim_next(
    conn: Conn, request: ClaimRequest, priority: Priority, *, now: datetime | None = None,
    notes: PickNotes | None = None, abandon: Callable[[], bool] | None = None, fold: bool = True,
) -> Batch | None:
    """Lease the next batch of `priority` work, or None if there is none.

    A pick is two transactions. The decision (`_decide`) locks the class's
    cursor row, reads the candidates, runs DRR, charges the chosen queue for
    a full batch and moves the cursor, and commits: the lock is held for one
    round trip and the Python between, not for the claim. The claim
    (`_lease`) then leases the rows without the lock and gives back what it
    was charged and did not get (`queues.sql` `add_to_deficits`: deficits
    are only ever added to, so the decisions and repayments of many workers
    commute). A claim that finds nothing, or finds its tenant at its cap or
    out of tokens, is repaid in full and the next decision is taken.

    `abandon` is asked before the decision commits and again after the
    batch's rows are locked and before the claim commits: if it says yes
    the pick keeps nothing (None) but, in the second case, the cursor's
    move. A stopping worker uses it, so a claim that began before the stop
    cannot take the jobs a stopping batch has just released: any claim that
    sees those rows read them after the stop, so it also sees the stop.

    A dispatcher that dies between the two transactions costs its tenant one
    turn's credit, never a job (the decision holds no lease).

    `fold`: first fold the wakes into queue rows (store/wakes.py), in a
    statement of its own, before the cursor lock; a worker that has just
    folded (`wakes.classes_with_work`) passes False. Not inside a caller's
    transaction: the fold's row locks would last until the caller commits.
    """
    if fold and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        wakes.fold(conn, now=now)
    notes = notes if notes is not None else PickNotes()
    notes.lock_wait = notes.lock_held = 0.0
    kinds = None if request.kinds is None else list(request.kinds)
    tried: set[str] = set()
    for _ in range(MAX_DECISIONS):
        decision = _decide(conn, request, priority, kinds, now, notes, abandon, tried)
        if decision is None:
            return None
        tried.add(decision.tenant_id)
        leased = _lease(conn, request, priority, decision, kinds, now, notes, abandon)
        if not isinstance(leased, _Retry):
            return leased
    return None


class _Retry:
    """_lease claimed nothing and repaid the charge: decide again."""


def _no_token(tokens: float | None) -> bool:
    return tokens is not None and tokens < 1


def _decide(conn: Conn, request: ClaimRequest, priority: Priority, kinds: list[str] | None,
            now: datetime | None, notes: PickNotes, abandon: Callable[[], bool] | None,
            tried: set[str]) -> _Decision | None:
    """The decision, under the class's cursor lock (see claim_next); the
    queues in `tried` are passed over, neither credited nor charged.

    Under the lock no row lock is waited for (queues.sql `add_to_deficits`,
    `skipping`): a queue row another transaction holds for a moment (a
    fold, a settle's charge, a probe's clear) would hold every worker of
    the class behind this one. Its delta is added after the decision
    commits, without the cursor lock (deltas commute)."""
    writes: list[_DeficitWrite] = []
    decision = _decide_locked(conn, request, priority, kinds, now, notes, abandon, tried, writes)
    # read after the commit: in the pipeline, reading them before would
    # cost the decision a round trip under the lock
    deferred = {t: d for write in writes for t, d in write.skipped().items()}
    if deferred:
        with conn.transaction():
            add_to_deficits(conn, priority, deferred)
    return decision


def _decide_locked(conn: Conn, request: ClaimRequest, priority: Priority, kinds: list[str] | None,
                   now: datetime | None, notes: PickNotes, abandon: Callable[[], bool] | None,
                   tried: set[str], writes: list[_DeficitWrite]) -> _Decision | None:
    """`_decide` under the lock; its deficit writes are appended to
    `writes`. Pipelined: BEGIN, the commit mode, the cursor lock and the
    candidate read go out in one round trip; the writes and the COMMIT in a
    second."""
    # inside a caller's transaction (a savepoint) the commit mode would
    # outlive the decision and apply to the caller's own commit: not there
    own_transaction = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with _LockClock(notes) as clock, conn.pipeline(), conn.transaction():
        if own_transaction:
            conn.execute(sql("scheduler", "decide_quickly"))
        locked = conn.execute(sql("scheduler", "lock_cursor"), {"priority": priority})
        found = conn.execute(composed("queues", "candidates", rate_columns="rate_columns"),
                             {"priority": priority, "limit": PROBE_LIMIT, "kinds": kinds, "now": now})
        row = locked.fetchone()
        clock.lock_taken()
        assert row is not None, "scheduler rows are created by the schema"
        cursor, turn_open = str(row["cursor_tenant"]), bool(row["turn_open"])
        rows = found.fetchall()
        if rows and not turn_open and rows[0]["tenant_id"] == cursor:
            rows.append(rows.pop(0))  # its turn is over: it goes last this round
        read = {str(r["tenant_id"]): drr.safe_deficit(r["deficit"]) for r in rows}
        tokens_of: dict[str, float | None] = {}
        for r in rows:
            tokens = None if r["rate_tokens"] is None else float(str(r["rate_tokens"]))
            tokens_of[str(r["tenant_id"])] = tokens
            if _no_token(tokens):
                assert tokens is not None
                notes.token_in(rates.refill_seconds(tokens, float(str(r["rate_per_second"]))))
        candidates = [
            drr.Candidate(
                tenant_id=str(r["tenant_id"]),
                weight=int(str(r["weight"])),
                # never trusted to be a usable number (see drr.safe_deficit)
                deficit=read[str(r["tenant_id"])],
                # a tenant at its cap, or with no token left, is passed over:
                # no credit, no charge, nobody waits for it
                at_cap=(_at_cap_hint(r) or _no_token(tokens_of[str(r["tenant_id"])])
                        or str(r["tenant_id"]) in tried),
            )
            for r in rows
        ]
        visits = drr.plan(candidates, cursor=cursor, turn_open=turn_open, mode=request.fair_by,
                          quantum=request.quantum, batch_size=request.batch_size)
        walked_past: dict[str, float] = {}
        visit = next((v for v in visits if v.eligible), None)
        for v in visits:
            if v is visit:
                break
            walked_past[v.tenant_id] = v.deficit - read[v.tenant_id]  # runtime debt shrinks by one quantum
        if visit is None:
            if walked_past:
                writes.append(_DeficitWrite.start(conn, priority, walked_past))
            return None
        r = next(r for r in rows if str(r["tenant_id"]) == visit.tenant_id)
        max_jobs = visit.max_jobs
        tokens = tokens_of[visit.tenant_id]
        # runtime mode: until a queue has history, assume a batch costs one quantum
        est = drr.estimate(r["avg_job_seconds"], default=request.quantum_seconds / max(1, request.batch_size))
        # a tenant without a whole token was passed over (at_cap above)
        by_tokens = tokens is not None and math.floor(tokens + 1e-9) < max_jobs
        if by_tokens:
            assert tokens is not None
            max_jobs = math.floor(tokens + 1e-9)
        deficit, keep_turn = drr.charge(visit, claimed=max_jobs, mode=request.fair_by, est_job_cost=est)
        if by_tokens:
            # bounded by its tokens, not its credit: the turn ends (tenants
            # sharing a kind's limit take turns) and no credit is banked (it
            # would let the tenant run ahead of others once unlimited)
            deficit, keep_turn = min(deficit, 0.0), False
        if abandon is not None and abandon():
            raise psycopg.Rollback()  # the transaction's exit: nothing of it is kept
        delta = deficit - read[visit.tenant_id]
        writes.append(_DeficitWrite.start(conn, priority, {**walked_past, visit.tenant_id: delta}))
        conn.execute(sql("scheduler", "advance_cursor"),
                     {"priority": priority, "tenant_id": visit.tenant_id, "turn_open": keep_turn})
        return _Decision(
            tenant_id=visit.tenant_id, max_jobs=max_jobs, delta=delta, written=deficit,
            unit=1.0 if request.fair_by is drr.Mode.JOBS else est,
            rate_limited=tokens is not None or bool(r["kind_limited"]),
            capped=r["max_sandboxes"] is not None,
            pending_kinds=None if r["kinds"] is None else [str(k) for k in r["kinds"]],  # type: ignore[attr-defined]
            egress=tuple(str(e) for e in (r["egress"] or ())),  # type: ignore[attr-defined]
            host_functions=None if r["host_functions"] is None
            else tuple(str(f) for f in r["host_functions"]),  # type: ignore[attr-defined]
        )
    return None  # rolled back: abandoned


def _lease(conn: Conn, request: ClaimRequest, priority: Priority, decision: _Decision,
           kinds: list[str] | None, now: datetime | None, notes: PickNotes,
           abandon: Callable[[], bool] | None) -> Batch | _Retry | None:
    """The claim of a decision, without the cursor lock: the batch, None
    (abandoned), or _Retry (nothing claimed; the charge is repaid)."""
    tenant_id = decision.tenant_id
    rows = jobs.ClaimedRows((), ())
    abandoned = False
    # Pipelined: BEGIN and the claim in one round trip (two when the
    # tenant's buckets or cap are read first, under their row locks until
    # commit), the writes and the COMMIT in another.
    with conn.pipeline(), conn.transaction():
        limits = None
        limit = decision.max_jobs
        if decision.rate_limited:
            # under the buckets' row locks until commit (rates.py)
            limits = rates.for_claim(conn, tenant_id, kinds, now=now, pending_kinds=decision.pending_kinds)
            if limits.refill_in is not None:
                notes.token_in(limits.refill_in)
            if limits.tenant is not None:
                limit = min(limit, limits.tenant)
        refused = limit < 1 or (decision.capped and _at_cap(conn, tenant_id, now))
        if not refused:
            rows = jobs.claim_rows(conn, tenant_id=tenant_id, priority=priority, limit=limit,
                                   worker_id=request.worker_id, driver=request.driver,
                                   lease_seconds=request.lease_seconds, kinds=request.kinds,
                                   quotas=None if limits is None else limits.kinds, now=now)
        if rows and abandon is not None and abandon():
            abandoned = True
            raise psycopg.Rollback()
        if rows:
            if limits is not None:
                rates.take(conn, limits, Counter(rows.column("kind")), now=now)
            if request.fair_by is drr.Mode.RUNTIME:
                conn.execute(sql("batches", "set_charged"), {"batch_id": rows.column("batch_id")[0],
                                                             "seconds": decision.unit * len(rows)})
        else:
            # nothing claimed: no credit kept, nothing charged
            add_to_deficits(conn, priority, {tenant_id: -decision.delta})
            if not refused and not (limits is not None and limits.exhausted):
                # nothing runnable of our kinds: the hint is fixed so that the
                # next decision does not come back (its kinds may all be out
                # of tokens instead: then the hint stays)
                _settle_queue_hint(conn, tenant_id, priority, now)
    if abandoned:
        with conn.transaction():
            add_to_deficits(conn, priority, {tenant_id: -decision.delta})
        return None
    if not rows:
        return _Retry()
    if len(rows) < decision.max_jobs and (decision.written > 0 or request.fair_by is drr.Mode.RUNTIME):
        # fewer than charged for: the queue ran dry (or out of tokens). A dry
        # queue keeps no credit; what it was charged beyond its jobs is given
        # back, up to 0. After the commit, in its own statement: the claim
        # locks jobs before this would lock the queue row, and an enqueue
        # locks them the other way round.
        with conn.transaction():
            add_to_deficits(conn, priority, {tenant_id: decision.unit * (decision.max_jobs - len(rows))},
                             ceiling=0.0)
    # the tenant's egress rules and host-function restriction travel with
    # the batch to its sandbox
    return replace(jobs.batch_of(tenant_id, priority, rows), egress=decision.egress,
                   host_functions=decision.host_functions)


def _at_cap_hint(row: dict[str, object]) -> bool:
    cap = row["max_sandboxes"]
    return cap is not None and int(str(row["live"])) >= int(str(cap))


def _at_cap(conn: Conn, tenant_id: str, now: datetime | None) -> bool:
    """Authoritative cap check under the tenant's row lock (held to commit),
    so two dispatchers picking different classes cannot both pass it."""
    row = conn.execute(sql("tenants", "lock_for_cap"), {"tenant_id": tenant_id}).fetchone()
    if row is None or row["max_sandboxes"] is None:
        return False
    live = conn.execute(sql("tenants", "count_live"), {"tenant_id": tenant_id, "now": now}).fetchone()
    assert live is not None
    return int(str(live["live"])) >= int(str(row["max_sandboxes"]))


def add_to_deficits(conn: Conn, priority: Priority, deltas: dict[str, float], *,
                    ceiling: float = drr.MAX_CREDIT) -> None:
    """Add to queues' deficits (queues.sql `add_to_deficits`), at most
    `ceiling`, waiting for rows another transaction holds."""
    conn.execute(composed("queues", "add_to_deficits", locking="waiting"),
                 _deficit_params(priority, deltas, ceiling))


def _deficit_params(priority: Priority, deltas: dict[str, float], ceiling: float) -> dict[str, object]:
    # a delta that is not a finite number adds nothing (it would compare
    # above every number in SQL and land at the bound)
    return {"priority": priority, "tenant_ids": list(deltas),
            "deltas": [drr.finite_or_none(d) or 0.0 for d in deltas.values()], "ceiling": ceiling}


@dataclass
class _DeficitWrite:
    """`add_to_deficits` under the cursor lock: rows another transaction
    holds are skipped, not waited for; `skipped()`, read once the decision
    has committed, gives their deltas back."""

    deltas: dict[str, float]
    cursor: psycopg.Cursor[dict[str, object]]

    @classmethod
    def start(cls, conn: Conn, priority: Priority, deltas: dict[str, float]) -> _DeficitWrite:
        cursor = conn.execute(composed("queues", "add_to_deficits", locking="skipping"),
                              _deficit_params(priority, deltas, drr.MAX_CREDIT))
        return cls(deltas, cursor)

    def skipped(self) -> dict[str, float]:
        written = {str(r["tenant_id"]) for r in self.cursor.fetchall()}
        return {t: d for t, d in self.deltas.items() if t not in written}


def _settle_queue_hint(conn: Conn, tenant_id: str, priority: Priority, now: datetime | None) -> None:
    """A probe found nothing runnable (of this worker's kinds): fix the
    queue's has_work/next_run_at and its kinds hint.

    Two statements on purpose (see queues.sql): the lock first, then the
    emptiness check in a fresh snapshot that sees every enqueue that
    committed while we waited for the lock.
    """
    conn.execute(sql("queues", "lock_for_clear"), {"tenant_id": tenant_id, "priority": priority})
    conn.execute(sql("queues", "clear_if_empty"), {"tenant_id": tenant_id, "priority": priority, "now": now})
