"""Host-side layout shared by the drivers: what gets mounted into a sandbox
(the Python installation, the app's code and dependencies, read-only), the
skeleton root filesystem with a generated /etc, and per-sandbox directories.

Nothing else of the host is visible: no /etc, /root, /home, /var, no
Postgres socket or data directory, no secrets file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tenantq.errors import InvalidInput
from tenantq.sandbox import code_view, install_view
from tenantq.sandbox.spec import Mount

GUEST_EGRESS_DIR = "/tenantq/egress"
GUEST_UID = 65534
GUEST_GID = 65534
SYSTEM_DIRS = ("/usr",)
API_DIRS = ("work", "workspace", "run")
# the app's code as sandboxes see it, and the masks (rule M1)
CODE_DIR = "code"
log = logging.getLogger("tenantq.sandbox")
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

    def app_code(self, module: str, sandbox_paths: Sequence[str] = ()) -> tuple[code_view.AppCode | None,
                                                                                   tuple[Path, ...]]:
        """`module`'s import closure under its own source tree and the
        operator's paths (real paths), both checked (rule M1): InvalidInput
        naming a file that must not be in a sandbox. The closure is None
        when the module is not found here (built in, or not installed)."""
        allowed = tuple(Path(os.path.realpath(p)) for p in sandbox_paths)
        for path in allowed:
            if not path.exists():
                raise InvalidInput(f"--sandbox-path {path}: no such file or directory")
            if path.is_dir():
                code_view.check_tree(path, allowed)
        root = code_view.app_root(module)
        if root is None:
            return None, allowed
        # an app installed into site-packages: its neighbours are other
        # distributions (mounted whole already), not the app's own code
        installed = any(_covered(str(root), [d]) for d in self.site_dirs)
        outside = tuple(Path(p) for p in (*self.code_paths, *_stdlib_dirs()))
        code = code_view.closure(module, root, outside=outside, only_top=installed)
        code_view.check(code, allowed)
        return code, allowed

    def with_app(self, app_module: str, data_dir: Path, sandbox_paths: Sequence[str] = ()) -> GuestPython:
        """This plus the app's code (its checked closure, copied under
        `data_dir`) and the operator's --sandbox-path entries."""
        code, allowed = self.app_code(app_module, sandbox_paths)
        mounts = list(self.mounts)
        sys_path = list(self.sys_path)
        code_paths = list(self.code_paths)
        if code is not None:
            if code.files:
                staged = code_view.stage(code, data_dir / CODE_DIR, allowed)
                for top in code.tops:
                    mounts.append(Mount(str(staged / top), str(code.root / top)))
                code_paths.append(str(staged))
            if str(code.root) not in sys_path:
                sys_path.append(str(code.root))
        mounts += [Mount(str(p), str(p)) for p in allowed]
        return replace(self, mounts=_ordered(mounts), sys_path=tuple(sys_path), code_paths=tuple(code_paths))


class AppView:
    """The guest Python with the app's code (`GuestPython.with_app`),
    re-derived at most every `recheck` seconds, so an edit of the app is
    copied again and reaches the next sandboxes (a new template key). An
    edit that makes the app import a file no sandbox may see keeps the
    previous copy (logged once): the new import then fails in the guest."""

    def __init__(self, install: GuestPython, app_module: str, data_dir: Path,
                 sandbox_paths: Sequence[str] = (), recheck: float = 2.0) -> None:
        self.install, self.app_module, self.data_dir = install, app_module, data_dir
        self.sandbox_paths, self.recheck = tuple(sandbox_paths), recheck
        self._lock = threading.Lock()
        self._current = install.with_app(app_module, data_dir, self.sandbox_paths)  # refuses to start
        self._next_check = time.monotonic() + recheck
        self._refused: str | None = None

    def current(self) -> GuestPython:
        with self._lock:
            if time.monotonic() >= self._next_check:
                try:
                    self._current = self.install.with_app(self.app_module, self.data_dir, self.sandbox_paths)
                    self._refused = None
                except InvalidInput as exc:
                    if str(exc) != self._refused:
                        log.error("the app's code changed, but %s; sandboxes keep the code as it was", exc)
                        self._refused = str(exc)
                self._next_check = time.monotonic() + self.recheck
            return self._current

    def staged(self) -> set[Path]:
        """The copies of the app's code in use (what the collector keeps)."""
        store = self.data_dir / CODE_DIR
        return {Path(m.source).parent for m in self.current().mounts if Path(m.source).parent.parent == store}


def _covered(path: str, mounted: list[str]) -> bool:
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounted)


def _ordered(mounts: Iterable[Mount]) -> tuple[Mount, ...]:
    """Parents before what is mounted inside them (each driver mounts in order)."""
    unique = {m.target: m for m in mounts}
    return tuple(sorted(unique.values(), key=lambda m: (len(Path(m.target).parts), m.target)))


def _stdlib_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    return sorted({os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib") if k in paths})


_installations: dict[Path, GuestPython] = {}
_installations_lock = threading.Lock()


def guest_python(data_dir: Path | None = None) -> GuestPython:
    """The Python installation as every sandbox sees it (rule M1): /usr, the
    interpreter's prefix, the site-packages directories on this process's
    sys.path and tenantq's package, read-only at their host paths, with what
    install_view hides covered by empty read-only files and directories
    (made under `data_dir`, default the settings' data dir)."""
    if data_dir is None:
        from tenantq.settings import Settings

        data_dir = Settings().data_dir
    with _installations_lock:
        cached = _installations.get(data_dir)
        if cached is None:
            cached = _installations[data_dir] = _installation(data_dir)
        return cached


def _installation(data_dir: Path) -> GuestPython:
    base = os.path.realpath(sys.base_prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    executable = os.path.join(base, "bin", version)
    mounted: list[str] = list(SYSTEM_DIRS)
    trees: list[str] = []

    def add(path: str) -> None:
        real = os.path.realpath(path)
        if os.path.exists(real) and not _covered(real, trees):
            trees.append(real)

    # the installation as trees to mount and scan; under /usr (the system's
    # Python) its standard library and site directories are the trees
    for path in ([base] if not _covered(base, mounted) else _stdlib_dirs()):
        add(path)
    site_dirs = [os.path.realpath(p) for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    for site_dir in site_dirs:
        add(site_dir)
    tenantq_parent = str(Path(__file__).resolve().parent.parent.parent)
    add(str(Path(tenantq_parent) / "tenantq"))
    masks = mask_sources(data_dir)
    mounts = [Mount(t, t) for t in trees if not _covered(t, mounted)]
    stdlib_tests = [os.path.join(d, "test") for d in _stdlib_dirs()]
    hidden = install_view.hidden(trees, site_dirs, stdlib_tests)
    mounts += [Mount(str(masks[is_dir]), path) for path, is_dir in hidden]
    if hidden:
        shown = ", ".join(path for path, _ in hidden[:5]) + (", ..." if len(hidden) > 5 else "")
        log.info("sandboxes do not see %d file(s) or dir(s) of the Python installation (rule M1): %s",
                 len(hidden), shown)
    return GuestPython(executable, _ordered(mounts), (tenantq_parent,), tuple(site_dirs),
                       (str(Path(tenantq_parent) / "tenantq"),))


def mask_sources(data_dir: Path) -> dict[bool, Path]:
    """An empty read-only file and directory to cover what a sandbox must not
    see ({False: file, True: directory})."""
    masks = data_dir / CODE_DIR / "masks"
    masks.mkdir(parents=True, exist_ok=True)
    empty_file, empty_dir = masks / "file", masks / "dir"
    if not empty_file.exists():
        empty_file.touch()
    empty_dir.mkdir(exist_ok=True)
    os.chmod(empty_file, 0o444)
    os.chmod(empty_dir, 0o555)
    return {False: empty_file, True: empty_dir}


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
    # only the outermost mounts need a mount point here: one inside another
    # (a mask, the app's code in a site-packages tree) has it in its parent
    targets = [m.target for m in mounts]
    mounts = tuple(m for m in mounts if not any(m.target != t and _covered(m.target, [t]) for t in targets))
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
