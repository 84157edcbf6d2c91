"""The sandbox side of the command line: choosing the executor for a worker
(`tenantq template` is in cli_templates.py)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: `tenantq --help` or `status` need none of them
    from tenantq.dispatch.executors.contract import BatchExecutor
    from tenantq.dispatch.executors.warm import WarmPolicy
    from tenantq.secrets import SecretsProvider
    from tenantq.tenant_data import AppDatabase

APP_HELP = ("Module that registers the handlers: a dotted module importable from the current directory "
            "(put on sys.path) or PYTHONPATH, e.g. myapp.jobs for ./myapp/jobs.py; a file path or "
            "module:attr is accepted too.")


def make_executor(app: str, sandbox: str, policy: WarmPolicy,
                  secrets: SecretsProvider | None = None, *, work_mb: int = 128,
                  app_db: AppDatabase | None = None, sandbox_paths: Sequence[str] = ()) -> BatchExecutor:
    """The executor `tenantq worker --app APP --sandbox NAME` runs batches on.

    APP is imported here (see `load_app` for the forms it takes), so a broken
    or empty app fails before anything connects or starts; so does an app
    whose sandboxes would see a settings or key file (rule M1)."""
    from tenantq.dispatch.executors.inline import InlineExecutor
    from tenantq.dispatch.executors.sandboxed import SandboxExecutor
    from tenantq.registry import REGISTRY, load_app
    from tenantq.sandbox.drivers import get_driver
    from tenantq.settings import Settings

    module = load_app(app)
    log = logging.getLogger("tenantq.worker")
    if sandbox == "inline":
        log.warning("--sandbox inline: every kind runs inside this process; use it for trusted code only")
        return InlineExecutor(REGISTRY, app_db=app_db)
    driver, chosen = get_driver(sandbox, Settings().data_dir)
    log.info("%s", chosen)
    return SandboxExecutor(driver, REGISTRY, module, policy=policy, secrets=secrets, work_mb=work_mb,
                           app_db=app_db, sandbox_paths=sandbox_paths)
