"""The host side of the M1 tests (tests/adversarial/test_code_mounts.py):
`Bench`, one test's real worker CLI runs over the throwaway project (in
the test's memory cgroup, cwd the project, a data dir of its own), its
jobs, CLI calls and templates; the check of a refusal to start ("a non-zero
exit, with one line naming the file and, for a module, which module imports
it"); and the Sandbox API process (`child_main`, started by
tests/adversarial/host_side.py) that makes a sandbox, base or of a
template, and runs the hunt in it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tenantq import JobInfo, Queue
from tenantq.testing import wait_until
from tests.adversarial import host_side
from tests.adversarial.code_mounts_support import (
    GUEST,
    HANDLER_TIMEOUT,
    KIND,
    REPO,
    Project,
    build_project,
    in_warm_closure,
    leaks,
)
from tests.adversarial.host import Host, MemoryCgroup

HUNT_SECONDS = 240.0
WORKER_SECONDS = HANDLER_TIMEOUT + 120.0
REFUSE_SECONDS = 60.0
CLI_SECONDS = 240.0
EXIT_SECONDS = 30.0
EXIT_HUNG = 97
TERMINAL = ("done", "dead", "cancelled")


@dataclass
class WorkerRun:
    returncode: int | None
    stderr: str
    seconds: float


def refusal_problems(what: str, returncode: int | None, stderr: str, path: Path | tuple[Path, ...],
                     importer: str | None) -> list[str]:
    """docs/security.md M1: refuses to start (a non-zero exit) with one line naming the file
    (any of `path`, when several are right) and, for a module, its importer. Log
    lines before it (the driver chosen) are allowed; after it, nothing."""
    paths = path if isinstance(path, tuple) else (path,)
    lines = [line for line in stderr.splitlines() if line.strip()]
    wrong: list[str] = []
    if returncode in (0, None):
        wrong.append(f"exited {returncode}, not a refusal to start")
    naming = [line for line in lines if any(str(p) in line for p in paths)]
    if len(naming) != 1 or lines[-1] != naming[0]:
        wrong.append(f"not one line naming {' or '.join(map(str, paths))}, last ({len(naming)} naming it)")
    elif importer is not None and importer not in naming[0]:
        wrong.append(f"the line does not say which module imports it ({importer})")
    if "Traceback" in stderr:
        wrong.append("a traceback")
    if not wrong:
        return []
    shown = "\n".join(lines[-12:])
    return [f"{what}: {'; '.join(wrong)}; output:\n{shown}"]


def walked(report: dict[str, Any]) -> list[str]:
    """The hunt really walked the filesystem (a walk that saw nothing proves nothing)."""
    counts = report.get("walk", {}).get("counts", {})
    if counts.get("files", 0) < 1000 or counts.get("read", 0) < 10:
        return [f"the hunt's walk saw too little to prove anything: {counts}"]
    return []


class Bench:
    """One test's projects, workers, jobs and templates; `cleanup` undoes them."""

    def __init__(self, driver: str, queue: Queue, cmd: list[str], env: dict[str, str], data_dir: Path,
                 tmp_path: Path, cgroup: MemoryCgroup) -> None:
        self.driver, self.queue, self.cmd, self.env = driver, queue, cmd, env
        self.data_dir, self.tmp, self.cgroup = data_dir, tmp_path, cgroup
        self.templates: list[str] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.files: list[IO[bytes]] = []
        self.runs = 0

    def build(self, **kw: Any) -> Project:
        return build_project(self.tmp, **kw)

    def enqueue(self, proj: Project, **order: Any) -> int:
        job_id: int = self.queue.enqueue("mallory", KIND, proj.order(data_dir=self.data_dir, **order),
                                         max_attempts=1)
        return job_id

    def _args(self, proj: Project, *extra: str) -> list[str]:
        return ["worker", "--app", proj.module, "--sandbox", self.driver, "--concurrency", "1",
                "--backoff-base", "0", "--poll-seconds", "0.2", "--log-format", "json",
                "--secrets", str(proj.secrets_file), *extra]

    def start(self, proj: Project, *extra: str, env: dict[str, str] | None = None,
              ) -> tuple[subprocess.Popen[bytes], Path]:
        """`tenantq worker ...` in the background; its stderr goes to the returned file."""
        self.runs += 1
        log = self.tmp / f"worker-{self.runs}.log"
        err = log.open("wb")
        self.files.append(err)
        proc = subprocess.Popen(self.cgroup.wrap([*self.cmd, *self._args(proj, *extra)]),
                                env={**proj.worker_env(self.env, self.data_dir), **(env or {})},
                                cwd=proj.root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err)
        self.procs.append(proc)
        return proc, log

    def worker(self, proj: Project, *extra: str, env: dict[str, str] | None = None,
               timeout: float = WORKER_SECONDS) -> WorkerRun:
        """`tenantq worker ... --once` to its exit (killed past `timeout`: returncode None)."""
        started = time.monotonic()
        proc, log = self.start(proj, "--once", *extra, env=env)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
            proc.kill()
            proc.wait(timeout=30)
        return WorkerRun(code, log.read_text(errors="replace"), time.monotonic() - started)

    def settle(self, job_id: int, proc: subprocess.Popen[bytes], timeout: float) -> JobInfo:
        """The job once it is settled, or as it is when the worker exits or the time is up."""
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: self.queue.job(job_id).status in TERMINAL or proc.poll() is not None,
                       timeout=timeout, interval=0.1, message=f"job {job_id} to settle")
        info: JobInfo = self.queue.job(job_id)
        return info

    def stop(self, proc: subprocess.Popen[bytes]) -> int | None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=45)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
            return None

    def finished(self, job_id: int, run: WorkerRun) -> tuple[dict[str, Any] | None, list[str]]:
        """The hunt's report of a job the worker must have run; or the problems."""
        info = self.queue.job(job_id)
        if run.returncode != 0 or info.status != "done" or not isinstance(info.result, dict):
            return None, [f"the worker exited {run.returncode}, the job is {info.status} "
                          f"({(info.last_error or '')[:1500]}); worker stderr:\n{run.stderr[-2500:]}"]
        print(f"hunt: {json.dumps({k: v for k, v in info.result.items() if k != 'direct'})[:3000]}")
        return info.result, []

    def not_run(self, job_id: int, what: str) -> list[str]:
        info = self.queue.job(job_id)
        if info.status == "pending" and info.attempts == 0:
            return []
        return [f"{what}: the job ran anyway ({info.status}, {info.attempts} attempts)"]

    def cli(self, proj: Project, *args: str) -> subprocess.CompletedProcess[str]:
        env = proj.worker_env(self.env, self.data_dir)
        return subprocess.run([*self.cmd, *args], cwd=proj.root, env=env, capture_output=True, text=True,
                              timeout=CLI_SECONDS, check=False, stdin=subprocess.DEVNULL)

    def api_hunt(self, proj: Project, template: str,
                 probe: str | None = None) -> tuple[dict[str, Any], list[str]]:
        """The hunt in Sandbox.create(template=...) made by a process whose cwd
        is the project and whose sys.path holds it and the extra site-packages.
        A template's layer is under the data dir (docs/sandbox-api.md), mounted:
        files there are allowed if they are the warmup's closure."""
        out = self.tmp / f"api-{template}.json"
        env = {"TENANTQ_DATA_DIR": str(self.data_dir), "TENANTQ_POOL_SIZE": "0",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(proj.root), str(proj.extra_site), str(REPO),
                                                           os.environ.get("PYTHONPATH")]))}
        args = {"driver": self.driver, "template": template, "cwd": str(proj.root), "out": str(out),
                "order": proj.order(walk=True, data_dir=self.data_dir), "source": GUEST.read_text(),
                "probe": probe}
        report = host_side.run_host_side("tests.adversarial.code_mounts_host", "hunt", args,
                                         cgroup=self.cgroup, tmp_path=self.tmp, timeout=WORKER_SECONDS,
                                         env=env)
        problems = host_side.show(report)
        saw: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
        hunt = saw.get("report")
        print(f"api hunt: {json.dumps({k: v for k, v in saw.items() if k != 'report'})[:1500]}")
        if not isinstance(hunt, dict):
            problems.append(f"the hunt in the {template} sandbox did not report: {str(saw)[:1500]}")
            return saw, problems
        print(f"api hunt report: {json.dumps({k: v for k, v in hunt.items() if k != 'direct'})[:3000]}")
        layer = in_warm_closure(proj, self.data_dir) if template != "base" else None
        return saw, problems + walked(hunt) + leaks(proj, hunt, layer=layer)

    def template_list(self, proj: Project) -> str:
        return self.cli(proj, "template", "list", "--json").stdout

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        for fh in self.files:
            fh.close()
        for name in self.templates:
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run([*self.cmd, "template", "rm", name], cwd=self.tmp,
                               env={**self.env, "TENANTQ_DATA_DIR": str(self.data_dir)},
                               capture_output=True, timeout=CLI_SECONDS, check=False)


# -- the Sandbox API process ---------------------------------------------------------------


def hunt_attack(host: Host, *, driver: str, template: str, cwd: str, order: dict[str, Any], source: str,
                probe: str | None, out: str) -> None:
    """In `cwd` (the project, on this process's PYTHONPATH with the extra
    site-packages): Sandbox.create(template=...) and the hunt in it; then
    `probe` (python3 -c) if given. Writes what it saw to `out`."""
    os.chdir(cwd)
    host.start_memory()
    sbx = host.create("m1", driver=driver, template=template, ttl_seconds=int(HUNT_SECONDS) + 120,
                      memory_mb=512, timeout_seconds=int(HUNT_SECONDS))
    saw: dict[str, Any] = {}
    run = host.bounded("hunt", lambda: sbx.exec(["python3", "-c", source, json.dumps(order)],
                                                timeout_seconds=HUNT_SECONDS), HUNT_SECONDS + 30)
    if run.ok:
        saw.update(reason=run.value.reason, stderr=run.value.stderr[-2000:])
        with contextlib.suppress(ValueError, IndexError):
            saw["report"] = json.loads(run.value.stdout.strip().splitlines()[-1])
    else:
        saw["error"] = run.describe()
    if probe is not None:
        tried = host.bounded("probe", lambda: sbx.exec(["python3", "-c", probe], timeout_seconds=60), 90)
        saw["probe"] = ({"reason": tried.value.reason, "stdout": tried.value.stdout[-500:],
                         "stderr": tried.value.stderr[-1500:]} if tried.ok else {"error": tried.describe()})
    Path(out).write_text(json.dumps(saw))
    host.check_memory("the hunt")


ATTACKS = {"hunt": hunt_attack}


def child_main(args_file: str, report_file: str) -> None:
    args = json.loads(Path(args_file).read_text())
    Host(Path(report_file)).run(ATTACKS, args)
    sys.stdout.flush()
    sys.stderr.flush()
    killer = threading.Timer(EXIT_SECONDS, lambda: os._exit(EXIT_HUNG))
    killer.daemon = True
    killer.start()
    sys.exit(0)
