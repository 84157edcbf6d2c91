"""`tenantq jobs` (finding jobs) and the bulk actions on such a filtered
set, `tenantq cancel FILTERS` and `tenantq dead retry FILTERS`, with their
deprecated spellings `tenantq jobs cancel` and `tenantq jobs retry-dead`,
run as real subprocesses."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest

import tenantq
import tests.apps.basic  # noqa: F401  (registers the demo.* handlers)
from tenantq import JobSpec, Queue
from tenantq.store.db import Database
from tenantq.testing import drain
from tests.acceptance.helpers import Cli, one_error_line, query, status_counts


@pytest.fixture
def jobs(queue: Queue, db: Database) -> dict[str, list[int]]:
    """acme: 4 pending reports for user-7 (meta plan=pro), 1 older mail job;
    globex: 2 dead jobs and 1 done."""
    (now,) = (r["now"] for r in query(db, "SELECT now() AS now"))
    assert isinstance(now, datetime)
    mail = [queue.enqueue("acme", "mail.send", {}, delay=3600, actor="user-8", now=now - timedelta(days=2))]
    reports = queue.enqueue_many([JobSpec("acme", "reports.render", {"n": n}, delay=3600, actor="user-7",
                                          meta={"plan": "pro", "request_id": f"r-{n}"}) for n in range(4)])
    dead = [queue.enqueue("globex", "demo.fail", {}, max_attempts=1) for _ in range(2)]
    done = [queue.enqueue("globex", "demo.hello", {})]
    drain(db, tenantq.REGISTRY)
    return {"mail": mail, "reports": reports, "dead": dead, "done": done}


def test_jobs_lists_newest_first_as_a_table_and_as_json(cli: Cli, jobs: dict[str, list[int]]) -> None:
    table = cli.ok("jobs", "--tenant", "acme")
    for column in ("id", "tenant", "kind", "status", "attempts", "actor", "created", "last error"):
        assert column in table, table
    lines = [line for line in table.splitlines() if "reports.render" in line or "mail.send" in line]
    shown = [int(line.split("│")[1]) for line in lines]
    assert shown == sorted([*jobs["reports"], *jobs["mail"]], reverse=True)
    assert "user-7" in table and "pending" in table

    listed = cli.json("jobs", "--status", "dead")
    assert [j["id"] for j in listed] == sorted(jobs["dead"], reverse=True)
    assert set(listed[0]) == {"id", "tenant_id", "kind", "priority", "status", "attempts", "max_attempts",
                              "actor", "meta", "created_at", "error_line"}
    assert listed[0]["error_line"] == "RuntimeError: boom on attempt 1"
    assert listed[0]["attempts"] == 1 and listed[0]["tenant_id"] == "globex"
    datetime.fromisoformat(listed[0]["created_at"])

    found = cli.json("jobs", "--tenant", "acme", "--actor", "user-7", "--meta", "plan=pro",
                     "--meta", "request_id=r-2", "--kind", "reports.render", "--since", "1h")
    assert [(j["id"], j["meta"]) for j in found] == [(jobs["reports"][2],
                                                      {"plan": "pro", "request_id": "r-2"})]
    assert [j["id"] for j in cli.json("jobs", "--tenant", "acme", "--since", "1d")] == \
        sorted(jobs["reports"], reverse=True)


def test_jobs_pages_with_the_cursor_it_prints(cli: Cli, jobs: dict[str, list[int]]) -> None:
    expected = sorted([*jobs["reports"], *jobs["mail"]], reverse=True)
    seen: list[int] = []
    args = ["jobs", "--tenant", "acme", "--limit", "2", "--json"]
    for _ in range(5):
        res = cli.run(*args)
        assert res.returncode == 0, res.stderr
        seen += [j["id"] for j in json.loads(res.stdout)]
        if not res.stderr:
            break
        hint = one_line(res.stderr)
        assert hint.startswith("older jobs: add --before "), hint
        args = ["jobs", "--tenant", "acme", "--limit", "2", "--json", "--before", hint.split()[-1]]
    assert seen == expected


def one_line(text: str) -> str:
    lines = text.splitlines()
    assert len(lines) == 1, text
    return lines[0]


# each is a subprocess (~0.7 s): a sample of every kind of mistake; the
# validation of each filter is tested in-process (tests/integration/test_finding.py)
BAD: dict[str, list[str]] = {
    "status": ["jobs", "--status", "zombie"],
    "since": ["jobs", "--since", "yesterday"],
    "limit-big": ["jobs", "--limit", "1001"],
    "limit-text": ["jobs", "--limit", "ten"],
    "meta": ["jobs", "--meta", "plan"],
    "before": ["jobs", "--before", "page-2"],
    "cancel-unfiltered": ["cancel"],
    "cancel-dry-run-running": ["cancel", "--tenant", "acme", "--dry-run", "--running"],
    "cancel-id-and-filter": ["cancel", "1", "--actor", "user-7"],
    "retry-unfiltered": ["dead", "retry"],
    "retry-id-and-filter": ["dead", "retry", "1", "--kind", "demo.fail"],
    "retry-since": ["dead", "retry", "--since", "yesterday"],
    "cancel-json": ["jobs", "--json", "cancel", "--tenant", "acme"],
}

# the deprecated spellings: their deprecation line, then the same one error line
BAD_DEPRECATED: dict[str, list[str]] = {
    "cancel-unfiltered": ["jobs", "cancel"],
    "cancel-dead": ["jobs", "cancel", "--tenant", "acme", "--status", "dead"],
    "cancel-two-tenants": ["jobs", "--tenant", "acme", "cancel", "--tenant", "globex"],
    "retry-pending": ["jobs", "retry-dead", "--tenant", "globex", "--status", "pending"],
}
DEPRECATED = {"cancel": "tenantq: 'jobs cancel' is deprecated; use 'cancel'",
              "retry-dead": "tenantq: 'jobs retry-dead' is deprecated; use 'dead retry'"}


def test_bad_input_is_one_line_and_changes_nothing(cli: Cli, db: Database,
                                                   jobs: dict[str, list[int]]) -> None:
    before = status_counts(db)
    for case, args in BAD.items():
        res = cli.run(*args)
        assert res.returncode != 0, (case, res.stdout)
        one_error_line(res.stderr)
        assert res.stdout == "", (case, res.stdout)
    for case, args in BAD_DEPRECATED.items():
        res = cli.run(*args)
        assert res.returncode != 0, (case, res.stdout)
        first, *rest = res.stderr.splitlines()
        assert first == DEPRECATED["cancel" if "cancel" in args else "retry-dead"], (case, res.stderr)
        one_error_line("\n".join(rest))
        assert res.stdout == "", (case, res.stdout)
    assert status_counts(db) == before


def test_cancel_a_filtered_set(cli: Cli, queue: Queue, jobs: dict[str, list[int]]) -> None:
    assert cli.ok("cancel", "--tenant", "acme", "--actor", "user-7", "--dry-run").strip() == \
        "would cancel 4 pending job(s) (tenant acme, actor user-7)"
    assert {queue.job(i).status for i in jobs["reports"]} == {"pending"}
    out = cli.ok("cancel", "--tenant", "acme", "--kind", "reports.render", "--meta", "plan=pro")
    assert out.strip() == \
        'cancelled 4 pending job(s) (tenant acme, kind reports.render, meta {"plan": "pro"})'
    assert {queue.job(i).status for i in jobs["reports"]} == {"cancelled"}
    assert queue.job(jobs["mail"][0]).status == "pending"
    assert cli.ok("cancel", "--kind", "reports.render").strip() == \
        "cancelled 0 pending job(s) (kind reports.render)"
    assert cli.ok("cancel", "--all").strip() == "cancelled 1 pending job(s) (every tenant)"


def test_jobs_cancel_is_a_hidden_alias_that_says_so(cli: Cli, queue: Queue,
                                                    jobs: dict[str, list[int]]) -> None:
    shown = cli.ok("jobs", "--help")
    assert "Commands:" not in shown and "retry-dead" not in shown, shown  # hidden
    # filters before the command's name count too
    res = cli.run("jobs", "--tenant", "acme", "cancel", "--kind", "reports.render", "--status", "pending")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines() == [DEPRECATED["cancel"]]
    assert res.stdout.strip() == "cancelled 4 pending job(s) (tenant acme, kind reports.render)"
    assert {queue.job(i).status for i in jobs["reports"]} == {"cancelled"}
    assert queue.job(jobs["mail"][0]).status == "pending"


def test_retry_dead_a_filtered_set(cli: Cli, queue: Queue, jobs: dict[str, list[int]]) -> None:
    assert cli.ok("dead", "retry", "--tenant", "acme").strip() == "replayed 0 job(s)"
    assert cli.ok("dead", "retry", "--tenant", "globex", "--kind", "demo.fail", "--dry-run").strip() == \
        "would replay 2 job(s)"
    out = cli.ok("dead", "retry", "--tenant", "globex", "--since", "1h")
    assert out.strip() == "replayed 2 job(s)"
    for job_id in jobs["dead"]:
        info = queue.job(job_id)
        assert (info.status, info.attempts, info.replays) == ("pending", 0, 1)
    assert queue.job(jobs["done"][0]).status == "done"


def test_jobs_retry_dead_is_a_hidden_alias_that_says_so(cli: Cli, queue: Queue,
                                                        jobs: dict[str, list[int]]) -> None:
    res = cli.run("jobs", "retry-dead", "--tenant", "globex", "--kind", "demo.fail", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "would replay 2 job(s)"
    assert res.stderr.splitlines() == [DEPRECATED["retry-dead"]]
    res = cli.run("jobs", "retry-dead", "--tenant", "globex", "--status", "dead", "--since", "1h")
    assert (res.returncode, res.stdout.strip()) == (0, "replayed 2 job(s)"), res.stderr
    assert res.stderr.splitlines() == [DEPRECATED["retry-dead"]]
    assert {queue.job(i).status for i in jobs["dead"]} == {"pending"}
