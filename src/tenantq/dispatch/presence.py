"""A worker in the registry of live workers (store/workers.py): which kinds
it claims, its heartbeat, and its executor's failures in a row.

The registry is what lets `tenantq job` say "no running worker has a
handler for kind K" or "worker W cannot run batches: <error>", and the
dashboard list what each worker serves. Writing it never stops a worker:
a failed write is logged and the next tick tries again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

import psycopg

from tenantq.dispatch.executors.contract import BatchExecutor
from tenantq.errors import InvalidInput
from tenantq.store import workers
from tenantq.store.db import Conn, Pool
from tenantq.store.workers import WorkerRecord

log = logging.getLogger("tenantq.worker")


def executor_kinds(executor: BatchExecutor) -> frozenset[str] | None:
    """The kinds `executor` can run: its `kinds()` when it has one, else
    its registry's kinds (SandboxExecutor holds one), else None: an
    executor that does not say claims every kind, as before kinds existed."""
    kinds = getattr(executor, "kinds", None)
    if callable(kinds):
        found: Iterable[str] | None = kinds()
    else:
        registry = getattr(executor, "registry", None)
        listed = getattr(registry, "kinds", None)
        found = listed() if callable(listed) else None
    return None if found is None else frozenset(str(k) for k in found)


def require_kinds(kinds: frozenset[str] | None, executor: BatchExecutor) -> None:
    """A worker whose app registers nothing it can run would lease nothing
    and wait forever: refuse to start it, with one line."""
    if kinds is not None and not kinds:
        inline = getattr(executor, "name", "") == "inline"
        raise InvalidInput("the app registers no handler this worker can run: decorate functions with "
                           "@tenantq.handler(KIND) in the module given to --app"
                           + ("; sandbox-only kinds (tenantq.python among them) need --sandbox "
                              "auto|gvisor|process" if inline else ""))


class Presence:
    """This worker's row in the registry, and its executor's failure streak."""

    def __init__(self, record: WorkerRecord) -> None:
        self.record = record
        self._lock = threading.Lock()
        self._failures = 0

    @property
    def failures(self) -> int:
        """Batches in a row whose executor failed."""
        with self._lock:
            return self._failures

    def beat(self, conn: Conn) -> None:
        """Register, or renew the heartbeat (every maintenance tick)."""
        try:
            workers.beat(conn, self.record)
        except psycopg.Error as exc:
            self._warn("could not heartbeat the worker registry", exc)

    def leave(self, pool: Pool) -> None:
        try:
            with pool.connection() as conn:
                workers.leave(conn, self.record.worker_id)
        except Exception as exc:  # Postgres gone, or a broken pool: the row ages out
            self._warn("could not leave the worker registry (the row ages out)", exc)

    def executor_failed(self, pool: Pool, error: str) -> int:
        """One more executor failure in a row; returns the streak."""
        with self._lock:
            self._failures += 1
            streak = self._failures
        try:
            with pool.connection() as conn:
                workers.executor_failed(conn, self.record.worker_id, error)
        except Exception as exc:
            self._warn("could not record the executor failure in the worker registry", exc)
        return streak

    def executor_ok(self, pool: Pool) -> None:
        """A batch ran: the streak ends (one write, only after failures)."""
        with self._lock:
            had, self._failures = self._failures, 0
        if not had:
            return
        try:
            with pool.connection() as conn:
                workers.executor_ok(conn, self.record.worker_id)
        except Exception as exc:
            self._warn("could not clear the executor failures in the worker registry", exc)

    def _warn(self, what: str, exc: BaseException) -> None:
        text = str(exc).strip().splitlines()
        log.warning("%s: %s", what, text[0][:200] if text else type(exc).__name__)
