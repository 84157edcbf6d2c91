"""Egress for Sandbox API sandboxes (docs/sandbox-api.md, "Egress"): no
network without rules; with `egress=[...]` the allowed hosts only, through
the host's proxy, for later execs and for fork children; bad rules are one
line. The servers are on 127.0.0.1, which the proxy admits only because the
test allows that network (TENANTQ_EGRESS_ALLOW_NETWORKS), as the queue's
egress tests do."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenantq import InvalidInput, Sandbox
from tests.egress.servers import serving

FETCH = ("python3 -c 'import sys, urllib.request; "
         "print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' ")


@pytest.fixture
def local_networks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENANTQ_EGRESS_ALLOW_NETWORKS", "127.0.0.1/32")


def test_without_rules_there_is_no_way_out(driver_name: str, data_dir: Path, local_networks: None) -> None:
    with serving(("allowed",)) as ports, Sandbox.create(driver=driver_name, ttl_seconds=60) as sbx:
        result = sbx.run(FETCH + f"http://127.0.0.1:{ports['allowed']}/", timeout_seconds=30)
        assert not result.ok and "allowed" not in result.stdout
        assert sbx.run("echo ${HTTP_PROXY:-none}").stdout == "none\n"


def test_the_allowed_hosts_and_only_them(driver_name: str, data_dir: Path, local_networks: None) -> None:
    with serving(("allowed", "other")) as ports, \
            Sandbox.create(driver=driver_name, ttl_seconds=120,
                           egress=[f"127.0.0.1:{ports['allowed']}"]) as sbx:
        good = sbx.run(FETCH + f"http://127.0.0.1:{ports['allowed']}/", timeout_seconds=30)
        assert good.stdout == "allowed\n", good
        refused = sbx.run(FETCH + f"http://127.0.0.1:{ports['other']}/", timeout_seconds=30)
        assert not refused.ok and "other" not in refused.stdout
        # going round the proxy (HTTP_PROXY unset) reaches nothing either
        direct = sbx.run("env -u HTTP_PROXY -u http_proxy " + FETCH + f"http://127.0.0.1:{ports['other']}/",
                         timeout_seconds=30)
        assert not direct.ok
        if driver_name == "gvisor":
            child = sbx.fork()
            try:
                assert child.run(FETCH + f"http://127.0.0.1:{ports['allowed']}/",
                                 timeout_seconds=30).stdout == "allowed\n"
                assert not child.run(FETCH + f"http://127.0.0.1:{ports['other']}/", timeout_seconds=30).ok
            finally:
                child.delete()
            # the parent's way out still works after the fork
            assert sbx.run(FETCH + f"http://127.0.0.1:{ports['allowed']}/",
                           timeout_seconds=30).stdout == "allowed\n"
        proxy = sbx.host.egress_dir / "proxy.sock"
        assert proxy.exists()
    assert not proxy.exists()


def test_a_pooled_sandbox_gets_its_owners_rules(data_dir: Path, local_networks: None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from tenantq.sandbox.pool import pool, pool_key, wait_until_ready

    monkeypatch.setenv("TENANTQ_POOL_SIZE", "1")
    with serving(("allowed",)) as ports:
        first = Sandbox.create(ttl_seconds=60)
        first.delete()
        ready = pool()
        try:
            assert wait_until_ready(pool_key("base", first.driver), 1, timeout=120)
            with Sandbox.create(ttl_seconds=60, egress=[f"127.0.0.1:{ports['allowed']}"]) as sbx:
                assert sbx.run(FETCH + f"http://127.0.0.1:{ports['allowed']}/",
                               timeout_seconds=30).stdout == "allowed\n"
        finally:
            ready.close()


@pytest.mark.parametrize(("egress", "message"), [
    (["http://example.com"], "egress rule"),
    ([""], None),
    ([1], "egress must be a list of host rules"),
    (["a.com:99999"], "port"),
])
def test_bad_rules_are_one_line_before_anything_is_made(data_dir: Path, egress: list[object],
                                                        message: str | None) -> None:
    if message is None:  # an empty rule list is no egress, as for tenants
        with Sandbox.create(ttl_seconds=30, egress=egress) as sbx:  # type: ignore[arg-type]
            assert sbx.egress == ()
        return
    with pytest.raises(InvalidInput, match=message) as info:
        Sandbox.create(ttl_seconds=30, egress=egress)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
    assert not list((data_dir / "sandboxes").glob("*/tq-*")) if (data_dir / "sandboxes").exists() else True
