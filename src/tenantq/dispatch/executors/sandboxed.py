"""Run a batch in a sandbox of its tenant and report each job as it goes.

The batch gets a sandbox from `WarmStarts` (kept warm, hibernated, restored
from the app's template, or booted cold), then `BatchSession` hands its jobs
to the guest runner over the control channel one at a time, reporting every
job's start and end at once. When the sandbox dies, the job the host had
handed out fails with the classified reason (`oom: exceeded 256 MiB`,
`timeout after 5 s`, `crashed: SIGSEGV`, ...); jobs never handed out are
left for the dispatcher to release. The sandbox is then kept warm for the
tenant's next batch or destroyed; after an OOM, a timeout, a crash or a
protocol violation it is always destroyed.

Kinds whose handler is registered with isolation="inline" run in the
dispatcher process (trusted first-party code: the shared-fleet path); the
rest of the batch goes to the sandbox.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from tenantq.dispatch.executors.contract import HostCallsUsed, JobEnded, JobStarted, Report
from tenantq.dispatch.executors.egress import EgressProxies
from tenantq.dispatch.executors.host_calls import SOCKET_NAME as HOST_CALLS_SOCKET
from tenantq.dispatch.executors.host_calls import CallServer
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.executors.session import BatchSession
from tenantq.dispatch.executors.warm import GuestServer, WarmPolicy, WarmStarts
from tenantq.domain.records import Batch, ClaimedJob
from tenantq.egress.config import EgressConfig
from tenantq.host_functions import Caller, CallGate
from tenantq.observe import metrics
from tenantq.registry import Registry
from tenantq.sandbox.driver import SandboxDriver
from tenantq.sandbox.layout import AppView, GuestPython, guest_python
from tenantq.sandbox.reaper import collect_host_files
from tenantq.sandbox.snapshots import SnapshotStore, runtime_version, template_key
from tenantq.sandbox.spec import End, ProcessResult, SandboxSpec
from tenantq.secrets import SecretsProvider
from tenantq.tenant_data import AppDatabase

log = logging.getLogger("tenantq.sandbox")

# Memory for the sandbox beyond its largest handler's limit: the guest
# Python and (for gVisor) the sentry. The handler limit itself is RLIMIT_AS
# inside; this cgroup limit is the backstop.
SANDBOX_OVERHEAD_MB = 192
# Host-side budget beyond the sum of handler timeouts: sandbox start-up.
START_ALLOWANCE_SECONDS = 15.0
# a code change is noticed (a new template key) within this long
KEY_RECHECK_SECONDS = 2.0


class SandboxExecutor:
    def __init__(self, driver: SandboxDriver, registry: Registry, app_module: str, *,
                 policy: WarmPolicy | None = None, egress: EgressConfig | None = None,
                 secrets: SecretsProvider | None = None,
                 tmp_mb: int = 64, work_mb: int = 128, max_pids: int = 512, cpus: float = 1.0,
                 app_db: AppDatabase | None = None, sandbox_paths: Sequence[str] = ()) -> None:
        self.driver = driver
        self.name = driver.name
        self.registry = registry
        self.app_module = app_module
        # rule M1: the installation (what the guest needs of it) and the app's
        # import closure, copied; InvalidInput (the worker does not start)
        # when that would put a settings file, a key... in a sandbox
        self.app_view = AppView(guest_python(driver.data_dir), app_module, driver.data_dir, sandbox_paths,
                                recheck=KEY_RECHECK_SECONDS)
        self.guest: GuestPython = self.app_view.current()
        # kinds registered isolation='inline' run here, and only they get ctx.db()
        self.inline = InlineExecutor(registry, app_db=app_db)
        # the session running each job of a live batch, for cancel()
        self._sessions: dict[int, BatchSession] = {}
        self._sessions_lock = threading.Lock()
        self._early_cancels: set[int] = set()
        self.tmp_mb, self.work_mb, self.max_pids, self.cpus = tmp_mb, work_mb, max_pids, cpus
        # code mounted under /tmp (an app or venv in the host's /tmp) has its
        # mount points in the sandbox's /tmp: the runner's clean-up keeps them
        keep_tmp = sorted(m.target for m in self.guest.mounts
                          if Path(m.target).parts[:2] == ("/", "tmp") and len(Path(m.target).parts) > 2)
        boot = {"app": app_module, "sys_path": list(self.guest.sys_path),
                "site_dirs": list(self.guest.site_dirs), "keep_tmp": keep_tmp}
        self.argv = [self.guest.executable, "-I", "-S", str(_runner_path()), json.dumps(boot)]
        self.store = SnapshotStore(driver.data_dir, driver.name)
        runsc = getattr(driver, "runsc", None)
        self.runtime = runtime_version([runsc, "--version"]) if runsc else driver.name
        self.warm = WarmStarts(driver, policy or WarmPolicy(), self.store, argv=self.argv,
                               key=self.template_key, app=app_module)
        # one memory limit for every sandbox of this app: a kept-warm or
        # restored sandbox must fit any batch (RLIMIT_AS still holds each
        # job to its own handler's limit)
        sandboxed = [h.memory_mb for k in registry.kinds()
                     if (h := registry.get(k)) is not None and h.isolation != "inline"]
        self.memory_mb = max(sandboxed, default=256) + SANDBOX_OVERHEAD_MB
        self.egress = EgressProxies(registry, driver.data_dir, egress, secrets)
        self._keys: dict[tuple[object, ...], tuple[float, str]] = {}
        # --ready-pool: pristine sandboxes from the start, before the first batch
        self.warm.fill_pool(self.spec("", 60))

    def template_key(self, spec: SandboxSpec) -> str:
        """The spec's template key, re-derived at most every KEY_RECHECK_SECONDS:
        it stats every file of the app and of tenantq (milliseconds for a
        large app), which every batch would otherwise pay."""
        limits = (spec.memory_mb, spec.cpus, spec.max_pids, spec.tmp_mb, spec.work_mb, spec.mounts)
        now = time.monotonic()
        cached = self._keys.get(limits)
        if cached is not None and now < cached[0]:
            return cached[1]
        key = template_key(self.app_module, self.app_view.current(), spec, self.name, self.runtime)
        self._keys[limits] = (now + KEY_RECHECK_SECONDS, key)
        return key

    def spec(self, tenant: str, ttl: float, labels: dict[str, str] | None = None) -> SandboxSpec:
        return SandboxSpec(tenant=tenant, memory_mb=self.memory_mb, cpus=self.cpus, max_pids=self.max_pids,
                           ttl_seconds=ttl, tmp_mb=self.tmp_mb, work_mb=self.work_mb,
                           mounts=self.app_view.current().mounts, labels=labels or {})

    def run(self, batch: Batch, *, env: Mapping[str, str], report: Report,
            should_stop: Callable[[], bool]) -> None:
        trusted = [j for j in batch.jobs if self._isolation(j) == "inline"]
        boxed = [j for j in batch.jobs if self._isolation(j) != "inline"]
        if trusted:
            self.inline.run(replace(batch, jobs=tuple(trusted)), env=env, report=report,
                            should_stop=should_stop)
        try:
            if boxed and not should_stop():
                self._run_sandboxed(replace(batch, jobs=tuple(boxed)), env, report, should_stop)
        finally:
            with self._sessions_lock:
                self._early_cancels.difference_update(j.id for j in batch.jobs)
            self.inline.forget(j.id for j in batch.jobs)

    def cancel(self, job_id: int) -> None:
        """Stop a job of a running batch (dispatch/cancels.py): through its
        sandbox's session, or the inline executor for an inline kind."""
        with self._sessions_lock:
            session = self._sessions.get(job_id)
            if session is None:
                # its sandbox is still starting (or it is an inline kind)
                self._early_cancels.add(job_id)
        if session is not None:
            session.cancel(job_id)
        else:
            self.inline.cancel(job_id)

    def reap(self) -> list[str]:
        """Sandboxes past their TTL, then unused templates and old hibernated images."""
        gone = self.driver.reap()
        try:
            current = {self.template_key(self.spec("template", 0))}
        except OSError:
            current = set()
        return gone + self.store.gc(current=current) + collect_host_files(self.driver.data_dir,
                                                                           self.app_view.staged())

    def close(self) -> None:
        self.warm.close()
        self.egress.shutdown()

    def _isolation(self, job: ClaimedJob) -> str:
        handler = self.registry.get(job.kind)
        return handler.isolation if handler is not None else "sandbox"

    def _budget(self, jobs: tuple[ClaimedJob, ...]) -> float:
        timeouts = [h.timeout if (h := self.registry.get(j.kind)) else 60.0 for j in jobs]
        return sum(timeouts) + START_ALLOWANCE_SECONDS

    def _run_sandboxed(self, batch: Batch, env: Mapping[str, str], report: Report,
                       should_stop: Callable[[], bool]) -> None:
        budget = self._budget(batch.jobs)
        spec = self.spec(batch.tenant_id, budget + 30, {"batch": str(batch.batch_id)})
        created = time.monotonic()
        server = self.warm.acquire(spec)
        metrics.SANDBOX_CREATE.labels(self.name).observe(time.monotonic() - created)
        reusable = False
        try:
            if server.batches:
                server.sandbox.extend_deadline(spec.ttl_seconds)
            session = BatchSession(server, self.registry, report, getattr(self.driver, "job_uid", None))
            with self._sessions_lock:
                self._sessions.update({job.id: session for job in batch.jobs})
                early = {job.id for job in batch.jobs} & self._early_cancels
                self._early_cancels -= early
            for job_id in early:  # asked to stop while the sandbox was starting
                session.cancel(job_id)
            proxy, guest_env = self.egress.open(server.sandbox, batch, session.running_now, env)
            calls = self._host_calls(server, batch, session.running_now)
            if calls is not None:
                session.on_job_end = calls.job_ended
            try:
                ended = session.run(batch, guest_env, spec.ttl_seconds, budget, should_stop)
            finally:
                if calls is not None:
                    calls.close()
                    if (record := calls.gate.batch_record()) is not None:
                        report(HostCallsUsed(record))
                if proxy is not None:
                    report(self.egress.close(proxy))
            if ended.fatal:
                # the app cannot even be imported in the sandbox: every job
                # of the batch fails (and reaches dead after its attempts)
                # instead of being released into a hot loop
                for job in batch.jobs:
                    report(JobStarted(job.id))
                    report(JobEnded(job.id, ok=False, error=ended.fatal))
            elif not ended.handed_out and not ended.end.ok:
                # the sandbox failed before the host handed out a job: no
                # tenant code ran, so the jobs go back without an attempt
                stderr = ended.result.stderr[-500:] if ended.result else ""
                log.error("sandbox failed before its first job: %s; stderr: %s", ended.end.reason(), stderr)
                if server.origin in ("template", "hibernated") and ended.result is not None:
                    # no job's code ran in this restored sandbox, so its image is
                    # broken: host-observed corruption (rule S1), never the guest's say
                    self._restore_failed(server, ended.result)
            elif not ended.end.ok:
                # the sandbox died under a job: its runner's last words, for the
                # operator (guest text: a bounded tail, escaped by %r)
                stderr = ended.result.stderr[-500:] if ended.result else ""
                log.warning("sandbox %s ended mid-batch: %s; stderr: %r", server.sandbox.id,
                            ended.end.reason(), stderr)
            end = ended.end
            if end.kind == "signal" and end.signal == 9 and server.sandbox.oom_killed():
                end = End("oom", exit_code=end.exit_code,
                          detail=f"exceeded {server.sandbox.spec.memory_mb} MiB")
            metrics.BATCH_OUTCOMES.labels(self.name, metrics.batch_reason(end.kind)).inc()
            reusable = ended.clean and end.ok and not ended.tainted
        finally:
            with self._sessions_lock:
                for job in batch.jobs:
                    self._sessions.pop(job.id, None)
            destroying = time.monotonic()
            self.warm.release(server, reusable=reusable)
            metrics.SANDBOX_DESTROY.labels(self.name).observe(time.monotonic() - destroying)

    def _host_calls(self, server: GuestServer, batch: Batch,
                    running_now: Callable[[], int | None]) -> CallServer | None:
        """The batch's host-function socket, when a handler of its jobs
        declares host functions (rule F1: the caller is the host's record of
        the running job, never the guest's say)."""
        jobs = {j.id: j for j in batch.jobs}
        if not any((h := self.registry.get(j.kind)) is not None and h.host_functions for j in batch.jobs):
            return None

        def current() -> Caller | None:
            job = jobs.get(running_now() or -1)
            return None if job is None else Caller(job.id, job.kind, job.actor)

        gate = CallGate(self.registry, batch.tenant_id, current, database=self.inline.app_db,
                        limits=self.inline.call_limits, allowed=batch.host_functions)
        return CallServer(server.sandbox.egress_dir / HOST_CALLS_SOCKET, gate)

    def _restore_failed(self, server: GuestServer, result: ProcessResult) -> None:
        detail = f"{result.end.reason()}: {result.stderr.strip()[-300:]}"
        if server.origin == "template":
            self.store.remove(server.key)
            self.warm.disable_snapshots(f"a sandbox restored from template {server.key} failed ({detail})")
        else:
            log.warning("a sandbox restored from hibernation failed (%s); cold starts for %s",
                        detail, server.tenant)


def _runner_path() -> Path:
    import tenantq.guest

    return Path(tenantq.guest.__file__).resolve().parent / "runner.py"
