from __future__ import annotations

import threading

import pytest

from tenantq.dispatch.maintenance import LeaseBook
from tenantq.dispatch.wakeup import Wakeup
from tenantq.store.queries import composed, migration_files, parse_blocks, qualified, sql


def test_parse_blocks() -> None:
    text = "-- header\n-- name: one\nSELECT 1;\n\n-- name: two\n-- why\nSELECT 2\n"
    assert parse_blocks(text) == {"one": "SELECT 1", "two": "-- why\nSELECT 2"}
    with pytest.raises(ValueError, match="duplicate"):
        parse_blocks("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;")


def test_every_sql_file_loads() -> None:
    assert "FOR UPDATE" in composed("jobs", "claim", lease="lease")
    with pytest.raises(KeyError, match="placeholders"):
        sql("jobs", "claim")
    with pytest.raises(KeyError, match="no SQL block"):
        sql("jobs", "nope")
    versions = [v for v, _, _ in migration_files()]
    assert versions == list(range(1, len(versions) + 1))


def test_wakeup_is_not_lost_between_check_and_wait() -> None:
    w = Wakeup()
    seen = w.generation
    w.fire()  # fires before the waiter waits: the wait must return at once
    done = threading.Event()

    def waiter() -> None:
        w.wait(seen, timeout=30)
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    assert done.wait(5)
    t.join()


def test_lease_book_lost_leases() -> None:
    book = LeaseBook()
    book.add(1)
    book.add(2)
    book.mark_lost({2, 3})
    assert book.live() == [1]
    assert book.is_lost(2) and not book.is_lost(3)
    book.remove(2)
    assert not book.is_lost(2)


def test_the_test_command_runs_every_test_dir() -> None:
    """`./run test` runs the suite as two lists of dirs side by side: a new
    dir in neither would never run."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = (root / "run").read_text()
    listed = [d for name in ("light", "heavy")
              for d in re.search(rf"^\s*{name}=\(([^)]*)\)", script, re.M).group(1).split()]  # type: ignore[union-attr]
    dirs = sorted(f"tests/{p.name}" for p in (root / "tests").iterdir()
                  if p.is_dir() and any(p.glob("test_*.py")))
    assert sorted(listed) == dirs, (listed, dirs)


def test_hot_statements_are_sent_without_comment_lines_and_short_enough_for_psycopgs_cache() -> None:
    """psycopg caches the conversion of a statement's %(name)s placeholders
    only up to MAX_CACHED_STATEMENT_LENGTH bytes: the statements run per job
    or per batch are sent without their whole-line comments, and fit."""
    from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH

    hot = [qualified("jobs", "insert", "tenantq"), composed("jobs", "claim", lease="lease"),
           sql("jobs", "settle"), composed("queues", "candidates", rate_columns="rate_columns")]
    for statement in hot:
        assert not [line for line in statement.splitlines() if line.lstrip().startswith("--")]
        assert len(statement.encode()) <= MAX_CACHED_STATEMENT_LENGTH, statement[:80]
