"""The queue's sandboxes (dispatch/executors/warm.py): booted for the guest
runner, or restored from a runner's checkpoint. Only the queue makes these;
`Sandbox.create` never does. Both are Sandbox API sandboxes (the one way to
make a sandbox, docs/sandbox.md "One path"), handed over to the runner
afterwards (`Sandbox.hand_over`)."""

from __future__ import annotations

from pathlib import Path

from tenantq.sandbox import boot
from tenantq.sandbox.agent_link import AgentLink
from tenantq.sandbox.api import Sandbox
from tenantq.sandbox.core import BOOT_SECONDS, NotSupported
from tenantq.sandbox.driver import SandboxDriver, SnapshotDriver
from tenantq.sandbox.hostside import HostProcess, HostSandbox
from tenantq.sandbox.spec import SandboxSpec


def boot_for_runner(chosen: SandboxDriver, spec: SandboxSpec, template: str) -> Sandbox:
    """A sandbox of exactly `spec` (the queue's limits and mounts, a
    read-only root), its agent started as the driver's supervisor (under
    gVisor: the sandbox's root with the capabilities to run each job as
    another uid, rule C1), and no host-side watchdog: the dispatcher's
    own deadline (rule H5) and the reaper end it. Then `hand_over`."""
    return boot.cold_agent(Sandbox, chosen, spec, template=template, supervisor=True)


def restore_runner(chosen: SandboxDriver, spec: SandboxSpec, image: Path, template: str) -> Sandbox:
    """A new sandbox resumed from the checkpoint of a handed-over one (a
    template, or a hibernated sandbox): its runner resumes inside its read
    of the next command, on the new sandbox's channel."""
    if not (chosen.snapshots and isinstance(chosen, SnapshotDriver)):
        raise NotSupported(f"the {chosen.name} driver cannot restore checkpoints")
    host, running = chosen.restore(spec, image, boot.agent_argv())
    assert isinstance(host, HostSandbox) and isinstance(running, HostProcess)
    sandbox = Sandbox(host, running, AgentLink(running.channel, read=False), chosen, template=template,
                      metadata={}, timeout_seconds=BOOT_SECONDS)
    sandbox.handed_over = True
    return sandbox
