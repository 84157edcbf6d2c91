"""The ready pool: per template (and driver and limits), `TENANTQ_POOL_SIZE`
pristine sandboxes booted ahead of demand, so `Sandbox.create` hands one
out instead of booting (docs/sandbox-api.md, "Ready pool").

A pooled sandbox belongs to no tenant and holds nothing: no metadata, no
envs, no secrets, a short TTL of its own. Handing it out gives it its
owner's tenant, metadata, envs and secrets (over the agent's channel) and
TTL; it is then an ordinary sandbox, deleted after use like any other and
never returned to the pool. A pool fills in the background, on the first
create of its kind in this process; what is left in it when the process
exits is deleted (or, if the process is killed, ends at its own TTL).
"""

from __future__ import annotations

import atexit
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tenantq.sandbox.core import SandboxCore

# template@build (a redefined template never hands out a sandbox of its
# previous definition), driver, memory_mb, cpus
PoolKey = tuple[str, str, int, float]
# a pooled sandbox's own TTL, renewed while it waits; a hand-out needs this much left
POOLED_TTL_SECONDS = 600.0
RENEW_BELOW_SECONDS = 300.0
REFILL_RETRY_SECONDS = 5.0


class ReadyPool:
    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._ready: dict[PoolKey, deque[SandboxCore]] = {}
        self._makers: dict[PoolKey, Callable[[], SandboxCore]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._at_exit = False

    def take(self, key: PoolKey, make: Callable[[], SandboxCore]) -> SandboxCore | None:
        """A ready sandbox of this kind, or None (then the caller boots one);
        either way the pool of this kind is (re)filled in the background."""
        if self.size <= 0:
            return None
        with self._lock:
            self._makers.setdefault(key, make)
            ready = self._ready.setdefault(key, deque())
            found = None
            while ready and found is None:
                candidate = ready.popleft()
                if candidate.is_running() and candidate.host.remaining_ttl() > 60:
                    found = candidate
                else:
                    threading.Thread(target=candidate.delete, daemon=True).start()
            self._start()
        self._wake.set()
        return found

    def fill(self, key: PoolKey, make: Callable[[], SandboxCore]) -> None:
        """Start keeping this kind ready now, before its first take (a worker
        at start)."""
        if self.size <= 0:
            return
        with self._lock:
            self._makers.setdefault(key, make)
            self._ready.setdefault(key, deque())
            self._start()
        self._wake.set()

    def forget(self, key: PoolKey) -> None:
        """Stop keeping this kind ready and delete what waits of it (the
        queue's template key changed: the app's code was edited)."""
        with self._lock:
            self._makers.pop(key, None)
            left = list(self._ready.pop(key, ()))
        for sandbox in left:
            threading.Thread(target=sandbox.delete, daemon=True).start()

    def ready(self, key: PoolKey) -> int:
        with self._lock:
            return len(self._ready.get(key, ()))

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._fill, name="tenantq-sandbox-pool", daemon=True)
            self._thread.start()
            if not self._at_exit:
                self._at_exit = True
                atexit.register(self.close)

    def _fill(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            made_one = False
            with self._lock:
                wanting = [k for k, make in self._makers.items() if len(self._ready.get(k, ())) < self.size]
            for key in wanting:
                try:
                    sandbox = self._makers[key]()
                except Exception:
                    continue
                with self._lock:
                    self._ready.setdefault(key, deque()).append(sandbox)
                made_one = True
            self._renew()
            if not made_one:
                self._wake.wait(REFILL_RETRY_SECONDS if wanting else 60.0)

    def _renew(self) -> None:
        with self._lock:
            waiting = [s for ready in self._ready.values() for s in ready]
        for sandbox in waiting:
            if sandbox.host.remaining_ttl() < RENEW_BELOW_SECONDS:
                sandbox.host.extend_deadline(POOLED_TTL_SECONDS)

    def close(self) -> None:
        """Stop filling (a boot under way finishes first) and delete what is
        still waiting: at exit, and for tests. The pool fills again on the
        next take()."""
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(60)
        with self._lock:
            left = [s for ready in self._ready.values() for s in ready]
            self._ready.clear()
            self._makers.clear()
        for sandbox in left:
            sandbox.delete()
        self._stop.clear()


_pool: list[ReadyPool] = []
_pool_lock = threading.Lock()


def pool() -> ReadyPool:
    """This process's pool; its size is TENANTQ_POOL_SIZE as it is now."""
    from tenantq.settings import Settings

    with _pool_lock:
        if not _pool:
            _pool.append(ReadyPool(0))
        _pool[0].size = Settings().pool_size
        return _pool[0]


def pool_key(template: str, driver: str, memory_mb: int = 512, cpus: float = 1.0) -> PoolKey:
    """The pool of sandboxes `Sandbox.create(template=..., driver=..., ...)` takes from."""
    from tenantq.sandbox import templates
    from tenantq.settings import Settings

    resolved = templates.resolve(Settings().data_dir, template)
    return (f"{template}@{resolved.key}", driver, memory_mb, float(cpus))


def wait_until_ready(key: PoolKey, count: int, timeout: float) -> bool:
    """For benchmarks and tests: has the pool of this kind `count` ready?"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pool().ready(key) >= count:
            return True
        time.sleep(0.05)
    return False
