"""Scene 1: deficit round robin between tenants of ONE class.

The whale's import (default class, no cap, weight 1) takes every slot; then
the small tenants' work arrives, in the same class, with no cap and the same
weight either. Only the rotation decides who runs next: each tenant with work
gets one batch per round. The table sets their measured waits beside the
wait a FIFO queue would have given them, computed from the same rows.
Isolation rides along: poison jobs, egress attempts, scoped secrets.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from tenantq.demo import workload
from tenantq.demo.report import legend, secs
from tenantq.demo.stage import Row, Stage, within
from tenantq.demo.stats import FairScene, fair_scene, p50, top


def run(stage: Stage, *, whale_jobs: int, reports: int, poison: tuple[str, ...],
        crm: str | None) -> tuple[FairScene, list[Row]]:
    c = stage.console
    c.rule("[bold]Scene 1: deficit round robin between tenants of one class")
    c.print(f"The whale enqueues a {whale_jobs}-row import. Once it holds all {stage.concurrency} slots, "
            f"{len(workload.SMALL_TENANTS) + 1} small tenants enqueue their work. Every job is in class "
            "[bold]default[/]; no tenant has a cap or a weight: only the rotation decides who runs next.")
    whale_ids = stage.q.enqueue_many(workload.whale_rows(whale_jobs))
    # the import is under way: every slot runs a whale batch and rows are done
    within(lambda: stage.live_batches("default", workload.WHALE) >= stage.concurrency
           and stage.count(whale_ids, ("done",)) > 0, 180, "the whale's import to hold every slot")
    small_ids = stage.q.enqueue_many(workload.small_work(reports, poison, crm))
    c.print(f"{len(small_ids)} small-tenant jobs enqueued while the whale's import runs "
            f"({stage.count(whale_ids, ('done',))} of its rows done)")
    elapsed = stage.drain([*whale_ids, *small_ids], f"draining in {stage.driver} sandboxes")
    rows = stage.jobs([*whale_ids, *small_ids])
    scene = fair_scene(rows, stage.batches("default"), whale=workload.WHALE, concurrency=stage.concurrency)
    _print_table(stage, scene, elapsed)
    _print_isolation(stage, rows)
    return scene, rows


def _retried(waits: tuple[float, ...]) -> str:
    return f"{len(waits)} ({secs(max(waits))})" if waits else "-"


def _print_table(stage: Stage, s: FairScene, elapsed: float) -> None:
    c = stage.console
    table = Table(title="Scene 1: waits in class default (no caps, equal weights)")
    columns = ("tenant", "jobs", "done", "dead", "1st batch", "wait p50", "wait max", "FIFO p50*", "retried")
    for col in columns:
        table.add_column(col, justify="left" if col == "tenant" else "right")
    for t in s.tenants:
        table.add_row(t.tenant, str(t.jobs), str(t.done), str(t.dead),
                      "-" if t.first_batch is None else f"#{t.first_batch}",
                      secs(p50(t.waits)), secs(top(t.waits)), secs(p50(t.fifo)), _retried(t.retried))
    c.print(table)
    spr = s.seconds_per_row
    per_row = "-" if spr is None else f"{spr * 1000:.1f} ms"
    whale_batch = "-" if spr is None else secs(stage.batch_size * spr)
    arrival = "-" if s.arrival is None else f"+{s.arrival:.1f} s"
    legend(c, [
        "wait: from enqueue to the lease of the batch that ran the job (Postgres's clock, created_at -> "
        "started_at), first attempts only; the batch's jobs then run one after another in the tenant's "
        "sandbox. p50: the tenant's median job; max: its slowest. A small tenant's jobs fit in one batch "
        f"(up to {stage.batch_size} jobs), so they share one lease: its p50 is its max.",
        f"1st batch: the place of the tenant's first batch in the lease order. The whale was alone at first "
        f"and took batches #1-#{s.first_whale_batches} (every slot). The small tenants arrived at {arrival} "
        f"and waited for a slot: the first batch to end did so {secs(s.slot_freed)} later (a whale batch is "
        f"up to {stage.batch_size} rows, about {whale_batch}; the first ones also started their sandboxes). "
        "Then DRR visited the tenants with work in rotation, one batch each, and the whale's next batch "
        "waited its turn: a tenant later in the rotation also waited for the batches before it.",
        f"FIFO p50* (computed, not measured): the whale rows enqueued before the job and not yet leased when "
        f"it arrived ({s.whale_ahead} for the small tenants) x {per_row} (the whale's measured slot time per "
        f"row: its batches' wall time / its rows) / {s.concurrency} slots. That is where a FIFO queue "
        "would have put it; the small tenants' own jobs ahead are not counted, so it is a lower bound.",
        "retried: jobs that ran more than once (the flaky webhook; mallory's poison jobs), with the longest "
        "wait in brackets. Their started_at is their last lease, so their wait includes the failed "
        "attempt and its backoff (0.2-1 s, jittered): they are kept out of wait p50/max.",
        f"whale: its rows wait behind its own backlog, so its p50 is about half its import (done at "
        f"+{secs(s.whale_finished)}). Its FIFO p50 counts only its own rows; the other tenants' batches took "
        f"{s.others_slot_seconds:.1f} slot-seconds, about {secs(s.others_slot_seconds / s.concurrency)} "
        "on all slots: the whale gave up about that much of its time to them.",
    ])
    small, fifo = p50(s.small_waits()), p50(s.small_fifo())
    if small is not None and fifo is not None:
        ratio = f"{fifo / small:.0f}x shorter" if small > 0 else "no wait"
        c.print(f"[bold]small tenants' first attempts: wait p50 {secs(small)} (max "
                f"{secs(top(s.small_waits()))}) vs {secs(fifo)} computed for FIFO: {ratio}[/]; "
                f"drained in {elapsed:.1f} s")


def _print_isolation(stage: Stage, rows: list[Row]) -> None:
    c = stage.console
    reports: list[dict[str, Any]] = [r["result"] for r in rows
                                     if r["kind"] == "demo.render_report" and isinstance(r["result"], dict)]
    own = sum(bool(r.get("api_key_is_mine")) and r.get("secrets_seen") == ["API_KEY"] for r in reports)
    c.print(f"secrets: {own} of {len(reports)} reports saw exactly one secret, their own tenant's")
    transform = next((r for r in rows if r["kind"] == "tenantq.python"), None)
    if transform is not None:
        if transform["status"] == "done":
            c.print(f"initech's own transform ran sandboxed: result {transform['result']}")
        else:
            c.print(f"initech's own transform was refused: {str(transform['last_error'])[:80]}")
    for r in rows:
        if r["kind"] in ("demo.push_crm", "demo.exfiltrate") and isinstance(r["result"], dict):
            outcomes = {"its CRM": r["result"]["crm"]} if "crm" in r["result"] else r["result"]
            for target, outcome in outcomes.items():
                c.print(f"egress: {r['tenant_id']} -> {target}: {outcome}")
    dead = [r for r in rows if r["status"] == "dead"]
    if dead:
        c.print(f"[bold]{len(dead)} poison job(s) contained in the dead-letter list[/] "
                "(each failed alone, with its reason; the other tenants never noticed):")
        for r in dead:
            c.print(f"  {r['tenant_id']} {r['kind']} after {r['attempts']} attempt(s): "
                    f"{str(r['last_error']).splitlines()[0][:90]}")
