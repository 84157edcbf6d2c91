"""Harness shared by the peer adapters (pgqueuer_bench.py, procrastinate_bench.py).

Runs in the peers' own virtualenv (see setup.py), so it imports nothing from tenantq. An adapter
subclasses `Peer` (connect + install schema, enqueue one / in bulk, start / stop a worker) and calls
`main()`; the two scenarios below are written once against that interface, so both peers are
measured by exactly the same procedure. Tenants don't exist in the peers: every job goes to one
queue/entrypoint with the tenant name in its payload.

Scenario `fairness` (times are time.time(), producer and worker share one process and one clock):
enqueue the whale's N jobs in bulk, start the worker, wait until --warmup-jobs whale jobs have run
(N = 0: no whale; instead run one probe job and let the worker go idle), then enqueue --small-jobs
jobs for each of --small-tenants tenants (one bulk call per tenant; a job's enqueue time is taken
just before its call) and wait until every small job has started or --deadline seconds (counted
from the first small enqueue) have passed. A small job's wait is the time.time() at the start of its
handler minus its enqueue time. whale_done_before_last_small counts whale jobs finished (warm-up
included) when the last small job started, or at the deadline.

Scenario `throughput`: enqueue --single jobs one call each, then --jobs in one bulk call, then
start the worker and time until every job has run and the worker has stopped (so its results
are persisted); the database is checked afterwards to hold every job as completed. With
--processes N, N - 1 more worker processes of the same settings are spawned and connected before
the clock starts, and start with the timed one (`Helpers`).

Output: logs on stderr, one JSON object as the last line of stdout.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

log = logging.getLogger("bench.peers")

WHALE = "whale"
PROBE = "probe"
IDLE_SETTLE_S = 0.5  # after the probe job, before the small jobs of the empty-queue baseline


@dataclass(frozen=True)
class JobPayload:
    """What every benchmark job carries: its tenant and its index within the tenant."""

    tenant: str
    seq: int

    def to_dict(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "seq": self.seq}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobPayload:
        return cls(tenant=str(data["tenant"]), seq=int(data["seq"]))


Handler = Callable[[JobPayload], Awaitable[None]]


class Peer(abc.ABC):
    """One peer queue, as an adapter sees it. Methods run on the benchmark's event loop."""

    system: ClassVar[str]
    #: How the fairness handler waits handler-ms (reported as "handler").
    handler_kind: ClassVar[str] = "asyncio.sleep"

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.worker_task: asyncio.Task[None] | None = None

    @property
    @abc.abstractmethod
    def version(self) -> str: ...

    @classmethod
    def run_async(cls, main: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
        """Run the scenario on the event loop this peer's own CLI would use (stdlib asyncio here)."""
        return asyncio.run(main)

    async def open(self, dsn: str) -> None:
        """Connect to the (fresh, empty) database and install the peer's schema."""
        await self.attach(dsn)
        await self.install()

    @abc.abstractmethod
    async def attach(self, dsn: str) -> None:
        """Connect to a database whose schema is installed (another process's worker)."""

    @abc.abstractmethod
    async def install(self) -> None:
        """Install the peer's schema, as its CLI does."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release every connection; must be safe to call after a partial `open`."""

    @abc.abstractmethod
    async def enqueue_one(self, job: JobPayload) -> None: ...

    @abc.abstractmethod
    async def enqueue_bulk(self, jobs: list[JobPayload]) -> None: ...

    @abc.abstractmethod
    async def start_worker(self, handler: Handler, concurrency: int | None, scenario: str) -> None:
        """Start the peer's worker as `self.worker_task`, running `handler` for each job.

        concurrency None means the peer's best throughput setting (scenario "throughput" only).
        """

    @abc.abstractmethod
    async def stop_worker(self) -> None:
        """Ask the worker to stop the peer's graceful way and wait for it (running jobs finish)."""

    @abc.abstractmethod
    async def count_completed(self) -> int:
        """How many jobs the database records as successfully completed."""

    @abc.abstractmethod
    def settings(self) -> dict[str, Any]:
        """The worker/enqueue settings in effect, for the JSON output."""


# --- scratch database ----------------------------------------------------------------------------


def with_dbname(dsn: str, dbname: str) -> str:
    """The postgresql:// URL `dsn` pointing at database `dbname` instead."""
    parts = urlsplit(dsn)
    if parts.scheme not in ("postgres", "postgresql"):
        raise SystemExit(f"--dsn must be a postgresql:// URL, got {dsn!r}")
    return urlunsplit(parts._replace(path=f"/{dbname}"))


@contextmanager
def scratch_database(dsn: str, system: str) -> Iterator[str]:
    """Create `bench_<system>_<random>` on dsn's server, yield its URL, drop it afterwards (always)."""
    name = f"bench_{system}_{uuid.uuid4().hex[:10]}"
    url = with_dbname(dsn, name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    log.info("created database %s", name)
    try:
        yield url
    finally:
        # FORCE (PG 13+) terminates connections a failed run may have left behind.
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        log.info("dropped database %s", name)


# --- helpers -------------------------------------------------------------------------------------


def server_cpu_meter(dsn: str) -> Callable[[], float] | None:
    """A reading of the CPU seconds the Postgres server at `dsn` has used
    (its postmaster, its live processes and the ones it has reaped: ended
    backends count too), or None when the server is not on this machine or
    its files or /proc cannot be read. Shared with tenantq's side
    (bench/throughput.py), so both sides measure the server the same way."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SELECT current_setting('data_directory'), pg_backend_pid()").fetchone()
            assert row is not None
            with open(f"{row[0]}/postmaster.pid") as pid_file:
                root = int(pid_file.readline())
            # this server's postmaster, seen from here: our backend is its child
            with open(f"/proc/{root}/task/{root}/children") as listing:
                if str(row[1]) not in listing.read().split():
                    return None
    except (psycopg.Error, OSError, ValueError):
        return None

    def cpu_seconds(pid: int | str, *, reaped: bool) -> float:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0  # it ended between the listing and the read: its time moves to cutime
        used = int(fields[11]) + int(fields[12])  # utime, stime
        return (used + (int(fields[13]) + int(fields[14]) if reaped else 0)) / tick

    def reading() -> float:
        with open(f"/proc/{root}/task/{root}/children") as listing:
            children = listing.read().split()
        return cpu_seconds(root, reaped=True) + sum(cpu_seconds(c, reaped=False) for c in children)

    return reading


async def wait_or_fail(peer: Peer, event: asyncio.Event, timeout: float | None) -> bool:
    """Wait for `event` for up to `timeout` seconds; raise if the worker task dies meanwhile."""
    assert peer.worker_task is not None
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter, peer.worker_task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if event.is_set():
        return True
    if peer.worker_task.done():
        peer.worker_task.result()  # re-raises the worker's exception, if any
        raise RuntimeError(f"{peer.system} worker stopped unexpectedly")
    return False


def rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("inf")


# --- scenario: fairness --------------------------------------------------------------------------


@dataclass
class FairnessRecorder:
    """Handler-side bookkeeping: when each small job started, how many whale jobs finished."""

    small_total: int
    warmup_target: int
    enqueued_at: dict[JobPayload, float] = field(default_factory=dict)
    started_at: dict[JobPayload, float] = field(default_factory=dict)
    whale_done: int = 0
    whale_done_at_last_small: int = 0
    warmed_up: asyncio.Event = field(default_factory=asyncio.Event)
    all_small_started: asyncio.Event = field(default_factory=asyncio.Event)
    probe_done: asyncio.Event = field(default_factory=asyncio.Event)

    def handler(self, sleep_s: float) -> Handler:
        async def handle(job: JobPayload) -> None:
            if job.tenant == PROBE:
                self.probe_done.set()
                return
            if job.tenant != WHALE:
                # A retried/duplicated delivery must not overwrite the first start.
                self.started_at.setdefault(job, time.time())
                self.whale_done_at_last_small = self.whale_done
                if len(self.started_at) >= self.small_total:
                    self.all_small_started.set()
            await asyncio.sleep(sleep_s)
            if job.tenant == WHALE:
                self.whale_done += 1
                if self.whale_done >= self.warmup_target:
                    self.warmed_up.set()

        return handle


async def fairness(peer: Peer, dsn: str) -> dict[str, Any]:
    a = peer.args
    small = [[JobPayload(f"small{t}", i) for i in range(a.small_jobs)] for t in range(a.small_tenants)]
    rec = FairnessRecorder(
        small_total=a.small_tenants * a.small_jobs,
        warmup_target=min(a.warmup_jobs, a.whale),
    )
    await peer.open(dsn)
    try:
        if a.whale:
            t0 = time.perf_counter()
            await peer.enqueue_bulk([JobPayload(WHALE, i) for i in range(a.whale)])
            log.info("enqueued %d whale jobs in %.2fs", a.whale, time.perf_counter() - t0)
        await peer.start_worker(rec.handler(a.handler_ms / 1000), a.concurrency, "fairness")
        try:
            if a.whale:
                if not await wait_or_fail(peer, rec.warmed_up, a.deadline):
                    raise RuntimeError(f"warm-up: {rec.whale_done} whale jobs ran in {a.deadline}s")
                log.info("warm-up done: %d whale jobs ran", rec.whale_done)
            else:
                # Empty-queue baseline: run one probe job through the same bulk path first, so the
                # waits measure pick-up by an idle worker, not worker start-up or a cold first enqueue.
                await peer.enqueue_bulk([JobPayload(PROBE, 0)])
                if not await wait_or_fail(peer, rec.probe_done, a.deadline):
                    raise RuntimeError(f"warm-up: the probe job did not run in {a.deadline}s")
                await wait_or_fail(peer, asyncio.Event(), IDLE_SETTLE_S)
            whale_done_at_small_enqueue = rec.whale_done
            first_enqueue = time.time()
            for jobs in small:
                now = time.time()
                rec.enqueued_at.update(dict.fromkeys(jobs, now))
                await peer.enqueue_bulk(jobs)
            remaining = a.deadline - (time.time() - first_enqueue)
            all_started = await wait_or_fail(peer, rec.all_small_started, max(remaining, 0.0))
            elapsed = time.time() - first_enqueue
            if not all_started:
                rec.whale_done_at_last_small = rec.whale_done  # the deadline ends the count
            log.info("%d/%d small jobs started after %.2fs", len(rec.started_at), rec.small_total, elapsed)
        finally:
            await peer.stop_worker()
    finally:
        await peer.close()
    waits: dict[str, list[float]] = {f"small{t}": [] for t in range(a.small_tenants)}
    for job, started in sorted(rec.started_at.items(), key=lambda kv: (kv[0].tenant, kv[0].seq)):
        waits[job.tenant].append(round(started - rec.enqueued_at[job], 6))
    return {
        "system": peer.system,
        "version": peer.version,
        "scenario": "fairness",
        "whale": a.whale,
        "concurrency": a.concurrency,
        "handler_ms": a.handler_ms,
        "handler": peer.handler_kind,
        "small_waits": waits,
        "unfinished_small": rec.small_total - len(rec.started_at),
        "whale_done_before_last_small": rec.whale_done_at_last_small,
        "whale_done_at_small_enqueue": whale_done_at_small_enqueue,
        "elapsed_seconds": round(elapsed, 3),
        "deadline_hit": not all_started,
        "settings": peer.settings(),
    }


# --- scenario: throughput ------------------------------------------------------------------------


async def throughput(peer: Peer, dsn: str) -> dict[str, Any]:
    a = peer.args
    total = a.single + a.jobs
    done = 0

    async def noop(job: JobPayload) -> None:
        nonlocal done
        done += 1

    single = [JobPayload(f"t{i % 10}", i) for i in range(a.single)]
    bulk = [JobPayload(f"t{i % 10}", a.single + i) for i in range(a.jobs)]
    await peer.open(dsn)
    server_cpu = server_cpu_meter(dsn)
    helpers = Helpers(type(peer), dsn, a.processes - 1)
    try:
        t0 = time.perf_counter()
        for job in single:
            await peer.enqueue_one(job)
        single_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        await peer.enqueue_bulk(bulk)
        bulk_s = time.perf_counter() - t0
        log.info("enqueue: %d single in %.2fs, %d bulk in %.2fs", a.single, single_s, a.jobs, bulk_s)
        await helpers.start()  # connected and waiting: their start-up is not timed
        server0 = server_cpu() if server_cpu else 0.0
        client0 = time.process_time()
        t0 = time.perf_counter()
        helpers.go.set()
        await peer.start_worker(noop, a.concurrency, "throughput")
        try:
            while done + helpers.done() < total:
                await asyncio.sleep(0.001)
                if peer.worker_task is not None and peer.worker_task.done():
                    peer.worker_task.result()
                    raise RuntimeError(f"{peer.system} worker stopped unexpectedly")
                helpers.check()
            handlers_s = time.perf_counter() - t0
        finally:
            helpers.stop.set()
            await peer.stop_worker()
            await helpers.join()
        drain_s = time.perf_counter() - t0
        client_s = time.process_time() - client0 + helpers.cpu_seconds()
        server_s = server_cpu() - server0 if server_cpu else None
        completed = await peer.count_completed()
        log.info(
            "drain: %d handlers in %.2fs (%d in other processes), workers stopped at %.2fs, "
            "%d completed in the database",
            done + helpers.done(),
            handlers_s,
            helpers.done(),
            drain_s,
            completed,
        )
        if completed != total:
            raise RuntimeError(f"{completed} of {total} jobs recorded as completed")
        big_s = 0.0
        if a.big_bulk:  # one bulk call of a large import, after the drain (not drained)
            big = [JobPayload(f"t{i % 10}", total + i) for i in range(a.big_bulk)]
            t0 = time.perf_counter()
            await peer.enqueue_bulk(big)
            big_s = time.perf_counter() - t0
    finally:
        helpers.kill()
        await peer.close()
    return {
        "system": peer.system,
        "version": peer.version,
        "scenario": "throughput",
        "enqueue_single_per_s": round(rate(a.single, single_s), 1),
        "enqueue_bulk_per_s": round(rate(a.jobs, bulk_s), 1),
        "drain_per_s": round(rate(total, drain_s), 1),
        "enqueue_big_bulk_per_s": round(rate(a.big_bulk, big_s), 1) if a.big_bulk else None,
        "drain_handlers_per_s": round(rate(total, handlers_s), 1),
        # CPU per drained job, in µs: the worker processes' own and the server's
        "drain_cpu_us": {"client": round(client_s / total * 1e6, 1),
                         "server": None if server_s is None else round(server_s / total * 1e6, 1)},
        "jobs": total,
        "settings": peer.settings(),
    }


class Helpers:
    """`--processes N`: N - 1 more worker processes of the same peer with the
    same settings, each with its own connections and event loop, as a
    deployment runs several `pgq run` / `procrastinate worker`. Started
    (spawned, connected) before the clock starts; `go` starts their workers
    together with the timed one; each publishes how many jobs it ran."""

    def __init__(self, peer_cls: type[Peer], dsn: str, n: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.counts = ctx.Array("q", max(n, 1), lock=False)
        self.cpu = ctx.Array("d", max(n, 1), lock=False)
        self.go, self.stop = ctx.Event(), ctx.Event()
        self.ready = [ctx.Event() for _ in range(n)]
        self.procs = [
            ctx.Process(target=_helper, args=(peer_cls, sys.argv[1:], dsn, i, self.counts, self.cpu,
                                              self.ready[i], self.go, self.stop), daemon=True)
            for i in range(n)
        ]

    async def start(self) -> None:
        for proc in self.procs:
            proc.start()
        for ready, proc in zip(self.ready, self.procs, strict=True):
            if not await asyncio.to_thread(ready.wait, 120):
                raise RuntimeError(f"a helper worker process did not connect (exit code {proc.exitcode})")

    def done(self) -> int:
        return sum(self.counts[i] for i in range(len(self.procs)))

    def cpu_seconds(self) -> float:
        """CPU the helpers used from `go` to their worker's stop (after join)."""
        return sum(self.cpu[i] for i in range(len(self.procs)))

    def check(self) -> None:
        for proc in self.procs:
            if proc.exitcode is not None:
                raise RuntimeError(f"a helper worker process ended early (exit code {proc.exitcode})")

    async def join(self) -> None:
        for proc in self.procs:
            await asyncio.to_thread(proc.join, 120)
            if proc.exitcode != 0:
                raise RuntimeError(f"a helper worker process failed (exit code {proc.exitcode})")

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()


def _helper(peer_cls: type[Peer], argv: list[str], dsn: str, index: int, counts: Any, cpu: Any, ready: Any,
            go: Any, stop: Any) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    peer = peer_cls(parse_args(peer_cls.system, argv))

    async def work() -> dict[str, Any]:
        done = 0

        async def noop(job: JobPayload) -> None:
            nonlocal done
            done += 1

        await peer.attach(dsn)
        try:
            ready.set()
            while not go.is_set():
                await asyncio.sleep(0.001)
            cpu0 = time.process_time()
            await peer.start_worker(noop, peer.args.concurrency, "throughput")
            try:
                while not stop.is_set():
                    counts[index] = done
                    await asyncio.sleep(0.001)
                    if peer.worker_task is not None and peer.worker_task.done():
                        peer.worker_task.result()
                        raise RuntimeError(f"{peer.system} worker stopped unexpectedly")
            finally:
                await peer.stop_worker()
                cpu[index] = time.process_time() - cpu0
            counts[index] = done
        finally:
            await peer.close()
        return {}

    peer_cls.run_async(work())


# --- command line --------------------------------------------------------------------------------


def parse_args(system: str, argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"{system}_bench.py", description=f"Benchmark {system}.")
    sub = parser.add_subparsers(dest="scenario", required=True)
    fair = sub.add_parser("fairness", help="small tenants' waits behind a whale's backlog")
    fair.add_argument("--dsn", required=True, help="postgresql:// URL; a scratch database is created there")
    fair.add_argument("--whale", type=int, required=True, help="whale backlog (0: empty-queue baseline)")
    fair.add_argument("--small-tenants", type=int, default=5)
    fair.add_argument("--small-jobs", type=int, default=10)
    fair.add_argument("--concurrency", type=int, default=8)
    fair.add_argument("--handler-ms", type=float, default=5)
    fair.add_argument("--deadline", type=float, default=60, help="seconds, from the first small enqueue")
    fair.add_argument("--warmup-jobs", type=int, default=200)
    thr = sub.add_parser("throughput", help="enqueue single/bulk and drain rates of no-op jobs")
    thr.add_argument("--dsn", required=True, help="postgresql:// URL; a scratch database is created there")
    thr.add_argument("--jobs", type=int, default=20_000, help="bulk-enqueued jobs")
    thr.add_argument("--single", type=int, default=1_000, help="jobs enqueued one call each")
    thr.add_argument("--big-bulk", type=int, default=0, help="then one bulk call of this many (not drained)")
    thr.add_argument("--concurrency", type=int, default=None, help="default: the peer's best setting")
    thr.add_argument("--processes", type=int, default=1, help="worker processes, each with these settings")
    thr.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="dequeue batch size where the peer has one; default: its best setting",
    )
    return parser.parse_args(argv)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Outside the event loop (creating/dropping the database): unwind through the `finally`s.
    raise SystemExit(128 + signum)


async def _terminable(scenario: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """Run `scenario`, turning SIGTERM into a cancellation so its `finally`s stop the worker cleanly."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await scenario


def main(peer_cls: type[Peer], argv: list[str] | None = None) -> None:
    # The peers' own loggers stay at Python's default WARNING level (as under their CLIs without -v):
    # Procrastinate logs every job at INFO, which would cost the worker time and flood stderr.
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log.setLevel(logging.INFO)
    args = parse_args(peer_cls.system, argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    peer = peer_cls(args)
    scenario = {"fairness": fairness, "throughput": throughput}[args.scenario]
    try:
        with scratch_database(args.dsn, peer_cls.system) as dsn:
            # The loop installs its own SIGTERM handler (_terminable); uvloop's is silently not called
            # when a Python-level handler was set before the loop started, so reset to the default.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                result = peer_cls.run_async(_terminable(scenario(peer, dsn)))
            finally:
                signal.signal(signal.SIGTERM, _exit_on_sigterm)
    except (asyncio.CancelledError, KeyboardInterrupt):
        log.warning("interrupted")
        sys.exit(128 + signal.SIGTERM)
    print(json.dumps(result), flush=True)
