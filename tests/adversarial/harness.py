"""The arena the adversarial tests fight in: the real worker CLI
(`tenantq worker --app tests.adversarial.attack_app --sandbox <driver>`) in a
memory cgroup of the test's own, a hostile tenant ("mallory") next to an
honest neighbour ("acme"), a host marker file the attacker knows the path of,
and (checks.py) the checks every test makes whatever it attacks
(docs/security.md, "Testing the promise"):

1. the marker is neither read (its content is in no result, error or log;
   its atime, set before its mtime, would move on any read) nor changed;
2. the neighbour's jobs finish `done`, correct, within normal waits;
3. the worker stays up (exit 0) with its peak RSS (VmHWM) within 150 MB
   of an honest run's on the same driver, and leaves nothing behind;
4. every hostile job ends with a clear reason and counted attempts.

One worker per test runs many hostile jobs next to the neighbour's:
`--once` (it must drain and exit 0) or serving (the neighbour keeps
enqueueing while the attack runs, stages enqueue more as earlier jobs
settle, then SIGTERM, and it must exit 0).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
from psycopg import sql as pgsql
from psycopg.rows import dict_row

from tenantq import JobInfo, JobSpec, Queue
from tenantq.store.db import Database
from tenantq.testing import wait_until
from tests.adversarial.checks import ACME, BASELINES, MALLORY, Checks
from tests.adversarial.host import Marker, MemoryCgroup, Watch, describe_host_pid
from tests.sandbox.conftest import Leftovers

APP = "tests.adversarial.attack_app"
TERMINAL = ("done", "dead", "cancelled")


# -- one test's arena ------------------------------------------------------------------


@dataclass
class Hostile:
    job_id: int
    kind: str
    payload: Any
    max_attempts: int
    # handed out whenever it is leased (alone in its batch, or first): its
    # attempts may never go down
    charged: bool
    # the job writes its own failure record (reason "exception" and any
    # text): a non-empty, bounded, clean last_error is all it is owed
    own_error_text: bool = False


@dataclass
class Neighbour:
    job_id: int
    n: int
    tenant: str
    enqueued_after_start: bool


@dataclass
class WorkerRun:
    returncode: int | None
    log: str
    log_bytes: int
    peak_kb: int
    elapsed: float
    started_at: datetime
    left_in_cgroup: list[str]
    cgroup_failcnt: int


class Arena(Checks):
    def __init__(self, *, driver: str, db: Database, queue: Queue, cmd: list[str], env: dict[str, str],
                 tmp_path: Path, cgroup: MemoryCgroup, marker: Marker, secrets: dict[str, dict[str, str]],
                 secrets_file: Path) -> None:
        self.driver = driver
        self.db = db
        self.queue = queue
        self.cmd = cmd
        self.env = env
        self.tmp = tmp_path
        self.cgroup = cgroup
        self.marker = marker
        self.secrets = secrets
        self.secrets_file = secrets_file
        self.hostile: list[Hostile] = []
        self.siblings: list[Neighbour] = []
        self.neighbours: list[Neighbour] = []
        self.problems: list[str] = []
        self.runs: list[WorkerRun] = []
        self.watch: Watch | None = None
        self.histories: list[dict[int, list[tuple[int, str]]]] = []
        # the test's Leftovers tracker: which sandboxes it saw come and go
        self.leftovers: Leftovers | None = None
        # jobs whose row Queue.job cannot decode (RecursionError)
        self.undecodable: set[int] = set()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._seq = 0

    # -- enqueueing -------------------------------------------------------------
    def attack(self, kind: str, payload: Any = None, *, max_attempts: int = 1, charged: bool = True,
               own_error_text: bool = False) -> int:
        job_id = self.queue.enqueue(MALLORY, kind, payload, max_attempts=max_attempts)
        self.hostile.append(Hostile(job_id, kind, payload, max_attempts, charged, own_error_text))
        if self.watch is not None:
            self.watch.watch([job_id])
        return job_id

    def attack_batch(self, *jobs: tuple[str, Any]) -> list[int]:
        """Several hostile jobs in one insert, so that one claim can take
        them together (a serving worker would otherwise lease the first
        before the second exists)."""
        specs = [JobSpec(tenant=MALLORY, kind=kind, payload=payload, max_attempts=1)
                 for kind, payload in jobs]
        ids = self.queue.enqueue_many(specs)
        for job_id, (kind, payload) in zip(ids, jobs, strict=True):
            self.hostile.append(Hostile(job_id, kind, payload, 1, False))
        if self.watch is not None:
            self.watch.watch(ids)
        return ids

    def sibling(self, n: int) -> int:
        """The hostile tenant's own honest job (its result matters)."""
        job_id = self.queue.enqueue(MALLORY, "adv.echo", {"n": n}, max_attempts=1)
        self.siblings.append(Neighbour(job_id, n, MALLORY, self.watch is not None))
        return job_id

    def neighbour(self, n: int) -> int:
        job_id = self.queue.enqueue(ACME, "adv.echo", {"n": n}, max_attempts=1)
        self.neighbours.append(Neighbour(job_id, n, ACME, self.watch is not None))
        if self.watch is not None:
            self.watch.watch([job_id])
        return job_id

    # -- running the worker -----------------------------------------------------------
    def _start(self, args: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
        self._seq += 1
        log = self.tmp / f"worker-{self._seq}.log"
        with open(log, "wb") as err:
            proc = subprocess.Popen(self.cgroup.wrap([*self.cmd, *args]), env=self.env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        self._procs.append(proc)
        return proc, log

    def worker_args(self, *extra: str, once: bool) -> list[str]:
        return ["worker", "--app", APP, "--sandbox", self.driver, "--backoff-base", "0",
                "--log-format", "json", "--secrets", str(self.secrets_file), "--poll-seconds", "0.2",
                *(["--once"] if once else []), *extra]

    def run(self, *extra: str, once: bool = True, timeout: float = 120.0,
            stages: list[Callable[[Arena], None]] | None = None, feed_neighbours: bool = True) -> WorkerRun:
        """One worker over everything enqueued. `once`: `--once`, which must
        drain and exit 0. Otherwise a serving worker: once it is up, each of
        `stages` runs (enqueues more) when every hostile and sibling job so
        far is settled; meanwhile the neighbour enqueues a job whenever its
        last one is done; after the last stage settles the worker gets
        SIGTERM and must exit 0."""
        started_at = datetime.now(UTC)
        t0 = time.monotonic()
        proc, log = self._start(self.worker_args(*extra, once=once))
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: proc.pid in self.cgroup.pids() or proc.poll() is not None, timeout=10,
                       interval=0.01, message="the worker to join its memory cgroup")
        if proc.pid not in self.cgroup.pids() and proc.poll() is None:
            self.problems.append(f"test setup: the worker {proc.pid} is not in {self.cgroup.path}")
        watch = Watch(self.db, proc.pid)
        self.watch = watch
        watch.watch([h.job_id for h in self.hostile] + [n.job_id for n in self.neighbours + self.siblings])
        watch.start()
        deadline = t0 + timeout
        returncode: int | None = None
        try:
            if once:
                returncode = self._wait_exit(proc, deadline)
            else:
                self._wait_log(log, "started:", deadline)
                self._serve(proc, deadline, feed_neighbours, list(stages or []))
                watch.read_rss()
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                returncode = self._wait_exit(proc, time.monotonic() + 45)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            watch.stop()
            self.watch = None
            self.histories.append(watch.history)
        elapsed = time.monotonic() - t0
        text = log.read_text(errors="replace")
        # whatever the worker started must be gone once it has exited
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not self.cgroup.pids(), timeout=15, interval=0.05,
                       message="the cgroup to empty")
        left = [describe_host_pid(p) for p in self.cgroup.pids()]
        run = WorkerRun(returncode, text, log.stat().st_size, watch.peak_kb, elapsed, started_at, left,
                        self.cgroup.failcnt())
        self.problems += watch.errors
        self.runs.append(run)
        return run

    def _wait_exit(self, proc: subprocess.Popen[bytes], deadline: float) -> int | None:
        try:
            return proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.problems.append(f"worker did not exit within its deadline (pid {proc.pid}); killed")
            proc.kill()
            proc.wait(timeout=30)
            return None

    def _wait_log(self, log: Path, text: str, deadline: float) -> None:
        wait_until(lambda: text in log.read_text(errors="replace"),
                   timeout=max(0.1, deadline - time.monotonic()), interval=0.05,
                   message=f"{text!r} in the worker log")

    def statuses(self, ids: list[int]) -> dict[int, str]:
        with psycopg.connect(self.db.dsn, autocommit=True) as conn:
            rows = conn.execute(pgsql.SQL("SELECT id, status FROM {} WHERE id = ANY(%s)").format(
                pgsql.Identifier(self.db.schema, "jobs")), (ids,)).fetchall()
        return {int(r[0]): str(r[1]) for r in rows}

    def _serve(self, proc: subprocess.Popen[bytes], deadline: float, feed: bool,
               stages: list[Callable[[Arena], None]]) -> None:
        """Until every stage ran and every hostile and sibling job is settled:
        keep one neighbour job in flight, each enqueued as soon as the last
        one is done."""
        fed = 0
        while True:
            if proc.poll() is not None:
                self.problems.append(f"the serving worker exited by itself with {proc.returncode}")
                return
            mine = [h.job_id for h in self.hostile] + [s.job_id for s in self.siblings]
            watched = mine + [n.job_id for n in self.neighbours]
            status = self.statuses(watched)
            if all(status.get(j) in TERMINAL for j in mine):
                if not stages:
                    break
                stages.pop(0)(self)
                continue
            last = self.neighbours[-1].job_id if self.neighbours else None
            if feed and fed < 40 and (last is None or status.get(last) in TERMINAL):
                self.neighbour(100 + fed)
                fed += 1
            if time.monotonic() > deadline:
                open_jobs = {j: s for j, s in status.items() if s not in TERMINAL}
                self.problems.append(f"jobs not settled by the deadline: {open_jobs}")
                return
            time.sleep(0.05)  # polling interval of a deadline-bounded wait
        neighbours = [n.job_id for n in self.neighbours]
        try:
            wait_until(lambda: all(s in TERMINAL for s in self.statuses(neighbours).values()),
                       timeout=max(0.1, min(30.0, deadline - time.monotonic())), interval=0.05,
                       message="the neighbour's jobs to settle")
        except TimeoutError as exc:
            self.problems.append(str(exc))

    # -- the honest baseline -----------------------------------------------------------
    def ensure_baseline(self) -> None:
        """The honest run's peak RSS on this driver (once per session), run
        before the test enqueues anything."""
        if self.driver in BASELINES:
            return
        saved = (self.hostile, self.siblings, self.neighbours)
        self.hostile, self.siblings, self.neighbours = [], [], []
        for n in range(3):
            self.neighbour(n)
            self.sibling(n)
        proc, log = self._start(self.worker_args("--concurrency", "2", once=True))
        watch = Watch(self.db, proc.pid)
        watch.start()
        try:
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            watch.stop()
        done = [self.queue.job(n.job_id).status for n in self.neighbours + self.siblings]
        assert code == 0 and done == ["done"] * 6, (
            f"the honest baseline run failed on {self.driver} (exit {code}, jobs {done}): the driver "
            f"does not work here at all:\n{log.read_text(errors='replace')[-3000:]}")
        BASELINES[self.driver] = watch.peak_kb
        self.hostile, self.siblings, self.neighbours = saved

    # -- the checks every test makes ------------------------------------------------------
    def job(self, job_id: int) -> JobInfo | SimpleNamespace:
        """The job through the public API; for a row the API cannot decode
        (a payload smuggled past the enqueue checks), its columns by SQL."""
        try:
            return self.queue.job(job_id)
        except RecursionError:
            self.undecodable.add(job_id)
        columns = ("id", "tenant_id", "kind", "status", "attempts", "max_attempts", "last_error",
                   "created_at", "started_at", "finished_at")
        query = pgsql.SQL("SELECT {}, result::text AS result FROM {} WHERE id = %s").format(
            pgsql.SQL(", ").join(pgsql.Identifier(c) for c in columns),
            pgsql.Identifier(self.db.schema, "jobs"))
        with psycopg.connect(self.db.dsn, autocommit=True, row_factory=dict_row) as conn:
            row = conn.execute(query, (job_id,)).fetchone()
        assert row is not None, job_id
        text = row.pop("result")
        return SimpleNamespace(**row, result=None if text is None else f"(undecoded) {text[:200]}")

    def cleanup(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)


