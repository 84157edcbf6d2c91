"""Prometheus metrics.

Two kinds:
- in-process instruments a worker updates as it runs (wait and run time
  histograms, sandbox create / destroy time by driver, batch outcomes by
  reason, job outcomes, dead-letter total), labelled by priority class,
  driver, reason and outcome only: bounded sets;
- queue gauges read from Postgres at scrape time (pending, oldest pending
  age, running batches, dead jobs per tenant and class). Tenant labels are
  bounded: the top N tenants by pending jobs (TENANTQ_METRICS_TOP_TENANTS,
  default 20) get their own series, the rest are summed into tenant="other".
"""

from __future__ import annotations

import bisect
import collections
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.registry import Collector

from tenantq.domain.records import ClaimedJob

REGISTRY = CollectorRegistry(auto_describe=True)
TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)

# a pick's cursor lock: sub-millisecond when uncontended
LOCK_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
PICK_LOCK_WAIT = Histogram("tenantq_pick_lock_wait_seconds",
                           "Time a pick waited for its class's scheduler cursor lock "
                           "(one round trip included).",
                           ["priority"], buckets=LOCK_BUCKETS, registry=REGISTRY)
PICK_LOCK_HELD = Histogram("tenantq_pick_lock_held_seconds",
                           "Time a pick held its class's scheduler cursor lock, to its commit.",
                           ["priority"], buckets=LOCK_BUCKETS, registry=REGISTRY)
JOB_WAIT = Histogram("tenantq_job_wait_seconds", "Time a job was runnable before it started.",
                     ["priority"], buckets=TIME_BUCKETS, registry=REGISTRY)
JOB_RUN = Histogram("tenantq_job_run_seconds", "Time a job's handler ran.", ["priority"],
                    buckets=TIME_BUCKETS, registry=REGISTRY)
SANDBOX_CREATE = Histogram("tenantq_sandbox_create_seconds", "Time to create a sandbox.", ["driver"],
                           buckets=TIME_BUCKETS, registry=REGISTRY)
SANDBOX_DESTROY = Histogram("tenantq_sandbox_destroy_seconds", "Time to destroy a sandbox.", ["driver"],
                            buckets=TIME_BUCKETS, registry=REGISTRY)
SANDBOX_STARTS = Counter("tenantq_sandbox_starts_total",
                         "Sandboxes handed to a batch, by where they came from "
                         "(cold boot, template restore, hibernated restore, kept warm).",
                         ["driver", "origin"], registry=REGISTRY)
SANDBOX_HIBERNATED = Counter("tenantq_sandbox_hibernated_total", "Idle sandboxes checkpointed to disk.",
                             ["driver"], registry=REGISTRY)
EGRESS_REQUESTS = Counter("tenantq_egress_requests_total",
                          "Requests through the egress proxy by tenant, allowed or blocked.",
                          ["tenant", "outcome"], registry=REGISTRY)
EGRESS_BYTES = Counter("tenantq_egress_bytes_total",
                       "Bytes through the egress proxy by tenant (out: sandbox to destination).",
                       ["tenant", "direction"], registry=REGISTRY)
BATCH_OUTCOMES = Counter("tenantq_batch_outcomes_total", "Batches by how their sandbox ended.",
                         ["driver", "reason"], registry=REGISTRY)
JOB_OUTCOMES = Counter("tenantq_job_outcomes_total", "Settled attempts by outcome (done, retry, dead).",
                       ["priority", "outcome"], registry=REGISTRY)
PRUNED = Counter("tenantq_pruned_jobs_total", "Finished jobs deleted by retention, by status.", ["status"],
                 registry=REGISTRY)
HOST_FUNCTION_CALLS = Counter("tenantq_host_function_calls_total",
                              "ctx.call of host functions by function and outcome (ok, error, refused).",
                              ["function", "outcome"], registry=REGISTRY)
HOST_FUNCTION_SECONDS = Histogram("tenantq_host_function_seconds", "Time a host function ran.", ["function"],
                                  buckets=TIME_BUCKETS, registry=REGISTRY)
DEAD_LETTERED = Counter("tenantq_dead_letter_total", "Jobs that reached dead.", ["priority"],
                        registry=REGISTRY)

BATCH_REASONS = ("ok", "oom", "timeout", "crashed", "killed", "failed")
# A bucket shows the exemplar of its latest observation that had one: one per
# bucket and second is plenty, and building and validating one per job was
# about a third of an inline no-op job's host time (docs/benchmarks.md).
EXEMPLAR_EVERY_SECONDS = 1.0


class SampledExemplars:
    """Observations of one histogram series; an exemplar (built only when
    kept) goes with at most one observation per bucket per
    EXEMPLAR_EVERY_SECONDS. Races between threads cost at most an extra one."""

    def __init__(self, series: Any, bounds: tuple[float, ...] = TIME_BUCKETS) -> None:
        self.series, self.bounds = series, bounds
        self._last = [float("-inf")] * (len(bounds) + 1)

    def observe(self, amount: float, exemplar: Callable[[], dict[str, str]]) -> None:
        bucket = bisect.bisect_left(self.bounds, amount)
        now = time.monotonic()
        if now - self._last[bucket] >= EXEMPLAR_EVERY_SECONDS:
            self._last[bucket] = now
            self.series.observe(amount, exemplar())
        else:
            self.series.observe(amount)

    def observe_many(self, amounts: Sequence[float], exemplar: Callable[[int], dict[str, str]]) -> None:
        """`observe` of each of `amounts` (a batch's waits or run times), with
        one update of the sum and one of each bucket they fall in: one
        `Histogram.observe` per job (two locked increments and a walk of the
        bounds) was a tenth of a no-op drain's Python time. `exemplar(i)`
        builds the exemplar of `amounts[i]`."""
        buckets = [bisect.bisect_left(self.bounds, amount) for amount in amounts]
        now = time.monotonic()
        left = dict(collections.Counter(buckets))
        total = 0.0
        for bucket in left:
            if now - self._last[bucket] >= EXEMPLAR_EVERY_SECONDS:
                self._last[bucket] = now
                i = buckets.index(bucket)
                self.series.observe(amounts[i], exemplar(i))
                left[bucket] -= 1
                total -= amounts[i]
        total += math.fsum(amounts)
        counters = getattr(self.series, "_buckets", None)
        if getattr(self.series, "_upper_bounds", None) != [*self.bounds, math.inf] or counters is None:
            # not the prometheus_client layout this was written against
            # (tests/unit/test_sampled_exemplars.py): one observe each
            for i, amount in enumerate(amounts):
                if left.get(buckets[i], 0) > 0:
                    left[buckets[i]] -= 1
                    self.series.observe(amount)
            return
        self.series._sum.inc(total)
        for bucket, n in left.items():
            if n:
                counters[bucket].inc(n)


_sampled: dict[tuple[int, str], SampledExemplars] = {}


def sampled(histogram: Histogram, label: str) -> SampledExemplars:
    """The process's one SampledExemplars of `histogram`'s series `label`."""
    key = (id(histogram), label)
    found = _sampled.get(key)
    if found is None:
        found = _sampled.setdefault(key, SampledExemplars(histogram.labels(label)))
    return found
# OpenMetrics: an exemplar's label names and values total at most 128 characters
EXEMPLAR_CHARS = 128


def job_exemplars(jobs: Sequence[ClaimedJob]) -> Callable[[int], dict[str, str]]:
    """`observe_many`'s exemplar maker for observations of `jobs`, in order."""
    return lambda i: exemplar(jobs[i].id, jobs[i].tenant_id, jobs[i].actor, jobs[i].meta)


def exemplar(job_id: int, tenant: str, actor: str | None,
             meta: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The exemplar of a job's wait and run observations (shown with the
    OpenMetrics exposition): which job, tenant and actor, and the request
    it came from (meta's `request_id`, when a string), cut to fit."""
    labels = {"job_id": str(job_id), "tenant": tenant}
    if actor:
        labels["actor"] = actor
    request_id = (meta or {}).get("request_id")
    if isinstance(request_id, str) and request_id:
        labels["request_id"] = request_id
    used = 0
    fitted: dict[str, str] = {}
    for name, value in labels.items():
        room = EXEMPLAR_CHARS - used - len(name)
        if room <= 0:
            break
        fitted[name] = value[:room]
        used += len(name) + len(fitted[name])
    return fitted


def batch_reason(end_kind: str) -> str:
    """Map a sandbox End kind onto the bounded reason label."""
    return {"ok": "ok", "oom": "oom", "timeout": "timeout", "signal": "killed", "exit": "crashed",
            "crashed": "crashed"}.get(end_kind, "failed")


class Forward(Collector):
    """Expose another registry's metrics through this one."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        yield from self.source.collect()
