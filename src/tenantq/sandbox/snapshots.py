"""Checkpoint images on disk: templates and hibernated sandboxes.

A template is a warm guest runner (app imported, warmups run, blocked on
stdin) checkpointed once per key: the app's code and dependencies (content
hash), the interpreter, tenantq's own code, the driver and runsc version,
and the sandbox limits. Every new batch sandbox restores from it. A key that
changes (the app's code was edited, a dependency upgraded) simply names a new
template; old ones are garbage-collected once unused.

A hibernated sandbox is a kept-warm one that sat idle: checkpointed to disk
per tenant and destroyed, restored by that tenant's next batch.

    <data_dir>/snapshots/<driver>/templates/<key>/{image/, meta.json, used}
    <data_dir>/snapshots/<driver>/hibernated/<tenant>/<id>/{image/, meta.json}

Builders hold a flock per key, so two workers on one host build a template
once; images are built in a staging dir and renamed into place.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenantq.sandbox.digests import DIGESTS
from tenantq.sandbox.layout import GuestPython
from tenantq.sandbox.spec import SandboxSpec

# a template nobody restored for this long is removed
TEMPLATE_MAX_IDLE_SECONDS = 24 * 3600.0
# a template superseded by a newer one for the same app and driver is
# removed once unused this long (workers of the previous deploy may still run)
SUPERSEDED_GRACE_SECONDS = 600.0
HIBERNATED_MAX_AGE_SECONDS = 24 * 3600.0
STAGING_MAX_AGE_SECONDS = 3600.0
# restores touch `used` at most this often
TOUCH_EVERY_SECONDS = 60.0


@dataclass(frozen=True)
class Template:
    key: str
    path: Path
    meta: dict[str, Any]

    @property
    def image(self) -> Path:
        return self.path / "image"

    @property
    def last_used(self) -> float:
        try:
            return (self.path / "used").stat().st_mtime
        except OSError:
            return float(self.meta.get("created", 0.0))

    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.image.rglob("*") if f.is_file())


_RUNTIME_VERSIONS: dict[str, str] = {}


def runtime_version(command: list[str]) -> str:
    key = " ".join(command)
    if key not in _RUNTIME_VERSIONS:
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            out = "unknown"
        _RUNTIME_VERSIONS[key] = out.strip()
    return _RUNTIME_VERSIONS[key]


def template_key(app: str, guest: GuestPython, spec: SandboxSpec, driver: str, runtime: str) -> str:
    """What a template depends on, hashed: change any of it and it is a new template."""
    parts = {
        "app": app, "driver": driver, "runtime": runtime, "python": sys.version,
        "executable": guest.executable,
        "limits": [spec.memory_mb, spec.cpus, spec.max_pids, spec.tmp_mb, spec.work_mb],
        "mounts": sorted(f"{m.source}:{m.target}" for m in spec.mounts),
        "code": {path: DIGESTS.tree(path) for path in guest.code_paths},
        # installed distributions: their dist-info names carry the versions
        "deps": {d: sorted(n for n in os.listdir(d) if n.endswith((".dist-info", ".egg-info", ".pth")))
                 for d in guest.site_dirs if os.path.isdir(d)},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class SnapshotStore:
    """Templates and hibernated images of one driver under the data dir."""

    def __init__(self, data_dir: Path, driver: str) -> None:
        self.root = data_dir / "snapshots" / driver
        self.templates_dir = self.root / "templates"
        self.hibernated_dir = self.root / "hibernated"
        self.driver = driver

    # -- templates -------------------------------------------------------
    def template(self, key: str) -> Template | None:
        path = self.templates_dir / key
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, ValueError):
            return None
        return Template(key, path, meta)

    def templates(self) -> list[Template]:
        if not self.templates_dir.is_dir():
            return []
        found = (self.template(p.name) for p in self.templates_dir.iterdir() if not p.name.startswith("."))
        return sorted((t for t in found if t is not None), key=lambda t: float(t.meta.get("created", 0)))

    def get_or_build(self, key: str, meta: dict[str, Any], build: Callable[[Path], None]) -> Template:
        """The template for `key`, building it (once per host) if missing.
        `build(image_dir)` writes a checkpoint into the new dir."""
        existing = self.template(key)
        if existing is not None:
            return existing
        with _flock(self.templates_dir / f".{key}.lock"):
            existing = self.template(key)
            if existing is not None:
                return existing
            staging = self.templates_dir / f".{key}-{uuid.uuid4().hex[:8]}"
            staging.mkdir(parents=True)
            try:
                started = time.monotonic()
                build(staging / "image")
                meta = {**meta, "key": key, "driver": self.driver, "created": time.time(),
                        "build_seconds": round(time.monotonic() - started, 3)}
                (staging / "meta.json").write_text(json.dumps(meta))
                staging.rename(self.templates_dir / key)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        with contextlib.suppress(OSError):
            (self.templates_dir / f".{key}.lock").unlink()
        built = self.template(key)
        assert built is not None
        return built

    def touch(self, template: Template) -> None:
        used = template.path / "used"
        with contextlib.suppress(OSError):
            if time.time() - used.stat().st_mtime < TOUCH_EVERY_SECONDS:
                return
        with contextlib.suppress(OSError):
            used.touch()

    def remove(self, key: str) -> bool:
        path = self.templates_dir / key
        if not path.is_dir():
            return False
        # rename first: a concurrent restore either got the whole image or none
        doomed = self.templates_dir / f".rm-{key}-{uuid.uuid4().hex[:6]}"
        with contextlib.suppress(OSError):
            path.rename(doomed)
            path = doomed
        shutil.rmtree(path, ignore_errors=True)
        return True

    # -- hibernated sandboxes ---------------------------------------------
    def hibernate_dir(self, tenant: str, key: str) -> Path:
        """A fresh dir for one tenant's hibernated sandbox; its `image` is
        written by the checkpoint, then `commit_hibernated` publishes it."""
        path = self._tenant_dir(tenant) / f".{key}-{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        return path

    def commit_hibernated(self, staging: Path, meta: dict[str, Any]) -> Path:
        (staging / "meta.json").write_text(json.dumps({**meta, "hibernated": time.time()}))
        final = staging.with_name(staging.name.lstrip("."))
        staging.rename(final)
        return final

    def take_hibernated(self, tenant: str, key: str) -> Path | None:
        """Claim one hibernated image of `tenant` made from template `key`
        (a rename, so two workers never restore the same one)."""
        base = self._tenant_dir(tenant)
        if not base.is_dir():
            return None
        for path in sorted(base.iterdir()):
            if path.name.startswith(".") or not path.name.startswith(f"{key}-"):
                continue
            claimed = path.with_name(f".taken-{path.name}")
            try:
                path.rename(claimed)
            except OSError:
                continue
            return claimed
        return None

    def hibernated(self) -> list[tuple[str, Path]]:
        if not self.hibernated_dir.is_dir():
            return []
        return [(bytes.fromhex(t.name).decode(), p) for t in sorted(self.hibernated_dir.iterdir())
                if t.is_dir() for p in sorted(t.iterdir()) if not p.name.startswith(".")]

    def _tenant_dir(self, tenant: str) -> Path:
        # hex: a tenant id may be "..", and must never become a path
        return self.hibernated_dir / tenant.encode().hex()

    # -- garbage collection -------------------------------------------------
    def gc(self, *, current: set[str] | None = None, now: float | None = None,
           max_idle: float = TEMPLATE_MAX_IDLE_SECONDS, superseded_grace: float = SUPERSEDED_GRACE_SECONDS,
           ) -> list[str]:
        """Remove templates unused for `max_idle`, templates superseded by a
        newer one of the same app (unused for `superseded_grace`), hibernated
        images past their age or of a template that is gone, and leftovers of
        interrupted builds. `current`: keys in use right now (never removed)."""
        now = time.time() if now is None else now
        current = current or set()
        removed: list[str] = []
        templates = self.templates()
        newest: dict[str, float] = {}
        for t in templates:
            app = str(t.meta.get("app"))
            newest[app] = max(newest.get(app, 0.0), float(t.meta.get("created", 0)))
        for t in templates:
            if t.key in current:
                continue
            idle = now - t.last_used
            superseded = float(t.meta.get("created", 0)) < newest[str(t.meta.get("app"))]
            if idle > max_idle or (superseded and idle > superseded_grace):
                self.remove(t.key)
                removed.append(f"template {t.key}")
        keys = {t.key for t in self.templates()}
        for tenant, path in self.hibernated():
            try:
                meta = json.loads((path / "meta.json").read_text())
            except (OSError, ValueError):
                meta = {}
            too_old = now - float(meta.get("hibernated", 0)) > HIBERNATED_MAX_AGE_SECONDS
            if too_old or meta.get("key") not in keys:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(f"hibernated {tenant}/{path.name}")
        for parent in (self.templates_dir, *self._tenant_dirs()):
            if not parent.is_dir():
                continue
            for path in parent.iterdir():
                stale = now - path.stat().st_mtime > STAGING_MAX_AGE_SECONDS
                if path.name.startswith(".") and stale and not path.name.endswith(".lock"):
                    shutil.rmtree(path, ignore_errors=True)
        return removed

    def _tenant_dirs(self) -> list[Path]:
        if not self.hibernated_dir.is_dir():
            return []
        return [p for p in self.hibernated_dir.iterdir() if p.is_dir()]
