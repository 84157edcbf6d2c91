"""`Queue.wait` / `AsyncQueue.wait` on real Postgres: woken by the done
channel's NOTIFY (settle, cancel, the reaper), never by polling while the
LISTEN connection is up; WaitTimeout and JobNotFound; one LISTEN connection
per process whatever the number of waiters (1,000 async, 50 threads); and
waits that survive losing that connection.

Jobs are settled through the store (claim, then settle), as a worker would,
so each test controls exactly when a job ends. Every test stops the
process's listener for its schema in teardown (the listener has no public
close: see `stop_listener`)."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql
from psycopg.rows import dict_row

import tenantq
from tenantq import AsyncQueue, JobSpec, Queue
from tenantq.client import listener as listener_module
from tenantq.client.listener import (
    APPLICATION_NAME,
    FALLBACK_POLL_SECONDS,
    CompletionListener,
    listener_for,
)
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.outcome import Backoff
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.domain.records import Batch, Settlement
from tenantq.queue import POOL_MAX
from tenantq.registry import Registry
from tenantq.store import jobs
from tenantq.store.db import Database
from tenantq.testing import wait_until
from tests.integration.helpers import db_now, running

TENANT = "acme"
KIND = "demo.noop"
# generous: a notification-driven wake takes milliseconds; this only
# separates "woken" from "never woken" on a loaded 2-core machine
WAKE_SECONDS = 3.0


# -- the process's listener -----------------------------------------------------


def stop_listener(db: Database) -> None:
    """Stop and forget this process's completion listener for `db` (its
    thread and LISTEN connection), as a test must leave nothing running.
    Queues release it when they close; this also joins its thread."""
    with listener_module._listeners_lock:
        found = listener_module._listeners.pop((db.dsn, db.schema), (None, 0))[0]
    if found is None:
        return
    found._stop.set()
    thread = found._thread
    if thread is not None and thread.is_alive():
        # it looks up from its socket every IDLE_SECONDS; end its connection
        # instead, so it stops at once (quietly: it only reports the loss of a
        # connection that was listening)
        found._listening.clear()
        with db.connect() as conn:
            pid = listening_pid(conn, db)
            if pid is not None:
                conn.execute("SELECT pg_terminate_backend(%(pid)s)", {"pid": pid})
        thread.join(listener_module.IDLE_SECONDS + listener_module.RECONNECT_SECONDS[1] + 5)
        assert not thread.is_alive(), "the tenantq-waits thread did not stop"


@pytest.fixture(autouse=True)
def _stop_listener(db: Database) -> Iterator[None]:
    yield
    stop_listener(db)


@dataclass
class Entered:
    """Watches the listener's Wait step: how many waits are blocked in it
    right now (subscribed AND read a status that had not ended), and what
    each one came back with (True: woken; False: its time slice ran out).
    A waiter may be woken spuriously (the listener wakes everyone when it
    (re)connects) and re-enter: assertions look at what follows a mark."""

    inside: int = 0
    woken: list[bool] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def entered(self) -> None:
        with self.lock:
            self.inside += 1

    def left(self, woken: bool) -> None:
        with self.lock:
            self.inside -= 1
            self.woken.append(woken)

    def mark(self) -> int:
        with self.lock:
            return len(self.woken)

    def since(self, mark: int) -> list[bool]:
        with self.lock:
            return self.woken[mark:]


def instrument(listener: CompletionListener, monkeypatch: pytest.MonkeyPatch) -> Entered:
    seen = Entered()
    sync_wait, async_wait = listener.wait, listener.async_wait

    def wait(waiter: Any, timeout: float | None) -> bool:
        seen.entered()
        woken = sync_wait(waiter, timeout)
        seen.left(woken)
        return woken

    async def awaited(waiter: Any, timeout: float | None) -> bool:
        seen.entered()
        woken = await async_wait(waiter, timeout)
        seen.left(woken)
        return woken

    monkeypatch.setattr(listener, "wait", wait)
    monkeypatch.setattr(listener, "async_wait", awaited)
    return seen


# -- this process's connections, as the server sees them ----------------------------


def local_endpoints(server_port: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket this process holds to a remote
    `server_port`: the client side of its connections to Postgres, as
    pg_stat_activity shows them (client_addr, client_port)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        path = Path(f"/proc/self/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) < 10 or fields[9] not in inodes:
                continue
            addr_hex, port_hex = fields[1].split(":")
            if int(fields[2].split(":")[1], 16) != server_port:
                continue
            raw = bytes.fromhex(addr_hex)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            ip = ipaddress.ip_address(raw)
            if v6 and isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped
            found.append((str(ip), int(port_hex, 16)))
    return found


BACKENDS_SQL = """
SELECT a.pid, a.application_name, a.query
FROM pg_stat_activity a
JOIN unnest(%(ips)s::text[], %(ports)s::integer[]) AS mine(ip, port)
  ON host(a.client_addr) = mine.ip AND a.client_port = mine.port
WHERE a.datname = current_database()
"""


def _endpoint_params(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> dict[str, Any]:
    endpoints = local_endpoints(int(conn.info.port))
    if not endpoints:
        pytest.skip("counting this process's connections needs a host:port DSN (the embedded Postgres "
                    "listens on a socket); set TENANTQ_DATABASE_URL")
    return {"ips": [ip for ip, _ in endpoints], "ports": [port for _, port in endpoints]}


def my_backends(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    """The server's view of this process's connections (`conn` included)."""
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(BACKENDS_SQL, _endpoint_params(conn))
        return cur.fetchall()


async def my_backends_async(conn: psycopg.AsyncConnection[Any]) -> list[dict[str, Any]]:
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(BACKENDS_SQL, _endpoint_params(conn))
        return await cur.fetchall()


def listen_backends(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This process's tenantq-waits connections (any schema)."""
    return [r for r in rows if r["application_name"] == APPLICATION_NAME]


def listening_pid(conn: psycopg.Connection[Any], db: Database) -> int | None:
    """The pid of this process's LISTEN connection for db's done channel, once it listens."""
    for row in listen_backends(my_backends(conn)):
        if row["query"] == f'LISTEN "{db.done_channel}"':
            return int(row["pid"])
    return None


# -- ending jobs through the store --------------------------------------------------


def claim(db: Database, *, limit: int = 10) -> Batch:
    with db.connect() as conn:
        batch = jobs.claim(conn, tenant_id=TENANT, priority="default", limit=limit, worker_id="w-test",
                           driver="test", lease_seconds=30)
    assert batch is not None, "nothing to claim"
    return batch


def settle(conn: psycopg.Connection[Any], batch: Batch, status: str = "done", *,
           error: str | None = None) -> None:
    jobs.settle(conn, batch.batch_id,
                [Settlement(j.id, status, result={"job": j.id} if status == "done" else None,  # type: ignore[arg-type]
                            error=error) for j in batch.jobs],
                end_outcome="ok")


def settle_now(db: Database, batch: Batch, status: str = "done", *, error: str | None = None) -> float:
    """Settle; returns the monotonic time the commit came back."""
    with db.connect() as conn:
        settle(conn, batch, status, error=error)
        return time.monotonic()


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


@contextmanager
def in_background(fn: Callable[[], Any]) -> Iterator[Future[Any]]:
    """Run fn in a thread; yields its Future; always joins it on the way out."""
    with ThreadPoolExecutor(1, thread_name_prefix="test-wait") as pool:
        yield pool.submit(fn)


async def until(predicate: Callable[[], bool], *, timeout: float, message: str) -> None:
    """Poll `predicate` on the loop until it holds; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {message}")
        await asyncio.sleep(0.01)


def _kill(db: Database, pid: int) -> None:
    with db.connect() as conn:
        row = conn.execute("SELECT pg_terminate_backend(%(pid)s) AS ok", {"pid": pid}).fetchone()
        assert row is not None and row["ok"] is True
        wait_until(lambda: conn.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE pid = %(pid)s",
                                        {"pid": pid}).fetchone() == {"n": 0},
                   timeout=10, message=f"backend {pid} to exit")


def _listener_pid(db: Database, *, other_than: int | None = None) -> int:
    def found() -> int | None:
        with db.connect() as conn:
            pid = listening_pid(conn, db)
        return pid if pid is not None and pid != other_than else None

    return wait_until(found, timeout=15, message="this process's tenantq-waits LISTEN connection")


def warm(db: Database, monkeypatch: pytest.MonkeyPatch) -> tuple[CompletionListener, Entered]:
    """Start the process's listener for db and wait until it LISTENs (so its
    connect-time wake-everyone is over before the test's waits begin);
    returns it, instrumented."""
    listener = listener_for(db)
    listener.unsubscribe(listener.subscribe(2**62))
    _listener_pid(db)
    return listener, instrument(listener, monkeypatch)


# -- it ends: woken at once -----------------------------------------------------------


def test_wait_returns_right_after_settle(queue: Queue, db: Database,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = queue.enqueue(TENANT, KIND, {"n": 1})
    _, seen = warm(db, monkeypatch)
    with in_background(lambda: queue.wait(job_id, timeout=60)) as future:
        wait_until(lambda: seen.inside == 1, timeout=10, message="the wait to block")
        assert not future.done()
        mark = seen.mark()
        settled_at = settle_now(db, claim(db))
        info = future.result(timeout=WAKE_SECONDS + 10)
        woke_in = time.monotonic() - settled_at
    assert isinstance(info, tenantq.JobInfo)
    assert (info.id, info.status, info.result, info.attempts) == (job_id, "done", {"job": job_id}, 1)
    assert seen.since(mark) == [True], "the wait came back without being woken"
    assert woke_in < WAKE_SECONDS, f"woke {woke_in:.3f}s after the settle"
    assert queue._listener().waiting() == 0


def test_wait_on_a_job_that_already_ended_returns_at_once(queue: Queue, db: Database) -> None:
    job_id = queue.enqueue(TENANT, KIND)
    settle_now(db, claim(db))
    started = time.monotonic()
    assert queue.wait(job_id).status == "done"
    assert queue.wait(job_id, timeout=0).status == "done"  # 0: look once, do not wait
    assert time.monotonic() - started < WAKE_SECONDS


def test_wait_returns_when_a_settle_kills_the_job(queue: Queue, db: Database,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = queue.enqueue(TENANT, KIND, max_attempts=1)
    _, seen = warm(db, monkeypatch)
    with in_background(lambda: queue.wait(job_id, timeout=60)) as future:
        wait_until(lambda: seen.inside == 1, timeout=10, message="the wait to block")
        mark = seen.mark()
        settle_now(db, claim(db), "dead", error="boom: out of attempts")
        info = future.result(timeout=WAKE_SECONDS + 10)
    assert (info.status, info.last_error, info.result) == ("dead", "boom: out of attempts", None)
    assert seen.since(mark) == [True]


def test_a_retry_does_not_end_the_wait(queue: Queue, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = queue.enqueue(TENANT, KIND, max_attempts=3)
    _, seen = warm(db, monkeypatch)
    with in_background(lambda: queue.wait(job_id, timeout=60)) as future:
        wait_until(lambda: seen.inside == 1, timeout=10, message="the wait to block")
        mark = seen.mark()
        settle_now(db, claim(db), "pending", error="transient")  # back to pending: not an end
        with pytest.raises(TimeoutError):
            future.result(timeout=0.5)
        assert seen.since(mark) == [], "a retry woke the waiter"
        settle_now(db, claim(db), "done")
        info = future.result(timeout=WAKE_SECONDS + 10)
    assert (info.status, info.attempts) == ("done", 2)
    assert seen.since(mark) == [True]


def test_wait_returns_when_the_reaper_kills_the_job(queue: Queue, db: Database,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    last_try = queue.enqueue(TENANT, KIND, max_attempts=1)
    retried = queue.enqueue(TENANT, KIND, max_attempts=3)
    _, seen = warm(db, monkeypatch)
    claim(db)  # both leased; the worker "dies": nobody settles, nobody heartbeats
    with ThreadPoolExecutor(2) as pool:
        dying = pool.submit(queue.wait, last_try, timeout=60)
        going_back = pool.submit(queue.wait, retried, timeout=2)
        wait_until(lambda: seen.inside == 2, timeout=10, message="both waits to block")
        with db.connect() as conn:
            # the reaper, at a time past the 30 s lease
            reaped = jobs.expire_leases(conn, now=db_now(db) + timedelta(seconds=60))
        assert {r["id"]: r["status"] for r in reaped} == {last_try: "dead", retried: "pending"}
        info = dying.result(timeout=WAKE_SECONDS + 10)
        assert info.status == "dead" and "lease expired" in (info.last_error or ""), info
        # the other went back to pending: not an end, so its wait times out
        with pytest.raises(tenantq.WaitTimeout, match="pending"):
            going_back.result(timeout=15)


def test_wait_returns_when_the_job_is_cancelled(queue: Queue, db: Database,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = queue.enqueue(TENANT, KIND, delay=3600)
    _, seen = warm(db, monkeypatch)
    with in_background(lambda: queue.wait(job_id, timeout=60)) as future:
        wait_until(lambda: seen.inside == 1, timeout=10, message="the wait to block")
        mark = seen.mark()
        with Queue(db.dsn, schema=db.schema) as other:  # another client cancels it
            assert other.cancel(job_id) is True
        info = future.result(timeout=WAKE_SECONDS + 10)
    assert info.status == "cancelled" and info.finished_at is not None
    assert seen.since(mark) == [True]


def test_async_wait_returns_when_the_job_is_cancelled_or_settled(db: Database,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _, seen = warm(db, monkeypatch)

    async def main() -> None:
        async with AsyncQueue(db.dsn, schema=db.schema) as aq:
            cancelled = await aq.enqueue(TENANT, KIND, delay=3600)
            done = await aq.enqueue(TENANT, KIND)
            waits = [asyncio.create_task(aq.wait(cancelled, timeout=60)),
                     asyncio.create_task(aq.wait(done, timeout=60))]
            await until(lambda: seen.inside == 2, timeout=10, message="both waits to block")
            assert not any(w.done() for w in waits)
            mark = seen.mark()
            assert await aq.cancel(cancelled) is True
            await asyncio.to_thread(lambda: settle_now(db, claim(db)))
            first, second = await asyncio.wait_for(asyncio.gather(*waits), timeout=WAKE_SECONDS + 10)
            assert (first.status, second.status, second.result) == ("cancelled", "done", {"job": done})
            assert seen.since(mark) == [True, True]

    asyncio.run(main())


# -- with a real worker -------------------------------------------------------------

APP = Registry()


@tenantq.handler("wait.echo", isolation="inline", registry=APP)
def echo(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    return {"echo": payload, "actor": ctx.actor}


@tenantq.handler("wait.until_cancelled", isolation="inline", registry=APP)
def until_cancelled(payload: Any, ctx: tenantq.JobContext) -> dict[str, bool]:
    return {"cancelled": ctx.cancelled.wait(30)}


def _worker(db: Database) -> Worker:
    return Worker(db, InlineExecutor(APP), WorkerConfig(
        concurrency=1, batch_size=10, lease_seconds=30, poll_seconds=0.2,
        backoff=Backoff(base_seconds=0.0, cap_seconds=0.0), worker_id="wait-w"))


def test_wait_returns_the_result_of_a_real_worker(queue: Queue, db: Database) -> None:
    with running(_worker(db)):
        job_id = queue.enqueue(TENANT, "wait.echo", {"n": 7}, actor="usr_1")
        info = queue.wait(job_id, timeout=30)
    assert (info.status, info.result) == ("done", {"echo": {"n": 7}, "actor": "usr_1"})


def test_wait_returns_when_a_running_job_is_cancelled(queue: Queue, db: Database) -> None:
    """A running job's cancel is a request its worker carries out; the wait
    ends when the worker settles it `cancelled`."""
    with running(_worker(db)):
        job_id = queue.enqueue(TENANT, "wait.until_cancelled")
        wait_until(lambda: queue.job(job_id).status == "running", timeout=15, message="the job to start")
        with in_background(lambda: queue.wait(job_id, timeout=30)) as future:
            assert queue.cancel(job_id, by="usr_ops") is True
            info = future.result(timeout=40)
    assert info.status == "cancelled", info
    assert info.result is None


# -- it does not end ---------------------------------------------------------------


def test_timeout_raises_wait_timeout_quickly(queue: Queue, db: Database) -> None:
    job_id = queue.enqueue(TENANT, KIND)
    started = time.monotonic()
    with pytest.raises(tenantq.WaitTimeout) as caught:
        queue.wait(job_id, timeout=0.3)
    elapsed = time.monotonic() - started
    assert isinstance(caught.value, TimeoutError)
    assert 0.3 <= elapsed < 0.3 + WAKE_SECONDS, elapsed
    message = str(caught.value)
    assert "\n" not in message and str(job_id) in message and "pending" in message, message
    # 0: one look, no wait
    started = time.monotonic()
    with pytest.raises(tenantq.WaitTimeout):
        queue.wait(job_id, timeout=0)
    assert time.monotonic() - started < WAKE_SECONDS
    # the waiter is gone: nothing left subscribed
    assert queue._listener().waiting() == 0
    assert queue.job(job_id).status == "pending"


def test_async_timeout_raises_wait_timeout(db: Database) -> None:
    async def main() -> None:
        async with AsyncQueue(db.dsn, schema=db.schema) as aq:
            job_id = await aq.enqueue(TENANT, KIND)
            started = time.monotonic()
            with pytest.raises(TimeoutError) as caught:
                await aq.wait(job_id, timeout=0.3)
            assert isinstance(caught.value, tenantq.WaitTimeout)
            assert 0.3 <= time.monotonic() - started < 0.3 + WAKE_SECONDS
            assert aq._listener().waiting() == 0

    asyncio.run(main())


def test_unknown_job_raises_job_not_found(queue: Queue, db: Database) -> None:
    with pytest.raises(tenantq.JobNotFound, match="no job with id 987654"):
        queue.wait(987654, timeout=5)
    with pytest.raises(tenantq.JobNotFound):
        queue.wait(987654)  # no timeout: still answers at once

    async def main() -> None:
        async with AsyncQueue(db.dsn, schema=db.schema) as aq:
            with pytest.raises(tenantq.JobNotFound, match="987654"):
                await aq.wait(987654, timeout=5)

    asyncio.run(main())
    assert queue._listener().waiting() == 0


def test_an_async_wait_cancelled_by_its_caller_unsubscribes(db: Database) -> None:
    async def main() -> None:
        async with AsyncQueue(db.dsn, schema=db.schema) as aq:
            job_id = await aq.enqueue(TENANT, KIND)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(aq.wait(job_id), timeout=0.3)  # the task is cancelled
            assert aq._listener().waiting() == 0
            task = asyncio.create_task(aq.wait(job_id, timeout=30))
            await until(lambda: aq._listener().waiting() == 1, timeout=10, message="the wait to subscribe")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert aq._listener().waiting() == 0

    asyncio.run(main())


# notify_channel and done_channel are cut to 63 bytes: with a schema name
# over 55 characters (the settings allow 63) pg_notify would refuse them
def test_wait_in_a_schema_with_the_longest_name_allowed(server_dsn: str) -> None:
    from tenantq.store.migrate import migrate

    long_db = Database(dsn=server_dsn, schema=("tq_long_" + uuid.uuid4().hex * 2)[:63])
    assert len(long_db.schema) == 63
    try:
        migrate(long_db)
        with Queue(long_db.dsn, schema=long_db.schema) as q:
            job_id = q.enqueue(TENANT, KIND)
            with in_background(lambda: q.wait(job_id, timeout=30)) as future:
                wait_until(lambda: q._listener().waiting() == 1, timeout=10, message="the wait to subscribe")
                settle_now(long_db, claim(long_db))
                assert future.result(timeout=WAKE_SECONDS + 10).status == "done"
    finally:
        stop_listener(long_db)
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE")
                         .format(pgsql.Identifier(long_db.schema)))


@pytest.mark.parametrize(("job_id", "timeout"), [(0, None), (-3, None), (True, None), ("12", None),
                                                 (1, -1), (1, float("nan")), (1, "5")])
def test_bad_arguments_are_one_line_invalid_input(queue: Queue, job_id: Any, timeout: Any) -> None:
    with pytest.raises(tenantq.InvalidInput) as caught:
        queue.wait(job_id, timeout=timeout)
    assert "\n" not in str(caught.value)


# -- many waiters, one connection -------------------------------------------------------


@pytest.mark.slow
def test_a_thousand_async_waiters_share_one_listen_connection(db: Database,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    n = 1000
    _, seen = warm(db, monkeypatch)

    async def main() -> dict[str, Any]:
        own = await psycopg.AsyncConnection.connect(db.conninfo, autocommit=True)
        settler = db.connect()  # the worker's side: settles them all in one batch
        try:
            baseline = len(await my_backends_async(own))  # the test's own connections (and the listener)
            async with AsyncQueue(db.dsn, schema=db.schema) as aq:
                ids = await aq.enqueue_many([JobSpec(TENANT, KIND, {"i": i}) for i in range(n)])
                woke: dict[int, float] = {}

                async def one(job_id: int) -> tenantq.JobInfo:
                    info = await aq.wait(job_id, timeout=120)
                    woke[job_id] = time.monotonic()
                    return info

                started = time.monotonic()
                tasks = [asyncio.create_task(one(j)) for j in ids]
                await until(lambda: seen.inside == n, timeout=60, message=f"{n} waits to block")
                assert not any(t.done() for t in tasks), "a wait ended before its job did"
                blocked_in = time.monotonic() - started
                assert aq._listener().waiting() == n

                samples: list[tuple[int, int]] = []

                async def sample() -> None:
                    rows = await my_backends_async(own)
                    samples.append((len(listen_backends(rows)), len(rows)))

                await sample()  # all blocked, nothing running
                batch = await asyncio.to_thread(claim, db, limit=n)
                assert len(batch.jobs) == n

                stop_sampling = asyncio.Event()

                async def sampler() -> None:  # the connections while the waiters wake and re-read
                    while not stop_sampling.is_set():
                        await sample()
                        await asyncio.sleep(0.05)

                sampling = asyncio.create_task(sampler())
                mark = seen.mark()
                settle_started = time.monotonic()
                await asyncio.to_thread(settle, settler, batch)
                settle_returned = time.monotonic()
                try:
                    infos = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
                finally:
                    stop_sampling.set()
                    await sampling
                assert [i.status for i in infos] == ["done"] * n
                assert [i.result for i in infos] == [{"job": j} for j in ids]
                woken = seen.since(mark)
                assert len(woken) == n and all(woken), "a wait came back without being woken"
                return {
                    "baseline": baseline, "samples": samples, "blocked_in": blocked_in,
                    "settle_seconds": settle_returned - settle_started,
                    "from_start": [woke[j] - settle_started for j in ids],
                    "from_commit": [woke[j] - settle_returned for j in ids],
                }
        finally:
            settler.close()
            await own.close()

    out = asyncio.run(main())
    listen_counts = sorted({s[0] for s in out["samples"]})
    peak = max(s[1] for s in out["samples"])
    from_start, from_commit = out["from_start"], out["from_commit"]
    print(f"\n{n} async waiters: tenantq-waits connections of this process in every sample: {listen_counts} "
          f"({len(out['samples'])} samples); this process's connections: peak {peak}, baseline "
          f"{out['baseline']} (the test's own 2 + the listener), so {peak - out['baseline']} more "
          f"(AsyncQueue pool max {POOL_MAX}); all {n} blocked {out['blocked_in']:.2f}s after the first "
          f"wait() call; settle of {n} in one batch took {out['settle_seconds'] * 1000:.0f} ms; "
          f"settle-start->wake p50 {statistics.median(from_start) * 1000:.0f} ms, "
          f"p99 {percentile(from_start, 99) * 1000:.0f} ms, max {max(from_start) * 1000:.0f} ms; "
          f"commit->wake p50 {statistics.median(from_commit) * 1000:.0f} ms, "
          f"p99 {percentile(from_commit, 99) * 1000:.0f} ms")
    assert listen_counts == [1], out["samples"]
    # the baseline already counts the (warmed) listener: on top only the pool
    assert peak <= out["baseline"] + POOL_MAX, out["samples"]


def test_fifty_sync_waiter_threads_share_one_listen_connection(queue: Queue, db: Database,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    n = 50
    ids = queue.enqueue_many([JobSpec(TENANT, KIND, {"i": i}) for i in range(n)])
    _, seen = warm(db, monkeypatch)
    woke: dict[int, float] = {}

    def one(job_id: int) -> tenantq.JobInfo:
        info = queue.wait(job_id, timeout=60)
        woke[job_id] = time.monotonic()
        return info

    with db.connect() as own, ThreadPoolExecutor(n, thread_name_prefix="waiter") as pool:
        baseline = len(my_backends(own))  # own + queue's pool (1 so far) + the listener
        futures = [pool.submit(one, j) for j in ids]
        wait_until(lambda: seen.inside == n, timeout=30, message=f"{n} waits to block")
        assert not any(f.done() for f in futures)
        rows = my_backends(own)
        listening = listen_backends(rows)
        assert len(listening) == 1, listening
        assert len(rows) <= baseline + POOL_MAX, rows
        # waiting holds no pool connection: another call gets one at once
        started = time.monotonic()
        assert queue.job(ids[0]).status == "pending"
        assert time.monotonic() - started < WAKE_SECONDS
        mark = seen.mark()
        settled_at = settle_now(db, claim(db, limit=n))
        infos = [f.result(timeout=60) for f in futures]
    assert [i.status for i in infos] == ["done"] * n
    woken = seen.since(mark)
    assert len(woken) == n and all(woken)
    latencies = [woke[j] - settled_at for j in ids]
    print(f"\n{n} sync waiter threads: 1 tenantq-waits connection, {len(rows)} connections of this "
          f"process while waiting (baseline {baseline}); commit->wake "
          f"p50 {statistics.median(latencies) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")


def test_sync_and_async_waiters_of_several_queues_share_one_listener(queue: Queue, db: Database) -> None:
    job_id = queue.enqueue(TENANT, KIND)

    async def main() -> None:
        async with AsyncQueue(db.dsn, schema=db.schema) as aq:
            with Queue(db.dsn, schema=db.schema) as second, ThreadPoolExecutor(2) as pool:
                threads = [pool.submit(queue.wait, job_id, timeout=60),
                           pool.submit(second.wait, job_id, timeout=60)]
                task = asyncio.create_task(aq.wait(job_id, timeout=60))
                assert queue._listener() is second._listener() is aq._listener()
                await until(lambda: queue._listener().waiting() == 3, timeout=10,
                            message="3 subscribed waits")
                # a wait subscribes before the listener's thread has connected:
                # wait for it to LISTEN, then count
                await asyncio.to_thread(_listener_pid, db)
                with db.connect() as own:
                    assert len(listen_backends(my_backends(own))) == 1
                await asyncio.to_thread(lambda: settle_now(db, claim(db)))
                info = await asyncio.wait_for(task, timeout=WAKE_SECONDS + 10)
                assert info.status == "done"
                assert [t.result(timeout=WAKE_SECONDS + 10).status for t in threads] == ["done", "done"]

    asyncio.run(main())


def test_a_waiter_is_woken_by_its_own_job_and_no_other(queue: Queue, db: Database,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The wake-up is per waiter: another job's end (its notification names
    only that job) does not wake a wait for this one."""
    other, mine = queue.enqueue(TENANT, KIND), queue.enqueue(TENANT, KIND)
    _, seen = warm(db, monkeypatch)
    with in_background(lambda: queue.wait(mine, timeout=60)) as waiting:
        wait_until(lambda: seen.inside == 1, timeout=10, message="the wait for `mine` to block")
        mark = seen.mark()
        with in_background(lambda: queue.wait(other, timeout=60)) as other_wait:
            wait_until(lambda: seen.inside == 2, timeout=10, message="the wait for `other` to block")
            batch = claim(db, limit=1)
            assert [j.id for j in batch.jobs] == [other]
            settle_now(db, batch)
            assert other_wait.result(timeout=WAKE_SECONDS + 10).status == "done"
        # the notification has come (it woke `other`'s waiter); `mine`'s was not woken
        assert seen.since(mark) == [True] and seen.inside == 1, seen.since(mark)
        assert not waiting.done()
        settle_now(db, claim(db))
        assert waiting.result(timeout=WAKE_SECONDS + 10).status == "done"


# -- the LISTEN connection goes away ----------------------------------------------------


def test_a_wait_survives_its_listen_connection_being_terminated(queue: Queue, db: Database,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = queue.enqueue(TENANT, KIND)
    _, seen = warm(db, monkeypatch)
    with in_background(lambda: queue.wait(job_id, timeout=60)) as future:
        wait_until(lambda: seen.inside == 1, timeout=10, message="the wait to block")
        first = _listener_pid(db)
        _kill(db, first)
        settled_at = settle_now(db, claim(db))  # at once: perhaps before LISTEN is back
        info = future.result(timeout=30)
        returned_in = time.monotonic() - settled_at
    assert info.status == "done"
    assert returned_in < FALLBACK_POLL_SECONDS + WAKE_SECONDS, f"returned {returned_in:.2f}s after the settle"
    # it reconnects (a new backend, still one) and wakes by notification again
    second = _listener_pid(db, other_than=first)
    with db.connect() as own:
        assert len(listen_backends(my_backends(own))) == 1
    next_job = queue.enqueue(TENANT, KIND)
    with in_background(lambda: queue.wait(next_job, timeout=60)) as future:
        wait_until(lambda: seen.inside == 1, timeout=10, message="the next wait to block")
        mark = seen.mark()
        settle_now(db, claim(db))
        assert future.result(timeout=WAKE_SECONDS + 10).status == "done"
    assert seen.since(mark) == [True]
    assert second != first


class _Unreachable:
    """Stands in for the listener's Database while the server refuses it."""

    def __init__(self, db: Database) -> None:
        self.done_channel = db.done_channel
        self.attempts = 0

    def connect(self, **_: object) -> Any:
        self.attempts += 1
        raise psycopg.OperationalError("connection refused (test)")


def test_waiters_poll_while_the_listen_connection_cannot_come_back(queue: Queue, db: Database,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = queue.enqueue(TENANT, KIND)
    listener, seen = warm(db, monkeypatch)
    with in_background(lambda: queue.wait(job_id, timeout=60)) as future:
        wait_until(lambda: seen.inside == 1, timeout=10, message="the wait to block")
        pid = _listener_pid(db)
        unreachable = _Unreachable(db)
        monkeypatch.setattr(listener, "db", unreachable)
        try:
            _kill(db, pid)
            wait_until(lambda: unreachable.attempts >= 1, timeout=10, message="a failed reconnect")
            with db.connect() as own:
                assert listen_backends(my_backends(own)) == [], "nothing can LISTEN meanwhile"
            mark = seen.mark()
            settled_at = settle_now(db, claim(db))
            info = future.result(timeout=30)
            returned_in = time.monotonic() - settled_at
        finally:
            monkeypatch.setattr(listener, "db", db)
    assert info.status == "done"
    # no notification could arrive (nothing listened): the wait re-read its job on its
    # own, after a slice of FALLBACK_POLL_SECONDS or a wake-everyone of a failed reconnect
    assert returned_in < FALLBACK_POLL_SECONDS + WAKE_SECONDS, returned_in
    assert seen.since(mark), "the wait never re-read its job"
