"""tenantq.contrib.django, for real: a Django project (tests/apps/djsite)
with the contrib app installed, on the test server, its tables in a schema
of this module's own (OPTIONS `-c search_path=...`) and tenantq's in
another (TENANTQ_SCHEMA). Django's settings are process-wide, so
everything Django does runs in child Pythons (`python -m django ...` with
DJANGO_SETTINGS_MODULE, or tests/apps/djsite/scenarios.py); this process
checks what they committed. TENANTQ_DATABASE_URL is unset in the children
unless a test sets it: tenantq's database is Django's DATABASES["default"]."""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql
from psycopg.conninfo import conninfo_to_dict

from tenantq.testing import wait_until
from tests.conftest import ROOT
from tests.examples.helpers import Processes, rows

pytest.importorskip("django")

SCENARIO = "from tests.apps.djsite.scenarios import main; main()"


@dataclass
class Site:
    server_dsn: str
    tq_schema: str
    app_schema: str
    env: dict[str, str]  # the children's: no TENANTQ_DATABASE_URL
    procs: Processes

    def django(self, *args: str, env: dict[str, str] | None = None, timeout: float = 60.0
               ) -> Any:
        return self.procs.run([sys.executable, "-W", "error", "-m", "django", *args], cwd=ROOT,
                              env=env or self.env, timeout=timeout)

    def scenario(self, name: str, **kwargs: Any) -> dict[str, Any]:
        ran = self.procs.run([sys.executable, "-W", "error", "-c", SCENARIO, name, json.dumps(kwargs)],
                             cwd=ROOT, env=self.env, timeout=90)
        assert ran.returncode == 0, f"scenario {name} failed:\n{ran.stderr[-4000:]}"
        result: dict[str, Any] = json.loads(ran.stdout.strip().splitlines()[-1])
        return result

    def job(self, job_id: int) -> dict[str, Any] | None:
        found = rows(self.server_dsn, f'SELECT status, result, last_error FROM "{self.tq_schema}".jobs '
                                      "WHERE id = %s", [job_id])
        return found[0] if found else None

    def jobs(self, tenant: str) -> list[int]:
        found = rows(self.server_dsn, f'SELECT id FROM "{self.tq_schema}".jobs WHERE tenant_id = %s '
                                      "ORDER BY id", [tenant])
        return [int(r["id"]) for r in found]

    def notes(self, tenant: str) -> list[dict[str, Any]]:
        return rows(self.server_dsn, f'SELECT id, text, job, stamped_by FROM "{self.app_schema}".djsite_note '
                                     "WHERE tenant = %s ORDER BY id", [tenant])


def _drop(dsn: str, *names: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in names:
            conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(pgsql.Identifier(name)))


@pytest.fixture(scope="module")
def site(server_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    tag = uuid.uuid4().hex[:10]
    tq_schema, app_schema = f"tq_djc_{tag}", f"app_djc_{tag}"
    tmp = tmp_path_factory.mktemp("contrib_django")
    procs = Processes(tmp)
    env = {k: v for k, v in os.environ.items() if k not in ("TENANTQ_DATABASE_URL", "PYTEST_ADDOPTS")}
    env.update({"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
                "DJANGO_SETTINGS_MODULE": "tests.apps.djsite.settings", "DJSITE_DSN": server_dsn,
                "DJSITE_SCHEMA": app_schema, "TENANTQ_SCHEMA": tq_schema,
                # were the DSN not taken from DATABASES, no embedded server outside this directory
                "TENANTQ_DATA_DIR": str(tmp / "data")})
    try:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(pgsql.SQL("CREATE SCHEMA {}").format(pgsql.Identifier(app_schema)))
        site = Site(server_dsn, tq_schema, app_schema, env, procs)
        migrated = site.django("migrate", "--no-input")
        assert migrated.returncode == 0, migrated.stderr[-4000:]
        yield site
    finally:
        procs.cleanup()
        _drop(server_dsn, tq_schema, app_schema)


def _tenant() -> str:
    return f"djc-{uuid.uuid4().hex[:8]}"


def test_tenantq_migrate_creates_tenantqs_tables_in_djangos_database(site: Site) -> None:
    for _ in range(2):  # idempotent
        ran = site.django("tenantq_migrate")
        assert ran.returncode == 0, ran.stderr[-4000:]
        assert ran.stdout.strip(), "it prints what it did"
    tables = rows(site.server_dsn, "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                  [site.tq_schema])
    assert {"jobs", "wakes"} <= {t["table_name"] for t in tables}


@pytest.fixture
def migrated(site: Site) -> Site:
    ran = site.django("tenantq_migrate")
    assert ran.returncode == 0, ran.stderr[-4000:]
    return site


def test_a_job_enqueued_in_a_django_transaction_runs_under_manage_py_tenantq_worker(migrated: Site) -> None:
    site, tenant = migrated, _tenant()
    done = site.scenario("enqueue", tenant=tenant)
    kept, dropped = done["kept"], done["dropped"]
    # committed together; the rolled-back block left neither its note nor its job
    assert [(n["id"], n["text"], n["job"]) for n in site.notes(tenant)] == [(kept["note_id"], "kept",
                                                                             kept["job_id"])]
    assert dropped["rolled_back"] and site.jobs(tenant) == [kept["job_id"]]

    argv = ["tenantq_worker", "--sandbox", "inline", "--concurrency", "1", "--poll-seconds", "0.2"]
    worker = site.procs.start("worker", [sys.executable, "-W", "error", "-m", "django", *argv],
                              cwd=ROOT, env=site.env)
    try:
        def ended() -> dict[str, Any] | None:
            if worker.poll() is not None:
                pytest.fail(f"the worker exited with {worker.returncode}\n{site.procs.log(worker)}")
            job = site.job(kept["job_id"])
            return job if job and job["status"] in ("done", "dead") else None

        job = wait_until(ended, timeout=60, interval=0.05, message="the job to end")
    finally:
        assert site.procs.stop(worker) == 0, site.procs.log(worker)
    assert job["status"] == "done", (job, site.procs.log(worker))
    # the handler ran on Django's connection (the app's search_path), through the ORM
    assert job["result"] == {"note_id": kept["note_id"], "text": "kept", "search_path": site.app_schema}
    assert site.notes(tenant)[0]["stamped_by"] == kept["job_id"]
    assert json.loads(site.procs.log(worker).strip().splitlines()[-1])["done"] >= 1


def test_call_command_runs_the_worker_in_process(migrated: Site) -> None:
    tenant = _tenant()
    done = migrated.scenario("call_command_once", tenant=tenant)
    assert (done["status"], done["stamped_by"]) == ("done", done["job_id"])
    assert done["result"]["text"] == "in-process"


def test_the_dsn_is_djangos_database_unless_tenantq_database_url_is_set(site: Site) -> None:
    server = conninfo_to_dict(site.server_dsn)
    derived = site.scenario("dsn")
    params = conninfo_to_dict(derived["django_dsn"])
    assert derived["database_url"] == derived["django_dsn"]
    for key in ("dbname", "user", "host", "port", "password"):
        assert str(params.get(key) or "") == str(server.get(key) or ""), key
    assert params["options"] == f"-c search_path={site.app_schema}"

    elsewhere = "postgresql://someone@elsewhere.invalid:5433/other"
    site.env["TENANTQ_DATABASE_URL"] = elsewhere
    try:
        overridden = site.scenario("dsn")
    finally:
        del site.env["TENANTQ_DATABASE_URL"]
    assert overridden == {"django_dsn": derived["django_dsn"], "database_url": elsewhere}

    # the worker takes DATABASES: a port nothing listens on is the port it fails on
    broken = site.django("tenantq_worker", "--once", "--sandbox", "inline",
                         env={**site.env, "DJSITE_PORT": "1"})
    assert broken.returncode != 0
    last = broken.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot connect to Postgres at ") and ":1 " in last, broken.stderr[-3000:]


def test_the_worker_command_takes_the_workers_options_and_reports_errors_in_one_line(site: Site) -> None:
    help_ = site.django("tenantq_worker", "--help")
    assert help_.returncode == 0, help_.stderr
    assert "Usage: python -m django tenantq_worker [OPTIONS]" in help_.stdout
    assert "--concurrency" in help_.stdout and "--once" in help_.stdout

    bad = site.django("tenantq_worker", "--concurrency", "0")
    assert bad.returncode != 0
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "--concurrency" in last, bad.stderr[-3000:]
