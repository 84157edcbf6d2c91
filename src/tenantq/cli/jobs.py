"""Jobs: `tenantq enqueue`, `status`, `job ID`, `jobs` (find them), `cancel`
(one, or in bulk by filters) and `dead list|retry` (the dead-letter list;
replay one, or in bulk by filters).

`tenantq jobs cancel` and `tenantq jobs retry-dead` are the deprecated
spellings of bulk `cancel` and `dead retry`: hidden, they print one
deprecation line and do the same (for one release)."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import click

from tenantq.cli._common import (
    DEFAULT_LIMIT,
    FILTERS,
    MAX_LIMIT,
    deprecated,
    emit_json,
    filter_kwargs,
    filter_options,
    filter_scope,
    job_filter,
    queue,
    utc_row,
)
from tenantq.domain import validation
from tenantq.errors import InvalidInput, WaitTimeout


@click.command()
@click.option("--tenant", required=True, help="Tenant the job belongs to.")
@click.option("--kind", required=True, help="Handler name, e.g. reports.render.")
@click.option("--payload", default="null", show_default=True, help="JSON payload, @FILE, or - for stdin.")
@click.option("--priority", default="default", show_default=True, help="interactive | default | bulk")
@click.option("--max-attempts", type=int, default=5, show_default=True)
@click.option("--delay", type=float, default=0.0, show_default=True, help="Seconds before it may run.")
@click.option("--key", default=None, help="Idempotency key, unique per tenant.")
@click.option("--actor", default=None, help="Who the job is for (a user id...): ctx.actor.")
@click.option("--meta", "meta_items", multiple=True, metavar="KEY=VALUE",
              help="Request context for ctx.meta (repeatable), or a JSON object.")
@click.option("--wait", "wait_", is_flag=True, help="Wait for the job to end; print it; exit 1 unless done.")
@click.option("--timeout", type=float, default=None, help="With --wait: give up after S seconds (exit 124).")
def enqueue(tenant: str, kind: str, payload: str, priority: str, max_attempts: int,
            delay: float, key: str | None, actor: str | None, meta_items: tuple[str, ...],
            wait_: bool, timeout: float | None) -> None:
    """Enqueue one job and print its id. --payload @FILE reads the JSON from
    a file, --payload - from standard input. With --wait, print the ended
    job (its result) instead; the exit code is 0 if it is done, 1 if it is
    dead or cancelled, 124 if --timeout passed first."""
    try:
        if payload == "-":
            payload = sys.stdin.read()
        elif payload.startswith("@"):
            with open(payload[1:], encoding="utf-8") as fh:
                payload = fh.read()
    except (OSError, UnicodeDecodeError) as exc:  # JSON text is UTF-8
        source = "standard input" if payload == "-" else f"file {payload[1:]}"
        raise InvalidInput(f"cannot read the payload from {source}: {exc}") from None
    parsed = validation.parse_payload(payload)
    meta = _meta_option(meta_items)
    if timeout is not None and not wait_:
        raise InvalidInput("--timeout goes with --wait")
    if timeout is not None and not (math.isfinite(timeout) and timeout >= 0):
        raise InvalidInput(f"--timeout must be a number of seconds, 0 or more, got {timeout}")
    with queue() as q:
        job_id = q.enqueue(tenant, kind, parsed, priority=priority, max_attempts=max_attempts,
                           delay=delay, key=key, actor=actor, meta=meta)
        if not wait_:
            click.echo(job_id)
            return
        try:
            info = q.wait(job_id, timeout=timeout)
        except WaitTimeout as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(124)
    emit_json({"id": info.id, "status": info.status, "result": info.result,
               "outcome": info.outcome_note, "last_error": info.last_error})
    if info.status != "done":
        sys.exit(1)


def _meta_option(items: tuple[str, ...]) -> dict[str, Any] | None:
    """--meta request_id=r-1 --meta plan=pro, or --meta '{"request_id": "r-1"}'."""
    if not items:
        return None
    if len(items) == 1 and items[0].lstrip().startswith("{"):
        try:
            meta = json.loads(items[0])
        except ValueError as exc:
            raise InvalidInput(f"--meta is not a JSON object: {exc}") from None
        validation.meta_json(meta)
        return meta  # type: ignore[no-any-return]
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise InvalidInput(f"--meta takes KEY=VALUE or a JSON object, got {item!r}")
        out[name] = value
    return out


@click.command()
@click.option("--tenant", default=None)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(tenant: str | None, as_json: bool) -> None:
    """Per tenant and class: pending, running, done, dead, oldest pending age;
    the tenants (paused ones marked); each schedule's next fire."""
    from tenantq.render import status_tables

    with queue() as q:
        rows, tenants, batches = q.status(tenant), q.tenants(tenant), q.running_batches()
        schedules = q.schedules(tenant)
    if as_json:
        emit_json({"queues": rows, "tenants": tenants, "running_batches": batches, "schedules": schedules})
        return
    status_tables(rows, tenants, batches, schedules)


@click.command()
@click.argument("job_id", type=int)
@click.option("--json", "as_json", is_flag=True)
def job(job_id: int, as_json: bool) -> None:
    """Show one job, and why it waits if it is pending."""
    from tenantq.render import job_panel

    with queue() as q:
        info = q.job(job_id)
    if as_json:
        emit_json(info.as_json())
        return
    job_panel(info)


# -- finding jobs --------------------------------------------------------------


@click.group("jobs", invoke_without_command=True)
@filter_options()
@click.option("--limit", type=int, default=None,
              help=f"Jobs per page (1-{MAX_LIMIT}; default {DEFAULT_LIMIT}).")
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
      tenantq cancel --tenant acme --kind reports.render     # act on such a set
      tenantq dead retry --tenant acme --since 1h

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
    checked = job_filter(filters)
    with queue() as q:
        page = q.find_jobs(tenant=checked.tenant, kind=checked.kind, status=checked.status,
                           actor=checked.actor, meta=checked.meta, since=checked.since_seconds,
                           limit=DEFAULT_LIMIT if limit is None else limit, before=before)
    if as_json:
        click.echo(json.dumps([utc_row(row) for row in page.jobs], default=str, indent=2))
    else:
        from tenantq.render import jobs_table

        jobs_table(page.jobs)
    if page.next_before is not None:
        click.echo(f"older jobs: add --before {page.next_before}", err=True)


def _merged(ctx: click.Context, own: dict[str, Any], *, status: str, instead: str) -> dict[str, Any]:
    """A deprecated bulk command's filters: its own and those given before
    its name (`tenantq jobs --tenant acme cancel`); the same filter twice,
    with different values, is refused, and --status must be `status`."""
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
    chosen = merged.pop("status")
    if chosen not in (None, status):
        raise InvalidInput(f"--status {chosen}: `tenantq {instead}` acts on {status} jobs only")
    return merged


@jobs.command("cancel", hidden=True)
@filter_options()
@click.option("--all", "all_", is_flag=True)
@click.option("--dry-run", is_flag=True)
@click.pass_context
def jobs_cancel(ctx: click.Context, /, all_: bool, dry_run: bool, **own: Any) -> None:
    """Deprecated: `tenantq cancel` with the same filters."""
    deprecated("jobs cancel", "cancel")
    bulk_cancel(_merged(ctx, own, status="pending", instead="cancel"), all_=all_, dry_run=dry_run)


@jobs.command("retry-dead", hidden=True)
@filter_options()
@click.option("--all", "all_", is_flag=True)
@click.option("--dry-run", is_flag=True)
@click.pass_context
def jobs_retry_dead(ctx: click.Context, /, all_: bool, dry_run: bool, **own: Any) -> None:
    """Deprecated: `tenantq dead retry` with the same filters."""
    deprecated("jobs retry-dead", "dead retry")
    bulk_retry_dead(_merged(ctx, own, status="dead", instead="dead retry"), all_=all_, dry_run=dry_run)


# -- cancelling ----------------------------------------------------------------


@click.command()
@click.argument("job_id", type=int, required=False)
@click.option("--by", default=None, metavar="WHO", help="Who cancels (shown by `tenantq job`).")
@filter_options("tenant", "kind")
@click.option("--priority", default=None, help="Bulk: only jobs of this class: interactive | default | bulk.")
@filter_options("actor", "meta", "since")
@click.option("--running", is_flag=True, help="Bulk: also ask the matching running jobs to stop.")
@click.option("--all", "all_", is_flag=True, help="Bulk, with no filter: every pending job of every tenant.")
@click.option("--dry-run", is_flag=True, help="Bulk: print how many pending jobs would be cancelled.")
def cancel(job_id: int | None, by: str | None, running: bool, all_: bool, dry_run: bool,
           **filters: Any) -> None:
    """Cancel a job: a pending one ends `cancelled` at once; a running one
    is stopped by its worker (a sandboxed job killed within about a
    second, an inline handler told through ctx.cancelled) and ends
    `cancelled`. A job that already ended is an error. With filters
    instead of an id, cancel every pending job that matches (and with
    --running, ask the matching running ones to stop); prints the counts.

    \b
      tenantq cancel 42 --by alice
      tenantq cancel --tenant acme --kind reports.render            # pending ones
      tenantq cancel --tenant acme --priority bulk --running        # and running ones
      tenantq cancel --tenant acme --actor user-7 --since 1h --dry-run"""
    if by is not None:
        try:
            validation.actor(by)
        except InvalidInput as exc:
            raise InvalidInput(f"--by: {exc}") from None
    if job_id is None:
        bulk_cancel(filters, all_=all_, dry_run=dry_run, running=running, by=by)
        return
    if any(v for v in filters.values()) or running or all_ or dry_run:
        raise InvalidInput("give a job id, or --tenant (or the other filters, --running, --all) to "
                           "cancel in bulk, not both")
    _cancel_one(job_id, by)


def bulk_cancel(filters: dict[str, Any], *, all_: bool, dry_run: bool, running: bool = False,
                by: str | None = None) -> None:
    """`tenantq cancel` with filters: every filter is checked before anything changes."""
    checked = job_filter(filters)
    if checked.empty and not all_:
        raise InvalidInput("give a job id, or --tenant T (or --kind, --priority, --actor, --meta, --since) "
                           "to cancel its pending jobs in bulk, or --all for every tenant's")
    if dry_run and running:
        raise InvalidInput("--dry-run counts pending jobs: it does not go with --running")
    scope = filter_scope(checked)
    with queue() as q:
        if dry_run:
            count = q.actionable_counts(**filter_kwargs(checked))["pending"]
            click.echo(f"would cancel {count} pending job(s) ({scope})")
            return
        pending = q.cancel_jobs(**filter_kwargs(checked), everything=all_)
        asked = (q.cancel_running_jobs(**filter_kwargs(checked), everything=all_, by=by)
                 if running else None)
    click.echo(f"cancelled {pending} pending job(s) ({scope})")
    if asked is not None:
        click.echo(f"asked {asked} running job(s) to stop: their workers stop them")


def _cancel_one(job_id: int, by: str | None) -> None:
    with queue() as q:
        before = q.job(job_id).status  # JobNotFound: one line
        if before not in ("pending", "running") or not q.cancel(job_id, by=by):
            ended = q.job(job_id).status
            raise InvalidInput(f"job {job_id} already ended ({ended}): there is nothing to cancel")
        after = q.job(job_id).status
    if after == "cancelled":
        click.echo(f"cancelled {job_id}")
    elif after == "running":
        click.echo(f"cancelling {job_id}: its worker stops it (running)")
    elif after == "pending":
        # its lease expired meanwhile and it went back: a pending job is cancelled now
        with queue() as q:
            q.cancel(job_id, by=by)
            after = q.job(job_id).status
        click.echo(f"cancelled {job_id}" if after == "cancelled"
                   else f"cancelling {job_id}: its worker stops it ({after})")
    else:
        raise InvalidInput(f"job {job_id} ended {after} before its worker could stop it")


# -- the dead-letter list ------------------------------------------------------


@click.group()
def dead() -> None:
    """The dead-letter list: jobs that used all their attempts."""


@dead.command("list")
@click.option("--tenant", default=None)
@click.option("--limit", type=int, default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def dead_list(tenant: str | None, limit: int, as_json: bool) -> None:
    """List dead jobs, newest first."""
    from tenantq.render import dead_table

    with queue() as q:
        rows = q.dead_jobs(tenant, limit=limit)
    if as_json:
        emit_json(rows)
        return
    dead_table(rows)


@dead.command("retry")
@click.argument("job_id", type=int, required=False)
@click.option("--all", "all_", is_flag=True, help="Every dead job (that matches the filters).")
@filter_options("tenant", "kind", "actor", "meta", "since")
@click.option("--dry-run", is_flag=True, help="Print how many would be replayed; change nothing.")
def dead_retry(job_id: int | None, all_: bool, dry_run: bool, **filters: Any) -> None:
    """Send dead jobs back to pending with fresh attempts: one by id, or
    every one that matches the filters (--all: of every tenant)."""
    if job_id is None:
        bulk_retry_dead(filters, all_=all_, dry_run=dry_run)
        return
    if all_ or dry_run or any(v for name, v in filters.items() if name != "tenant"):
        raise InvalidInput("give a job id, or --all or filters, not both")
    with queue() as q:
        ids = q.retry_dead([job_id], tenant=filters["tenant"])
    if not ids:
        raise InvalidInput(f"job {job_id} is not dead (or does not exist)")
    click.echo(f"replayed {len(ids)} job(s)")


def bulk_retry_dead(filters: dict[str, Any], *, all_: bool, dry_run: bool) -> None:
    checked = job_filter(filters)
    if checked.empty and not all_:
        raise InvalidInput("give a job id, or --all, or filters (--tenant, --kind, --actor, --meta, --since)")
    with queue() as q:
        if dry_run:
            count = q.actionable_counts(**filter_kwargs(checked))["dead"]
            click.echo(f"would replay {count} job(s)")
            return
        count = q.retry_dead_jobs(**filter_kwargs(checked), everything=all_)
    click.echo(f"replayed {count} job(s)")
