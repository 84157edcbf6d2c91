"""Building a worker: the executor its batches run on, and the `Worker`
around it. One place for `tenantq worker` (cli/worker.py), `tenantq
template build` (the executor alone), `tenantq.testing.drain()` and the demo.

Heavy modules (the executors, the drivers) are imported when called, so
importing this module costs nothing a command line does not need."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tenantq.errors import InvalidInput
from tenantq.settings import DEFAULT_WORKER_WORK_MB

if TYPE_CHECKING:
    from tenantq.dispatch.config import WorkerConfig
    from tenantq.dispatch.executors.contract import BatchExecutor
    from tenantq.dispatch.executors.warm import WarmPolicy
    from tenantq.dispatch.worker import Worker
    from tenantq.egress.config import EgressConfig
    from tenantq.observe.alerts import DeadLetterAlerts
    from tenantq.registry import Registry
    from tenantq.sandbox.driver import SandboxDriver
    from tenantq.secrets import SecretsProvider
    from tenantq.store.db import Database
    from tenantq.tenant_data import AppDatabase

log = logging.getLogger("tenantq.worker")


def build_executor(
    app: str | None = None,
    sandbox: str | SandboxDriver = "inline",
    *,
    registry: Registry | None = None,
    policy: WarmPolicy | None = None,
    secrets: SecretsProvider | None = None,
    work_mb: int = DEFAULT_WORKER_WORK_MB,
    app_db: AppDatabase | None = None,
    sandbox_paths: Sequence[str] = (),
    egress: EgressConfig | None = None,
) -> BatchExecutor:
    """The executor batches run on: `sandbox` is "inline" (in this
    process), a driver name ("auto", "gvisor", "process") or a driver.

    `app` (the module that registers the handlers; see `registry.load_app`
    for the forms it takes) is imported here, so a broken or empty app
    fails before anything connects or starts; so does an app whose
    sandboxes would see a settings or key file (rule M1). A sandboxed
    executor needs it (its sandboxes import it); an inline one runs the
    kinds of `registry` (default: the global REGISTRY) with or without it."""
    from tenantq.registry import REGISTRY, load_app

    module = load_app(app) if app is not None else None
    handlers = registry if registry is not None else REGISTRY
    if isinstance(sandbox, str) and sandbox == "inline":
        from tenantq.dispatch.executors.inline import InlineExecutor

        return InlineExecutor(handlers, app_db=app_db)
    if module is None:
        raise InvalidInput("a sandboxed worker needs the app module its sandboxes import (--app MODULE)")
    from tenantq.dispatch.executors.sandboxed import SandboxExecutor

    if isinstance(sandbox, str):
        from tenantq.sandbox.drivers import get_driver
        from tenantq.settings import Settings

        driver, chosen = get_driver(sandbox, Settings().data_dir)
        log.info("%s", chosen)
    else:
        driver = sandbox
    return SandboxExecutor(driver, handlers, module, policy=policy, secrets=secrets, work_mb=work_mb,
                           app_db=app_db, sandbox_paths=sandbox_paths, egress=egress)


def build_worker(
    db: Database,
    *,
    app: str | None = None,
    sandbox: str | SandboxDriver = "inline",
    config: WorkerConfig | None = None,
    registry: Registry | None = None,
    policy: WarmPolicy | None = None,
    secrets: SecretsProvider | None = None,
    work_mb: int = DEFAULT_WORKER_WORK_MB,
    app_db: AppDatabase | None = None,
    sandbox_paths: Sequence[str] = (),
    egress: EgressConfig | None = None,
    alerts: DeadLetterAlerts | None = None,
) -> Worker:
    """A `Worker` on `db` with the executor `build_executor` makes of the
    same arguments; `secrets` go to both (the sandboxes' environment and
    the egress proxy's injected keys). `app_db` is not opened or closed
    here: its owner does that."""
    from tenantq.dispatch.worker import Worker

    executor = build_executor(app, sandbox, registry=registry, policy=policy, secrets=secrets,
                              work_mb=work_mb, app_db=app_db, sandbox_paths=sandbox_paths, egress=egress)
    return Worker(db, executor, config, secrets=secrets.for_tenant if secrets is not None else None,
                  alerts=alerts)
