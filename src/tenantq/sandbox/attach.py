"""Finding Sandbox API sandboxes made by any process on this host:
`Sandbox.list(metadata=...)` and `Sandbox.connect(sandbox_id)`.

What the host knows about a sandbox it reads from its own metadata file
(`<data_dir>/sandboxes/<driver>/<id>/sandbox.json`, host-only, never in
the sandbox). To talk to a running sandbox from another process, the host
listens on a new Unix socket in the sandbox's control dir (host-owned,
read-only inside at /tenantq/egress) and signals the agent, which connects
to it. The host never connects to, opens or follows anything the guest
made (docs/security.md, rule H1); whatever answers on that socket is, as
always, hostile input (sandbox/agent_link.py).
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from tenantq.egress.sockets import bound_socket
from tenantq.errors import InvalidInput
from tenantq.sandbox.channel import Channel
from tenantq.sandbox.hostside import HostSandbox, read_meta

SANDBOX_ID = re.compile(r"^tq-[0-9a-f]{12}$")
DRIVERS = ("gvisor", "process")
CONNECT_SECONDS = 10.0


class SandboxNotFound(InvalidInput, LookupError):
    """No live Sandbox API sandbox has that id on this host."""


@dataclass(frozen=True)
class SandboxInfo:
    id: str
    driver: str
    template: str
    tenant: str | None
    metadata: dict[str, str]
    created: float
    deadline: float


def _info(path: Path, meta: dict[str, object], api_label: str) -> SandboxInfo | None:
    labels = meta.get("labels")
    if not isinstance(labels, dict) or api_label not in labels or "tenantq.pooled" in labels:
        return None  # not an API sandbox, or one waiting in a ready pool
    try:
        deadline = float(str(meta["deadline"]))
        created = float(str(meta.get("created", 0)))
    except (KeyError, ValueError):
        return None
    if deadline < time.time():
        return None
    metadata = {str(k)[5:]: str(v) for k, v in labels.items() if str(k).startswith("meta.")}
    return SandboxInfo(id=path.name, driver=str(meta.get("driver")), template=str(labels[api_label]),
                       tenant=str(meta.get("tenant")) or None, metadata=metadata, created=created,
                       deadline=deadline)


def list_sandboxes(base: Path, api_label: str, metadata: dict[str, str] | None) -> list[SandboxInfo]:
    """Live API sandboxes, oldest first, whose metadata has every given key and value."""
    found: list[SandboxInfo] = []
    for driver in DRIVERS:
        directory = base / driver
        if not directory.is_dir():
            continue
        for path in directory.iterdir():
            if not SANDBOX_ID.match(path.name):
                continue
            meta = read_meta(path)
            info = _info(path, meta, api_label) if meta else None
            if info is not None and all(info.metadata.get(k) == v for k, v in (metadata or {}).items()):
                found.append(info)
    return sorted(found, key=lambda i: (i.created, i.id))


def find(base: Path, sandbox_id: str, api_label: str) -> tuple[Path, dict[str, object]]:
    if not isinstance(sandbox_id, str) or not SANDBOX_ID.match(sandbox_id):
        raise InvalidInput(f"not a sandbox id: {sandbox_id!r} (ids look like tq-0123456789ab)")
    for driver in DRIVERS:
        path = base / driver / sandbox_id
        meta = read_meta(path)
        if meta is not None and _info(path, meta, api_label) is not None:
            return path, meta
    raise SandboxNotFound(f"no running sandbox {sandbox_id} on this host (ended, deleted, or past its TTL)")


def open_channel(host: HostSandbox, timeout: float = CONNECT_SECONDS) -> Channel:
    """A new channel to the sandbox's agent: listen in the control dir, wake
    the agent (SIGUSR1 to the sandbox's init), accept its connection."""
    name = f"client-{uuid.uuid4().hex[:12]}.sock"
    path = host.egress_dir / name
    # bound through a /proc/self/fd alias of the dir: socket paths are short
    listener = bound_socket(path)
    try:
        listener.settimeout(0.2)
        deadline = time.monotonic() + timeout
        while True:
            host.signal_init(signal.SIGUSR1)  # type: ignore[attr-defined]
            try:
                conn, _ = listener.accept()
                break
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"sandbox {host.id} did not answer within {timeout:g} s") from None
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    fd = conn.detach()
    return Channel(fd, fd, lambda: True)
