"""Operating tenantq: `tenantq migrate`, `prune`, `dashboard`, `reap`, and
`db url|stop` (the embedded Postgres)."""

from __future__ import annotations

import click

from tenantq.cli._common import queue
from tenantq.domain import validation
from tenantq.errors import InvalidInput, TenantqError


@click.command()
def migrate() -> None:
    """Install or upgrade tenantq's tables (idempotent, safe to run concurrently)."""
    with queue() as q:
        click.echo(q.migrate().summary())


@click.command()
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
    with queue() as q:
        went = q.prune(older_than_seconds=seconds, dry_run=dry_run, limit=limit)
    counts = {status: went.get(status, 0) for status in ("done", "cancelled", "dead")}
    total = sum(counts.values())
    detail = ", ".join(f"{status} {n}" for status, n in counts.items())
    verb = "would prune" if dry_run else "pruned"
    click.echo(f"{verb} {total} finished job(s): {detail}")
    if total >= limit:
        click.echo(f"stopped at --limit {limit}: run it again for the rest", err=True)


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; keep it local unless --token is set.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--token", default=None, envvar="TENANTQ_DASHBOARD_TOKEN",
              help="Require this bearer token (or a login) for every page, action and /metrics.")
def dashboard(host: str, port: int, token: str | None) -> None:
    """Serve the web dashboard (and /metrics): tenants, queues, running batches, failures, dead jobs."""
    from tenantq.observe.logs import configure as configure_logs
    from tenantq.observe.queue_metrics import asgi_app
    from tenantq.settings import Settings
    from tenantq.web.app import serve

    configure_logs(None)  # so the URL line (and any warning) is shown
    if token is not None and not token:
        raise InvalidInput("--token must not be empty")
    _check_listen(host, port)
    with queue() as q:
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


@click.command()
def reap() -> None:
    """Reap expired leases and sandboxes past their TTL (workers also do this)."""
    from tenantq.sandbox.reaper import reap_sandboxes
    from tenantq.settings import Settings

    with queue() as q:
        click.echo(f"reaped {q.reap()} job(s) from expired leases")
    gone = reap_sandboxes(Settings().data_dir)
    click.echo(f"reaped {len(gone)} sandbox(es) past their TTL")


@click.group()
def db() -> None:
    """The embedded Postgres (used when TENANTQ_DATABASE_URL is unset)."""


@db.command("url")
def db_url() -> None:
    """Print the DSN tenantq uses (starting the embedded server if needed)."""
    with queue() as q:
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
