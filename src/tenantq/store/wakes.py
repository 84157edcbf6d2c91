"""Folding wakes into queue rows (queues.sql, "The has_work protocol").

A statement that makes jobs pending writes a `wakes` row and touches no
shared row, so an open producer transaction holds nothing anyone waits
for; a worker folds the wakes into `queues` before it looks for work.
"""

from __future__ import annotations

from datetime import datetime

from tenantq.store.db import Conn
from tenantq.store.queries import composed
from tenantq.store.steps import Query, Steps, run

# Wakes one fold takes at most: a burst of single enqueues (one wake each)
# is folded in a few statements, and no fold holds its rows for long.
FOLD_LIMIT = 5_000


def fold_steps(*, now: datetime | None = None) -> Steps[int]:
    """Fold the wakes no other fold holds; how many it took. On tenantq's
    own connection (its search_path names the schema)."""
    rows = yield Query(composed("queues", "fold", fold_ctes="fold_ctes"), {"limit": FOLD_LIMIT, "now": now})
    return int(str(rows[0]["folded"]))


def fold(conn: Conn, *, now: datetime | None = None) -> int:
    return run(conn, fold_steps(now=now))


def classes_with_work(conn: Conn, *, kinds: list[str] | None, now: datetime | None = None) -> set[str]:
    """Fold, then the classes with a queue with work due now for `kinds`
    (None: any): one statement."""
    rows = conn.execute(composed("queues", "classes_with_work", fold_ctes="fold_ctes"),
                        {"limit": FOLD_LIMIT, "now": now, "kinds": kinds}).fetchall()
    return {str(r["priority"]) for r in rows}
