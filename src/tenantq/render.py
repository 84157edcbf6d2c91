"""Terminal rendering for the CLI (rich tables); `--json` bypasses this."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from tenantq.store.model import JobInfo

console = Console()


def _age(seconds: Any) -> str:
    if seconds is None:
        return "-"
    s = float(seconds)
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.1f}h"


def status_tables(rows: list[dict[str, Any]], tenants: list[dict[str, Any]],
                  batches: list[dict[str, Any]]) -> None:
    queues = Table(title="Queues (tenant x priority class)")
    for col in ("tenant", "class", "pending", "runnable", "running", "done", "dead", "cancelled",
                "oldest pending"):
        queues.add_column(col, justify="left" if col in ("tenant", "class") else "right")
    for r in rows:
        queues.add_row(r["tenant_id"], r["priority"], str(r["pending"]), str(r["runnable"]),
                       str(r["running"]), str(r["done"]), str(r["dead"]), str(r["cancelled"]),
                       _age(r["oldest_pending_seconds"]))
    console.print(queues)
    fair = Table(title="Tenants")
    for col in ("tenant", "weight", "max sandboxes", "running batches", "deficit", "egress"):
        fair.add_column(col, justify="left" if col in ("tenant", "egress") else "right",
                        overflow="fold" if col == "egress" else "ellipsis")
    for t in tenants:
        cap = "-" if t["max_sandboxes"] is None else str(t["max_sandboxes"])
        fair.add_row(t["tenant_id"], str(t["weight"]), cap, str(t["live_batches"]),
                     f"{float(t['deficit']):.1f}", ", ".join(t.get("egress") or []) or "none")
    console.print(fair)
    if batches:
        live = Table(title="Running batches")
        for col in ("batch", "tenant", "class", "driver", "jobs", "age", "worker"):
            live.add_column(col)
        for b in batches:
            live.add_row(str(b["batch_id"]), b["tenant_id"], b["priority"], b["sandbox_driver"],
                         str(b["job_count"]), _age(b["age_seconds"]), b["worker_id"])
        console.print(live)


def job_panel(info: JobInfo) -> None:
    table = Table(show_header=False, title=f"Job {info.id}")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("tenant", info.tenant_id)
    table.add_row("kind", info.kind)
    table.add_row("priority", info.priority)
    table.add_row("status", info.status)
    table.add_row("attempts", f"{info.attempts} of {info.max_attempts}")
    table.add_row("run after", str(info.run_after))
    table.add_row("created", str(info.created_at))
    if info.finished_at:
        table.add_row("finished", str(info.finished_at))
    if info.lease_owner:
        table.add_row("lease", f"batch {info.batch_id} held by {info.lease_owner} "
                               f"until {info.lease_expires_at}")
    table.add_row("payload", _preview(info.payload))
    if info.result is not None:
        table.add_row("result", _preview(info.result))
    if info.last_error:
        table.add_row("last error", info.last_error)
    for blocked in info.egress_blocked:
        table.add_row("egress blocked", f"{blocked['reason']} (batch {blocked['batch_id']})")
    for reason in info.why_waiting:
        table.add_row("waiting", reason)
    console.print(table)


def dead_table(rows: list[dict[str, Any]]) -> None:
    table = Table(title=f"Dead jobs ({len(rows)})")
    for col in ("id", "tenant", "kind", "attempts", "died", "last error"):
        table.add_column(col)
    for r in rows:
        error = (r["last_error"] or "").splitlines()[0][:100] if r["last_error"] else ""
        table.add_row(str(r["id"]), r["tenant_id"], r["kind"], f"{r['attempts']}/{r['max_attempts']}",
                      str(r["finished_at"])[:19], error)
    console.print(table)


def _preview(value: Any, limit: int = 400) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."
