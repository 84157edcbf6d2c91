"""Concurrent producers, measured by one procedure for every system.

Used by bench/producers.py (tenantq and the bare INSERT + NOTIFY baseline, in tenantq's venv) and by
pgqueuer_producers.py (PgQueuer, in the peers' venv), so it imports nothing from either: the standard
library only.

A cell: `producers` producers, each with its own connection, each running transactions in a loop
until told to stop: BEGIN; `work_ms` of its own work (a sleep inside the open transaction) and
enqueue one job for a tenant drawn at random from `tenants`, the work before the enqueue
(`work_at` "before") or after it ("after": the transaction stays open W ms past the enqueue, as a
request that enqueues and then goes on, or an import enqueuing as it goes); COMMIT.

A system supplies a `Runner`: run the producers of the given slots in this process (threads for a
blocking driver: `run_threads`; asyncio tasks for an async one: `run_tasks`), each adding 1 to
`counters[slot]` per commit. The producers are spread over `processes` spawned processes (0:
threads or tasks of the calling process).

`measure` opens every producer's connection before the clock starts, lets them run `warmup`
seconds, and then counts the commits of the next `seconds` seconds (the counters are read at both
ends of the window); the machine's busy and stolen shares of that window come from /proc/stat.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

# one committed transaction of a producer: (tenant, seq) -> None
Transaction = Callable[[str, int], None]
AsyncTransaction = Callable[[str, int], Awaitable[None]]
# runner(config, cell, slots, counters, go, stop, ready): runs the slots' producers until stop.value
Runner = Callable[[dict[str, Any], "Cell", list[int], Any, Any, Any, Any], None]


@dataclass(frozen=True)
class Cell:
    producers: int
    tenants: int
    work_ms: float
    seconds: float
    warmup: float
    processes: int  # 0: the calling process's threads (or tasks)
    work_at: str = "before"  # the work before the enqueue, or "after" it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def work_s(self) -> tuple[float, float]:
        """Seconds of work (before the enqueue, after it), both inside the transaction."""
        if self.work_at not in ("before", "after"):
            raise ValueError(f"work_at must be 'before' or 'after', not {self.work_at!r}")
        work = self.work_ms / 1000
        return (work, 0.0) if self.work_at == "before" else (0.0, work)


def tenant_picker(cell: Cell, slot: int) -> Callable[[], str]:
    """A producer's tenants: always `t0`, or one of t0..t{tenants-1} at random per transaction."""
    if cell.tenants <= 1:
        return lambda: "t0"
    rng = random.Random(slot)
    return lambda: f"t{rng.randrange(cell.tenants)}"


def payload(tenant: str, seq: int) -> dict[str, Any]:
    """What every system's job carries (bench/peers/peerlib.py, JobPayload)."""
    return {"tenant": tenant, "seq": seq}


def cpu_ticks() -> tuple[int, int, int]:
    """(busy, stolen, total) CPU ticks of the machine so far (bench/soak.py, cpu_ticks)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0, 0
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq
    return busy, steal, busy + idle + iowait + steal


def _process_cpu(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far; 0.0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client_cpu(procs: list[Any]) -> float:
    """CPU seconds the producers have used so far: this process's own (threads), or their processes'."""
    if procs and isinstance(procs[0], threading.Thread):
        return time.process_time()
    return sum(_process_cpu(proc.pid) for proc in procs)


def run_threads(open_producer: Callable[[int], tuple[Transaction, Callable[[], None]]], cell: Cell,
                slots: list[int], counters: Any, go: Any, stop: Any, ready: Any) -> None:
    """One thread per slot, each looping `transaction` until stop; connections opened first."""
    opened: list[tuple[Transaction, Callable[[], None]]] = []
    failures: list[BaseException] = []

    def loop(slot: int, transaction: Transaction) -> None:
        pick = tenant_picker(cell, slot)
        go.wait()
        seq = 0
        try:
            while not stop.value:
                transaction(pick(), seq)
                seq += 1
                counters[slot] += 1
        except BaseException as exc:
            failures.append(exc)
            stop.value = 1

    try:
        for slot in slots:
            opened.append(open_producer(slot))
        threads = [threading.Thread(target=loop, args=(slot, tx), daemon=True)
                   for slot, (tx, _) in zip(slots, opened, strict=True)]
        for thread in threads:
            thread.start()
        ready.set()
        for thread in threads:
            thread.join()
    finally:
        for _, close in opened:
            close()
    if failures:
        raise failures[0]


AsyncOpened = tuple[AsyncTransaction, Callable[[], Awaitable[None]]]


async def run_tasks(open_producer: Callable[[int], Awaitable[AsyncOpened]], cell: Cell, slots: list[int],
                    counters: Any, go: Any, stop: Any, ready: Any) -> None:
    """`run_threads` for an async driver: one task per slot on the running loop."""
    opened: list[AsyncOpened] = []

    async def loop(slot: int, transaction: AsyncTransaction) -> None:
        pick = tenant_picker(cell, slot)
        seq = 0
        while not stop.value:
            await transaction(pick(), seq)
            seq += 1
            counters[slot] += 1

    try:
        for slot in slots:
            opened.append(await open_producer(slot))
        ready.set()
        await asyncio.to_thread(go.wait)
        tasks = [asyncio.create_task(loop(slot, tx)) for slot, (tx, _) in zip(slots, opened, strict=True)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            stop.value = 1
            for task in tasks:
                task.cancel()
            raise
    finally:
        for _, close in opened:
            await close()


def _split(n: int, parts: int) -> list[list[int]]:
    return [list(range(n))[i::parts] for i in range(parts)]


def measure(runner: Runner, config: dict[str, Any], cell: Cell, *,
            ready_timeout: float = 120) -> dict[str, Any]:
    """Run one cell with `runner`; commits per second in the measured window, and the machine's load."""
    ctx = multiprocessing.get_context("spawn")
    counters = ctx.Array("q", cell.producers, lock=False)
    stop = ctx.Value("b", 0, lock=False)
    go = ctx.Event()
    groups = _split(cell.producers, max(cell.processes, 1))
    readies = [ctx.Event() for _ in groups]
    procs: list[Any] = []
    failures: list[BaseException] = []
    if cell.processes == 0:
        def guarded() -> None:
            try:
                runner(config, cell, groups[0], counters, go, stop, readies[0])
            except BaseException as exc:
                failures.append(exc)
                readies[0].set()
        procs.append(threading.Thread(target=guarded, daemon=True))
    else:
        procs += [ctx.Process(target=runner, args=(config, cell, group, counters, go, stop, ready),
                              daemon=True) for group, ready in zip(groups, readies, strict=True)]
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + ready_timeout
        for ready, proc in zip(readies, procs, strict=True):
            while not ready.wait(0.1):
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"a producer {'thread' if cell.processes == 0 else 'process'} "
                                       f"did not start (exit code {getattr(proc, 'exitcode', None)})")
        if failures:
            raise failures[0]
        go.set()
        time.sleep(cell.warmup)
        before, t0, ticks0, cpu0 = list(counters), time.perf_counter(), cpu_ticks(), _client_cpu(procs)
        time.sleep(cell.seconds)
        after, t1, ticks1, cpu1 = list(counters), time.perf_counter(), cpu_ticks(), _client_cpu(procs)
    finally:
        stop.value = 1
        go.set()
        started = [p for p in procs if (p.ident if isinstance(p, threading.Thread) else p.pid) is not None]
        for proc in started:
            proc.join(30 + cell.work_ms / 1000)
        for proc in started:
            if isinstance(proc, threading.Thread):
                if proc.is_alive():
                    raise RuntimeError("a producer thread did not stop")
            elif proc.is_alive():
                proc.kill()
                raise RuntimeError("a producer process did not stop")
    if failures:
        raise failures[0]
    for proc in procs:
        if not isinstance(proc, threading.Thread) and proc.exitcode != 0:
            raise RuntimeError(f"a producer process failed (exit code {proc.exitcode})")
    per_producer = [a - b for a, b in zip(after, before, strict=True)]
    busy, stolen, total = (x1 - x0 for x1, x0 in zip(ticks1, ticks0, strict=True))
    return {
        "commits_per_s": sum(per_producer) / (t1 - t0),
        "commits": sum(per_producer),
        "seconds": t1 - t0,
        "slowest_producer_share": min(per_producer) / (sum(per_producer) / len(per_producer))
        if sum(per_producer) else 0.0,
        # the producers' CPU, in cores (threads of one process: near 1.0 means bound by the GIL)
        "client_cores": (cpu1 - cpu0) / (t1 - t0),
        "busy_share": busy / total if total > 0 else None,
        "steal_share": stolen / total if total > 0 else None,
    }
