"""Host-side layout shared by the drivers: what gets mounted into a sandbox
(the Python installation, the app's code and dependencies, read-only), the
skeleton root filesystem with a generated /etc, and per-sandbox directories.

Nothing else of the host is visible: no /etc, /root, /home, /var, no
Postgres socket or data directory, no secrets file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from tenantq.errors import InvalidInput
from tenantq.sandbox.spec import Mount

GUEST_EGRESS_DIR = "/tenantq/egress"
GUEST_UID = 65534
GUEST_GID = 65534
SYSTEM_DIRS = ("/usr",)
API_DIRS = ("work", "workspace", "run")
# the agent's start script; tenantq's source is mounted at its host path
START_AGENT = Path(__file__).resolve().parent.parent / "guest" / "start_agent.py"

ETC_FILES = {
    "passwd": "root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
              "nobody:x:65534:65534:nobody:/tmp:/usr/sbin/nologin\n",
    "group": "root:x:0:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1 localhost\n::1 localhost\n",
    "hostname": "sandbox\n",
    "resolv.conf": "",
    "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
}


@dataclass(frozen=True)
class GuestPython:
    """How to run Python inside: the interpreter, the mounts it needs, and
    the sys.path entries the guest runner adds."""

    executable: str
    mounts: tuple[Mount, ...]
    sys_path: tuple[str, ...]
    site_dirs: tuple[str, ...]
    # tenantq's own package and the app's code: what a template's key hashes
    code_paths: tuple[str, ...] = ()


def _covered(path: str, mounted: list[str]) -> bool:
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounted)


def guest_python(app_module: str | None) -> GuestPython:
    base = os.path.realpath(sys.base_prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    executable = os.path.join(base, "bin", version)
    mounted: list[str] = list(SYSTEM_DIRS)
    mounts: list[Mount] = []

    def add(path: str) -> None:
        real = os.path.realpath(path)
        if os.path.exists(real) and not _covered(real, mounted):
            mounted.append(real)
            mounts.append(Mount(real, real))

    add(base)
    site_dirs = [os.path.realpath(p) for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    for site_dir in site_dirs:
        add(site_dir)
    sys_path: list[str] = []
    tenantq_parent = str(Path(__file__).resolve().parent.parent.parent)
    add(str(Path(tenantq_parent) / "tenantq"))
    sys_path.append(tenantq_parent)
    code_paths = [str(Path(tenantq_parent) / "tenantq")]
    if app_module:
        top = app_module.split(".")[0]
        spec = importlib.util.find_spec(top)
        if spec is not None and spec.origin not in (None, "built-in", "frozen"):
            if spec.submodule_search_locations:  # a package: mount its directory
                location = os.path.realpath(next(iter(spec.submodule_search_locations)))
            else:  # a single-file module: mount only that file
                location = os.path.realpath(spec.origin or "")
            add(location)
            sys_path.append(os.path.dirname(location))
            code_paths.append(location)
    return GuestPython(executable, tuple(mounts), tuple(sys_path), tuple(site_dirs), tuple(code_paths))


def check_mounts(mounts: tuple[Mount, ...]) -> None:
    """Refuse a spec whose mount sources are missing, before anything is made."""
    for m in mounts:
        if not os.path.exists(m.source):
            raise InvalidInput(f"sandbox mount source {m.source} does not exist")
        if not os.path.isabs(m.target):
            raise InvalidInput(f"sandbox mount target {m.target!r} must be an absolute path")


def build_skeleton(base_dir: Path, mounts: tuple[Mount, ...]) -> Path:
    """A read-only root: empty mount points, merged-/usr symlinks, a minimal
    /etc. Built once per set of mount targets and shared by sandboxes."""
    key = hashlib.sha256("\n".join(["v3", *sorted(f"{m.target}:{os.path.isdir(m.source)}" for m in mounts)])
                         .encode()).hexdigest()[:16]
    root = base_dir / f"rootfs-{key}"
    if (root / ".complete").exists():
        return root
    staging = base_dir / f".rootfs-{key}-{uuid.uuid4().hex[:6]}"
    staging.mkdir(parents=True)
    # work, workspace, run: where code written for hosted sandboxes puts its
    # files (`cd /work && ...`); empty, and writable only in a Sandbox API
    # sandbox (its writable layer); the queue's jobs see them read-only
    for d in ("usr", "tmp", "proc", "dev", "etc", "tenantq/work", "tenantq/egress", *API_DIRS):
        (staging / d).mkdir(parents=True, exist_ok=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        os.symlink(f"usr/{link}", staging / link)
    for name, text in ETC_FILES.items():
        (staging / "etc" / name).write_text(text)
    for m in mounts:
        target = staging / m.target.lstrip("/")
        if os.path.isdir(m.source):
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
    for dirpath, dirnames, _ in os.walk(staging):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o755)
    (staging / ".complete").touch()
    try:
        staging.rename(root)
    except OSError:  # another process built it first
        shutil.rmtree(staging, ignore_errors=True)
    return root


def new_sandbox_dir(data_dir: Path, driver: str, *, guest_owns_work: bool) -> tuple[str, Path]:
    """A private directory for one sandbox: <data_dir>/sandboxes/<driver>/<id>
    (the parents are 0700, so no other host user can reach the work dir).

    `guest_owns_work`: the guest's uid is a real host uid (gVisor's gofer
    acts for uid 65534) rather than root mapped into a user namespace."""
    parent = data_dir / "sandboxes" / driver
    parent.mkdir(parents=True, exist_ok=True)
    os.chmod(data_dir / "sandboxes", 0o700)
    sandbox_id = f"tq-{uuid.uuid4().hex[:12]}"
    path = parent / sandbox_id
    path.mkdir(mode=0o700)
    work = path / "work"
    work.mkdir()
    # the batch's egress proxy socket appears here (bound read-only at
    # /tenantq/egress); empty while the tenant has no egress rules
    (path / "egress").mkdir(mode=0o755)
    if guest_owns_work:
        if os.geteuid() == 0:
            os.chown(work, GUEST_UID, GUEST_GID)
        else:
            os.chmod(work, 0o777)  # still private: the parent is 0700
    return sandbox_id, path
