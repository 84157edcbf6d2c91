"""The checks every adversarial test makes, whatever it attacks
(docs/security.md, "Testing the promise"), as the base class of `Arena`:
the host marker, the neighbour's jobs, the worker's exit, RSS, log and
leftovers, and every hostile job's reason and attempts. Problems are
collected, not raised one at a time, so that one run reports every promise
it saw broken."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from tests.adversarial import attack_app

MALLORY, ACME = "mallory", "acme"
RSS_HEADROOM_KB = 150 * 1024
# a neighbour's job: done within this long of its enqueue (or of the
# worker's start, for jobs enqueued before it). Measured here: 0.2-3.4 s
# with the attacks running; the headroom is for a loaded 2-core CI host
# (10.6 s seen at load average 13), not for a slot the attack holds up
NEIGHBOUR_WAIT_SECONDS = 15.0
MAX_ERROR_CHARS = 4000
# the worker's own log must stay small whatever the guest prints
MAX_LOG_BYTES = 4 << 20
# how a classified reason starts (docs/security.md rule 6; guest/jobs.py)
REASON = re.compile(r"^(timeout after \d|oom: |crashed: |killed by signal \d|result |unknown kind "
                    r"|[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Timeout|Warning)\b|[a-z][\w -]*: )")
# driver -> the honest run's peak RSS (kB), measured once per session
BASELINES: dict[str, int] = {}


class Checks:
    """Needs, from the Arena it is a base of: driver, problems, runs,
    histories, marker, secrets, hostile, siblings, neighbours, job()."""

    driver: str
    problems: list[str]
    runs: list[Any]
    histories: list[dict[int, list[tuple[int, str]]]]
    marker: Any
    secrets: dict[str, dict[str, str]]
    hostile: list[Any]
    siblings: list[Any]
    neighbours: list[Any]

    def job(self, job_id: int) -> Any:
        raise NotImplementedError

    def check_common(self) -> None:
        p = self.problems
        baseline = BASELINES.get(self.driver, 0)
        for i, run in enumerate(self.runs):
            tag = f"worker run {i + 1}"
            if run.returncode != 0:
                p.append(f"{tag}: the worker exited {run.returncode} (must be 0); "
                         f"log tail:\n{run.log[-2500:]}")
            if run.peak_kb - baseline > RSS_HEADROOM_KB:
                p.append(f"{tag}: dispatcher peak RSS {run.peak_kb} kB is {run.peak_kb - baseline} kB "
                         f"over the honest run's {baseline} kB (limit {RSS_HEADROOM_KB} kB)")
            if run.log_bytes > MAX_LOG_BYTES:
                p.append(f"{tag}: the worker's log grew to {run.log_bytes} bytes")
            if run.left_in_cgroup:
                p.append(f"{tag}: processes left after the worker exited: {run.left_in_cgroup}")
            if "Traceback" in run.log:
                p.append(f"{tag}: a traceback in the worker log:\n{around(run.log, 'Traceback')}")
        p += self.marker.changes()
        texts = self.texts()
        for secret in self.marker.secrets():
            for where, text in texts.items():
                if secret in text:
                    p.append(f"the host marker/canary content reached {where}")
        for value in self.secrets[ACME].values():
            for where, text in texts.items():
                if where.startswith(("mallory", "worker")) and value in text:
                    p.append(f"the neighbour's secret reached {where}")
        self.check_neighbours()
        self.check_hostile()

    def texts(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for h in self.hostile + self.siblings:
            info = self.job(h.job_id)
            out[f"mallory job {h.job_id}"] = json.dumps(info.result) + (info.last_error or "")
        for n in self.neighbours:
            info = self.job(n.job_id)
            out[f"acme job {n.job_id}"] = json.dumps(info.result) + (info.last_error or "")
        for i, run in enumerate(self.runs):
            out[f"worker log {i + 1}"] = run.log
        return out

    def check_neighbours(self) -> None:
        for n in self.neighbours + self.siblings:
            info = self.job(n.job_id)
            who = f"{n.tenant} job {n.job_id} (adv.echo n={n.n})"
            if info.status != "done":
                self.problems.append(f"{who} is {info.status}, not done: {(info.last_error or '')[:400]}")
                continue
            r = info.result
            expected = {"tenant": n.tenant, "n": n.n, "billing": attack_app.billing(n.n), "attempt": 1,
                        "uid": 65534}
            got = {k: r.get(k) for k in expected} if isinstance(r, dict) else r
            if got != expected:
                self.problems.append(f"{who} has a result it did not compute: {str(r)[:300]}")
            if info.attempts != 1:
                self.problems.append(f"{who} ran with {info.attempts} attempts")
            if isinstance(r, dict):
                if r.get("others"):
                    self.problems.append(f"{who} saw other processes in its sandbox: {r['others']}")
                if any(r.get("scratch", {}).values()):
                    self.problems.append(f"{who} found files in its scratch space: {r['scratch']}")
            wait = self.neighbour_wait(n) if n.tenant == ACME else None
            if wait is not None and wait > NEIGHBOUR_WAIT_SECONDS:
                self.problems.append(f"{who} took {wait:.1f} s from enqueue to done "
                                     f"(normal: within {NEIGHBOUR_WAIT_SECONDS:g} s)")

    def neighbour_wait(self, n: Any) -> float | None:
        """Seconds from a neighbour job's enqueue (or the worker's start, if
        it was enqueued before) to its end."""
        info = self.job(n.job_id)
        if info.finished_at is None:
            return None
        since = info.created_at
        if not n.enqueued_after_start and self.runs:
            since = max(since, self.runs[0].started_at)
        return float((info.finished_at - since).total_seconds())

    def check_hostile(self) -> None:
        history = self.watch_history()
        for h in self.hostile:
            info = self.job(h.job_id)
            who = f"hostile job {h.job_id} ({h.kind} {short(h.payload)})"
            if info.status not in ("done", "dead"):
                self.problems.append(f"{who} did not settle: {info.status}, attempts {info.attempts}")
                continue
            if info.attempts > h.max_attempts:
                self.problems.append(f"{who} ran {info.attempts} times (max_attempts {h.max_attempts})")
            error = info.last_error or ""
            if len(error) > MAX_ERROR_CHARS:
                self.problems.append(f"{who}: last_error is {len(error)} characters "
                                     f"(bound: {MAX_ERROR_CHARS})")
            if "\x00" in error or any(0xD800 <= ord(c) <= 0xDFFF for c in error):
                self.problems.append(f"{who}: last_error holds a NUL or a lone surrogate")
            if info.status == "dead":
                if info.attempts != h.max_attempts:
                    self.problems.append(f"{who} is dead after {info.attempts} of {h.max_attempts} attempts")
                if not (REASON.match(error) or (h.own_error_text and error)):
                    self.problems.append(f"{who} is dead without a classified reason: {error[:300]!r}")
            seen = history.get(h.job_id, [])
            if h.charged:
                counts = [a for a, _ in seen]
                if any(b < a for a, b in itertools.pairwise(counts)):
                    self.problems.append(f"{who}: its attempts went down (a refund for a job that ran): "
                                         f"{seen}")

    def watch_history(self) -> dict[int, list[tuple[int, str]]]:
        merged: dict[int, list[tuple[int, str]]] = {}
        for run_history in self.histories:
            for job_id, seen in run_history.items():
                merged.setdefault(job_id, []).extend(seen)
        return merged

    def outcome(self, job_id: int) -> tuple[str, int, Any, str]:
        info = self.job(job_id)
        return info.status, info.attempts, info.result, info.last_error or ""

    def expect(self, condition: bool, message: str) -> None:
        if not condition:
            self.problems.append(message)

    def summary(self) -> str:
        """Every job of the test, one line each (printed: pytest shows it on failure)."""
        lines = []
        for h in [*self.hostile, *self.siblings, *self.neighbours]:
            info = self.job(h.job_id)
            error = (info.last_error or "").replace("\n", " | ")[:160]
            payload = short(getattr(h, "payload", None))[:40]
            lines.append(f"{h.job_id:>4} {info.tenant_id:<8} {info.kind:<16} {payload:<40} {info.status:<5} "
                         f"attempts={info.attempts}/{info.max_attempts} {error}")
        waits = [self.neighbour_wait(n) for n in self.neighbours]
        known = [w for w in waits if w is not None]
        if known:
            lines.append(f"neighbour waits: {len(known)} jobs, max {max(known):.2f} s")
        for i, run in enumerate(self.runs):
            lines.append(f"worker run {i + 1}: exit {run.returncode}, {run.elapsed:.1f} s, peak "
                         f"{run.peak_kb} kB (honest run {BASELINES.get(self.driver)} kB), "
                         f"log {run.log_bytes} bytes")
        return "\n".join(lines)

    def verdict(self) -> None:
        """Fail with every problem seen (common checks included)."""
        print(self.summary())
        self.check_common()
        if self.problems:
            raise AssertionError(f"{len(self.problems)} broken promise(s) on the {self.driver} driver:\n- "
                                 + "\n- ".join(self.problems))



def short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) < 80 else text[:77] + "..."


def around(text: str, needle: str, width: int = 1500) -> str:
    at = text.find(needle)
    return text[max(0, at - 200): at + width]
