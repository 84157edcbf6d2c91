"""`tenantq dashboard` as a process: it says where it listens, serves the
overview and /metrics, and stops on SIGTERM."""

from __future__ import annotations

import re
import signal

import httpx

from tenantq import Queue
from tenantq.testing import wait_until
from tests.acceptance.helpers import Cli, wait_exit


def test_dashboard_serves_overview_and_metrics(cli: Cli, queue: Queue) -> None:
    queue.enqueue("acme", "demo.noop", {})
    proc, stderr = cli.start("dashboard", "--port", "0")
    url = wait_until(lambda: (m := re.search(r"http://127\.0\.0\.1:\d+/", stderr.read_text())) and m.group(0),
                     timeout=30, message="the dashboard's URL line")
    page = httpx.get(url, timeout=10)
    assert page.status_code == 200
    assert "acme" in page.text
    metrics = httpx.get(url + "metrics", timeout=10)
    assert metrics.status_code == 200
    assert 'tenantq_pending_jobs{priority="default",tenant="acme"} 1.0' in metrics.text
    proc.send_signal(signal.SIGTERM)
    assert wait_exit(proc) == 0
