"""`./run fuzz [--minutes N] [TARGET ...]`: run each fuzz target for N
minutes (default 10) with a corpus under .fuzz/<target>/ seeded with valid
inputs, and print executions, coverage and crashes per target."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGETS = ("channel_frames", "proxy_head")


def _frame(value: object) -> bytes:
    body = json.dumps(value).encode()
    return b"%010d\n" % len(body) + body


def seeds(target: str) -> list[bytes]:
    if target == "channel_frames":
        records = [{"status": "ready"}, {"status": "batch_ready"},
                   {"status": "job_end", "seq": 0, "ok": True, "result": {"a": [1, 2]}},
                   {"status": "job_end", "seq": 1, "ok": False, "reason": "timeout", "error": "x"},
                   {"status": "batch_end", "exit": 0}, {"status": "batch_end", "signal": 9},
                   {"status": "fatal", "error": "boom"}]
        return [b"\x00" + _frame(r) for r in records] + [b"\x01" + b"".join(_frame(r) for r in records)]
    return [b"CONNECT api.example.com:443 HTTP/1.1\r\nHost: api.example.com\r\n\r\n",
            b"GET http://api.example.com/x?y=1 HTTP/1.1\r\nHost: api.example.com\r\n\r\n",
            b"CONNECT [::ffff:127.0.0.1]:80 HTTP/1.1\r\n\r\n"]


def run(target: str, minutes: float) -> dict[str, object]:
    corpus = ROOT / ".fuzz" / target / "corpus"
    crashes = ROOT / ".fuzz" / target / "crashes"
    corpus.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(crashes, ignore_errors=True)  # each run reports its own finds
    crashes.mkdir(parents=True)
    for i, seed in enumerate(seeds(target)):
        (corpus / f"seed-{i}").write_bytes(seed)
    command = [sys.executable, str(HERE / f"{target}.py"), str(corpus),
               f"-max_total_time={int(minutes * 60)}", "-print_final_stats=1",
               f"-artifact_prefix={crashes}/", "-timeout=10", "-rss_limit_mb=2048"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    out = done.stderr
    execs = re.findall(r"stat::number_of_executed_units:\s+(\d+)", out)
    cov = re.findall(r"cov: (\d+) ft: (\d+)", out)
    return {"target": target, "exit": done.returncode, "executions": int(execs[-1]) if execs else 0,
            "coverage_edges": int(cov[-1][0]) if cov else 0, "features": int(cov[-1][1]) if cov else 0,
            "crashes": sorted(p.name for p in crashes.iterdir()),
            "tail": out.strip().splitlines()[-3:] if done.returncode else []}


def main() -> int:
    parser = argparse.ArgumentParser(prog="./run fuzz")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("targets", nargs="*", default=list(TARGETS))
    args = parser.parse_args()
    failed = False
    print(f"{'target':16} {'minutes':>7} {'executions':>11} {'edges':>6} {'features':>8}  crashes")
    for target in args.targets:
        if target not in TARGETS:
            print(f"unknown fuzz target {target!r}: choose from {', '.join(TARGETS)}", file=sys.stderr)
            return 2
        r = run(target, args.minutes)
        failed |= bool(r["crashes"]) or r["exit"] != 0
        print(f"{target:16} {args.minutes:7g} {r['executions']:11,} {r['coverage_edges']:6} "
              f"{r['features']:8}  {', '.join(r['crashes']) or 'none'}")  # type: ignore[str-format]
        for line in r["tail"]:  # type: ignore[attr-defined]
            print(f"    {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
