"""A job's attempt history (the `attempts` table): read for `tenantq job`
and the job page, and summed up in one line."""

from __future__ import annotations

from typing import Any

from tenantq.domain.records import JobInfo
from tenantq.store.queries import sql
from tenantq.store.steps import Query, Steps

# attempts shown per job (a job may have thousands after many replays)
HISTORY_LIMIT = 100
NOTE_ERROR_CHARS = 300


def history_steps(tenant_id: str, job_id: int, *,
                  limit: int = HISTORY_LIMIT) -> Steps[list[dict[str, Any]]]:
    """The newest `limit` attempts that ended, oldest first."""
    rows: list[dict[str, Any]] = yield Query(sql("jobs", "attempts_of"),
                                             {"tenant_id": tenant_id, "id": job_id, "limit": limit})
    rows.reverse()
    return rows


def _first_line(text: object) -> str:
    lines = str(text or "").strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= NOTE_ERROR_CHARS else line[: NOTE_ERROR_CHARS - 1] + "…"


def outcome_note(job: JobInfo) -> str | None:
    """How the job ended, in one line, from its history: "succeeded on
    attempt 2 after: <the error of the last failed attempt before it>",
    "dead after 3 attempts: <error>", "cancelled"; None while it has not
    ended (a pending job's story is its why-waiting list)."""
    history = job.attempts_history
    counted = [a for a in history if a["outcome"] != "released"]
    replay = f" (replay {job.replays})" if job.replays else ""
    if job.status == "done":
        failures = [a for a in counted[:-1] if a["outcome"] in ("failed", "lost")]
        if not failures:
            return f"succeeded on attempt {job.attempts}{replay}"
        return f"succeeded on attempt {job.attempts}{replay} after: {_first_line(failures[-1]['error'])}"
    if job.status == "dead":
        return f"dead after {job.attempts} attempt(s){replay}: {_first_line(job.last_error)}"
    if job.status == "cancelled":
        return "cancelled before it ran" if not counted else "cancelled"
    return None
