"""Egress through real sandboxes (gvisor and process): each batch reaches
only what its tenant allows, through its own proxy, and nothing else: not
the other tenant's hosts, not Postgres, not another batch's proxy. Test
servers listen on 127.0.0.1; the proxy's guard allows exactly 127.0.0.1/32
(Postgres is refused by policy, not by the guard)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tests.apps.net  # noqa: F401  (registers net.* here too: the host applies handler narrowing)
from tenantq import JobSpec, Queue
from tenantq.dispatch.executors.sandboxed import SandboxExecutor
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.egress.config import EgressConfig
from tenantq.egress.tls import TenantCA
from tenantq.observe import metrics
from tenantq.registry import REGISTRY
from tenantq.sandbox.driver import SandboxDriver
from tenantq.secrets import FileSecrets
from tenantq.store.db import Database
from tenantq.testing import wait_until
from tests.acceptance.helpers import query
from tests.egress.servers import Named, serving
from tests.sandbox.conftest import files_containing, processes_mentioning

NET_APP = "tests.apps.net"


@pytest.fixture
def servers() -> Iterator[dict[str, int]]:
    with serving(("alpha", "beta")) as ports:
        yield ports


def _drain(db: Database, driver: SandboxDriver) -> None:
    executor = SandboxExecutor(driver, REGISTRY, NET_APP,
                               egress=EgressConfig(allow_networks=("127.0.0.1/32",)))
    stats = Worker(db, executor, WorkerConfig(concurrency=2, batch_size=5, once=True)).run()
    assert stats.dead == 0 and stats.retried == 0, stats.snapshot()


def test_each_tenant_reaches_only_its_own_hosts(driver: SandboxDriver, db: Database, queue: Queue,
                                                servers: dict[str, int]) -> None:
    alpha, beta = (f"http://127.0.0.1:{servers[n]}/" for n in ("alpha", "beta"))
    queue.set_tenant("tenant-a", egress=f"127.0.0.1:{servers['alpha']}")
    queue.set_tenant("tenant-b", egress=f"127.0.0.1:{servers['beta']}")
    before = metrics.EGRESS_REQUESTS.labels("tenant-a", "blocked")._value.get()
    job_a = queue.enqueue("tenant-a", "net.get", {"urls": [alpha, beta]})
    job_b = queue.enqueue("tenant-b", "net.get", {"urls": [beta, alpha]})
    _drain(db, driver)
    a, b = queue.job(job_a), queue.job(job_b)
    assert a.status == b.status == "done", (a, b)
    assert a.result[0] == {"ok": True, "status": 200, "body": "alpha"}
    assert b.result[0] == {"ok": True, "status": 200, "body": "beta"}
    for refused, host in ((a.result[1], f"127.0.0.1:{servers['beta']}"),
                          (b.result[1], f"127.0.0.1:{servers['alpha']}")):
        assert refused["ok"] is False and refused["status"] == 403, refused
        assert f"{host} is not allowed" in refused["error"], refused
    # visible on the job page, counted on the batch and in the metrics
    assert [blk["host"] for blk in a.egress_blocked] == [f"127.0.0.1:{servers['beta']}"]
    (record,) = query(db, "SELECT egress FROM batches WHERE tenant_id = 'tenant-a'")
    assert record["egress"]["allowed"] == 1 and record["egress"]["blocked"] == 1
    assert record["egress"]["bytes_in"] > 0
    assert metrics.EGRESS_REQUESTS.labels("tenant-a", "blocked")._value.get() == before + 1


def test_no_way_out_but_the_own_proxy(driver: SandboxDriver, db: Database, queue: Queue,
                                      servers: dict[str, int], data_dir: Any) -> None:
    queue.set_tenant("tenant-a", egress=f"127.0.0.1:{servers['alpha']}")
    pg = ("127.0.0.1", 5432)
    job_a = queue.enqueue("tenant-a", "net.direct", {"tcp": [pg, ("127.0.0.1", servers["alpha"])]})
    via_proxy = queue.enqueue("tenant-a", "net.get", {"urls": ["http://127.0.0.1:5432/"]})
    # a tenant without egress: no socket at all; and another sandbox's socket
    # path (host or guest) leads nowhere
    other_socket = str(data_dir / "sandboxes" / driver.name)
    job_none = queue.enqueue("tenant-none", "net.direct", {
        "tcp": [pg], "unix": ["/tenantq/egress/proxy.sock", other_socket]})
    _drain(db, driver)
    direct, none = queue.job(job_a).result, queue.job(job_none).result
    assert not any(v == "connected" for v in direct["tcp"].values()), direct
    assert direct["egress_dir"] == ["proxy.sock"] and direct["proxy_env"].startswith("http://127.0.0.1:")
    proxied = queue.job(via_proxy).result[0]
    assert proxied["status"] == 403 and "127.0.0.1:5432 is not allowed" in proxied["error"], proxied
    assert none["egress_dir"] == [] and none["proxy_env"] is None, none
    assert not any(v == "connected" for v in [*none["tcp"].values(), *none["unix"].values()]), none


def test_a_handler_narrows_its_tenant_policy(driver: SandboxDriver, db: Database, queue: Queue,
                                             servers: dict[str, int]) -> None:
    alpha = f"http://127.0.0.1:{servers['alpha']}/"
    queue.set_tenant("tenant-a", egress=f"127.0.0.1:{servers['alpha']}")
    wide, narrow = queue.enqueue_many([JobSpec("tenant-a", "net.get", {"urls": [alpha]}),
                                       JobSpec("tenant-a", "net.narrowed", {"urls": [alpha]})])
    _drain(db, driver)
    assert queue.job(wide).result[0]["body"] == "alpha"
    refused = queue.job(narrow).result[0]
    assert refused["status"] == 403 and "not allowed for its handler" in refused["error"], refused
    assert [b["host"] for b in queue.job(narrow).egress_blocked] == [f"127.0.0.1:{servers['alpha']}"]


class AuthDigest(Named):
    """Answers with a digest of the Authorization header it got (echoing the
    header itself would carry the secret into the sandbox)."""

    def body(self) -> bytes:
        auth = self.headers.get("Authorization", "")
        return json.dumps({"auth_sha256": hashlib.sha256(auth.encode()).hexdigest()}).encode()


def _memfd_contains(pid: int, needle: bytes) -> bool:
    """gVisor keeps the guest's memory in a memfd of its sentry: read the
    file's data extents (SEEK_DATA/SEEK_HOLE), never faulting holes in (that
    would charge the sandbox's memory cgroup)."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if not os.readlink(fd).startswith("/memfd:"):
                continue
            handle = os.open(fd, os.O_RDONLY)
        except OSError:
            continue
        try:
            size, offset = os.fstat(handle).st_size, 0
            while offset < size:
                try:
                    data = os.lseek(handle, offset, os.SEEK_DATA)
                    hole = os.lseek(handle, data, os.SEEK_HOLE)
                except OSError:
                    break
                position = data
                while position < hole:
                    chunk = os.pread(handle, min(SCAN_CHUNK, hole - position) + len(needle), position)
                    if needle in chunk:
                        return True
                    position += SCAN_CHUNK
                offset = hole
        finally:
            os.close(handle)
    return False


def _memory_contains(pid: int, needle: bytes) -> bool:
    """Does process `pid`'s memory hold `needle`? (root, on the host)"""
    if _memfd_contains(pid, needle):
        return True
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        mem = open(f"/proc/{pid}/mem", "rb", buffering=0)  # noqa: SIM115
    except OSError:
        return False
    with mem:
        for line in maps:
            fields = line.split()
            span, perms = fields[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if "r" not in perms or end - start > MAX_REGION or "memfd:" in line:
                continue
            offset = start
            while offset < end:
                try:
                    mem.seek(offset)
                    chunk = mem.read(min(SCAN_CHUNK, end - offset) + len(needle))
                except (OSError, OverflowError, ValueError):
                    break
                if needle in chunk:
                    return True
                offset += SCAN_CHUNK
    return False


MAX_REGION = 256 << 20


def _with_descendants(roots: set[int]) -> list[int]:
    """The sandbox's processes: those naming its dir (bwrap, runsc) and every
    process below them (the guest Python of the process driver)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parent[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    found = set(roots)
    grew = True
    while grew:
        grown = {pid for pid, ppid in parent.items() if ppid in found} - found
        found |= grown
        grew = bool(grown)
    return sorted(found)
SCAN_CHUNK = 8 << 20


def test_an_injected_secret_never_enters_the_sandbox(
        driver: SandboxDriver, db: Database, queue: Queue, servers: dict[str, int], tmp_path: Path,
        data_dir: Path) -> None:
    secret = f"sk_live_{os.getpid()}_{tmp_path.name[-6:]}_never_inside"
    public = TenantCA(tmp_path / "public", "upstream")  # stands in for the public CAs
    with serving(("stripe",), AuthDigest, tls=public.server_context("127.0.0.1")) as https:
        https_port = https["stripe"]
        secrets_file = tmp_path / "secrets.json"
        secrets_file.write_text(json.dumps({"tenant-a": {"API_KEY": {"value": secret, "inject": {
            "host": f"127.0.0.1:{https_port}", "header": "Authorization", "format": "Bearer {value}"}}}}))
        queue.set_tenant("tenant-a", egress=f"127.0.0.1:{https_port},127.0.0.1:{servers['alpha']}")
        job = queue.enqueue("tenant-a", "net.secret_probe", {
            "stripe": f"https://127.0.0.1:{https_port}/v1/charges",
            "other": f"http://127.0.0.1:{servers['alpha']}/"})
        provider = FileSecrets(secrets_file)  # as `tenantq worker --secrets FILE` wires it
        executor = SandboxExecutor(driver, REGISTRY, NET_APP, secrets=provider,
                                   egress=EgressConfig(allow_networks=("127.0.0.1/32",),
                                                       upstream_ca=str(public.dir / "ca.pem")))
        worker = Worker(db, executor, WorkerConfig(concurrency=1, batch_size=1, once=True),
                        secrets=provider.for_tenant)
        runner = threading.Thread(target=worker.run)
        runner.start()
        try:
            base = data_dir / "sandboxes" / driver.name
            work = wait_until(lambda: next((p / "work" for p in base.glob("tq-*") if (p / "work" / "probed")
                                            .exists()), None), timeout=120, message="the job to be probed")
            sandbox_pids = _with_descendants({pid for pid, _ in processes_mentioning(str(data_dir))})
            assert sandbox_pids, "no sandbox process to scan"
            leaking = [pid for pid in sandbox_pids if _memory_contains(pid, secret.encode())]
            in_files = files_containing(work.parent, [secret])
        finally:
            if work.exists():
                (work / "release").write_text("")
            runner.join(timeout=120)
        assert leaking == [] and in_files == [], (leaking, in_files, queue.job(job))
    info = queue.job(job)
    assert info.status == "done", info.last_error
    result = info.result
    assert result["env_value"].startswith("tenantq-placeholder-API_KEY-") and secret not in json.dumps(result)
    assert result["ctx_value"] == result["env_value"]
    assert result["stripe"]["status"] == 200, result
    expected = hashlib.sha256(f"Bearer {secret}".encode()).hexdigest()
    assert json.loads(result["stripe"]["body"])["auth_sha256"] == expected, "the proxy injected the secret"
    assert result["leak"]["status"] == 403 and "secret API_KEY" in result["leak"]["error"], result
    blocked = queue.job(job).egress_blocked
    assert len(blocked) == 1 and "API_KEY" in blocked[0]["reason"]


def test_a_batch_cannot_use_another_batchs_proxy(driver: SandboxDriver, db: Database, queue: Queue,
                                                 servers: dict[str, int], data_dir: Path) -> None:
    queue.set_tenant("tenant-a", egress=f"127.0.0.1:{servers['alpha']}")
    queue.set_tenant("tenant-b", egress=f"127.0.0.1:{servers['beta']}")
    holding = queue.enqueue("tenant-a", "net.hold")
    executor = SandboxExecutor(driver, REGISTRY, NET_APP,
                               egress=EgressConfig(allow_networks=("127.0.0.1/32",)))
    worker = Worker(db, executor, WorkerConfig(concurrency=2, batch_size=1, poll_seconds=0.1))
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        base = data_dir / "sandboxes" / driver.name
        a_box = wait_until(lambda: next((p for p in base.glob("tq-*") if (p / "work" / "holding").exists()),
                                        None), timeout=120, message="tenant-a's batch to hold its proxy")
        a_socket = a_box / "egress" / "proxy.sock"
        assert a_socket.exists(), "tenant-a's proxy listens while its batch runs"
        probe = queue.enqueue("tenant-b", "net.direct",
                              {"unix": [str(a_socket), "/tenantq/egress/proxy.sock"]})
        wait_until(lambda: queue.job(probe).status == "done", timeout=120, message="tenant-b's probe")
    finally:
        for box in base.glob("tq-*"):
            if (box / "work" / "holding").exists():
                (box / "work" / "release").write_text("")
        wait_until(lambda: queue.job(holding).status == "done", timeout=120, message="the held batch to end")
        worker.stop()
        runner.join(timeout=120)
    result = queue.job(probe).result
    # tenant-a's socket does not exist in tenant-b's sandbox; its own proxy is its own
    assert result["unix"][str(a_socket)].startswith("FileNotFoundError"), result
    assert result["unix"]["/tenantq/egress/proxy.sock"] == "connected"
    assert result["egress_dir"] == ["proxy.sock"]
    assert not a_socket.exists(), "the proxy goes with its batch"
