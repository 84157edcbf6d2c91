"""Terminal rendering for the CLI (rich tables); `--json` bypasses this.

No cell is ever cut short: on a terminal, cells wrap to its width; piped or
redirected, a table is as wide as its content (rich would assume 80
columns and write 'pendi…')."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tenantq.domain.formatting import duration
from tenantq.domain.records import JobInfo

# piped output: wide enough that no table is squeezed (tables only take the
# width their content needs)
PIPE_WIDTH = 10_000


def make_console() -> Console:
    return Console() if sys.stdout.isatty() else Console(width=PIPE_WIDTH)


console = make_console()


def table(*columns: str, title: str | None = None, right: tuple[str, ...] = (),
          show_header: bool = True) -> Table:
    """A table whose cells wrap (fold) instead of being cut with '…'."""
    out = Table(title=title, show_header=show_header)
    for col in columns:
        out.add_column(col, justify="right" if col in right else "left", overflow="fold")
    return out


def _age(seconds: Any) -> str:
    if seconds is None:
        return "-"
    s = float(seconds)
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.1f}h"


def fire_time(value: Any, zone: str | None = None, *, now: datetime | None = None,
              relative: bool = True) -> str:
    """A schedule's fire time in its own time zone, and how far it is:
    '2026-12-02 09:00 CET (in 20h 35m)'; '-' for none."""
    if not isinstance(value, datetime):
        return "-"
    try:
        from zoneinfo import ZoneInfo

        local = value.astimezone(ZoneInfo(zone or "UTC"))
    except (ValueError, KeyError, OSError):
        local = value.astimezone(UTC)
    shown = local.strftime("%Y-%m-%d %H:%M %Z")
    if not relative:
        return shown
    delta = (value - (now or datetime.now(UTC))).total_seconds()
    if delta >= 1:
        return f"{shown} (in {duration(delta)})"
    if delta <= -1:
        return f"{shown} ({duration(-delta)} ago)"
    return f"{shown} (now)"


def seconds_text(value: Any) -> str:
    """A retention override: 30d, 12h, 90m, 45s; 'default' for none."""
    if value is None:
        return "default"
    seconds = float(value)
    if seconds != int(seconds):
        return f"{seconds:g}s"
    whole = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if whole and whole % size == 0:
            return f"{whole // size}{unit}"
    return f"{whole}s"


def schedules_table(rows: list[dict[str, Any]], *, title: str = "Schedules", full: bool = True) -> Table:
    """Schedules, each with its next fire (in its time zone, and in how
    long). `full`: also the last fire and job and the origin (`schedule list`)."""
    columns = ["id", "tenant", "kind", "cron", "timezone", "next fire"]
    if full:
        columns += ["last fire", "last job"]
    columns += ["paused"] + (["origin"] if full else [])
    out = table(*columns, title=title, right=("id", "last job"))
    now = datetime.now(UTC)
    for r in rows:
        zone = str(r["timezone"])
        cells = [str(r["schedule_id"]), r["tenant_id"], r["kind"], r["cron"], zone,
                 "paused" if r["paused"] else fire_time(r["next_fire_at"], zone, now=now)]
        if full:
            cells += [fire_time(r["last_fire_at"], zone, now=now),
                      "-" if r["last_job_id"] is None else str(r["last_job_id"])]
        cells.append("yes" if r["paused"] else "no")
        if full:
            cells.append(str(r["origin"]))
        out.add_row(*(Text(str(cell)) for cell in cells))
    return out


def status_tables(rows: list[dict[str, Any]], tenants: list[dict[str, Any]],
                  batches: list[dict[str, Any]], schedules: list[dict[str, Any]] | None = None) -> None:
    counts = ("pending", "runnable", "running", "done", "dead", "cancelled", "oldest pending")
    queues = table("tenant", "class", *counts, title="Queues (tenant x priority class)", right=counts)
    for r in rows:
        queues.add_row(r["tenant_id"], r["priority"], str(r["pending"]), str(r["runnable"]),
                       str(r["running"]), str(r["done"]), str(r["dead"]), str(r["cancelled"]),
                       _age(r["oldest_pending_seconds"]))
    console.print(queues)
    numbers = ("weight", "max sandboxes", "running batches", "deficit")
    fair = table("tenant", *numbers, "egress", "host functions", "paused", title="Tenants", right=numbers)
    for t in tenants:
        cap = "-" if t["max_sandboxes"] is None else str(t["max_sandboxes"])
        paused = t.get("paused_at")
        allowed = t.get("host_functions")
        fair.add_row(t["tenant_id"], str(t["weight"]), cap, str(t["live_batches"]),
                     f"{float(t['deficit']):.1f}", ", ".join(t.get("egress") or []) or "none",
                     "declared" if allowed is None else ", ".join(allowed) or "none",
                     f"paused since {paused.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"
                     if isinstance(paused, datetime) else "-")
    console.print(fair)
    if batches:
        live = table("batch", "tenant", "class", "driver", "jobs", "age", "worker", title="Running batches")
        for b in batches:
            live.add_row(str(b["batch_id"]), b["tenant_id"], b["priority"], b["sandbox_driver"],
                         str(b["job_count"]), _age(b["age_seconds"]), b["worker_id"])
        console.print(live)
    if schedules:
        console.print(schedules_table(schedules, full=False))


def job_panel(info: JobInfo) -> None:
    panel = Table(show_header=False, title=f"Job {info.id}")
    panel.add_column(style="bold", overflow="fold")
    panel.add_column(overflow="fold")
    panel.add_row("tenant", info.tenant_id)
    panel.add_row("kind", info.kind)
    panel.add_row("priority", info.priority)
    panel.add_row("status", info.status)
    panel.add_row("attempts", f"{info.attempts} of {info.max_attempts}")
    panel.add_row("run after", str(info.run_after))
    panel.add_row("created", str(info.created_at))
    if info.actor:
        panel.add_row("actor", info.actor)
    if info.meta:
        panel.add_row("meta", _preview(info.meta))
    if info.finished_at:
        panel.add_row("finished", str(info.finished_at))
    if info.cancel_requested_at:
        # asked while it ran (a pending job is cancelled at once, without a request)
        note = " (its worker is stopping it)" if info.status == "running" else ""
        panel.add_row("cancel requested", f"{info.cancel_requested_at}{note}")
    if info.cancelled_by:
        panel.add_row("cancelled by", Text(info.cancelled_by))
    if info.lease_owner:
        panel.add_row("lease", f"batch {info.batch_id} held by {info.lease_owner} "
                               f"until {info.lease_expires_at}")
    panel.add_row("payload", _preview(info.payload))
    if info.result is not None:
        panel.add_row("result", _preview(info.result))
    if info.outcome_note:
        panel.add_row("outcome", info.outcome_note)
    if info.last_error:
        panel.add_row("last error", info.last_error)
    for attempt in info.attempts_history:
        # one line per attempt, oldest first: when, where, how it ended
        error = (attempt.get("error") or "").splitlines()[0][:120] if attempt.get("error") else ""
        where = f"{attempt.get('worker_id') or '?'} ({attempt.get('driver') or '?'})"
        panel.add_row(f"attempt {attempt.get('attempt')}",
                      f"{attempt.get('outcome')} {attempt.get('started_at')} -> {attempt.get('finished_at')} "
                      f"on {where}" + (f": {error}" if error else ""))
        calls = attempt.get("host_calls")
        if isinstance(calls, dict):
            panel.add_row("  host calls", host_calls_text(calls))
    for blocked in info.egress_blocked:
        panel.add_row("egress blocked", f"{blocked['reason']} (batch {blocked['batch_id']})")
    for reason in info.why_waiting:
        panel.add_row("waiting", reason)
    console.print(panel)


def host_calls_text(calls: dict[str, Any]) -> Text:
    """An attempt's host-function calls: the counts, then one line per
    listed call (name, outcome, milliseconds). Text, never markup."""
    listed = calls.get("calls") or []
    count = int(calls.get("count") or 0)
    lines = [f"{count} call(s), {int(calls.get('errors') or 0)} not ok, "
             f"{float(calls.get('seconds') or 0) * 1000:.1f} ms in all"]
    lines += [f"{c.get('name')}: {c.get('outcome')} in {float(c.get('ms') or 0):.1f} ms" for c in listed]
    if count > len(listed):
        lines.append(f"... and {count - len(listed)} more (the first {len(listed)} are listed)")
    return Text("\n".join(lines))


def dead_table(rows: list[dict[str, Any]]) -> None:
    dead = table("id", "tenant", "kind", "attempts", "died", "last error", title=f"Dead jobs ({len(rows)})")
    for r in rows:
        error = (r["last_error"] or "").splitlines()[0][:100] if r["last_error"] else ""
        dead.add_row(str(r["id"]), r["tenant_id"], r["kind"], f"{r['attempts']}/{r['max_attempts']}",
                      str(r["finished_at"])[:19], error)
    console.print(dead)


def jobs_table(rows: list[dict[str, Any]]) -> None:
    """`tenantq jobs`: one row per job, newest first. Cells are Text, never
    markup: an actor or an error may hold brackets."""
    found = table("id", "tenant", "kind", "status", "attempts", "actor", "created (UTC)", "last error",
                  title=f"Jobs ({len(rows)}, newest first)", right=("id", "attempts"))
    for r in rows:
        created = r["created_at"]
        shown = created.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if isinstance(created, datetime) \
            else str(created)
        found.add_row(*(Text(cell) for cell in (
            str(r["id"]), r["tenant_id"], r["kind"], r["status"], f"{r['attempts']}/{r['max_attempts']}",
            r["actor"] or "-", shown, (r["error_line"] or "")[:100])))
    if not rows:
        console.print("No job matches.")
        return
    console.print(found)


def _preview(value: Any, limit: int = 400) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."
