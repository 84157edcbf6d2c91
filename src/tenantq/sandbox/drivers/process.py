"""The process driver, for hosts without runsc: each run is a subprocess in
fresh namespaces (bubblewrap: user, pid, net, ipc, uts, mount), with a
read-only view of /usr, the Python installation and the app, a private
tmpfs /tmp, the work dir read-write, uid 65534 inside, and cgroup limits
(memory, pids, CPU) on the host. Weaker than gVisor: the job's system calls
reach the host kernel.

A Sandbox API sandbox (spec.writable_root) writes to one writable layer
instead: a tmpfs with a size and an inode count (`writable_layer`: half of
memory_mb, one inode per 4 KiB), whose `root/` is the sandbox's `/` (so
`/tmp`, `/work`, `/tenantq/work` are directories on it) and whose `shm/` is
its `/dev/shm`. Every write anywhere gets ENOSPC at the quota, and `statvfs`
of any of those paths shows it. It is mounted in a mount namespace of the
sandbox's own, just before bwrap (LAYER_SETUP): no host path ever shows the
guest's files, and it goes with the sandbox's last process, whoever ends it.

The guest runner exits when its stdin pipe from the dispatcher reaches EOF
(the dispatcher died), and bwrap with it; other commands run under `timeout
-s KILL <ttl>`; the reaper kills whatever is left in the sandbox's cgroup past
its deadline. (Not `--die-with-parent`: that follows the *thread* that
started bwrap, and a kept-warm sandbox outlives the worker slot that made it.)

What it adds for a hostile job (docs/security.md, rule P2): a seccomp filter
(sandbox/drivers/seccomp.py: no ptrace or process_vm_*, no namespaces or mounts),
`--disable-userns` (no nested user namespace, even if the filter had a
gap), and `--as-pid-1` so the guest runner is the sandbox's init: no bwrap
process inside holds the control channel's pipes. Jobs share the runner's
uid here; the runner and supervisor are non-dumpable, which on Linux keeps
a same-uid process from ptracing them or reopening their fds via /proc.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

from tenantq.sandbox import cgroups
from tenantq.sandbox.cgroups import CgroupBox
from tenantq.sandbox.driver import GUEST_WORK_DIR
from tenantq.sandbox.drivers import seccomp
from tenantq.sandbox.hostside import (
    HostProcess,
    HostSandbox,
    expired_dirs,
    spec_from_meta,
    start_process,
    unmount_work_dir,
)
from tenantq.sandbox.layout import (
    API_DIRS,
    GUEST_EGRESS_DIR,
    GUEST_GID,
    GUEST_UID,
    build_skeleton,
    check_mounts,
    new_sandbox_dir,
)
from tenantq.sandbox.spec import SandboxSpec

PROCESS_MAX_PIDS = 64
# An API sandbox's writable layer holds at most memory_mb // LAYER_SHARE MiB
# in files and one file (inode) per LAYER_BYTES_PER_INODE bytes of that.
# Its pages and inodes are charged to the sandbox's memory cgroup and outlive
# the process that wrote them (killing it frees nothing), so the layer must
# stay well below the limit: full, it pins at most half the limit in pages
# plus the inodes' kernel memory (measured: 0.6 KiB for an empty file, 1.4
# KiB for a directory with a 255-byte name; under a fifth of the limit). The
# rest stays for processes: at the limit the kernel kills the largest, which
# frees its memory, and the agent goes on.
# (bwrap's own --tmpfs takes a size but no inode count: an empty-file bomb
# there pins kernel memory until the memory cgroup kills the agent.)
LAYER_SHARE = 2
LAYER_BYTES_PER_INODE = 4096
# its mount point, an empty dir in the sandbox's host-only directory
LAYER_DIR = "layer"
# Run by the sandbox's first host process, in the sandbox's cgroups, after
# `unshare --mount` (a private mount namespace that only it, bwrap and the
# sandbox share): mount the layer ($1 options, $2 name, $3 mount point) and
# make its two directories, then become bwrap. Nothing of the guest exists
# yet, and bwrap binds those directories by paths the guest never sees.
LAYER_SETUP = 'mount -t tmpfs -o "$1" "$2" "$3" && mkdir -m 0755 "$3/root" && mkdir -m 1777 "$3/shm" ' \
              '|| exit 125; shift 3; exec "$@"'
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
# Put the shell in the sandbox's cgroups, then become bwrap: everything the
# sandbox starts is born inside the limits.
ENTER_CGROUPS = 'IFS=:; for f in $TQ_CGROUP_PROCS; do ' \
                'echo $$ > "$f" || exit 125; done; unset TQ_CGROUP_PROCS; exec "$@"'


def writable_layer(memory_mb: int) -> tuple[int, int]:
    """(MiB, inodes) of an API sandbox's writable layer with this memory limit."""
    size_mb = memory_mb // LAYER_SHARE
    return size_mb, (size_mb << 20) // LAYER_BYTES_PER_INODE


class ProcessDriver:
    name = "process"
    # bubblewrap has no checkpoint/restore: keep-warm works, templates do not
    snapshots = False
    # jobs run as the runner's uid (one uid is mapped into the namespace)
    job_uid: int | None = None

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.bwrap = shutil.which("bwrap") or "bwrap"
        self.unshare = shutil.which("unshare") or "unshare"
        self.base = data_dir / "sandboxes" / self.name

    def create(self, spec: SandboxSpec) -> ProcessSandbox:
        check_mounts(spec.mounts)
        sandbox_id, path = new_sandbox_dir(self.data_dir, self.name, guest_owns_work=False)
        try:
            skeleton = build_skeleton(self.data_dir / "sandboxes", spec.mounts)
            sandbox = ProcessSandbox(self, sandbox_id, path, spec, skeleton)
            # the guest's uid 65534 is the host's root mapped into its namespace
            if spec.writable_root:  # its writable layer is mounted at each start (LAYER_SETUP)
                sandbox.layer_dir.mkdir(mode=0o700)
            else:
                sandbox.mount_work_dir(0)
            if cgroups.available():
                # Unlike gVisor there is no sentry or gofer to budget for, and
                # RLIMIT_NPROC cannot help (the guest is root on the host,
                # mapped): a small pids cap makes a fork bomb get EAGAIN fast,
                # before memory or the timeout end it.
                sandbox.box.create(memory_mb=spec.memory_mb, max_pids=min(spec.max_pids, PROCESS_MAX_PIDS),
                                   cpus=spec.cpus)
            return sandbox
        except BaseException:
            CgroupBox(sandbox_id).remove()
            unmount_work_dir(path / "work")
            shutil.rmtree(path, ignore_errors=True)
            raise

    def adopt(self, sandbox_id: str, path: Path, meta: dict[str, object]) -> ProcessSandbox:
        """The host side of a sandbox another process created (Sandbox.connect)."""
        spec = spec_from_meta(meta)
        skeleton = build_skeleton(self.data_dir / "sandboxes", spec.mounts)
        return ProcessSandbox(self, sandbox_id, path, spec, skeleton,
                              existing=meta)

    def reap(self) -> list[str]:
        removed: list[str] = []
        for path in expired_dirs(self.base):
            CgroupBox(path.name).remove()  # kills whatever still runs in it
            unmount_work_dir(path / "work")
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
        return removed


class ProcessSandbox(HostSandbox):
    def __init__(self, driver: ProcessDriver, sandbox_id: str, path: Path, spec: SandboxSpec,
                 skeleton: Path, existing: dict[str, object] | None = None) -> None:
        super().__init__(sandbox_id, path, spec, driver.name, existing)
        self.driver = driver
        self.skeleton = skeleton
        self.layer_dir = path / LAYER_DIR
        self._host_pid = int(str(existing["host_pid"])) if existing and "host_pid" in existing else None

    def _with_layer(self, sandboxed: list[str]) -> list[str]:
        """`sandboxed` (bwrap's argv) preceded by the writable layer's mount
        in a private mount namespace (LAYER_SETUP). Its quota, bytes and
        inodes, is set by mount options, as the work dir's is; its root and
        shm directories are the host's root's, the guest's uid inside (mapped)."""
        size_mb, inodes = writable_layer(self.spec.memory_mb)
        options = f"size={size_mb}m,nr_inodes={inodes},mode=0700,uid=0,gid=0,nosuid,nodev"
        return [self.driver.unshare, "--mount", "--propagation", "private", "--",
                "/bin/sh", "-c", LAYER_SETUP, "sh", options, f"tenantq-{self.id}-layer", str(self.layer_dir),
                *sandboxed]

    def signal_init(self, signum: int) -> None:
        """Signal the sandbox's init (an API sandbox's agent): bwrap's child,
        pid 1 of the sandbox's pid namespace."""
        bwrap = self._proc.pid if self._proc is not None else self._host_pid
        if bwrap is None:
            return
        with contextlib.suppress(OSError, ValueError):
            for task in Path(f"/proc/{bwrap}/task").iterdir():
                for child in (task / "children").read_text().split():
                    os.kill(int(child), signum)

    def _argv(self, argv: list[str], env: dict[str, str], *, self_limiting: bool,
              seccomp_fd: int) -> list[str]:
        spec = self.spec
        ttl = max(1, int(self.remaining_ttl()))
        args = [self.driver.bwrap, "--new-session", "--unshare-all", "--unshare-user", "--disable-userns",
                "--as-pid-1", "--seccomp", str(seccomp_fd),
                "--uid", str(GUEST_UID), "--gid", str(GUEST_GID), "--hostname", "sandbox"]
        if spec.writable_root:
            # first: the writable layer is the root, and everything below is
            # mounted on it (bwrap's mount points are its first few inodes)
            args += ["--bind", str(self.layer_dir / "root"), "/"]
        args += ["--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):
            args += ["--symlink", f"usr/{link}", f"/{link}"]
        # --mqueue: POSIX message queues show up there, so the guest can empty them (rule P1)
        # /dev is bwrap's own tmpfs (device nodes, /dev/stdout links): made
        # read-only below, as under gVisor, or a job could leave files (and
        # relinked /dev/stdout) there for the next job, which no cleaner
        # empties (rule P1); /dev/shm is a capped tmpfs of its own, emptied
        # before every job like /tmp
        args += ["--ro-bind", str(self.skeleton / "etc"), "/etc", "--proc", "/proc", "--dev", "/dev",
                 "--mqueue", "/dev/mqueue"]
        if spec.writable_root:
            # /dev/shm and /tmp on the writable layer, inside its one quota
            args += ["--bind", str(self.layer_dir / "shm"), "/dev/shm", "--perms", "1777", "--dir", "/tmp"]
        else:
            args += ["--size", str(spec.tmp_mb * 1024 * 1024), "--tmpfs", "/dev/shm",
                     "--size", str(spec.tmp_mb * 1024 * 1024), "--tmpfs", "/tmp"]
        for m in spec.mounts:
            args += ["--ro-bind", m.source, m.target]
        # --remount-ro /: bwrap's root is a tmpfs of its own, writable, outside
        # any quota and never emptied between batches; read-only, as under gVisor.
        # An API sandbox's root is its writable layer (LAYER_SETUP), which has
        # no skeleton: the usual dirs, empty, and the work dir as one more
        if spec.writable_root:
            for d in (*API_DIRS, GUEST_WORK_DIR.lstrip("/")):
                args += ["--dir", f"/{d}"]
        else:
            args += ["--bind", str(self.work_dir), GUEST_WORK_DIR]
        args += ["--ro-bind", str(self.egress_dir), GUEST_EGRESS_DIR,
                 *([] if spec.writable_root else ["--remount-ro", "/"]), "--remount-ro", "/dev",
                 "--chdir", "/" if spec.writable_root else GUEST_WORK_DIR, "--clearenv"]
        for key, value in {**BASE_ENV, **env}.items():
            args += ["--setenv", key, value]
        init = argv if self_limiting else ["/usr/bin/timeout", "-s", "KILL", str(ttl), *argv]
        return [*args, "--", *init]

    def start(self, argv: list[str], *, env: dict[str, str] | None = None,
              self_limiting: bool = False, supervisor: bool = False) -> HostProcess:
        if self.destroyed:
            raise RuntimeError(f"sandbox {self.id} was destroyed")
        procs = ":".join(str(p) for p in self.box.procs_files()) if cgroups.available() else ""
        # the filter goes in as an inherited fd: the shell that enters the
        # cgroups passes it on to bwrap
        filter_fd = seccomp.program_fd()
        try:
            sandboxed = self._argv(argv, env or {}, self_limiting=self_limiting, seccomp_fd=filter_fd)
            if self.spec.writable_root:
                sandboxed = self._with_layer(sandboxed)
            command = ["/bin/sh", "-c", ENTER_CGROUPS, "sh", *sandboxed] if procs else sandboxed
            os.set_inheritable(filter_fd, True)
            running = start_process(self, command, {"TQ_CGROUP_PROCS": procs, "PATH": "/usr/bin:/bin"},
                                    lambda: self._kill_all(), pass_fds=(filter_fd,))
        finally:
            os.close(filter_fd)
        self._proc = running.proc
        if self.spec.writable_root:  # only an API sandbox is adopted by another process (connect)
            self.update_meta(host_pid=running.proc.pid)
        return running

    def _kill_all(self) -> None:
        self.box.kill_all()
        if self._proc is not None:
            self._proc.kill()

    def kill(self) -> None:
        self.box.kill_all()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()

    def destroy(self) -> None:
        if self.destroyed:
            return
        self.destroyed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self.box.kill_all()
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        self._remove_host_state()
