"""Rule F1 (docs/security.md) and docs/tenant-data.md, attacked from inside
real sandboxes by jobs that have read the source: the batch's host-function
socket (`/tenantq/egress/hostfn.sock`) gets bad headers, a header announcing
~10 GB, a 10 MiB body, slowloris stalls, hundreds of parallel connections and
calls, replies never read, half-closes, garbage, NaN, deep nesting, non-object
args, names that are huge, not strings or unicode look-alikes, names declared
by a sibling handler of the same batch or by none, attempts to unlink or
replace the socket; a job passes another tenant's id, row ids and SQL in its
args, switches its session's tenant, writes another tenant's row; a job
leaves a daemon that keeps calling into the next job of its batch and fires
requests it hangs up on as it returns; forked children make more than the
batch's 1,000 calls, more than 4 at a time; four calls overrun their timeout.

What must hold: the host's own record of every host-function run (each
function logs its `ctx` to a host file) shows only declared names, the
batch's tenant and the calling job's id and actor, never a call of one job
run as another's, never NaN in args, at most 4 running at once and 1,000 per
batch; RLS shows mallory only mallory's rows; every refusal is one line in a
reply, in time; the worker stays up and small, the neighbour's jobs (plain
and host-function ones) keep their normal waits (harness checks)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tenantq import JobSpec
from tests.adversarial import harness
from tests.adversarial.checks import ACME, MALLORY, NEIGHBOUR_WAIT_SECONDS
from tests.adversarial.harness import Arena, Hostile
from tests.adversarial.hostfn_app import DECLARED, LOG_ENV, SCHEMA_ENV
from tests.appdb import ROWS, AppSchema

APP = "tests.adversarial.hostfn_app"
MALLORY_ROWS = [20, 21]
# stated in rule F1 / docs/tenant-data.md
MAX_IN_FLIGHT = 4
MAX_CONNECTIONS = MAX_IN_FLIGHT + 4
MAX_CALLS = 1000
READ_DEADLINE = 10.0
SLACK = 3.0
# mal.daemon (leaves a daemon, fires requests as it returns), then the next job of its batch
DAEMON_PAIRS = ("mal.daemon", "mal.after", "mal.daemon#2", "mal.after#2", "mal.daemon#3", "mal.after#3")
# raw requests the host may answer (their host-side runs are checked instead)
ANSWERABLE = {"trailing_bytes", "two_requests", "dup_name", "forged_envelope"}


def actor_of(tenant: str, key: str) -> str:
    return f"usr_{tenant}_" + re.sub(r"\W", "_", key.replace("mal.", ""))


def _enqueue(arena: Arena, tenant: str, jobs: list[tuple[str, str]], ids: dict[str, int]) -> None:
    """(key, kind) jobs in one insert (one claim takes them together), an
    actor of its own per job."""
    specs = [JobSpec(tenant=tenant, kind=kind, payload={}, max_attempts=1,
                     actor=actor_of(tenant, key)) for key, kind in jobs]
    for job_id, (key, kind) in zip(arena.queue.enqueue_many(specs), jobs, strict=True):
        ids[key] = job_id
        arena.hostile.append(Hostile(job_id, kind, {}, 1, True))
        if arena.watch is not None:
            arena.watch.watch([job_id])


def _host_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _max_overlap(entries: list[dict[str, Any]]) -> int:
    """Most host-function runs (start..end pairs) at one instant."""
    events: list[tuple[float, int]] = []
    for e in entries:
        if e["phase"] in ("start", "end"):
            events.append((e["t"], 1 if e["phase"] == "start" else -1))
    # an end at the same instant as a start is counted first
    events.sort(key=lambda ev: (ev[0], ev[1]))
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def _one_line_refusal(out: dict[str, Any]) -> str | None:
    """None if `out` (hostfn_app.read_reply) is a one-line refusal in time, else why not."""
    reply = out.get("reply")
    if not isinstance(reply, dict):
        return f"no reply ({ {k: v for k, v in out.items() if k != 'reply'} })"
    if reply.get("ok") is not False:
        return f"not refused: {reply}"
    error = str(reply.get("error", ""))
    if not error or "\n" in error:
        return f"the refusal is not one line: {error[:200]!r}"
    return None


def test_host_function_socket_attacks_and_tenant_confusion(
        arena: Arena, app_schema: AppSchema, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "APP", APP)
    with psycopg.connect(app_schema.superuser_url, autocommit=True) as conn:
        for order_id in MALLORY_ROWS:
            conn.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s, %s)").format(
                sql.Identifier(app_schema.schema, "orders")), (order_id, MALLORY, order_id * 100))
    host_log = tmp_path / "hostfn.jsonl"
    arena.env.update({"TENANTQ_APP_DATABASE_URL": app_schema.login_url, SCHEMA_ENV: app_schema.schema,
                      LOG_ENV: str(host_log)})
    ids: dict[str, int] = {}
    batches: list[set[int]] = []

    def socket_and_confusion(a: Arena) -> None:
        before = set(ids.values())
        _enqueue(a, MALLORY, [(k, k) for k in ("mal.peer", "mal.raw", "mal.confuse")], ids)
        batches.append(set(ids.values()) - before)
        _enqueue(a, ACME, [("acme:honest1", "mal.honest")], ids)

    def daemon_and_flood(a: Arena) -> None:
        before = set(ids.values())
        _enqueue(a, MALLORY, [(k, k.split("#")[0]) for k in (*DAEMON_PAIRS, "mal.flood", "mal.uncaught")],
                 ids)
        batches.append(set(ids.values()) - before)
        _enqueue(a, ACME, [("acme:honest2", "mal.honest")], ids)

    arena.run("--concurrency", "2", "--batch-size", "8", once=False, timeout=240,
              stages=[socket_and_confusion, daemon_and_flood])

    p = arena.problems
    jobs = {job_id: arena.job(job_id) for job_id in ids.values()}
    actors = {job_id: actor_of(jobs[job_id].tenant_id, key) for key, job_id in ids.items()}

    def report(key: str) -> dict[str, Any]:
        info = jobs[ids[key]]
        if info.status != "done" or not isinstance(info.result, dict):
            p.append(f"{key} did not report: {info.status} {(info.last_error or '')[:600]}")
            return {}
        return info.result

    def mine(key: str, got: Any, what: str) -> None:
        """A host function's view of the caller must be the calling job's."""
        job_id = ids[key]
        expected = {"tenant": MALLORY, "actor": actors[job_id], "job_id": job_id, "kind": key.split("#")[0]}
        seen = {k: got.get(k) for k in expected} if isinstance(got, dict) else got
        if seen != expected:
            p.append(f"F1/H2: {key} {what}: the host function saw {seen}, not {expected}")

    # the test's premise: each stage's jobs ran in one batch (one socket)
    for keys in (("mal.peer", "mal.raw", "mal.confuse"), DAEMON_PAIRS):
        stamps = {k: jobs[ids[k]].result.get("stamp") for k in keys if isinstance(jobs[ids[k]].result, dict)}
        arena.expect(len(set(stamps.values())) == 1 and len(stamps) == len(keys),
                     f"test setup: these jobs did not share one batch's socket: {stamps}")

    # -- mal.peer: its own names only ------------------------------------------------
    peer = report("mal.peer")
    if peer:
        arena.expect(peer["other"] == {"ok": "other"}, f"mal.peer could not call its own mal.other: {peer}")
        mine("mal.peer", peer["log"].get("ok"), "mal.log")
        arena.expect("error" in peer["noop_of_sibling"],
                     f"F1: mal.peer called mal.noop, declared only by its batch's mal.raw: {peer}")

    # -- mal.raw: the socket itself ----------------------------------------------------
    raw = report("mal.raw")
    if raw:
        print(f"mal.raw report on {arena.driver}:")
        for label in sorted(raw):
            print(f"  {label}: {json.dumps(raw[label])[:400]}")
        for label, out in raw.items():
            if not isinstance(out, dict) or label in ANSWERABLE or label in (
                    "parallel", "parallel_calls", "socket_path", "half_close_after_request",
                    "other_via_ctx", "log_at_end") or label.startswith(("slowloris", "never_read")):
                continue
            if label.startswith("half_close_mid"):
                if out.get("timeout"):
                    p.append(f"F1: raw {label}: a request the guest half-closed mid-way held the "
                             f"connection for {out.get('secs')} s: {out}")
                continue
            why = _one_line_refusal(out)
            if why:
                p.append(f"F1: raw {label} (every refusal is one line in the reply): {why}")
        out = raw.get("forged_envelope", {})
        reply = out.get("reply") or {}
        if reply.get("ok") is True:
            mine("mal.raw", reply.get("result"), "a request naming tenant acme, actor root, job 1")
            rows = (reply.get("result") or {}).get("rows")
            arena.expect(rows == [[i, MALLORY] for i in MALLORY_ROWS],
                         f"F1: a request naming another tenant saw rows {rows}")
        half = raw["half_close_after_request"].get("reply") or {}
        arena.expect(half.get("ok") is True and half.get("result") == 1,
                     f"a complete request followed by a half-close got no answer: "
                     f"{raw['half_close_after_request']}")
        for label in ("slowloris_header", "slowloris_body"):
            out = raw.get(label, {})
            if out.get("timeout") or out.get("secs", 0) > READ_DEADLINE + SLACK or "secs" not in out:
                p.append(f"F1 (each read has a 10 s deadline): raw {label}: the stalled connection was "
                         f"not cut within {READ_DEADLINE + SLACK:g} s: {out}")
        for label in ("header_10gb", "header_64k_plus_1", "body_10mib"):
            secs = raw.get(label, {}).get("secs", 99)
            arena.expect(secs <= SLACK, f"F1: raw {label}: refused only after {secs} s "
                                        "(the header alone decides)")
        par = raw["parallel"]
        arena.expect(par["still_open"] <= MAX_CONNECTIONS,
                     f"F1 (at most in-flight + 4 connections per batch): {par['still_open']} of "
                     f"{par['connected']} idle connections stayed open: {par}")
        arena.expect((par["call_after"].get("reply") or {}).get("ok") is True,
                     f"after 300 idle connections were closed, a call still failed: {par['call_after']}")
        calls = raw["parallel_calls"]["outcomes"]
        odd = {k: n for k, n in calls.items() if k != "ok" and not k.startswith(("refused", "closed"))}
        arena.expect(not odd, f"F1: of 100 parallel calls some were neither answered nor refused nor "
                              f"closed: {calls}")
        for name, outcome in raw["socket_path"].items():
            if name in ("listing", "call_after"):
                continue
            arena.expect(outcome.startswith("refused"),
                         f"F1 (the socket is mounted read-only): the job could {name} in "
                         f"/tenantq/egress: {outcome} (listing {raw['socket_path']['listing']})")
        arena.expect((raw["socket_path"]["call_after"].get("reply") or {}).get("ok") is True,
                     f"after the socket attacks a call failed: {raw['socket_path']['call_after']}")
        arena.expect("error" in raw["other_via_ctx"],
                     f"F1: mal.raw called mal.other (declared by its batch's mal.peer): "
                     f"{raw['other_via_ctx']}")
        mine("mal.raw", raw["log_at_end"].get("ok"), "mal.log at the end")

    # -- mal.confuse: another tenant in the args -----------------------------------------
    confuse = report("mal.confuse")
    if confuse:
        job_id = ids["mal.confuse"]
        views = {"whoami": confuse["whoami"], "injection": confuse["injection"],
                 **{f"after_switch[{i}]": v for i, v in enumerate(confuse["after_switch"])},
                 **{f"threaded[{i}]": v for i, v in enumerate(confuse["threaded"])}}
        arena.expect(len(confuse["threaded"]) == 4, f"threaded calls missing: {confuse['threaded']}")
        for what, view in views.items():
            got = view.get("ok")
            if not isinstance(got, dict):
                p.append(f"mal.confuse {what}: the call failed: {view}")
                continue
            mine("mal.confuse", got, what)
            expected = {"setting": MALLORY, "db_actor": actors[job_id],
                        "rows": [[i, MALLORY] for i in MALLORY_ROWS]}
            seen = {k: got.get(k) for k in expected}
            arena.expect(seen == expected, f"F1/RLS: mal.confuse {what} (args naming acme, ids, SQL): "
                                           f"{seen}, not {expected}")
            arena.expect(got.get("by_tenant") == [] and set(got.get("by_id", [])) <= set(MALLORY_ROWS),
                         f"F1/RLS: mal.confuse {what}: another tenant's rows by id or name: {got}")
        arena.expect(confuse["switch"] == {"ok": True}, f"mal.switch failed: {confuse['switch']}")
        arena.expect("error" in confuse["insert_other_tenant"],
                     f"RLS: a host function wrote tenant acme's row: {confuse['insert_other_tenant']}")
        for one in confuse["overruns"]:
            arena.expect("error" in one and one["secs"] <= 0.5 + SLACK,
                         f"F1 (a call is answered within its timeout): an overrunning call: {one}")
        arena.expect("error" in confuse["while_overrunning"],
                     f"F1 (an overrunning function still counts as in flight): a 5th call while 4 overran "
                     f"was run: {confuse['while_overrunning']} at {confuse['while_overrunning_secs']} s")
        arena.expect(confuse["after_overruns"] == {"ok": 1},
                     f"once the overrunning functions returned, a call failed: {confuse['after_overruns']}")
    with psycopg.connect(app_schema.superuser_url, autocommit=True) as conn:
        rows = conn.execute(sql.SQL("SELECT id, tenant_id FROM {} ORDER BY id").format(
            sql.Identifier(app_schema.schema, "orders"))).fetchall()
    expected_rows = sorted([(i, t) for t, ids_ in ROWS.items() for i in ids_] + [(i, MALLORY)
                                                                                for i in MALLORY_ROWS])
    arena.expect([tuple(r) for r in rows] == expected_rows, f"RLS: the orders table changed: {rows}")

    # -- mal.daemon / mal.after: calls from a job that ended -------------------------------
    for key in DAEMON_PAIRS:
        got = report(key)
        for i, view in enumerate(got.get("seen", [])):
            if "ok" in view:  # (or refused: the calls left over from mal.daemon may hold its slots)
                mine(key, view.get("ok"), f"call {i}")
            else:
                arena.expect("error" in view, f"{key} call {i}: neither a result nor a refusal: {view}")

    # -- mal.flood: concurrency and the per-batch budget ----------------------------------
    flood = report("mal.flood")
    if flood:
        outcomes = flood["outcomes"]
        print("mal.flood outcomes on", arena.driver, outcomes)
        arena.expect(not any(k.startswith("OTHER") for k in outcomes),
                     f"F1: a call ended with something other than its result or HostFunctionError: "
                     f"{outcomes}")
        arena.expect(outcomes.get("ok", 0) <= MAX_CALLS, f"F1: one job made {outcomes.get('ok')} calls")
        arena.expect(any(k != "ok" and "already running" not in k for k in outcomes),
                     f"F1: the flood's children never met the batch's {MAX_CALLS} calls: {outcomes}")

    # -- mal.uncaught: a clear error ------------------------------------------------------
    info = jobs[ids["mal.uncaught"]]
    arena.expect(info.status == "dead" and (info.last_error or "").startswith("HostFunctionError: "),
                 f"mal.uncaught: {info.status} {(info.last_error or '')[:300]!r}")

    # -- the neighbour's host-function jobs -------------------------------------------------
    for key, job_id in ids.items():
        if not key.startswith(f"{ACME}:"):
            continue
        info = jobs[job_id]
        if info.status != "done":
            p.append(f"acme's mal.honest {job_id} is {info.status}: {(info.last_error or '')[:400]}")
            continue
        for i, view in enumerate(info.result["calls"]):
            got = view.get("ok") or {}
            honest: dict[str, Any] = {"tenant": ACME, "actor": actors[job_id], "job_id": job_id,
                                      "kind": "mal.honest", "setting": ACME,
                                      "rows": [[r, ACME] for r in ROWS[ACME]], "by_id": [], "by_tenant": []}
            seen = {k: got.get(k) for k in honest}
            arena.expect(seen == honest, f"acme's mal.honest {job_id} call {i}: {seen or view}")
        wait = (info.finished_at - info.created_at).total_seconds() if info.finished_at else 0.0
        arena.expect(wait <= NEIGHBOUR_WAIT_SECONDS,
                     f"acme's mal.honest {job_id} took {wait:.1f} s from enqueue to done")

    # -- the host's own record of every run ---------------------------------------------------
    entries = _host_log(host_log)
    arena.expect(bool(entries), f"no host function ran at all ({host_log})")
    misattributed: list[str] = []
    escalated = 0
    for e in entries:
        if e["job_id"] not in jobs:
            p.append(f"F1: a host function ran for job {e['job_id']}, none of this test's: {e}")
            continue
        info = jobs[e["job_id"]]
        if (e["tenant"], e["actor"], e["kind"]) != (info.tenant_id, actors[e["job_id"]], info.kind):
            p.append(f"F1/H2: a host function ran with tenant/actor/kind {e['tenant']}/{e['actor']}/"
                     f"{e['kind']} for job {e['job_id']} "
                     f"({info.tenant_id}/{actors[e['job_id']]}/{info.kind})")
        if e["fn"] not in DECLARED.get(e["kind"], []):
            p.append(f"F1: {e['fn']} ran for a job of {e['kind']}, which does not declare it: {e}")
        if re.search(r"\b(NaN|-?Infinity)\b", e["args"]):
            p.append(f"F1 (args must be a JSON object; NaN and Infinity are not JSON): {e['fn']} ran "
                     f"with args {e['args'][:120]}")
        tag = e["tag"] or ""
        owner = tag.split(":", 1)[0]
        if owner.isdigit() and int(owner) != e["job_id"]:
            caller = jobs.get(int(owner))
            if caller is not None and e["fn"] not in DECLARED.get(caller.kind, []):
                escalated += 1
            misattributed.append(f"{tag} ({e['fn']}) ran as job {e['job_id']} (actor {e['actor']}, "
                                 f"kind {e['kind']})")
    if misattributed:
        p.append(f"F1/H2 (the job calling is the one the host handed out): {len(misattributed)} calls made "
                 f"by one job ran as another job of its batch ({escalated} of them of a function the "
                 f"calling job's handler does not declare), e.g. {misattributed[:4]}")
    for n, batch in enumerate(batches, 1):
        runs = [e for e in entries if e["job_id"] in batch]
        calls = [e for e in runs if e["phase"] in ("run", "start")]
        arena.expect(len(calls) <= MAX_CALLS, f"F1: mallory's batch {n} ran {len(calls)} host functions "
                                              f"(at most {MAX_CALLS} calls per batch)")
        peak = _max_overlap(runs)
        arena.expect(peak <= MAX_IN_FLIGHT, f"F1: {peak} host functions of mallory's batch {n} ran at "
                                            f"once (at most {MAX_IN_FLIGHT} in flight)")
        print(f"mallory batch {n} on {arena.driver}: {len(calls)} host-function runs, at most {peak} at once")
    print(f"host log: {len(entries)} runs; {len(misattributed)} misattributed")
    arena.verdict()
