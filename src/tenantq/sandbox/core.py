"""The state of one Sandbox API sandbox, and what its parts do with it.

`SandboxCore` is what the facade (`Sandbox`, sandbox/api.py) and its parts
share: booting (sandbox/boot.py), commands (sandbox/commands.py), files
(sandbox/files.py), fork (sandbox/forking.py), the ready pool
(sandbox/pool.py) and the queue's runner sandboxes (sandbox/runner_boot.py).
The parts import this module, never the facade, so the facade's module is
the only one that knows them all (tests/unit/test_layout.py: no circle of
modules). A part that makes a sandbox makes one of the class it is given
(the facade's), so a caller always holds a `Sandbox`.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tenantq.errors import TenantqError
from tenantq.sandbox.agent_link import AgentLink
from tenantq.sandbox.driver import SandboxDriver
from tenantq.sandbox.hostside import HostProcess, HostSandbox, read_meta
from tenantq.sandbox.spec import SandboxSpec

if TYPE_CHECKING:
    from pathlib import Path

    from tenantq.egress.policy import Rule
    from tenantq.egress.proxy import BatchProxy, EgressHub

API_LABEL = "tenantq.api"
# a sandbox waiting in the ready pool: no owner yet, not listed
POOLED_LABEL = "tenantq.pooled"
MAX_TTL_SECONDS = 7 * 24 * 3600.0
BOOT_SECONDS = 60.0


class NotSupported(TenantqError):
    """The driver cannot do this (the process driver cannot fork)."""


class SandboxCore:
    """One sandbox's host record, its init process, its agent link and its
    driver, with what the parts do to it; the public methods are the
    facade's (sandbox/api.py)."""

    def __init__(self, host: HostSandbox, running: HostProcess | None, link: AgentLink,
                 driver: SandboxDriver, *, template: str, metadata: dict[str, str],
                 timeout_seconds: float) -> None:
        self.host = host
        # the host's process of the sandbox's init: None in a process that
        # attached to a sandbox another one created (Sandbox.connect)
        self.running = running
        self._link = link
        self.driver_impl = driver
        self.id = host.id
        self.template = template
        self.metadata = metadata
        self.tenant = host.spec.tenant or None
        self.default_timeout = timeout_seconds
        self.fork_lock = threading.Lock()
        self.watchdog: subprocess.Popen[bytes] | None = None
        # how long the last fork took (sandbox/forking.py)
        self.last_fork: Any = None
        # the hosts it may reach (sandbox/api_egress.py), and their proxy
        self.egress: tuple[Rule, ...] = ()
        self.proxy: tuple[BatchProxy, EgressHub] | None = None
        # its init is the queue's guest runner now (hand_over)
        self.handed_over = False

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} template={self.template} driver={self.driver_impl.name}>"

    # -- what the parts use ------------------------------------------------------------

    def run(self, cmd: str | Sequence[str], **kwargs: Any) -> Any:
        """A command in the foreground: the facade's (a template's warmups
        run through it, sandbox/boot.py)."""
        raise NotImplementedError

    def link(self) -> AgentLink:
        return self._link

    @property
    def spec(self) -> SandboxSpec:
        return self.host.spec

    @property
    def driver(self) -> str:
        return self.driver_impl.name

    def oom_count(self) -> int:
        """OOM kills so far, as the host's cgroups count them. Under gVisor
        the container's own cgroup goes with the sandbox when an OOM kills
        its sentry, so the box's peak usage at the limit counts as one too."""
        box = self.host.box
        return box.oom_kills() + (1 if box.oom_killed(self.spec.memory_mb << 20) else 0)

    def end_reason(self, why: str) -> str:
        """Why a command has no exit status: the sandbox itself ended."""
        if self.host.remaining_ttl() <= 0:
            return "the sandbox reached its TTL"
        if self.oom_count() > 0:
            return f"oom: exceeded {self.spec.memory_mb} MiB (the sandbox was killed)"
        return why

    def start_egress(self, allowed: tuple[Rule, ...]) -> None:
        """Open the sandbox's egress proxy and have the agent point later
        commands at it (nothing when `allowed` is empty: no network)."""
        if not allowed:
            return
        from tenantq.sandbox import api_egress

        self.proxy = api_egress.open_proxy(self.host, self.tenant, allowed)
        self.egress = allowed
        self._link.request({"op": "egress"}, BOOT_SECONDS)

    def watch(self) -> None:
        """Start the host-side TTL watchdog (sandbox/watchdog.py)."""
        from tenantq.sandbox import watchdog

        self.watchdog = watchdog.start(self.driver_impl.name, self.driver_impl.data_dir, self.id)
        self.host.update_meta(watchdog_pid=self.watchdog.pid)

    def adopt(self, running: HostProcess) -> HostProcess | None:
        """The parent after its restore (sandbox/forking.py); the old run."""
        old, self.running = self.running, running
        return old

    def is_running(self) -> bool:
        alive = self.running.alive() if self.running is not None else True
        linked = self._link.broken is None or self.handed_over
        return not self.host.destroyed and linked and alive

    def delete(self) -> bool:
        """End the sandbox and remove everything it left on the host;
        False when it was already gone."""
        was = not self.host.destroyed
        self._link.close("the sandbox was deleted")
        if self.proxy is not None:
            (proxy, hub), self.proxy = self.proxy, None
            hub.close(proxy)
        stop_watchdog(self.host, self.watchdog)
        self.host.destroy()
        if self.running is not None:
            self.running.close()
        return was

    kill = delete

    # -- the queue's sandboxes (dispatch/executors/warm.py, sandbox/runner_boot.py) ---------------

    def hand_over(self, argv: list[str], env: dict[str, str] | None = None) -> HostProcess:
        """The agent execs `argv` as the sandbox's init (the queue's guest
        runner, guest/runner.py); its started process's channel, returned, is
        then the caller's alone, and exec/files of this object refuse
        (SandboxGone). Everything else stays: TTL, checkpoint, delete."""
        if self.running is None:
            raise NotSupported("only the process that created a sandbox can hand it over")
        self._link.hand_over(list(argv), dict(env or {}), BOOT_SECONDS)
        self.handed_over = True
        return self.running

    @property
    def init_process(self) -> HostProcess:
        """The host's process of the sandbox's init (its channel's pipes)."""
        assert self.running is not None
        return self.running

    def checkpoint_and_stop(self, image: Path) -> None:
        """Save the sandbox to `image` (a new dir), which stops it (a
        template's build, a hibernation); delete() then removes the rest."""
        checkpoint = getattr(self.host, "checkpoint", None)
        if checkpoint is None:
            raise NotSupported(f"the {self.driver_impl.name} driver cannot checkpoint")
        checkpoint(image)

    def hand_out(self, *, ttl: float, metadata: dict[str, str], tenant: str | None, env: dict[str, str],
                 timeout: float) -> None:
        """A pooled sandbox becomes its owner's (sandbox/pool.py)."""
        labels = {API_LABEL: self.template, **{f"meta.{k}": v for k, v in metadata.items()}}
        self.assign(tenant=tenant or "", labels=labels, ttl=ttl)
        if env:
            self._link.send({"op": "env", "env": env})
        self.metadata, self.tenant, self.default_timeout = metadata, tenant, timeout

    def assign(self, *, tenant: str, labels: dict[str, str], ttl: float) -> None:
        """A pristine sandbox of the ready pool becomes one owner's: its
        tenant, labels and TTL (the host's record of it, sandbox/pool.py)."""
        self.host.spec = dataclasses.replace(self.host.spec, tenant=tenant, labels=labels)
        self.host.update_meta(tenant=tenant, labels=labels, dispatcher_pid=os.getpid())
        self.host.extend_deadline(ttl)
        self.tenant = tenant or None


def stop_watchdog(host: HostSandbox, child: subprocess.Popen[bytes] | None) -> None:
    from tenantq.sandbox import watchdog

    if child is not None:
        child.kill()
        child.wait(10)
        return
    meta = read_meta(host.path) or {}
    if "watchdog_pid" in meta:
        watchdog.stop(int(str(meta["watchdog_pid"])), host.id)
