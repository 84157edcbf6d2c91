"""The Sandbox API: `from tenantq import Sandbox` (docs/sandbox-api.md).

A sandbox here is one long-lived container (gVisor) or namespace set
(bubblewrap) whose init is tenantq's agent (guest/agent.py): files at any
absolute path on a writable layer over the read-only root, commands with
timeouts, background processes, state that lasts from one exec to the
next, fork on gVisor. The host keeps its own record of the sandbox (its
directory, deadline and labels under the data dir, never inside the
sandbox) and measures what it decides: the TTL (the agent enforces the
deadline the host writes, the reaper removes what outlives it), timeouts
and OOM (sandbox/commands.py). Everything the agent says is hostile input
(sandbox/agent_link.py).
"""

from __future__ import annotations

import base64
import builtins
import dataclasses
import math
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tenantq.errors import InvalidInput, TenantqError
from tenantq.sandbox.agent_link import AgentLink, SandboxGone
from tenantq.sandbox.attach import SandboxInfo, SandboxNotFound
from tenantq.sandbox.commands import CommandHandle, ExecResult
from tenantq.sandbox.driver import SandboxDriver, SnapshotDriver
from tenantq.sandbox.drivers import get_driver
from tenantq.sandbox.files import Filesystem
from tenantq.sandbox.hostside import HostSandbox, Running, read_meta
from tenantq.sandbox.spec import SandboxSpec

if TYPE_CHECKING:
    from tenantq.egress.policy import Rule
    from tenantq.egress.proxy import BatchProxy, EgressHub
    from tenantq.sandbox.templates import Resolved

API_LABEL = "tenantq.api"
# a sandbox waiting in the ready pool: no owner yet, not listed
POOLED_LABEL = "tenantq.pooled"
MAX_TTL_SECONDS = 7 * 24 * 3600.0
DEFAULT_OUTPUT_CAP = 1 << 20
MAX_OUTPUT_CAP = 64 << 20
BOOT_SECONDS = 60.0
METADATA_LIMIT = 64
NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


class NotSupported(TenantqError):
    """The driver cannot do this (the process driver cannot fork)."""


def _positive(name: str, value: float, *, most: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value <= 0:
        raise InvalidInput(f"{name} must be a positive finite number, got {value!r}")
    if most is not None and value > most:
        raise InvalidInput(f"{name} must be at most {most:g}, got {value!r}")
    return float(value)


def _strings(name: str, values: Mapping[str, str] | None, key: re.Pattern[str]) -> dict[str, str]:
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise InvalidInput(f"{name} must be a mapping of strings to strings")
    if len(values) > 256:
        raise InvalidInput(f"{name} has {len(values)} entries (at most 256)")
    out = {}
    for k, v in values.items():
        if not isinstance(k, str) or not key.match(k):
            raise InvalidInput(f"{name}: bad name {k!r} (letters, digits, _ . : -)")
        if not isinstance(v, str) or "\0" in v or len(v) > 32768:
            raise InvalidInput(f"{name}[{k!r}] must be a string without NUL bytes, at most 32 KiB")
        out[k] = v
    return out


class Sandbox:
    """A running sandbox. Make one with `Sandbox.create(...)`; `with` deletes it."""

    def __init__(self, host: HostSandbox, running: Running | None, link: AgentLink, driver: SandboxDriver, *,
                 template: str, metadata: dict[str, str], timeout_seconds: float) -> None:
        self._host = host
        self._running = running
        self._link = link
        self._driver = driver
        self.id = host.id
        self.template = template
        self.metadata = metadata
        self.tenant = host.spec.tenant or None
        self.default_timeout = timeout_seconds
        self.filesystem = Filesystem(self)
        self._fork_lock = threading.Lock()
        self._watchdog: subprocess.Popen[bytes] | None = None
        # how long the last fork took (sandbox/forking.py)
        self.last_fork: Any = None
        # the hosts it may reach (sandbox/api_egress.py), and their proxy
        self.egress: tuple[Rule, ...] = ()
        self._proxy: tuple[BatchProxy, EgressHub] | None = None
        # its init is the queue's guest runner now (hand_over)
        self.handed_over = False

    # -- making one ----------------------------------------------------------------

    @classmethod
    def create(cls, template: str = "base", ttl_seconds: float = 300,
               metadata: Mapping[str, str] | None = None, tenant: str | None = None,
               envs: Mapping[str, str] | None = None,
               secrets: Mapping[str, str] | None = None, egress: Sequence[str] | None = None,
               memory_mb: int = 512, cpus: float = 1.0, timeout_seconds: float = 60,
               driver: str | None = None) -> Sandbox:
        """A running sandbox. `ttl_seconds`: it is deleted then, whoever is
        still around; `timeout_seconds`: every exec's default timeout;
        `envs` are in every exec's environment, and so are `secrets`, which
        are never written to disk (they go over the agent's channel)."""
        ttl = _positive("ttl_seconds", ttl_seconds, most=MAX_TTL_SECONDS)
        timeout = _positive("timeout_seconds", timeout_seconds, most=MAX_TTL_SECONDS)
        labels = _strings("metadata", metadata, NAME)
        if len(labels) > METADATA_LIMIT:
            raise InvalidInput(f"metadata has {len(labels)} keys (at most {METADATA_LIMIT})")
        env = _strings("envs", envs, ENV_NAME)
        secret_env = _strings("secrets", secrets, ENV_NAME)
        if tenant is not None and (not isinstance(tenant, str) or not NAME.match(tenant)):
            raise InvalidInput(f"tenant must be 1-64 letters, digits or _ . : -, got {tenant!r}")
        if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or not 64 <= memory_mb <= 65536:
            raise InvalidInput(f"memory_mb must be an integer from 64 to 65536, got {memory_mb!r}")
        _positive("cpus", cpus, most=64)
        from tenantq.sandbox import api_egress

        allowed = api_egress.rules(egress)
        from tenantq.sandbox import templates
        from tenantq.settings import Settings

        data_dir = Settings().data_dir
        chosen, _ = get_driver(driver or "auto", data_dir)
        # an unknown name is a one-line error; a layer not built yet (the
        # code-interpreter's first use) is built now, once per host
        resolved = templates.resolve(data_dir, template)
        reap_now_and_then(chosen)
        from tenantq.sandbox.pool import POOLED_TTL_SECONDS, pool, pool_key

        def pooled() -> Sandbox:
            return cls._boot_new(chosen, resolved, POOLED_TTL_SECONDS, {POOLED_LABEL: "1"}, None,
                                 memory_mb, float(cpus), {}, {}, timeout)

        ready = pool().take(pool_key(template, chosen.name, memory_mb, cpus), pooled)
        if ready is not None:
            ready._hand_out(ttl=ttl, metadata=labels, tenant=tenant, env={**env, **secret_env},
                            timeout=timeout)
            made = ready
        else:
            made = cls._boot_new(chosen, resolved, ttl, {f"meta.{k}": v for k, v in labels.items()}, tenant,
                                 memory_mb, float(cpus), env, secret_env, timeout)
        try:
            made._start_egress(allowed)
        except BaseException:
            made.delete()
            raise
        return made

    @classmethod
    def _boot_new(cls, chosen: SandboxDriver, resolved: Resolved, ttl: float, labels: dict[str, str],
                  tenant: str | None, memory_mb: int, cpus: float, env: dict[str, str],
                  secret_env: dict[str, str], timeout: float) -> Sandbox:
        from tenantq.sandbox import boot

        spec = boot.template_spec(resolved, tenant=tenant or "", memory_mb=memory_mb, cpus=cpus, ttl=ttl,
                                  labels={API_LABEL: resolved.name, **labels})
        return boot.boot(cls, chosen, resolved, spec, env=env, secret_env=secret_env, timeout=timeout)

    def _start_egress(self, allowed: tuple[Rule, ...]) -> None:
        """Open the sandbox's egress proxy and have the agent point later
        commands at it (nothing when `allowed` is empty: no network)."""
        if not allowed:
            return
        from tenantq.sandbox import api_egress

        self._proxy = api_egress.open_proxy(self._host, self.tenant, allowed)
        self.egress = allowed
        self._link.request({"op": "egress"}, BOOT_SECONDS)

    def watch(self) -> None:
        """Start the host-side TTL watchdog (sandbox/watchdog.py)."""
        from tenantq.sandbox import watchdog

        self._watchdog = watchdog.start(self._driver.name, self._driver.data_dir, self.id)
        self._host.update_meta(watchdog_pid=self._watchdog.pid)

    def _hand_out(self, *, ttl: float, metadata: dict[str, str], tenant: str | None, env: dict[str, str],
                  timeout: float) -> None:
        """A pooled sandbox becomes its owner's (sandbox/pool.py)."""
        labels = {API_LABEL: self.template, **{f"meta.{k}": v for k, v in metadata.items()}}
        self.assign(tenant=tenant or "", labels=labels, ttl=ttl)
        if env:
            self._link.send({"op": "env", "env": env})
        self.metadata, self.tenant, self.default_timeout = metadata, tenant, timeout

    @classmethod
    def connect(cls, sandbox_id: str, *, timeout_seconds: float = 60) -> Sandbox:
        """A running sandbox another process (on this host) created. The
        returned object drives it fully (exec, files, set_ttl, delete);
        `close()` lets it go without ending the sandbox."""
        from tenantq.sandbox import attach

        path, meta = attach.find(sandboxes_dir(), sandbox_id, API_LABEL)
        from tenantq.settings import Settings

        chosen, _ = get_driver(str(meta.get("driver")), Settings().data_dir)
        host = chosen.adopt(sandbox_id, path, meta)  # type: ignore[attr-defined]
        assert isinstance(host, HostSandbox)
        channel = attach.open_channel(host)
        link = AgentLink(channel, owns_fds=True)
        link.wait_ready(BOOT_SECONDS)
        labels = host.spec.labels
        metadata = {k[5:]: v for k, v in labels.items() if k.startswith("meta.")}
        return cls(host, None, link, chosen, template=labels.get(API_LABEL, "base"), metadata=metadata,
                   timeout_seconds=timeout_seconds)

    @classmethod
    def list(cls, metadata: Mapping[str, str] | None = None) -> builtins.list[SandboxInfo]:
        """The live API sandboxes on this host whose metadata includes `metadata`."""
        from tenantq.sandbox import attach

        return attach.list_sandboxes(sandboxes_dir(), API_LABEL, _strings("metadata", metadata, NAME))

    def close(self) -> None:
        """Let go of the sandbox without ending it (it lives to its TTL)."""
        self._link.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} template={self.template} driver={self._driver.name}>"

    # -- what the other parts use ------------------------------------------------

    def link(self) -> AgentLink:
        return self._link

    @property
    def spec(self) -> SandboxSpec:
        return self._host.spec

    @property
    def driver(self) -> str:
        return self._driver.name

    def oom_count(self) -> int:
        """OOM kills so far, as the host's cgroups count them. Under gVisor
        the container's own cgroup goes with the sandbox when an OOM kills
        its sentry, so the box's peak usage at the limit counts as one too."""
        box = self._host.box
        return box.oom_kills() + (1 if box.oom_killed(self.spec.memory_mb << 20) else 0)

    def end_reason(self, why: str) -> str:
        """Why a command has no exit status: the sandbox itself ended."""
        if self._host.remaining_ttl() <= 0:
            return "the sandbox reached its TTL"
        if self.oom_count() > 0:
            return f"oom: exceeded {self.spec.memory_mb} MiB (the sandbox was killed)"
        return why

    # -- commands ------------------------------------------------------------------

    def exec(self, cmd: str | Sequence[str], timeout_seconds: float | None = None, cwd: str | None = None,
             envs: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
             on_stdout: Callable[[str], None] | None = None, on_stderr: Callable[[str], None] | None = None,
             background: bool = False, output_cap: int = DEFAULT_OUTPUT_CAP) -> Any:
        """Run `cmd` (a shell string, run by /bin/sh -c, or an argv list).
        Returns its ExecResult, or with `background=True` a CommandHandle at
        once (no timeout unless one is given)."""
        if isinstance(cmd, str):
            if not cmd.strip():
                raise InvalidInput("cmd is empty")
            argv = ["/bin/sh", "-c", cmd]
        elif isinstance(cmd, Sequence) and cmd and all(isinstance(a, str) for a in cmd):
            argv = list(cmd)
        else:
            raise InvalidInput(f"cmd must be a shell string or a non-empty list of strings, got {cmd!r}")
        if any("\0" in a for a in argv):
            raise InvalidInput("cmd must not contain NUL bytes")
        if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
            raise InvalidInput(f"cwd must be an absolute path, got {cwd!r}")
        if isinstance(output_cap, bool) or not isinstance(output_cap, int) or \
                not 0 <= output_cap <= MAX_OUTPUT_CAP:
            raise InvalidInput(f"output_cap must be an integer from 0 to {MAX_OUTPUT_CAP}, "
                               f"got {output_cap!r}")
        if timeout_seconds is not None:
            timeout: float | None = _positive("timeout_seconds", timeout_seconds, most=MAX_TTL_SECONDS)
        else:
            timeout = None if background else self.default_timeout
        raw_stdin = stdin.encode() if isinstance(stdin, str) else stdin
        frame = {"argv": argv, "cwd": cwd, "env": _strings("envs", envs, ENV_NAME),
                 "stdin": base64.b64encode(raw_stdin).decode() if raw_stdin else None,
                 "keep_stdin": background and raw_stdin is None}
        command_id, state = self._link.start_command(frame, output_cap, {1: on_stdout, 2: on_stderr})
        handle = CommandHandle(self, command_id, state, timeout)
        return handle if background else handle.wait()

    def run(self, cmd: str | Sequence[str], **kwargs: Any) -> ExecResult:
        """exec() in the foreground, typed as returning an ExecResult."""
        result = self.exec(cmd, **{**kwargs, "background": False})
        assert isinstance(result, ExecResult)
        return result

    # -- lifetime --------------------------------------------------------------------

    def set_ttl(self, ttl_seconds: float) -> None:
        """The sandbox now ends `ttl_seconds` from now (shorter or longer)."""
        ttl = _positive("ttl_seconds", ttl_seconds, most=MAX_TTL_SECONDS)
        self._host.extend_deadline(ttl)

    def is_running(self) -> bool:
        alive = self._running.alive() if self._running is not None else True
        linked = self._link.broken is None or self.handed_over
        return not self._host.destroyed and linked and alive

    # -- the queue's sandboxes (dispatch/executors/warm.py) ------------------------------------

    @classmethod
    def boot_for_runner(cls, chosen: SandboxDriver, spec: SandboxSpec, template: str) -> Sandbox:
        """A sandbox of exactly `spec` (the queue's limits and mounts, a
        read-only root), its agent started as the driver's supervisor (under
        gVisor: the sandbox's root with the capabilities to run each job as
        another uid, rule C1), and no host-side watchdog: the dispatcher's
        own deadline (rule H5) and the reaper end it. Then `hand_over`."""
        from tenantq.sandbox import boot

        return boot.cold_agent(cls, chosen, spec, template=template, supervisor=True)

    @classmethod
    def restore_runner(cls, chosen: SandboxDriver, spec: SandboxSpec, image: Path, template: str) -> Sandbox:
        """A new sandbox resumed from the checkpoint of a handed-over one (a
        template, or a hibernated sandbox): its runner resumes inside its read
        of the next command, on the new sandbox's channel."""
        from tenantq.sandbox import boot

        if not (chosen.snapshots and isinstance(chosen, SnapshotDriver)):
            raise NotSupported(f"the {chosen.name} driver cannot restore checkpoints")
        host, running = chosen.restore(spec, image, boot.agent_argv())
        assert isinstance(host, HostSandbox) and isinstance(running, Running)
        sandbox = cls(host, running, AgentLink(running.channel, read=False), chosen, template=template,
                      metadata={}, timeout_seconds=BOOT_SECONDS)
        sandbox.handed_over = True
        return sandbox

    def hand_over(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Running:
        """The agent execs `argv` as the sandbox's init (the queue's guest
        runner, guest/runner.py); its started process's channel, returned, is
        then the caller's alone, and exec/files of this object refuse
        (SandboxGone). Everything else stays: TTL, checkpoint, delete."""
        if self._running is None:
            raise NotSupported("only the process that created a sandbox can hand it over")
        self._link.hand_over(list(argv), dict(env or {}), BOOT_SECONDS)
        self.handed_over = True
        return self._running

    @property
    def init_process(self) -> Running:
        """The host's process of the sandbox's init (its channel's pipes)."""
        assert self._running is not None
        return self._running

    def checkpoint_and_stop(self, image: Path) -> None:
        """Save the sandbox to `image` (a new dir), which stops it (a
        template's build, a hibernation); delete() then removes the rest."""
        checkpoint = getattr(self._host, "checkpoint", None)
        if checkpoint is None:
            raise NotSupported(f"the {self._driver.name} driver cannot checkpoint")
        checkpoint(image)

    def assign(self, *, tenant: str, labels: dict[str, str], ttl: float) -> None:
        """A pristine sandbox of the ready pool becomes one owner's: its
        tenant, labels and TTL (the host's record of it, sandbox/pool.py)."""
        self._host.spec = dataclasses.replace(self._host.spec, tenant=tenant, labels=labels)
        self._host.update_meta(tenant=tenant, labels=labels, dispatcher_pid=os.getpid())
        self._host.extend_deadline(ttl)
        self.tenant = tenant or None

    def delete(self) -> bool:
        """End the sandbox and remove everything it left on the host;
        False when it was already gone."""
        was = not self._host.destroyed
        self._link.close("the sandbox was deleted")
        if self._proxy is not None:
            (proxy, hub), self._proxy = self._proxy, None
            hub.close(proxy)
        _stop_watchdog(self._host, self._watchdog)
        self._host.destroy()
        if self._running is not None:
            self._running.close()
        return was

    kill = delete

    # -- fork (gVisor) ---------------------------------------------------------------------

    def fork(self, ttl_seconds: float | None = None) -> Sandbox:
        return self.fork_many(1, ttl_seconds=ttl_seconds)[0]

    def fork_many(self, n: int, ttl_seconds: float | None = None) -> builtins.list[Sandbox]:
        from tenantq.sandbox.forking import fork_many

        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64:
            raise InvalidInput(f"n must be an integer from 1 to 64, got {n!r}")
        ttl = self._host.remaining_ttl() if ttl_seconds is None else _positive("ttl_seconds", ttl_seconds,
                                                                                  most=MAX_TTL_SECONDS)
        with self._fork_lock:
            return fork_many(self, n, max(1.0, ttl))

    def _adopt(self, running: Running) -> Running | None:
        """The parent after its restore (sandbox/forking.py); the old run."""
        old, self._running = self._running, running
        return old

    @property
    def host(self) -> HostSandbox:
        return self._host


def remove_sandbox(sandbox_id: str) -> bool:
    """End a sandbox by id (live or past its TTL) and remove its host state;
    False when nothing of it was left."""
    from tenantq.sandbox import attach
    from tenantq.settings import Settings

    if not isinstance(sandbox_id, str) or not attach.SANDBOX_ID.match(sandbox_id):
        raise InvalidInput(f"not a sandbox id: {sandbox_id!r} (ids look like tq-0123456789ab)")
    for name in attach.DRIVERS:
        path = sandboxes_dir() / name / sandbox_id
        meta = read_meta(path)
        if meta is None or API_LABEL not in dict(meta.get("labels") or {}):  # type: ignore[call-overload]
            continue
        chosen, _ = get_driver(name, Settings().data_dir)
        host = chosen.adopt(sandbox_id, path, meta)  # type: ignore[attr-defined]
        _stop_watchdog(host, None)
        host.destroy()
        return True
    return False


def _stop_watchdog(host: HostSandbox, child: subprocess.Popen[bytes] | None) -> None:
    from tenantq.sandbox import watchdog

    if child is not None:
        child.kill()
        child.wait(10)
        return
    meta = read_meta(host.path) or {}
    if "watchdog_pid" in meta:
        watchdog.stop(int(str(meta["watchdog_pid"])), host.id)


_last_reap = [0.0]
REAP_EVERY_SECONDS = 60.0


def reap_now_and_then(driver: SandboxDriver) -> None:
    """Sandboxes whose creator died are ended by their agent at the TTL; what
    they leave on the host (dirs, cgroups, runsc state) goes at the next
    reap. Every create starts one in the background, at most once a minute."""
    now = time.monotonic()
    if now - _last_reap[0] < REAP_EVERY_SECONDS:
        return
    _last_reap[0] = now
    threading.Thread(target=driver.reap, name="tenantq-sandbox-reap", daemon=True).start()


def sandboxes_dir() -> Path:
    from tenantq.settings import Settings

    return Settings().data_dir / "sandboxes"


__all__ = ["CommandHandle", "ExecResult", "NotSupported", "Sandbox", "SandboxGone", "SandboxInfo",
           "SandboxNotFound"]
