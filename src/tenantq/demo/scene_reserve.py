"""Scene 2: the interactive reservation.

The whale's bulk import takes every slot, including the ones reserved for
interactive work (lent while interactive has nothing to run). Then a few
small tenants each send one interactive report, one at a time, each while
all slots run bulk batches: the lent batch is recalled (it finishes the row
it runs and releases the rest, attempts refunded) and the report runs. The
table sets each report's wait beside the wait strict priority alone would
have given it (until the first running bulk batch ended), computed.
"""

from __future__ import annotations

import functools

from rich.table import Table

from tenantq.demo import workload
from tenantq.demo.report import legend, secs
from tenantq.demo.stage import Stage, within
from tenantq.demo.stats import ClassWaits, p50, reservation_scene, top
from tenantq.fairness.slots import reserved_slots

# the bulk import lasts about this long (sized from scene 1's measured pace)
BULK_SECONDS = 5.0


def bulk_rows(stage: Stage, seconds_per_row: float | None) -> int:
    """Enough bulk rows to keep every slot busy through the arrivals: about
    BULK_SECONDS of work, and at least three rounds of batches."""
    floor = 3 * stage.concurrency * stage.batch_size
    if not seconds_per_row:
        return floor
    return max(floor, min(20_000, round(BULK_SECONDS * stage.concurrency / seconds_per_row)))


def run(stage: Stage, *, seconds_per_row: float | None, start_row: int) -> list[ClassWaits]:
    c = stage.console
    reserved = reserved_slots(stage.concurrency, stage.worker.config.interactive_share)
    n = bulk_rows(stage, seconds_per_row)
    c.rule("[bold]Scene 2: the interactive reservation")
    c.print(f"The whale enqueues {n} rows in class [bold]bulk[/]; they take all {stage.concurrency} slots, "
            f"the {reserved} reserved for interactive work included (lent while it has none). Then "
            f"{', '.join(workload.INTERACTIVE_ARRIVALS)} each send one [bold]interactive[/] report, one at a "
            "time, each while every slot runs a bulk batch.")
    recalled0 = stage.worker.stats.snapshot()["recalled"]
    bulk_ids = stage.q.enqueue_many(workload.whale_rows(n, priority="bulk", start=start_row))
    report_ids: list[int] = []
    saturated = 0
    for tenant in workload.INTERACTIVE_ARRIVALS:
        if within(lambda: stage.live_batches("bulk") >= stage.concurrency, 60, "bulk batches in every slot"):
            saturated += 1
        job_id = stage.q.enqueue_many([workload.interactive_report(tenant)])[0]
        report_ids.append(job_id)
        within(functools.partial(stage.leased, job_id), 60, f"{tenant}'s report to be leased")
    elapsed = stage.drain([*bulk_ids, *report_ids], f"draining in {stage.driver} sandboxes")
    recalled = stage.worker.stats.snapshot()["recalled"] - recalled0
    rows, spr = reservation_scene(stage.jobs([*bulk_ids, *report_ids]),
                                  stage.batches("bulk", "interactive"),
                                  fallback_seconds_per_row=seconds_per_row)
    table = Table(title="Scene 2: waits per class (the interactive reservation)")
    for col in ("tenant", "interactive", "wait", "without reservation*", "bulk rows", "bulk p50", "bulk max"):
        table.add_column(col, justify="left" if col == "tenant" else "right")
    for r in rows:
        table.add_row(r.tenant, str(len(r.interactive)) if r.interactive else "-",
                      secs(top(r.interactive)), secs(top(r.without_reservation)),
                      str(r.bulk_jobs) if r.bulk_jobs else "-", secs(p50(r.bulk)), secs(top(r.bulk)))
    c.print(table)
    per_row = "-" if spr is None else f"{spr * 1000:.1f} ms"
    legend(c, [
        "wait: from enqueue to the lease of the batch that ran the job, first attempts only (as in scene 1). "
        "interactive: the tenant's reports; their wait column is the longest one.",
        f"Why so short: {reserved} of the {stage.concurrency} slots (30%, rounded up) are reserved for "
        "interactive work. While it had none, they ran the whale's bulk batches on loan; when a report "
        "arrived, the lent batch finished the row it was running, released the rest (attempts refunded) "
        f"and the slot took the report. Bulk batches recalled: {recalled}. All slots ran bulk batches at "
        f"{saturated} of the {len(report_ids)} arrivals.",
        "without reservation* (computed, not measured): until the first of the bulk batches running at the "
        "report's arrival would have ended: measured for the batches that ran to the end, their rows x "
        f"{per_row} (a bulk row's measured slot time) for the recalled ones. Strict priority alone "
        "(interactive first at every claim, no reserved slots) would have kept the report waiting that long.",
        f"bulk p50/max: the whale's {n} rows wait behind their own backlog (the bulk import took "
        f"{elapsed:.1f} s on all slots); rows released by a recall wait again for the next bulk batch.",
    ])
    return rows
