"""`./run demo` (`python -m tenantq.demo`), run once as a subprocess against
the real database in a schema of its own; then its output and its rows.

The demo asserts nothing itself; this checks its structure (three scenes, a
legend under each table, the closing lines) and the properties it claims,
with generous bounds: deficit round robin keeps the small tenants' first
attempts far below the wait FIFO would have given them, every poison job
ends dead with its reason, the interactive reports all ran, each tenant's
monthly report adds up its own orders only (a real FORCE ROW LEVEL SECURITY
table, read as a role that is neither owner nor superuser) and mallory's
tries at acme's orders each fail with their reason or see mallory's rows.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import sql as pgsql

from tenantq.demo import appdb, scene_reports, stats, workload
from tenantq.demo.report import LEGEND_PREFIX, closing_lines
from tenantq.demo.stage import BATCHES_SQL, JOBS_SQL
from tenantq.settings import Settings
from tenantq.store.db import Database
from tests.acceptance.helpers import query

DEMO_TIMEOUT = 400.0


@dataclass(frozen=True)
class DemoRun:
    db: Database
    stdout: str
    stderr: str
    returncode: int
    embedded: bool  # the demo resolved the embedded Postgres itself

    def section(self, start: str, end: str | None = None) -> str:
        assert start in self.stdout, f"{start!r} not in the demo's output:\n{self.stdout}"
        text = self.stdout.split(start, 1)[1]
        return text.split(end, 1)[0] if end and end in text else text

    def jobs(self, where: str) -> list[stats.Row]:
        ids = [int(r["id"]) for r in query(self.db, f"SELECT id FROM jobs WHERE {where}")]
        return query(self.db, JOBS_SQL, {"ids": ids})

    def batches(self, *priorities: str) -> list[stats.Row]:
        return query(self.db, BATCHES_SQL, {"priorities": list(priorities)})


@pytest.fixture(scope="module")
def demo(server_dsn: str) -> Iterator[DemoRun]:
    db = Database(dsn=server_dsn, schema=f"tq_demo_{uuid.uuid4().hex[:10]}")
    env = dict(os.environ, COLUMNS="160")
    # with TENANTQ_DATABASE_URL unset the tests run on the embedded server:
    # so does the demo, resolving it itself, as `./run demo` would
    embedded = not env.get("TENANTQ_DATABASE_URL")
    try:
        res = subprocess.run([sys.executable, "-m", "tenantq.demo", "--schema", db.schema], env=env,
                             capture_output=True, text=True, timeout=DEMO_TIMEOUT, check=False,
                             stdin=subprocess.DEVNULL)
        yield DemoRun(db, res.stdout, res.stderr, res.returncode, embedded)
    finally:
        app, reader = appdb.names(db.schema)
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            for name in (db.schema, app):
                conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(pgsql.Identifier(name)))
            # the demo keeps its role for the next run; this run's is this test's own
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (reader,)).fetchone():
                conn.execute(pgsql.SQL("DROP OWNED BY {}").format(pgsql.Identifier(reader)))
                conn.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(reader)))


def _ok(demo: DemoRun) -> DemoRun:
    assert demo.returncode == 0, (
        f"demo exited {demo.returncode}\n{demo.stdout[-4000:]}\n{demo.stderr[-4000:]}")
    return demo


def _sandboxed(demo: DemoRun) -> bool:
    return "Running inline instead" not in demo.stdout


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT + 60)
def test_scene_1_is_drr_within_one_class_and_beats_fifo(demo: DemoRun) -> None:
    _ok(demo)
    # one class, no caps, equal weights: nothing but the rotation decides
    scene_one = demo.jobs("id < (SELECT min(id) FROM jobs WHERE priority = 'bulk')")
    assert {r["priority"] for r in scene_one} == {"default"}
    assert query(demo.db, "SELECT count(*) AS n FROM tenants WHERE max_sandboxes IS NOT NULL "
                          "OR weight <> 1")[0]["n"] == 0
    # scene 3's reports are in class default too: leave out everything after scene 1
    bulk_start = min(float(r["created"]) for r in demo.jobs("priority = 'bulk'"))
    scene = stats.fair_scene(scene_one, [b for b in demo.batches("default") if b["created"] < bulk_start],
                             whale=workload.WHALE, concurrency=4)
    assert scene.seconds_per_row is not None and scene.seconds_per_row > 0
    assert scene.first_whale_batches >= 4  # the whale held every slot when the others arrived
    assert all(t.first_batch is not None for t in scene.small)
    small, fifo = stats.p50(scene.small_waits()), stats.p50(scene.small_fifo())
    assert small is not None and fifo is not None
    # generous: the demo typically shows an order of magnitude
    assert small * 3 < fifo, f"small tenants' first-attempt wait p50 {small:.2f}s vs FIFO {fifo:.2f}s"
    assert "computed for FIFO" in demo.section("Scene 1: waits")


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT + 60)
def test_every_poison_job_ends_dead_with_its_reason(demo: DemoRun) -> None:
    _ok(demo)
    rows = {r["kind"]: r for r in demo.jobs(f"tenant_id = '{workload.HOSTILE}'")}
    expected = workload.POISON if _sandboxed(demo) else ("demo.parse_invoice",)
    listed = demo.section("poison job(s) contained in the dead-letter list")
    for kind in expected:
        assert rows[kind]["status"] == "dead", rows[kind]
        assert workload.POISON_REASONS[kind] in str(rows[kind]["last_error"]).lower(), rows[kind]
        assert kind in listed
    # nobody else's work was touched
    others = demo.jobs(f"tenant_id <> '{workload.HOSTILE}'")
    if not _sandboxed(demo):  # an inline worker refuses tenant-supplied code
        others = [r for r in others if r["kind"] != "tenantq.python"]
    assert {r["status"] for r in others} == {"done"}


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT + 60)
def test_scene_2_runs_interactive_reports_during_the_bulk_import(demo: DemoRun) -> None:
    _ok(demo)
    reports = demo.jobs("priority = 'interactive'")
    assert sorted(r["tenant_id"] for r in reports) == sorted(workload.INTERACTIVE_ARRIVALS)
    assert {r["status"] for r in reports} == {"done"}
    assert demo.jobs("priority = 'bulk'"), "the whale's bulk import"


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT + 60)
def test_every_table_has_its_legend(demo: DemoRun) -> None:
    _ok(demo)
    marker = LEGEND_PREFIX.strip()

    def legend(text: str) -> str:
        """The legend items, each unwrapped to one line."""
        items: list[str] = []
        for line in text.splitlines():
            if line.strip().startswith(marker):
                items.append(line.strip())
            elif items and line.startswith(" " * len(LEGEND_PREFIX)) and line.strip():
                items[-1] += " " + line.strip()
        return "\n".join(items)

    one = legend(demo.section("Scene 1: waits", "Scene 2:"))
    for term in ("wait: from enqueue to the lease", "p50: the tenant's median job", "1st batch:",
                 "FIFO p50* (computed, not measured)", "retried:", "whale:"):
        assert term in one, f"{term!r} missing from scene 1's legend:\n{one}"
    two = legend(demo.section("Scene 2: waits", "Scene 3:"))
    for term in ("wait: from enqueue to the lease", "Why so short:", "Bulk batches recalled:",
                 "without reservation* (computed, not measured)", "bulk p50/max:"):
        assert term in two, f"{term!r} missing from scene 2's legend:\n{two}"
    three = legend(demo.section("Scene 3: monthly reports"))
    for term in ("orders / total:", "FORCE ROW LEVEL SECURITY", "seeded*: (computed, not read back)",
                 "rows of:", "right:", "why:"):
        assert term in three, f"{term!r} missing from scene 3's legend:\n{three}"


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT + 60)
def test_scene_3_reports_read_only_their_tenants_orders_through_the_host_function(demo: DemoRun) -> None:
    _ok(demo)
    app, reader = appdb.names(demo.db.schema)
    # the isolation is Postgres's: a policy under FORCE, a role that bypasses none of it
    table = query(demo.db, "SELECT c.relrowsecurity AND c.relforcerowsecurity AS forced, "
                           "(SELECT count(*) FROM pg_policy p WHERE p.polrelid = c.oid) AS policies "
                           "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                           "WHERE n.nspname = %(app)s AND c.relname = 'orders'", {"app": app})
    assert table == [{"forced": True, "policies": 1}], table
    role = query(demo.db, "SELECT rolsuper, rolbypassrls, rolcanlogin FROM pg_roles WHERE rolname = %(r)s",
                 {"r": reader})
    assert role == [{"rolsuper": False, "rolbypassrls": False, "rolcanlogin": False}], role
    rows = demo.jobs(f"kind IN ('{scene_reports.REPORT}', '{scene_reports.SNOOP}')")
    scene = scene_reports.report_scene(rows)
    assert sorted(r["tenant_id"] for r in scene.reports) == sorted(appdb.ORDERS)
    for r in scene.reports:
        orders, total = appdb.expected(r["tenant_id"])
        assert r["status"] == "done", r
        assert r["result"] == {"month": appdb.MONTH, "orders": orders, "total": total,
                               "tenants_seen": [r["tenant_id"]]}, r
    assert scene.snoop is not None and scene.snoop["status"] == "done", scene.snoop
    tries = {a["try"]: a for a in scene.attempts}
    own_orders, own_total = appdb.expected(workload.HOSTILE)
    victim_id = tries["the victim's id in the args"]
    assert (victim_id["orders"], victim_id["total"], victim_id["tenants_seen"]) == (
        own_orders, own_total, [workload.HOSTILE]), victim_id
    assert tries["SQL in the args"]["error"].startswith(
        "HostFunctionError: orders.for_month raised InvalidTextRepresentation: invalid input syntax for "
        "type integer"), tries
    assert tries["a function it does not declare"]["error"] == (
        "HostFunctionError: refused: handler 'report.snoop' does not declare host function "
        "'orders.export_all'"), tries
    database = tries["the database itself"]
    if _sandboxed(demo):
        assert database["error"].startswith("NoAppDatabase: ctx.db():"), database
    else:  # inline, the tenant-scoped connection: the policy hides acme's rows
        assert database["orders"] == 0, database
    assert not scene.leaked()
    # the output: every try on one line with what it got, then the verdict
    out = demo.section("Scene 3: monthly reports")
    for a in scene.attempts:
        assert f"{a['try']}: {a['call']} -> " in out, f"{a['try']!r} not printed:\n{out}"
        if "error" in a:
            assert f"-> {a['error']}" in out
    assert f"rows of {workload.HOSTILE}" in out
    assert (f"verdict: {len(appdb.ORDERS)} of {len(appdb.ORDERS)} reports right" in out
            and f"none got a row of {appdb.VICTIM}'s" in out), out


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT + 60)
def test_closing_lines_say_where_postgres_is(demo: DemoRun) -> None:
    closing = _ok(demo).section("demo took")
    assert "tenantq dashboard" in closing
    if demo.embedded:
        assert "embedded Postgres" in closing and "is still running" in closing
        assert "tenantq db stop" in closing and ".venv/bin/tenantq db stop" in closing
        assert "data dir" in closing
    else:
        assert "TENANTQ_DATABASE_URL" in closing and "db stop" not in closing


def test_closing_lines_for_the_embedded_postgres(tmp_path: Path) -> None:
    lines = "\n".join(closing_lines(Settings(database_url=None, data_dir=tmp_path), "tenantq_demo",
                                    embedded_was_running=False))
    assert "was started by this demo and is still running" in lines
    assert str(tmp_path / "pg") in lines
    assert "tenantq db stop" in lines and ".venv/bin/tenantq db stop" in lines


def test_closing_lines_for_a_server_of_ones_own(tmp_path: Path) -> None:
    lines = "\n".join(closing_lines(Settings(database_url="postgresql://db.example/app", data_dir=tmp_path),
                                    "tenantq_demo", embedded_was_running=False))
    assert "TENANTQ_DATABASE_URL" in lines and "schema tenantq_demo" in lines
    assert "tenantq_demo_app CASCADE" in lines and "DROP ROLE tenantq_demo_reader" in lines
    assert "db stop" not in lines and "embedded" not in lines


def _job(job_id: int, tenant: str, created: float, started: float | None, attempts: int = 1,
         priority: str = "default") -> stats.Row:
    return {"id": job_id, "tenant_id": tenant, "created": created, "started": started,
            "attempts": attempts, "status": "done", "priority": priority, "finished": None}


def test_fifo_wait_counts_the_whale_rows_not_yet_leased() -> None:
    whale = [_job(i, "whale", 0.0, 10.0 if i < 4 else 20.0) for i in range(10)]  # 4 leased at t=10
    small = [_job(100, "acme", 15.0, 15.5)]
    # 6 whale rows ahead and unleased at t=15, 0.5 slot-seconds each, 2 slots
    assert stats.fifo_waits(small, whale, 0.5, 2) == [1.5]
    assert stats.fifo_waits(whale[:3], whale, 0.5, 2) == [0.0, 0.25, 0.5]


def test_retried_jobs_stay_out_of_the_first_attempt_waits() -> None:
    rows = [_job(1, "whale", 0.0, 0.0), _job(2, "acme", 1.0, 1.2), _job(3, "acme", 1.0, 3.0, attempts=2)]
    batches = [{"batch_id": 1, "tenant_id": "whale", "priority": "default", "job_count": 1,
                "outcome": "ok", "created": 0.0, "ended": 1.0},
               {"batch_id": 2, "tenant_id": "acme", "priority": "default", "job_count": 2,
                "outcome": "ok", "created": 1.2, "ended": 1.5}]
    scene = stats.fair_scene(rows, batches, whale="whale", concurrency=1)
    acme = scene.small[0]
    assert acme.waits == pytest.approx((0.2,)) and acme.retried == pytest.approx((2.0,))
    assert acme.first_batch == 2 and scene.first_whale_batches == 1


def test_without_reservation_waits_for_the_first_bulk_batch_to_end() -> None:
    bulk = [{"batch_id": 1, "tenant_id": "whale", "priority": "bulk", "job_count": 50, "outcome": "ok",
             "created": 0.0, "ended": 4.0},
            {"batch_id": 2, "tenant_id": "whale", "priority": "bulk", "job_count": 50,
             "outcome": "released", "created": 0.5, "ended": 1.1}]
    report = _job(9, "acme", 1.0, 1.1, priority="interactive")
    # the recalled batch would have run 50 rows x 0.04 s from 0.5: until 2.5
    assert stats.without_reservation(report, bulk, 0.04) == pytest.approx(1.5)
    assert stats.without_reservation(_job(9, "acme", 5.0, 5.0), bulk, 0.04) is None
