"""The picture people would rather look at: small tenants' worst wait
versus the whale's backlog, for tenantq and the FIFO peers."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display here
import matplotlib.pyplot as plt

DOCS = Path(__file__).resolve().parent.parent / "docs"
COLORS = {"tenantq": "#1f7a3a", "pgqueuer": "#c0392b", "procrastinate": "#7d3c98"}


def plot_fairness(payload: dict[str, Any], path: Path = DOCS / "fairness-wait.png") -> Path:
    deadline = float(payload["settings"]["deadline"])
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    systems = sorted({r["system"] for r in payload["runs"]}, key=lambda s: (s != "tenantq", s))
    for system in systems:
        xs, ys, capped = [], [], []
        for r in payload["runs"]:
            if r["system"] != system or not r["whale"]:
                continue
            waits = [w for ws in r["small_waits"].values() for w in ws]
            if r.get("unfinished_small"):
                capped.append(r["whale"])
                xs.append(r["whale"])
                ys.append(deadline)
            else:
                xs.append(r["whale"])
                ys.append(max(waits))
        ax.plot(xs, ys, marker="o", color=COLORS.get(system), label=system, linewidth=2)
        for x in capped:
            ax.annotate("not started\nby deadline", (x, deadline), textcoords="offset points",
                        xytext=(0, -28), ha="center", fontsize=8, color=COLORS.get(system))
    empty = [r for r in payload["runs"] if r["system"] == "tenantq" and not r["whale"]]
    if empty:
        base = max(w for ws in empty[0]["small_waits"].values() for w in ws)
        ax.axhline(base, color=COLORS["tenantq"], linestyle=":", linewidth=1)
        ax.text(2_000, base * 1.15, f"tenantq on an empty queue ({base * 1000:.0f} ms)", fontsize=8,
                color=COLORS["tenantq"])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("whale backlog (jobs)")
    ax.set_ylabel("small tenants' max wait (s)")
    settings = payload["settings"]
    ax.set_title(f"Noisy neighbour: 5 small tenants x {settings['small_jobs']} jobs, "
                 f"concurrency {settings['concurrency']}, {settings['handler_ms']} ms jobs")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    # python -m bench.plot bench/results/fairness-....json
    print(plot_fairness(json.loads(Path(sys.argv[1]).read_text())))


def plot_soak(payload: dict[str, Any], path: Path = DOCS / "soak.png") -> Path:
    """The soak's series over time, with and without retention."""
    series = [("claim_p50_ms", "pick and claim p50 (ms)"), ("claim_p99_ms", "pick and claim p99 (ms)"),
              ("drain_per_s", "drained jobs/s"), ("small_wait_ms", "small tenant's wait p50 (ms)"),
              ("jobs_mb", "jobs table (MB)"), ("indexes_mb", "jobs indexes (MB)"),
              ("cpu_busy_pct", "machine CPU busy (%)"),
              ("cpu_steal_pct", "CPU taken by the hypervisor (steal, %)")]
    fig, axes = plt.subplots(4, 2, figsize=(10, 11.2), dpi=110)
    for ax, (key, title) in zip(axes.flat, series, strict=True):
        for run in payload["runs"]:
            xs = [s["t_s"] for s in run["samples"]]
            ys = [s.get(key, float("nan")) for s in run["samples"]]  # runs before a series had none
            label = "retention on" if run["retention"] else "no retention"
            ax.plot(xs, ys, marker=".", label=label,
                    color="#1f7a3a" if run["retention"] else "#c0392b", linewidth=1.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("time (s)", fontsize=9)
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    settings = payload["settings"]
    fig.suptitle(f"Soak: {settings['total']:,} jobs at {settings['rate']:,.0f}/s", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
