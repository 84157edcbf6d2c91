"""Rules C1, P2 and E1: other processes, filtered system calls, the network; and H2/H5:
killing and stopping what runs the job."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
from typing import Any

import tenantq
from tests.adversarial.attacks.tools import (
    CANARY,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    PTRACE_ATTACH,
    PTRACE_DETACH,
    PTRACE_SEIZE,
    RESULT_FD,
    SYS,
    attempt,
    errname,
    head,
    in_child,
    libc,
    pids,
    syscall,
)

# -- C1 / P2: other processes, system calls, namespaces, the network --------------------


def _iovec(address: int, length: int) -> ctypes.Array[Any]:
    arr = (ctypes.c_void_p * 2)()
    arr[0] = address
    arr[1] = length
    return arr


@tenantq.handler("adv.probe", timeout=30, memory_mb=256)
def probe(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    me, parent = os.getpid(), os.getppid()
    targets = sorted({1, parent, *[p for p in pids() if p != me]})
    out: dict[str, Any] = {"pid": me, "ppid": parent, "uid": os.getuid(), "targets": targets}
    # addresses valid in the parent too: the job is forked from it
    remote = id(sys.modules)
    canary = ctypes.c_char_p(CANARY)
    canary_address = ctypes.cast(canary, ctypes.c_void_p).value or 0
    local = ctypes.create_string_buffer(64)
    per_pid: dict[str, dict[str, str]] = {}
    for pid in targets:
        r: dict[str, str] = {}
        r["ptrace_attach"] = syscall("ptrace", PTRACE_ATTACH, pid, 0, 0)
        if r["ptrace_attach"].startswith("ok"):
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, 0x40000000)  # __WALL
            syscall("ptrace", PTRACE_DETACH, pid, 0, 0)
        r["ptrace_seize"] = syscall("ptrace", PTRACE_SEIZE, pid, 0, 0)
        if r["ptrace_seize"].startswith("ok"):
            syscall("ptrace", PTRACE_DETACH, pid, 0, 0)
        local_iov = _iovec(ctypes.addressof(local), 64)
        r["process_vm_readv"] = syscall("process_vm_readv", pid, local_iov, 1, _iovec(remote, 64), 1, 0)
        same = ctypes.create_string_buffer(CANARY)
        r["process_vm_writev"] = syscall("process_vm_writev", pid,
                                         _iovec(ctypes.addressof(same), len(CANARY)), 1,
                                         _iovec(canary_address, len(CANARY)), 1, 0)
        r["kcmp"] = syscall("kcmp", me, pid, 0, 1, 1)
        pidfd = syscall("pidfd_open", pid, 0)
        r["pidfd_open"] = pidfd
        if pidfd.startswith("ok: "):
            number = int(pidfd[4:])
            for target_fd in (0, 1, 2):
                r[f"pidfd_getfd_{target_fd}"] = syscall("pidfd_getfd", number, target_fd, 0)
            os.close(number)

        def read_mem(pid: int = pid) -> int:
            fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
            try:
                return len(os.pread(fd, 64, remote))
            finally:
                os.close(fd)

        r["mem"] = attempt(read_mem)
        r["mem_write"] = attempt(lambda pid=pid: os.close(os.open(f"/proc/{pid}/mem", os.O_WRONLY)))
        for name in ("environ", "auxv", "maps", "syscall", "stack", "pagemap", "personality"):
            r[name] = attempt(lambda pid=pid, name=name: head(f"/proc/{pid}/{name}", 120))
        r["fd_list"] = attempt(lambda pid=pid: len(os.listdir(f"/proc/{pid}/fd")))
        r["fd_open_1"] = attempt(lambda pid=pid: os.close(os.open(f"/proc/{pid}/fd/1", os.O_WRONLY)))
        r["fd_open_0"] = attempt(lambda pid=pid: os.close(os.open(f"/proc/{pid}/fd/0", os.O_RDONLY)))
        r["root_list"] = attempt(lambda pid=pid: len(os.listdir(f"/proc/{pid}/root/")))
        r["signal_0"] = attempt(lambda pid=pid: os.kill(pid, 0))
        per_pid[str(pid)] = r
    out["pids"] = per_pid
    # namespaces and the rest of what P2 filters (each in a child of its own)
    sc: dict[str, str] = {}
    sc["unshare_user"] = in_child(lambda: syscall("unshare", CLONE_NEWUSER))
    sc["unshare_user_then_mount"] = in_child(_userns_mount)
    sc["unshare_mount_ns"] = in_child(lambda: syscall("unshare", CLONE_NEWNS))
    sc["unshare_net"] = in_child(lambda: syscall("unshare", CLONE_NEWNET))
    sc["mount_tmpfs"] = in_child(lambda: _mount("/tmp"))
    sc["setns_mnt_of_1"] = in_child(_setns_to_init)
    sc["clone_newuser"] = in_child(lambda: _raw_clone(CLONE_NEWUSER | signal.SIGCHLD))
    sc["clone_newpid"] = in_child(lambda: _raw_clone(CLONE_NEWPID | signal.SIGCHLD))
    sc["clone3"] = in_child(lambda: syscall("clone3", 0, 0))
    sc["fsopen"] = syscall("fsopen", ctypes.c_char_p(b"tmpfs"), 0)
    sc["open_tree"] = syscall("open_tree", -100, ctypes.c_char_p(b"/"), 1)  # OPEN_TREE_CLONE
    sc["bpf"] = syscall("bpf", 0, 0, 0)
    sc["perf_event_open"] = syscall("perf_event_open", 0, 0, -1, -1, 0)
    sc["userfaultfd"] = syscall("userfaultfd", 0)
    sc["io_uring_setup"] = syscall("io_uring_setup", 1, 0)
    sc["keyctl"] = syscall("keyctl", 0, -3, 0)  # KEYCTL_GET_KEYRING_ID of the session keyring
    sc["add_key"] = syscall("add_key", ctypes.c_char_p(b"user"), ctypes.c_char_p(b"mallory"),
                            ctypes.c_char_p(b"x"), 1, -3)
    sc["init_module"] = syscall("init_module", 0, 0, ctypes.c_char_p(b""))
    sc["finit_module"] = syscall("finit_module", -1, ctypes.c_char_p(b""), 0)
    sc["kexec_load"] = syscall("kexec_load", 0, 0, 0, 0)
    sc["ptrace_traceme"] = in_child(lambda: syscall("ptrace", 0, 0, 0, 0))
    out["syscalls"] = sc
    # the network: no egress rules means no network at all
    net: dict[str, str] = {}
    for host, port in payload.get("tcp", []):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        net[f"tcp {host}:{port}"] = attempt(lambda h=host, p=port, f=family: _connect(f, (h, int(p))))
    for path in payload.get("unix", []):
        address = "\0" + path[1:] if path.startswith("@") else path
        net[f"unix {path}"] = attempt(lambda a=address: _connect(socket.AF_UNIX, a))
    net["udp 8.8.8.8:53"] = attempt(lambda: _udp(("8.8.8.8", 53)))
    out["interfaces"] = [name for _, name in socket.if_nameindex()]
    out["egress_dir"] = attempt(lambda: sorted(os.listdir("/tenantq/egress")))
    out["net"] = net
    # the host's files, by every path an attacker can think of
    marker = payload["marker"]
    out["files"] = {p: attempt(lambda p=p: head(p)) for p in
                    (marker, f"/proc/1/root{marker}", f"/proc/{parent}/root{marker}",
                     f"/proc/self/cwd{marker}", "/etc/shadow", "/root/.bash_history", "/var/run/postgresql")}
    out["environ_keys"] = sorted(os.environ)
    return out


def _connect(family: int, address: Any) -> str:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(3)
    try:
        sock.connect(address)
        return "CONNECTED"
    finally:
        sock.close()


def _udp(address: tuple[str, int]) -> int:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        return sock.sendto(b"mallory", address)
    finally:
        sock.close()


def _mount(target: str) -> str:
    lib = libc()
    res = lib.mount(b"none", target.encode(), b"tmpfs", 0, None)
    return "ok" if res == 0 else errname(ctypes.get_errno())


def _userns_mount() -> str:
    first = syscall("unshare", CLONE_NEWUSER | CLONE_NEWNS)
    if not first.startswith("ok"):
        return f"unshare: {first}"
    return f"unshare: ok; mount: {_mount('/tmp')}"


def _setns_to_init() -> str:
    """setns into the runner's mount namespace, else (its ns files are not
    ours to open) into our own: the call itself must be refused."""
    for path in ("/proc/1/ns/mnt", "/proc/self/ns/mnt"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        return syscall("setns", fd, 0)
    return "open: no namespace file could be opened"


def _raw_clone(flags: int) -> str:
    lib = libc()
    lib.syscall.restype = ctypes.c_long
    ctypes.set_errno(0)
    res = lib.syscall(ctypes.c_long(SYS["clone"]), ctypes.c_long(flags), ctypes.c_long(0), ctypes.c_long(0),
                       ctypes.c_long(0), ctypes.c_long(0))
    if res == 0:
        os._exit(0)  # the clone itself: gone at once
    if res == -1:
        return errname(ctypes.get_errno())
    with contextlib.suppress(ChildProcessError):
        os.waitpid(res, 0)
    return f"ok: {res}"


# -- H2 / C1: killing and stopping what runs the job ----------------------------------------


@tenantq.handler("adv.kill", timeout=2, memory_mb=128)
def kill(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    variant = payload["variant"]
    parent = os.getppid()
    print(f"attempt {ctx.attempt}/{ctx.max_attempts}: {variant} (pid {os.getpid()}, parent {parent})",
          flush=True)
    targets = {"kill_parent": (parent, signal.SIGKILL), "kill_init": (1, signal.SIGKILL),
               "kill_all": (-1, signal.SIGKILL), "stop_parent": (parent, signal.SIGSTOP),
               "stop_all": (-1, signal.SIGSTOP), "term_init": (1, signal.SIGTERM),
               "kill_self": (os.getpid(), signal.SIGKILL), "stop_init": (1, signal.SIGSTOP),
               "stop_self": (os.getpid(), signal.SIGSTOP)}
    if variant in targets:
        pid, signum = targets[variant]
        outcome = attempt(lambda: os.kill(pid, signum))
        print(f"kill({pid}, {signum.name}): {outcome}", flush=True)
        if variant.startswith("stop") and outcome == "ok":
            time.sleep(0.2)
        return {"variant": variant, "kill": outcome, "parent_after": os.getppid(), "alive": True}
    if variant == "segfault":
        ctypes.string_at(0)
    if variant == "exit_silently":
        os._exit(0)
    if variant == "block_and_spin":
        signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP})
        while True:
            pass
    if variant == "close_result_and_hang":
        os.close(RESULT_FD)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        while True:
            time.sleep(1)
    raise ValueError(variant)
