"""The tenantq runner and batch supervisor are out of a job's reach (rule C1),
the process driver's seccomp filter holds (rule P2), and a tenant without
egress rules has no network at all (docs/sandbox.md, rule E1): one hostile job
tries ptrace, process_vm_readv/writev, pidfd_getfd, kcmp, /proc/PID/mem,
environ and fd of every other process, nested user namespaces, mounts and
the rest of the filtered calls, then every way out to the host's Postgres
and the network, and reports. Its neighbour's jobs run next to it."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.adversarial.harness import Arena

# per other process, what must fail (C1: no signal, no memory, no descriptor)
DENIED_PER_PID = ("ptrace_attach", "ptrace_seize", "process_vm_readv", "process_vm_writev", "kcmp", "mem",
                  "mem_write", "environ", "auxv", "fd_open_0", "fd_open_1", "root_list",
                  "pidfd_getfd_0", "pidfd_getfd_1", "pidfd_getfd_2")
# gVisor lets another uid read these (docs/security.md, rule C1 says so and
# why it is harmless: tenantq's fixed environment, an address layout of a
# process nobody can read or write); the environment's keys are checked below
GVISOR_READABLE = ("environ", "auxv")
# rule P2: what the process driver's filter turns into EPERM
FILTERED_EPERM = ("unshare_user", "unshare_mount_ns", "unshare_net", "mount_tmpfs", "setns_mnt_of_1",
                  "clone_newuser", "clone_newpid", "fsopen", "open_tree", "bpf", "perf_event_open",
                  "userfaultfd", "io_uring_setup", "keyctl", "add_key", "init_module", "finit_module",
                  "kexec_load", "ptrace_traceme")


@pytest.fixture
def host_listeners() -> Iterator[dict[str, Any]]:
    """A TCP port on every host address and an abstract Unix socket, both
    listening on the host: the sandbox must reach neither."""
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))  # servers of tests listen on loopback only
    tcp.listen(8)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"tqadv-host-{uuid.uuid4().hex[:8]}"
    abstract.bind("\0" + name)
    abstract.listen(8)
    try:
        yield {"port": tcp.getsockname()[1], "abstract": "@" + name}
    finally:
        tcp.close()
        abstract.close()


def test_no_reach_into_other_processes_the_kernel_or_the_network(arena: Arena,
                                                                 host_listeners: dict[str, Any]) -> None:
    port = host_listeners["port"]
    # loopback targets only: were a regression to open the network, nothing
    # may leave this machine (the egress guard's refusal of internal and
    # metadata addresses is tested without connecting: tests/unit/test_address_guard.py)
    tcp = [["127.0.0.1", 5432], ["127.0.0.1", port], ["::1", 5432]]
    unix = ["/var/run/postgresql/.s.PGSQL.5432", "/run/postgresql/.s.PGSQL.5432", "/tmp/.s.PGSQL.5432",
            host_listeners["abstract"]]
    arena.neighbour(1)
    probe = arena.attack("adv.probe", {"marker": str(arena.marker.path), "tcp": tcp, "unix": unix})
    arena.sibling(2)
    arena.neighbour(3)
    arena.run("--concurrency", "2", "--batch-size", "2")

    status, _, report, error = arena.outcome(probe)
    arena.expect(status == "done", f"the probe job did not report: {status}, {error[:1500]}")
    if status == "done":
        check_probe(arena, report)
    arena.verdict()


def check_probe(arena: Arena, report: dict[str, Any]) -> None:
    expect = arena.expect
    parent = report["ppid"]
    pids = report["pids"]
    expect(str(parent) in pids and "1" in pids, f"the probe did not see its parent or pid 1: {sorted(pids)}")
    for pid, results in pids.items():
        role = "pid 1 (the runner)" if pid == "1" else \
            "the batch supervisor" if pid == str(parent) else f"pid {pid}"
        if pid not in ("1", str(parent)):
            continue  # other processes of the job's own uid are its own
        for name in DENIED_PER_PID:
            if arena.driver == "gvisor" and name in GVISOR_READABLE:
                continue  # docs/security.md, rule C1: readable under gVisor, and harmless
            outcome = results.get(name, "not tried")
            expect(not outcome.startswith("ok"), f"rule C1: the job could {name} {role}: {outcome}")
        if arena.driver == "gvisor":
            expect(not results["signal_0"].startswith("ok"),
                   f"rule C1 (gvisor): the job may signal {role} (kill(pid, 0): {results['signal_0']})")
    calls = report["syscalls"]
    if arena.driver == "process":
        for name in FILTERED_EPERM:
            outcome = calls.get(name, "not tried")
            expect(outcome.startswith("EPERM"),
                   f"rule P2: {name} must fail with EPERM under the process driver, got {outcome!r}")
        expect(calls["clone3"].startswith("ENOSYS"),
               f"rule P2: clone3 must fail with ENOSYS: {calls['clone3']}")
        expect(calls["unshare_user_then_mount"].startswith("unshare: EPERM"),
               f"a nested user namespace with a mount worked: {calls['unshare_user_then_mount']}")
    for target, outcome in report["net"].items():
        expect(not outcome.startswith("ok"), f"no egress rules, yet the sandbox reached {target}: {outcome}")
    expect(report["interfaces"] == ["lo"], f"network interfaces in the sandbox: {report['interfaces']}")
    expect("proxy.sock" not in report["egress_dir"],
           f"no egress rules, yet an egress proxy socket: /tenantq/egress {report['egress_dir']}")
    for path, outcome in report["files"].items():
        expect(not outcome.startswith("ok"), f"the sandbox read the host's {path}: {outcome}")
    leaked = [k for k in report["environ_keys"] if k.startswith("TENANTQ") or "ACME" in k]
    expect(not leaked, f"the sandbox's environment holds {leaked}")
