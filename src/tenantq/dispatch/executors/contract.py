"""The contract between the dispatcher and whatever runs a batch.

An executor runs the jobs of one batch in order and reports each job's start
and end through a callback as they happen, so the dispatcher can settle
finished jobs even if the batch dies later. It stops starting new jobs as
soon as `should_stop()` is true; jobs it never started are the
dispatcher's to release. If it raises before any job started (a failing
warmup, a sandbox that cannot start), the dispatcher fails the batch's first
job with that error (attempt counted) and releases the rest.

Optional: `kinds() -> Iterable[str]`, the kinds it can run. The worker
claims only those (an executor without `kinds()` but with a `registry`
offers the registry's kinds; one with neither claims every kind).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from tenantq.domain.records import Batch


@dataclass(frozen=True)
class JobStarted:
    job_id: int


@dataclass(frozen=True)
class JobEnded:
    job_id: int
    ok: bool
    result: Any = None
    error: str | None = None
    retryable: bool = True
    # measured run time, when the executor knows it better than the
    # dispatcher's clock between start and end events (a sandbox's guest)
    seconds: float | None = None
    # its host-function calls, counted by the host's gate (host_functions.py)
    host_calls: dict[str, Any] | None = None


@dataclass(frozen=True)
class EgressUsed:
    """What the batch's sandbox did through its egress proxy (sent once, at the
    end of a batch that had one): counts for the batch record, and the
    refused requests with the job that was running."""

    record: dict[str, int]
    blocks: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class HostCallsUsed:
    """What the batch's host-function calls cost (sent once, at the end of a
    batch that made any): counts for the batch record."""

    record: dict[str, Any]


Event = JobStarted | JobEnded | EgressUsed | HostCallsUsed
Report = Callable[[Event], None]


class BatchExecutor(Protocol):
    name: str

    def run(
        self,
        batch: Batch,
        *,
        env: Mapping[str, str],
        report: Report,
        should_stop: Callable[[], bool],
    ) -> None: ...
