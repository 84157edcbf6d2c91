"""Metrics, dead-letter alerts and log formats, against real Postgres."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from prometheus_client import generate_latest

import tenantq
import tests.apps.basic  # noqa: F401  (registers the test handlers)
from tenantq import JobSpec, Queue
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.outcome import Backoff
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.observe import metrics, queue_metrics
from tenantq.observe.alerts import DeadLetterAlerts
from tenantq.store.db import Database
from tenantq.testing import wait_until


def _drain(db: Database, alerts: DeadLetterAlerts | None = None) -> None:
    config = WorkerConfig(concurrency=1, batch_size=10, once=True, backoff=Backoff(0, 0))
    Worker(db, InlineExecutor(tenantq.REGISTRY), config, alerts=alerts).run()


def _sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_queue_gauges_bound_tenant_labels(db: Database, queue: Queue) -> None:
    queue.enqueue_many([JobSpec(f"t{i}", "demo.noop", {}) for i in range(4) for _ in range(10 * (i + 1))])
    text = generate_latest(queue_metrics.registry_for(db, top_tenants=2)).decode()
    # the two biggest tenants have their own series, the rest are summed
    assert _sample(text, "tenantq_pending_jobs", tenant="t3", priority="default") == 40
    assert _sample(text, "tenantq_pending_jobs", tenant="t2", priority="default") == 30
    assert _sample(text, "tenantq_pending_jobs", tenant="other", priority="default") == 30
    assert _sample(text, "tenantq_pending_jobs", tenant="t0", priority="default") is None
    assert (_sample(text, "tenantq_oldest_pending_seconds", tenant="t3", priority="default") or -1) >= 0


def test_worker_instruments_count_outcomes(db: Database, queue: Queue) -> None:
    before = generate_latest(metrics.REGISTRY).decode()
    dead_before = _sample(before, "tenantq_dead_letter_total", priority="bulk") or 0
    queue.enqueue_many([JobSpec("m", "demo.noop", {}, priority="bulk") for _ in range(5)])
    queue.enqueue("m", "demo.fail", {}, priority="bulk", max_attempts=2)
    _drain(db)
    after = generate_latest(metrics.REGISTRY).decode()
    assert _sample(after, "tenantq_dead_letter_total", priority="bulk") == dead_before + 1
    assert "tenantq_job_wait_seconds_bucket" in after
    assert (_sample(after, "tenantq_job_outcomes_total", priority="bulk", outcome="retry") or 0) >= 1
    assert (_sample(after, "tenantq_batch_outcomes_total", driver="inline", reason="ok") or 0) >= 1


def test_on_dead_command_fires_once_per_dead_job(db: Database, queue: Queue, tmp_path: Path) -> None:
    out = tmp_path / "dead.jsonl"
    ids = [queue.enqueue("acme", "demo.fail", {"n": i}, max_attempts=2) for i in range(3)]
    queue.enqueue("acme", "demo.noop", {})
    alerts = DeadLetterAlerts(command=f"cat >> {out}; echo >> {out}")
    _drain(db, alerts)
    events = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert sorted(e["job_id"] for e in events) == ids
    assert all(e["event"] == "job.dead" and e["tenant"] == "acme" and e["kind"] == "demo.fail"
               and e["attempts"] == 2 and "boom on attempt 2" in e["last_error"] for e in events)
    assert alerts.sent == 3


def test_a_failing_hook_is_logged_not_fatal(db: Database, queue: Queue) -> None:
    queue.enqueue("acme", "demo.fail", {}, max_attempts=1)
    alerts = DeadLetterAlerts(command="exit 3")
    _drain(db, alerts)
    assert alerts.failed == 1
    assert queue.status()[0]["dead"] == 1


class _Collector(BaseHTTPRequestHandler):
    received: list[dict[str, object]] = []
    fail_first = 0

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        if type(self).fail_first > 0:
            type(self).fail_first -= 1
            self.send_response(503)
        else:
            type(self).received.append(json.loads(body))
            self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[tuple[str, type[_Collector]]]:
    handler = type("Collector", (_Collector,), {"received": [], "fail_first": 1})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", handler
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def test_on_dead_url_posts_with_retries(db: Database, queue: Queue,
                                        webhook: tuple[str, type[_Collector]]) -> None:
    url, handler = webhook
    job_id = queue.enqueue("beta", "demo.fail", {}, max_attempts=1)
    alerts = DeadLetterAlerts(url=url)
    _drain(db, alerts)
    wait_until(lambda: handler.received, timeout=10, message="the webhook")
    assert [e["job_id"] for e in handler.received] == [job_id]  # the first POST got 503, the retry landed
    assert handler.received[0]["tenant"] == "beta"


def test_worker_logs_json_lines_when_not_on_a_terminal(db: Database, queue: Queue,
                                                       cli_env: dict[str, str]) -> None:
    queue.enqueue("acme", "demo.noop", {})
    done = subprocess.run([sys.executable, "-m", "tenantq.cli", "worker", "--app", "tests.apps.basic",
                           "--sandbox", "inline", "--once"], env=cli_env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{\"ts\"")]
    assert any(entry["logger"] == "tenantq.worker" and "started" in entry["msg"] for entry in lines)
    assert all({"ts", "level", "logger", "msg"} <= entry.keys() for entry in lines)
