"""Rule M1 (docs/security.md): a sandbox sees code, never the host's
configuration or credentials. On both drivers, written from the promise and
the guest-visible surface only (code_mounts_support.py builds the project,
code_mounts_guest.py is the attacker, code_mounts_host.py runs the host side):

1. the queue's sandboxes: the real worker over a throwaway project whose
   top-level package holds, next to its code, every file M1 names
   (settings*.py, a settings/ package, .env*, *.env, secrets.*,
   credentials*, keys, .netrc, .pgpass, .pypirc, pip.conf, the project's
   .git, modules and notes outside the import closure) and a site-packages
   dir on the worker's sys.path holding .pth, sitecustomize.py, pip.conf,
   .env, .git, *.key, *.p12 and .pem files with a private key (one after
   2 MiB of certificates), at the top and deeper. Its handler walks the
   whole filesystem and reads every planted path: nothing planted may be
   read, nor the virtualenv's own .pth files, the unused base site-packages,
   the data dir or the --secrets file; the app's import closure (lazy,
   relative, importlib and namespace-package imports) and the extra package
   (with its CA bundle) must work, byte for byte as on the host;
2. the worker refuses an app whose closure holds a denied file (non-zero
   exit, one line naming it and its importer, no job run); `--sandbox-path`
   naming that very file lets it (and only it) in, naming its directory does
   not; a data directory named by `--sandbox-path` is visible, one holding a
   `.env` is refused (`--sandbox-path` and TENANTQ_SANDBOX_PATHS), symlinks
   in one lead to nothing planted; an edit of the app while the worker
   serves is copied again (a new module) and checked again (a new import of
   settings.py, a new .env);
3. Sandbox API sandboxes: the same hunt in a `base` sandbox made from the
   project's directory, and in one of a template whose warmup is
   `PKG.warm:load` (only that module's closure may be in its layer); a
   warmup that imports the app's settings makes `template create` refuse.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tenantq import Queue
from tests.adversarial.code_mounts_host import (
    CLI_SECONDS,
    REFUSE_SECONDS,
    WORKER_SECONDS,
    Bench,
    refusal_problems,
    walked,
)
from tests.adversarial.code_mounts_support import HELPERS_VALUE, Project, honest_problems, leaks
from tests.adversarial.host import MemoryCgroup
from tests.sandbox.conftest import Leftovers

# docs/security.md M1: "an edit of the app is copied again within 2 s" (and a second for slack)
COPY_SECONDS = 3.0


@pytest.fixture
def m1(driver_name: str, queue: Queue, tenantq_cmd: list[str], cli_env: dict[str, str], data_dir: Path,
       tmp_path: Path, memory_cgroup: MemoryCgroup, leftovers: Leftovers) -> Iterator[Bench]:
    bench = Bench(driver_name, queue, tenantq_cmd, cli_env, data_dir, tmp_path, memory_cgroup)
    try:
        yield bench
    finally:
        bench.cleanup()


# -- 1. the queue's sandboxes ------------------------------------------------------------------


@pytest.mark.timeout(WORKER_SECONDS + 120)
def test_queue_sandbox_sees_the_import_closure_and_no_planted_file(m1: Bench) -> None:
    proj = m1.build()
    job = m1.enqueue(proj, walk=True)
    run = m1.worker(proj)
    report, problems = m1.finished(job, run)
    if report is not None:
        problems += walked(report) + leaks(proj, report) + honest_problems(proj, report)
    assert not problems, f"M1 broken on the {m1.driver} driver:\n- " + "\n- ".join(problems)


# -- 2. refusals and the operator's paths ------------------------------------------------------

REFUSALS: dict[str, dict[str, Any]] = {
    "settings.py imported at the top": {
        "build": {"top_imports": "from PKG import settings  # noqa: F401"},
        "files": ("settings.py",), "importer": "PKG.jobs"},
    "local_settings.py imported inside the handler": {
        "build": {"lazy_imports": "import PKG.local_settings  # noqa: F401"},
        "files": ("local_settings.py",), "importer": "PKG.jobs"},
    "a settings/ package, imported by a lazily imported module": {
        "build": {"helpers_imports": "from PKG.config.settings import base  # noqa: F401"},
        "files": ("config/settings/__init__.py", "config/settings/base.py"), "importer": "PKG.helpers"},
    "credentials*.py by importlib.import_module": {
        "build": {"lazy_imports": 'importlib.import_module("PKG.credentials_store")'},
        "files": ("credentials_store.py",), "importer": "PKG.jobs"},
    "the app's own secrets.py": {
        "build": {"top_imports": "from PKG import secrets as app_secrets  # noqa: F401"},
        "files": ("secrets.py",), "importer": "PKG.jobs"},
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_worker_refuses_an_app_whose_closure_holds_a_denied_file(m1: Bench, case: str) -> None:
    spec = REFUSALS[case]
    proj = m1.build(**spec["build"])
    job = m1.enqueue(proj, walk=False)
    run = m1.worker(proj, timeout=REFUSE_SECONDS)
    files = tuple(proj.path(f) for f in spec["files"])
    importer = str(spec["importer"]).replace("PKG", proj.pkg)
    problems = refusal_problems(f"worker ({case})", run.returncode, run.stderr, files, importer)
    problems += m1.not_run(job, f"worker ({case})")
    assert not problems, "\n- ".join(["M1 refusal broken:", *problems])


@pytest.mark.timeout(WORKER_SECONDS + 60)
def test_sandbox_path_naming_the_denied_file_lets_in_that_file_only(m1: Bench) -> None:
    proj = m1.build(top_imports="from PKG import settings  # noqa: F401")
    settings = proj.path("settings.py")
    job = m1.enqueue(proj, walk=False, visible=[settings])
    run = m1.worker(proj, "--sandbox-path", str(settings))
    report, problems = m1.finished(job, run)
    if report is not None:
        problems += leaks(proj, report, allowed=(settings,)) + honest_problems(proj, report)
        token = next(t for t, p in proj.secret.items() if p.path == settings)
        if token not in report["direct"].get(str(settings), {}).get("tokens", []):
            problems.append(f"--sandbox-path {settings}: the file is not readable in the sandbox: "
                            f"{report['direct'].get(str(settings))}")
    assert not problems, "\n- ".join(["--sandbox-path FILE:", *problems])


def test_sandbox_path_naming_the_directory_that_holds_it_is_not_enough(m1: Bench) -> None:
    # only the one denied file in the app tree: the refusal can name nothing else
    proj = m1.build(top_imports="from PKG import settings  # noqa: F401", plant_app=False,
                    extra_files=("settings.py",))
    settings = proj.path("settings.py")
    job = m1.enqueue(proj, walk=False)
    problems: list[str] = []
    for directory in (settings.parent, proj.root):
        run = m1.worker(proj, "--sandbox-path", str(directory), timeout=REFUSE_SECONDS)
        problems += refusal_problems(f"worker --sandbox-path {directory}", run.returncode, run.stderr,
                                     settings, None)
    problems += m1.not_run(job, "worker --sandbox-path DIR")
    assert not problems, "\n- ".join(["--sandbox-path DIR holding the denied file:", *problems])


@pytest.mark.timeout(WORKER_SECONDS + 60)
def test_sandbox_path_data_directory_is_visible_and_one_with_a_dotenv_is_refused(m1: Bench) -> None:
    proj = m1.build()
    data = proj.root / "data"
    table = proj.plant(data / "table.csv", "data: table.csv", "id,value\n1,TOKEN\n", visible=True)
    rows = proj.plant(data / "nested" / "rows.json", "data: nested/rows.json", '{"v": "TOKEN"}', visible=True)
    bad = proj.tmp / "databad"
    dotenv = proj.plant(bad / ".env", "data dir: .env")
    (bad / "rows.csv").write_text("id\n1\n")
    for d in (data, data / "nested", bad):
        d.chmod(0o755)
    job = m1.enqueue(proj, walk=False, visible=[table.path, rows.path])
    run = m1.worker(proj, "--sandbox-path", str(data))
    report, problems = m1.finished(job, run)
    if report is not None:
        problems += leaks(proj, report) + honest_problems(proj, report)
    second = m1.enqueue(proj, walk=False)
    for how, extra, env in (
        ("--sandbox-path", ["--sandbox-path", str(bad)], None),
        ("TENANTQ_SANDBOX_PATHS", [], {"TENANTQ_SANDBOX_PATHS": f"{data},{bad}"}),
    ):
        refused = m1.worker(proj, *extra, env=env, timeout=REFUSE_SECONDS)
        problems += refusal_problems(f"worker with {how} {bad}", refused.returncode, refused.stderr,
                                     dotenv.path, None)
    problems += m1.not_run(second, "a data dir holding a .env")
    assert not problems, "\n- ".join(["--sandbox-path DATA_DIR:", *problems])


def test_symlinks_in_a_sandbox_path_lead_to_no_secret(m1: Bench) -> None:
    """A data dir named by --sandbox-path holding symlinks (absolute and
    relative) to the app's .env, to the worker's --secrets file, to the app's
    package and to the host config dir: the worker may refuse (one line), or
    run, and then no read through them gives anything planted."""
    proj = m1.build()
    data = proj.root / "linked"
    table = proj.plant(data / "table.csv", "data: table.csv", "id,value\n1,TOKEN\n", visible=True)
    data.chmod(0o755)
    links = {"abs-env.csv": proj.path(".env"), "rel-env.csv": Path("..") / proj.pkg / ".env",
             "tenants.json": proj.secrets_file, "pkg": proj.root / proj.pkg,
             "hostcfg": proj.secrets_file.parent}
    for name, target in links.items():
        (data / name).symlink_to(target)
    follow = [data / "abs-env.csv", data / "rel-env.csv", data / "tenants.json", data / "pkg" / ".env",
              data / "pkg" / "settings.py", data / "pkg" / "server.key", data / "hostcfg" / "tenants.json"]
    job = m1.enqueue(proj, walk=False, visible=[table.path], follow=follow)
    run = m1.worker(proj, "--sandbox-path", str(data))
    if run.returncode != 0:  # refusing keeps them out too: then cleanly
        named = (*(data / n for n in links), *links.values(), *(p.path for p in proj.secret.values()))
        problems = refusal_problems("worker --sandbox-path DIR with symlinks", run.returncode, run.stderr,
                                    named, None) + m1.not_run(job, "worker --sandbox-path DIR with symlinks")
    else:
        report, problems = m1.finished(job, run)
        if report is not None:
            problems += leaks(proj, report) + honest_problems(proj, report)
    assert not problems, "\n- ".join(["--sandbox-path DIR holding symlinks to secrets:", *problems])


def after_edit(m1: Bench, proj: Project, proc: Any, edited: float, **order: Any) -> list[tuple[float, Any]]:
    """Jobs one after another until one enqueued COPY_SECONDS after the edit
    has settled (or the worker is gone): (seconds after the edit, JobInfo)."""
    seen: list[tuple[float, Any]] = []
    while proc.poll() is None and len(seen) < 30:
        enqueued = time.monotonic() - edited
        seen.append((enqueued, m1.settle(m1.enqueue(proj, walk=False, **order), proc, WORKER_SECONDS)))
        if enqueued >= COPY_SECONDS:
            break
    return seen


@pytest.mark.timeout(2 * WORKER_SECONDS + 60)
def test_an_edit_of_the_app_is_copied_again_and_checked_again(m1: Bench) -> None:
    """A serving worker. Edit 1: a new module, imported lazily by jobs.py (and
    a late.env beside it): jobs enqueued 3 s later import it and see no
    late.env. Edit 2: jobs.py imports settings.py at the top: from then on no
    job sees settings.py, whatever the worker does about it (refuse and exit,
    keep the old copy, fail the batches)."""
    proj = m1.build()
    proc, log = m1.start(proj)
    jobs, newmod = proj.path("jobs.py"), proj.path("newmod.py")
    first = m1.settle(m1.enqueue(proj, walk=False), proc, WORKER_SECONDS)
    problems = [] if first.status == "done" else [
        f"before any edit, the job is {first.status}: {(first.last_error or '')[:800]}\n"
        f"{log.read_text()[-2000:]}"]
    new = proj.plant(newmod, "edit 1: newmod.py", "VALUE = 'TOKEN'\n", visible=True)
    proj.plant(proj.path("late.env"), "edit 1: late.env, planted beside the code while the worker serves")
    lazy = f"    from {proj.pkg} import newmod  # noqa: F401\n"
    jobs.write_text(jobs.read_text().replace("    pass\n", lazy, 1))
    edit1 = after_edit(m1, proj, proc, time.monotonic(), visible=[newmod])
    last_after, last = edit1[-1] if edit1 else (0.0, None)
    if last is None or last_after < COPY_SECONDS or new.token not in json.dumps(last.result):
        status, error = (last.status, (last.last_error or "")[:800]) if last is not None else (None, "")
        problems.append(f"edit 1: a job enqueued {last_after:.1f} s after the edit did not import the new "
                        f"module: {status} {error}")
    top = f"from {proj.pkg} import hunt\n"
    jobs.write_text(jobs.read_text().replace(top, f"{top}from {proj.pkg} import settings  # noqa: F401\n", 1))
    seen = [(-1.0, first), *edit1, *after_edit(m1, proj, proc, time.monotonic())]
    for after, info in seen:
        if isinstance(info.result, dict):
            problems += [f"job {info.id} ({after:.1f} s after an edit): {p}"
                         for p in leaks(proj, info.result)]
        text = (info.last_error or "") + json.dumps(info.result)
        problems += [f"job {info.id}: {p.label} in its error or result"
                     for t, p in proj.secret.items() if t in text]
    code = m1.stop(proc)
    text = log.read_text(errors="replace")
    print("\n".join(f"{after:5.1f} s after an edit: job {i.id} {i.status} {(i.last_error or '')[:150]!r}"
                    for after, i in seen) + f"\nworker exit {code}; log tail:\n{text[-1500:]}")
    if "Traceback" in text:
        problems.append(f"a traceback in the worker log:\n{text[-2500:]}")
    assert not problems, "\n- ".join(["an edit of the app while the worker serves:", *problems])


# -- 3. Sandbox API sandboxes and templates ------------------------------------------------------


@pytest.mark.timeout(WORKER_SECONDS + 60)
def test_api_sandbox_sees_no_planted_file(m1: Bench) -> None:
    proj = m1.build()
    _, problems = m1.api_hunt(proj, "base")
    assert not problems, f"M1 broken in a Sandbox API sandbox ({m1.driver}):\n- " + "\n- ".join(problems)


PROBE = """
import importlib, json
out = {}
import PKG.warm
out["load"] = PKG.warm.load()
for name in ("PKG.dynmod", "PKG.jobs", "PKG.unused_module", "PKG.settings"):
    try:
        importlib.import_module(name)
        out[name] = "imported"
    except Exception as exc:
        out[name] = type(exc).__name__
print(json.dumps(out))
"""


@pytest.mark.timeout(CLI_SECONDS + WORKER_SECONDS + 60)
def test_template_layer_holds_only_the_warmup_closure(m1: Bench) -> None:
    proj = m1.build()
    name = f"m1-{uuid.uuid4().hex[:8]}"
    m1.templates.append(name)
    made = m1.cli(proj, "template", "create", name, "--warmup", f"{proj.pkg}.warm:load",
                  "--sandbox", m1.driver)
    assert made.returncode == 0, f"template create: {made.stdout} {made.stderr}"
    saw, problems = m1.api_hunt(proj, name, probe=PROBE.replace("PKG", proj.pkg))
    probe = saw.get("probe", {})
    try:
        got = json.loads(probe.get("stdout", "").strip().splitlines()[-1])
    except (ValueError, IndexError):
        got = None
    if not isinstance(got, dict) or got.get("load") != HELPERS_VALUE:
        problems.append(f"the warmup's closure does not work in the template's sandbox: {probe}")
    else:
        for module, outcome in got.items():
            if module != "load" and outcome == "imported":
                problems.append(f"{module}, outside the warmup's import closure, is in the template's layer")
    assert not problems, f"M1 broken in a template's sandbox ({m1.driver}):\n- " + "\n- ".join(problems)


def test_template_create_refuses_a_warmup_that_imports_settings(m1: Bench) -> None:
    proj = m1.build(warm_imports="from PKG import settings  # noqa: F401")
    name = f"m1-{uuid.uuid4().hex[:8]}"
    m1.templates.append(name)
    made = m1.cli(proj, "template", "create", name, "--warmup", f"{proj.pkg}.warm:load",
                  "--sandbox", m1.driver)
    problems = refusal_problems("template create", made.returncode, made.stdout + made.stderr,
                                proj.path("settings.py"), f"{proj.pkg}.warm")
    if name in m1.template_list(proj):
        problems.append(f"template create refused (or should have), yet `template list` shows {name}")
    assert not problems, "\n- ".join(["template create with a warmup importing settings:", *problems])
