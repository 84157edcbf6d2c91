"""`tenantq worker`: the command that runs jobs (options, logging, signals).
The worker itself is built by dispatch/build.py; the options' defaults are
the TENANTQ_WORKER_* settings (settings.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import click

from tenantq.cli._common import APP_HELP, setting_option
from tenantq.errors import TenantqError


@click.command()
@click.option("--app", "app", required=True, metavar="MODULE", help=APP_HELP)
@setting_option("--sandbox", type=click.Choice(["auto", "gvisor", "process", "inline"]),
                setting="worker_sandbox",
                help="Where batches run; kinds registered isolation='inline' always run in-process.")
@click.option("--secrets", "secrets_file", default=None,
              type=click.Path(dir_okay=False, path_type=Path),
              help="JSON or TOML: tenant -> {NAME: value}; each tenant's sandboxes get only theirs.")
@setting_option("--concurrency", type=click.IntRange(1, 256), setting="worker_concurrency",
                help="Slots: batches run at once.")
@setting_option("--batch-size", type=click.IntRange(1, 10000), setting="worker_batch_size",
                help="Most jobs a slot leases at once (all of one tenant).")
@setting_option("--lease-seconds", type=click.FloatRange(0.5, 86400), setting="worker_lease_seconds",
                help="A batch's lease, heartbeated three times per period.")
@setting_option("--poll-seconds", type=click.FloatRange(0.05, 60), setting="worker_poll_seconds",
                help="Polling fallback when no NOTIFY arrives.")
@setting_option("--backoff-base", type=click.FloatRange(0, 3600), setting="worker_backoff_base",
                help="Retry backoff base in seconds (full jitter, doubling per attempt).")
@setting_option("--backoff-cap", type=click.FloatRange(0, 86400), setting="worker_backoff_cap",
                help="The longest retry backoff in seconds.")
@setting_option("--fair-by", type=click.Choice(["jobs", "runtime"]), setting="worker_fair_by",
                help="DRR cost: one unit per job, or measured run seconds.")
@setting_option("--quantum-seconds", type=click.FloatRange(0.001, 3600), setting="worker_quantum_seconds",
                help="With --fair-by runtime: credit per turn and unit of weight.")
@setting_option("--interactive-share", type=click.FloatRange(0, 1), setting="worker_interactive_share",
                help="Share of slots reserved for interactive work (lent out when unused).")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              help="Serve Prometheus /metrics on 127.0.0.1:PORT.")
@click.option("--on-dead", default=None, help="Command run with each dead job as JSON on stdin.")
@click.option("--on-dead-url", default=None, help="URL each dead job is POSTed to as JSON.")
@click.option("--log-format", type=click.Choice(["json", "text"]), default=None,
              help="Default: text with a live progress line on a terminal, JSON lines otherwise.")
@click.option("--once", is_flag=True, help="Drain what is runnable now, then exit.")
@setting_option("--snapshots", type=click.Choice(["auto", "off"]), setting="worker_snapshots",
                help="Restore sandboxes from the app's warm template where the driver can (gvisor).")
@setting_option("--keep-warm", type=click.FloatRange(0, 86400), setting="worker_keep_warm",
                help="Keep a tenant's sandbox this many idle seconds for its next batch (0: never).")
@setting_option("--max-batches-per-sandbox", type=click.IntRange(1, 100000),
                setting="worker_max_batches_per_sandbox",
                help="Batches a kept-warm sandbox serves before it is replaced.")
@click.option("--hibernate-after", type=click.FloatRange(0, 86400), default=None,
              help="Checkpoint a kept-warm sandbox to disk after this many idle seconds.")
@setting_option("--ready-pool", type=click.IntRange(0, 64), setting="worker_ready_pool",
                help="Keep this many pristine sandboxes restored (or booted) ahead of demand, "
                     "bound to a tenant only when its batch takes one.")
@setting_option("--work-mb", type=click.IntRange(1, 65536), setting="worker_work_mb",
                help="Quota of a sandbox's work dir (a tmpfs: ENOSPC past it; counts as sandbox memory).")
@click.option("--app-db", "app_db_url", default=None, metavar="URL",
              help="The application's database for inline handlers' ctx.db(), tenant-scoped "
                   "(default: TENANTQ_APP_DATABASE_URL).")
@click.option("--app-db-role", default=None, metavar="ROLE",
              help="SET LOCAL ROLE in every ctx.db() transaction (a role without BYPASSRLS).")
@click.option("--store-connections", type=click.IntRange(2, 1000), default=None,
              help="Most connections to tenantq's own database (default: concurrency + 2, at most 20).")
@click.option("--sandbox-path", "sandbox_paths", multiple=True, metavar="PATH",
              help="A file or directory sandboxes see read-only at its path, besides the modules the app "
                   "imports (data, templates, modules imported by computed names); repeatable "
                   "(also TENANTQ_SANDBOX_PATHS, comma-separated). Naming a settings or key file itself "
                   "is the only way to let a sandbox see one (docs/security.md, rule M1).")
def worker(app: str, sandbox: str, secrets_file: Path | None, concurrency: int, batch_size: int,
           lease_seconds: float, poll_seconds: float, backoff_base: float, backoff_cap: float, fair_by: str,
           quantum_seconds: float, interactive_share: float, metrics_port: int | None,
           on_dead: str | None, on_dead_url: str | None, log_format: str | None, once: bool,
           snapshots: str, keep_warm: float, max_batches_per_sandbox: int,
           hibernate_after: float | None, ready_pool: int, work_mb: int, app_db_url: str | None,
           app_db_role: str | None, store_connections: int | None, sandbox_paths: tuple[str, ...]) -> None:
    """Run jobs: lease batches fairly, run them, settle every job.

    \b
    --app names the module whose @tenantq.handler functions are the kinds to run:
      tenantq worker --app myapp.jobs      (myapp/jobs.py in the current directory)
    It is imported as `python -m` would: the current directory is put on
    sys.path, then PYTHONPATH applies. A file path (myapp/jobs.py) or
    module:attr (myapp.jobs:app) is accepted too; the worker refuses to start
    when the app does not import or registers no handler.

    Prints its stats as one JSON line on stderr when it stops.
    """
    from tenantq.observe.logs import configure as configure_logs
    from tenantq.queue import Queue
    from tenantq.registry import load_app
    from tenantq.secrets import FileSecrets, NoSecrets, SecretsProvider
    from tenantq.settings import Settings

    chosen_format = configure_logs(log_format)
    if sandbox != "inline":
        # what sandboxes see of the Python installation (rule M1: a scan of
        # its trees, about half a second) while the app and the database are checked
        threading.Thread(target=_scan_installation, name="tenantq-install-scan", daemon=True).start()
    logging.getLogger("tenantq.worker").addFilter(_StatsOnce())
    secrets: SecretsProvider = FileSecrets(secrets_file) if secrets_file else NoSecrets()
    # the mistakes of a first run, each one line before anything else is
    # printed or started: an app that does not import or registers nothing,
    # then a database that is not there. Checked before the executors and
    # the dispatcher are imported (about half a second of imports), so a
    # database that does not answer is reported that much sooner.
    module = load_app(app)
    with Queue() as q:
        db_ = q.db
    db_.check()

    from tenantq.dispatch.build import build_worker
    from tenantq.dispatch.executors.warm import WarmPolicy
    from tenantq.dispatch.outcome import Backoff
    from tenantq.dispatch.worker import WorkerConfig
    from tenantq.fairness.drr import Mode
    from tenantq.observe.alerts import DeadLetterAlerts
    from tenantq.observe.logs import ProgressLine
    from tenantq.observe.queue_metrics import serve_worker_metrics
    from tenantq.tenant_data import AppDatabase

    policy = WarmPolicy(snapshots=snapshots == "auto", keep_warm_seconds=keep_warm,
                        max_batches=max_batches_per_sandbox, hibernate_after=hibernate_after,
                        max_idle=concurrency, ready_pool=ready_pool)
    app_db_config = Settings().app_database(app_db_url, app_db_role)
    app_db = AppDatabase(app_db_config).open() if app_db_config is not None else None
    # after the app database answered: one that does not is a one-line error, nothing before it
    if sandbox == "inline":
        logging.getLogger("tenantq.worker").warning(
            "--sandbox inline: every kind runs inside this process; use it for trusted code only")
    try:
        config = WorkerConfig(concurrency=concurrency, batch_size=batch_size, lease_seconds=lease_seconds,
                              poll_seconds=poll_seconds, once=once,
                              backoff=Backoff(base_seconds=backoff_base, cap_seconds=backoff_cap),
                              fair_by=Mode(fair_by), quantum_seconds=quantum_seconds,
                              interactive_share=interactive_share, store_connections=store_connections)
        w = build_worker(db_, app=module, sandbox=sandbox, config=config, policy=policy, secrets=secrets,
                         work_mb=work_mb, app_db=app_db,
                         sandbox_paths=[*Settings().sandbox_path_list(), *sandbox_paths],
                         alerts=DeadLetterAlerts(command=on_dead, url=on_dead_url))
        if metrics_port is not None:
            serve_worker_metrics(db_, metrics_port, top_tenants=Settings().metrics_top_tenants)
        _install_signal_handlers(w.stop)
        progress = None
        if chosen_format == "text" and sys.stderr.isatty():
            progress = ProgressLine(lambda: _progress(w), w.stopping)
            progress.start()
        stats = w.run()
        if progress is not None:
            progress.join(timeout=2)  # it clears its line first, so it cannot erase the stats line
    finally:
        if app_db is not None:
            app_db.close()
    click.echo(json.dumps({"worker": config.worker_id, **stats.snapshot()}), err=True)
    if w.failed:
        # the worker stopped itself because it could not carry on: non-zero exit, one line saying why
        raise TenantqError(f"worker stopped: {w.failure or 'it could not carry on; see the log above'}")


def _scan_installation() -> None:
    from tenantq.sandbox.layout import guest_python
    from tenantq.settings import Settings

    with contextlib.suppress(Exception):  # the executor does it again and reports what fails
        guest_python(Settings().data_dir)


class _StatsOnce(logging.Filter):
    """Worker.run logs its final stats, and the command prints them as its
    last stderr line (JSON, which scripts parse): drop the log record so
    they appear once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "worker %s stopped: %s"


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

