"""Helpers for testing code that uses tenantq (shipped to users, like
Oban.Testing): drain a queue synchronously, wait on a condition with a
deadline instead of sleeping."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from tenantq.dispatch.outcome import Backoff
from tenantq.dispatch.worker import Worker, WorkerConfig, WorkerStats
from tenantq.registry import REGISTRY, Registry
from tenantq.sandbox.inline import InlineExecutor
from tenantq.store.db import Database

T = TypeVar("T")


def drain(
    db: Database,
    registry: Registry | None = None,
    *,
    concurrency: int = 1,
    batch_size: int = 10,
    backoff: Backoff | None = None,
) -> WorkerStats:
    """Run every runnable job inline until none is left, then return.

    Retries are scheduled with `backoff` (default: no delay at all, so a
    failing job is retried within the same drain until it is dead).
    """
    config = WorkerConfig(
        concurrency=concurrency, batch_size=batch_size, once=True,
        backoff=backoff or Backoff(base_seconds=0.0, cap_seconds=0.0),
    )
    return Worker(db, InlineExecutor(registry or REGISTRY), config).run()


def wait_until(
    predicate: Callable[[], T | bool | None],
    *,
    timeout: float = 10.0,
    interval: float = 0.02,
    message: str = "condition",
) -> T:
    """Poll `predicate` until it returns something truthy; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)
