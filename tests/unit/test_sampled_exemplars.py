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
