"""The DRR arithmetic, simulated without a database: the same plan()/charge()
the picker uses, driven over many picks."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from tenantq.fairness import drr
from tenantq.fairness.drr import Candidate, Mode
from tenantq.fairness.slots import is_lent, reserved_slots


class Sim:
    """An in-memory stand-in for the queues table and the scheduler row."""

    def __init__(self, weights: dict[str, int], backlog: dict[str, int], *, batch_size: int = 10,
                 mode: Mode = Mode.JOBS, quantum: float | None = None,
                 caps: dict[str, int] | None = None) -> None:
        self.weights = weights
        self.backlog = dict(backlog)
        self.deficit = dict.fromkeys(weights, 0.0)
        self.cursor = ""
        self.turn_open = False
        self.batch_size = batch_size
        self.mode = mode
        self.quantum = quantum if quantum is not None else float(batch_size)
        self.caps = caps or {}
        self.live: Counter[str] = Counter()
        self.avg: dict[str, float] = {}
        self.charged = 0.0

    def finish(self, tenant: str, jobs: int, seconds: float) -> None:
        """A runtime-charged batch ended: what settle does in SQL."""
        self.deficit[tenant] -= drr.correction(actual_seconds=seconds, charged_seconds=self.charged)
        prev = self.avg.get(tenant)
        self.avg[tenant] = seconds / jobs if prev is None else 0.8 * prev + 0.2 * seconds / jobs

    def rotation(self) -> list[str]:
        active = sorted(t for t, n in self.backlog.items() if n > 0)
        ordered = [t for t in active if t >= self.cursor] + [t for t in active if t < self.cursor]
        if ordered and not self.turn_open and ordered[0] == self.cursor:
            ordered.append(ordered.pop(0))
        return ordered

    def pick(self) -> tuple[str, int] | None:
        cands = [Candidate(t, self.weights[t], self.deficit[t],
                           at_cap=t in self.caps and self.live[t] >= self.caps[t])
                 for t in self.rotation()]
        visits = drr.plan(cands, cursor=self.cursor, turn_open=self.turn_open, mode=self.mode,
                          quantum=self.quantum, batch_size=self.batch_size)
        for visit in visits:
            if not visit.eligible:
                self.deficit[visit.tenant_id] = visit.deficit  # walked past, still in debt
                continue
            n = min(visit.max_jobs, self.backlog[visit.tenant_id])
            self.backlog[visit.tenant_id] -= n
            est = self.avg.get(visit.tenant_id, self.quantum / self.batch_size)
            self.charged = est * n
            left, keep = drr.charge(visit, claimed=n, mode=self.mode, est_job_cost=est)
            self.deficit[visit.tenant_id] = left
            if self.backlog[visit.tenant_id] == 0:
                self.deficit[visit.tenant_id] = 0.0  # empty queue: credit resets
            self.cursor, self.turn_open = visit.tenant_id, keep
            return visit.tenant_id, n
        return None


def test_weights_1_2_3_give_shares_1_2_3() -> None:
    sim = Sim({"a": 1, "b": 2, "c": 3}, {"a": 10**6, "b": 10**6, "c": 10**6}, batch_size=7)
    served: Counter[str] = Counter()
    for _ in range(6000):
        pick = sim.pick()
        assert pick is not None
        served[pick[0]] += pick[1]
    total = sum(served.values())
    for tenant, weight in {"a": 1, "b": 2, "c": 3}.items():
        assert served[tenant] / total == pytest.approx(weight / 6, rel=0.02)


def test_small_tenants_are_served_within_the_first_round() -> None:
    backlog = {"whale": 200_000, **{f"s{i}": 20 for i in range(5)}}
    sim = Sim(dict.fromkeys(backlog, 1), backlog, batch_size=10)
    order = [sim.pick() for _ in range(12)]
    first_round = [p[0] for p in order[:6] if p]
    assert sorted(first_round) == sorted(backlog)  # every tenant once in the first 6 picks
    # the small tenants' 20 jobs (2 batches each) are done after two rounds
    assert all(sim.backlog[f"s{i}"] == 0 for i in range(5))


def test_a_weight_3_tenant_takes_three_batches_in_a_row() -> None:
    sim = Sim({"a": 1, "b": 3}, {"a": 1000, "b": 1000}, batch_size=10)
    picks = [sim.pick() for _ in range(8)]
    assert [p[0] for p in picks if p] == ["a", "b", "b", "b", "a", "b", "b", "b"]


def test_batch_is_capped_by_credit_and_leftover_carries() -> None:
    # quantum 4 per turn, batch size 10: batches of 4
    sim = Sim({"a": 1, "b": 1}, {"a": 100, "b": 100}, batch_size=10, quantum=4)
    assert sim.pick() == ("a", 4)
    assert sim.pick() == ("b", 4)


def test_empty_queue_resets_credit() -> None:
    sim = Sim({"a": 5, "b": 1}, {"a": 3, "b": 100}, batch_size=10)
    assert sim.pick() == ("a", 3)  # credit 50, took 3, queue now empty
    assert sim.deficit["a"] == 0.0
    sim.backlog["a"] = 100  # new work arrives: a starts from zero, not 47
    cands = [Candidate("a", 5, sim.deficit["a"])]
    visits = drr.plan(cands, cursor="b", turn_open=False, mode=Mode.JOBS, quantum=10, batch_size=10)
    assert visits[0].deficit == 50


def test_capped_tenant_is_skipped_not_blocking() -> None:
    sim = Sim({"a": 1, "b": 1, "c": 1}, {"a": 100, "b": 100, "c": 100}, caps={"a": 1})
    sim.live["a"] = 1
    picks = [sim.pick() for _ in range(6)]
    assert "a" not in {p[0] for p in picks if p}
    assert sim.deficit["a"] == 0.0  # no credit accrues while capped
    sim.live["a"] = 0
    assert any(p and p[0] == "a" for p in (sim.pick() for _ in range(3)))


def test_everyone_capped_gives_no_pick() -> None:
    visits = drr.plan([Candidate("a", 1, 0.0, at_cap=True)], cursor="", turn_open=False, mode=Mode.JOBS,
                      quantum=10, batch_size=10)
    assert visits == []


def test_runtime_mode_equalises_time_not_jobs() -> None:
    """Tenant 'slow' runs 3 s jobs, 'fast' 0.1 s jobs: by run time each gets
    about half of the seconds, so 'fast' runs ~30x more jobs."""
    batch = 2
    sim = Sim({"slow": 1, "fast": 1}, {"slow": 10**6, "fast": 10**6}, batch_size=batch,
              mode=Mode.RUNTIME, quantum=1.0)
    cost = {"slow": 3.0, "fast": 0.1}
    seconds: Counter[str] = Counter()
    for _ in range(20_000):
        pick = sim.pick()
        assert pick is not None
        tenant, n = pick
        seconds[tenant] += cost[tenant] * n
        sim.finish(tenant, n, cost[tenant] * n)  # the batch ends before the next pick
    share = seconds["slow"] / (seconds["slow"] + seconds["fast"])
    assert share == pytest.approx(0.5, abs=0.03)
    # by job count instead, 'slow' would get 3.0 / 3.1 of the time
    jobs_sim = Sim({"slow": 1, "fast": 1}, {"slow": 10**6, "fast": 10**6}, batch_size=batch)
    by_jobs: Counter[str] = Counter()
    for _ in range(2000):
        pick = jobs_sim.pick()
        assert pick is not None
        by_jobs[pick[0]] += int(cost[pick[0]] * pick[1] * 10)
    assert by_jobs["slow"] / (by_jobs["slow"] + by_jobs["fast"]) > 0.9


def test_runtime_debt_skips_rounds_but_never_stalls() -> None:
    visits = drr.plan([Candidate("a", 1, -10.0), Candidate("b", 2, -10.0)], cursor="", turn_open=False,
                      mode=Mode.RUNTIME, quantum=1.0, batch_size=5)
    # nobody is eligible on one pass: fast-forward 6 rounds, which b (weight 2)
    # needs to get out of debt (-10 + 12 > 0); a would need 11
    assert [(v.tenant_id, v.eligible) for v in visits] == [("a", False), ("b", True)]
    assert visits[0].deficit == pytest.approx(-4.0)
    assert visits[1].deficit == pytest.approx(2.0)


def test_reserved_slots() -> None:
    assert reserved_slots(8) == 3  # ceil(0.3 * 8)
    assert reserved_slots(1) == 1
    assert reserved_slots(10, 0.5) == 5
    assert reserved_slots(4, 0) == 0
    with pytest.raises(ValueError, match="between 0 and 1"):
        reserved_slots(4, 1.5)
    assert is_lent(0, "bulk", reserved=3)
    assert not is_lent(0, "interactive", reserved=3)
    assert not is_lent(3, "bulk", reserved=3)  # a shared slot is never recalled


# -- hostile numbers: whatever is stored or reported, plan/charge never raise --

NAN, INF = float("nan"), float("inf")
HOSTILE = [NAN, INF, -INF, 1e308, -1e308, 5e-324]


def _finite_visits(visits: list[drr.Visit]) -> bool:
    return all(math.isfinite(v.deficit) and abs(v.deficit) <= drr.MAX_CREDIT and v.max_jobs >= 1
               for v in visits)


@pytest.mark.parametrize("mode", [Mode.JOBS, Mode.RUNTIME])
@pytest.mark.parametrize("deficit", HOSTILE)
def test_plan_reads_a_hostile_deficit_as_a_safe_one(mode: Mode, deficit: float) -> None:
    for turn_open in (False, True):
        visits = drr.plan([Candidate("a", 1, deficit), Candidate("b", 3, 0.0)], cursor="a",
                          turn_open=turn_open, mode=mode, quantum=1.0, batch_size=10)
        assert [v.tenant_id for v in visits] == ["a", "b"]
        assert _finite_visits(visits), visits
    # NaN and infinities count as no credit at all: 'a' starts its turn from 0
    if not math.isfinite(deficit):
        (visit,) = drr.plan([Candidate("a", 2, deficit)], cursor="", turn_open=False, mode=mode,
                            quantum=5.0, batch_size=10)
        assert visit.deficit == 10.0 and visit.eligible


@pytest.mark.parametrize("quantum", [NAN, INF, -1.0, 0.0, 1e-300])
def test_plan_survives_a_hostile_quantum_and_a_deep_debt(quantum: float) -> None:
    visits = drr.plan([Candidate("a", 1, -1e308), Candidate("b", 10_000, -1e12)], cursor="",
                      turn_open=False, mode=Mode.RUNTIME, quantum=quantum, batch_size=5)
    assert _finite_visits(visits), visits


def test_a_debt_at_the_bound_still_recovers_in_one_fast_forward() -> None:
    # float rounding at 1e12 must not leave the queue just short of eligible
    (visit,) = drr.plan([Candidate("a", 1, -drr.MAX_CREDIT)], cursor="", turn_open=False, mode=Mode.RUNTIME,
                        quantum=1.0, batch_size=5)
    assert visit.eligible and visit.deficit >= 1e-9


@pytest.mark.parametrize("mode", [Mode.JOBS, Mode.RUNTIME])
@pytest.mark.parametrize("value", [*HOSTILE, -5.0])
def test_charge_never_raises_and_stays_finite(mode: Mode, value: float) -> None:
    visit = drr.Visit("a", value, eligible=True, max_jobs=10)
    left, _ = drr.charge(visit, claimed=10, mode=mode, est_job_cost=1.0)
    assert math.isfinite(left) and abs(left) <= drr.MAX_CREDIT
    honest = drr.Visit("a", 5.0, eligible=True, max_jobs=10)
    left, keep = drr.charge(honest, claimed=2, mode=Mode.RUNTIME, est_job_cost=value)
    # an estimate that is not a finite, non-negative number is charged as 0
    expected = 5.0 - 2 * min(value, drr.MAX_JOB_SECONDS) if math.isfinite(value) and value >= 0 else 5.0
    assert left == pytest.approx(expected) and math.isfinite(left)
    assert keep is (left > 0)


@pytest.mark.parametrize("value", [NAN, INF, -INF, -5.0, None, "junk"])
def test_correction_counts_a_hostile_run_time_as_zero(value: object) -> None:
    assert drr.correction(actual_seconds=value, charged_seconds=2.0) == -2.0  # type: ignore[arg-type]
    assert drr.correction(actual_seconds=3.0, charged_seconds=value) == 3.0  # type: ignore[arg-type]


def test_safe_values() -> None:
    assert [drr.safe_deficit(v) for v in (NAN, INF, -INF, None, "x", -3.5, 1e308, -1e308)] == [
        0.0, 0.0, 0.0, 0.0, 0.0, -3.5, drr.MAX_CREDIT, -drr.MAX_CREDIT]
    assert [drr.safe_seconds(v) for v in (NAN, INF, -INF, -5.0, None, 2.5)] == [0.0, 0.0, 0.0, 0.0, 0.0, 2.5]
    assert drr.estimate(None, default=0.1) == 0.1
    assert drr.estimate(NAN, default=0.1) == 0.1
    assert drr.estimate(INF, default=0.1) == 0.1
    assert drr.estimate(-1.0, default=0.1) == 0.1
    assert drr.estimate(0.0, default=0.1) == 0.0
    assert drr.estimate(1e308, default=0.1) == drr.MAX_JOB_SECONDS
    assert drr.estimate(NAN, default=NAN) == 0.0  # even a hostile default is made safe
    assert drr.estimate("4.5", default=0.1) == 4.5  # Postgres numerics may arrive as text


def test_a_poisoned_queue_recovers_and_shares_stay_fair() -> None:
    """What NaN did before: every later pick died in math.floor(nan). Now the
    poisoned deficit reads as 0 and the schedule carries on fairly."""
    sim = Sim({"a": 1, "b": 1}, {"a": 10**6, "b": 10**6}, batch_size=10)
    sim.deficit["a"] = NAN
    served: Counter[str] = Counter()
    for _ in range(200):
        pick = sim.pick()
        assert pick is not None
        served[pick[0]] += pick[1]
    assert served["a"] == served["b"]
    runtime = Sim({"a": 1, "b": 1}, {"a": 10**6, "b": 10**6}, batch_size=2, mode=Mode.RUNTIME, quantum=1.0)
    for _ in range(200):
        pick = runtime.pick()
        assert pick is not None
        tenant, n = pick
        runtime.finish(tenant, n, NAN if tenant == "a" else 0.5 * n)  # 'a' always reports NaN
        runtime.deficit[tenant] = drr.safe_deficit(runtime.deficit[tenant])  # what the store keeps
        runtime.avg[tenant] = drr.estimate(runtime.avg[tenant], default=0.5)
    assert all(math.isfinite(d) for d in runtime.deficit.values())
