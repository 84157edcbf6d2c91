"""Rules E1 and E3 (docs/security.md) and docs/egress.md "policy before DNS",
attacked through a resolver the test controls: each scenario of
tests/adversarial/egress_netns.py / egress_netns_main.py runs in a network and
mount namespace of its own (`unshare --net --mount`), where /etc/resolv.conf
names a tiny DNS server on the namespace's loopback and every address the
proxy must not reach has a trap listener.

- internal: allowed names answering cloud metadata, RFC 6598, private,
  documentation, benchmarking, unspecified and loopback addresses and their
  IPv6 wrappings (v4-mapped, 6to4, Teredo, NAT64, local-use NAT64, ULA, ::1)
  are refused with 403 and never connected to; a global answer is (control);
- rebind: the answer changes between the policy's look-up and the connect
  (first 127.0.0.1, allowed here, then 127.0.0.2, refused);
- names: CONNECT targets and absolute URIs that smuggle a disallowed name
  past a wildcard rule never reach the resolver;
- flood: more than 256 names per batch under a wildcard rule, each
  intercepted (a leaf certificate per name), ten tenants' batches: the 257th
  name is refused before DNS, memory stops growing, nothing goes to disk and
  a neighbour's requests stay fast.

The proxy runs in the namespace's process, built the way tests/egress/ builds
it; the trap listeners bind addresses other than 127.0.0.1, but only on the
namespace's own loopback, which nothing outside it can reach."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECONDS = {"internal": 120, "rebind": 120, "names": 120, "flood": 400}


def _run(scenario: str, tmp_path: Path) -> dict[str, list[str]]:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and ip to make a network namespace with a resolver of its own")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(["unshare", "--net", "--mount", "--", sys.executable, "-m",
                           "tests.adversarial.egress_netns_main", scenario, str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=SECONDS[scenario],
                          check=False)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, (
        f"the {scenario} scenario did not run (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    report: dict[str, list[str]] = json.loads(lines[-1])
    print("\n".join(report["notes"]))
    return report


@pytest.mark.parametrize("scenario", ["internal", "rebind", "names"])
def test_dns_answers_and_names(scenario: str, tmp_path: Path) -> None:
    problems = _run(scenario, tmp_path)["problems"]
    assert not problems, f"{scenario}:\n- " + "\n- ".join(problems)


@pytest.mark.timeout(450)
def test_a_flood_of_resolvable_names_is_bounded(tmp_path: Path) -> None:
    problems = _run("flood", tmp_path)["problems"]
    assert not problems, "flood:\n- " + "\n- ".join(problems)
