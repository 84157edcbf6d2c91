"""`tenantq jobs`: find jobs by tenant, kind, status, actor, meta and age,
newest first, a page at a time; and the bulk actions on such a filtered
set, `tenantq jobs cancel` (pending jobs) and `tenantq jobs retry-dead`
(dead jobs), as Oban's cancel_all_jobs / retry_all_jobs and Sidekiq's
"Delete All" / "Retry All" on a filtered view.

Bad input (a filter that does not validate) is one line on stderr, a
non-zero exit, and nothing changed."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import click

from tenantq.errors import InvalidInput
from tenantq.store import search

if TYPE_CHECKING:
    from tenantq.queue import Queue

F = TypeVar("F", bound=Callable[..., Any])

FILTERS = ("tenant", "kind", "status", "actor", "meta", "since")


def _filter_options(fn: F) -> F:
    """The filters, the same on `jobs` and on each bulk command."""
    options = [
        click.option("--tenant", default=None, help="Only this tenant's jobs."),
        click.option("--kind", default=None, help="Only jobs of this kind (handler name)."),
        click.option("--status", default=None, metavar="STATUS",
                     help=f"Only jobs in this state: {' | '.join(search.STATUSES)}."),
        click.option("--actor", default=None, help="Only jobs enqueued for this actor (enqueue --actor)."),
        click.option("--meta", "meta", multiple=True, metavar="KEY=VALUE",
                     help="Only jobs whose meta has KEY=VALUE (repeatable: all must match), "
                          "or whose meta contains this JSON object."),
        click.option("--since", default=None, metavar="AGE",
                     help="Only jobs created in the last AGE: 30s, 15m, 1h, 7d, 2w."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _queue() -> Queue:
    from tenantq.queue import Queue

    return Queue()


def _merged(ctx: click.Context, own: dict[str, Any]) -> dict[str, Any]:
    """A bulk command's filters: its own and those given before its name
    (`tenantq jobs --tenant acme cancel`); the same filter twice, with
    different values, is refused."""
    given: dict[str, Any] = (ctx.parent.obj if ctx.parent is not None else None) or {}
    merged: dict[str, Any] = {}
    for name in FILTERS:
        if name == "meta":
            merged[name] = list(given.get("meta") or ()) + list(own.get("meta") or ())
            continue
        first, second = given.get(name), own.get(name)
        if first is not None and second is not None and first != second:
            raise InvalidInput(f"--{name} is given twice ({first!r} and {second!r})")
        merged[name] = second if second is not None else first
    return merged


def _validated(filters: dict[str, Any]) -> search.JobFilter:
    return search.job_filter(**{k: (list(v) or None) if k == "meta" else v for k, v in filters.items()})


def _kwargs(checked: search.JobFilter) -> dict[str, Any]:
    """A validated filter as keyword arguments of the bulk operations."""
    return {"tenant": checked.tenant, "kind": checked.kind, "actor": checked.actor, "meta": checked.meta,
            "since": checked.since_seconds}


def _bulk_filter(ctx: click.Context, own: dict[str, Any], *, status: str, all_: bool) -> search.JobFilter:
    checked = _validated(_merged(ctx, own))
    if checked.status not in (None, status):
        raise InvalidInput(f"--status {checked.status}: `tenantq jobs {ctx.info_name}` acts on {status} "
                           f"jobs only")
    if checked.empty and not all_:
        raise InvalidInput(f"no filter given: add --tenant, --kind, --actor, --meta or --since, or --all "
                           f"for every {status} job of every tenant")
    return checked


def _as_json(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v.astimezone(UTC).isoformat() if isinstance(v, datetime) else v for k, v in row.items()}


@click.group("jobs", invoke_without_command=True)
@_filter_options
@click.option("--limit", type=int, default=None,
              help=f"Jobs per page (1-{search.MAX_LIMIT}; default {search.DEFAULT_LIMIT}).")
@click.option("--before", default=None, metavar="CURSOR",
              help="The next (older) page: the cursor printed with the previous one.")
@click.option("--json", "as_json", is_flag=True, help="A JSON list (the fields of the table, and meta).")
@click.pass_context
def jobs(ctx: click.Context, tenant: str | None, kind: str | None, status: str | None,
         actor: str | None, meta: tuple[str, ...], since: str | None, limit: int | None,
         before: str | None, as_json: bool) -> None:
    """Find jobs, newest first: id, tenant, kind, status, attempts, actor,
    created and the first line of the last error.

    \b
      tenantq jobs --tenant acme --status dead --since 1d
      tenantq jobs --tenant acme --actor user-42 --meta request_id=r-1 --json
      tenantq jobs cancel --tenant acme --kind reports.render
      tenantq jobs retry-dead --tenant acme --since 1h

    When there are older jobs, the cursor of the next page is printed on
    stderr (--before CURSOR)."""
    filters = {"tenant": tenant, "kind": kind, "status": status, "actor": actor, "meta": meta,
               "since": since}
    if ctx.invoked_subcommand is not None:
        if limit is not None or before is not None or as_json:
            raise InvalidInput(f"--limit, --before and --json list jobs; `tenantq jobs "
                               f"{ctx.invoked_subcommand}` does not take them")
        ctx.obj = filters
        return
    checked = _validated(filters)
    with _queue() as q:
        page = q.find_jobs(tenant=checked.tenant, kind=checked.kind, status=checked.status,
                           actor=checked.actor, meta=checked.meta, since=checked.since_seconds,
                           limit=search.DEFAULT_LIMIT if limit is None else limit,
                           before=before)
    if as_json:
        click.echo(json.dumps([_as_json(row) for row in page.jobs], default=str, indent=2))
    else:
        from tenantq.render import jobs_table

        jobs_table(page.jobs)
    if page.next_before is not None:
        click.echo(f"older jobs: add --before {page.next_before}", err=True)


@jobs.command("cancel")
@_filter_options
@click.option("--all", "all_", is_flag=True, help="With no filter: every pending job of every tenant.")
@click.option("--dry-run", is_flag=True, help="Print how many would be cancelled; change nothing.")
@click.pass_context
def jobs_cancel(ctx: click.Context, /, all_: bool, dry_run: bool, **own: Any) -> None:
    """Cancel every pending job that matches the filters; prints how many.
    Running jobs finish; `wait` callers of the cancelled jobs return."""
    checked = _bulk_filter(ctx, own, status="pending", all_=all_)
    with _queue() as q:
        if dry_run:
            count = q.actionable_counts(**_kwargs(checked))["pending"]
            click.echo(f"would cancel {count} job(s)")
            return
        count = q.cancel_jobs(**_kwargs(checked), everything=all_)
    click.echo(f"cancelled {count} job(s)")


@jobs.command("retry-dead")
@_filter_options
@click.option("--all", "all_", is_flag=True, help="With no filter: every dead job of every tenant.")
@click.option("--dry-run", is_flag=True, help="Print how many would be replayed; change nothing.")
@click.pass_context
def jobs_retry_dead(ctx: click.Context, /, all_: bool, dry_run: bool, **own: Any) -> None:
    """Replay every dead job that matches the filters (fresh attempts, as
    `tenantq dead retry`); prints how many."""
    checked = _bulk_filter(ctx, own, status="dead", all_=all_)
    with _queue() as q:
        if dry_run:
            count = q.actionable_counts(**_kwargs(checked))["dead"]
            click.echo(f"would replay {count} job(s)")
            return
        count = q.retry_dead_jobs(**_kwargs(checked), everything=all_)
    click.echo(f"replayed {count} job(s)")
