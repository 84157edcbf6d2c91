"""The app's code as a sandbox sees it (docs/security.md, rule M1).

A sandbox gets the modules its handlers import, never the project they live
in: the `--app` module (or a template's warmup module) and every module of
the app's own source tree it imports, found by reading the source on the
host (`import` and `from ... import` at any depth of a file, and
`importlib.import_module("literal")`), transitively, with each package's
`__init__.py`. Those files are copied into `<data_dir>/code/<digest>/`,
named by their content, and each top-level package (or module) of the copy
is mounted read-only at its host path. So a sandbox sees exactly the files
that were checked, as they were checked: a project's `settings.py`, `.env`,
deploy keys and `.git` stay on the host, and a file the host checked cannot
be swapped for another before a sandbox mounts it.

Files that hold configuration or credentials by their name are refused
(`refusal`): a worker whose app imports one, or whose `--sandbox-path`
directory holds one, does not start. The operator's only override is a
`--sandbox-path` that names that very file.
"""

from __future__ import annotations

import ast
import contextlib
import fnmatch
import hashlib
import importlib.machinery
import os
import py_compile
import shutil
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tenantq.errors import InvalidInput
from tenantq.sandbox.digests import DIGESTS

# (pattern on the file's name, what it is), matched case-insensitively
DENIED_NAMES = (
    (".env", "an environment file"), (".env.*", "an environment file"), ("*.env", "an environment file"),
    (".envrc", "an environment file"),
    ("settings*.py", "a settings file"), ("local_settings.py", "a settings file"),
    ("secrets.*", "a secrets file"), ("credentials*", "a credentials file"),
    ("*.pem", "a key or certificate file"), ("*.key", "a key file"), ("*.p12", "a key file"),
    ("*.pfx", "a key file"), ("*.jks", "a key store"), ("id_rsa*", "an SSH key"),
    ("id_ecdsa*", "an SSH key"), ("id_ed25519*", "an SSH key"), (".netrc", "a credentials file"),
    (".pgpass", "a credentials file"), (".pypirc", "a credentials file"), ("pip.conf", "a pip configuration"),
    ("pip.ini", "a pip configuration"), (".git-credentials", "a credentials file"),
    (".npmrc", "a credentials file"),
)
# a directory of one of these names: everything in it
DENIED_DIRS = (("settings", "in a settings directory"), (".git", "in a git directory"))
IMPORTERS = ("import_module", "__import__")


def refusal(path: Path, root: Path) -> str | None:
    """Why `path` (under `root`) must never be in a sandbox, else None."""
    name = path.name.lower()
    for pattern, what in DENIED_NAMES:
        if fnmatch.fnmatchcase(name, pattern):
            return what
    try:
        parts = path.relative_to(root).parts[:-1]
    except ValueError:
        parts = path.parts[:-1]
    for part in parts:
        for dirname, what in DENIED_DIRS:
            if part.lower() == dirname:
                return what
    return None


@dataclass(frozen=True)
class AppCode:
    """The files of the app's closure (host paths -> the module that
    imports each, `None` for the app module itself), under `root`."""

    root: Path
    files: dict[Path, str | None]

    @property
    def tops(self) -> tuple[str, ...]:
        """The top-level packages or modules the closure spans."""
        return tuple(sorted({p.relative_to(self.root).parts[0] for p in self.files}))

    def digest(self) -> str:
        h = hashlib.sha256(str(self.root).encode())
        for path in sorted(self.files):
            h.update(f"\n{path.relative_to(self.root)}\0{DIGESTS.file(str(path))}".encode())
        return h.hexdigest()[:20]


def app_root(module: str) -> Path | None:
    """The sys.path entry the app's top-level package or module is found
    under (None: built in, frozen, or not found)."""
    import importlib.util

    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec(module.split(".")[0])
        if spec is not None and spec.origin not in (None, "built-in", "frozen"):
            if spec.submodule_search_locations:
                location = os.path.realpath(next(iter(spec.submodule_search_locations)))
            else:
                location = os.path.realpath(spec.origin or "")
            return Path(os.path.dirname(location))
    return None


def closure(module: str, root: Path, *, outside: Sequence[Path] = (), only_top: bool = False) -> AppCode:
    """The files of `module` and of every module under `root` it imports,
    transitively. Files under `outside` (tenantq's own package, the
    installation trees) are left out: they are mounted already. With
    `only_top`, only modules of `module`'s own top-level package count (an
    app installed into site-packages, whose neighbours are other
    distributions)."""
    found: dict[Path, str | None] = {}
    parsed: set[Path] = set()
    todo: list[tuple[str, str | None]] = [(module, None)]
    top = module.split(".")[0]
    while todo:
        name, importer = todo.pop()
        if only_top and name.split(".")[0] != top:
            continue
        for path in _files_of(name, root):
            if any(_under(Path(os.path.realpath(path)), o) for o in outside):
                continue
            found.setdefault(path, importer)
            if path in parsed or path.suffix != ".py":
                continue
            parsed.add(path)
            here = _module_of(path, root)
            package = here if path.name == "__init__.py" else here.rpartition(".")[0]
            todo.extend((imported, here) for imported in _imports(path, package))
    return AppCode(root, found)


def _under(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def _module_of(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _files_of(name: str, root: Path) -> list[Path]:
    """The files importing `name` runs under `root`: each package's
    `__init__.py` on the way, then the module's own file."""
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        return []
    out: list[Path] = []
    directory = root
    for i, part in enumerate(parts):
        package = directory / part
        if package.is_dir():
            if (package / "__init__.py").is_file():
                out.append(package / "__init__.py")
            directory = package  # a namespace package has no __init__.py
            continue
        if i == len(parts) - 1:
            for suffix in (".py", *importlib.machinery.EXTENSION_SUFFIXES):
                if (directory / f"{part}{suffix}").is_file():
                    out.append(directory / f"{part}{suffix}")
                    break
        break  # not (a package of) this tree: the stdlib, an installed distribution, or missing
    return out


def _imports(path: Path, package: str) -> list[str]:
    """Every module name `path`'s source can import (statically), absolute."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            if base is None:
                continue
            names.append(base)
            # `from pkg import sub`: sub may be a module of pkg
            names.extend(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) \
                else None
            if called in IMPORTERS and not node.args[0].value.startswith("."):
                names.append(node.args[0].value)
    return names


def _absolute(module: str | None, level: int, package: str) -> str | None:
    if level == 0:
        return module
    parts = package.split(".") if package else []
    if level - 1 > len(parts) or (level - 1 == len(parts) and not module):
        return None
    base = parts[:len(parts) - (level - 1)]
    return ".".join([*base, *([module] if module else [])]) or None


def check(code: AppCode, allowed: Iterable[Path] = ()) -> None:
    """InvalidInput naming the first file of the closure that must never be
    in a sandbox (unless `allowed` names that very file)."""
    exact = {Path(os.path.realpath(p)) for p in allowed}
    for path in sorted(code.files):
        real = Path(os.path.realpath(path))  # a symlinked module: its target's name counts too
        why = refusal(path, code.root) or (refusal(real, real.parent) if real != path else None)
        if why is not None and path not in exact:
            importer = code.files[path]
            by = f", imported by {importer}" if importer else ""
            raise InvalidInput(
                f"sandboxes would see {path} ({why}){by}: keep it out of what sandboxed handlers "
                f"import, or name this file with --sandbox-path if it holds no secret")


def check_tree(directory: Path, allowed: Iterable[Path]) -> None:
    """InvalidInput naming the first file under `directory` (an operator's
    --sandbox-path) that must never be in a sandbox, unless named itself."""
    exact = {Path(os.path.realpath(p)) for p in allowed}
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames.sort()
        for name in sorted([*filenames, *(d for d in dirnames if d.lower() in (".git", "settings"))]):
            path = Path(dirpath) / name
            why = refusal(path, directory.parent) if path.is_file() else refusal(path / "x", directory.parent)
            if why is not None and path not in exact:
                raise InvalidInput(f"sandboxes would see {path} ({why}), in --sandbox-path {directory}: "
                                   "name that file itself with --sandbox-path if it holds no secret")


def stage(code: AppCode, store: Path, mount_points: Iterable[Path] = ()) -> Path:
    """The closure copied into `store/<digest>/` (built once, in a staging
    dir renamed into place), with empty mount points for the operator's
    paths that lie inside it. Returns the copy's root."""
    points = sorted(p for p in mount_points if any(_under(p, code.root / t) for t in code.tops))
    digest = hashlib.sha256(f"{code.digest()}\n{points}".encode()).hexdigest()[:20]
    target = store / digest
    if target.is_dir():
        os.utime(target)  # in use: the collector goes by age
        return target
    store.mkdir(parents=True, exist_ok=True)
    os.chmod(store, 0o755)
    staging = store / f".{digest}-{uuid.uuid4().hex[:8]}"
    try:
        copy_into(code, staging, points)
        with contextlib.suppress(OSError):  # another worker staged the same code first
            staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def copy_into(code: AppCode, directory: Path, mount_points: Iterable[Path] = ()) -> None:
    """Copy the closure's files into `directory` at their places relative to
    the app root, read-only, compiled; with empty mount points."""
    for path in code.files:
        copy = directory / path.relative_to(code.root)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
        if copy.suffix == ".py":
            # the mount is read-only: compiled here, once, for the guest's
            # interpreter (this one), under the host path tracebacks show
            py_compile.compile(str(copy), dfile=str(path), doraise=False, quiet=2)
        os.chmod(copy, 0o444)
    for point in mount_points:
        inside = directory / point.relative_to(code.root)
        if point.is_dir():
            inside.mkdir(parents=True, exist_ok=True)
        elif not inside.exists():
            inside.parent.mkdir(parents=True, exist_ok=True)
            inside.touch(mode=0o444)
    for dirpath, _, _ in os.walk(directory):
        os.chmod(dirpath, 0o755)


def with_paths(code: AppCode, paths: Iterable[Path]) -> AppCode:
    """The closure plus every file of the operator's paths (which must lie
    under the app root: a template's layer holds them at the same place)."""
    files = dict(code.files)
    for path in paths:
        if not _under(path, code.root):
            raise InvalidInput(f"--sandbox-path {path} is not under the app's directory {code.root}")
        walked = [path] if path.is_file() else sorted(
            Path(d) / f for d, _, names in os.walk(path) for f in names)
        files.update((f, None) for f in walked if f.is_file())
    return AppCode(code.root, files)


def collect(store: Path, keep: Iterable[Path], *, older_than: float, now: float) -> list[Path]:
    """Remove copies not in `keep` untouched for `older_than` seconds."""
    kept = {Path(p) for p in keep}
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for path in store.iterdir():
            with contextlib.suppress(OSError):
                if path.is_dir() and path not in kept and now - path.stat().st_mtime > older_than:
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
    return removed
