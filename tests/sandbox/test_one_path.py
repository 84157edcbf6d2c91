"""One path: the queue's sandboxes are Sandbox API sandboxes.

Every sandbox a batch runs in, whatever it came from (a cold boot, the app's
template, the ready pool, a kept-warm or hibernated sandbox), is made,
restored and deleted by the Sandbox API's own code (sandbox/boot.py,
sandbox/api.py), its agent handing the init over to the guest runner; no
other module calls a driver's create or restore."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tenantq import Sandbox
from tenantq.dispatch.executors.warm import GuestServer, WarmPolicy
from tenantq.sandbox.driver import SandboxDriver
from tenantq.sandbox.drivers.gvisor import GVisorDriver
from tenantq.sandbox.drivers.process import ProcessDriver
from tenantq.testing import wait_until
from tests.sandbox.test_warm import needs_runsc
from tests.sandbox.warm_harness import Harness

API_MODULES = {"tenantq.sandbox.boot", "tenantq.sandbox.api", "tenantq.sandbox.forking",
               "tenantq.sandbox.runner_boot"}
# a driver's restore makes its new sandbox with its own create (the restore's caller is checked)
DRIVER_MODULES = {"tenantq.sandbox.drivers.gvisor", "tenantq.sandbox.drivers.process"}


def _driver(name: str, data_dir: Path) -> SandboxDriver:
    return GVisorDriver(data_dir) if name == "gvisor" else ProcessDriver(data_dir)


class Callers:
    """Which modules call the driver's create and restore."""

    def __init__(self, driver: SandboxDriver) -> None:
        self.seen: list[tuple[str, str]] = []
        for name in ("create", "restore"):
            original = getattr(driver, name, None)
            if original is not None:
                setattr(driver, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            caller = inspect.stack()[1].frame.f_globals.get("__name__", "?")
            self.seen.append((name, str(caller)))
            return original(*args, **kwargs)
        return call


class Acquired:
    """A GuestServer as the executor acquired it (a kept-warm one's origin
    changes when it serves again: its origin then is kept here)."""

    def __init__(self, server: GuestServer) -> None:
        self.server, self.origin, self.api = server, server.origin, server.api


def _servers(h: Harness) -> list[Acquired]:
    """Every GuestServer the executor acquires, as it acquires it."""
    servers: list[Acquired] = []
    acquire = h.executor.warm.acquire

    def recording(spec: Any) -> GuestServer:
        server = acquire(spec)
        servers.append(Acquired(server))
        return server

    h.executor.warm.acquire = recording  # type: ignore[method-assign]
    return servers


def _meta(server: Acquired) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((server.api.host.path / "sandbox.json").read_text())
    return meta


def _pool_key(h: Harness) -> Any:
    spec = h.executor.spec("", 60)
    return h.executor.warm._pool_key(spec, h.executor.template_key(spec))


def test_every_batch_sandbox_is_made_through_the_sandbox_api(
        driver_name: str, data_dir: Path, harness: Callable[..., Harness]) -> None:
    driver = _driver(driver_name, data_dir)
    callers = Callers(driver)
    hibernate = driver_name == "gvisor"
    h = harness(driver, WarmPolicy(keep_warm_seconds=30, hibernate_after=1.0 if hibernate else None))
    servers = _servers(h)
    h.result("warm.state", tenant="acme")          # a template restore (gvisor) or a cold boot
    h.result("warm.state", tenant="acme")          # kept warm
    if hibernate:
        wait_until(lambda: h.executor.warm.idle_count() == 0 and h.executor.store.hibernated(), timeout=60,
                   message="the idle sandbox to hibernate")
        h.result("warm.state", tenant="acme")      # restored from acme's hibernated image
    pooled = harness(driver, WarmPolicy(ready_pool=1))
    pool = pooled.executor.warm.pool
    assert pool is not None
    # the pool fills from the executor's start, before any batch
    wait_until(lambda: pool.ready(_pool_key(pooled)) == 1, timeout=120, message="the ready pool to fill")
    from_pool = _servers(pooled)
    pooled.result("warm.state", tenant="globex")   # from the pool
    servers = servers + from_pool
    origins = [s.origin for s in servers]
    first = "template" if driver_name == "gvisor" else "cold"
    assert origins == [first, "warm", *(["hibernated"] if hibernate else []), "pool"], origins
    for acquired in servers:
        assert isinstance(acquired.api, Sandbox) and acquired.api.handed_over, acquired.origin
    assert callers.seen, "no sandbox was made"
    outside = [(name, module) for name, module in callers.seen if module not in API_MODULES | DRIVER_MODULES]
    assert not outside, f"sandboxes made outside the Sandbox API: {outside}"


def test_the_ready_pool_binds_a_pristine_sandbox_to_a_tenant_only_when_its_batch_takes_it(
        driver_name: str, data_dir: Path, harness: Callable[..., Harness]) -> None:
    h = harness(_driver(driver_name, data_dir), WarmPolicy(ready_pool=1))
    servers = _servers(h)
    key = _pool_key(h)
    pool = h.executor.warm.pool
    assert pool is not None
    wait_until(lambda: pool.ready(key) == 1, timeout=120, message="the ready pool to fill")
    with pool._lock:
        (waiting,) = pool._ready[key]
    meta = json.loads((waiting.host.path / "sandbox.json").read_text())
    assert meta["tenant"] == "" and meta["labels"] == {"pooled": h.executor.warm.template_name}, meta
    state = h.result("warm.state", tenant="globex", env={"TOKEN": "globex-secret"})
    taken = servers[-1]
    assert taken.origin == "pool" and taken.api is waiting
    assert state["env"] == "globex-secret" and state["warmups"] == 1, state
    assert not taken.api.is_running(), "a pooled sandbox is deleted after its one owner's batch"
    # the next batch, of another tenant, never gets that sandbox back
    wait_until(lambda: pool.ready(key) == 1, timeout=120, message="the ready pool to refill")
    h.result("warm.state", tenant="initech")
    assert servers[-1].origin == "pool" and servers[-1].api is not waiting
    ids = [s.api.id for s in servers]
    assert len(set(ids)) == len(ids), ids


@needs_runsc
def test_a_queue_sandbox_is_not_listed_as_an_api_sandbox(data_dir: Path, harness: Callable[..., Harness],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENANTQ_DATA_DIR", str(data_dir))
    h = harness(GVisorDriver(data_dir), WarmPolicy(keep_warm_seconds=30))
    servers = _servers(h)
    h.result("warm.state", tenant="acme")
    assert servers[0].api.is_running() and _meta(servers[0])["tenant"] == "acme"
    assert Sandbox.list() == [], "the queue's sandboxes are the queue's, not the API user's"
