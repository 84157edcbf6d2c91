"""Booting a Sandbox API sandbox from its template (sandbox/templates.py).

Cold: the driver makes the sandbox with the template's layers mounted
read-only and starts the agent as its init; the template's warmups run in
it before it is handed to anyone. Restored (gVisor): the template's
checkpoint, a sandbox booted and warmed once per host and key, is restored
into a new sandbox instead, so a create skips the boot and the warmups.

Either way the sandbox holds nothing of a tenant until `Sandbox.create`
gives it its envs and secrets over the agent's channel; a restored agent is
told to forget the template's commands and reseed itself (as a fork child
is: guest/agent.py).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from tenantq.errors import InvalidInput
from tenantq.sandbox.agent_link import AgentLink
from tenantq.sandbox.core import API_LABEL, SandboxCore
from tenantq.sandbox.digests import DIGESTS
from tenantq.sandbox.driver import SandboxDriver, SnapshotDriver
from tenantq.sandbox.hostside import HostProcess, HostSandbox
from tenantq.sandbox.layout import GUEST_EGRESS_DIR, START_AGENT, guest_python
from tenantq.sandbox.snapshots import SnapshotStore, runtime_version
from tenantq.sandbox.spec import SandboxSpec
from tenantq.sandbox.templates import Resolved, python_path

# a part makes sandboxes of the class it is given: the facade's (sandbox/core.py)
S = TypeVar("S", bound=SandboxCore)

BOOT_SECONDS = 60.0
WARMUP_TIMEOUT_SECONDS = 600.0
# a restored agent answers a round trip within this (runsc has read the image)
RESTORE_SECONDS = 60.0
BUILD_LABEL = "tenantq.template-build"
KEY_RECHECK_SECONDS = 10.0
_keys: dict[tuple[object, ...], tuple[float, str]] = {}


def agent_argv() -> list[str]:
    # -S: the agent is stdlib-only; the site module's .pth processing alone
    # costs ~0.35 s under gVisor. By path, not -m: -m would import the whole
    # tenantq package first (another ~0.3 s; see guest/start_agent.py). The
    # tenantq source is mounted at its host path, so the path is the same
    # in the guest.
    return [guest_python().executable, "-S", "-P", str(START_AGENT), "--deadline-file",
            f"{GUEST_EGRESS_DIR}/deadline"]


def template_spec(resolved: Resolved, *, tenant: str, memory_mb: int, cpus: float, ttl: float,
                  labels: dict[str, str]) -> SandboxSpec:
    mounts = guest_python().mounts + resolved.mounts
    return SandboxSpec(tenant=tenant, memory_mb=memory_mb, cpus=cpus, ttl_seconds=ttl, mounts=mounts,
                       writable_root=True, labels=labels)


def boot(cls: type[S], chosen: SandboxDriver, resolved: Resolved, spec: SandboxSpec, *,
         env: dict[str, str], secret_env: dict[str, str], timeout: float) -> S:
    """A running sandbox of `resolved` made to `spec`: restored from the
    template's checkpoint where the driver can, booted and warmed otherwise."""
    if chosen.snapshots and isinstance(chosen, SnapshotDriver):
        image = template_image(cls, chosen, resolved, spec)
        host_running = chosen.restore(spec, image, agent_argv())
        host, running = host_running
        assert isinstance(host, HostSandbox) and isinstance(running, HostProcess)
        try:
            link = AgentLink(running.channel)
            link.ready.set()  # it said so when the template was booted
            link.send({"op": "resume", "forget": True})
            link.request({"op": "fs", "fs": "exists", "path": "/"}, RESTORE_SECONDS)
        except BaseException:
            host.destroy()
            raise
        sandbox = _wrap(cls, chosen, host, running, link, resolved, spec, timeout)
    else:
        sandbox = _cold(cls, chosen, resolved, spec, env={}, timeout=timeout)
        try:
            run_warmups(sandbox, resolved)
        except BaseException:
            sandbox.delete()
            raise
    try:
        if resolved.layers:  # a layer in use is never removed (templates.remove_stale_layers)
            sandbox.host.update_meta(layers=[str(p) for p in resolved.layers])
        if env or secret_env:
            sandbox.link().send({"op": "env", "env": {**env, **secret_env}})
        sandbox.watch()
    except BaseException:
        sandbox.delete()
        raise
    return sandbox


def _wrap(cls: type[S], chosen: SandboxDriver, host: HostSandbox, running: HostProcess, link: AgentLink,
          resolved: Resolved, spec: SandboxSpec, timeout: float) -> S:
    metadata = {k[5:]: v for k, v in spec.labels.items() if k.startswith("meta.")}
    return cls(host, running, link, chosen, template=resolved.name, metadata=metadata,
               timeout_seconds=timeout)


def _cold(cls: type[S], chosen: SandboxDriver, resolved: Resolved, spec: SandboxSpec, *,
          env: dict[str, str], timeout: float) -> S:
    path = ":".join(python_path(resolved))
    host, running, link = _start_agent(chosen, spec, env={**env, "PYTHONPATH": path}, supervisor=False)
    return _wrap(cls, chosen, host, running, link, resolved, spec, timeout)


def cold_agent(cls: type[S], chosen: SandboxDriver, spec: SandboxSpec, *, template: str,
               supervisor: bool) -> S:
    """A sandbox of `spec` booted with the agent as its init, nothing else
    (the queue's: runner_boot.boot_for_runner)."""
    path = ":".join(guest_python().sys_path)
    host, running, link = _start_agent(chosen, spec, env={"PYTHONPATH": path}, supervisor=supervisor)
    return cls(host, running, link, chosen, template=template, metadata={}, timeout_seconds=BOOT_SECONDS)


def _start_agent(chosen: SandboxDriver, spec: SandboxSpec, *, env: dict[str, str],
                 supervisor: bool) -> tuple[HostSandbox, HostProcess, AgentLink]:
    host = chosen.create(spec)
    assert isinstance(host, HostSandbox)
    try:
        # self_limiting: the agent is init and ends the sandbox at the
        # deadline itself (a `timeout` wrapper could not be extended by set_ttl)
        running = host.start(agent_argv(), env=env, self_limiting=True, supervisor=supervisor)
        assert isinstance(running, HostProcess)
        link = AgentLink(running.channel)
        link.wait_ready(BOOT_SECONDS)
    except BaseException:
        host.destroy()
        raise
    return host, running, link


def run_warmups(sandbox: SandboxCore, resolved: Resolved) -> None:
    """Each warmup `module:function`, in a python3 of the sandbox; what it
    writes or leaves running stays. A failing one: InvalidInput with its
    last line of stderr."""
    python = guest_python().executable
    for warmup in resolved.warmups:
        module, function = warmup.split(":")
        code = f"import importlib; getattr(importlib.import_module({module!r}), {function!r})()"
        result = sandbox.run([python, "-c", code], timeout_seconds=WARMUP_TIMEOUT_SECONDS)
        if result.exit_code != 0:
            tail = result.stderr.strip().splitlines()
            raise InvalidInput(f"template {resolved.name!r}: warmup {warmup} failed ({result.reason})"
                               + (f": {tail[-1][:300]}" if tail else ""))


def image_key(chosen: SandboxDriver, resolved: Resolved, spec: SandboxSpec) -> str:
    """What a template's checkpoint depends on, hashed; re-derived at most
    every KEY_RECHECK_SECONDS (it stats every file of tenantq's code)."""
    limits = (resolved.key, resolved.name, chosen.name, spec.memory_mb, spec.cpus, spec.max_pids, spec.tmp_mb,
              spec.mounts)
    now = time.monotonic()
    cached = _keys.get(limits)
    if cached is not None and now < cached[0]:
        return cached[1]
    key = _image_key(chosen, resolved, spec)
    _keys[limits] = (now + KEY_RECHECK_SECONDS, key)
    return key


def _image_key(chosen: SandboxDriver, resolved: Resolved, spec: SandboxSpec) -> str:
    runsc = getattr(chosen, "runsc", None)
    parts = {"template": resolved.key, "name": resolved.name, "driver": chosen.name,
             "runtime": runtime_version([runsc, "--version"]) if runsc else chosen.name,
             "python": sys.version, "limits": [spec.memory_mb, spec.cpus, spec.max_pids, spec.tmp_mb],
             "mounts": sorted(f"{m.source}:{m.target}" for m in spec.mounts),
             "tenantq": {p: DIGESTS.tree(p) for p in guest_python().code_paths}}
    return "api-" + hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def template_image(cls: type[S], chosen: SandboxDriver, resolved: Resolved, spec: SandboxSpec) -> Path:
    """The checkpoint of `resolved` for sandboxes like `spec`: built once per
    host and key (boot with no tenant, warm, checkpoint), then reused."""
    store = SnapshotStore(chosen.data_dir, chosen.name)
    key = image_key(chosen, resolved, spec)

    def build(image: Path) -> None:
        build_spec = replace(spec, tenant="", ttl_seconds=WARMUP_TIMEOUT_SECONDS + 120,
                             labels={BUILD_LABEL: resolved.name})
        sandbox = _cold(cls, chosen, resolved, build_spec, env={}, timeout=WARMUP_TIMEOUT_SECONDS)
        try:
            run_warmups(sandbox, resolved)
            sandbox.link().hold(RESTORE_SECONDS)
            sandbox.host.checkpoint(image)  # type: ignore[attr-defined]
        finally:
            sandbox.delete()

    template = store.get_or_build(key, {"app": f"template:{resolved.name}", "template": resolved.name}, build)
    store.touch(template)
    if not template.image.is_dir():
        raise InvalidInput(f"template {resolved.name!r}: its checkpoint {key} has no image (remove it: "
                           f"tenantq template rm {key})")
    return template.image


def prepare(cls: type[SandboxCore], chosen: SandboxDriver, resolved: Resolved, *, memory_mb: int = 512,
            cpus: float = 1.0) -> str:
    """Make `resolved` ready on this driver now (`tenantq template create`):
    its checkpoint on gVisor; elsewhere a sandbox booted and warmed once, to
    show the warmups work. Returns what was done, in a few words."""
    spec = template_spec(resolved, tenant="", memory_mb=memory_mb, cpus=cpus,
                         ttl=WARMUP_TIMEOUT_SECONDS + 120, labels={API_LABEL: resolved.name})
    if chosen.snapshots and isinstance(chosen, SnapshotDriver):
        store = SnapshotStore(chosen.data_dir, chosen.name)
        key = image_key(chosen, resolved, spec)
        existed = store.template(key) is not None
        template_image(cls, chosen, resolved, spec)
        return f"checkpoint {key} ({'up to date' if existed else 'built'})"
    sandbox = _cold(cls, chosen, resolved, spec, env={}, timeout=WARMUP_TIMEOUT_SECONDS)
    try:
        run_warmups(sandbox, resolved)
    finally:
        sandbox.delete()
    return f"booted and warmed once on {chosen.name} (it has no checkpoints: each sandbox runs the warmups)"
