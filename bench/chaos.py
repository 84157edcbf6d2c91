"""Chaos: the reliability figures.

Scenarios, each in a scratch schema of its own, with real `tenantq worker`
processes (the CLI, as an operator runs it):

- kill9: healthy inline jobs; the worker is killed with SIGKILL at `kills`
  random points of the drain (a seeded RNG picks how many jobs must have
  settled first; the kill waits until the worker has a batch running), a new
  worker is started each time, and `worker --once` drains the rest.
- postgres_restart: the Postgres server itself is restarted while a worker
  drains; the worker must survive and settle everything.
- poison: five healthy tenants (sandboxed short jobs, enqueued in waves) next
  to a tenant whose jobs OOM, fork-bomb, segfault and spin (max_attempts 2);
  the same healthy load alone is the baseline.
- fill_tmp: the same healthy load next to a tenant whose jobs fill the
  sandbox's /tmp (they must die with "No space left on device").

Counting. enqueued, completed (done), dead come from the jobs table after the
final drain; lost = enqueued - (done + dead + cancelled) and must be 0.
Duplicated executions: for the inline scenarios every execution appends
`job attempt pid` to a shared log before it does its work, so the count is
exact (executions beyond the first, summed over jobs); each is checked
against the jobs the killed worker held at the moment of the kill. A
sandbox's work dir is private, so the sandboxed scenarios count from the
table: a job that completed with attempts == 1 ran once; attempts > 1 means
it was run again, and duplicated = sum(attempts - 1) over the healthy jobs
(the hostile jobs fail by design and use their attempts). Wait = started_at -
created_at of a healthy job's final attempt (started_at is the lease time).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from rich.console import Console
from rich.table import Table

from bench.common import machine_info, save, scratch_schema
from tenantq import JobSpec, Queue
from tenantq.errors import DatabaseUnavailable
from tenantq.store.db import Database

# wide enough for the table when the output is a file or a CI log (rich would default to 80)
console = Console(width=None if sys.stdout.isatty() else 120)
ROOT = Path(__file__).resolve().parent.parent
APP = "bench.chaos_app"
CLI = [sys.executable, "-m", "tenantq.cli"]
HEALTHY_TENANTS = [f"healthy{i}" for i in range(5)]
POISON_KINDS = ("chaos.oom", "chaos.forkbomb", "chaos.segfault", "chaos.spin")
METHOD = {
    "lost": "enqueued - (done + dead + cancelled) after the final drain; must be 0",
    "duplicates_inline": "exact: every execution appends 'job attempt pid' to a shared log before its "
                         "work; duplicated = sum over jobs of (executions - 1)",
    "duplicates_sandboxed": "from the table: attempts == 1 means the job ran once; duplicated = "
                            "sum(attempts - 1) over the healthy jobs (hostile jobs fail by design)",
    "wait": "started_at - created_at of a healthy job's final attempt (started_at = lease time)",
}


# -- processes -------------------------------------------------------------


class Procs:
    """Every process a scenario starts; stop_all() ends and reaps them."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stderr: dict[int, Path] = {}
        self._files: list[IO[bytes]] = []

    def worker(self, *args: str) -> subprocess.Popen[bytes]:
        path = self.logs / f"worker-{len(self.procs)}.stderr"
        err = open(path, "wb")  # noqa: SIM115 - closed in stop_all
        self._files.append(err)
        proc = subprocess.Popen([*CLI, "worker", "--app", APP, *args], env=self.env, cwd=ROOT,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        self.procs.append(proc)
        self.stderr[proc.pid] = path
        return proc

    def once(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, "worker", "--app", APP, "--once", *args], env=self.env, cwd=ROOT,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                              check=False)

    def text(self, proc: subprocess.Popen[bytes]) -> str:
        return self.stderr[proc.pid].read_text(errors="replace")

    def wait_started(self, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
        _until(lambda: "started: executor=" in self.text(proc) or proc.poll() is not None, timeout,
               "the worker to start")
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited {proc.returncode}: {self.text(proc)[-2000:]}")

    def terminate(self, proc: subprocess.Popen[bytes], timeout: float = 60) -> int:
        """SIGTERM (graceful: running jobs finish, sandboxes are destroyed), SIGKILL if it hangs."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(timeout=30)

    def stop_all(self) -> None:
        try:
            for proc in self.procs:
                if proc.poll() is None:
                    self.terminate(proc, timeout=30)
        finally:
            for fh in self._files:
                fh.close()


@contextlib.contextmanager
def _scenario(prefix: str) -> Iterator[tuple[Database, Procs, Path]]:
    """A scratch schema, a temp dir (logs, the workers' data dir) and the process list."""
    with scratch_schema(prefix) as db, tempfile.TemporaryDirectory(prefix=f"tenantq-{prefix}-") as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        env = dict(os.environ)
        env.update(TENANTQ_DATABASE_URL=db.dsn, TENANTQ_SCHEMA=db.schema, TENANTQ_DATA_DIR=str(data_dir),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
        procs = Procs(env, Path(tmp))
        try:
            yield db, procs, Path(tmp)
        finally:
            procs.stop_all()


def _until(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.02) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


# -- reading the table -----------------------------------------------------


def _query(db: Database, statement: str, params: Any = None) -> list[dict[str, Any]]:
    """A fresh connection per read, retried while Postgres restarts."""
    for attempt in range(100):
        try:
            with db.connect() as conn:
                return list(conn.execute(statement, params).fetchall())
        except (psycopg.OperationalError, DatabaseUnavailable):
            if attempt == 99:
                raise
            time.sleep(0.1)
    raise AssertionError("unreachable")


def _counts(db: Database) -> Counter[str]:
    rows = _query(db, "SELECT status, count(*) AS n FROM jobs GROUP BY status")
    return Counter({str(r["status"]): int(r["n"]) for r in rows})


def _settled(db: Database) -> int:
    c = _counts(db)
    return c["done"] + c["dead"] + c["cancelled"]


def _tally(db: Database, enqueued: int) -> dict[str, Any]:
    c = _counts(db)
    lost = enqueued - (c["done"] + c["dead"] + c["cancelled"])
    return {"enqueued": enqueued, "completed": c["done"], "dead": c["dead"], "cancelled": c["cancelled"],
            "pending_or_running": c["pending"] + c["running"], "lost": lost}


def _waits(db: Database, tenants: list[str]) -> dict[str, float]:
    rows = _query(db, "SELECT extract(epoch FROM started_at - created_at)::float8 AS w FROM jobs "
                      "WHERE tenant_id = ANY(%s) AND status = 'done'", (tenants,))
    waits = [float(r["w"]) for r in rows]
    if not waits:
        return {"p50": float("nan"), "max": float("nan"), "n": 0}
    return {"p50": statistics.median(waits), "max": max(waits), "n": len(waits)}


def _executions(log: Path) -> Counter[int]:
    if not log.exists():
        return Counter()
    return Counter(int(line.split()[0]) for line in log.read_text().splitlines() if line.strip())


def _worker_summaries(procs: Procs) -> list[dict[str, Any]]:
    """The JSON line each worker prints when it exits (killed ones print none)."""
    out = []
    for path in procs.stderr.values():
        lines = path.read_text(errors="replace").strip().splitlines()
        if lines and lines[-1].startswith('{"worker"'):
            out.append(json.loads(lines[-1]))
    return out


def _drain_once(db: Database, procs: Procs, enqueued: int, args: list[str], deadline: float) -> int:
    """`worker --once` until every job settled (a dead worker's leases must expire first)."""
    runs = 0
    end = time.monotonic() + deadline
    while _settled(db) < enqueued and time.monotonic() < end:
        runnable = _query(db, "SELECT count(*) AS n FROM jobs "
                              "WHERE (status = 'pending' AND run_after <= now()) "
                              "OR (status = 'running' AND batch_id IN (SELECT batch_id FROM batches "
                              "WHERE ended_at IS NULL AND lease_expires_at <= now()))")[0]["n"]
        if not runnable:
            time.sleep(0.1)  # leases of the killed worker have not expired yet
            continue
        res = procs.once(*args, timeout=max(10.0, end - time.monotonic()))
        runs += 1
        if res.returncode != 0:
            raise RuntimeError(f"worker --once exited {res.returncode}: {res.stderr[-2000:]}")
    return runs


# -- scenario 1: kill -9 ---------------------------------------------------

INLINE_ARGS = ["--sandbox", "inline", "--concurrency", "2", "--batch-size", "10", "--poll-seconds", "0.1"]


def _enqueue_records(db: Database, log: Path, jobs: int, handler_ms: float, tenants: int = 10) -> list[int]:
    with Queue(db.dsn, schema=db.schema) as q:
        payload = {"log": str(log), "ms": handler_ms}
        ids: list[int] = q.enqueue_many([JobSpec(f"t{i % tenants}", "chaos.record", payload)
                                         for i in range(jobs)])
    return ids


def _held_by(db: Database, pid: int) -> set[int]:
    rows = _query(db, "SELECT j.id FROM jobs j JOIN batches b ON b.batch_id = j.batch_id "
                      "WHERE j.status = 'running' AND b.ended_at IS NULL AND b.worker_id LIKE %s",
                  (f"%:{pid}:%",))
    return {int(r["id"]) for r in rows}


def _progress(db: Database, pid: int) -> dict[str, int]:
    """Settled jobs, pending jobs, running jobs, and the running ones worker `pid` holds, in one read."""
    row = _query(db, "SELECT count(*) FILTER (WHERE j.status IN ('done', 'dead', 'cancelled')) AS settled, "
                     "count(*) FILTER (WHERE j.status = 'pending') AS pending, "
                     "count(*) FILTER (WHERE j.status = 'running') AS running, "
                     "count(*) FILTER (WHERE j.status = 'running' AND b.ended_at IS NULL "
                     "AND b.worker_id LIKE %s) AS held "
                     "FROM jobs j LEFT JOIN batches b ON b.batch_id = j.batch_id", (f"%:{pid}:%",))[0]
    return {k: int(v) for k, v in row.items()}


def scenario_kill9(*, jobs: int, kills: int, seed: int, handler_ms: float = 3, lease: float = 2.0,
                   concurrency: int = 2, batch_size: int = 10, deadline: float = 180) -> dict[str, Any]:
    """Kill points: a seeded sample of settled-job counts, drawn below `jobs` minus what the killed
    workers may hold (so work is left at every point); the kill waits until the live worker holds a
    running batch, so it always lands mid-batch."""
    rng = random.Random(seed)
    args = ["--sandbox", "inline", "--concurrency", str(concurrency), "--batch-size", str(batch_size),
            "--poll-seconds", "0.1", "--lease-seconds", str(lease)]
    with _scenario("chaos_kill") as (db, procs, tmp):
        log = tmp / "executions.log"
        ids = _enqueue_records(db, log, jobs, handler_ms)
        room = jobs - (kills + 1) * concurrency * batch_size
        lo, hi = max(1, room // 20), max(2, room * 9 // 10)
        points = sorted(rng.sample(range(lo, hi), min(kills, hi - lo)))
        held_at_kill: Counter[int] = Counter()
        kill_log: list[dict[str, Any]] = []
        missed: list[int] = []
        t0 = time.monotonic()
        end = t0 + deadline
        worker = procs.worker(*args)
        for i, point in enumerate(points):
            while True:
                p = _progress(db, worker.pid)
                if p["settled"] >= point and p["held"]:
                    break
                if (p["pending"] == 0 and p["running"] == 0) or worker.poll() is not None:
                    break  # no work left to interrupt (or the worker died on its own)
                if time.monotonic() > end:
                    raise TimeoutError(f"kill9: waiting for {point} settled and a running batch: {p}; "
                                       f"worker log: {procs.text(worker)[-1500:]}")
                time.sleep(0.01)
            if not p["held"]:
                missed.append(point)
                break
            worker.send_signal(signal.SIGKILL)
            worker.wait(timeout=10)
            held = _held_by(db, worker.pid)  # nobody else runs: these are what the dead worker held
            held_at_kill.update(held)
            kill_log.append({"at_settled": point, "settled": _settled(db), "held": len(held),
                             "t": round(time.monotonic() - t0, 2)})
            if i < len(points) - 1:
                worker = procs.worker(*args)
        if worker.poll() is None:  # a kill point was missed: stop the live worker gracefully
            procs.terminate(worker)
        once_runs = _drain_once(db, procs, jobs, args, deadline)
        elapsed = time.monotonic() - t0
        tally = _tally(db, jobs)
        runs = _executions(log)
        dup = sum(n - 1 for n in runs.values())
        beyond = sorted(j for j, n in runs.items() if n - 1 > held_at_kill[j])
        done_ids = {int(r["id"]) for r in _query(db, "SELECT id FROM jobs WHERE status = 'done'")}
        never_ran = sorted(done_ids - set(runs))
        attempts_extra = _query(db, "SELECT coalesce(sum(attempts - 1), 0)::int AS n FROM jobs")[0]["n"]
        summaries = _worker_summaries(procs)
        return {"scenario": "kill9", **tally, "duplicated_executions": dup, "method": "execution log",
                "duplicates_beyond_held": beyond, "done_without_execution": never_ran,
                "held_at_kills": sum(held_at_kill.values()), "kills": kill_log, "missed_points": missed,
                "seed": seed,
                "attempts_beyond_first": attempts_extra, "once_drains": once_runs,
                "refused_settles": sum(s.get("refused", 0) for s in summaries),
                "waits": _waits(db, sorted({f"t{i % 10}" for i in range(10)})), "seconds": elapsed,
                "job_ids": [min(ids), max(ids)] if ids else [],
                "settings": {"jobs": jobs, "kills": kills, "handler_ms": handler_ms, "lease_seconds": lease,
                             "worker": args}}


# -- scenario 2: Postgres restart ------------------------------------------


def _restart_command(db: Database) -> tuple[list[str] | None, str]:
    """How to restart the server `db` lives on, or None and why not."""
    params = conninfo_to_dict(db.dsn)
    host, port = str(params.get("host", "")), str(params.get("port", "5432"))
    row = _query(db, "SELECT current_setting('data_directory') AS d, current_setting('port') AS p")[0]
    data_dir, server_port = Path(str(row["d"])), str(row["p"])
    if host in ("127.0.0.1", "localhost", "::1") and port == "5432" == server_port:
        versions = sorted(os.listdir("/etc/postgresql")) if os.path.isdir("/etc/postgresql") else []
        if os.geteuid() != 0:
            return None, "the machine's Postgres needs root to restart (pg_ctlcluster)"
        if not versions or not shutil.which("pg_ctlcluster"):
            return None, "no pg_ctlcluster / /etc/postgresql on this machine"
        if not str(data_dir).startswith("/var/lib/postgresql/"):
            return None, f"port 5432 is served from {data_dir}, not a Debian cluster"
        return ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main", "restart"], \
            f"pg_ctlcluster {versions[-1]} main restart"
    opts = data_dir / "postmaster.opts"
    try:
        postgres_bin = opts.read_text().split('"')[0].strip() or opts.read_text().split()[0]
    except OSError:
        return None, f"cannot read {opts} (not the embedded server, or not readable): skipped"
    pg_ctl = Path(postgres_bin).with_name("pg_ctl")
    if not pg_ctl.exists():
        return None, f"no pg_ctl next to {postgres_bin}"
    owner = pwd.getpwuid(data_dir.stat().st_uid).pw_name
    cmd = [str(pg_ctl), "-D", str(data_dir), "-w", "-t", "60", "-l", str(data_dir / "log"), "restart"]
    if owner != pwd.getpwuid(os.geteuid()).pw_name:
        if os.geteuid() != 0:
            return None, f"the embedded server belongs to {owner}; restarting it needs root"
        cmd = ["runuser", "-u", owner, "--", *cmd]
    return cmd, f"embedded server: pg_ctl restart ({data_dir})"


def _pg_ready(db: Database) -> bool:
    try:
        with db.connect() as conn:
            conn.execute("SELECT 1")
        return True
    except Exception:
        return False


def scenario_postgres_restart(*, jobs: int, handler_ms: float = 3, lease: float = 10.0,
                     deadline: float = 180) -> dict[str, Any]:
    args = [*INLINE_ARGS, "--lease-seconds", str(lease)]
    with _scenario("chaos_pg") as (db, procs, tmp):
        cmd, how = _restart_command(db)
        if cmd is None:
            console.print(f"[yellow]postgres_restart skipped: {how}[/]")
            return {"scenario": "postgres_restart", "skipped": how}
        # other clients of this server (before our worker connects): they see the restart too
        others = _query(db, "SELECT count(*) AS n FROM pg_stat_activity "
                            "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()")[0]["n"]
        log = tmp / "executions.log"
        _enqueue_records(db, log, jobs, handler_ms)
        worker = procs.worker(*args)
        _until(lambda: _settled(db) >= max(1, jobs // 5), deadline, "a fifth of the jobs to settle")
        before = _settled(db)
        t0 = time.time()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        finally:
            _until(lambda: _pg_ready(db), 120, "Postgres to accept connections again", interval=0.1)
        t1 = time.time()
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr[-1000:]}")

        def first_settle_after() -> float | None:
            row = _query(db, "SELECT extract(epoch FROM min(finished_at))::float8 AS t FROM jobs "
                             "WHERE finished_at >= to_timestamp(%s)", (t1,))[0]
            return float(row["t"]) if row["t"] is not None else None

        _until(lambda: first_settle_after() is not None or _settled(db) >= jobs, deadline,
               "the first settle after the restart")
        first = first_settle_after()
        _until(lambda: _settled(db) >= jobs, deadline, "every job to settle after the restart", interval=0.1)
        survived = worker.poll() is None
        rc = procs.terminate(worker)
        text = procs.text(worker)
        warnings = {k: text.count(k) for k in ("claim failed", "maintenance tick failed",
                                                "listener lost its connection", "giving up settling")}
        tally = _tally(db, jobs)
        runs = _executions(log)
        summaries = _worker_summaries(procs)
        return {"scenario": "postgres_restart", **tally,
                "duplicated_executions": sum(n - 1 for n in runs.values()), "method": "execution log",
                "restart": how, "settled_before_restart": before,
                "restart_seconds": t1 - t0, "recovery_seconds": (first - t0) if first else None,
                "worker_survived": survived, "worker_exit_code": rc, "worker_log_warnings": warnings,
                "worker_stats": summaries[0] if summaries else None,
                "other_client_connections_at_restart": others,
                "waits": _waits(db, [f"t{i}" for i in range(10)]),
                "settings": {"jobs": jobs, "handler_ms": handler_ms, "lease_seconds": lease, "worker": args}}


# -- scenarios 3 and 4: hostile tenants next to healthy ones, sandboxed ------

SANDBOX_ARGS = ["--sandbox", "auto", "--concurrency", "4", "--batch-size", "10", "--poll-seconds", "0.1",
                "--backoff-base", "0.2", "--backoff-cap", "1"]


def sandboxed_load(name: str, *, hostile: list[JobSpec], healthy_jobs: int, waves: int,
                   wave_gap: float = 1.0, deadline: float = 240) -> dict[str, Any]:
    """The healthy tenants enqueue `healthy_jobs` each, in `waves`, next to `hostile` (enqueued first)."""
    with _scenario(f"chaos_{name}") as (db, procs, _):
        tmp_free = shutil.disk_usage("/tmp").free
        with Queue(db.dsn, schema=db.schema) as q:
            if hostile:
                q.enqueue_many(hostile)
            worker = procs.worker(*SANDBOX_ARGS)
            procs.wait_started(worker)
            t0 = time.monotonic()
            per_wave = [healthy_jobs // waves + (1 if w < healthy_jobs % waves else 0) for w in range(waves)]
            for w, n in enumerate(per_wave):
                q.enqueue_many([JobSpec(t, "chaos.work", {"wave": w})
                                for t in HEALTHY_TENANTS for _ in range(n)])
                if w < waves - 1:
                    time.sleep(wave_gap)
        enqueued = len(hostile) + healthy_jobs * len(HEALTHY_TENANTS)
        _until(lambda: _settled(db) >= enqueued or worker.poll() is not None, deadline,
               f"{name}: every job to settle", interval=0.1)
        elapsed = time.monotonic() - t0
        rc = procs.terminate(worker)
        chose = re.search(r"sandbox auto: chose (\w+)", procs.text(worker))
        tally = _tally(db, enqueued)
        healthy = _query(db, "SELECT status, attempts FROM jobs WHERE tenant_id = ANY(%s)",
                         (HEALTHY_TENANTS,))
        bad = _query(db, "SELECT kind, status, attempts, last_error FROM jobs WHERE NOT tenant_id = ANY(%s) "
                         "ORDER BY id", (HEALTHY_TENANTS,))
        dup = sum(int(r["attempts"]) - 1 for r in healthy if r["status"] == "done")
        return {"scenario": name, **tally, "duplicated_executions": dup, "method": "attempts",
                "healthy_done": sum(r["status"] == "done" for r in healthy), "healthy_jobs": len(healthy),
                "hostile": [{"kind": r["kind"], "status": r["status"], "attempts": r["attempts"],
                             "error": _first_line(r["last_error"])} for r in bad],
                "waits": _waits(db, HEALTHY_TENANTS), "seconds": elapsed, "worker_exit_code": rc,
                "driver": chose.group(1) if chose else "?", "host_tmp_free_delta_mb":
                    (shutil.disk_usage("/tmp").free - tmp_free) / 2**20,
                "settings": {"healthy_tenants": len(HEALTHY_TENANTS), "healthy_jobs_per_tenant": healthy_jobs,
                             "waves": waves, "wave_gap_seconds": wave_gap, "worker": SANDBOX_ARGS}}


def _first_line(text: str | None) -> str | None:
    """The classified reason: last_error's first line (a traceback may follow)."""
    if not text or not text.strip():
        return None
    line = text.strip().splitlines()[0]
    if line.count("(") > line.count(")"):  # `oom: exceeded 128 MiB (MemoryError: ` + traceback lines
        line = line[:line.rfind("(")].rstrip()
    return line[:160]


def poison_jobs(per_kind: int = 1) -> list[JobSpec]:
    return [JobSpec("poison", kind, {}, max_attempts=2) for kind in POISON_KINDS for _ in range(per_kind)]


def fill_jobs(n: int = 2) -> list[JobSpec]:
    return [JobSpec("filler", "chaos.fill_tmp", {}, max_attempts=2) for _ in range(n)]


# -- the table -------------------------------------------------------------


def _ms(x: float) -> str:
    return "-" if x != x else f"{x * 1000:,.0f} ms"  # NaN: no waits


def _table(rows: list[dict[str, Any]], baseline: dict[str, Any] | None) -> Table:
    table = Table(title="chaos: reliability under kill -9, a Postgres restart, poison and a full /tmp",
                  caption="lost = enqueued - (done + dead + cancelled), must be 0. Duplicated executions: "
                          "inline scenarios count every execution from a shared log (exact); sandboxed ones "
                          "count sum(attempts - 1) over healthy jobs (a sandbox's files are private). "
                          "Wait = lease time - enqueue time of the healthy jobs' final attempt.")
    for col in ("scenario", "enqueued", "completed", "dead", "dup. exec.", "lost", "healthy p50 wait",
                "healthy max wait", "max vs baseline"):
        table.add_column(col, justify="left" if col == "scenario" else "right")
    for r in rows:
        if "skipped" in r:
            table.add_row(r["scenario"], *["-"] * 8)
            continue
        w = r["waits"]
        ratio = "-"
        if baseline is not None and r["scenario"] in ("poison", "fill_tmp") and baseline["waits"]["max"]:
            ratio = f"{w['max'] / baseline['waits']['max']:.2f}x"
        if r["scenario"] == "poison_baseline":
            ratio = "1.00x"
        table.add_row(r["scenario"], f"{r['enqueued']:,}", f"{r['completed']:,}", str(r["dead"]),
                      str(r["duplicated_executions"]), str(r["lost"]), _ms(w["p50"]), _ms(w["max"]), ratio)
    return table


def _notes(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    if r["scenario"] == "kill9":
        missed = f" ({len(r['missed_points'])} point(s) missed: no work left)" if r["missed_points"] else ""
        return (f"{len(r['kills'])} kills{missed} (seed {r['seed']}), {r['held_at_kills']} jobs held by the "
                f"killed workers' leases ({r['duplicated_executions']} had started, so ran again); "
                f"{len(r['duplicates_beyond_held'])} duplicates beyond those; {r['seconds']:.1f} s")
    if r["scenario"] == "postgres_restart":
        rec = r["recovery_seconds"]
        return (f"{r['restart']}: down {r['restart_seconds']:.1f} s, first settle "
                f"{rec:.1f} s after the restart began; worker survived: {r['worker_survived']}"
                if rec is not None else f"{r['restart']}: no settle after the restart")
    errors = sorted({f"{h['kind'].removeprefix('chaos.')} -> {h['error'] or ''}" for h in r["hostile"]
                     if h["status"] == "dead"})
    text = (f"{r['driver']} sandboxes; healthy jobs done {r['healthy_done']}/{r['healthy_jobs']}, "
            f"{r['seconds']:.1f} s; host /tmp free changed {r['host_tmp_free_delta_mb']:+.1f} MiB")
    return text + "".join(f"\n    dead: {e}" for e in errors)


# -- entry point -----------------------------------------------------------


def run(*, jobs: int = 2000, kills: int = 10, seed: int | None = None, postgres_restart: bool = True,
        poison: bool = True, fill_tmp: bool = True, restart_jobs: int | None = None, healthy_jobs: int = 40,
        waves: int = 8, deadline: float = 240) -> dict[str, Any]:
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    console.print(f"chaos: seed {seed} (rerun the same kill points with seed={seed})")
    rows: list[dict[str, Any]] = []
    with scratch_schema("info") as db:
        info = machine_info(db)
    baseline: dict[str, Any] | None = None
    try:
        if kills > 0:
            rows.append(scenario_kill9(jobs=jobs, kills=kills, seed=seed, deadline=deadline))
        if postgres_restart:
            rows.append(scenario_postgres_restart(jobs=restart_jobs or jobs, deadline=deadline))
        if poison or fill_tmp:
            baseline = sandboxed_load("poison_baseline", hostile=[], healthy_jobs=healthy_jobs, waves=waves,
                                      deadline=deadline)
        if poison:
            rows.append(sandboxed_load("poison", hostile=poison_jobs(), healthy_jobs=healthy_jobs,
                                       waves=waves, deadline=deadline))
        if baseline is not None:
            rows.append(baseline)
        if fill_tmp:
            rows.append(sandboxed_load("fill_tmp", hostile=fill_jobs(), healthy_jobs=healthy_jobs,
                                       waves=waves, deadline=deadline))
    finally:
        if postgres_restart:
            _ensure_postgres_running()
    console.print(_table(rows, baseline))
    for r in rows:
        console.print(f"[bold]{r['scenario']}[/]: {_notes(r)}", highlight=False)
    payload = {"benchmark": "chaos", "machine": info, "seed": seed, "method": METHOD,
               "settings": {"jobs": jobs, "kills": kills, "postgres_restart": postgres_restart,
                            "poison": poison, "fill_tmp": fill_tmp, "healthy_jobs": healthy_jobs,
                            "waves": waves},
               "scenarios": rows}
    console.print(f"wrote {save('chaos', payload)}")
    problems = [f"{r['scenario']}: {r['lost']} lost" for r in rows if r.get("lost")]
    problems += [f"kill9: duplicates beyond the killed workers' batches: {r['duplicates_beyond_held'][:20]}"
                 for r in rows if r.get("duplicates_beyond_held")]
    problems += [f"kill9: done without an execution: {r['done_without_execution'][:20]}"
                 for r in rows if r.get("done_without_execution")]
    assert not problems, "; ".join(problems)
    return payload


def _ensure_postgres_running() -> None:
    """The restart scenario must leave the server up; start it if it is not."""
    db = Database.resolve()
    if _pg_ready(db):
        return
    cmd, how = _restart_command_offline()
    console.print(f"[red]Postgres is not accepting connections after the run; starting it ({how})[/]")
    if cmd:
        subprocess.run(cmd, check=False, timeout=120)


def _restart_command_offline() -> tuple[list[str] | None, str]:
    versions = sorted(os.listdir("/etc/postgresql")) if os.path.isdir("/etc/postgresql") else []
    if versions and shutil.which("pg_ctlcluster"):
        cmd = ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main", "start"]
        return cmd, "pg_ctlcluster start"
    return None, "no way to start it known"
