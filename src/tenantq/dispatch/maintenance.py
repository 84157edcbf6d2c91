"""Per-worker background duties: heartbeat its leases and its row in the
registry of live workers, reap expired leases.

Every running worker reaps every expired lease (not only its own), so no
user cron is needed and a killed dispatcher's jobs come back within one
lease period plus one reap interval.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import psycopg

from tenantq.observe import metrics
from tenantq.settings import Settings
from tenantq.store import jobs, schedules, wakes, workers
from tenantq.store.db import Conn, Pool
from tenantq.store.queries import sql
from tenantq.store.steps import run

if TYPE_CHECKING:
    from tenantq.dispatch.cancels import CancelBook
    from tenantq.dispatch.presence import Presence
    from tenantq.registry import Registry

log = logging.getLogger("tenantq.maintenance")

REPAIR_EVERY_SECONDS = 60.0
# retention: how often a worker prunes finished jobs, in chunks of
# PRUNE_CHUNK rows, for at most PRUNE_BUDGET_SECONDS per round; a round
# that ran out of time with more to go is followed by another after
# PRUNE_BACKLOG_PAUSE_SECONDS (a backlog never holds the maintenance thread
# for long, and pruning keeps up with a busy queue)
PRUNE_JOBS_EVERY_SECONDS = 60.0
PRUNE_CHUNK = 1000
PRUNE_BUDGET_SECONDS = 2.0
# with a backlog, the next round comes after this pause, not at the next
# tick (ticks are lease/3 apart: 2 s of pruning per 10 s fell behind a
# 2,500 jobs/s soak on two workers); the pause leaves the database room
PRUNE_BACKLOG_PAUSE_SECONDS = 0.5
SANDBOX_REAP_EVERY_SECONDS = 10.0
PRUNE_EVERY_SECONDS = 3600.0


class LeaseBook:
    """The batches this worker holds, shared by slots and the heartbeat."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[int] = set()
        self._lost: set[int] = set()

    def add(self, batch_id: int) -> None:
        with self._lock:
            self._live.add(batch_id)

    def remove(self, batch_id: int) -> None:
        with self._lock:
            self._live.discard(batch_id)
            self._lost.discard(batch_id)

    def live(self) -> list[int]:
        with self._lock:
            return sorted(self._live - self._lost)

    def mark_lost(self, batch_ids: set[int]) -> None:
        with self._lock:
            self._lost |= batch_ids & self._live

    def is_lost(self, batch_id: int) -> bool:
        with self._lock:
            return batch_id in self._lost


def driver_reaper(executor: object) -> Callable[[], list[str]] | None:
    """A sandboxed executor reaps sandboxes past their TTL (and old snapshots)."""
    reap = getattr(executor, "reap", None)
    if not callable(reap):
        reap = getattr(getattr(executor, "driver", None), "reap", None)
    return reap if callable(reap) else None


def sync_app_schedules(pool: Pool, registry: Registry | None, kinds: Iterable[str] | None) -> None:
    """At a worker's start: store the schedules its app declares
    (@tenantq.periodic) and drop the app schedules of its kinds that the
    app no longer declares (a worker of another app leaves theirs alone)."""
    declared = registry.periodic_schedules() if registry is not None else []
    if not declared and kinds is None:
        return
    served = sorted(kinds) if kinds is not None else sorted({s.kind for s in declared})
    with pool.connection() as conn:
        run(conn, schedules.sync_app_steps(declared, served), atomic=True)


class Maintenance(threading.Thread):
    def __init__(
        self,
        pool: Pool,
        leases: LeaseBook,
        *,
        lease_seconds: float,
        stopping: threading.Event,
        on_reaped: Callable[[list[dict[str, Any]]], None] | None = None,
        on_interactive: Callable[[], None] | None = None,
        reap_sandboxes: Callable[[], list[str]] | None = None,
        presence: Presence | None = None,
        kinds: Iterable[str] | None = None,
        cancels: CancelBook | None = None,
    ) -> None:
        super().__init__(name="tenantq-maintenance", daemon=True)
        self.pool = pool
        self.leases = leases
        self.lease_seconds = lease_seconds
        self.stopping = stopping
        self.on_reaped = on_reaped
        self.on_interactive = on_interactive
        self.reap_sandboxes = reap_sandboxes
        self.presence = presence
        self.cancels = cancels
        # interactive work of these kinds recalls lent slots (None: any)
        self.kinds = None if kinds is None else sorted(kinds)
        self._last_sandbox_reap = 0.0
        # heartbeat three times per lease so one missed beat loses nothing
        self.interval = max(0.05, lease_seconds / 3)
        self._last_repair = 0.0
        self._last_prune = 0.0
        self._last_job_prune = 0.0
        # the last round ran out of time with more to prune: go on soon
        self._prune_backlog = False
        # the last tenant a prune chunk reached: the next starts after it
        self._prune_after = ""
        settings = Settings()  # read once: each read parses the environment (~2.5 ms)
        self.retention = settings.retention()
        self.batch_retention = settings.batch_retention()

    def run(self) -> None:
        next_tick = time.monotonic() + self.interval
        while not self.stopping.wait(self._pause(next_tick)):
            try:
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + self.interval
                    self.tick()
                elif self._prune_backlog:
                    with self.pool.connection() as conn:
                        self.prune_jobs(conn)
            except psycopg.Error as exc:
                log.warning("maintenance tick failed (%s); will retry", str(exc).strip()[:200])

    def _pause(self, next_tick: float) -> float:
        until_tick = max(0.0, next_tick - time.monotonic())
        return min(until_tick, PRUNE_BACKLOG_PAUSE_SECONDS) if self._prune_backlog else until_tick

    def fire_schedules(self, conn: Conn) -> None:
        """Enqueue the jobs of due schedules (store/schedules.py: one job per
        fire time across every worker); a schedule fires within one tick."""
        db = self.pool.db
        fired = run(conn, schedules.fire_due_steps(schema=db.schema, channel=db.notify_channel), atomic=True)
        if fired:
            log.info("fired %d schedule(s): jobs %s", len(fired), [job for _, job in fired][:20])

    def prune_jobs(self, conn: Conn) -> dict[str, int]:
        """Retention: delete finished jobs past their window, chunk by chunk
        (each its own short transaction), within the round's time budget."""
        total: dict[str, int] = {}
        deadline = time.monotonic() + PRUNE_BUDGET_SECONDS
        while not self.stopping.is_set():
            went, last = run(conn, jobs.prune_chunk_steps(retention=self.retention, limit=PRUNE_CHUNK,
                                                          after=self._prune_after))
            for status, count in went.items():
                total[status] = total.get(status, 0) + count
                metrics.PRUNED.labels(status).inc(count)
            # the next chunk starts with the tenant after the last one this reached
            self._prune_after = last or self._prune_after
            if sum(went.values()) < PRUNE_CHUNK:
                self._prune_backlog = False
                break
            if time.monotonic() >= deadline:
                self._prune_backlog = True
                break
        if total:
            log.info("pruned %s finished job(s) past their retention", total)
        self.prune_batches(conn, deadline)
        return total

    def prune_batches(self, conn: Conn, deadline: float) -> int:
        """Retention of ended batches (TENANTQ_RETAIN_BATCHES), in chunks like
        the jobs', in what is left of the round's time budget. Kept longer
        than the jobs they ran, they became the one table a soak saw grow
        (docs/benchmarks.md, "Soak")."""
        pruned = 0
        while not self.stopping.is_set() and time.monotonic() < deadline:
            cur = conn.execute(sql("batches", "prune"), {"keep_seconds": self.batch_retention,
                                                         "limit": PRUNE_CHUNK, "now": None})
            pruned += cur.rowcount
            if cur.rowcount < PRUNE_CHUNK:
                break
        else:
            self._prune_backlog = True
        return pruned

    def tick(self) -> None:
        with self.pool.connection() as conn:
            held = self.leases.live()
            if held:
                alive = jobs.heartbeat(conn, held, lease_seconds=self.lease_seconds)
                lost = set(held) - alive
                if lost:
                    log.warning("lost leases %s: their results will be refused", sorted(lost))
                    self.leases.mark_lost(lost)
                if self.cancels is not None:
                    # the fallback for a missed 'cancel:' notification
                    for batch_id, job_id in run(conn, jobs.cancel_requests_steps(held)):
                        self.cancels.request(batch_id, job_id)
            if self.presence is not None:
                self.presence.beat(conn)
            if self.on_interactive is not None:
                # polling fallback for the NOTIFY that recalls lent slots
                row = conn.execute(sql("queues", "interactive_runnable"), {"kinds": self.kinds}).fetchone()
                if row is not None and row["waiting"]:
                    self.on_interactive()
            self.fire_schedules(conn)
            reaped = jobs.expire_leases(conn)
            if reaped:
                log.warning("reaped %d jobs from expired leases", len(reaped))
                if self.on_reaped is not None:
                    self.on_reaped(reaped)
            now = time.monotonic()
            due = now - self._last_sandbox_reap >= SANDBOX_REAP_EVERY_SECONDS
            if self.reap_sandboxes is not None and due:
                self._last_sandbox_reap = now
                try:
                    gone = self.reap_sandboxes()
                except (OSError, subprocess.SubprocessError) as exc:
                    log.warning("sandbox reaper failed: %s", exc)
                else:
                    if gone:
                        log.warning("reaped %d sandbox(es) past their TTL: %s", len(gone), gone)
            if now - self._last_repair >= REPAIR_EVERY_SECONDS:
                self._last_repair = now
                # slots fold as they look for work; a fleet whose slots are
                # all busy folds here, so queue rows (and the dashboard's
                # view of them) do not lag by more than this period
                wakes.fold(conn)
                conn.execute(sql("queues", "repair"))
            if now - self._last_job_prune >= PRUNE_JOBS_EVERY_SECONDS:
                self._last_job_prune = now
                self.prune_jobs(conn)
            if now - self._last_prune >= PRUNE_EVERY_SECONDS:
                self._last_prune = now
                workers.prune(conn)
