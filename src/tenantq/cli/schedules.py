"""`tenantq schedule`: periodic jobs added at run time (docs/periodic.md).

    tenantq schedule add --tenant acme --kind reports.daily --cron "0 9 * * *" --timezone Europe/Paris
    tenantq schedule list [--tenant acme] [--json]
    tenantq schedule pause ID | resume ID | rm ID

Schedules an app declares with `@tenantq.periodic` are listed too (origin
`app`); every worker of that app puts them back as it declares them, so
remove those from the code, not with `rm`.

Bad input (a cron expression or time zone that does not parse...) is one
line on stderr, a non-zero exit, and nothing changed."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from tenantq.cli._common import queue, utc_row
from tenantq.domain import validation
from tenantq.errors import InvalidInput

if TYPE_CHECKING:
    from tenantq.queue import Queue


SCHEDULE_ID = click.IntRange(1, 2**63 - 1)


def _find(q: Queue, schedule_id: int) -> dict[str, Any]:
    for row in q.schedules():
        if row["schedule_id"] == schedule_id:
            return row
    raise InvalidInput(f"no schedule with id {schedule_id} (see tenantq schedule list)")


def _next_fire(row: dict[str, Any]) -> str:
    from tenantq.render import fire_time

    return fire_time(row["next_fire_at"], str(row["timezone"]))


@click.group("schedule")
def schedule() -> None:
    """Periodic jobs: a job of KIND for TENANT at every fire time of a cron
    expression, one job per fire time however many workers run."""


@schedule.command("add")
@click.option("--tenant", required=True, help="Tenant the jobs belong to.")
@click.option("--kind", required=True, help="Handler name, e.g. reports.daily.")
@click.option("--cron", "cron", required=True, metavar="EXPR",
              help='5 fields ("*/5 * * * *": minute hour day month weekday) or @hourly, @daily, '
                   "@weekly, @monthly, @yearly.")
@click.option("--payload", default="{}", show_default=True, help="The JSON object every job gets as payload.")
@click.option("--timezone", default="UTC", show_default=True, help="IANA time zone the cron is read in.")
@click.option("--priority", default="default", show_default=True, help="interactive | default | bulk")
@click.option("--max-attempts", type=int, default=5, show_default=True)
@click.option("--name", default=None,
              help="Name it: adding the same name again (for this tenant) changes it instead.")
def schedule_add(tenant: str, kind: str, cron: str, payload: str, timezone: str, priority: str,
                 max_attempts: int, name: str | None) -> None:
    """Add a schedule (or change the one of that --name); prints its id
    and next fire."""
    parsed = validation.parse_payload(payload)
    with queue() as q:
        row = q.add_schedule(tenant, kind, cron, payload=parsed, timezone=timezone, priority=priority,
                             max_attempts=max_attempts, name=name)
    paused = " (paused)" if row["paused"] else ""
    click.echo(f"schedule {row['schedule_id']}{paused}: next fire {_next_fire(row)}")


@schedule.command("list")
@click.option("--tenant", default=None, help="Only this tenant's schedules.")
@click.option("--json", "as_json", is_flag=True, help="A JSON list (every field, times in UTC).")
def schedule_list(tenant: str | None, as_json: bool) -> None:
    """Every schedule, soonest first per tenant: id, tenant, kind, cron,
    time zone, next fire (and in how long), last fire, last job, paused,
    origin (app: @tenantq.periodic; db: schedule add)."""
    from tenantq.render import console, schedules_table

    with queue() as q:
        rows = q.schedules(tenant)
    if as_json:
        click.echo(json.dumps([utc_row(row) for row in rows], default=str, indent=2))
        return
    if not rows:
        click.echo("No schedules." if tenant is None else f"No schedules for tenant {tenant}.")
        return
    console.print(schedules_table(rows, title=f"Schedules ({len(rows)})"))


@schedule.command("rm")
@click.argument("schedule_id", type=SCHEDULE_ID)
def schedule_rm(schedule_id: int) -> None:
    """Delete a schedule (the jobs it already enqueued stay)."""
    with queue() as q:
        row = _find(q, schedule_id)
        if not q.remove_schedule(schedule_id):
            raise InvalidInput(f"no schedule with id {schedule_id} (see tenantq schedule list)")
    click.echo(f"removed schedule {schedule_id}")
    if row["origin"] == "app":
        click.echo(f"note: schedule {schedule_id} is declared by the app (@tenantq.periodic on "
                   f"{row['kind']}): its workers add it again when they start; remove it from the code",
                   err=True)


@schedule.command("pause")
@click.argument("schedule_id", type=SCHEDULE_ID)
def schedule_pause(schedule_id: int) -> None:
    """Stop firing a schedule until it is resumed."""
    with queue() as q:
        if not q.pause_schedule(schedule_id, paused=True):
            raise InvalidInput(f"no schedule with id {schedule_id} (see tenantq schedule list)")
    click.echo(f"paused schedule {schedule_id}")


@schedule.command("resume")
@click.argument("schedule_id", type=SCHEDULE_ID)
def schedule_resume(schedule_id: int) -> None:
    """Fire a paused schedule again, from its next fire time after now
    (the fires it missed while paused are not made up)."""
    with queue() as q:
        if not q.pause_schedule(schedule_id, paused=False):
            raise InvalidInput(f"no schedule with id {schedule_id} (see tenantq schedule list)")
        row = _find(q, schedule_id)
    click.echo(f"resumed schedule {schedule_id}: next fire {_next_fire(row)}")
