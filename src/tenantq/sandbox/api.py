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
import math
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tenantq.errors import InvalidInput
from tenantq.sandbox.agent_link import AgentLink, SandboxGone
from tenantq.sandbox.attach import SandboxInfo, SandboxNotFound
from tenantq.sandbox.commands import CommandHandle, ExecResult
from tenantq.sandbox.core import (
    API_LABEL,
    BOOT_SECONDS,
    MAX_TTL_SECONDS,
    POOLED_LABEL,
    NotSupported,
    SandboxCore,
    stop_watchdog,
)
from tenantq.sandbox.driver import SandboxDriver
from tenantq.sandbox.drivers import get_driver
from tenantq.sandbox.files import Filesystem
from tenantq.sandbox.hostside import HostProcess, HostSandbox, read_meta

if TYPE_CHECKING:
    from tenantq.sandbox.templates import Resolved

DEFAULT_OUTPUT_CAP = 1 << 20
MAX_OUTPUT_CAP = 64 << 20
METADATA_LIMIT = 64
NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


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


class Sandbox(SandboxCore):
    """A running sandbox. Make one with `Sandbox.create(...)`; `with` deletes it.

    The public API over the sandbox's state (sandbox/core.py), which the
    parts share."""

    def __init__(self, host: HostSandbox, running: HostProcess | None, link: AgentLink,
                 driver: SandboxDriver, *, template: str, metadata: dict[str, str],
                 timeout_seconds: float) -> None:
        super().__init__(host, running, link, driver, template=template, metadata=metadata,
                         timeout_seconds=timeout_seconds)
        self.filesystem = Filesystem(self)

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
            assert isinstance(ready, Sandbox)  # the pool holds what `pooled` made
            ready.hand_out(ttl=ttl, metadata=labels, tenant=tenant, env={**env, **secret_env},
                           timeout=timeout)
            made = ready
        else:
            made = cls._boot_new(chosen, resolved, ttl, {f"meta.{k}": v for k, v in labels.items()}, tenant,
                                 memory_mb, float(cpus), env, secret_env, timeout)
        try:
            made.start_egress(allowed)
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
        self.link().close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()

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
        command_id, state = self.link().start_command(frame, output_cap, {1: on_stdout, 2: on_stderr})
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
        self.host.extend_deadline(ttl)

    # -- fork (gVisor) ---------------------------------------------------------------------

    def fork(self, ttl_seconds: float | None = None) -> Sandbox:
        return self.fork_many(1, ttl_seconds=ttl_seconds)[0]

    def fork_many(self, n: int, ttl_seconds: float | None = None) -> builtins.list[Sandbox]:
        from tenantq.sandbox.forking import fork_many

        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64:
            raise InvalidInput(f"n must be an integer from 1 to 64, got {n!r}")
        ttl = self.host.remaining_ttl() if ttl_seconds is None else _positive("ttl_seconds", ttl_seconds,
                                                                                 most=MAX_TTL_SECONDS)
        with self.fork_lock:
            return fork_many(self, n, max(1.0, ttl))


def prepare_template(chosen: SandboxDriver, resolved: Resolved, *, memory_mb: int = 512,
                     cpus: float = 1.0) -> str:
    """Make a template ready on this driver now (`tenantq template create`;
    sandbox/boot.py `prepare`); what was done, in a few words."""
    from tenantq.sandbox import boot

    return boot.prepare(Sandbox, chosen, resolved, memory_mb=memory_mb, cpus=cpus)


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
        stop_watchdog(host, None)
        host.destroy()
        return True
    return False


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
