"""`tenantq template`: the Sandbox API's templates (create, list, rm by
name; sandbox/templates.py) and the queue's checkpoint images (build, and
list/rm by key; sandbox/snapshots.py)."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import click

from tenantq.cli._common import APP_HELP
from tenantq.errors import InvalidInput

if TYPE_CHECKING:
    from tenantq.sandbox.snapshots import SnapshotStore

SNAPSHOT_DRIVERS = ("gvisor",)


def _data_dir() -> Path:
    from tenantq.settings import Settings

    return Settings().data_dir


def _stores() -> list[SnapshotStore]:
    from tenantq.sandbox.snapshots import SnapshotStore

    return [SnapshotStore(_data_dir(), name) for name in SNAPSHOT_DRIVERS]


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


@click.group()
def template() -> None:
    """Sandbox templates: what Sandbox.create(template=NAME) starts from, and the
    queue's checkpoints (the app booted, warmed up and checkpointed)."""


@template.command("create")
@click.argument("name")
@click.option("--python-requirements", "requirements", type=click.Path(dir_okay=False, path_type=Path),
              help="A pip requirements file, installed (wheels only) into the template's read-only layer.")
@click.option("--warmup", metavar="MODULE:FUNCTION",
              help="Run once in a sandbox of the template before its checkpoint (on gVisor; elsewhere in "
                   "every new sandbox): what it writes or leaves running is in every sandbox made from it.")
@click.option("--from", "base", default="base", show_default=True, help="The template this one builds on.")
@click.option("--sandbox", type=click.Choice(["auto", "gvisor", "process"]), default="auto",
              show_default=True)
@click.option("--sandbox-path", "sandbox_paths", multiple=True, metavar="PATH",
              help="A file or directory under the warmup's project copied into the layer too (data, "
                   "modules imported by computed names); only the modules the warmup imports are copied "
                   "otherwise (docs/security.md, rule M1). Repeatable.")
def template_create(name: str, requirements: Path | None, warmup: str | None, base: str,
                    sandbox: str, sandbox_paths: tuple[str, ...]) -> None:
    """Make (or rebuild) the Sandbox API template NAME: its layer now, and on
    gVisor its checkpoint. Running it again with the same inputs changes nothing."""
    from tenantq.sandbox import templates
    from tenantq.sandbox.api import prepare_template
    from tenantq.sandbox.drivers import get_driver

    text = ""
    if requirements is not None:
        try:
            text = requirements.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidInput(f"cannot read --python-requirements {requirements}: {exc}") from None
    started = time.monotonic()
    templates.check_name(name)  # before any path is made of it
    chosen, _ = get_driver(sandbox, _data_dir())
    existed = (templates.templates_dir(_data_dir()) / name / "template.json").exists()
    resolved, changed = templates.create(_data_dir(), name, base=base, requirements=text, warmup=warmup,
                                         sandbox_paths=sandbox_paths)
    try:
        done = prepare_template(chosen, resolved)
    except InvalidInput:
        if not existed:  # a new template whose warmup fails is not kept
            templates.remove(_data_dir(), name)
        raise
    layer = sum(_size(p) for p in resolved.layers) / 1e6
    click.echo(f"template {name} {'built' if changed else 'is up to date'}: layer {layer:.1f} MB, {done} "
               f"({time.monotonic() - started:.1f} s)")


@template.command("build")
@click.option("--app", "app", required=True, metavar="MODULE", help=APP_HELP)
@click.option("--sandbox", type=click.Choice(["auto", "gvisor"]), default="auto", show_default=True)
def template_build(app: str, sandbox: str) -> None:
    """Build the queue app's checkpoint now (workers otherwise build it on first use)."""
    from tenantq.dispatch.build import build_executor
    from tenantq.dispatch.executors.sandboxed import SandboxExecutor
    from tenantq.dispatch.executors.warm import WarmPolicy

    executor = build_executor(app, "gvisor" if sandbox == "auto" else sandbox, policy=WarmPolicy())
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


def _named_rows() -> list[dict[str, object]]:
    from tenantq.sandbox import templates

    rows: list[dict[str, object]] = []
    for d in templates.definitions(_data_dir()):
        layers = sorted((templates.templates_dir(_data_dir()) / d.name).glob("layer-*"))
        packages = [line.strip() for line in d.requirements.splitlines() if line.strip()
                    and not line.strip().startswith("#")]
        rows.append({"kind": "built-in" if d.builtin else "custom", "name": d.name, "from": d.base,
                     "packages": packages, "warmup": d.warmup,
                     "built": bool(layers) or not (packages or d.warmup),
                     "created": _when(d.created), "size_mb": round(sum(_size(p) for p in layers) / 1e6, 1)})
    return rows


def _image_rows() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for store in _stores():
        for t in store.templates():
            rows.append({"kind": "checkpoint", "key": t.key, "of": t.meta.get("app"), "driver": store.driver,
                         "created": _when(float(t.meta.get("created", 0))), "last_used": _when(t.last_used),
                         "size_mb": round(t.size_bytes() / 1e6, 1)})
        for tenant, path in store.hibernated():
            meta = json.loads((path / "meta.json").read_text()) if (path / "meta.json").exists() else {}
            rows.append({"kind": "hibernated", "key": meta.get("key"), "of": f"tenant {tenant}",
                         "driver": store.driver, "created": _when(float(meta.get("hibernated", 0))),
                         "last_used": "-", "size_mb": round(_size(path) / 1e6, 1)})
    return rows


@template.command("list")
@click.option("--json", "as_json", is_flag=True)
def template_list(as_json: bool) -> None:
    """The templates by name (built-in and custom), then the checkpoints and
    hibernated sandboxes on this host."""
    named, images = _named_rows(), _image_rows()
    if as_json:
        click.echo(json.dumps({"templates": named, "checkpoints": images}, indent=2))
        return
    from tenantq.render import console
    from tenantq.render import table as make_table

    table = make_table("name", "kind", "from", "packages", "warmup", "built", "MB", right=("MB",))
    for r in named:
        packages = list(r["packages"])  # type: ignore[call-overload]
        table.add_row(str(r["name"]), str(r["kind"]), str(r["from"] or "-"),
                      ", ".join(packages) if packages else "-", str(r["warmup"] or "-"),
                      "yes" if r["built"] else "on first use", f"{r['size_mb']:.1f}")
    console.print(table)
    if not images:
        click.echo("no checkpoints")
        return
    table = make_table("kind", "key", "of", "driver", "created (UTC)", "last used", "MB", right=("MB",))
    for r in images:
        table.add_row(str(r["kind"]), str(r["key"]), str(r["of"]), str(r["driver"]), str(r["created"]),
                      str(r["last_used"]), f"{r['size_mb']:.1f}")
    console.print(table)


@template.command("rm")
@click.argument("names", nargs=-1)
@click.option("--all", "remove_all", is_flag=True, help="Every checkpoint and hibernated sandbox.")
def template_rm(names: tuple[str, ...], remove_all: bool) -> None:
    """Remove templates by name (with their checkpoints; a built-in's layer is
    rebuilt on next use) or checkpoints by key (rebuilt when next needed)."""
    import shutil

    from tenantq.sandbox import templates

    if not names and not remove_all:
        raise InvalidInput("name the templates or checkpoint keys to remove, or use --all")
    stores = _stores()
    keys = {t.key for s in stores for t in s.templates()}
    defined = {d.name for d in templates.definitions(_data_dir())}
    missing = [n for n in names if n not in keys and n not in defined]
    if missing:
        raise InvalidInput(f"no template or checkpoint {missing[0]!r} (see tenantq template list)")
    if "base" in names:
        raise InvalidInput("'base' is built in and cannot be removed (its checkpoints can, by key)")
    removed = 0
    for name in names:
        if name in defined:
            removed += templates.remove(_data_dir(), name)
    for store in stores:
        for t in store.templates():
            if remove_all or t.key in names or t.meta.get("template") in names:
                removed += store.remove(t.key)
        if remove_all:
            for _, path in store.hibernated():
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
    click.echo(f"removed {removed} template(s) and checkpoint(s)")
