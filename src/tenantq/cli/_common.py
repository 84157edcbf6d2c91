"""What the commands share: the Queue they open, JSON output, the job
filters, options whose defaults are settings, the deprecation line, and
the error handling that makes bad input one line on stderr (`run`).

Imported by every command module, so it imports nothing heavy: the queue,
the store and the settings are imported when a command runs."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import click

from tenantq.errors import InvalidInput, TenantqError

if TYPE_CHECKING:
    from tenantq.queue import Queue
    from tenantq.store.search import JobFilter

F = TypeVar("F", bound=Callable[..., Any])

# store/search.py's STATUSES, DEFAULT_LIMIT and MAX_LIMIT, for help texts
# (tests/unit/test_cli_layout.py checks they agree; importing the store
# here would load psycopg for `tenantq --help`)
JOB_STATUSES = ("pending", "running", "done", "dead", "cancelled")
DEFAULT_LIMIT = 50
MAX_LIMIT = 1000

APP_HELP = ("Module that registers the handlers: a dotted module importable from the current directory "
            "(put on sys.path) or PYTHONPATH, e.g. myapp.jobs for ./myapp/jobs.py; a file path or "
            "module:attr is accepted too.")


def queue() -> Queue:
    """A Queue on the configured database (TENANTQ_DATABASE_URL, or the embedded Postgres)."""
    from tenantq.queue import Queue

    return Queue()


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, default=str, indent=2))


def utc_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row for --json: its times as ISO 8601 in UTC."""
    return {k: v.astimezone(UTC).isoformat() if isinstance(v, datetime) else v for k, v in row.items()}


def deprecated(old: str, new: str) -> None:
    """The one line a deprecated spelling prints before it does what `new` does."""
    click.echo(f"tenantq: '{old}' is deprecated; use '{new}'", err=True)


# -- the job filters: `tenantq jobs`, bulk `cancel`, bulk `dead retry` ----------

FILTERS = ("tenant", "kind", "status", "actor", "meta", "since")


def filter_options(*names: str) -> Callable[[F], F]:
    """The filters `names` (of FILTERS), the same options on every command that takes them."""
    every = {
        "tenant": click.option("--tenant", default=None, help="Only this tenant's jobs."),
        "kind": click.option("--kind", default=None, help="Only jobs of this kind (handler name)."),
        "status": click.option("--status", default=None, metavar="STATUS",
                               help=f"Only jobs in this state: {' | '.join(JOB_STATUSES)}."),
        "actor": click.option("--actor", default=None,
                              help="Only jobs enqueued for this actor (enqueue --actor)."),
        "meta": click.option("--meta", "meta", multiple=True, metavar="KEY=VALUE",
                             help="Only jobs whose meta has KEY=VALUE (repeatable: all must match), "
                                  "or whose meta contains this JSON object."),
        "since": click.option("--since", default=None, metavar="AGE",
                              help="Only jobs created in the last AGE: 30s, 15m, 1h, 7d, 2w."),
    }

    def decorate(fn: F) -> F:
        for name in reversed(names or FILTERS):
            fn = every[name](fn)
        return fn

    return decorate


def job_filter(filters: dict[str, Any]) -> JobFilter:
    """The filters given, validated (InvalidInput, one line, for a bad one)."""
    from tenantq.store import search

    return search.job_filter(**{k: (list(v) or None) if k == "meta" else v for k, v in filters.items()})


def filter_kwargs(checked: JobFilter) -> dict[str, Any]:
    """A validated filter as keyword arguments of the Queue's bulk operations."""
    return {"tenant": checked.tenant, "kind": checked.kind, "actor": checked.actor, "meta": checked.meta,
            "since": checked.since_seconds, "priority": checked.priority}


def filter_scope(checked: JobFilter) -> str:
    """What a bulk command acted on, in words: `tenant acme, kind reports.render`."""
    parts = [(name, getattr(checked, name)) for name in ("tenant", "kind", "priority", "actor")]
    words = [f"{name} {value}" for name, value in parts if value is not None]
    if checked.meta:
        words.append(f"meta {json.dumps(checked.meta, sort_keys=True)}")
    if checked.since_seconds is not None:
        words.append(f"since {checked.since_seconds:g} s ago")
    return ", ".join(words) or "every tenant"


# -- options whose default is a setting ---------------------------------------


class SettingOption(click.Option):
    """An option whose default is a TENANTQ_* setting (settings.py), read
    when the command runs; its help shows the setting's own default and
    its variable. `setting` is the Settings field."""

    def __init__(self, *args: Any, setting: str, **kwargs: Any) -> None:
        self.setting = setting

        def from_settings() -> Any:
            from tenantq.settings import Settings

            return getattr(Settings(), setting)

        kwargs["default"] = from_settings
        super().__init__(*args, **kwargs)

    def get_help_extra(self, ctx: click.Context) -> Any:
        from tenantq.settings import Settings

        extra = super().get_help_extra(ctx)
        extra["default"] = str(Settings.model_fields[self.setting].default)
        extra["envvars"] = (f"TENANTQ_{self.setting.upper()}",)
        return extra


def setting_option(*decls: str, setting: str, **kwargs: Any) -> Callable[[F], F]:
    return click.option(*decls, cls=SettingOption, setting=setting, **kwargs)


# -- running the command line -------------------------------------------------


def run(group: click.Group) -> None:
    """Run `group` as `tenantq`: a usage mistake, bad input or a TENANTQ_*
    variable that does not parse is one line on stderr and a non-zero exit."""
    try:
        group.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.UsageError as exc:
        click.echo(f"error: {exc.format_message()} (see --help)", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except TenantqError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except Exception as exc:
        pydantic = sys.modules.get("pydantic")
        if pydantic is None or not isinstance(exc, pydantic.ValidationError):
            raise
        click.echo(f"error: {setting_error(exc)}", err=True)  # a TENANTQ_* variable that does not parse
        sys.exit(2)


def setting_error(exc: Any) -> str:
    """A pydantic ValidationError of the settings as `TENANTQ_NAME: message`."""
    errors = exc.errors()
    if not errors:
        return str(exc).strip().splitlines()[0]
    loc = [str(part) for part in errors[0]["loc"]]
    name = loc[0].upper() if loc else "SETTING"
    name = name if name.startswith("TENANTQ_") else f"TENANTQ_{name}"
    message = (str(errors[0]["msg"]).strip().splitlines() or ["invalid"])[0]
    return f"{name}: {message}"


__all__ = ["APP_HELP", "InvalidInput", "deprecated", "emit_json", "queue", "run", "setting_option"]
