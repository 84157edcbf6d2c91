"""Rule H2: cancelling a running job is the host's decision
(docs/security.md; docs/controls.md, "Cancelling one job"). The host sends
the batch supervisor `{"op": "cancel", "seq": N}` for the job in flight, or
never hands out a job it was asked to cancel; a job ends `cancelled` only
because the host's record says someone cancelled it (`cancelled_by`); a
guest that reports reason "cancelled" for a job nobody cancelled gets an
ordinary failure (attempt counted, retried or dead); a cancel for any other
sequence number changes nothing; the batch's other jobs are unaffected.

Attacks (guest side: tests/adversarial/attacks/cancel_attacks.py, run by the
worker through tests/adversarial/cancel_app.py, which also registers every
`adv.*` handler):

- forged cancels: cancel frames and lines, `job_end` records with reason
  "cancelled", for every guessable sequence number (its own, siblings',
  0, negative, huge, not integers), to every descriptor the job holds and
  every /proc/PID/fd/* it can open; the exact outcome of a real cancel on
  its own result pipe; floods of all that, with a child that keeps going;
  a process="batch" job that leaves that outcome on the shared result pipe
  for the next job of its kind;
- real cancels (`Queue.cancel(id, by="ops")`) of jobs that ignore and block
  every signal, fork, setsid, double-fork, respawn and exec, and of one
  that races the cancel with result frames (one byte short, completed from
  signal handlers and from leftovers watching the supervisor wake) and
  tries to swallow the host's frames; the next sibling of the batch looks
  for anything of the cancelled job over a watch window (and a control: the
  same stubborn job left to run reports what it had set up by then);
- a cancel of a job of the batch that has not started yet, issued while a
  sibling runs; cancels racing the end of a short job whose sibling runs
  right after it (several offsets); stale cancels of jobs that ended.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tenantq import JobInfo, JobSpec
from tests.adversarial import harness
from tests.adversarial.checks import MALLORY
from tests.adversarial.harness import TERMINAL, Arena, Hostile, Neighbour

CANCEL_APP = "tests.adversarial.cancel_app"
BY = "ops"
# docs/controls.md: a running sandboxed job settles `cancelled` "within about
# a second, and in practice at once" (9-30 ms measured; its acceptance test
# fails above 1 s). Generous for a loaded 2-core host with both drivers, finite:
CANCEL_BOUND = 5.0
# a job's own deadline (cancel.resist: timeout 20 s; rule H5 adds 3 s): past
# it, a job that was never stopped has ended anyway
RESIST_END = 20.0 + 3.0 + 2.0
# the first job of a batch: a sandbox start (a gVisor template build on first use)
FIRST_JOB_TIMEOUT = 60.0
# how long a hostile job gets to set up its leftovers and watchers before the cancel
SETUP_SECONDS = 1.5
RACED = "RESULT-WRITTEN-AFTER-CANCEL"
# the race of a cancel with a job's end: in a batch (a quick sibling, a job
# that naps NAP s, a sibling that sleeps AFTER_NAP s) on a kept-warm sandbox,
# the nap is cancelled OFFSETS after the batch's lease (its started_at): while
# it runs (it ends some 0.35-0.6 s after the lease), after it ended while the
# sibling after it runs but before its `done` is written (seen here: the
# `done` of a batch's finished jobs is written up to about a second after
# they end, while the batch goes on), and after that
NAP = 0.3
AFTER_NAP = 1.0
OFFSETS = (0.15, 0.3, 0.45, 0.6, 0.75, 0.9, 1.1)
SERVE = ("--concurrency", "2", "--batch-size", "10", "--keep-warm", "30")


@pytest.fixture
def ring(arena: Arena, monkeypatch: pytest.MonkeyPatch) -> Arena:
    """The arena, its worker serving tests/adversarial/cancel_app.py."""
    monkeypatch.setattr(harness, "APP", CANCEL_APP)
    return arena


# -- helpers ------------------------------------------------------------------------


def wait_job(arena: Arena, job_id: int, until: Callable[[JobInfo], bool], timeout: float,
             what: str) -> JobInfo | None:
    """Poll Queue.job until `until` holds, within `timeout`; None (and a
    problem) past it."""
    deadline = time.monotonic() + timeout
    while True:
        info = arena.queue.job(job_id)
        if until(info):
            return info
        if time.monotonic() > deadline:
            arena.problems.append(f"{what}: not within {timeout:g} s (job {job_id} is {info.status}, "
                                  f"attempts {info.attempts}, error {(info.last_error or '')[:300]!r})")
            return None
        time.sleep(0.005)  # polling interval of a deadline-bounded wait


def settled(info: JobInfo) -> bool:
    return info.status in TERMINAL


def leased(info: JobInfo) -> bool:
    return info.status != "pending" and info.started_at is not None


def pause(seconds: float) -> None:
    """Let `seconds` pass (to time a cancel, not to wait for a condition)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        time.sleep(0.002)


def enqueue_batch(arena: Arena, plan: list[tuple[str, str, str, Any, int]]) -> dict[str, int]:
    """One insert (so one claim takes them together, in this order) of
    (name, role, kind, payload, max_attempts): role "sibling" is the
    tenant's honest job the harness checks (done, its own result, nothing of
    earlier jobs seen); "hostile" a job that must end done or dead with a
    counted attempt ("own_error": with its own failure text); "target" a
    job this test cancels and checks itself."""
    specs = [JobSpec(tenant=MALLORY, kind=kind, payload=payload, max_attempts=attempts)
             for _, _, kind, payload, attempts in plan]
    ids = arena.queue.enqueue_many(specs)
    named: dict[str, int] = {}
    for job_id, (name, role, kind, payload, attempts) in zip(ids, plan, strict=True):
        named[name] = job_id
        if role == "sibling":
            arena.siblings.append(Neighbour(job_id, int(payload["n"]), MALLORY, True))
        elif role in ("hostile", "own_error"):
            arena.hostile.append(Hostile(job_id, kind, payload, attempts, charged=False,
                                         own_error_text=role == "own_error"))
    if arena.watch is not None:
        arena.watch.watch(ids)
    return named


def sibling(n: int, **extra: Any) -> dict[str, Any]:
    return {"n": n, **extra}


def check_untouched(arena: Arena, ids: dict[str, int], names: list[str], why: str) -> None:
    """Jobs nobody cancelled carry no cancel."""
    for name in names:
        info = arena.queue.job(ids[name])
        arena.expect(info.status != "cancelled" and info.cancelled_by is None
                     and info.cancel_requested_at is None,
                     f"rule H2: {name} (job {info.id}, {info.kind}), which nobody cancelled, {why}: status "
                     f"{info.status}, cancelled_by {info.cancelled_by!r}, cancel requested "
                     f"{info.cancel_requested_at}, error {(info.last_error or '')[:200]!r}")


def check_one_batch(arena: Arena, ids: dict[str, int], siblings: list[str], others: list[str]) -> None:
    """Precondition: the jobs enqueued together ran in one batch, in one
    sandbox (else the sibling checks prove less): every sibling saw the same
    batch supervisor (pid and start time), and every job has the lease time
    of the siblings' batch (a settled job's batch_id is not kept)."""
    seen: dict[str, Any] = {}
    leased: dict[str, Any] = {}
    for name in [*siblings, *others]:
        info = arena.queue.job(ids[name])
        leased[name] = info.started_at
        if name in siblings:
            r = info.result
            seen[name] = (r.get("ppid"), r.get("supervisor_started")) if isinstance(r, dict) else None
    arena.expect(len(set(seen.values())) == 1 and None not in seen.values(),
                 f"precondition: the siblings enqueued together did not run under one batch "
                 f"supervisor: {seen}")
    arena.expect(len(set(leased.values())) == 1,
                 f"precondition: the jobs enqueued together were not leased together: {leased}")


def seconds(later: datetime | None, earlier: datetime | None) -> float | None:
    if later is None or earlier is None:
        return None
    return (later - earlier).total_seconds()


def cancel_running(arena: Arena, job_id: int, name: str) -> tuple[float, bool]:
    """Queue.cancel of a running job: when it was called, and what it said."""
    info = arena.queue.job(job_id)
    arena.expect(info.status == "running",
                 f"precondition: {name} (job {job_id}) is {info.status} when it is cancelled, not running "
                 f"(error {(info.last_error or '')[:300]!r})")
    called = time.monotonic()
    accepted = arena.queue.cancel(job_id, by=BY)
    arena.expect(accepted, f"Queue.cancel({job_id}) of the running {name} returned False")
    return called, accepted


def check_cancelled(arena: Arena, job_id: int, name: str, called: float, observed: float | None) -> None:
    """Ended `cancelled` by `ops`, no result, one counted attempt, within the bound."""
    info = arena.queue.job(job_id)
    text = json.dumps(info.result)
    if info.status == "done" and (info.cancel_requested_at is None or info.finished_at is None
                                  or info.finished_at <= info.cancel_requested_at):
        # "a job that ends first wins" (docs/controls.md): not a broken
        # promise, but the attack went off before the cancel it was to race
        arena.problems.append(f"precondition: {name} (job {job_id}) ended done before its cancel "
                              f"(finished {info.finished_at}, cancel requested {info.cancel_requested_at}): "
                              f"{text[:200]}")
        return
    arena.expect(info.status == "cancelled" and info.cancelled_by == BY,
                 f"rule H2: {name} (job {job_id}) was cancelled while running but ended {info.status}, "
                 f"cancelled_by {info.cancelled_by!r}, result {text[:200]}, error "
                 f"{(info.last_error or '')[:300]!r}")
    arena.expect(info.result is None and RACED not in text,
                 f"rule H2: the cancelled {name} (job {job_id}) has a result: {text[:300]}")
    arena.expect(info.attempts == 1, f"{name} (job {job_id}), cancelled on its first attempt, shows "
                                     f"{info.attempts} attempts (counted once, never retried)")
    took = None if observed is None else observed - called
    stamped = seconds(info.finished_at, info.cancel_requested_at)
    print(f"{arena.driver}: {name} cancelled: observed after {took if took is None else round(took, 3)} s, "
          f"cancel_requested_at -> finished_at {stamped} s; error {(info.last_error or '')[:120]!r}")
    arena.expect(took is not None and took <= CANCEL_BOUND,
                 f"docs/controls.md: the running {name} (job {job_id}) did not settle within "
                 f"{CANCEL_BOUND:g} s of its cancel (observed after {took} s; the docs: within about a "
                 f"second)")
    arena.expect(stamped is not None and 0 <= stamped <= CANCEL_BOUND,
                 f"docs/controls.md: {name} (job {job_id}): cancel_requested_at "
                 f"{info.cancel_requested_at} -> finished_at {info.finished_at} ({stamped} s; bound "
                 f"{CANCEL_BOUND:g} s)")
    seen = arena.watch_history().get(job_id, [])
    counts = [a for a, _ in seen]
    arena.expect(not any(b < a for a, b in itertools.pairwise(counts)),
                 f"{name} (job {job_id}): its attempts went down: {seen}")


def check_ordinary_failure(arena: Arena, job_id: int, name: str, attempts: int) -> None:
    """A job that reported reason "cancelled" for itself, with nobody
    cancelling it: an ordinary failure, every attempt counted, dead."""
    info = arena.queue.job(job_id)
    outcomes = [entry.get("outcome") for entry in info.attempts_history]
    print(f"{arena.driver}: {name} (job {job_id}): {info.status}, attempts {info.attempts}, history "
          f"{json.dumps(info.attempts_history, default=str)[:600]}")
    arena.expect(info.status == "dead" and info.attempts == attempts,
                 f"rule H2: {name} (job {job_id}) reported reason 'cancelled' with nobody cancelling it: it "
                 f"must be an ordinary failure, retried, dead after {attempts} attempts; it is {info.status} "
                 f"after {info.attempts}, cancelled_by {info.cancelled_by!r}, error "
                 f"{(info.last_error or '')[:300]!r}")
    arena.expect("cancelled" not in outcomes,
                 f"rule H2: {name} (job {job_id}): an attempt recorded as cancelled: {outcomes}")


# -- 1 + 2: forged cancels and floods of them -------------------------------------------


def test_forged_cancels_and_floods_of_them_decide_nothing(ring: Arena) -> None:
    arena = ring
    ids: dict[str, int] = {}
    siblings = ["s1", "s2", "s3", "s4", "s5"]

    def forged_batch(a: Arena) -> None:
        a.neighbour(1)
        ids.update(enqueue_batch(a, [
            ("s1", "sibling", "cancel.sibling", sibling(11), 1),
            ("forge", "hostile", "cancel.forge", {"result_fd": "none"}, 1),
            ("s2", "sibling", "cancel.sibling", sibling(12), 1),
            ("forge_cancelled", "own_error", "cancel.forge", {"result_fd": "cancelled"}, 2),
            ("s3", "sibling", "cancel.sibling", sibling(13), 1),
            ("flood", "hostile", "cancel.flood", {"count": 50_000, "child": True}, 1),
            ("s4", "sibling", "cancel.sibling", sibling(14, watch=0.3), 1),
            ("flood_fd3", "own_error", "cancel.flood", {"count": 50_000, "fd3": True}, 2),
            ("s5", "sibling", "cancel.sibling", sibling(15), 1),
        ]))

    def shared_batch(a: Arena) -> None:
        ids.update(enqueue_batch(a, [
            ("shared_forger", "hostile", "cancel.shared", {"forge_next": True}, 1),
            ("shared_next", "own_error", "cancel.shared", {}, 2),
            ("s6", "sibling", "cancel.sibling", sibling(16), 1),
        ]))

    arena.run(*SERVE, once=False, stages=[forged_batch, shared_batch], timeout=150)

    check_one_batch(arena, ids, siblings, ["forge", "flood"])
    check_untouched(arena, ids, [*siblings, "s6", "forge", "forge_cancelled", "flood", "flood_fd3",
                                 "shared_forger", "shared_next"], "was touched by a forged cancel")
    status, _, report, error = arena.outcome(ids["forge"])
    arena.expect(status == "done" and isinstance(report, dict) and report.get("forged") == ids["forge"],
                 f"cancel.forge (its own return) did not end done with its own result: {status} "
                 f"{str(report)[:300]} {error[:600]!r}")
    if status == "done" and isinstance(report, dict):
        opened = {k: v for k, v in report["proc"].items() if v.startswith(("USABLE", "inert"))}
        refused = sorted({v for v in report["proc"].values() if not v.startswith(("USABLE", "inert"))})
        print(f"{arena.driver}: cancel.forge: /proc/PID/fd opens refused with {refused}, pids "
              f"{sorted({k.split('/')[2] for k in report['proc']})} (ppid {report['ppid']})")
        print(f"{arena.driver}: cancel.forge wrote {report['blob_bytes']} bytes of forged cancels to its own "
              f"fds {report['own']}; reopened via /proc: {opened}")
        for path, outcome in report["proc"].items():
            pid = path.split("/")[2]
            if pid in ("1", str(report["ppid"])) and outcome.startswith("USABLE"):
                arena.problems.append(f"rule C1: the job reopened {path} of "
                                      f"{'the runner' if pid == '1' else 'the batch supervisor'} and wrote "
                                      f"forged cancels into it: {outcome}")
    check_ordinary_failure(arena, ids["forge_cancelled"], "cancel.forge (result_fd: cancelled)", 2)
    check_ordinary_failure(arena, ids["flood_fd3"], "cancel.flood (fd3)", 2)
    status, _, result, error = arena.outcome(ids["flood"])
    arena.expect(status == "done" and isinstance(result, dict) and result.get("flooded") == ids["flood"],
                 f"cancel.flood (returns normally) did not end done with its own result: {status} "
                 f"{str(result)[:300]} {error[:300]!r}")
    if status == "done" and isinstance(result, dict):
        print(f"{arena.driver}: cancel.flood wrote {result['written']} in {result['seconds']} s")
    # process="batch": the forger's own result is its own; the next job of its
    # kind may be harmed (rule C2 lets it), but a forged cancel is still an
    # ordinary failure of that job, counted, and retried
    status, _, result, error = arena.outcome(ids["shared_forger"])
    arena.expect(status == "done" and result == {"shared": ids["shared_forger"]},
                 f"cancel.shared (forge_next): {status} {str(result)[:200]} {error[:300]!r}")
    info = arena.queue.job(ids["shared_next"])
    print(f"{arena.driver}: the job after a process='batch' forger: {info.status}, attempts {info.attempts}, "
          f"{info.result!r}, history {[e.get('outcome') for e in info.attempts_history]}")
    arena.expect(info.status in ("done", "dead") and info.attempts == 2
                 and info.result in (None, {"shared": info.id}),
                 f"rule H2: the job after a process='batch' job that forged its outcome 'cancelled' must "
                 f"be an ordinary failure, counted and retried: {info.status} after {info.attempts} "
                 f"attempts, result {info.result!r}, error {(info.last_error or '')[:300]!r}")
    arena.verdict()


# -- 3, 4, 5: real cancels, stubborn and racing jobs, stale and racing cancels ------------


def test_a_real_cancel_stops_its_job_and_nothing_else(ring: Arena) -> None:
    arena = ring
    tag = f"tqcancel{uuid.uuid4().hex[:6]}"
    ids: dict[str, int] = {}
    timing: dict[str, tuple[float, float | None]] = {}
    races: list[dict[str, Any]] = []
    stale: dict[str, Any] = {}
    siblings = ["s0", "s1", "s2", "s3", "s4"]

    def cancel_batch(a: Arena) -> None:
        a.neighbour(2)
        ids.update(enqueue_batch(a, [
            ("s0", "sibling", "cancel.sibling", sibling(21), 1),
            ("stubborn", "target", "cancel.resist", {"tag": tag, "mode": "stubborn"}, 3),
            # looks for the stubborn job's leftovers; the victim is cancelled meanwhile
            ("s1", "sibling", "cancel.sibling", sibling(22, watch=1.0), 1),
            ("racer", "target", "cancel.resist", {"tag": tag, "mode": "racer"}, 3),
            ("s2", "sibling", "cancel.sibling", sibling(23, watch=0.6), 1),
            ("victim", "target", "cancel.victim", {}, 3),
            ("forge_cancelled", "own_error", "cancel.forge", {"result_fd": "cancelled"}, 2),
            ("s3", "sibling", "cancel.sibling", sibling(24), 1),
            # the control: the stubborn job left to report what it set up
            ("control", "hostile", "cancel.resist", {"tag": tag, "mode": "stubborn", "report_after": 1.0}, 1),
            ("s4", "sibling", "cancel.sibling", sibling(25, watch=0.5), 1),
        ]))
        if wait_job(a, ids["s0"], settled, FIRST_JOB_TIMEOUT, "the batch's first job to end") is None:
            return
        for name, before in (("stubborn", None), ("racer", "s1")):
            if before is not None and wait_job(a, ids[before], settled, RESIST_END,
                                               f"{before} to end before {name} runs") is None:
                return
            pause(SETUP_SECONDS)  # the job's leftovers and watchers are up
            called, _ = cancel_running(a, ids[name], name)
            info = wait_job(a, ids[name], settled, RESIST_END, f"the cancelled {name} to settle")
            timing[name] = (called, time.monotonic() if info is not None else None)
            if name == "stubborn":
                # the victim has not started (s1 runs its watch window): the
                # host must never hand it out; s1 must go on
                accepted = a.queue.cancel(ids["victim"], by=BY)
                a.expect(accepted, f"Queue.cancel of the victim (job {ids['victim']}), not started, returned "
                                   "False")
        a.neighbour(3)

    def racing_cancels(a: Arena) -> None:
        for i, offset in enumerate(OFFSETS):
            got = enqueue_batch(a, [
                ("before", "sibling", "cancel.sibling", sibling(30 + i), 1),
                ("nap", "target", "cancel.nap", {"sleep": NAP}, 1),
                ("after", "sibling", "cancel.sibling", sibling(40 + i, sleep=AFTER_NAP), 1),
            ])
            info = wait_job(a, got["nap"], leased, FIRST_JOB_TIMEOUT, f"race {i}: its batch to be leased")
            if info is None or info.started_at is None:
                continue
            pause((info.started_at + timedelta(seconds=offset) - datetime.now(UTC)).total_seconds())
            now = datetime.now(UTC)
            at = (now - info.started_at).total_seconds()
            accepted = a.queue.cancel(got["nap"], by=BY)
            for name in ("nap", "after"):
                wait_job(a, got[name], settled, RESIST_END, f"race {i}: {name} to settle")
            races.append({"offset": round(at, 3), "accepted": accepted, "called": now.timestamp(), **got})

    def stale_cancels(a: Arena) -> None:
        fields = ("status", "result", "finished_at", "cancelled_by", "cancel_requested_at", "attempts",
                  "last_error")
        for name in ("s0", "forge_cancelled", "stubborn", "victim"):
            before = a.queue.job(ids[name])
            accepted = a.queue.cancel(ids[name], by="ops-again")
            after = a.queue.job(ids[name])
            changed = {f: (getattr(before, f), getattr(after, f)) for f in fields
                       if getattr(before, f) != getattr(after, f)}
            stale[name] = (before.status, accepted, changed)
        cli = subprocess.run([*a.cmd, "cancel", str(ids["s0"]), "--by", "cli"], env=a.env,
                             capture_output=True, text=True, timeout=60, check=False)
        stale["cli"] = (cli.returncode, (cli.stdout + cli.stderr).strip()[-400:])
        stale["cli_after"] = a.queue.job(ids["s0"]).cancelled_by

    arena.run(*SERVE, once=False, stages=[cancel_batch, racing_cancels, stale_cancels], timeout=170)

    # the cancelled jobs: cancelled by ops, no result, one attempt, in time
    for name in ("stubborn", "racer"):
        if name in timing:
            check_cancelled(arena, ids[name], name, *timing[name])
        elif name in ids:
            arena.problems.append(f"{name} (job {ids[name]}) was never cancelled: the stage stopped early")
    if "victim" in ids:
        info = arena.queue.job(ids["victim"])
        arena.expect(info.status == "cancelled" and info.cancelled_by == BY and info.result is None,
                     f"rule H2: the victim (job {info.id}), cancelled before its turn in its batch, ended "
                     f"{info.status}, cancelled_by {info.cancelled_by!r}, result {str(info.result)[:200]} "
                     f"(it must never be handed out)")
        print(f"{arena.driver}: victim: {info.status}, attempts {info.attempts}, {info.last_error!r}")
    if ids:
        status, _, control, error = arena.outcome(ids["control"])
        arena.expect(status == "done" and isinstance(control, dict) and len(control["alive"]) >= 4,
                     f"precondition: the stubborn job, left to run, did not have its leftovers up within 1 s "
                     f"(so the cancelled one may not have either): {status} {str(control)[:600]} "
                     f"{error[:300]!r}")
        if isinstance(control, dict):
            print(f"{arena.driver}: control: {len(control['alive'])} leftovers up; the supervisor as a job "
                  f"sees it: {control['fingerprint']}; its stdin: {control['swallow']}")
        check_ordinary_failure(arena, ids["forge_cancelled"], "cancel.forge (result_fd: cancelled) next to "
                                                              "a real cancel in its batch", 2)
        check_untouched(arena, ids, [*siblings, "forge_cancelled"],
                        "was touched by a cancel of another job of its batch")
        check_one_batch(arena, ids, siblings, ["stubborn", "racer"])
        check_leftover_watchers(arena, ids)
    # the cancel racing a job's end never reaches the job after it
    arena.expect(len(races) == len(OFFSETS), f"only {len(races)} of {len(OFFSETS)} races ran")
    kinds = [check_race(arena, race) for race in races]
    print(f"{arena.driver}: races: {kinds}")
    # stale cancels change nothing
    for name, value in stale.items():
        if name in ("cli", "cli_after"):
            continue
        status, accepted, changed = value
        arena.expect(not accepted and not changed,
                     f"docs/controls.md: a cancel of {name}, which had already ended ({status}), returned "
                     f"{accepted} and changed {changed}")
    if "cli" in stale:
        code, text = stale["cli"]
        arena.expect(code == 1 and "already ended" in text and stale["cli_after"] is None,
                     f"docs/controls.md: `tenantq cancel` of a done job: exit {code} (must be 1), {text!r}, "
                     f"cancelled_by now {stale['cli_after']!r}")
    arena.verdict()


def check_leftover_watchers(arena: Arena, ids: dict[str, int]) -> None:
    """Precondition: s1 and s2 ran after the job they look for leftovers of,
    under the batch supervisor s0 ran under (the cancelled job's sandbox);
    else their clean view proves less."""
    first = arena.queue.job(ids["s0"]).result
    for name, cancelled in (("s1", "stubborn"), ("s2", "racer")):
        info, target = arena.queue.job(ids[name]), arena.queue.job(ids[cancelled])
        arena.expect(info.finished_at is not None and target.finished_at is not None
                     and info.finished_at > target.finished_at,
                     f"precondition: {name} did not run after the cancelled {cancelled} "
                     f"({info.finished_at} vs {target.finished_at})")
        mine = info.result
        if not (isinstance(first, dict) and isinstance(mine, dict)):
            continue
        same = (first["ppid"], first["supervisor_started"]) == (mine["ppid"], mine["supervisor_started"])
        arena.expect(same and mine["pid"] > first["pid"],
                     f"precondition: {name} did not run under the batch supervisor of s0 (the sandbox of "
                     f"the cancelled {cancelled}): s0 {first['ppid']}/{first['supervisor_started']} pid "
                     f"{first['pid']}, {name} {mine['ppid']}/{mine['supervisor_started']} pid {mine['pid']}")


def check_race(arena: Arena, race: dict[str, Any]) -> str:
    """One cancel racing the nap's end: the nap ends cancelled (by ops, no
    result) or done with its own result (it ended first); the job after it
    in the batch is never hit. Returns which way it went."""
    nap, after = arena.queue.job(race["nap"]), arena.queue.job(race["after"])
    at = f"race at +{race['offset']} s"
    # the job after the nap starts once the nap has ended: its start (its own
    # clock, the host's under both drivers) tells when the cancel came
    next_started = after.result.get("started") if isinstance(after.result, dict) else None
    when = "?" if next_started is None else \
        "after the nap ended" if race["called"] > next_started else "while the nap ran"
    if nap.status == "cancelled":
        kind = f"cancelled (cancel issued {when})"
        arena.expect(nap.cancelled_by == BY and nap.result is None and race["accepted"],
                     f"{at}: the cancelled nap (job {nap.id}): cancelled_by {nap.cancelled_by!r}, result "
                     f"{nap.result!r}, cancel returned {race['accepted']}")
    elif nap.status == "done":
        kind = f"done, cancel {'accepted' if race['accepted'] else 'refused'} (issued {when})"
        arena.expect(nap.result == {"napped": nap.id},
                     f"{at}: the nap (job {nap.id}) is done with a result not its own: {nap.result!r}")
        if not race["accepted"]:
            arena.expect(nap.cancelled_by is None and nap.cancel_requested_at is None,
                         f"{at}: a refused cancel of the done nap (job {nap.id}) changed it: cancelled_by "
                         f"{nap.cancelled_by!r}")
    else:
        kind = nap.status
        arena.problems.append(f"{at}: the nap (job {nap.id}) ended {nap.status}: "
                              f"{(nap.last_error or '')[:300]!r}")
    hit = after.status != "done" or after.cancelled_by is not None or after.cancel_requested_at is not None
    arena.expect(not hit,
                 f"rule H2: {at}: the job after the cancelled nap (job {after.id}) was hit by the nap's "
                 f"cancel: {after.status}, cancelled_by {after.cancelled_by!r}, cancel requested "
                 f"{after.cancel_requested_at}, error {(after.last_error or '')[:300]!r}")
    arena.expect(nap.started_at == after.started_at,
                 f"precondition: {at}: the nap and the job after it were not leased together "
                 f"({nap.started_at}, {after.started_at})")
    return f"+{race['offset']} s: {kind}"
