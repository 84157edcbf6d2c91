"""Each benchmark runs at tiny sizes so it cannot rot (the real runs are
`./run bench`, never part of the tests)."""

from __future__ import annotations

from pathlib import Path

import bench.common
import pytest
from bench.__main__ import BENCHMARKS, SMALL


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_runs_small(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    payload = BENCHMARKS[name](**SMALL[name])
    assert payload["benchmark"] == name
    assert "machine" in payload
    assert list(tmp_path.glob(f"{name}-*.json")), "the benchmark wrote no JSON result"
