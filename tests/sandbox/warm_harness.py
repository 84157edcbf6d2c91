"""A SandboxExecutor driven batch by batch (tests/sandbox/test_warm.py,
test_one_path.py; the `harness` fixture is in conftest.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from tenantq.dispatch.executors.contract import JobEnded, JobStarted
from tenantq.dispatch.executors.sandboxed import SandboxExecutor
from tenantq.dispatch.executors.warm import GuestServer, WarmPolicy
from tenantq.domain.records import Batch, ClaimedJob
from tenantq.registry import REGISTRY, Registry
from tenantq.sandbox.driver import SandboxDriver

WARM_APP = "tests.apps.warm"


class Harness:
    """A SandboxExecutor driven batch by batch, recording where each batch's
    sandbox came from (a test signal, instead of timing guesses)."""

    def __init__(self, driver: SandboxDriver, policy: WarmPolicy, app: str = WARM_APP,
                 registry: Registry = REGISTRY) -> None:
        self.executor = SandboxExecutor(driver, registry, app, policy=policy)
        self.origins: list[tuple[str, str]] = []  # (sandbox id, origin) per batch
        self.next_id = 1
        acquire = self.executor.warm.acquire

        def recording_acquire(spec: Any) -> GuestServer:
            server = acquire(spec)
            self.origins.append((server.sandbox.id, server.origin))
            return server

        self.executor.warm.acquire = recording_acquire  # type: ignore[method-assign]

    def run(self, *kinds: str, tenant: str = "acme", env: dict[str, str] | None = None,
            payload: Any = None) -> list[JobEnded]:
        jobs = []
        for kind in kinds:
            jobs.append(ClaimedJob(self.next_id, tenant, kind, payload, 1, 3))
            self.next_id += 1
        batch = Batch(self.next_id, tenant, "default", datetime.now(UTC), tuple(jobs))
        ended: list[JobEnded] = []

        def report(event: JobStarted | JobEnded) -> None:
            if isinstance(event, JobEnded):
                ended.append(event)

        self.executor.run(batch, env=env or {}, report=report, should_stop=lambda: False)
        return ended

    def result(self, *kinds: str, **kw: Any) -> Any:
        ended = self.run(*kinds, **kw)
        assert ended and ended[-1].ok, ended
        return ended[-1].result
