from __future__ import annotations

import random

from tenantq.dispatch.outcome import MAX_ERROR_CHARS, Backoff, failed, succeeded
from tenantq.domain.records import ClaimedJob


def _job(attempt: int, max_attempts: int = 3) -> ClaimedJob:
    return ClaimedJob(id=7, tenant_id="t", kind="k", payload=None, attempt=attempt,
                      max_attempts=max_attempts)


def test_backoff_ceiling_doubles_and_caps() -> None:
    b = Backoff(base_seconds=2, cap_seconds=60)
    assert [b.ceiling(n) for n in range(1, 8)] == [2, 4, 8, 16, 32, 60, 60]
    assert b.ceiling(10_000) == 60  # no overflow on huge attempt counts


def test_full_jitter_spans_zero_to_ceiling() -> None:
    b = Backoff(base_seconds=1, cap_seconds=100)
    rng = random.Random(42)
    delays = [b.delay(4, rng) for _ in range(5000)]
    assert min(delays) >= 0 and max(delays) <= 8
    # full jitter: uniform over [0, 8], so the mean is near 4 and both halves are used
    assert 3.7 < sum(delays) / len(delays) < 4.3
    assert min(delays) < 0.1 and max(delays) > 7.9


def test_failure_retries_until_attempts_are_used() -> None:
    b = Backoff(base_seconds=1, cap_seconds=10)
    first = failed(_job(1), "boom", backoff=b, rng=random.Random(1))
    assert first.status == "pending" and first.error == "boom" and 0 <= first.delay <= 1
    last = failed(_job(3), "boom", backoff=b)
    assert last.status == "dead" and last.error == "boom"
    assert failed(_job(1), "fatal", backoff=b, retryable=False).status == "dead"


def test_long_errors_are_truncated() -> None:
    s = failed(_job(1), "x" * 10_000, backoff=Backoff())
    assert s.error is not None and len(s.error) == MAX_ERROR_CHARS
    assert s.error.endswith("(truncated)")


def test_results_must_be_storable() -> None:
    assert succeeded(_job(1), {"ok": True}, backoff=Backoff()).status == "done"
    bad = succeeded(_job(1), object(), backoff=Backoff())
    assert bad.status == "pending" and "not JSON-serialisable" in (bad.error or "")
    huge = succeeded(_job(3), "x" * (1024 * 1024 + 1), backoff=Backoff())
    assert huge.status == "dead" and "limit" in (huge.error or "")
