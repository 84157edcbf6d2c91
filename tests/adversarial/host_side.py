"""The test's side of a Sandbox API test's host process (tests/adversarial/host.py
`Host`): run a module's `child_main` in a subprocess inside the test's memory
cgroup, under a wall-clock bound, and read back the report it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.adversarial.host import MemoryCgroup

ROOT = Path(__file__).resolve().parents[2]


def run_host_side(child: str, attack: str, args: dict[str, Any], *, cgroup: MemoryCgroup, tmp_path: Path,
                  timeout: float, env: dict[str, str] | None = None, exit_hung: int | None = None,
                  exit_seconds: float = 0.0) -> dict[str, Any]:
    """Run `child`.child_main on ATTACKS[attack](**args) in a subprocess inside
    `cgroup`; its report. A child that ends in `exit_hung` once done had an exit
    that outlived `exit_seconds` (where the ready pool deletes what it holds)."""
    code = (f"import sys; sys.path.insert(0, sys.argv[1]); "
            f"from {child} import child_main; child_main(sys.argv[2], sys.argv[3])")
    work = tmp_path / "harness"
    work.mkdir(exist_ok=True)
    args_file, report_file, log_file = (work / f"{attack}.{n}" for n in ("args.json", "report.json", "log"))
    args_file.write_text(json.dumps({"attack": attack, **args}))
    started = time.monotonic()
    with log_file.open("wb") as log:
        proc = subprocess.Popen(cgroup.wrap([sys.executable, "-c", code, str(ROOT), str(args_file),
                                             str(report_file)]),
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
        try:
            rc: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
    try:
        report: dict[str, Any] = json.loads(report_file.read_text())
    except (OSError, ValueError):
        report = {"problems": [], "notes": [], "steps": [], "memory": {}}
    report["seconds"] = round(time.monotonic() - started, 1)
    report["log"] = log_file.read_text(errors="replace")[-4000:]
    last = (report.get("steps") or ["(none)"])[-1]
    if rc is None:
        report["problems"].append(f"the host side was still running after {timeout:.0f} s "
                                  f"(last step: {last})")
    elif exit_hung is not None and rc == exit_hung and report.get("done"):
        report["problems"].append(
            f"the host-side process finished but its exit (where the ready pool deletes what it holds) "
            f"had not ended {exit_seconds:.0f} s later; log tail:\n{report['log'][-1500:]}")
    elif rc != 0:
        report["problems"].append(f"the host-side process exited {rc} (crashed, or killed at its memory "
                                  f"cgroup's limit; failcnt {cgroup.failcnt()}); last step: {last}; "
                                  f"log tail:\n{report['log'][-2000:]}")
    elif not report.get("done"):
        report["problems"].append(f"the host side ended without finishing (last step: {last})")
    return report


def show(report: dict[str, Any]) -> list[str]:
    """Print the report (pytest shows it on failure, and with -s); its problems."""
    print(f"host side: {report.get('seconds')} s; memory {json.dumps(report.get('memory'))}")
    for step in report.get("steps", []):
        print(f"  step {step}")
    for note in report.get("notes", []):
        print(f"  note: {note}")
    for problem in report.get("problems", []):
        print(f"  PROBLEM: {problem}")
    return list(report.get("problems", []))
