"""From a job's result or failure to its settlement: done, retry or dead.

Pure logic (unit-tested without a database): exponential backoff with full
jitter, capped, and the dead-letter rule.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from tenantq.store.model import ClaimedJob, Settlement

MAX_RESULT_BYTES = 1024 * 1024
MAX_ERROR_CHARS = 4000


@dataclass(frozen=True)
class Backoff:
    """delay = uniform(0, min(cap, base * 2 ** (attempt - 1))) ("full jitter")."""

    base_seconds: float = 2.0
    cap_seconds: float = 600.0

    def ceiling(self, attempt: int) -> float:
        exponent = min(max(attempt - 1, 0), 62)
        return float(min(self.cap_seconds, self.base_seconds * (2**exponent)))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        return (rng or random).uniform(0.0, self.ceiling(attempt))


def succeeded(job: ClaimedJob, result: Any, *, backoff: Backoff) -> Settlement:
    """Done, unless the result cannot be stored: then it is a failed attempt."""
    try:
        text = json.dumps(result, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return failed(job, f"result is not JSON-serialisable: {exc}", backoff=backoff)
    if "\\u0000" in text.replace("\\\\", ""):
        return failed(job, "result contains a NUL character, which Postgres jsonb cannot store",
                      backoff=backoff)
    size = len(text.encode())
    if size > MAX_RESULT_BYTES:
        return failed(job, f"result is {size} bytes of JSON; the limit is {MAX_RESULT_BYTES}",
                      backoff=backoff)
    return Settlement(job_id=job.id, status="done", result=result, result_json=text)


def failed(
    job: ClaimedJob, error: str, *, backoff: Backoff, retryable: bool = True,
    rng: random.Random | None = None,
) -> Settlement:
    """A failed attempt: retry after a backoff, or dead when attempts are used up."""
    error = error.replace("\x00", "\\0")  # Postgres text cannot hold NUL
    error = error if len(error) <= MAX_ERROR_CHARS else error[: MAX_ERROR_CHARS - 15] + "... (truncated)"
    if not retryable or job.attempt >= job.max_attempts:
        return Settlement(job_id=job.id, status="dead", error=error)
    return Settlement(job_id=job.id, status="pending", error=error, delay=backoff.delay(job.attempt, rng))


def unstorable(job: ClaimedJob, settlement: Settlement, problem: str, backoff: Backoff) -> Settlement:
    """Postgres refused a settlement's data: a done job becomes a failed
    attempt naming the problem; an error text is stripped to plain text."""
    if settlement.status == "done":
        return failed(job, f"result could not be stored: {problem.strip().splitlines()[0]}", backoff=backoff)
    clean = (settlement.error or "").encode("ascii", "replace").decode()
    return Settlement(job_id=settlement.job_id, status=settlement.status, error=clean, delay=settlement.delay)
