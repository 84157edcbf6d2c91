"""The ready pool's bookkeeping (sandbox/pool.py) with stand-in sandboxes:
what it hands out, what it deletes, what a retired kind leaves behind."""

from __future__ import annotations

import threading
from typing import Any

from tenantq.sandbox.pool import ReadyPool
from tenantq.testing import wait_until


class FakeHost:
    def remaining_ttl(self) -> float:
        return 600.0


class FakeSandbox:
    made = 0

    def __init__(self) -> None:
        FakeSandbox.made += 1
        self.host = FakeHost()
        self.deleted = threading.Event()

    def is_running(self) -> bool:
        return not self.deleted.is_set()

    def set_ttl(self, seconds: float) -> None:
        pass

    def delete(self) -> bool:
        self.deleted.set()
        return True


def _make() -> Any:
    return FakeSandbox()


def test_a_filled_pool_hands_out_each_sandbox_once_and_refills() -> None:
    pool = ReadyPool(2)
    key = ("app:x@k1", "process", 256, 1.0)
    try:
        pool.fill(key, _make)
        wait_until(lambda: pool.ready(key) == 2, timeout=10, message="the pool to fill")
        first, second = pool.take(key, _make), pool.take(key, _make)
        assert first is not None and second is not None and first is not second
        wait_until(lambda: pool.ready(key) == 2, timeout=10, message="the pool to refill")
        assert pool.take(key, _make) not in (first, second)
    finally:
        pool.close()


def test_forgetting_a_kind_deletes_what_waits_of_it_and_stops_refilling_it() -> None:
    pool = ReadyPool(1)
    old, new = ("app:x@k1", "process", 256, 1.0), ("app:x@k2", "process", 256, 1.0)
    try:
        pool.fill(old, _make)
        wait_until(lambda: pool.ready(old) == 1, timeout=10, message="the pool to fill")
        with pool._lock:
            (waiting,) = pool._ready[old]
        pool.forget(old)
        assert waiting.deleted.wait(10), "a retired kind's sandbox is deleted"
        pool.fill(new, _make)
        wait_until(lambda: pool.ready(new) == 1, timeout=10, message="the new kind to fill")
        assert pool.ready(old) == 0
    finally:
        pool.close()


def test_close_deletes_every_waiting_sandbox() -> None:
    pool = ReadyPool(2)
    key = ("app:x@k1", "process", 256, 1.0)
    pool.fill(key, _make)
    wait_until(lambda: pool.ready(key) == 2, timeout=10, message="the pool to fill")
    with pool._lock:
        waiting = list(pool._ready[key])
    pool.close()
    assert all(s.deleted.is_set() for s in waiting)
