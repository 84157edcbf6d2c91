"""What a producer pays for tenantq: one enqueue per call, and concurrent producers each enqueuing in
its own transaction; beside a bare `INSERT ... RETURNING id` + NOTIFY and PgQueuer, in one run
(issue 35, items 2-4).

A. Per call: one enqueue per call on one autocommit connection, in a loop (50 unmeasured first):
   `Queue.enqueue` (its pool; and with `conn=` a plain autocommit connection), `AsyncQueue.enqueue`
   (asyncio), the bare INSERT + NOTIFY as one prepared statement (sync and async psycopg) and as a
   pipelined BEGIN; INSERT; NOTIFY; COMMIT (one round trip), the bare INSERT alone (a reference), and
   PgQueuer's `enqueue` on each of its drivers (bench/peers/pgqueuer_producers.py). `percall_rounds`
   rounds of `n` calls, every variant once per round (short rounds, many of them: a burst of load
   from elsewhere on the machine falls on one sample of one variant); medians. The ratios are the
   medians of each round's ratio (paired: this machine's commit latency drifts by tens of percent
   over seconds, and both sides of a round's ratio see the same spell). tenantq's time / the bare
   baseline's (the faster form; async against async) has the goal <= 1.3; tenantq's rate /
   PgQueuer's best driver's, >= 1.0.
B. Concurrent producers: P producers, threads of one process each with its own connection, each
   running `BEGIN; W ms of its own work (a sleep); enqueue one job; COMMIT` in a loop, and the same
   with the work after the enqueue (`BEGIN; enqueue; W ms; COMMIT`: the transaction stays open past
   the enqueue, as a request that enqueues and goes on, or an import; this is where a lock the
   enqueue takes is held for W ms); tenantq enqueues with `conn=`, the bare baseline runs the
   one-statement INSERT + NOTIFY, PgQueuer `Queries.enqueue` on the same connection. The tenant is
   always the same (tenants 1) or drawn per transaction from 1,000 (all of them exist before the
   first run: one job each). Commits per second over `seconds` after `warmup`
   (bench/peers/producerlib.py, the one procedure for all three). Every cell runs each system once
   per round, the order rotating round by round; medians of `rounds`. PgQueuer runs on the driver
   that was fastest per call in A. The goal for tenantq / bare: >= 0.8 at W = 0, >= 0.9 at W = 10 ms.

Threads, not processes: on the 2-CPU machine this was written on, the producers' one process used
0.4-0.75 of a core (8 and 32 producers, W = 0; less with W = 10 ms) while the server's processes
took the rest, and the same producers spread over 2 processes made no difference beyond the noise
(8 producers, W = 0: tenantq 1,974 vs 2,102 commits/s, bare 2,292 vs 2,235; 32: 1,452 vs 1,482,
1,866 vs 2,408 with runs from 1,274 to 3,259). `processes` spreads them over that many processes
instead; every run reports the producers' CPU in cores (`client_cores`, in the JSON). Each system
has a schema of its own on the same server, dropped at the end.
"""

from __future__ import annotations

import itertools
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql as pgsql
from rich.console import Console
from rich.table import Table

from bench.common import machine_info, save, scratch_schema, summarise
from bench.peers.producerlib import Cell, cpu_ticks, measure
from bench.producers_support import (
    KIND,
    PgQueuer,
    bare_producers,
    bare_schema,
    drop_schema,
    percall_bare,
    percall_bare_async,
    percall_tenantq,
    percall_tenantq_async,
    tenantq_producers,
)
from tenantq import JobSpec, Queue
from tenantq.store.db import Database

console = Console(width=150)
PGQUEUER_DRIVERS = ("asyncpg", "psycopg-async", "psycopg-sync")
PER_CALL_GOAL = 1.3  # tenantq's time per call / the bare baseline's, at most
PGQUEUER_GOAL = 1.0  # tenantq's calls per second / PgQueuer's, at least
SYSTEMS = ("tenantq", "bare", "pgqueuer")


def _goal(w_ms: float) -> float:
    """tenantq / bare commits per second, at least (issue 35, item 3)."""
    return 0.8 if w_ms == 0 else 0.9


def _verdict(ratio: float, met: bool) -> str:
    return f"{ratio:.2f}x {'met' if met else 'NOT met'}"


def _percall(db: Database, statements: dict[str, str], peer: PgQueuer | None, *, n: int,
             rounds: int) -> dict[str, list[float]]:
    """ms per call of every variant, one sample per round."""
    times: dict[str, list[float]] = {}
    with Queue(db.dsn, schema=db.schema) as queue, psycopg.connect(db.dsn, autocommit=True) as conn, \
            psycopg.connect(db.dsn, autocommit=True) as caller:
        variants: dict[str, Callable[[], float]] = {
            "tenantq Queue.enqueue": lambda: percall_tenantq(queue, n),
            "tenantq Queue.enqueue(conn=)": lambda: percall_tenantq(queue, n, conn=caller),
            "tenantq AsyncQueue.enqueue": lambda: percall_tenantq_async(db, n),
            "bare, one statement": lambda: percall_bare(conn, statements, "one", n),
            "bare, pipelined": lambda: percall_bare(conn, statements, "pipeline", n),
            "bare, async, one statement": lambda: percall_bare_async(db.dsn, statements, n),
            "bare INSERT alone (no NOTIFY)": lambda: percall_bare(conn, statements, "insert", n),
        }
        for _ in range(rounds):
            for name, call in variants.items():
                times.setdefault(name, []).append(call())
            for driver in PGQUEUER_DRIVERS if peer else ():
                assert peer is not None
                answer = peer.request(op="percall", driver=driver, n=n)
                times.setdefault(f"PgQueuer {driver}", []).append(float(answer["ms"]))
    return times


PERCALL_SETTINGS = {
    "tenantq Queue.enqueue": "the queue's pool (autocommit), psycopg sync",
    "tenantq Queue.enqueue(conn=)": "conn= a plain psycopg autocommit connection",
    "tenantq AsyncQueue.enqueue": "the queue's async pool, stdlib asyncio",
    "bare, one statement": "WITH i AS (INSERT .. RETURNING id), n AS (SELECT pg_notify(..)), prepared",
    "bare, pipelined": "pipeline: BEGIN; INSERT .. RETURNING id; NOTIFY; COMMIT, one round trip",
    "bare, async, one statement": "psycopg AsyncConnection, stdlib asyncio, prepared",
    "bare INSERT alone (no NOTIFY)": "reference only: no wake-up at all",
    "PgQueuer asyncpg": "Queries(AsyncpgDriver), uvloop",
    "PgQueuer psycopg-async": "Queries(PsycopgDriver), autocommit AsyncConnection, uvloop",
    "PgQueuer psycopg-sync": "SyncQueries(SyncPsycopgDriver), autocommit Connection",
}


def _paired(numerators: list[float], denominators: list[float]) -> float:
    """The median of the rounds' ratios."""
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def _percall_table(times: dict[str, list[float]], *, n: int, rounds: int) -> dict[str, Any]:
    med = {name: statistics.median(v) for name, v in times.items()}
    bare_sync = min(("bare, one statement", "bare, pipelined"), key=lambda k: med[k])
    bases = {"tenantq Queue.enqueue": bare_sync, "tenantq Queue.enqueue(conn=)": bare_sync,
             "tenantq AsyncQueue.enqueue": "bare, async, one statement"}
    pgq = [k for k in med if k.startswith("PgQueuer")]
    best_pgq = min(pgq, key=lambda k: med[k]) if pgq else None
    table = Table(title=f"A. one enqueue per call on one connection, ms (median of {rounds} rounds x {n:,} "
                        f"calls, min-max)")
    for column in ("variant", "ms per call", "calls/s", "time / bare (goal <= 1.3)",
                   "rate / PgQueuer's best (goal >= 1.0)"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    rows: dict[str, Any] = {}
    for name, samples in times.items():
        row: dict[str, Any] = {"setting": PERCALL_SETTINGS[name], **summarise(samples), "runs_ms": samples}
        vs_bare = vs_pgq = ""
        if name in bases:
            # ratios paired by round (every variant runs once per round, so a
            # slow spell of the machine's disk falls on both sides of a ratio),
            # then the median of those
            row["time_vs_bare"] = _paired(samples, times[bases[name]])
            row["bare"] = bases[name]
            vs_bare = _verdict(row["time_vs_bare"], row["time_vs_bare"] <= PER_CALL_GOAL)
            if best_pgq:
                row["rate_vs_pgqueuer"] = _paired(times[best_pgq], samples)
                vs_pgq = _verdict(row["rate_vs_pgqueuer"], row["rate_vs_pgqueuer"] >= PGQUEUER_GOAL)
        marks = [label for label, chosen in (("the sync baseline", bare_sync), ("PgQueuer's best", best_pgq))
                 if name == chosen]
        table.add_row(name + (f" ({marks[0]})" if marks else ""),
                      f"{med[name]:.3f} ({min(samples):.3f}-{max(samples):.3f})", f"{1e3 / med[name]:,.0f}",
                      vs_bare, vs_pgq)
        rows[name] = row
    console.print(table)
    for name in times:
        against = f"; compared with {bases[name]}" if name in bases else ""
        console.print(f"  {name}: {PERCALL_SETTINGS[name]}{against}")
    return {"variants": rows, "bare_baseline": bare_sync, "pgqueuer_best": best_pgq}


def _cells(db: Database, statements: dict[str, str], peer: PgQueuer | None, driver: str | None, *,
           grid: list[tuple[int, int, float, str]], rounds: int, seconds: float, warmup: float,
           processes: int) -> list[dict[str, Any]]:
    systems = [s for s in SYSTEMS if s != "pgqueuer" or peer is not None]
    runs: dict[tuple[int, int, float, str], dict[str, list[dict[str, Any]]]] = {
        cell: {s: [] for s in systems} for cell in grid}
    tenantq_config = {"dsn": db.dsn, "schema": db.schema}
    bare_config = {"dsn": db.dsn, **statements}
    for r, (p, tenants, w, at) in itertools.product(range(rounds), grid):
        cell = Cell(producers=p, tenants=tenants, work_ms=w, seconds=seconds, warmup=warmup,
                    processes=processes, work_at=at)
        k = r % len(systems)
        for system in systems[k:] + systems[:k]:  # the order rotates round by round
            if system == "tenantq":
                result = measure(tenantq_producers, tenantq_config, cell)
            elif system == "bare":
                result = measure(bare_producers, bare_config, cell)
            else:
                assert peer is not None
                result = peer.request(op="cell", driver=driver, cell=cell.to_dict())
            runs[(p, tenants, w, at)][system].append(result)
    out = []
    for (p, tenants, w, at), by_system in runs.items():
        rates = {s: [x["commits_per_s"] for x in v] for s, v in by_system.items()}
        med = {s: statistics.median(v) for s, v in rates.items()}
        out.append({
            "producers": p, "tenants": tenants, "work_ms": w, "work_at": at,
            "commits_per_s": {s: summarise(v) for s, v in rates.items()},
            "tenantq_vs_bare": med["tenantq"] / med["bare"] if med["bare"] else None,
            # the same, from each round's two runs (side by side in time)
            "tenantq_vs_bare_paired": statistics.median(
                t / b if b else 0.0 for t, b in zip(rates["tenantq"], rates["bare"], strict=True)),
            "tenantq_vs_pgqueuer": med["tenantq"] / med["pgqueuer"] if med.get("pgqueuer") else None,
            "goal": _goal(w),
            "busy_share": statistics.median(x["busy_share"] or 0.0 for v in by_system.values() for x in v),
            "steal_share": statistics.median(x["steal_share"] or 0.0 for v in by_system.values() for x in v),
            "client_cores": {s: statistics.median(x["client_cores"] for x in v)
                             for s, v in by_system.items()},
            "runs": by_system,
        })
    return out


def _cells_table(cells: list[dict[str, Any]], *, rounds: int, seconds: float, driver: str | None,
                 processes: int) -> None:
    how = "threads of one process" if processes == 0 else f"threads in {processes} processes"
    table = Table(title=f"B. concurrent producers, commits/s (median of {rounds} rotating rounds x "
                        f"{seconds:g} s, min-max); producers are {how}")
    for column in ("P", "tenants", "BEGIN; ...; COMMIT", "tenantq (conn=)", "bare INSERT+NOTIFY",
                   f"PgQueuer ({driver or '-'})", "tenantq / bare", "goal", "tenantq / PgQueuer", "busy"):
        table.add_column(column, justify="right")
    for c in cells:
        rates = c["commits_per_s"]

        def cell(system: str, rates: dict[str, Any] = rates) -> str:
            r = rates.get(system)
            return f"{r['median']:,.0f} ({r['min']:,.0f}-{r['max']:,.0f})" if r else "-"
        ratio = c["tenantq_vs_bare"]
        met = ratio is not None and ratio >= c["goal"]
        table.add_row(str(c["producers"]), f"{c['tenants']:,}", _shape(c["work_ms"], c["work_at"]),
                      cell("tenantq"), cell("bare"), cell("pgqueuer"),
                      f"{ratio:.2f}x" if ratio is not None else "-",
                      f">= {c['goal']:.1f} {'met' if met else 'NOT met'}",
                      f"{c['tenantq_vs_pgqueuer']:.2f}x" if c["tenantq_vs_pgqueuer"] else "-",
                      f"{c['busy_share']:.0%}")
    console.print(table)
    console.print("  P: producers, each its own connection; tenants 1: every job the same tenant, else one "
                  "drawn per transaction; 'W ms; enqueue': the sleep before the enqueue, 'enqueue; W ms': "
                  "after it (the transaction stays open past the enqueue); busy: the machine's CPU, median "
                  "over the cell's runs")


def _shape(work_ms: float, work_at: str) -> str:
    if not work_ms:
        return "enqueue"
    return f"{work_ms:g} ms; enqueue" if work_at == "before" else f"enqueue; {work_ms:g} ms"


def _table_rows(dsn: str, schemas: dict[str, str]) -> dict[str, dict[str, int]]:
    """Rows and dead rows of each system's tables at the end (reported, not judged)."""
    out: dict[str, dict[str, int]] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        for system, schema in schemas.items():
            for name, live, dead in conn.execute(
                    "SELECT relname, n_live_tup, n_dead_tup FROM pg_stat_user_tables WHERE schemaname = %s "
                    "AND n_live_tup + n_dead_tup > 0 ORDER BY relname", (schema,)).fetchall():
                out[f"{system}.{name}"] = {"live": int(live), "dead": int(dead)}
    return out


def run(*, n: int = 150, percall_rounds: int = 31, rounds: int = 3, producers: tuple[int, ...] = (8, 32),
        tenants: tuple[int, ...] = (1, 1_000), work_ms: tuple[float, ...] = (0, 10),
        work_at: tuple[str, ...] = ("before", "after"), seconds: float = 1.5, warmup: float = 0.4,
        processes: int = 0, peers: bool = True) -> dict[str, Any]:
    """`work_at`: where a cell's work goes, before the enqueue or after it (one cell each; with no
    work, one cell)."""
    started = time.perf_counter()
    grid = [(p, t, w, at) for p, t, w in itertools.product(producers, tenants, work_ms)
            for at in (work_at if w else work_at[:1])]
    suffix = uuid.uuid4().hex[:8]
    schemas: dict[str, str] = {}
    peer: PgQueuer | None = None
    with scratch_schema("producers") as db:
        schemas["tenantq"] = db.schema
        try:
            schemas["bare"] = f"producers_bare_{suffix}"
            statements = bare_schema(db, schemas["bare"])
            # the tenants exist, as in an app that has been running
            with Queue(db.dsn, schema=db.schema) as queue:
                queue.enqueue_many([JobSpec(f"t{i}", KIND, {"tenant": f"t{i}", "seq": -1})
                                    for i in range(max(tenants))])
            if peers:
                schemas["pgqueuer"] = f"producers_pgq_{suffix}"
                peer = PgQueuer(db.dsn, schemas["pgqueuer"])
            info = machine_info(db)
            console.print(f"PostgreSQL {info['postgres']}, {info['cpus']} CPUs, catalog dead rows "
                          f"{info['catalog_dead_rows']:,}; PgQueuer "
                          f"{peer.versions['version'] if peer else '(not run)'}")
            phases = {"setup": time.perf_counter() - started}
            times = _percall(db, statements, peer, n=n, rounds=percall_rounds)
            phases["percall"] = time.perf_counter() - started - sum(phases.values())
            percall = _percall_table(times, n=n, rounds=percall_rounds)
            best = percall["pgqueuer_best"]
            driver = best.removeprefix("PgQueuer ") if best else None
            ticks0 = cpu_ticks()
            cells = _cells(db, statements, peer, driver, grid=grid, rounds=rounds, seconds=seconds,
                           warmup=warmup, processes=processes)
            ticks1 = cpu_ticks()
            phases["producers"] = time.perf_counter() - started - sum(phases.values())
            _cells_table(cells, rounds=rounds, seconds=seconds, driver=driver, processes=processes)
            tables = _table_rows(db.dsn, schemas)
            jobs = tables.get("tenantq.jobs", {}).get("live", 0)
            counted = sum(sum(x["commits"] for x in c["runs"]["tenantq"]) for c in cells)
            if jobs < counted:  # the statistics lag: read the table itself before failing
                with psycopg.connect(db.dsn) as conn:
                    row = conn.execute(pgsql.SQL("SELECT count(*) FROM {}.jobs").format(
                        pgsql.Identifier(db.schema))).fetchone()
                    assert row is not None and row[0] >= counted, f"{row} jobs for {counted} counted commits"
        finally:
            if peer is not None:
                peer.close()
            for system in ("pgqueuer", "bare"):
                if system in schemas:
                    drop_schema(db.dsn, schemas[system])
        end = machine_info(db)
    busy, stolen, total = (b - a for a, b in zip(ticks0, ticks1, strict=True))
    elapsed = time.perf_counter() - started
    console.print(f"machine busy {busy / total:.0%} (stolen {stolen / total:.0%}) over part B; catalog dead "
                  f"rows {info['catalog_dead_rows']:,} before, {end['catalog_dead_rows']:,} after; "
                  f"{elapsed:.0f} s in all" if total else f"{elapsed:.0f} s in all")
    payload = {"benchmark": "producers", "machine": info,
               "settings": {"n": n, "percall_rounds": percall_rounds, "rounds": rounds, "grid": grid,
                            "seconds": seconds, "warmup": warmup, "processes": processes, "peers": peers,
                            "pgqueuer_driver": driver, "pgqueuer": peer.versions if peer else None},
               "percall": percall, "producers": cells,
               "busy_share": busy / total if total else None,
               "steal_share": stolen / total if total else None,
               "catalog_dead_rows_after": end["catalog_dead_rows"], "tables": tables, "seconds": elapsed,
               "phases_s": phases}
    console.print(f"saved {save('producers', payload)}")
    return payload


if __name__ == "__main__":
    run()
