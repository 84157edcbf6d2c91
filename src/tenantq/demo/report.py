"""How the demo prints: numbers, legend lines under each table, the
sandboxes it used, and its closing lines (where Postgres is and how to stop
the embedded one)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from tenantq.demo.appdb import names
from tenantq.observe import metrics
from tenantq.settings import Settings
from tenantq.store.embedded import embedded_pgdata

LEGEND_PREFIX = "  · "


def secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def legend(console: Console, lines: Sequence[str]) -> None:
    """One line per term of the table above: what it measures and why."""
    width = max(60, min(console.width, 120))
    for line in lines:
        text = textwrap.fill(line, width=width, initial_indent=LEGEND_PREFIX,
                             subsequent_indent=" " * len(LEGEND_PREFIX),
                             break_on_hyphens=False, break_long_words=False)
        console.print(f"[dim]{escape(text)}[/]", soft_wrap=True)


def sandboxes_line(driver: str) -> str | None:
    if driver == "inline":
        return None
    starts = {origin: int(metrics.SANDBOX_STARTS.labels(driver, origin)._value.get())
              for origin in ("cold", "template", "hibernated", "warm")}
    return ("sandboxes: " + ", ".join(f"{n} {origin}" for origin, n in starts.items() if n)
            + " (template = restored from the app's warm snapshot; warm = the tenant's kept sandbox)")


def embedded_running(data_dir: Path) -> bool:
    return (embedded_pgdata(data_dir) / "postmaster.pid").exists()


def closing_lines(settings: Settings, schema: str, *, embedded_was_running: bool) -> list[str]:
    """Where the demo's data is and what is still running. `Database.resolve`
    uses TENANTQ_DATABASE_URL when set, else starts (or reuses) the embedded
    Postgres under the data dir and leaves it running for the next command."""
    env = f"TENANTQ_SCHEMA={schema}"
    lines = [f"Look around: {env} .venv/bin/tenantq dashboard (then open http://127.0.0.1:8080/) · "
             f"{env} .venv/bin/tenantq status · {env} .venv/bin/tenantq dead list"]
    app, reader = names(schema)
    if settings.database_url:
        lines.append(f"Postgres: the server in TENANTQ_DATABASE_URL; the demo's tables are in schema "
                     f"{schema} and its app's orders in {app} (recreated on every run; DROP SCHEMA {schema}, "
                     f"{app} CASCADE removes them; the NOLOGIN role {reader} is kept for the next run: "
                     f"DROP ROLE {reader} after that).")
        return lines
    pgdata = embedded_pgdata(settings.data_dir)
    how = "was already running" if embedded_was_running else "was started by this demo"
    lines += [
        f"The embedded Postgres {how} and is still running (data dir {pgdata}), so the next tenantq "
        "command reuses it.",
        "Stop it with: tenantq db stop   (from this checkout: .venv/bin/tenantq db stop)",
    ]
    return lines
