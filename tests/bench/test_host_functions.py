"""`./run bench host-functions` at its tiny sizes: a row for every mode that
works here (the others skipped with a reason), counts that match the sizes,
sane percentiles, the JSON result, and the bench's app schema and roles gone
afterwards (the real run is `./run bench host-functions`, never a test)."""

from __future__ import annotations

import json
from pathlib import Path

import bench.common
import psycopg
import pytest
from bench.__main__ import SMALL
from bench.host_functions import DIRECT, MODES, run

from tenantq.sandbox.drivers import bwrap_works, runsc_works


def test_the_host_functions_bench_measures_every_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str],
                                                      server_dsn: str) -> None:
    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    small = SMALL["host-functions"]
    payload = run(**small)
    out = capsys.readouterr().out

    works = {"inline": True, "process": bwrap_works(), "gvisor": runsc_works()}
    expected = [mode for mode in MODES if works[mode]]
    assert payload["modes"] == expected
    assert set(payload["skipped"]) == {mode for mode, ok in works.items() if not ok}
    assert all(reason for reason in payload["skipped"].values())

    calls = {"noop": small["trivial_calls"], "orders": small["select_calls"]}
    rows = {"noop": [0], "orders": [100]}  # {} back; 100 of the tenant's rows
    for function, n in calls.items():
        modes = expected + ([DIRECT] if function == "orders" else [])
        by_mode = payload["summary"][function]
        assert sorted(by_mode) == sorted(modes), by_mode
        for mode in modes:
            entry = by_mode[mode]
            assert entry["calls"] == small["rounds"] * (n - small["warmup"]), (function, mode, entry)
            assert len(payload["samples_ms"][function][mode]) == entry["calls"]
            assert 0 < entry["p50_ms"] <= entry["p99_ms"] < 10_000, (function, mode, entry)
            assert entry["rows"] == rows[function], (function, mode, entry)
            if mode != "inline":
                assert entry["p50_vs_inline"] > 0 and entry["p99_vs_inline"] > 0, entry
            if function == "orders" and mode != DIRECT:
                assert entry["p50_vs_direct"] > 0 and entry["p99_vs_direct"] > 0, entry

    for mode in expected:
        assert f" {mode} " in out, out
    assert "direct psycopg (host)" in out and "SELECT 100 rows" in out, out

    [written] = tmp_path.glob("host-functions-*.json")
    saved = json.loads(written.read_text())
    assert saved["benchmark"] == "host-functions" and saved["summary"] == payload["summary"]

    # the app's schema and both roles are dropped
    settings = payload["settings"]
    with psycopg.connect(server_dsn) as conn:
        schemas = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s",
                               (settings["app_schema"],)).fetchone()
        roles = conn.execute("SELECT rolname FROM pg_roles WHERE rolname = ANY(%s)",
                             (settings["roles"],)).fetchall()
    assert schemas == (0,)
    assert roles == []
