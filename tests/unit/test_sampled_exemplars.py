"""Exemplars are sampled: at most one per histogram bucket per
EXEMPLAR_EVERY_SECONDS, built only when kept (observe/metrics.py)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from tenantq.observe import metrics


def test_one_exemplar_per_bucket_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    histogram = Histogram("t_seconds", "test", ["priority"], buckets=metrics.TIME_BUCKETS,
                          registry=CollectorRegistry())
    series = metrics.SampledExemplars(histogram.labels("default"))
    built: list[float] = []

    def make(amount: float) -> dict[str, str]:
        built.append(amount)
        return {"job_id": str(len(built))}

    for amount in (0.001, 0.002, 0.003, 7.0, 7.5):  # two buckets: <= 5 ms, and 5-10 s
        series.observe(amount, lambda amount=amount: make(amount))  # type: ignore[misc]
    assert built == [0.001, 7.0], "the first of each bucket only"
    clock[0] += metrics.EXEMPLAR_EVERY_SECONDS
    series.observe(0.004, lambda: make(0.004))
    assert built == [0.001, 7.0, 0.004], "a second later the bucket takes a new one"
    count = [s for m in histogram.collect() for s in m.samples if s.name == "t_seconds_count"]
    assert count[0].value == 6, "every observation is counted, exemplar or not"


def _samples(histogram: Histogram) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("le", "")): s.value for m in histogram.collect() for s in m.samples
            if not s.name.endswith("_created")}


def test_observe_many_counts_what_one_observe_each_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    amounts = [0.001, 0.004, 0.005, 0.0051, 0.3, 0.3, 7.0, 7.5, 4000.0, 0.0]
    one_each = Histogram("a_seconds", "test", ["priority"], buckets=metrics.TIME_BUCKETS,
                         registry=CollectorRegistry())
    together = Histogram("a_seconds", "test", ["priority"], buckets=metrics.TIME_BUCKETS,
                         registry=CollectorRegistry())
    single = metrics.SampledExemplars(one_each.labels("default"))
    for amount in amounts:
        single.observe(amount, lambda: {"job_id": "x"})
    built: list[int] = []

    def make(i: int) -> dict[str, str]:
        built.append(i)
        return {"job_id": str(i)}

    metrics.SampledExemplars(together.labels("default")).observe_many(amounts, make)
    got, want = _samples(together), _samples(one_each)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key
    # the first observation of each bucket gets the exemplar: <=5 ms (0, 1, 4, 5 ms),
    # <=10 ms, <=0.5 s, <=10 s, +Inf
    assert sorted(built) == [0, 3, 4, 6, 8]
    exemplars = {s.labels["le"]: s.exemplar for m in together.collect() for s in m.samples
                 if s.name == "a_seconds_bucket" and s.exemplar is not None}
    assert {e.labels["job_id"] for e in exemplars.values()} == {"0", "3", "4", "6", "8"}

    clock[0] += metrics.EXEMPLAR_EVERY_SECONDS / 2
    built.clear()
    series = metrics.SampledExemplars(together.labels("bulk"))
    series.observe_many([0.001], make)
    series.observe_many([0.002, 0.003], make)
    assert built == [0], "within the interval a bucket keeps the exemplar it has"
    clock[0] += metrics.EXEMPLAR_EVERY_SECONDS
    series.observe_many([0.002, 0.003], make)
    assert built == [0, 0], "a second later it takes the first of the next batch"
