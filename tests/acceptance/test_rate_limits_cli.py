"""`tenantq tenant set --rate/--burst/--rate-kind`, `tenantq kind set
--rate`, `tenantq rates`, as real subprocesses: limits are stored, shown
and lifted; bad input is one line, a non-zero exit, and nothing written."""

from __future__ import annotations

import json

from tenantq.store.db import Database
from tests.acceptance.helpers import Cli, one_error_line, query


def _limits(db: Database) -> list[tuple[str, str, float, float]]:
    rows = query(db, "SELECT tenant_id, kind, per_second, burst FROM rate_limits ORDER BY tenant_id, kind")
    return [(r["tenant_id"], r["kind"], float(r["per_second"]), float(r["burst"])) for r in rows]


def test_rate_limits_are_set_shown_and_lifted(cli: Cli, db: Database) -> None:
    out = cli.ok("tenant", "set", "acme", "--rate", "10/s", "--burst", "20",
                 "--rate-kind", "reports.render=120/m")
    assert "rate limit (all its kinds): 10/s" in out and "rate limit (kind reports.render): 120/m" in out
    assert "across every tenant" in cli.ok("kind", "set", "crm.sync", "--rate", "5000/h")
    assert _limits(db) == [("", "crm.sync", 5000 / 3600, 5000 / 3600), ("acme", "", 10.0, 20.0),
                           ("acme", "reports.render", 2.0, 2.0)]
    shown = cli.ok("rates")
    assert "tenant acme: 10/s, burst 20" in shown and "kind crm.sync (all tenants): 1.38889/s" in shown
    listed = json.loads(cli.ok("rates", "--tenant", "acme", "--json"))
    assert {(r["tenant_id"], r["kind"]) for r in listed} == {("", "crm.sync"), ("acme", ""),
                                                             ("acme", "reports.render")}
    cli.ok("tenant", "set", "acme", "--rate", "none", "--rate-kind", "reports.render=none")
    cli.ok("kind", "set", "crm.sync", "--rate", "none")
    assert _limits(db) == []
    assert cli.ok("rates").strip() == "no rate limits"


def test_bad_rate_limits_are_one_line_and_write_nothing(cli: Cli, db: Database) -> None:
    for args in (["tenant", "set", "acme", "--rate", "10/x"],
                 ["tenant", "set", "acme", "--rate", "0/s"],
                 ["tenant", "set", "acme", "--burst", "5"],
                 ["tenant", "set", "acme", "--rate", "10/s", "--burst", "0"],
                 ["tenant", "set", "acme", "--rate-kind", "reports.render"],
                 ["tenant", "set", "acme", "--rate-kind", "bad kind!=2/s"],
                 ["kind", "set", "crm.sync", "--rate", "-1/s"]):
        res = cli.run(*args)
        assert res.returncode != 0, args
        one_error_line(res.stderr)
    assert _limits(db) == []
