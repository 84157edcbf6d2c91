"""The hand-over (docs/security.md, rule C1 and the paragraph after it;
docs/sandbox.md, "One path"): every queue sandbox boots with the Sandbox
API's agent as its init, and before any tenant is bound to it the host asks
the agent to hand over, the agent execs the guest runner in its own place,
and from then on the host reads the channel only as the batch protocol; the
ready pool (`worker --ready-pool N`) prepares such sandboxes with no tenant,
binds one to a tenant when its batch takes it and never gives it to another.

Attacked from inside, by a tenant's job that has read the guest code
(tests/apps/hand_over_attacks.py, the worker's app here):

1. it looks for the agent and commands it: agent ops (exec, fs, env,
   hand_over, ...), agent events and batch records (forged `job_end`s for
   its siblings) to every descriptor it holds, to every /proc/PID/fd/* it
   can open and to every Unix socket it can name. Nothing it asked for may
   happen (in the sandbox or on the host), pid 1 must be the runner with the
   runner's credentials, and its own and its siblings' results and attempts
   must be theirs;
2. it leaves files (scratch dirs, the work dir, under the read-only code
   mounts in /tmp, any other writable dir, /dev's symlinks swapped for its
   own where /dev is writable), processes, IPC objects and
   environment in a pooled and in a kept-warm sandbox, and the other
   tenant's next job must see none of it (nor the same tenant's next batch);
3. it reads whatever it can of a sandbox the other tenant's batch ran in
   before it: the other tenant's secret (given through `--secrets`) must be
   nowhere in it.
"""

from __future__ import annotations

import json
import random
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tenantq import JobSpec
from tenantq.testing import wait_until
from tests.adversarial import harness
from tests.adversarial.attack_app import FORGED
from tests.adversarial.attacks.tools import SCRATCH_DIRS
from tests.adversarial.harness import ACME, MALLORY, TERMINAL, Arena
from tests.adversarial.test_leftovers import METRICS_PORT, wait_kept_warm
from tests.sandbox.conftest import sandbox_dirs

APP = "tests.apps.hand_over_attacks"
# docs/security.md, rule C1: what gVisor lets a job read of the runner's and
# the supervisor's /proc/PID/environ is "tenantq's fixed environment: PATH,
# HOME, LANG, PYTHON*"
FIXED_ENV = ("PATH", "HOME", "LANG")
# rule C1: under gVisor the runner (and the supervisor) are root with only
# CAP_SETUID, CAP_SETGID, CAP_KILL and CAP_SYS_ADMIN; jobs run as 65534 with none
RUNNER_CAPS = (1 << 5) | (1 << 6) | (1 << 7) | (1 << 21)
JOB_UID = 65534
STAGE_SECONDS = 90.0


@pytest.fixture(autouse=True)
def hand_over_app(monkeypatch: pytest.MonkeyPatch) -> None:
    """The arena's worker runs this test's app (which registers adv.* too)."""
    monkeypatch.setattr(harness, "APP", APP)


def fixed_env_problems(where: str, environ: Any, secret_values: list[str]) -> list[str]:
    """Rule C1: a runner's or supervisor's /proc environ, where readable,
    is the fixed environment and holds no secret (of any tenant)."""
    if not isinstance(environ, dict):
        return []  # not readable (bubblewrap: non-dumpable)
    problems = []
    extra = sorted(k for k in environ if k not in FIXED_ENV and not k.startswith("PYTHON"))
    if extra:
        problems.append(f"rule C1: {where} has more than tenantq's fixed environment (PATH, HOME, LANG, "
                        f"PYTHON*): {extra}")
    text = json.dumps(environ)
    for value in secret_values:
        if value in text:
            problems.append(f"rule C1: a tenant's secret is in {where}")
    return problems


def env_problems(who: str, tenant: str, seen: dict[str, Any],
                 secrets: dict[str, dict[str, str]]) -> list[str]:
    """Promise 2 and docs/sandbox.md ("the tenant's secrets arrive per
    batch"): a job's ctx.env and environment hold its own tenant's secrets
    and no other tenant's."""
    problems = []
    for name, value in secrets[tenant].items():
        if seen["ctx_env"].get(name) != value:
            problems.append(f"{who} ({tenant}): its own secret {name} is not in ctx.env: "
                            f"{sorted(seen['ctx_env'])}")
    for other, theirs in secrets.items():
        if other == tenant:
            continue
        for name in theirs:
            if name in seen["ctx_env"] or name in seen["env"]:
                problems.append(f"promise 2: {who} ({tenant}) has {other}'s secret {name} in its environment")
    extra = sorted(set(seen["ctx_env"]) - set(secrets[tenant]))
    if extra:
        print(f"{who} ({tenant}): ctx.env holds more than the tenant's secrets: {extra}")
    return problems


def caps(status: dict[str, str], key: str) -> int:
    try:
        return int(status.get(key, "0"), 16)
    except ValueError:
        return -1


def runner_problems(driver: str, facts: dict[str, Any], who: str) -> list[str]:
    """Rule C1, hand-over paragraph: pid 1 is the guest runner (the agent
    exec'd it in its own place), no agent is left anywhere in the sandbox,
    and the runner has the runner's credentials."""
    problems = []
    pid1 = facts["pid1_cmdline"]
    if "runner.py" not in pid1 or "agent.py" in pid1:
        problems.append(f"rule C1: {who}: pid 1 is not the guest runner: {pid1[:200]!r}")
    agents = {p: c for p, c in facts["cmdlines"].items() if "agent.py" in c or "tenantq.guest.agent" in c}
    if agents:
        problems.append(f"rule C1: {who}: an agent is left in the sandbox to speak for it: {agents}")
    if facts["uid"] != JOB_UID:
        problems.append(f"rule C1: {who}: the job runs as uid {facts['uid']}, not {JOB_UID}")
    if caps(facts["self_status"], "CapEff") != 0:
        problems.append(f"rule C1: {who}: the job has capabilities: {facts['self_status']}")
    if driver == "gvisor":
        for name, status in (("pid 1 (the runner)", facts["pid1_status"]),
                             ("the batch supervisor", facts["ppid_status"])):
            if status.get("Uid", "").split()[:1] != ["0"]:
                problems.append(f"rule C1: {who}: {name} is not the sandbox's root: {status}")
            for key in ("CapEff", "CapPrm", "CapAmb", "CapInh"):
                value = caps(status, key)
                if value < 0 or value & ~RUNNER_CAPS:
                    problems.append(f"rule C1: {who}: {name} holds {key} {status.get(key)} beyond "
                                    f"CAP_SETUID, CAP_SETGID, CAP_KILL, CAP_SYS_ADMIN")
    return problems


# -- 1: no agent to command ------------------------------------------------------------


def test_no_agent_is_left_to_command_and_forged_frames_settle_nothing(arena: Arena, tmp_path: Path) -> None:
    """Rule C1 (only tenantq's own processes hold the control channel; after
    the hand-over no agent is left in the sandbox to speak for it, the
    runner is pid 1 with the runner's credentials, and the host reads the
    channel only as the batch protocol) and rule H2 / promise 5 (a job
    decides its own result only: never a sibling's, never its own attempt
    accounting). A job writes agent ops (exec, fs write/read/make_dir, env,
    egress, hand_over, quiesce/resume, kill), agent events and batch records
    (forged job_end for every plausible sequence number, its siblings'
    included) to every fd it holds, /proc/1/fd/*, /proc/*/fd/* (and task
    fds) and every Unix socket it can name. Nothing it asked for happens (no
    file in /tmp, the work dir or a host directory; no injected environment
    in a later job), the siblings around it settle with their own results at
    one attempt each, and its own result is its own report."""
    host_dir = tmp_path / "pwned"
    host_dir.mkdir()
    host_dir.chmod(0o777)
    tag = f"tqho{uuid.uuid4().hex[:8]}"
    spec = {"tag": tag, "host_dir": str(host_dir)}
    arena.neighbour(1)
    talk = arena.attack("ho.talk", spec)
    siblings = [arena.sibling(2)]
    talk_fd3 = arena.attack("ho.talk", {**spec, "result_fd": True}, charged=False, own_error_text=True)
    siblings.append(arena.sibling(3))
    look = arena.attack("ho.look", {"ipc_key": 0}, charged=False)
    siblings.append(arena.sibling(4))
    arena.neighbour(5)
    arena.run("--concurrency", "2", "--batch-size", "6", timeout=150)

    secret_values = [v for tenant in arena.secrets.values() for v in tenant.values()]
    status, attempts, report, error = arena.outcome(talk)
    arena.expect(status == "done" and attempts == 1,
                 f"rule H2: ho.talk did not end with its own report at one attempt: {status}, attempts "
                 f"{attempts}, {error[:600]}")
    if status == "done":
        own = isinstance(report, dict) and report.get("tqho") == "talk" and report.get("job_id") == talk
        arena.expect(own,
                     f"rule H2: ho.talk's result is not its own report: {str(report)[:300]}")
    if status == "done" and isinstance(report, dict) and report.get("tqho") == "talk":
        print(f"ho.talk on {arena.driver}: pid 1 {report['before']['pid1_cmdline'][:120]!r}; own fds "
              f"{report['own']}; /proc: {json.dumps(report['proc'])[:1500]}; sockets {report['sockets']}")
        arena.expect(not report["evidence"], f"rule C1: something executed the forged agent frames: "
                                             f"{report['evidence']}")
        arena.expect(report["injected_env"] is None,
                     "rule C1: a forged env frame reached the job's environment")
        for when in ("before", "after"):
            arena.problems += runner_problems(arena.driver, report[when], f"ho.talk ({when} its frames)")
        for path, outcome in report["proc"].items():
            pid = path.split("/")[2]
            if pid in ("1", str(report["before"]["ppid"])) and outcome.startswith("USABLE"):
                arena.problems.append(f"rule C1: the job reopened {path} of "
                                      f"{'the runner' if pid == '1' else 'the batch supervisor'}: {outcome}")
        for path, outcome in report["sockets"].items():
            got = [part for part in outcome.split("; ") if "CONNECTED" in part and "got 0 bytes" not in part]
            arena.expect(not got, f"rule C1: a socket in the sandbox ({path}) answered agent frames: {got}")
        arena.problems += fixed_env_problems("pid 1's /proc environ (seen by ho.talk)",
                                             report["pid1_environ"], secret_values)
    on_host = sorted(p.name for p in host_dir.iterdir())
    arena.expect(not on_host, f"rule C1: the forged agent frames were executed on the host: {on_host} in "
                              f"{host_dir}")

    status, attempts, _, error = arena.outcome(talk_fd3)
    arena.expect(attempts == 1 and status in ("done", "dead"),
                 f"rule H2: ho.talk writing its result pipe too: {status} after {attempts} attempts "
                 f"{error[:300]}")

    status, _, seen, error = arena.outcome(look)
    arena.expect(status == "done", f"ho.look after ho.talk did not report: {status} {error[:600]}")
    if status == "done":
        text = json.dumps(seen)
        arena.expect(tag not in text and "TQHO_INJECTED" not in text and FORGED not in text,
                     f"rule C1: a later job of the batch sees what the forged frames asked for: "
                     f"{[k for k in ('TQHO_INJECTED', FORGED, tag) if k in text]}")
        arena.problems += env_problems("ho.look after ho.talk", MALLORY, seen, arena.secrets)
        arena.problems += runner_problems(arena.driver, seen["facts"], "ho.look after ho.talk")
        for pid in ("1", str(seen["facts"]["ppid"])):
            arena.problems += fixed_env_problems(f"/proc/{pid}/environ", seen["environs"].get(pid),
                                                 secret_values)
    for job_id in siblings:
        info = arena.job(job_id)
        arena.expect(FORGED not in json.dumps(info.result) + (info.last_error or ""),
                     f"rule H2: sibling {job_id} has a forged result: {str(info.result)[:200]}")
    arena.verdict()


# -- 2 and 3: a pooled or kept-warm sandbox carries nothing to the next tenant ---------


MODES = {
    # a pooled sandbox, once a tenant's batch took it, is destroyed after it
    "ready-pool": ("--ready-pool", "1"),
    # ... or kept warm for that tenant only
    "ready-pool+keep-warm": ("--ready-pool", "1", "--keep-warm", "30"),
}
# the ids of the process driver's sandboxes, as a job sees them in its mountinfo
# (the work dir's tmpfs is named after its sandbox)
SANDBOX_ID = re.compile(r"tenantq-(tq-[0-9a-f]+)")


class Stages:
    """The jobs this test enqueues itself, one tenant's batch per stage,
    each stage waiting for every earlier batch's sandbox to be given back
    (test_leftovers.wait_kept_warm) and then for its own jobs to settle.
    acme's jobs here are not the arena's adv.echo neighbours, so the arena
    would not wait for them."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.ids: dict[str, int] = {}
        self.tenant_of: dict[str, str] = {}
        self.order: list[str] = []

    def settle(self, ids: list[int], what: str) -> None:
        try:
            wait_until(lambda: all(s in TERMINAL for s in self.arena.statuses(ids).values()),
                       timeout=STAGE_SECONDS, interval=0.05, message=what)
        except TimeoutError as exc:
            self.arena.problems.append(str(exc))

    def batch(self, tenant: str, *jobs: tuple[str, str, dict[str, Any]],
              neighbour: int | None = None) -> Callable[[Arena], None]:
        """A stage: `jobs` in one insert (one batch), with the honest
        neighbour's adv.echo (n=`neighbour`, checked by the arena) first in
        it when given: then its sandbox is known too."""
        def stage(arena: Arena) -> None:
            wait_kept_warm()
            specs = [JobSpec(tenant=tenant, kind=kind, payload=payload, max_attempts=1)
                     for _, kind, payload in jobs]
            if neighbour is not None:
                specs.insert(0, JobSpec(tenant=ACME, kind="adv.echo", payload={"n": neighbour},
                                        max_attempts=1))
            ids = arena.queue.enqueue_many(specs)
            if neighbour is not None:
                arena.neighbours.append(harness.Neighbour(ids[0], neighbour, ACME, True))
            for (name, kind, payload), job_id in zip(jobs, ids[len(ids) - len(jobs):], strict=True):
                self.ids[name] = job_id
                self.tenant_of[name] = tenant
                self.order.append(name)
                if tenant == MALLORY:
                    arena.hostile.append(harness.Hostile(job_id, kind, payload, 1, False))
            if arena.watch is not None:
                arena.watch.watch(ids)
            self.settle(ids, f"{tenant}'s batch {[j[0] for j in jobs]}")
        return stage

    def report(self, name: str) -> dict[str, Any] | None:
        status, attempts, result, error = self.arena.outcome(self.ids[name])
        if status != "done" or not isinstance(result, dict):
            self.arena.problems.append(f"{name} ({self.tenant_of[name]}) did not report: {status}, "
                                       f"attempts {attempts}, {error[:600]}")
            return None
        return result


def sandbox_of(facts: dict[str, Any]) -> str | None:
    """The process driver's sandbox id, as the job's mountinfo names it (None
    under gVisor, whose guest sees no host name of its sandbox)."""
    found = SANDBOX_ID.search(" ".join(facts["work_mount"]))
    return found.group(1) if found else None


def pid1_age(facts: dict[str, Any]) -> float | None:
    try:
        return float(facts["uptime"].split()[0]) - int(facts["pid1_starttime"]) / 100
    except (ValueError, IndexError):
        return None


@pytest.mark.parametrize("mode", list(MODES))
def test_a_pooled_or_kept_warm_sandbox_shows_the_next_tenant_nothing(arena: Arena, mode: str) -> None:
    """docs/sandbox.md, "Warm starts" 1 and 3 (a sandbox is never shared
    between tenants; a pooled sandbox has no tenant and no secrets, is bound
    to a tenant only when its batch takes it, and never goes back to the
    pool: kept warm for the same tenant at most); rules P1 and C2 (kept-warm
    sandboxes start every batch, and every job, with no process, file or IPC
    object of an earlier one); promise 2 (a job never reaches another
    tenant's secrets); promise 1 (a job can write only its own quota'd
    scratch space); rule C1 (the runner's and the supervisor's environ hold
    no secret). Once the pool is up, mallory's batch leaves files holding
    its secrets everywhere it can write (scratch, the work dir, under the
    code mounts in /tmp, any other writable directory, where /dev is one it
    also points /dev/stdout and /dev/stderr at files of its own), daemons,
    IPC objects and environment, and looks in the next job; acme's batch
    looks for any of it, then leaves the same with acme's secret; mallory's
    next batch (its kept-warm sandbox, with --keep-warm) looks for acme's
    secret and anything of its own earlier batch; acme's next batch looks
    again. No look may see another tenant's secret, or anything an earlier
    job left, and (process driver, which shows a job its sandbox's id) no
    sandbox may run both tenants' jobs."""
    data_dir = Path(arena.env["TENANTQ_DATA_DIR"])
    base = random.randrange(0x10000, 0x7FFF0000)
    tags = {MALLORY: f"tqho-m{uuid.uuid4().hex[:8]}", ACME: f"tqho-a{uuid.uuid4().hex[:8]}"}
    leave = {t: ("ho.leave", {"tag": tags[t], "ipc_key": base if t == MALLORY else base + 8}) for t in tags}
    look = ("ho.look", {"ipc_key": base})
    look_acme_ipc = ("ho.look", {"ipc_key": base + 8})
    stages = Stages(arena)
    pooled: set[str] = set()

    def pool_up(a: Arena) -> None:
        """The pool boots ahead of the next demand once the worker has seen
        one (acme's first batch, the neighbour's job in it): a sandbox of
        this test's data dir exists that no batch holds (a precondition,
        reported, not a promise)."""
        stages.batch(ACME, ("a_first", *look), neighbour=1)(a)
        wait_kept_warm()
        kept = 1 if "keep-warm" in mode else 0
        try:
            wait_until(lambda: len(sandbox_dirs(data_dir)) > kept, timeout=30, interval=0.05,
                       message="the ready pool's sandbox")
        except TimeoutError as exc:
            print(f"note: {exc}")
        pooled.update(p.name for p in sandbox_dirs(data_dir))

    plan = [
        pool_up,
        stages.batch(MALLORY, ("m_leave", *leave[MALLORY]), ("m_same", *look)),
        stages.batch(ACME, ("a_look", *look), ("a_leave", *leave[ACME]), ("a_same", *look_acme_ipc)),
        stages.batch(MALLORY, ("m_look", *look_acme_ipc)),
        stages.batch(ACME, ("a_look2", *look)),
    ]
    arena.run("--concurrency", "3", "--batch-size", "4", "--metrics-port", str(METRICS_PORT), *MODES[mode],
              once=False, stages=plan, timeout=200)

    reports = {name: stages.report(name) for name in stages.order}
    for name in ("m_leave", "a_leave"):
        left = reports.get(name)
        if left is None:
            continue
        print(f"{name}: writable outside scratch {left['writable_statvfs']}; /dev symlinks swapped "
              f"{left['dev_swaps']}; alive at end {len(left['alive_at_end'])}; made "
              f"{sum(v == 'ok' for v in left['made'].values())} files")
        arena.expect(len(left["alive_at_end"]) >= 3,
                     f"precondition: {name}'s daemons were not running when it ended: {left['alive_at_end']}")
        arena.expect(sorted(left["own_env_keys"]) == sorted(arena.secrets[stages.tenant_of[name]]),
                     f"precondition: {name} did not get its own tenant's secrets: {left['own_env_keys']}")
        outside = {d: v for d, v in left["writable_statvfs"].items()
                   if not any(d == s or d.startswith(s + "/") for s in SCRATCH_DIRS)}
        arena.expect(not outside, f"promise 1: {name} can write outside its quota'd scratch space (the work "
                                  f"dir, /tmp, /dev/shm, /dev/mqueue): {outside}")
    secret_values = [v for tenant in arena.secrets.values() for v in tenant.values()]
    for position, name in enumerate(stages.order):
        seen = reports.get(name)
        if seen is None or seen.get("tqho") != "look":
            continue
        tenant = stages.tenant_of[name]
        other = MALLORY if tenant == ACME else ACME
        who = f"{name} ({tenant}, {mode})"
        text = json.dumps(seen)
        for value in arena.secrets[other].values():
            arena.expect(value not in text, f"promise 2: {who} read {other}'s secret: {where(seen, value)}")
        arena.problems += env_problems(who, tenant, seen, arena.secrets)
        for earlier in stages.order[:position]:
            if earlier.endswith("_leave"):
                tag = tags[stages.tenant_of[earlier]]
                rule = "promise 2 / rule P1" if stages.tenant_of[earlier] != tenant else "rule P1/C2"
                arena.expect(tag not in text, f"{rule}: {who} sees what {earlier} left: {where(seen, tag)}")
        arena.expect("TQHO_LEFT" not in text,
                     f"rule C2: {who} sees an earlier job's environment: {where(seen, 'TQHO_LEFT')}")
        dirty = {d: sorted(files)[:12] for d, files in seen["scratch"].items() if files}
        arena.expect(not dirty, f"rule P1: {who} finds files in its scratch space: {dirty}")
        arena.expect(not seen["others"], f"rule C2: {who} sees processes: {seen['others']}")
        found = {k: v for k, v in seen["ipc"].items() if v.startswith("FOUND")}
        arena.expect(not found, f"rule P1: {who} finds IPC objects: {found}")
        arena.problems += runner_problems(arena.driver, seen["facts"], who)
        for pid in ("1", str(seen["facts"]["ppid"])):
            arena.problems += fixed_env_problems(f"/proc/{pid}/environ (seen by {who})",
                                                 seen["environs"].get(pid), secret_values)

    # which sandbox each job ran in, as far as its guest can tell
    where_ran: dict[str, str | None] = {}
    if reports.get("a_first") is not None:
        pooled.discard(sandbox_of(reports["a_first"]["facts"]) or "")
    for name in stages.order:
        result = reports.get(name)
        if result is None:
            continue
        facts = result["facts"] if result.get("tqho") == "look" else result.get("facts", {})
        where_ran[name] = sandbox_of(facts)
        age = pid1_age(facts)
        print(f"{name} ({stages.tenant_of[name]}): sandbox {where_ran[name]} "
              f"{'(from the pool)' if where_ran[name] in pooled else ''} pid {facts['pid']} "
              f"ppid {facts['ppid']} "
              f"pid-1 age {age if age is None else round(age, 2)} s ns {facts['ns'].get('pid')}")
    if arena.driver == "process":
        by_tenant = {t: {s for n, s in where_ran.items() if stages.tenant_of[n] == t and s} for t in tags}
        shared = by_tenant[MALLORY] & by_tenant[ACME]
        arena.expect(not shared, f"docs/sandbox.md: a sandbox ran both tenants' jobs ({mode}): {shared}")
        arena.expect(where_ran.get("m_leave") == where_ran.get("m_same"),
                     "precondition: m_leave and m_same (one batch) ran in different sandboxes")
        if not any(s in pooled for s in where_ran.values()):
            print(f"note: no batch of this test ran in a sandbox that was in the data dir before them "
                  f"(pool: {sorted(pooled)})")
    if "keep-warm" in mode and reports.get("m_leave") and reports.get("m_look"):
        before, after = reports["m_leave"]["facts"], reports["m_look"]["facts"]
        # gVisor shows a job no name of its sandbox: pids go on in a sandbox's
        # pid namespace (tests/adversarial/test_leftovers.py, check_reused)
        reused = (where_ran.get("m_leave") == where_ran.get("m_look") if arena.driver == "process"
                  else after["ppid"] > before["pid"])
        arena.expect(reused,
                     "precondition: mallory's next batch ran in a fresh sandbox, not its kept-warm one")
    arena.verdict()


def where(seen: Any, needle: str, limit: int = 8) -> list[str]:
    """Where in a report `needle` is: the paths of the keys and values that
    hold it, with the value."""
    hits: list[str] = []
    stack: list[tuple[str, Any]] = [("", seen)]
    while stack and len(hits) < limit:
        path, value = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                if needle in str(k):
                    hits.append(f"{path}.{k}: {json.dumps(v)[:300]}")
                elif needle in json.dumps(v):
                    stack.append((f"{path}.{k}", v))
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(value) if needle in json.dumps(v)]
        else:
            hits.append(f"{path}: {json.dumps(value)[:300]}")
    return hits
