"""The gvisor driver: each run is a fresh gVisor container (runsc, ptrace
platform, `--network=none`) on the sandbox's bundle.

The OCI bundle tenantq builds: a shared read-only skeleton root (generated
/etc, empty mount points), /usr and the Python installation and the app's
code bound read-only, a size-capped tmpfs /tmp, the private work dir bound
read-write at /tenantq/work, uid 65534, memory / pids / CPU limits in the
sandbox's cgroup, RLIMIT_NPROC for a graceful EAGAIN before the pids
backstop. The container's init is `timeout -s KILL <ttl>`, so the sandbox
dies at its deadline even if the dispatcher that started it is gone.

The guest runner (`supervisor=True`) is the one process that runs as the
sandbox's root, with only the capabilities SUPERVISOR_CAPS lists: it holds the
control channel, and every job runs as uid 65534, which cannot signal it,
read its memory or reopen its fds (gVisor does not apply dumpability to
/proc/PID/fd; a second uid does: docs/security.md, rule C1).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from tenantq.sandbox.cgroups import CgroupBox
from tenantq.sandbox.driver import GUEST_WORK_DIR
from tenantq.sandbox.hostside import (
    HostProcess,
    HostSandbox,
    expired_dirs,
    owner_alive,
    read_meta,
    spec_from_meta,
    start_process,
    unmount_work_dir,
)
from tenantq.sandbox.layout import (
    GUEST_EGRESS_DIR,
    GUEST_GID,
    GUEST_UID,
    build_skeleton,
    check_mounts,
    new_sandbox_dir,
)
from tenantq.sandbox.spec import End, Mount, ProcessResult, SandboxSpec, SnapshotFailed

# SETUID/SETGID: to become the job's uid; KILL: to end what a job leaves;
# SYS_ADMIN: to give each job process an IPC namespace of its own (rule P1).
# A job drops them all with its uid change (guest/jobs.py).
SUPERVISOR_CAPS = ["CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_SYS_ADMIN"]
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}


class GVisorProcess(HostProcess):
    def _result(self, returncode: int, end: End) -> ProcessResult:
        result = super()._result(returncode, end)
        if result.end.kind == "exit" and returncode == 2 and "panic" in result.stderr.lower():
            end = End("crashed", exit_code=2, detail="the sandbox kernel stopped (process limit reached?)")
            return ProcessResult(result.exit_code, result.stdout, result.stderr, end)
        return result


# host tasks (sentry threads, ptrace stubs) the sandbox's pids cgroup allows
# per guest task that RLIMIT_NPROC allows (see _config): a bound on what a
# sandbox costs the host, high enough that the guest's own limit, a graceful
# EAGAIN, is what a fork bomb meets
HOST_TASKS_PER_GUEST_TASK = 64


class GVisorDriver:
    name = "gvisor"
    snapshots = True
    # the uid jobs run as, apart from the runner (the sandbox's root)
    job_uid: int | None = GUEST_UID

    def __init__(self, data_dir: Path, *, runsc: str | None = None) -> None:
        self.data_dir = data_dir
        self.runsc = runsc or shutil.which("runsc") or "runsc"
        self.state_root = data_dir / "runsc"
        self.state_root.mkdir(parents=True, exist_ok=True)
        self.base = data_dir / "sandboxes" / self.name

    def runsc_cmd(self, *args: str, overlay: bool = False) -> list[str]:
        # --host-uds=open: a job may connect to a host Unix socket it can see,
        # and the only one mounted in is its batch's egress proxy.
        # --overlay2=root:memory (API sandboxes): writes to the root go to
        # the sandbox's own memory (capped by its limit, saved with a
        # checkpoint, so a fork carries them), never to the shared skeleton
        flags = ["--overlay2=root:memory"] if overlay else []
        return [self.runsc, "--root", str(self.state_root), "--platform=ptrace", "--network=none",
                "--host-uds=open", *flags, *args]

    def restore(self, spec: SandboxSpec, image: Path, argv: list[str]) -> tuple[GVisorSandbox, HostProcess]:
        """A new sandbox whose processes resume from a checkpoint image."""
        sandbox = self.create(spec)
        try:
            return sandbox, sandbox.restore(image, argv)
        except BaseException:
            sandbox.destroy()
            raise

    def create(self, spec: SandboxSpec) -> GVisorSandbox:
        check_mounts(spec.mounts)
        sandbox_id, path = new_sandbox_dir(self.data_dir, self.name, guest_owns_work=True)
        try:
            skeleton = build_skeleton(self.data_dir / "sandboxes", spec.mounts)
            sandbox = GVisorSandbox(self, sandbox_id, path, spec, skeleton)
            sandbox.mount_work_dir(GUEST_UID)
            sandbox.box.create(memory_mb=None, max_pids=None, cpus=None, only_memory=True)
            return sandbox
        except BaseException:
            unmount_work_dir(path / "work")
            shutil.rmtree(path, ignore_errors=True)
            CgroupBox(sandbox_id).remove()
            raise

    def adopt(self, sandbox_id: str, path: Path, meta: dict[str, object]) -> GVisorSandbox:
        """The host side of a sandbox another process created (Sandbox.connect)."""
        spec = spec_from_meta(meta)
        skeleton = build_skeleton(self.data_dir / "sandboxes", spec.mounts)
        return GVisorSandbox(self, sandbox_id, path, spec, skeleton,
                             existing=meta)

    def _containers(self) -> list[dict[str, Any]]:
        out = subprocess.run(self.runsc_cmd("list", "-format=json"), capture_output=True, text=True,
                             timeout=30)
        try:
            return list(json.loads(out.stdout or "[]") or [])
        except ValueError:
            return []

    def reap(self) -> list[str]:
        """Kill and delete containers past their deadline or already stopped,
        then remove expired sandbox dirs and their cgroups."""
        removed: list[str] = []
        for c in self._containers():
            cid, status, bundle = str(c.get("id")), str(c.get("status")), Path(str(c.get("bundle", "")))
            meta = read_meta(bundle)
            expired = meta is None or float(str(meta["deadline"])) < _now()
            # a stopped container whose dispatcher still runs is being
            # cleaned up by its own `runsc run`; leave it alone
            orphaned = status == "stopped" and not owner_alive(meta)
            if expired or orphaned:
                subprocess.run(self.runsc_cmd("kill", cid, "KILL"), capture_output=True, timeout=30)
                subprocess.run(self.runsc_cmd("delete", "--force", cid), capture_output=True, timeout=30)
                removed.append(cid)
        for path in expired_dirs(self.base):
            CgroupBox(path.name).remove()
            unmount_work_dir(path / "work")
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
        return removed


def _now() -> float:
    return time.time()


class GVisorSandbox(HostSandbox):
    def __init__(self, driver: GVisorDriver, sandbox_id: str, path: Path, spec: SandboxSpec,
                 skeleton: Path, existing: dict[str, object] | None = None) -> None:
        super().__init__(sandbox_id, path, spec, driver.name, existing)
        self.driver = driver
        self.skeleton = skeleton
        self._running: str | None = None
        # containers whose `runsc run` we killed: their state needs a delete
        self._dirty: list[str] = []
        # a sandbox another process started (Sandbox.connect): its container
        self._adopted = str(existing["container"]) if existing and "container" in existing else None

    def signal_init(self, signum: int) -> None:
        """Signal the container's init (an API sandbox's agent)."""
        cid = self._running or self._adopted
        if cid is not None:
            subprocess.run(self.driver.runsc_cmd("kill", cid, str(signum)), capture_output=True, timeout=30)

    def _config(
        self, cid: str, argv: list[str], env: dict[str, str], *, self_limiting: bool, supervisor: bool = False
    ) -> dict[str, Any]:
        spec = self.spec
        ttl = max(1, int(self.remaining_ttl()))
        init = argv if self_limiting else ["/usr/bin/timeout", "-s", "KILL", str(ttl), *argv]
        mounts: list[dict[str, Any]] = [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=1777", f"size={spec.tmp_mb}m"]},
            {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]},
            *({"destination": m.target, "type": "bind", "source": m.source, "options": ["rbind", "ro"]}
              for m in spec.mounts),
            {"destination": GUEST_WORK_DIR, "type": "bind", "source": str(self.work_dir),
             "options": ["rbind", "rw"]},
            {"destination": GUEST_EGRESS_DIR, "type": "bind", "source": str(self.egress_dir),
             "options": ["rbind", "ro"]},
        ]
        # each guest process costs the sandbox ~6 host tasks (sentry, stubs):
        # stay well under the pids backstop, whose hit panics the sentry
        nproc = max(16, (spec.max_pids - 64) // 16)
        # The backstop itself: under fork churn the ptrace platform's host
        # tasks per guest task grow far past 6 (28 guest tasks reached 511 of
        # 512 host tasks in the adversarial cancel test, and at 512 the
        # sentry panicked: the batch ended "crashed: exit code 2"), so the
        # host limit is HOST_TASKS_PER_GUEST_TASK per guest task allowed
        host_pids = max(spec.max_pids, nproc * HOST_TASKS_PER_GUEST_TASK)
        # an API sandbox's processes are its root, with no capability: they
        # own the (overlaid) root; gVisor's sentry is the boundary either way
        uid = 0 if supervisor or spec.writable_root else GUEST_UID
        caps = SUPERVISOR_CAPS if supervisor and not spec.writable_root else []
        return {
            "ociVersion": "1.0.0",
            "process": {
                "terminal": False,
                "user": {"uid": uid, "gid": 0 if uid == 0 else GUEST_GID},
                "capabilities": {k: caps for k in ("bounding", "effective", "permitted")},
                "args": init,
                "env": [f"{k}={v}" for k, v in {**BASE_ENV, **env}.items()],
                # the work dir is the job uid's (0700): the runner stays out
                "cwd": "/" if uid == 0 else GUEST_WORK_DIR,
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024},
                            {"type": "RLIMIT_NPROC", "hard": nproc, "soft": nproc}],
                "noNewPrivileges": True,
            },
            "root": {"path": str(self.skeleton), "readonly": not spec.writable_root},
            "hostname": "sandbox",
            "mounts": mounts,
            "linux": {
                "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network")],
                "cgroupsPath": f"{self.box.relative}/{cid}",
                "resources": {
                    "memory": {"limit": spec.memory_mb * 1024 * 1024},
                    "pids": {"limit": host_pids},
                    "cpu": {"quota": int(spec.cpus * 100_000), "period": 100_000},
                },
            },
            "annotations": {"tenantq.sandbox": self.id, "tenantq.tenant": spec.tenant,
                            "tenantq.deadline": f"{self.deadline:.0f}",
                            **{f"tenantq.label.{k}": v for k, v in spec.labels.items()}},
        }

    def start(self, argv: list[str], *, env: dict[str, str] | None = None,
              self_limiting: bool = False, supervisor: bool = False) -> HostProcess:
        return self._launch(f"{self.id}-{self.runs + 1}", argv, env or {}, self_limiting, supervisor, "run")

    def restore(self, image: Path, argv: list[str]) -> HostProcess:
        """Start this (new) sandbox from a checkpoint image instead of booting:
        the image's processes resume, reading this sandbox's stdin."""
        return self._launch(f"{self.id}-{self.runs + 1}", argv, {}, True, True, "restore", "--image-path",
                            str(image))

    def checkpoint(self, image: Path) -> None:
        """Save the running container to `image` (a new directory); this
        stops it. Raises SnapshotFailed with runsc's reason."""
        cid, proc = self._running, self._proc
        if cid is None or proc is None:
            raise SnapshotFailed("nothing runs in this sandbox to checkpoint")
        image.mkdir(parents=True)
        done = subprocess.run(self.driver.runsc_cmd("checkpoint", "--image-path", str(image), cid,
                                                    overlay=self.spec.writable_root),
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise SnapshotFailed(f"runsc checkpoint failed: {done.stderr.strip()[-300:]}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)  # the checkpoint stopped it
        self._running = None
        self._dirty.append(cid)

    def _launch(self, cid: str, argv: list[str], env: dict[str, str], self_limiting: bool, supervisor: bool,
                *command: str) -> HostProcess:
        if self.destroyed:
            raise RuntimeError(f"sandbox {self.id} was destroyed")
        config = self._config(cid, argv, env, self_limiting=self_limiting, supervisor=supervisor)
        (self.path / "config.json").write_text(json.dumps(config))

        def kill() -> None:
            self._kill(cid)
            if cid not in self._dirty:
                self._dirty.append(cid)

        # runsc hands its stdio to the container: stdin and stdout are the
        # control channel's pipes, stderr an append-mode file (notes/gvisor.md)
        runsc = self.driver.runsc_cmd(*command, "--bundle", str(self.path), cid,
                                      overlay=self.spec.writable_root)
        running = start_process(self, runsc, None, kill, new_session=True, kind=GVisorProcess)
        self._proc, self._running = running.proc, cid
        if self.spec.writable_root:  # only an API sandbox is adopted by another process (connect)
            self.update_meta(container=cid, host_pid=running.proc.pid)
        return running

    def _live(self) -> str | None:
        """The container that still runs (`runsc run` deletes one that exits)."""
        if self._running is not None and self._proc is not None and self._proc.poll() is None:
            return self._running
        return None

    def kill(self) -> None:
        cid = self._live()
        if cid is not None:
            self._kill(cid)
            self._dirty.append(cid)

    def _kill(self, cid: str) -> None:
        # SIGKILL to the container's init ends its pid namespace, so every
        # process in it (`kill --all` does not stop a restored container)
        subprocess.run(self.driver.runsc_cmd("kill", cid, "KILL"), capture_output=True, timeout=30)

    def destroy(self) -> None:
        if self.destroyed:
            return
        self.destroyed = True
        if self._adopted is not None:
            self._kill(self._adopted)
            self._dirty.append(self._adopted)
        proc, cid = self._proc, self._live()
        if cid is not None:
            self._kill(cid)
            self._dirty.append(cid)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        for dirty in self._dirty:
            # a `runsc run` that was killed leaves state behind until delete
            subprocess.run(self.driver.runsc_cmd("delete", "--force", dirty), capture_output=True, timeout=30)
        self._remove_host_state()


__all__ = ["GVisorDriver", "GVisorSandbox", "Mount", "SnapshotFailed"]
