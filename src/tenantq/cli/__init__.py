"""`tenantq ...`: the command line, a thin layer over Queue and Worker. Bad
input exits non-zero with one line on stderr and changes nothing.

One module per noun: jobs.py (enqueue, status, job, jobs, cancel, dead),
worker.py, tenants.py (tenant, kind, rates), schedules.py, sandboxes.py,
templates.py and admin.py (migrate, prune, dashboard, reap, db); the
helpers they share are in _common.py. Heavy modules (the queue, the
executors) are imported inside the commands, so `tenantq --help` and
`tenantq status` load only what they use.

The commands are importable from here (`from tenantq.cli import worker`:
a click command, e.g. for a Django management command)."""

from __future__ import annotations

import click

from tenantq import __version__
from tenantq.cli._common import run
from tenantq.cli.admin import dashboard, db, migrate, prune, reap
from tenantq.cli.jobs import cancel, dead, enqueue, job, jobs, status
from tenantq.cli.sandboxes import sandbox
from tenantq.cli.schedules import schedule
from tenantq.cli.templates import template
from tenantq.cli.tenants import kind, rates, tenant
from tenantq.cli.worker import worker


@click.group()
@click.version_option(__version__, prog_name="tenantq")
def cli() -> None:
    """tenantq: fair, isolated background jobs for multi-tenant apps."""


for _command in (migrate, enqueue, status, job, cancel, prune, dead, dashboard, reap, db, worker, template,
                 sandbox, jobs, schedule, tenant, kind, rates):
    cli.add_command(_command)


def main() -> None:
    """The `tenantq` console script (and `python -m tenantq.cli`)."""
    run(cli)


__all__ = ["cancel", "cli", "dashboard", "db", "dead", "enqueue", "job", "jobs", "kind", "main", "migrate",
           "prune", "rates", "reap", "sandbox", "schedule", "status", "template", "tenant", "worker"]
