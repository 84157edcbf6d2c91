"""A worker's settings and counters (`WorkerConfig`, `WorkerStats`);
re-exported by dispatch/worker.py, where they are documented. The
defaults are settings.py's DEFAULT_WORKER_* (the TENANTQ_WORKER_* settings'
defaults, which `tenantq worker`'s options take)."""

from __future__ import annotations

import os
import socket
import threading
import uuid
from dataclasses import dataclass, field

from tenantq.dispatch.outcome import Backoff
from tenantq.errors import InvalidInput
from tenantq.fairness.drr import Mode
from tenantq.settings import (
    DEFAULT_WORKER_BACKOFF_BASE,
    DEFAULT_WORKER_BACKOFF_CAP,
    DEFAULT_WORKER_BATCH_SIZE,
    DEFAULT_WORKER_CONCURRENCY,
    DEFAULT_WORKER_FAIR_BY,
    DEFAULT_WORKER_INTERACTIVE_SHARE,
    DEFAULT_WORKER_LEASE_SECONDS,
    DEFAULT_WORKER_POLL_SECONDS,
    DEFAULT_WORKER_QUANTUM_SECONDS,
)

# A worker's connections to tenantq's store when not set: one per slot up
# to this many. A slot holds one only to claim and to settle (short
# transactions), so more slots share them; without the bound, 200 slots
# would open 200 connections and crowd out everything else on the server
# (`./run bench host-connections` found the app database's pool refused
# with "too many clients" behind them).
DEFAULT_MAX_STORE_CONNECTIONS = 20


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class WorkerConfig:
    concurrency: int = DEFAULT_WORKER_CONCURRENCY
    batch_size: int = DEFAULT_WORKER_BATCH_SIZE
    lease_seconds: float = DEFAULT_WORKER_LEASE_SECONDS
    poll_seconds: float = DEFAULT_WORKER_POLL_SECONDS
    flush_seconds: float = 1.0
    once: bool = False
    backoff: Backoff = field(default_factory=lambda: Backoff(base_seconds=DEFAULT_WORKER_BACKOFF_BASE,
                                                             cap_seconds=DEFAULT_WORKER_BACKOFF_CAP))
    fair_by: Mode = field(default_factory=lambda: Mode(DEFAULT_WORKER_FAIR_BY))
    quantum_seconds: float = DEFAULT_WORKER_QUANTUM_SECONDS
    interactive_share: float = DEFAULT_WORKER_INTERACTIVE_SHARE
    worker_id: str = field(default_factory=default_worker_id)
    # unexpected failures in a row (claims, or batches), with no success in
    # between, after which the worker stops and reports failure
    max_failures: int = 10
    # a slot waits min(this * 2 ** n, 30) s after its n-th failed batch in a row
    failure_backoff_seconds: float = 0.5
    # the most connections to tenantq's store (claims, settles, maintenance);
    # None: concurrency + 2, at most DEFAULT_MAX_STORE_CONNECTIONS
    store_connections: int | None = None

    def __post_init__(self) -> None:
        if self.store_connections is not None and not 2 <= self.store_connections <= 1000:
            raise InvalidInput(f"store connections must be 2-1000, got {self.store_connections}")

    def store_pool_size(self) -> int:
        if self.store_connections is not None:
            return self.store_connections
        return min(self.concurrency + 2, DEFAULT_MAX_STORE_CONNECTIONS)


@dataclass
class WorkerStats:
    batches: int = 0
    done: int = 0
    retried: int = 0
    dead: int = 0
    released: int = 0
    refused: int = 0
    reaped: int = 0
    recalled: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
