"""From a job's result or failure to its settlement: done, retry or dead.

Pure logic (unit-tested without a database): exponential backoff with full
jitter, capped, and the dead-letter rule.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any

import psycopg

from tenantq.domain.records import ClaimedJob, Settlement

MAX_RESULT_BYTES = 1024 * 1024
MAX_ERROR_CHARS = 4000
# a retry is never scheduled further out than this (make_interval's range is
# far larger; a backoff configured with an infinite cap must not reach it)
MAX_DELAY_SECONDS = 10 * 365 * 86400.0


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
    except RecursionError:
        return failed(job, "result is not JSON-serialisable: nested too deeply", backoff=backoff)
    except (TypeError, ValueError, OverflowError) as exc:
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
    error = str(error).replace("\x00", "\\0")  # Postgres text cannot hold NUL
    error = error if len(error) <= MAX_ERROR_CHARS else error[: MAX_ERROR_CHARS - 15] + "... (truncated)"
    if not retryable or job.attempt >= job.max_attempts:
        return Settlement(job_id=job.id, status="dead", error=error)
    delay = backoff.delay(job.attempt, rng)
    delay = min(delay, MAX_DELAY_SECONDS) if math.isfinite(delay) and delay > 0 else 0.0
    return Settlement(job_id=job.id, status="pending", error=error, delay=delay)


def first_line(problem: object) -> str:
    """The first line of an error (a Postgres message's first line names
    the problem; the rest is detail and context), as plain ASCII."""
    lines = str(problem).strip().splitlines()
    text = lines[0] if lines else type(problem).__name__
    return text.encode("ascii", "replace").decode()[:500]


def unstorable(job: ClaimedJob, settlement: Settlement, problem: object, backoff: Backoff) -> Settlement:
    """Postgres refused a settlement on its own (see dispatch/settle.py): a
    done job becomes a failed attempt naming the problem; a failure keeps
    its status and says why its error text was replaced by plain text."""
    reason = first_line(problem)
    if settlement.status == "done":
        return failed(job, f"result could not be stored: {reason}", backoff=backoff)
    clean = (settlement.error or "").encode("ascii", "replace").decode()
    return Settlement(job_id=settlement.job_id, status=settlement.status,
                      error=f"error text could not be stored: {reason}; as ASCII: {clean}",
                      delay=settlement.delay)


def last_resort(job: ClaimedJob, settlement: Settlement, problem: object, backoff: Backoff) -> Settlement:
    """The last resort when even `unstorable` was refused: a failed attempt
    (dead if it was going to be dead) with a fixed, plain reason; nothing
    the job produced is kept."""
    error = f"could not be stored: {first_line(problem)}"
    if settlement.status == "dead":
        return Settlement(job_id=settlement.job_id, status="dead", error=error)
    return failed(job, error, backoff=backoff)


# SQLSTATE classes worth retrying: 08 connection exception, 40 transaction
# rollback (serialization failure, deadlock), 53 insufficient resources (too
# many connections, disk full), 57 operator intervention (admin or crash
# shutdown, cannot connect now, query cancelled), 58 system error (I/O).
# Not 54 (program limit exceeded, e.g. a jsonb nested too deeply), which
# psycopg also files under OperationalError: that is the data's fault.
_TRANSIENT_CLASSES = frozenset({"08", "40", "53", "57", "58"})


def is_transient(exc: BaseException) -> bool:
    """Would the same statement succeed later? Only for connection-level
    errors; a statement Postgres refused would be refused again."""
    if isinstance(exc, psycopg.errors.PipelineAborted):
        return False  # a previous statement of the pipeline failed: that error decides
    if isinstance(exc, psycopg.InterfaceError):
        return True
    if isinstance(exc, psycopg.OperationalError):
        state = exc.sqlstate
        # no SQLSTATE: raised by the client (connection lost, pool timeout)
        return state is None or state[:2] in _TRANSIENT_CLASSES or state == "55P03"
    return False
