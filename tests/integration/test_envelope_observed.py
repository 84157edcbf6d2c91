"""The job's envelope where operators look (issue "producer", item 4): the
metrics' exemplars name the job, its tenant, its actor and the request it
came from (meta's `request_id`), and a dead job's log record carries the
actor and meta as fields."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.openmetrics.exposition import generate_latest

import tenantq
from tenantq import JobSpec, Queue
from tenantq.observe import metrics
from tenantq.registry import Registry
from tenantq.store.db import Database
from tenantq.testing import drain


def _registry() -> Registry:
    reg = Registry()
    tenantq.handler("env.ok", registry=reg)(lambda payload, ctx: 1)

    @tenantq.handler("env.fail", registry=reg)
    def fail(payload: object, ctx: tenantq.JobContext) -> None:
        raise RuntimeError("no")

    return reg


def test_exemplars_and_the_dead_jobs_log_carry_the_envelope(db: Database,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    with Queue(db.dsn, schema=db.schema) as q:
        ok, dead = q.enqueue_many([
            JobSpec("acme", "env.ok", actor="usr_99182", meta={"request_id": "req-7f3a", "plan": "pro"}),
            JobSpec("acme", "env.fail", actor="usr_5", meta={"request_id": "req-dead"}, max_attempts=1)])
        with caplog.at_level(logging.WARNING, logger="tenantq.worker"):
            drain(db, _registry())
        assert q.job(ok).status == "done" and q.job(dead).status == "dead"
    exposition = generate_latest(metrics.REGISTRY).decode()
    runs = [line for line in exposition.splitlines()
            if line.startswith("tenantq_job_run_seconds_bucket") and "# {" in line]
    # a bucket keeps the exemplar of its latest observation: one of the two
    envelopes = [(ok, "usr_99182", "req-7f3a"), (dead, "usr_5", "req-dead")]
    assert any(f'job_id="{job}"' in line and f'actor="{actor}"' in line and f'request_id="{request}"' in line
               for line in runs for job, actor, request in envelopes), runs
    (record,) = [r for r in caplog.records if "is dead after" in r.getMessage()]
    assert (record.job_id, record.actor, record.meta) == (dead, "usr_5", {"request_id": "req-dead"})  # type: ignore[attr-defined]
