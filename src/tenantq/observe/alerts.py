"""Dead-letter alerts: `--on-dead CMD` and `--on-dead-url URL`.

Each job that reaches `dead` (settled by this worker, or dead-lettered by
its reaper) fires once: CMD runs with the job as JSON on stdin (with a
timeout), URL gets the JSON POSTed (retried with backoff). Alerts go through
a queue and a thread of their own, so a slow hook never holds up a batch;
a failing hook is logged, never fatal. Delivery is at most once: an alert
queued when the worker is killed is lost (the job itself is safe in the
dead-letter list).
"""

from __future__ import annotations

import json
import logging
import queue
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

log = logging.getLogger("tenantq.alerts")

CMD_TIMEOUT_SECONDS = 10.0
URL_TIMEOUT_SECONDS = 10.0
URL_ATTEMPTS = 4


@dataclass(frozen=True)
class DeadJob:
    job_id: int
    tenant: str
    kind: str
    attempts: int
    last_error: str

    def payload(self) -> dict[str, Any]:
        return {"event": "job.dead", **asdict(self)}


class DeadLetterAlerts(threading.Thread):
    def __init__(self, *, command: str | None = None, url: str | None = None) -> None:
        super().__init__(name="tenantq-alerts", daemon=True)
        self.command = command
        self.url = url
        self._queue: queue.Queue[DeadJob | None] = queue.Queue()
        self.sent = 0
        self.failed = 0

    @property
    def enabled(self) -> bool:
        return bool(self.command or self.url)

    def fire(self, job: DeadJob) -> None:
        if self.enabled:
            self._queue.put(job)

    def close(self, timeout: float = 30.0) -> None:
        """Deliver what is queued (up to `timeout`), then stop."""
        self._queue.put(None)
        if self.is_alive():
            self.join(timeout)

    def run(self) -> None:
        while (job := self._queue.get()) is not None:
            body = json.dumps(job.payload())
            if self.command:
                self._run_command(job, body)
            if self.url:
                self._post(job, body)

    def _run_command(self, job: DeadJob, body: str) -> None:
        try:
            done = subprocess.run(self.command or "", shell=True, input=body.encode(), capture_output=True,
                                  timeout=CMD_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self.failed += 1
            log.warning("--on-dead command timed out after %gs for job %d", CMD_TIMEOUT_SECONDS, job.job_id)
            return
        if done.returncode != 0:
            self.failed += 1
            log.warning("--on-dead command exited %d for job %d: %s", done.returncode, job.job_id,
                        done.stderr.decode(errors="replace").strip()[-300:])
        else:
            self.sent += 1

    def _post(self, job: DeadJob, body: str) -> None:
        delay = 0.5
        for attempt in range(1, URL_ATTEMPTS + 1):
            try:
                response = httpx.post(self.url or "", content=body, timeout=URL_TIMEOUT_SECONDS,
                                      headers={"content-type": "application/json"})
                if response.status_code < 300:
                    self.sent += 1
                    return
                problem = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if attempt < URL_ATTEMPTS:
                time.sleep(delay)
                delay *= 2
        self.failed += 1
        log.warning("--on-dead-url gave up on job %d after %d attempts: %s", job.job_id, URL_ATTEMPTS,
                    problem)
