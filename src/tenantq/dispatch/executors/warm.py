"""Where a batch's sandbox comes from, and where it goes afterwards.

Every one of them is a Sandbox API sandbox (sandbox/api.py): made,
restored, checkpointed and deleted by the same code as `Sandbox.create`'s,
its agent then handing the sandbox's init over to the guest runner
(`Sandbox.hand_over`: the agent execs the runner as pid 1 on its own
channel, which is then the batch session's). The app's template is such a
sandbox, booted with no tenant, the runner warm and idle, checkpointed.

`WarmStarts.acquire(tenant)` tries, in order:
1. an idle kept-warm sandbox of this tenant (never another tenant's) made
   from the current template key;
2. this tenant's hibernated image;
3. a pristine sandbox from the ready pool (`--ready-pool N`: restored from
   the template, or booted, ahead of demand; bound to the tenant only now);
4. a restore from the template (built on first use: boot, warm up, checkpoint);
5. a cold boot of the guest runner.
Snapshots (2, 4) need a driver that can checkpoint (gVisor); where they fail
tenantq says so once and goes on with cold boots. The process driver keeps
sandboxes warm (and pooled) but has no snapshots.

`release(server, reusable)` puts a sandbox back for `--keep-warm` seconds,
up to `--max-batches-per-sandbox` batches, or destroys it: a sandbox that saw
an OOM, a timeout or a crash is never reused. A pool thread destroys idle
sandboxes at the keep-warm limit, or hibernates them (checkpoint to disk,
destroy) after `--hibernate-after`, so an idle tenant costs disk, not memory.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from tenantq.dispatch.executors import records
from tenantq.errors import InvalidInput
from tenantq.guest.protocol import FrameError
from tenantq.observe import metrics
from tenantq.sandbox import runner_boot
from tenantq.sandbox.agent_link import SandboxGone
from tenantq.sandbox.api import Sandbox as ApiSandbox
from tenantq.sandbox.channel import ChannelTimeout, GuestGone
from tenantq.sandbox.core import NotSupported
from tenantq.sandbox.driver import DriverSandbox, SandboxDriver, SnapshotDriver, StartedProcess
from tenantq.sandbox.pool import POOLED_TTL_SECONDS, PoolKey, ReadyPool
from tenantq.sandbox.snapshots import SnapshotStore, Template
from tenantq.sandbox.spec import SandboxSpec, SnapshotFailed

log = logging.getLogger("tenantq.sandbox")

Origin = Literal["cold", "template", "hibernated", "warm", "pool"]
READY_TIMEOUT_SECONDS = 120.0
GRACEFUL_EXIT_SECONDS = 2.0


@dataclass(frozen=True)
class WarmPolicy:
    snapshots: bool = True
    keep_warm_seconds: float = 0.0
    max_batches: int = 50
    hibernate_after: float | None = None
    # idle sandboxes kept per worker (each holds memory)
    max_idle: int = 8
    # pristine sandboxes kept ready ahead of demand (the Sandbox API's pool)
    ready_pool: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.ready_pool, bool) or not 0 <= self.ready_pool <= 64:
            raise InvalidInput(f"--ready-pool must be from 0 to 64, got {self.ready_pool}")
        if self.keep_warm_seconds < 0:
            raise InvalidInput(f"--keep-warm must be 0 or more seconds, got {self.keep_warm_seconds:g}")
        if self.max_batches < 1:
            raise InvalidInput(f"--max-batches-per-sandbox must be at least 1, got {self.max_batches}")
        if self.hibernate_after is not None and not 0 < self.hibernate_after < self.keep_warm_seconds:
            raise InvalidInput("--hibernate-after must be more than 0 and less than --keep-warm "
                               f"({self.hibernate_after:g} vs {self.keep_warm_seconds:g})")


@dataclass
class GuestServer:
    """A sandbox whose guest runner waits for batches on its stdin."""

    api: ApiSandbox
    origin: Origin
    key: str
    tenant: str
    # a hibernated image this sandbox was restored from: removed once the
    # restore has surely finished reading it (after the first batch)
    consumed_image: Path | None = None
    batches: int = 0
    idle_since: float = field(default_factory=time.monotonic)
    # a cold-booted runner says ready (or fatal) first; a restored one
    # resumes inside its read of the next command
    needs_ready: bool = False

    @property
    def sandbox(self) -> DriverSandbox:
        """The host's side of it (limits, dirs, TTL, OOM record)."""
        host: DriverSandbox = self.api.host  # type: ignore[assignment]  # a driver's: GVisorSandbox, ProcessSandbox
        return host

    @property
    def running(self) -> StartedProcess:
        """Its init, the runner: the control channel's pipes."""
        return self.api.init_process

    def destroy(self) -> None:
        if self.running.alive():
            # EOF tells an idle guest runner to exit: the cheapest clean end
            self.running.close_stdin()
            self.running.wait(GRACEFUL_EXIT_SECONDS)
        self.api.delete()
        if self.consumed_image is not None:
            shutil.rmtree(self.consumed_image, ignore_errors=True)
            self.consumed_image = None


class WarmStarts:
    def __init__(self, driver: SandboxDriver, policy: WarmPolicy, store: SnapshotStore, *,
                 argv: list[str], key: Callable[[SandboxSpec], str], app: str) -> None:
        self.driver = driver
        self.policy = policy
        self.store = store
        self.argv = argv
        self.key_of = key
        self.app = app
        self.template_name = f"app:{app}"
        self._idle: list[GuestServer] = []
        self._lock = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.snapshots = policy.snapshots and driver.snapshots and isinstance(driver, SnapshotDriver)
        self.hibernation = self.snapshots and policy.hibernate_after is not None
        self.pool = ReadyPool(policy.ready_pool) if policy.ready_pool > 0 else None
        self._pooling: PoolKey | None = None  # the kind the pool keeps ready now
        if policy.snapshots and not driver.snapshots:
            log.warning("sandbox %s cannot checkpoint/restore: no templates, every sandbox boots cold%s",
                        driver.name, " (kept warm between batches)" if policy.keep_warm_seconds else "")
        if policy.hibernate_after is not None and not self.hibernation:
            log.warning("--hibernate-after needs snapshots (gvisor): idle sandboxes are destroyed instead")

    # -- getting a sandbox ---------------------------------------------------
    def acquire(self, spec: SandboxSpec) -> GuestServer:
        key = self.key_of(spec)
        with self._lock:
            for server in self._idle:
                if server.tenant == spec.tenant and server.key == key:
                    self._idle.remove(server)
                    if server.running.alive():
                        server.origin = "warm"
                        return self._count(server)
                    server.destroy()
                    break
        if self.hibernation:
            image = self.store.take_hibernated(spec.tenant, key)
            if image is not None:
                try:
                    return self._count(self._restore(spec, image / "image", "hibernated", key, image))
                except (SnapshotFailed, OSError, SandboxGone) as exc:
                    log.warning("could not restore hibernated sandbox of %s: %s", spec.tenant, exc)
                    shutil.rmtree(image, ignore_errors=True)
        if self.pool is not None:
            pooled = self.pool.take(self._pooled_kind(spec, key), lambda: self._pristine(spec, key))
            if pooled is not None:
                assert isinstance(pooled, ApiSandbox)  # what _pristine made
                # nothing of a tenant was in it: now it is this one's, for good
                pooled.assign(tenant=spec.tenant, labels=spec.labels, ttl=spec.ttl_seconds)
                return self._count(GuestServer(pooled, "pool", key, spec.tenant))
        return self._count(self._fresh(spec, key))

    def fill_pool(self, spec: SandboxSpec) -> None:
        """Have the ready pool of sandboxes like `spec` filled from now on
        (the executor's start), not only after the first batch."""
        if self.pool is not None:
            key = self.key_of(spec)
            self.pool.fill(self._pooled_kind(spec, key), lambda: self._pristine(spec, key))

    def _fresh(self, spec: SandboxSpec, key: str) -> GuestServer:
        """Restored from the template where snapshots work, else booted."""
        if self.snapshots:
            template = self.template(spec, key)
            if template is not None:
                self.store.touch(template)
                return self._restore(spec, template.image, "template", key)
        sandbox = runner_boot.boot_for_runner(self.driver, spec, self.template_name)
        try:
            sandbox.hand_over(self.argv)
        except BaseException:
            sandbox.delete()
            raise
        return GuestServer(sandbox, "cold", key, spec.tenant, needs_ready=True)

    def _pool_key(self, spec: SandboxSpec, key: str) -> PoolKey:
        return (f"{self.template_name}@{key}", self.driver.name, spec.memory_mb, spec.cpus)

    def _pooled_kind(self, spec: SandboxSpec, key: str) -> PoolKey:
        """The pool's kind for this spec; a new template key (the app was
        edited) retires the old kind's waiting sandboxes."""
        kind = self._pool_key(spec, key)
        assert self.pool is not None
        if self._pooling is not None and self._pooling != kind:
            self.pool.forget(self._pooling)
        self._pooling = kind
        return kind

    def _pristine(self, like: SandboxSpec, key: str) -> ApiSandbox:
        """A sandbox for the ready pool: no tenant, the pool's own TTL, its
        runner booted (its ready frame read here) or restored."""
        spec = replace(like, tenant="", labels={"pooled": self.template_name}, ttl_seconds=POOLED_TTL_SECONDS)
        server = self._fresh(spec, key)
        if server.needs_ready:
            try:
                self._await_ready(server.running)
            except BaseException:
                server.destroy()
                raise
        return server.api

    def _count(self, server: GuestServer) -> GuestServer:
        metrics.SANDBOX_STARTS.labels(self.driver.name, server.origin).inc()
        return server

    def _restore(self, spec: SandboxSpec, image: Path, origin: Origin, key: str,
                 consumed: Path | None = None) -> GuestServer:
        try:
            sandbox = runner_boot.restore_runner(self.driver, spec, image, self.template_name)
        except NotSupported as exc:
            raise SnapshotFailed(str(exc)) from None
        return GuestServer(sandbox, origin, key, spec.tenant, consumed_image=consumed)

    def template(self, spec: SandboxSpec, key: str | None = None) -> Template | None:
        """The template for this spec's key, built if missing; None (said
        once) where snapshots do not work."""
        key = key or self.key_of(spec)
        meta = {"app": self.app, "memory_mb": spec.memory_mb, "cpus": spec.cpus, "max_pids": spec.max_pids}
        try:
            return self.store.get_or_build(key, meta, lambda image: self._build(spec, key, image))
        except (SnapshotFailed, OSError, SandboxGone) as exc:
            self.disable_snapshots(f"building the template failed: {exc}")
            return None

    def _build(self, spec: SandboxSpec, key: str, image: Path) -> None:
        """Boot the guest runner, wait until it is warm and idle, checkpoint it."""
        started = time.monotonic()
        build_spec = replace(spec, tenant="template", labels={"template": key})
        sandbox = runner_boot.boot_for_runner(self.driver, build_spec, self.template_name)
        try:
            self._await_ready(sandbox.hand_over(self.argv))
            sandbox.checkpoint_and_stop(image)
        finally:
            sandbox.delete()
        log.info("built template %s for %s in %.2f s", key, self.app, time.monotonic() - started)

    @staticmethod
    def _await_ready(running: StartedProcess) -> None:
        try:
            fatal = records.boot(running.channel.receive(time.monotonic() + READY_TIMEOUT_SECONDS))
        except (GuestGone, ChannelTimeout, FrameError, records.ProtocolViolation) as exc:
            raise SnapshotFailed(f"the guest runner was not ready ({exc}): "
                                 f"{running.stderr().strip()[-500:]}") from None
        if fatal is not None:
            raise SnapshotFailed(f"the guest runner could not boot: {fatal[-500:]}")

    def disable_snapshots(self, reason: str) -> None:
        if self.snapshots:
            log.warning("sandbox snapshots off for this worker: %s; using cold starts", reason)
        self.snapshots = False
        self.hibernation = False

    # -- giving it back ------------------------------------------------------
    def release(self, server: GuestServer, *, reusable: bool) -> None:
        server.batches += 1
        if server.consumed_image is not None:
            shutil.rmtree(server.consumed_image, ignore_errors=True)
            server.consumed_image = None
        keep = (reusable and self.policy.keep_warm_seconds > 0 and server.batches < self.policy.max_batches
                and server.running.alive())
        if not keep:
            server.destroy()
            return
        server.idle_since = time.monotonic()
        server.sandbox.extend_deadline(self.policy.keep_warm_seconds + 30)
        evicted: list[GuestServer] = []
        with self._lock:
            if self._closed:
                evicted.append(server)
            else:
                self._idle.append(server)
                while len(self._idle) > self.policy.max_idle:
                    evicted.append(self._idle.pop(0))
                self._ensure_thread()
                self._lock.notify_all()
        for old in evicted:
            old.destroy()

    def idle_count(self) -> int:
        with self._lock:
            return len(self._idle)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._expire_loop, name="tenantq-warm-pool", daemon=True)
            self._thread.start()

    def _expire_loop(self) -> None:
        limit = self.policy.hibernate_after if self.hibernation else None
        keep = self.policy.keep_warm_seconds
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                due = [s for s in self._idle
                       if now - s.idle_since >= (limit if limit is not None else keep)]
                for s in due:
                    self._idle.remove(s)
                if not due:
                    wait = min((s.idle_since + (limit or keep) - now for s in self._idle), default=None)
                    self._lock.wait(timeout=wait)
                    continue
            for server in due:
                if limit is not None and self.hibernation:
                    self._hibernate(server)
                else:
                    server.destroy()

    def _hibernate(self, server: GuestServer) -> None:
        staging = self.store.hibernate_dir(server.tenant, server.key)
        try:
            server.api.checkpoint_and_stop(staging / "image")
            self.store.commit_hibernated(staging, {"tenant": server.tenant, "key": server.key,
                                                   "batches": server.batches})
            metrics.SANDBOX_HIBERNATED.labels(self.driver.name).inc()
            log.info("hibernated the idle sandbox of %s", server.tenant)
        except (SnapshotFailed, OSError, NotSupported) as exc:
            shutil.rmtree(staging, ignore_errors=True)
            self.hibernation = False
            log.warning("hibernation off for this worker: %s; idle sandboxes are destroyed", exc)
        finally:
            server.destroy()

    def close(self) -> None:
        """Destroy every idle sandbox (the worker stops)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._lock.notify_all()
        for server in idle:
            server.destroy()
        if self.pool is not None:
            self.pool.close()
        if self._thread is not None:
            self._thread.join(timeout=60)
