"""`tenantq ...`: a thin layer over Queue and Worker. Bad input exits non-zero
with one line on stderr and changes nothing."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from pydantic import ValidationError

from tenantq import __version__
from tenantq.domain import validation
from tenantq.errors import InvalidInput, TenantqError, WaitTimeout
from tenantq.queue import Queue

F = TypeVar("F", bound=Callable[..., Any])


def _queue() -> Queue:
    return Queue()


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, default=str, indent=2))


@click.group()
@click.version_option(__version__, prog_name="tenantq")
def cli() -> None:
    """tenantq: fair, isolated background jobs for multi-tenant apps."""


@cli.command()
def migrate() -> None:
    """Install or upgrade tenantq's tables (idempotent, safe to run concurrently)."""
    with _queue() as q:
        click.echo(q.migrate().summary())


@cli.command()
@click.option("--tenant", required=True, help="Tenant the job belongs to.")
@click.option("--kind", required=True, help="Handler name, e.g. reports.render.")
@click.option("--payload", default="null", show_default=True, help="JSON payload, @FILE, or - for stdin.")
@click.option("--priority", default="default", show_default=True,
              help="interactive | default | bulk")
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
    with _queue() as q:
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
    _emit_json({"id": info.id, "status": info.status, "result": info.result,
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


@cli.command()
@click.option("--tenant", default=None)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(tenant: str | None, as_json: bool) -> None:
    """Per tenant and class: pending, running, done, dead, oldest pending age;
    the tenants (paused ones marked); each schedule's next fire."""
    from tenantq.render import status_tables

    with _queue() as q:
        rows, tenants, batches = q.status(tenant), q.tenants(tenant), q.running_batches()
        schedules = q.schedules(tenant)
    if as_json:
        _emit_json({"queues": rows, "tenants": tenants, "running_batches": batches, "schedules": schedules})
        return
    status_tables(rows, tenants, batches, schedules)


@cli.command()
@click.argument("job_id", type=int)
@click.option("--json", "as_json", is_flag=True)
def job(job_id: int, as_json: bool) -> None:
    """Show one job, and why it waits if it is pending."""
    from tenantq.render import job_panel

    with _queue() as q:
        info = q.job(job_id)
    if as_json:
        _emit_json(info.as_json())
        return
    job_panel(info)


@cli.command()
@click.argument("job_id", type=int, required=False)
@click.option("--by", default=None, metavar="WHO", help="Who cancels (shown by `tenantq job`).")
@click.option("--tenant", default=None, help="Bulk: cancel this tenant's pending jobs (and the filters).")
@click.option("--kind", default=None, help="Bulk: only jobs of this kind.")
@click.option("--priority", default=None, help="Bulk: only jobs of this class: interactive | default | bulk.")
@click.option("--running", is_flag=True, help="Bulk: also ask the matching running jobs to stop.")
def cancel(job_id: int | None, by: str | None, tenant: str | None, kind: str | None,
           priority: str | None, running: bool) -> None:
    """Cancel a job: a pending one ends `cancelled` at once; a running one
    is stopped by its worker (a sandboxed job killed within about a
    second, an inline handler told through ctx.cancelled) and ends
    `cancelled`. A job that already ended is an error.

    \b
      tenantq cancel 42 --by alice
      tenantq cancel --tenant acme --kind reports.render            # pending ones
      tenantq cancel --tenant acme --priority bulk --running        # and running ones"""
    if by is not None:
        try:
            validation.actor(by)
        except InvalidInput as exc:
            raise InvalidInput(f"--by: {exc}") from None
    if job_id is not None:
        if tenant is not None or kind is not None or priority is not None or running:
            raise InvalidInput("give a job id, or --tenant (with --kind, --priority, --running) to "
                               "cancel in bulk, not both")
        _cancel_one(job_id, by)
        return
    if tenant is None:
        raise InvalidInput("give a job id, or --tenant T to cancel its pending jobs in bulk")
    # every filter is checked before anything changes (the running ones are asked second)
    validation.tenant_id(tenant)
    if kind is not None:
        validation.kind(kind)
    if priority is not None:
        validation.priority(priority)
    with _queue() as q:
        pending = q.cancel_jobs(tenant=tenant, kind=kind, priority=priority)
        asked = q.cancel_running_jobs(tenant=tenant, kind=kind, priority=priority, by=by) if running else None
    scope = ", ".join(f"{name} {value}" for name, value in (("tenant", tenant), ("kind", kind),
                                                          ("priority", priority)) if value is not None)
    click.echo(f"cancelled {pending} pending job(s) ({scope})")
    if asked is not None:
        click.echo(f"asked {asked} running job(s) to stop: their workers stop them")


def _cancel_one(job_id: int, by: str | None) -> None:
    with _queue() as q:
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
        with _queue() as q:
            q.cancel(job_id, by=by)
            after = q.job(job_id).status
        click.echo(f"cancelled {job_id}" if after == "cancelled"
                   else f"cancelling {job_id}: its worker stops it ({after})")
    else:
        raise InvalidInput(f"job {job_id} ended {after} before its worker could stop it")


@cli.command()
@click.option("--older-than", default=None, metavar="DURATION",
              help="Prune finished jobs older than this (30d, 12h...), whatever their retention.")
@click.option("--dry-run", is_flag=True, help="Print what would go; delete nothing.")
@click.option("--limit", type=click.IntRange(1, None), default=1_000_000, show_default=True,
              help="Stop after this many jobs.")
def prune(older_than: str | None, dry_run: bool, limit: int) -> None:
    """Delete finished jobs past their retention now (workers do it every
    minute): per status, TENANTQ_RETAIN_DONE / _CANCELLED / _DEAD or the
    tenant's own (tenant set --retain-*), with their attempt history.
    Prints how many went (or, with --dry-run, would go) by status."""
    seconds = None if older_than is None else validation.duration(older_than, "--older-than")
    with _queue() as q:
        went = q.prune(older_than_seconds=seconds, dry_run=dry_run, limit=limit)
    counts = {status: went.get(status, 0) for status in ("done", "cancelled", "dead")}
    total = sum(counts.values())
    detail = ", ".join(f"{status} {n}" for status, n in counts.items())
    verb = "would prune" if dry_run else "pruned"
    click.echo(f"{verb} {total} finished job(s): {detail}")
    if total >= limit:
        click.echo(f"stopped at --limit {limit}: run it again for the rest", err=True)


@cli.group()
def dead() -> None:
    """The dead-letter list: jobs that used all their attempts."""


@dead.command("list")
@click.option("--tenant", default=None)
@click.option("--limit", type=int, default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def dead_list(tenant: str | None, limit: int, as_json: bool) -> None:
    """List dead jobs, newest first."""
    from tenantq.render import dead_table

    with _queue() as q:
        rows = q.dead_jobs(tenant, limit=limit)
    if as_json:
        _emit_json(rows)
        return
    dead_table(rows)


@dead.command("retry")
@click.argument("job_id", type=int, required=False)
@click.option("--all", "all_", is_flag=True, help="Replay every dead job (of --tenant).")
@click.option("--tenant", default=None)
def dead_retry(job_id: int | None, all_: bool, tenant: str | None) -> None:
    """Send dead jobs back to pending with fresh attempts."""
    if (job_id is None) == (not all_):
        raise InvalidInput("give a job id or --all, not both and not neither")
    with _queue() as q:
        ids = q.retry_dead(None if all_ else [int(job_id or 0)], tenant=tenant)
    if job_id is not None and not ids:
        raise InvalidInput(f"job {job_id} is not dead (or does not exist)")
    click.echo(f"replayed {len(ids)} job(s)")


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; keep it local unless --token is set.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--token", default=None, envvar="TENANTQ_DASHBOARD_TOKEN",
              help="Require this bearer token (or a login) for every page, action and /metrics.")
def dashboard(host: str, port: int, token: str | None) -> None:
    """Serve the web dashboard (and /metrics): tenants, queues, running batches, failures, dead jobs."""
    from tenantq.observe.logs import configure as configure_logs
    from tenantq.observe.metrics import asgi_app
    from tenantq.settings import Settings
    from tenantq.web.app import serve

    configure_logs(None)  # so the URL line (and any warning) is shown
    if token is not None and not token:
        raise InvalidInput("--token must not be empty")
    _check_listen(host, port)
    with _queue() as q:
        try:
            serve(q, host=host, port=port, token=token,
                  metrics_app=asgi_app(q.db, top_tenants=Settings().metrics_top_tenants))
        except SystemExit as exc:
            # uvicorn exits (status 3) when it cannot bind: the port was taken after the check
            if exc.code in (0, None):
                raise
            raise TenantqError(f"the dashboard could not listen on {host}:{port} "
                               "(in use? pick another with --port)") from None


def _check_listen(host: str, port: int) -> None:
    """Bind HOST:PORT the way uvicorn will (SO_REUSEADDR, every address HOST
    resolves to) and let go, so a port in use is one line, not a traceback."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidInput(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                shown = f"[{address[0]}]:{port}" if family == socket.AF_INET6 else f"{address[0]}:{port}"
                if exc.errno == errno.EADDRINUSE:
                    raise InvalidInput(f"port {port} is already in use on {shown} (another dashboard?): "
                                       "stop it or pick another with --port") from None
                raise InvalidInput(f"cannot listen on {shown}: {exc.strerror or exc}") from None


@cli.command()
def reap() -> None:
    """Reap expired leases and sandboxes past their TTL (workers also do this)."""
    from tenantq.sandbox.reaper import reap_sandboxes
    from tenantq.settings import Settings

    with _queue() as q:
        click.echo(f"reaped {q.reap()} job(s) from expired leases")
    gone = reap_sandboxes(Settings().data_dir)
    click.echo(f"reaped {len(gone)} sandbox(es) past their TTL")


@cli.group()
def db() -> None:
    """The embedded Postgres (used when TENANTQ_DATABASE_URL is unset)."""


@db.command("url")
def db_url() -> None:
    """Print the DSN tenantq uses (starting the embedded server if needed)."""
    with _queue() as q:
        click.echo(q.db.dsn)


@db.command("stop")
def db_stop() -> None:
    """Stop the embedded Postgres if it runs."""
    from tenantq.settings import Settings
    from tenantq.store.db import quiet_embedded_logs
    from tenantq.store.embedded import stop_embedded

    data_dir = Settings().data_dir
    quiet_embedded_logs(data_dir)
    stopped = stop_embedded(data_dir)
    click.echo("stopped the embedded Postgres" if stopped else "the embedded Postgres is not running")


def _add_subcommands() -> None:
    from tenantq.cli_jobs import jobs
    from tenantq.cli_sandboxes import sandbox
    from tenantq.cli_schedule import schedule
    from tenantq.cli_templates import template
    from tenantq.cli_tenant import kind, rates, tenant
    from tenantq.cli_worker import worker

    cli.add_command(worker)
    cli.add_command(template)
    cli.add_command(sandbox)
    cli.add_command(jobs)
    cli.add_command(schedule)
    cli.add_command(tenant)
    cli.add_command(kind)
    cli.add_command(rates)


_add_subcommands()


def main() -> None:
    try:
        cli.main(standalone_mode=False)
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
    except ValidationError as exc:  # a TENANTQ_* variable that does not parse
        click.echo(f"error: {_setting_error(exc)}", err=True)
        sys.exit(2)


def _setting_error(exc: ValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return str(exc).strip().splitlines()[0]
    loc = [str(part) for part in errors[0]["loc"]]
    name = loc[0].upper() if loc else "SETTING"
    name = name if name.startswith("TENANTQ_") else f"TENANTQ_{name}"
    message = (str(errors[0]["msg"]).strip().splitlines() or ["invalid"])[0]
    return f"{name}: {message}"


if __name__ == "__main__":
    main()
