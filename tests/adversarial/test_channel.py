"""The control channel (guest/protocol.py) cannot be forged by a job (rules
C1, H2, H4): a job that writes garbage and forged `job_end` / `batch_end` /
`ready` records to every descriptor it has and to every /proc/PID/fd/* it can
open decides its own result only, never a sibling's, never its batch's end;
a job that writes its own result frame past guest/jobs.py's checks (too
deep, a reason outside the fixed set, 1e400, NaN, NUL and lone surrogates,
over the result limit, a lying header, a truncated frame) fails alone with a
classified reason; a payload that is in the table despite the enqueue checks
fails alone as undecodable (rule H6)."""

from __future__ import annotations

import json

import psycopg
from psycopg import sql as pgsql

from tests.adversarial import attack_app
from tests.adversarial.attack_app import FORGED
from tests.adversarial.harness import Arena


def test_forged_control_records_decide_nothing(arena: Arena) -> None:
    arena.neighbour(1)
    fds = arena.attack("adv.fds", {"result_fd": False}, charged=False)
    siblings = [arena.sibling(2), arena.sibling(3)]
    arena.attack("adv.fds", {"result_fd": True}, charged=False)
    siblings += [arena.sibling(4), arena.sibling(5)]
    fds_again = arena.attack("adv.fds", {"result_fd": False}, charged=False)
    siblings.append(arena.sibling(6))
    arena.neighbour(7)
    arena.run("--concurrency", "2", "--batch-size", "4")

    for job_id in (fds, fds_again):
        status, _, report, error = arena.outcome(job_id)
        arena.expect(status == "done", f"adv.fds (no result fd) did not report: {status} {error[:800]}")
        if status != "done":
            continue
        arena.expect(bool(report["own"]), "adv.fds found no descriptor of its own to write to")
        opened = {k: v for k, v in report["proc"].items() if v.startswith(("USABLE", "inert"))}
        print(f"adv.fds {job_id} on {arena.driver}: own fds {report['own']}; reopened via /proc: {opened}")
        for path, outcome in report["proc"].items():
            pid = path.split("/")[2]
            if pid in ("1", str(report["ppid"])) and outcome.startswith("USABLE"):
                arena.problems.append(f"rule C1: the job reopened {path} of "
                                      f"{'the runner' if pid == '1' else 'the batch supervisor'}: {outcome}")
    # fds_all wrote forged frames then garbage into its own result pipe: the
    # first frame is its own result to decide, whatever it says
    for job_id in [fds, fds_again, *siblings]:
        info = arena.job(job_id)
        arena.expect(info.result != FORGED and FORGED not in json.dumps(info.result),
                     f"job {job_id} ({info.kind}) has a forged result: {str(info.result)[:200]}")
        if job_id in siblings:
            arena.expect(FORGED not in (info.last_error or ""), f"sibling {job_id} got a forged error")
    arena.verdict()


RAW_VARIANTS = ("deep", "reason", "inf", "nan_token", "error_text", "over_result_limit", "nul_result",
                "surrogate_result", "huge_header", "truncated")


def deep_json(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def test_raw_result_frames_fail_alone(arena: Arena) -> None:
    arena.neighbour(1)
    raw = {v: arena.attack("adv.raw_result", {"variant": v}, own_error_text=v == "error_text")
           for v in RAW_VARIANTS}
    extra = arena.attack("adv.raw_result", {"variant": "extra_fields"})
    sibling = arena.sibling(2)
    # a payload that got into the table anyway (rule H6): nested 5,000 deep
    smuggled = arena.attack("adv.echo", {"n": 1})
    with psycopg.connect(arena.db.dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("UPDATE {} SET payload = %s::jsonb WHERE id = %s").format(
            pgsql.Identifier(arena.db.schema, "jobs")), (deep_json(5000), smuggled))
    last = arena.sibling(3)
    arena.neighbour(4)
    arena.run("--concurrency", "2", "--batch-size", "1", timeout=150)

    for variant, job_id in raw.items():
        status, attempts, result, error = arena.outcome(job_id)
        if variant in ("nul_result", "surrogate_result"):
            # Postgres cannot store these; the host may clean them, or fail the job with the reason
            if status == "done":
                text = json.dumps(result)
                arena.expect("\\u0000" not in text and "\\ud800" not in text and "\\udfff" not in text,
                             f"raw {variant}: stored a result holding what it must not: {text[:200]}")
            continue
        arena.expect(status == "dead", f"raw result frame {variant!r} was accepted: {status}, "
                                       f"result {str(result)[:200]}, error {error[:300]!r}")
    status, attempts, result, error = arena.outcome(extra)
    arena.expect(status == "done" and result == 1 and attempts == 1,
                 f"a result frame with extra fields: {status}, attempts {attempts}, {result!r}, "
                 f"{error[:300]}")
    status, attempts, result, error = arena.outcome(smuggled)
    arena.expect(status == "dead", f"a 5,000-deep payload in the table ended {status}: {error[:300]}")
    arena.expect(bool(error), "a 5,000-deep payload in the table failed without a reason")
    for job_id in (sibling, last):
        arena.expect(arena.job(job_id).status == "done", f"sibling {job_id} did not finish")
    arena.verdict()


def test_a_shared_process_job_reaches_no_other_kind_and_no_next_batch(arena: Arena) -> None:
    """A handler with process="batch" opts out of rule C2 for its own kind
    only: its job may affect the later jobs of its kind in its batch, never
    another kind's, never the next batch, and its process is replaced
    whenever another kind comes next."""
    spec = {"tag": "tqadv-shared", "ipc_key": 4242}
    ids: dict[str, int] = {}

    def first_batch(a: Arena) -> None:
        (ids["shared1"], ids["other_kind"], ids["shared2"], ids["shared3"], ids["look"]) = a.attack_batch(
            ("adv.shared", {}), ("adv.echo", {"n": 7}), ("adv.shared", {}), ("adv.shared", {}),
            ("adv.look", spec))

    def next_batch(a: Arena) -> None:
        ids["next_batch"], = a.attack_batch(("adv.look", spec))

    arena.run("--concurrency", "2", "--batch-size", "5", "--keep-warm", "30", once=False,
              stages=[first_batch, next_batch], timeout=150)

    for name in ("shared1", "shared2"):
        status, _, result, error = arena.outcome(ids[name])
        arena.expect(status == "done" and isinstance(result, dict) and result.get("shared") == ids[name],
                     f"{name}, the first job of its kind since another kind ran, did not get its own "
                     f"result: {status} {str(result)[:200]} {error[:200]}")
    # (shared3 ran right after shared2 in the same process: what it got is
    # for the handler's author to accept, and shows the sharing had teeth)
    print(f"shared3 after shared2 in one process: {arena.outcome(ids['shared3'])[2]!r}")
    status, _, result, error = arena.outcome(ids["other_kind"])
    expected = {"tenant": "mallory", "n": 7, "billing": attack_app.billing(7)}
    arena.expect(status == "done" and isinstance(result, dict)
                 and {k: result.get(k) for k in expected} == expected and not result.get("others"),
                 f"rule C2: the job of another kind after a process='batch' job: {status} "
                 f"{str(result)[:300]} {error[:200]}")
    for name in ("look", "next_batch"):
        status, _, seen, error = arena.outcome(ids[name])
        arena.expect(status == "done", f"{name}: {status} {error[:300]}")
        if status == "done":
            arena.expect(not seen["others"], f"rule C2: {name} sees processes a process='batch' job left: "
                                             f"{seen['others']}")
            dirty = {d: e for d, e in seen["scratch"].items() if e}
            arena.expect(not dirty, f"rule C2/P1: {name} sees files a process='batch' job left: {dirty}")
    arena.verdict()
