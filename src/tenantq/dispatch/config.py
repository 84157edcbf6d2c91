"""A worker's settings and counters (`WorkerConfig`, `WorkerStats`);
re-exported by dispatch/worker.py, where they are documented."""

from __future__ import annotations

import os
import socket
import threading
import uuid
from dataclasses import dataclass, field

from tenantq.dispatch.outcome import Backoff
from tenantq.fairness.drr import Mode
from tenantq.fairness.slots import DEFAULT_INTERACTIVE_SHARE


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class WorkerConfig:
    concurrency: int = 4
    batch_size: int = 10
    lease_seconds: float = 30.0
    poll_seconds: float = 1.0
    flush_seconds: float = 1.0
    once: bool = False
    backoff: Backoff = field(default_factory=Backoff)
    fair_by: Mode = Mode.JOBS
    quantum_seconds: float = 1.0
    interactive_share: float = DEFAULT_INTERACTIVE_SHARE
    worker_id: str = field(default_factory=default_worker_id)
    # unexpected failures in a row (claims, or batches), with no success in
    # between, after which the worker stops and reports failure
    max_failures: int = 10
    # a slot waits min(this * 2 ** n, 30) s after its n-th failed batch in a row
    failure_backoff_seconds: float = 0.5


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
