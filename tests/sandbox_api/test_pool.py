"""The ready pool: pristine sandboxes booted ahead of demand, bound to their
owner only when handed out, never reused."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenantq import Sandbox
from tenantq.sandbox.pool import pool, pool_key, wait_until_ready


@pytest.fixture
def pooled(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setenv("TENANTQ_POOL_SIZE", "2")
    yield 2
    pool().close()  # what is still waiting goes, before the leftovers check


def test_create_hands_out_a_pristine_pooled_sandbox_and_never_takes_it_back(
        pooled: int, driver_name: str) -> None:
    key = pool_key("base", driver_name)
    first = Sandbox.create(driver=driver_name, ttl_seconds=60)  # cold: the pool of its kind starts filling
    assert wait_until_ready(key, pooled, timeout=120)
    assert [i.id for i in Sandbox.list()] == [first.id]  # waiting sandboxes belong to nobody
    waiting = {s.id for s in pool()._ready[key]}
    sbx = Sandbox.create(driver=driver_name, ttl_seconds=45, metadata={"job": "pooled"}, tenant="acme",
                         envs={"WHO": "owner"}, secrets={"TOKEN": "s3cret"})
    try:
        assert sbx.id in waiting
        assert sbx.run("echo $WHO $TOKEN").stdout == "owner s3cret\n"
        assert sbx.tenant == "acme" and sbx.metadata == {"job": "pooled"}
        listed = {i.id: i for i in Sandbox.list(metadata={"job": "pooled"})}
        assert listed[sbx.id].tenant == "acme"
        assert 30 < listed[sbx.id].deadline - time.time() <= 45
        # pristine: no file, process or variable of anyone before it
        assert sbx.run("ls /work 2>/dev/null; env | grep -c '^WHO='").stdout.strip().endswith("1")
    finally:
        sbx.delete()
        first.delete()
    assert wait_until_ready(key, pooled, timeout=120)  # refilled
    assert sbx.id not in {s.id for s in pool()._ready[key]}  # deleted after use, never back in the pool
    # another kind (other limits) is another pool: no pooled one fits it
    other = Sandbox.create(driver=driver_name, ttl_seconds=30, memory_mb=256)
    try:
        assert other.id not in waiting
    finally:
        other.delete()
