"""Periodic jobs on real Postgres: `@tenantq.periodic` schedules stored by a
worker at start (and dropped when the app no longer declares them), bad
cron / time zone input refused in one line, exactly one job per fire time
however many firers race (threads calling `fire_due_steps` with the same
`now`, and three `tenantq worker` processes on one schema), missed fires
collapsed into one job for the latest of them, `worker --once` firing and
draining in one run, pause / resume, and time zones across daylight saving.

In-process workers use registries of their own (never the global one), so
no schedule declared here reaches another test's worker."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, LiteralString
from zoneinfo import ZoneInfo

import pytest

import tenantq
from tenantq import Queue
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.outcome import Backoff
from tenantq.dispatch.worker import Worker, WorkerConfig, WorkerStats
from tenantq.domain.cron import next_fire, wall_clock
from tenantq.domain.schedules import spec as schedule_spec
from tenantq.errors import InvalidInput
from tenantq.registry import Registry
from tenantq.store import schedules
from tenantq.store.db import Database
from tenantq.store.steps import Steps, run
from tenantq.testing import wait_until
from tests.acceptance.helpers import Cli, wait_exit
from tests.integration.helpers import db_now, fetch_all, fetch_one, scalar

NO_BACKOFF = Backoff(base_seconds=0.0, cap_seconds=0.0)
CONTROLS_APP = "tests.apps.controls"
PARIS = "Europe/Paris"


def _registry(*, periodic: dict[str, Any] | None = None, kind: str = "ctl.tick") -> Registry:
    """A registry with one inline handler, optionally declared periodic."""
    reg = Registry()

    def tick(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
        return {"fire_time": ctx.meta.get("fire_time"), "tenant": ctx.tenant}

    if periodic is not None:
        tick = tenantq.periodic(registry=reg, **periodic)(tick)
    tenantq.handler(kind, isolation="inline", registry=reg)(tick)
    return reg


def _once(db: Database, registry: Registry) -> WorkerStats:
    """A `once` worker: syncs the app's schedules, fires what is due, drains, returns."""
    config = WorkerConfig(concurrency=1, batch_size=10, once=True, lease_seconds=30, backoff=NO_BACKOFF)
    return Worker(db, InlineExecutor(registry), config).run()


def _execute(db: Database, statement: LiteralString, params: dict[str, Any] | None = None) -> None:
    with db.connect() as conn:
        conn.execute(statement, params or {})


def _steps(db: Database, steps: Steps[Any]) -> Any:
    with db.connect() as conn:
        return run(conn, steps, atomic=True)


def _fire(db: Database, now: datetime | None = None) -> list[tuple[int, int]]:
    """What every worker's maintenance runs each tick."""
    fired: list[tuple[int, int]] = _steps(db, schedules.fire_due_steps(
        schema=db.schema, channel=db.notify_channel, now=now))
    return fired


def _add(db: Database, tenant: str, cron: str, *, now: datetime, timezone: str = "UTC",
         name: str | None = None) -> dict[str, Any]:
    """A schedule whose next fire is computed from `now` (not the clock)."""
    spec = schedule_spec(tenant, "ctl.tick", cron, timezone=timezone, name=name)
    row: dict[str, Any] = _steps(db, schedules.upsert_steps(spec, origin="db", now=now))
    return row


def _schedule_jobs(db: Database, schedule_id: int) -> list[dict[str, Any]]:
    return fetch_all(db, "SELECT id, status, meta, idempotency_key FROM jobs "
                         "WHERE (meta->>'schedule_id')::bigint = %(s)s ORDER BY id", {"s": schedule_id})


def _app_rows(db: Database) -> list[dict[str, Any]]:
    return fetch_all(db, "SELECT schedule_id, tenant_id, kind, cron, timezone, payload, origin, next_fire_at "
                         "FROM schedules WHERE origin = 'app' ORDER BY tenant_id")


def _floor(at: datetime, minutes: int) -> datetime:
    return at.replace(minute=at.minute - at.minute % minutes, second=0, microsecond=0)


# -- declaring -------------------------------------------------------------


def test_periodic_schedules_are_stored_at_worker_start_and_dropped_when_no_longer_declared(
        queue: Queue, db: Database) -> None:
    declared = _registry(periodic={"cron": "* * * * *", "tenant": ["acme", "globex"],
                                   "payload": {"report": "daily"}})
    before = db_now(db)
    _once(db, declared)
    rows = _app_rows(db)
    assert [(r["tenant_id"], r["kind"], r["cron"], r["timezone"], r["payload"]) for r in rows] == [
        ("acme", "ctl.tick", "* * * * *", "UTC", {"report": "daily"}),
        ("globex", "ctl.tick", "* * * * *", "UTC", {"report": "daily"}),
    ]
    for row in rows:  # the next minute: not fired by that run
        assert before < row["next_fire_at"] <= before + timedelta(seconds=61), row
        assert row["next_fire_at"].second == 0 and row["next_fire_at"].microsecond == 0
    assert scalar(db, "SELECT count(*) FROM jobs") == 0
    # they are what Queue.schedules() lists
    assert {s["tenant_id"] for s in queue.schedules()} == {"acme", "globex"}
    assert [s["tenant_id"] for s in queue.schedules("acme")] == ["acme"]

    # a second start of the same app changes nothing (same rows, same next fire)
    _once(db, _registry(periodic={"cron": "* * * * *", "tenant": ["acme", "globex"],
                                  "payload": {"report": "daily"}}))
    assert _app_rows(db) == rows

    # a schedule added at run time for the same kind, and a worker of another
    # app (other kinds): neither touches the app's schedules
    db_row = queue.add_schedule("acme", "ctl.tick", "@hourly")
    _once(db, _registry(kind="other.kind"))
    assert _app_rows(db) == rows

    # a changed cron is a new schedule: the old ones go, the new ones come
    _once(db, _registry(periodic={"cron": "*/5 * * * *", "tenant": ["acme", "globex"],
                                  "payload": {"report": "daily"}}))
    changed = _app_rows(db)
    assert [(r["tenant_id"], r["cron"]) for r in changed] == [(t, "*/5 * * * *") for t in ("acme", "globex")]
    assert not {r["schedule_id"] for r in changed} & {r["schedule_id"] for r in rows}

    # the app no longer declares them: its next worker drops them, and only them
    _once(db, _registry())
    assert _app_rows(db) == []
    assert [s["schedule_id"] for s in queue.schedules()] == [db_row["schedule_id"]]


def test_a_periodic_function_that_is_no_handler_is_refused_at_worker_start(db: Database) -> None:
    reg = _registry()

    @tenantq.periodic("@daily", tenant="acme", registry=reg)
    def orphan(payload: Any, ctx: tenantq.JobContext) -> None:
        return None

    with pytest.raises(InvalidInput, match="it is not a handler") as err:
        _once(db, reg)
    assert "\n" not in str(err.value)
    assert scalar(db, "SELECT count(*) FROM schedules") == 0


@pytest.mark.parametrize(("cron", "timezone", "says"), [
    ("61 * * * *", "UTC", "invalid cron expression"),
    ("* * * *", "UTC", "invalid cron expression"),
    ("every minute", "UTC", "invalid cron expression"),
    ("", "UTC", "cron expression must be"),
    ("* * * * *\n* * * * *", "UTC", "invalid cron expression"),
    ("*/5 * * * *", "Mars/Olympus_Mons", "unknown time zone"),
    ("*/5 * * * *", "", "time zone must be"),
    ("*/5 * * * *", "../../etc/passwd", "unknown time zone"),
])
def test_bad_cron_or_time_zone_is_one_line_invalid_input(queue: Queue, db: Database, cron: str,
                                                         timezone: str, says: str) -> None:
    with pytest.raises(InvalidInput) as err:
        queue.add_schedule("acme", "ctl.tick", cron, timezone=timezone)
    message = str(err.value)
    assert says in message and "\n" not in message, message
    assert scalar(db, "SELECT count(*) FROM schedules") == 0
    # the decorator refuses the same, when the app is imported
    with pytest.raises(InvalidInput) as decorated:
        tenantq.periodic(cron, tenant="acme", timezone=timezone, registry=Registry())
    assert says in str(decorated.value) and "\n" not in str(decorated.value)


# -- one job per fire time -------------------------------------------------


def test_concurrent_firers_make_exactly_one_job_per_fire_time(db: Database) -> None:
    """Eight connections run `fire_due_steps` at once with the same `now`,
    round after round (one fire time each): each fire is enqueued by exactly
    one of them, once."""
    start = datetime(2031, 5, 6, 10, 0, tzinfo=UTC)
    ids = [int(_add(db, f"t{n}", "* * * * *", now=start - timedelta(seconds=1))["schedule_id"])
           for n in range(5)]
    firers, rounds = 8, 12
    barrier = threading.Barrier(firers)
    errors: list[BaseException] = []
    fired: list[list[tuple[int, int]]] = [[] for _ in range(rounds)]
    lock = threading.Lock()

    def firer() -> None:
        try:
            with db.connect() as conn:
                for k in range(rounds):
                    at = start + timedelta(minutes=k, seconds=30)  # within fire time k's minute
                    barrier.wait(timeout=20)
                    got = run(conn, schedules.fire_due_steps(schema=db.schema, channel=db.notify_channel,
                                                             now=at), atomic=True)
                    with lock:
                        fired[k].extend(got)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=firer, name=f"firer-{n}", daemon=True) for n in range(firers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a firer hung"
    if errors:
        raise errors[0]

    for k, pairs in enumerate(fired):
        # every schedule fired once per round, by one firer: no pair twice,
        # not even one a second firer got back through the idempotency key
        assert sorted(s for s, _ in pairs) == ids, (k, pairs)
        assert len({j for _, j in pairs}) == len(ids), (k, pairs)
    assert scalar(db, "SELECT count(*) FROM jobs") == len(ids) * rounds
    for schedule_id in ids:
        jobs = _schedule_jobs(db, schedule_id)
        times = [datetime.fromisoformat(j["meta"]["fire_time"]) for j in jobs]
        assert times == [start + timedelta(minutes=k) for k in range(rounds)], times
        assert [j["idempotency_key"] for j in jobs] == [
            f"schedule:{schedule_id}:{wall_clock(t, 'UTC')}" for t in times]
    rows = fetch_all(db, "SELECT next_fire_at, last_fire_at FROM schedules")
    assert {(r["last_fire_at"], r["next_fire_at"]) for r in rows} == {
        (start + timedelta(minutes=rounds - 1), start + timedelta(minutes=rounds))}


@pytest.fixture
def cli(tenantq_cmd: list[str], cli_env: dict[str, str], tmp_path: Path) -> Iterator[Cli]:
    runner = Cli(tenantq_cmd, cli_env, tmp_path)
    try:
        yield runner
    finally:
        runner.cleanup()


def test_three_worker_processes_make_exactly_one_job_per_fire(queue: Queue, db: Database, cli: Cli,
                                                              tmp_path: Path) -> None:
    """Three `tenantq worker` processes of an app that declares a schedule for
    ten tenants start together (each stores the schedules) and then race to
    fire them: every time the schedules fall due, one job per schedule, run once."""
    tenants = [f"tenant-{n}" for n in range(10)]
    log = tmp_path / "runs.log"
    # a yearly cron: each due time set below is its own fire (the latest
    # cron time before it is months earlier)
    cli.env = {**cli.env, "TQ_CONTROLS_PERIODIC": f"0 0 1 1 *;{','.join(tenants)}",
               "TQ_CONTROLS_LOG": str(log)}
    flags = ("--sandbox", "inline", "--concurrency", "1", "--lease-seconds", "1.5", "--poll-seconds", "0.2",
             "--log-format", "json")
    procs = [cli.start("worker", "--app", CONTROLS_APP, *flags) for _ in range(3)]
    wait_until(lambda: len(queue.workers()) == 3, timeout=30, interval=0.1, message="three live workers")
    rows = _app_rows(db)
    assert [r["tenant_id"] for r in rows] == tenants, "one row per tenant, whatever the racing starts did"

    rounds = 4
    due_times: list[datetime] = []
    for _ in range(rounds):
        due = fetch_one(db, "WITH moved AS (UPDATE schedules SET next_fire_at = now() - interval '1 second' "
                            "RETURNING next_fire_at) SELECT max(next_fire_at) AS at FROM moved")["at"]
        due_times.append(due)
        wait_until(lambda due=due: scalar(db, "SELECT count(*) FROM schedules WHERE last_fire_at = %(d)s",
                                          {"d": due}) == len(tenants),
                   timeout=15, interval=0.05, message="every schedule fired by a worker's maintenance")
    total = len(tenants) * rounds
    wait_until(lambda: scalar(db, "SELECT count(*) FROM jobs WHERE status = 'done'") == total,
               timeout=30, interval=0.1, message="every fired job done")
    for proc, _ in procs:
        proc.send_signal(signal.SIGTERM)
    for proc, _ in procs:
        assert wait_exit(proc, timeout=30) == 0

    jobs = fetch_all(db, "SELECT id, tenant_id, status, meta, result FROM jobs ORDER BY id")
    assert len(jobs) == total, [j["meta"] for j in jobs]
    fires = sorted((j["tenant_id"], j["meta"]["fire_time"]) for j in jobs)
    assert fires == sorted((t, d.isoformat()) for t in tenants for d in due_times)
    for job in jobs:
        assert job["result"]["fire_time"] == job["meta"]["fire_time"]
    runs = log.read_text().split()
    assert len(runs) == 2 * total and sorted(int(x) for x in runs[::2]) == [j["id"] for j in jobs], \
        "every job ran exactly once"
    assert [r["tenant_id"] for r in _app_rows(db)] == tenants
    firing = [n for n, (_, err) in enumerate(procs) if '"fired ' in err.read_text(errors="replace")]
    print(f"workers that fired: {firing}")


def test_fires_missed_while_no_worker_ran_are_enqueued_once_for_the_latest(queue: Queue,
                                                                           db: Database) -> None:
    schedule = queue.add_schedule("acme", "ctl.tick", "*/5 * * * *")
    an_hour_ago = _floor(db_now(db), 5) - timedelta(hours=1)
    _execute(db, "UPDATE schedules SET next_fire_at = %(at)s", {"at": an_hour_ago})
    stats = _once(db, _registry())  # fires at start, then drains the job in the same run
    assert stats.done == 1, stats.snapshot()

    (job,) = _schedule_jobs(db, schedule["schedule_id"])
    info = queue.job(job["id"])
    fire_time = datetime.fromisoformat(info.meta["fire_time"])  # type: ignore[index]
    # the latest fire time up to the firing transaction's clock (the job's created_at)
    assert fire_time == _floor(info.created_at.astimezone(UTC), 5), (fire_time, info.created_at)
    assert fire_time - an_hour_ago >= timedelta(minutes=60)
    assert info.status == "done" and info.result["fire_time"] == info.meta["fire_time"]  # type: ignore[index]
    # keyed by the schedule's wall-clock time (domain/cron.py `wall_clock`)
    assert info.idempotency_key == f"schedule:{schedule['schedule_id']}:{wall_clock(fire_time, 'UTC')}"
    row = queue.schedules()[0]
    assert row["last_fire_at"] == fire_time and row["last_job_id"] == job["id"]
    assert row["next_fire_at"] == fire_time + timedelta(minutes=5)
    # nothing more is due: another worker start enqueues nothing
    _once(db, _registry())
    assert len(_schedule_jobs(db, schedule["schedule_id"])) == 1


def test_a_missed_fire_due_exactly_now_is_the_one_enqueued(db: Database) -> None:
    """`now` on a fire time: that fire is due (a schedule whose next fire is
    `now` fires for it), so when earlier fires were missed, the one job
    is for it, the latest, and the next fire is the one after."""
    start = datetime(2032, 3, 1, 12, 0, tzinfo=UTC)
    row = _add(db, "acme", "*/5 * * * *", now=start - timedelta(seconds=1))
    assert row["next_fire_at"] == start
    on_time = start + timedelta(minutes=5)  # 12:00 was missed; 12:05 is due now
    assert len(_fire(db, on_time)) == 1
    (job,) = _schedule_jobs(db, row["schedule_id"])
    state = fetch_one(db, "SELECT last_fire_at, next_fire_at FROM schedules")
    assert (job["meta"]["fire_time"], state["next_fire_at"]) == (on_time.isoformat(),
                                                                 on_time + timedelta(minutes=5)), state


def test_worker_once_fires_what_is_due_and_drains_it_in_the_same_run(queue: Queue, db: Database,
                                                                     cli: Cli, tmp_path: Path) -> None:
    log = tmp_path / "runs.log"
    schedule = queue.add_schedule("acme", "controls.tick", "* * * * *", payload={"log": str(log)})
    _execute(db, "UPDATE schedules SET next_fire_at = now() - interval '1 hour'")
    res = cli.run("worker", "--app", CONTROLS_APP, "--sandbox", "inline", "--once", timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    stats = json.loads(res.stderr.strip().splitlines()[-1])
    assert stats["done"] == 1, stats
    (job,) = _schedule_jobs(db, schedule["schedule_id"])
    info = queue.job(job["id"])
    assert info.status == "done" and info.result["fire_time"] == info.meta["fire_time"], info  # type: ignore[index]
    assert log.read_text().split()[0] == str(job["id"])
    assert queue.schedules()[0]["next_fire_at"] > db_now(db)


def test_paused_schedules_do_not_fire_and_resume_from_the_next_time_after_now(queue: Queue,
                                                                             db: Database) -> None:
    schedule = queue.add_schedule("acme", "ctl.tick", "*/5 * * * *")
    other = queue.add_schedule("globex", "ctl.tick", "*/5 * * * *")
    sid = int(schedule["schedule_id"])
    _execute(db, "UPDATE schedules SET next_fire_at = now() - interval '2 hours'")

    assert queue.pause_schedule(sid) is True
    assert [s["paused"] for s in queue.schedules("acme")] == [True]
    fired = _fire(db)  # what a worker's tick runs: only the running schedule fires
    assert [s for s, _ in fired] == [other["schedule_id"]]
    assert _schedule_jobs(db, sid) == []
    assert _fire(db) == []

    before = datetime.now(UTC)
    assert queue.pause_schedule(sid, paused=False) is True
    after = datetime.now(UTC)
    (row,) = queue.schedules("acme")
    assert row["paused"] is False
    # its next fire is the first after now: none of the 24 it missed
    assert row["next_fire_at"] in {next_fire("*/5 * * * *", "UTC", at) for at in (before, after)}
    assert row["next_fire_at"] > after
    assert _fire(db) == []
    assert _schedule_jobs(db, sid) == []
    # and it fires at that time (as does the other, which fired for now earlier)
    fired = _fire(db, row["next_fire_at"])
    assert sorted(s for s, _ in fired) == sorted([sid, other["schedule_id"]])
    (job,) = _schedule_jobs(db, sid)
    assert job["meta"]["fire_time"] == row["next_fire_at"].isoformat()

    # unknown ids: False; bad ids: InvalidInput
    assert queue.pause_schedule(10**12) is False
    with pytest.raises(InvalidInput):
        queue.pause_schedule(0)


def test_resuming_a_schedule_that_was_not_paused_keeps_its_due_fire(queue: Queue, db: Database) -> None:
    """Resume is for paused schedules: on a running one it changes nothing,
    so a fire that is due (the next maintenance tick would enqueue it) stays due."""
    schedule = queue.add_schedule("acme", "ctl.tick", "*/5 * * * *")
    _execute(db, "UPDATE schedules SET next_fire_at = now() - interval '1 minute'")
    due = queue.schedules()[0]["next_fire_at"]
    assert queue.pause_schedule(int(schedule["schedule_id"]), paused=False) is True
    assert queue.schedules()[0]["next_fire_at"] == due
    assert len(_fire(db)) == 1


# -- time zones --------------------------------------------------------------


def test_a_morning_schedule_in_paris_fires_at_8_or_7_utc_with_daylight_saving(db: Database) -> None:
    paris = ZoneInfo(PARIS)
    winter = _add(db, "acme", "0 9 * * *", timezone=PARIS, now=datetime(2024, 1, 15, 12, 0, tzinfo=UTC),
                  name="winter")
    summer = _add(db, "acme", "0 9 * * *", timezone=PARIS, now=datetime(2024, 7, 15, 12, 0, tzinfo=UTC),
                  name="summer")
    assert winter["next_fire_at"] == datetime(2024, 1, 16, 8, 0, tzinfo=UTC)
    assert summer["next_fire_at"] == datetime(2024, 7, 16, 7, 0, tzinfo=UTC)
    for row in (winter, summer):
        _steps(db, schedules.remove_steps(int(row["schedule_id"])))

    # firing across the changes: spring forward (31 March 2024), fall back (27 October 2024)
    spring = _add(db, "acme", "0 9 * * *", timezone=PARIS, now=datetime(2024, 3, 29, 12, 0, tzinfo=UTC),
                  name="spring")
    assert spring["next_fire_at"] == datetime(2024, 3, 30, 8, 0, tzinfo=UTC)
    expected = [datetime(2024, 3, 30, 8, 0, tzinfo=UTC), datetime(2024, 3, 31, 7, 0, tzinfo=UTC),
                datetime(2024, 4, 1, 7, 0, tzinfo=UTC)]
    for fire_at, following in zip(expected, [*expected[1:], datetime(2024, 4, 2, 7, 0, tzinfo=UTC)],
                                  strict=True):
        assert len(_fire(db, fire_at + timedelta(seconds=30))) == 1
        state = fetch_one(db, "SELECT last_fire_at, next_fire_at FROM schedules")
        assert (state["last_fire_at"], state["next_fire_at"]) == (fire_at, following), state
    jobs = _schedule_jobs(db, spring["schedule_id"])
    times = [datetime.fromisoformat(j["meta"]["fire_time"]) for j in jobs]
    assert times == expected
    assert {t.astimezone(paris).strftime("%H:%M") for t in times} == {"09:00"}
    _steps(db, schedules.remove_steps(int(spring["schedule_id"])))

    autumn = _add(db, "acme", "0 9 * * *", timezone=PARIS, now=datetime(2024, 10, 25, 12, 0, tzinfo=UTC),
                  name="autumn")
    assert autumn["next_fire_at"] == datetime(2024, 10, 26, 7, 0, tzinfo=UTC)
    _fire(db, datetime(2024, 10, 26, 7, 0, 30, tzinfo=UTC))
    assert fetch_one(db, "SELECT next_fire_at FROM schedules")["next_fire_at"] == datetime(
        2024, 10, 27, 8, 0, tzinfo=UTC)


def test_add_schedule_in_a_time_zone_gives_its_local_time_in_utc(queue: Queue) -> None:
    row = queue.add_schedule("acme", "ctl.tick", "0 9 * * *", timezone=PARIS)
    local = row["next_fire_at"].astimezone(ZoneInfo(PARIS))
    assert (local.hour, local.minute) == (9, 0)
    offset = local.utcoffset()
    assert offset is not None
    assert row["next_fire_at"].astimezone(UTC).hour == (7 if offset == timedelta(hours=2) else 8)
    assert row["timezone"] == PARIS


def test_a_daily_schedule_fires_once_on_the_day_the_clocks_go_back(db: Database) -> None:
    """02:30 happens twice in Paris on 27 October 2024 (CEST, then CET): a
    job scheduled daily at 02:30 runs once that day, as cron runs it."""
    row = _add(db, "acme", "30 2 * * *", timezone=PARIS, now=datetime(2024, 10, 26, 12, 0, tzinfo=UTC))
    assert row["next_fire_at"] == datetime(2024, 10, 27, 0, 30, tzinfo=UTC)  # 02:30 CEST
    for at in (datetime(2024, 10, 27, 0, 30, 30, tzinfo=UTC), datetime(2024, 10, 27, 1, 30, 30, tzinfo=UTC),
               datetime(2024, 10, 28, 1, 30, 30, tzinfo=UTC)):
        _fire(db, at)
    days = [datetime.fromisoformat(j["meta"]["fire_time"]).astimezone(ZoneInfo(PARIS)).date().isoformat()
            for j in _schedule_jobs(db, row["schedule_id"])]
    assert days == ["2024-10-27", "2024-10-28"], days
