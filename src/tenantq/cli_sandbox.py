"""The sandbox side of the command line: choosing the executor for a worker,
and `tenantq template build|list|rm`."""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import click

from tenantq.errors import InvalidInput

if TYPE_CHECKING:  # imported where used: `tenantq --help` or `status` need none of them
    from tenantq.sandbox.executor import BatchExecutor
    from tenantq.sandbox.snapshots import SnapshotStore
    from tenantq.sandbox.warm import WarmPolicy
    from tenantq.secrets import SecretsProvider

SNAPSHOT_DRIVERS = ("gvisor",)

APP_HELP = ("Module that registers the handlers: a dotted module importable from the current directory "
            "(put on sys.path) or PYTHONPATH, e.g. myapp.jobs for ./myapp/jobs.py; a file path or "
            "module:attr is accepted too.")


def make_executor(app: str, sandbox: str, policy: WarmPolicy,
                  secrets: SecretsProvider | None = None, *, work_mb: int = 128) -> BatchExecutor:
    """The executor `tenantq worker --app APP --sandbox NAME` runs batches on.

    APP is imported here (see `load_app` for the forms it takes), so a broken
    or empty app fails before anything connects or starts."""
    from tenantq.registry import REGISTRY, load_app
    from tenantq.sandbox.batch import SandboxExecutor
    from tenantq.sandbox.driver import get_driver
    from tenantq.sandbox.inline import InlineExecutor
    from tenantq.settings import Settings

    module = load_app(app)
    log = logging.getLogger("tenantq.worker")
    if sandbox == "inline":
        log.warning("--sandbox inline: every kind runs inside this process; use it for trusted code only")
        return InlineExecutor(REGISTRY)
    driver, chosen = get_driver(sandbox, Settings().data_dir)
    log.info("%s", chosen)
    return SandboxExecutor(driver, REGISTRY, module, policy=policy, secrets=secrets, work_mb=work_mb)


def _stores() -> list[SnapshotStore]:
    from tenantq.sandbox.snapshots import SnapshotStore
    from tenantq.settings import Settings

    return [SnapshotStore(Settings().data_dir, name) for name in SNAPSHOT_DRIVERS]


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


@click.group()
def template() -> None:
    """Warm sandbox templates: the app booted, warmed up and checkpointed."""


@template.command("build")
@click.option("--app", "app", required=True, metavar="MODULE", help=APP_HELP)
@click.option("--sandbox", type=click.Choice(["auto", "gvisor"]), default="auto", show_default=True)
def template_build(app: str, sandbox: str) -> None:
    """Build the app's template now (workers otherwise build it on first use)."""
    from tenantq.sandbox.batch import SandboxExecutor
    from tenantq.sandbox.warm import WarmPolicy

    executor = make_executor(app, "gvisor" if sandbox == "auto" else sandbox, WarmPolicy())
    assert isinstance(executor, SandboxExecutor)
    spec = executor.spec("template", 60)
    key = executor.template_key(spec)
    existed = executor.store.template(key) is not None
    started = time.monotonic()
    built = executor.warm.template(spec, key)
    if built is None:
        raise InvalidInput(f"could not build a template for {app} with {executor.name} (see the log above)")
    size = built.size_bytes() / 1e6
    if existed:
        click.echo(f"template {key} for {app} ({executor.name}) is up to date ({size:.1f} MB)")
    else:
        click.echo(f"built template {key} for {app} ({executor.name}) in "
                   f"{time.monotonic() - started:.2f} s ({size:.1f} MB)")


@template.command("list")
@click.option("--json", "as_json", is_flag=True)
def template_list(as_json: bool) -> None:
    """Templates and hibernated sandboxes on this host."""
    rows: list[dict[str, object]] = []
    for store in _stores():
        for t in store.templates():
            rows.append({"kind": "template", "key": t.key, "app": t.meta.get("app"), "driver": store.driver,
                         "created": _when(float(t.meta.get("created", 0))), "last_used": _when(t.last_used),
                         "size_mb": round(t.size_bytes() / 1e6, 1), "tenant": None})
        for tenant, path in store.hibernated():
            meta = json.loads((path / "meta.json").read_text()) if (path / "meta.json").exists() else {}
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            rows.append({"kind": "hibernated", "key": meta.get("key"), "app": None, "driver": store.driver,
                         "created": _when(float(meta.get("hibernated", 0))), "last_used": "-",
                         "size_mb": round(size / 1e6, 1), "tenant": tenant})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no templates")
        return
    from tenantq.render import console
    from tenantq.render import table as make_table

    table = make_table("kind", "key", "app / tenant", "driver", "created (UTC)", "last used", "MB",
                       right=("MB",))
    for r in rows:
        table.add_row(str(r["kind"]), str(r["key"]), str(r["app"] or r["tenant"]), str(r["driver"]),
                      str(r["created"]), str(r["last_used"]), f"{r['size_mb']:.1f}")
    console.print(table)


@template.command("rm")
@click.argument("keys", nargs=-1)
@click.option("--all", "remove_all", is_flag=True, help="Every template and hibernated sandbox.")
def template_rm(keys: tuple[str, ...], remove_all: bool) -> None:
    """Remove templates by key (workers rebuild what they need)."""
    import shutil

    if not keys and not remove_all:
        raise InvalidInput("name the template keys to remove, or use --all")
    stores = _stores()
    known = {t.key for s in stores for t in s.templates()}
    missing = [k for k in keys if k not in known]
    if missing:
        raise InvalidInput(f"no template {missing[0]!r} (see tenantq template list)")
    removed = 0
    for store in stores:
        for t in store.templates():
            if remove_all or t.key in keys:
                removed += store.remove(t.key)
        if remove_all:
            for _, path in store.hibernated():
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
    click.echo(f"removed {removed} snapshot(s)")
