"""`tenantq ...`: a thin layer over Queue and Worker. Bad input exits non-zero
with one line on stderr and changes nothing."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import click

from tenantq import __version__
from tenantq.errors import InvalidInput, TenantqError
from tenantq.queue import Queue
from tenantq.store import validation

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
def enqueue(tenant: str, kind: str, payload: str, priority: str, max_attempts: int,
            delay: float, key: str | None) -> None:
    """Enqueue one job and print its id. --payload @FILE reads the JSON from
    a file, --payload - from standard input."""
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
    with _queue() as q:
        click.echo(q.enqueue(tenant, kind, parsed, priority=priority, max_attempts=max_attempts,
                             delay=delay, key=key))


@cli.command()
@click.option("--tenant", default=None)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(tenant: str | None, as_json: bool) -> None:
    """Per tenant and class: pending, running, done, dead, oldest pending age."""
    from tenantq.render import status_tables

    with _queue() as q:
        rows, tenants, batches = q.status(tenant), q.tenants(tenant), q.running_batches()
    if as_json:
        _emit_json({"queues": rows, "tenants": tenants, "running_batches": batches})
        return
    status_tables(rows, tenants, batches)


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
@click.argument("job_id", type=int)
def cancel(job_id: int) -> None:
    """Cancel a pending job."""
    with _queue() as q:
        if not q.cancel(job_id):
            raise InvalidInput(f"job {job_id} is not pending; only pending jobs can be cancelled")
    click.echo(f"cancelled {job_id}")


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


@cli.group()
def tenant() -> None:
    """Tenant settings."""


@tenant.command("set")
@click.argument("tenant_id")
@click.option("--weight", type=int, default=None, help="Plan-tier weight (default 1).")
@click.option("--max-sandboxes", type=int, default=None, help="Cap on running batches; 0 = no cap.")
@click.option("--egress", default=None,
              help='Hosts its sandboxed jobs may reach: "api.stripe.com,*.salesforce.com:443"; "" = none.')
def tenant_set(tenant_id: str, weight: int | None, max_sandboxes: int | None, egress: str | None) -> None:
    """Set a tenant's weight, concurrency cap and egress rules."""
    with _queue() as q:
        row = q.set_tenant(tenant_id, weight=weight, max_sandboxes=max_sandboxes, egress=egress)
    cap = row["max_sandboxes"] if row["max_sandboxes"] is not None else "none"
    click.echo(f"tenant {row['tenant_id']}: weight {row['weight']}, max sandboxes {cap}, "
               f"egress {', '.join(row['egress']) or 'none'}")


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
    with _queue() as q:
        serve(q, host=host, port=port, token=token,
              metrics_app=asgi_app(q.db, top_tenants=Settings().metrics_top_tenants))


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
    from tenantq.store.embedded import stop_embedded

    stopped = stop_embedded(Settings().data_dir)
    click.echo("stopped the embedded Postgres" if stopped else "the embedded Postgres is not running")


@cli.command()
@click.option("--app", "app", required=True, help="Module that registers the handlers.")
@click.option("--sandbox", type=click.Choice(["auto", "gvisor", "process", "inline"]),
              default="auto", show_default=True,
              help="Where batches run; kinds registered isolation='inline' always run in-process.")
@click.option("--secrets", "secrets_file", default=None,
              type=click.Path(dir_okay=False, path_type=Path),
              help="JSON or TOML: tenant -> {NAME: value}; each tenant's sandboxes get only theirs.")
@click.option("--concurrency", type=click.IntRange(1, 256), default=4, show_default=True)
@click.option("--batch-size", type=click.IntRange(1, 10000), default=10, show_default=True)
@click.option("--lease-seconds", type=click.FloatRange(0.5, 86400), default=30.0, show_default=True)
@click.option("--poll-seconds", type=click.FloatRange(0.05, 60), default=1.0, show_default=True,
              help="Polling fallback when no NOTIFY arrives.")
@click.option("--backoff-base", type=click.FloatRange(0, 3600), default=2.0, show_default=True,
              help="Retry backoff base in seconds (full jitter, doubling per attempt).")
@click.option("--backoff-cap", type=click.FloatRange(0, 86400), default=600.0, show_default=True)
@click.option("--fair-by", type=click.Choice(["jobs", "runtime"]), default="jobs", show_default=True,
              help="DRR cost: one unit per job, or measured run seconds.")
@click.option("--quantum-seconds", type=click.FloatRange(0.001, 3600), default=1.0, show_default=True,
              help="With --fair-by runtime: credit per turn and unit of weight.")
@click.option("--interactive-share", type=click.FloatRange(0, 1), default=0.3, show_default=True,
              help="Share of slots reserved for interactive work (lent out when unused).")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              help="Serve Prometheus /metrics on 127.0.0.1:PORT.")
@click.option("--on-dead", default=None, help="Command run with each dead job as JSON on stdin.")
@click.option("--on-dead-url", default=None, help="URL each dead job is POSTed to as JSON.")
@click.option("--log-format", type=click.Choice(["json", "text"]), default=None,
              help="Default: text with a live progress line on a terminal, JSON lines otherwise.")
@click.option("--once", is_flag=True, help="Drain what is runnable now, then exit.")
@click.option("--snapshots", type=click.Choice(["auto", "off"]), default="auto", show_default=True,
              help="Restore sandboxes from the app's warm template where the driver can (gvisor).")
@click.option("--keep-warm", type=click.FloatRange(0, 86400), default=0.0, show_default=True,
              help="Keep a tenant's sandbox this many idle seconds for its next batch (0: never).")
@click.option("--max-batches-per-sandbox", type=click.IntRange(1, 100000), default=50, show_default=True)
@click.option("--hibernate-after", type=click.FloatRange(0, 86400), default=None,
              help="Checkpoint a kept-warm sandbox to disk after this many idle seconds.")
@click.option("--work-mb", type=click.IntRange(1, 65536), default=128, show_default=True,
              help="Quota of a sandbox's work dir (a tmpfs: ENOSPC past it; counts as sandbox memory).")
def worker(app: str, sandbox: str, secrets_file: Path | None, concurrency: int, batch_size: int,
           lease_seconds: float, poll_seconds: float, backoff_base: float, backoff_cap: float, fair_by: str,
           quantum_seconds: float, interactive_share: float, metrics_port: int | None,
           on_dead: str | None, on_dead_url: str | None, log_format: str | None, once: bool,
           snapshots: str, keep_warm: float, max_batches_per_sandbox: int,
           hibernate_after: float | None, work_mb: int) -> None:
    """Run jobs: lease batches fairly, run them, settle every job."""
    from tenantq.cli_sandbox import make_executor
    from tenantq.dispatch.outcome import Backoff
    from tenantq.dispatch.worker import Worker, WorkerConfig
    from tenantq.fairness.drr import Mode
    from tenantq.observe.alerts import DeadLetterAlerts
    from tenantq.observe.logs import ProgressLine
    from tenantq.observe.logs import configure as configure_logs
    from tenantq.observe.metrics import serve_worker_metrics
    from tenantq.sandbox.warm import WarmPolicy
    from tenantq.secrets import FileSecrets, NoSecrets, SecretsProvider
    from tenantq.settings import Settings

    chosen_format = configure_logs(log_format)
    secrets: SecretsProvider = FileSecrets(secrets_file) if secrets_file else NoSecrets()
    policy = WarmPolicy(snapshots=snapshots == "auto", keep_warm_seconds=keep_warm,
                        max_batches=max_batches_per_sandbox, hibernate_after=hibernate_after,
                        max_idle=concurrency)
    executor = make_executor(app, sandbox, policy, secrets, work_mb=work_mb)
    config = WorkerConfig(concurrency=concurrency, batch_size=batch_size, lease_seconds=lease_seconds,
                          poll_seconds=poll_seconds, once=once,
                          backoff=Backoff(base_seconds=backoff_base, cap_seconds=backoff_cap),
                          fair_by=Mode(fair_by), quantum_seconds=quantum_seconds,
                          interactive_share=interactive_share)
    with _queue() as q:
        db_ = q.db
    w = Worker(db_, executor, config, secrets=secrets.for_tenant,
               alerts=DeadLetterAlerts(command=on_dead, url=on_dead_url))
    if metrics_port is not None:
        serve_worker_metrics(db_, metrics_port, top_tenants=Settings().metrics_top_tenants)
    _install_signal_handlers(w.stop)
    if chosen_format == "text" and sys.stderr.isatty():
        ProgressLine(lambda: _progress(w), w.stopping).start()
    stats = w.run()
    click.echo(json.dumps({"worker": config.worker_id, **stats.snapshot()}), err=True)
    if w.failed:
        # the worker stopped itself because it could not carry on: non-zero exit, one line saying why
        raise TenantqError(f"worker stopped: {w.failure or 'it could not carry on; see the log above'}")


def _progress(w: Any) -> str:
    s = w.stats.snapshot()
    return (f"tenantq worker [{w.executor.name}] batches {s['batches']} · done {s['done']} · "
            f"retried {s['retried']} · dead {s['dead']} · released {s['released']} · "
            f"running {len(w.leases.live())}")


def _install_signal_handlers(stop: Callable[[], None]) -> None:
    received = {"count": 0}

    def handle(signum: int, frame: FrameType | None) -> None:
        received["count"] += 1
        if received["count"] > 1:
            # second signal: leave now; unfinished leases expire and are reaped
            os._exit(128 + signum)
        logging.getLogger("tenantq.worker").info(
            "received %s: finishing running jobs, releasing the rest", signal.Signals(signum).name)
        stop()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


def _add_subcommands() -> None:
    from tenantq.cli_sandbox import template

    cli.add_command(template)


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


if __name__ == "__main__":
    main()
