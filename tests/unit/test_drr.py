"""The DRR arithmetic, simulated without a database: the same plan()/charge()
the picker uses, driven over many picks."""

from __future__ import annotations

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
