"""Scene 3: tenant data through a host function.

Each tenant's monthly report runs in its tenant's sandbox, which holds no
database credential and has no route to Postgres; it reads its orders with
`ctx.call("orders.for_month", {"month": 9})`. The host function runs in the
dispatcher, in a transaction scoped to the batch's tenant under FORCE ROW
LEVEL SECURITY (demo/appdb.py). Mallory's own code, in mallory's sandbox,
goes after acme's orders: acme's id in the args, SQL in the args, a
function its handler does not declare, the database itself. The table
checks each report against the seed; each try is printed with what it got.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.markup import escape
from rich.table import Table

from tenantq import JobSpec
from tenantq.demo import appdb, workload
from tenantq.demo.report import legend
from tenantq.demo.stage import Row, Stage

REPORT = "report.monthly"
SNOOP = "report.snoop"


def jobs() -> list[JobSpec]:
    """One report per seeded tenant, and mallory's try at the victim's orders."""
    specs = [JobSpec(tenant, REPORT, {"month": appdb.MONTH}) for tenant in appdb.ORDERS]
    # one attempt: it is not flaky, a retry would only repeat the same tries
    specs.append(JobSpec(workload.HOSTILE, SNOOP, {"month": appdb.MONTH, "victim": appdb.VICTIM},
                         max_attempts=1))
    return specs


@dataclass(frozen=True)
class ReportScene:
    reports: tuple[Row, ...]         # the report.monthly jobs, seed order
    snoop: Row | None                # mallory's job
    attempts: tuple[dict[str, Any], ...]

    def right(self, row: Row) -> bool:
        """Done, the seed's count and total, and only its own tenant's rows."""
        result = row["result"] if isinstance(row["result"], dict) else {}
        orders, total = appdb.expected(str(row["tenant_id"]))
        return (row["status"] == "done" and result.get("orders") == orders and result.get("total") == total
                and result.get("tenants_seen") in ([row["tenant_id"]], []))

    def leaked(self) -> list[dict[str, Any]]:
        """Tries that got any row of a tenant other than the snooper's."""
        return [a for a in self.attempts if set(a.get("tenants_seen") or ()) - {workload.HOSTILE}]


def report_scene(rows: Sequence[Row]) -> ReportScene:
    snoop = next((r for r in rows if r["kind"] == SNOOP), None)
    result = snoop["result"] if snoop is not None and isinstance(snoop["result"], dict) else {}
    attempts = result.get("attempts")
    return ReportScene(reports=tuple(r for r in rows if r["kind"] == REPORT), snoop=snoop,
                       attempts=tuple(a for a in attempts if isinstance(a, dict))
                       if isinstance(attempts, list) else ())


def run(stage: Stage, *, app_schema: str, reader: str) -> ReportScene:
    c = stage.console
    c.rule("[bold]Scene 3: tenant data through a host function")
    where = (f"in their own {stage.driver} sandbox, with no database credential"
             if stage.driver != "inline" else "inline (no sandbox on this machine)")
    c.print(f"{len(appdb.ORDERS)} tenants each run a monthly report ([bold]{REPORT}[/]) {where}; the report "
            "reads its orders through the host function [bold]orders.for_month[/], which runs in the "
            f"dispatcher. {workload.HOSTILE}'s own code ([bold]{SNOOP}[/]) goes after "
            f"{appdb.VICTIM}'s orders.")
    ids = stage.q.enqueue_many(jobs())
    elapsed = stage.drain(ids, f"reports in {stage.driver} sandboxes", timeout=180)
    scene = report_scene(stage.jobs(ids))
    table = Table(title=f"Scene 3: monthly reports (month {appdb.MONTH}) read through orders.for_month")
    for col in ("tenant", "job", "orders", "total", "seeded*", "rows of", "right"):
        table.add_column(col, justify="right" if col in ("orders", "total", "seeded*") else "left")
    for row in scene.reports:
        # what the sandbox returned is the guest's say: shown, never trusted to be well-formed
        result = row["result"] if isinstance(row["result"], dict) else {}
        orders, total = appdb.expected(str(row["tenant_id"]))
        got = row["status"] == "done"
        table.add_row(row["tenant_id"], f"#{row['id']}", _num(result.get("orders")) if got else "-",
                      _num(result.get("total")) if got else "-", f"{orders} / {total:,}",
                      escape(_tenants(result.get("tenants_seen"))),
                      "yes" if scene.right(row) else f"NO: {escape(_error(row))}")
    c.print(table)
    legend(c, [
        f"orders / total: what the sandboxed {REPORT} job computed from the rows orders.for_month "
        f"returned for month {appdb.MONTH}. The function ran in the dispatcher, in a transaction of the "
        f"batch's tenant (app.current_tenant_id, set by the host) as role {reader} (NOLOGIN, neither "
        f"owner nor superuser), on {app_schema}.orders under FORCE ROW LEVEL SECURITY.",
        f"seeded*: (computed, not read back) the tenant's month-{appdb.MONTH} orders as the demo inserted "
        "them, count / sum; every tenant also has orders in other months, which a right report leaves out.",
        "rows of: the tenant_id of every row the report got. The function's query has no "
        "WHERE tenant_id: only the policy kept the other tenants' rows out.",
        "right: the report matches the seed and saw only its own tenant's rows. job: the job's id "
        "(tenantq job ID shows its result).",
    ])
    _print_attempts(stage, scene)
    legend(c, [
        "why: the host function's tenant is the batch's, from the host's records, whatever the args say; "
        "the month is a bound parameter, so the SQL reached Postgres as a value it could not read as a "
        "number; a handler may call only the host functions its host_functions= lists; a sandbox holds "
        "no database credential and has no route to Postgres.",
    ])
    _verdict(stage, scene, elapsed)
    return scene


def _num(value: object) -> str:
    return f"{value:,}" if isinstance(value, int) else "-" if value is None else str(value)


def _tenants(value: object) -> str:
    return ", ".join(map(str, value)) if isinstance(value, list) and value else "none"


def _error(row: Row) -> str:
    return str(row["last_error"] or row["status"]).strip().splitlines()[0][:120]


def _print_attempts(stage: Stage, scene: ReportScene) -> None:
    c = stage.console
    snoop = scene.snoop
    if snoop is None or snoop["status"] != "done":
        c.print(f"{workload.HOSTILE}'s {SNOOP} job did not finish: "
                f"{escape(_error(snoop) if snoop is not None else 'not found')}")
        return
    where = "in its sandbox" if stage.driver != "inline" else "inline"
    c.print(f"{workload.HOSTILE}'s {SNOOP} job ({where}) goes after {appdb.VICTIM}'s orders:")
    for a in scene.attempts:
        if "error" in a:
            got = str(a["error"])
        else:
            n = a.get("orders")
            got = (f"{_num(n)} order{'' if n == 1 else 's'}, total {_num(a.get('total'))}: "
                   f"rows of {_tenants(a.get('tenants_seen'))}")
        c.print(f"  {escape(str(a.get('try')))}: {escape(str(a.get('call')))} -> {escape(got)}",
                soft_wrap=True, highlight=False)


def _verdict(stage: Stage, scene: ReportScene, elapsed: float) -> None:
    right = sum(scene.right(r) for r in scene.reports)
    leaked = scene.leaked()
    # a try that neither failed nor leaked saw the snooper's own rows (or none)
    failed = sum("error" in a for a in scene.attempts)
    own = len(scene.attempts) - failed - len(leaked)
    ok = right == len(scene.reports) and not leaked and len(scene.attempts) > 0
    style = "bold" if ok else "bold red"
    leak = (f"{len(leaked)} got another tenant's rows: " + json.dumps([a.get("try") for a in leaked])
            if leaked else f"none got a row of {appdb.VICTIM}'s")
    stage.console.print(
        f"[{style}]verdict: {right} of {len(scene.reports)} reports right, each from its own tenant's rows "
        f"only; {workload.HOSTILE}'s {len(scene.attempts)} tries at {appdb.VICTIM}'s orders: {escape(leak)} "
        f"({own} got {workload.HOSTILE}'s own rows only, {failed} failed with their reason)[/]; "
        f"ran in {elapsed:.1f} s", soft_wrap=True, highlight=False)
