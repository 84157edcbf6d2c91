"""`./run bench host-connections` at its tiny size: its verdict (the app
database's connections never exceed the pool while every batch calls) must
hold, every batch's calls answered; its scratch database dropped (the real
run, 200 batches, is `./run bench host-connections`, never a test)."""

from __future__ import annotations

from pathlib import Path

import bench.common
import psycopg
import pytest
from bench.__main__ import SMALL
from bench.host_connections import run

from tenantq.sandbox.drivers import bwrap_works


@pytest.mark.skipif(not bwrap_works(), reason="bubblewrap does not work here (the bench's sandboxes)")
def test_the_connections_bench_holds_at_its_small_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       server_dsn: str) -> None:
    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    small = SMALL["host-connections"]
    payload = run(**small)
    assert payload["holds"], payload
    assert payload["peak"]["calling"] == small["batches"] and payload["peak"]["app"] >= 1, payload
    assert payload["calls"] >= small["batches"] and payload["done"] == small["batches"]
    with psycopg.connect(server_dsn) as conn:
        left = conn.execute("SELECT datname FROM pg_database "
                            "WHERE datname LIKE 'tqbench_hostconn_%'").fetchall()
    assert left == [], left
