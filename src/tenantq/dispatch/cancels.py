"""Cancelling running jobs, on the worker's side.

`Queue.cancel(id)` on a running job sets `cancel_requested_at` and
notifies the workers' channel with 'cancel:<batch>:<job>' (jobs.sql
`cancel`). The worker holding that batch records the request here (from
the notification at once, or from its maintenance tick's
`cancel_requests` read if it missed it) and tells its executor, if the
executor can stop a job (`cancel(job_id)`: the inline executor sets the
handler's `ctx.cancelled`; the sandbox executor has its guest kill the job
process, or skips the job if it has not started). Whatever the executor
then reports for that job, the batch settles it `cancelled` (settle.py):
which job was cancelled is the host's bookkeeping, never the guest's word
(docs/security.md, rule H2).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

log = logging.getLogger("tenantq.cancel")


class CancelBook:
    """The cancel requests for jobs of this worker's live batches."""

    def __init__(self, live_batches: Callable[[], Iterable[int]],
                 stop_job: Callable[[int], None] | None) -> None:
        self._lock = threading.Lock()
        self._requested: set[int] = set()
        self._live_batches = live_batches
        self._stop_job = stop_job

    def request(self, batch_id: int, job_id: int) -> bool:
        """A cancel request for a job of `batch_id`: recorded (and the
        executor told) if that batch is this worker's; True if it was new."""
        if batch_id not in set(self._live_batches()):
            return False
        with self._lock:
            new = job_id not in self._requested
            self._requested.add(job_id)
        if new:
            log.info("batch %d: stopping job %d (cancel requested)", batch_id, job_id)
        # told again on a repeat (the maintenance tick re-reads requests
        # while the job runs): stopping a job twice is harmless
        if self._stop_job is not None:
            try:
                self._stop_job(job_id)
            except Exception:  # the job still ends cancelled when it ends
                log.exception("batch %d: the executor could not stop job %d", batch_id, job_id)
        return new

    def requested(self, job_id: int) -> bool:
        # asked for every job that ends: one membership test, which is
        # atomic against the locked add/difference_update (one C call each)
        return job_id in self._requested

    def forget(self, job_ids: Iterable[int]) -> None:
        with self._lock:
            self._requested.difference_update(job_ids)


def parse_notification(payload: str) -> tuple[int, int] | None:
    """'cancel:<batch>:<job>' -> (batch, job); anything else None."""
    parts = payload.split(":")
    if len(parts) == 3 and parts[0] == "cancel" and parts[1].isdigit() and parts[2].isdigit():
        return int(parts[1]), int(parts[2])
    return None


def cancelled_error(ok: bool, error: object) -> str:
    """A cancelled job's last_error: how its run ended, said once (the
    executor's own "cancelled ..." is not prefixed again)."""
    note = ended_note(ok, error)
    return note if note.startswith("cancelled") else f"cancelled while running: {note}"


def ended_note(ok: bool, error: object) -> str:
    """How a cancelled job's run ended, for its attempt's record."""
    if ok:
        return "it had finished (its result is dropped)"
    first = str(error or "stopped").strip().splitlines()
    return first[0][:200] if first else "stopped"
