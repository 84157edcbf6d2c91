"""Templates of the Sandbox API: what `Sandbox.create(template=NAME)` starts from.

A template is a name and a definition: the template it builds on (`from`),
Python requirements, and a warmup (`module:function`). Two are built in:
`base` (a POSIX shell, coreutils and python3 with its standard library: the
host's interpreter, read-only) and `code-interpreter` (base plus
CODE_INTERPRETER_PACKAGES, installed on first use). `tenantq template create`
adds more; per-tenant dependencies are a template per tenant.

What a template is made of, host side (under the data dir, root only; the
sandbox sees the layers read-only and nothing else of it):

    <data_dir>/templates/<name>/template.json   its definition
    <data_dir>/templates/<name>/layer-<key>/    `pip install --target` of its
                                                requirements, plus a copy of
                                                its warmup's code

and, on gVisor, a checkpoint of a sandbox booted from it with its warmup run,
kept in the snapshot store (sandbox/snapshots.py) as app "template:<name>".
Both are keyed by everything they depend on (the requirements, the warmup's
code, the Python version; for the checkpoint also tenantq's code, runsc's
version and the sandbox's limits): change one and the next create builds a
new one, once per host (a flock per key), in a staging dir renamed into
place. A template never holds a tenant's data: it is built with no tenant,
no secrets and no envs, which every create adds afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tenantq.errors import InvalidInput
from tenantq.sandbox import code_view
from tenantq.sandbox.digests import DIGESTS
from tenantq.sandbox.hostside import META_FILE
from tenantq.sandbox.layout import guest_python
from tenantq.sandbox.snapshots import _flock
from tenantq.sandbox.spec import Mount

BUILTIN = ("base", "code-interpreter")
# the stated set of code-interpreter (wheels only; pip picks this Python's)
CODE_INTERPRETER_PACKAGES = ("numpy", "pandas")
# matched whole (fullmatch: "$" would let a trailing newline through)
NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
WARMUP = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*")
PIP_TIMEOUT_SECONDS = 900.0
# a sandbox's PATH (sandbox/drivers/gvisor.py, process.py BASE_ENV)
GUEST_PATH = "/usr/local/bin:/usr/bin:/bin"
MAX_REQUIREMENTS_BYTES = 64 << 10
MAX_DEPTH = 8


@dataclass(frozen=True)
class TemplateDef:
    name: str
    base: str | None = "base"
    requirements: str = ""
    warmup: str | None = None
    # the warmup's code on the host when the template was created: the app
    # root, the files copied into the layer (the warmup module's import
    # closure and --sandbox-path files, relative to the root: rule M1) and
    # their digest then; a template changes only when `tenantq template
    # create` runs again
    code: str | None = None
    code_digest: str | None = None
    files: tuple[str, ...] = ()
    created: float = field(default=0.0, compare=False)

    @property
    def builtin(self) -> bool:
        return self.name in BUILTIN


@dataclass(frozen=True)
class Resolved:
    """A template ready to boot from: its layers (read-only mounts, put
    first on PYTHONPATH, innermost template last) and its warmups in order."""

    name: str
    layers: tuple[Path, ...]
    warmups: tuple[str, ...]
    key: str

    @property
    def mounts(self) -> tuple[Mount, ...]:
        return tuple(Mount(str(p), str(p)) for p in self.layers)

    @property
    def python_path(self) -> tuple[str, ...]:
        out: list[str] = []
        for layer in self.layers:
            out += [str(layer / "site"), str(layer / "code")]
        return tuple(out)


def _builtin(name: str) -> TemplateDef:
    if name == "base":
        return TemplateDef("base", base=None)
    return TemplateDef("code-interpreter", requirements="\n".join(CODE_INTERPRETER_PACKAGES) + "\n")


def templates_dir(data_dir: Path) -> Path:
    return data_dir / "templates"


def check_name(name: object) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidInput(f"a template name is 1-63 lowercase letters, digits or _ . - (starting with a "
                           f"letter or digit), got {name!r}")
    return name


def check_requirements(text: str) -> None:
    """Only named requirements from the index (`numpy>=2`, `pandas[xml]; python_version>"3.10"`)
    and absolute paths of wheel files: no options (`-e`, `-r`, `-c`,
    `--index-url`...), no other paths (source trees), no URLs. pip
    builds a local source tree by running its build backend, on the host
    and as root, whatever `--only-binary` says, and `-r FILE` reads a host
    file; a template's inputs may come from a tenant."""
    from packaging.requirements import InvalidRequirement, Requirement

    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        shown = line[:80]
        if line.endswith(".whl") and os.path.isabs(line):
            # a wheel file the operator built: unpacked, never run, on the host
            if not os.path.isfile(line):
                raise InvalidInput(f"requirements line {number}: {shown!r}: no such wheel file")
            continue
        if line.startswith("-"):
            raise InvalidInput(f"requirements line {number}: {shown!r}: options are not allowed, only "
                               "package names with versions (wheels from the index)")
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            raise InvalidInput(f"requirements line {number}: {shown!r} is not a package name with an "
                               "optional version (paths and URLs are not allowed)") from None
        if requirement.url:
            raise InvalidInput(f"requirements line {number}: {shown!r}: a URL or path is not allowed, "
                               "only packages from the index")


def definition(data_dir: Path, name: str) -> TemplateDef:
    """The definition of `name`; InvalidInput naming the templates if none."""
    check_name(name)
    if name in BUILTIN:
        return _builtin(name)
    try:
        raw = json.loads((templates_dir(data_dir) / name / "template.json").read_text())
        if raw.get("code") and "files" not in raw:
            raise InvalidInput(f"template {name!r} was made by an earlier tenantq, which copied its warmup's "
                               f"whole package into it (settings and keys too): run tenantq template create "
                               f"{name} again")
        return TemplateDef(name=name, base=raw.get("base"), requirements=str(raw.get("requirements") or ""),
                           warmup=raw.get("warmup"), code=raw.get("code"), code_digest=raw.get("code_digest"),
                           files=tuple(str(f) for f in raw.get("files") or ()),
                           created=float(raw.get("created") or 0.0))
    except FileNotFoundError:
        known = ", ".join(d.name for d in definitions(data_dir))
        raise InvalidInput(f"unknown template {name!r}: the templates are {known} "
                           "(tenantq template create NAME makes one)") from None
    except (OSError, ValueError, TypeError) as exc:
        raise InvalidInput(f"template {name!r} is unreadable ({exc}): remove it with tenantq template rm "
                           f"{name}") from None


def definitions(data_dir: Path) -> list[TemplateDef]:
    custom = []
    root = templates_dir(data_dir)
    if root.is_dir():
        for path in sorted(root.iterdir()):
            if path.name not in BUILTIN and NAME.match(path.name) and (path / "template.json").is_file():
                with contextlib.suppress(InvalidInput):
                    custom.append(definition(data_dir, path.name))
    return [_builtin(n) for n in BUILTIN] + custom


def _warmup_code(warmup: str | None, sandbox_paths: Sequence[str]) -> code_view.AppCode | None:
    """The warmup module's checked import closure and the operator's paths
    (copied into the layer: rule M1), or None when the module is to be found
    in the requirements."""
    if warmup is None:
        return None
    module = warmup.split(":")[0]
    # looked up as `python -m` would: the current directory first (the
    # installed `tenantq` script's sys.path does not have it)
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        code, allowed = guest_python().app_code(module, sandbox_paths)
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(cwd)
    return code_view.with_paths(code, allowed) if code is not None and code.files else None


def _digest(root: str, files: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(f"{f}\0{DIGESTS.file(os.path.join(root, f))}" for f in files)
                          .encode()).hexdigest()


def _layer_key(defn: TemplateDef, under: str) -> str:
    parts = {"requirements": defn.requirements, "python": sys.version, "under": under,
             "warmup": defn.warmup, "code": defn.code_digest}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _build_layer(layer: Path, defn: TemplateDef) -> None:
    """pip installs the requirements into `layer`/site (wheels from the index
    only, `check_requirements`: nothing is built or run on the host for a
    template) and copies the warmup's code."""
    with _flock(layer.parent / f".{layer.name}.lock"):
        if layer.is_dir():
            return
        staging = layer.with_name(f".{layer.name}-{uuid.uuid4().hex[:8]}")
        (staging / "site").mkdir(parents=True)
        (staging / "code").mkdir()
        try:
            if defn.requirements.strip():
                requirements = staging / "requirements.txt"
                requirements.write_text(defn.requirements)
                # for the python3 a sandbox finds on its PATH (the host's /usr),
                # which may not be the interpreter running tenantq
                guest = shutil.which("python3", path=GUEST_PATH) or sys.executable
                done = subprocess.run(
                    [sys.executable, "-m", "pip", "--python", guest, "install", "--quiet", "--no-input",
                     "--disable-pip-version-check", "--only-binary=:all:", "--target", str(staging / "site"),
                     "-r", str(requirements)],
                    # in the empty staging dir: no name can mean a directory here
                    cwd=staging / "code", capture_output=True, text=True, timeout=PIP_TIMEOUT_SECONDS)
                if done.returncode != 0:
                    why = (done.stderr.strip() or done.stdout.strip()).splitlines()
                    raise InvalidInput(f"template {defn.name!r}: pip could not install its requirements: "
                                       f"{why[-1] if why else 'exit ' + str(done.returncode)}")
            if defn.code is not None:
                if _digest(defn.code, defn.files) != defn.code_digest:
                    raise InvalidInput(f"template {defn.name!r} must be rebuilt (for this Python) but its "
                                       f"warmup's code under {defn.code} is gone or changed: run tenantq "
                                       f"template create {defn.name} again")
                root = Path(defn.code)
                code_view.copy_into(code_view.AppCode(root, {root / f: None for f in defn.files}),
                                    staging / "code")
            os.chmod(staging, 0o755)
            staging.rename(layer)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def resolve(data_dir: Path, name: str, *, build: bool = True) -> Resolved:
    """`name`'s layers (built now if missing and `build`) and warmups, from
    the innermost template out."""
    chain: list[TemplateDef] = []
    current: str | None = name
    while current is not None:
        if len(chain) >= MAX_DEPTH or any(d.name == current for d in chain):
            raise InvalidInput(f"template {name!r}: its `from` chain loops or is deeper than {MAX_DEPTH}")
        defn = definition(data_dir, current)
        chain.append(defn)
        current = defn.base
    layers: list[Path] = []
    warmups: list[str] = []
    under = ""
    for defn in reversed(chain):  # base first
        key = _layer_key(defn, under)
        under = key
        if defn.requirements.strip() or defn.code is not None:
            layer = templates_dir(data_dir) / defn.name / f"layer-{key}"
            if not layer.is_dir():
                if not build:
                    raise InvalidInput(f"template {defn.name!r} is not built yet")
                _build_layer(layer, defn)
            layers.append(layer)
        if defn.warmup:
            warmups.append(defn.warmup)
    return Resolved(name, tuple(reversed(layers)), tuple(warmups), under)


def create(data_dir: Path, name: str, *, base: str = "base", requirements: str = "",
           warmup: str | None = None, sandbox_paths: Sequence[str] = ()) -> tuple[Resolved, bool]:
    """Define (or redefine) template `name` and build its layer; returns it
    and whether anything was built (False: up to date)."""
    check_name(name)
    if name in BUILTIN:
        raise InvalidInput(f"{name!r} is a built-in template: pick another name (--from {name} builds on it)")
    check_name(base)
    if base == name:
        raise InvalidInput(f"template {name!r} cannot be built from itself")
    ancestor: str | None = base
    for _ in range(MAX_DEPTH):  # exists, and is not built (at any depth) from `name`: before any write
        if ancestor is None or ancestor in BUILTIN:
            break
        if ancestor == name:
            raise InvalidInput(f"template {name!r}: its `from` chain loops or is deeper than {MAX_DEPTH}")
        ancestor = definition(data_dir, ancestor).base
    else:
        raise InvalidInput(f"template {name!r}: its `from` chain loops or is deeper than {MAX_DEPTH}")
    definition(data_dir, base)  # exists?
    if not isinstance(requirements, str) or "\0" in requirements or \
            len(requirements.encode()) > MAX_REQUIREMENTS_BYTES:
        raise InvalidInput(f"requirements must be text without NUL bytes, at most "
                           f"{MAX_REQUIREMENTS_BYTES} bytes")
    check_requirements(requirements)
    if warmup is not None and not WARMUP.fullmatch(warmup):
        raise InvalidInput(f"--warmup takes MODULE:FUNCTION, e.g. myapp.warm:load, got {warmup!r}")
    code = _warmup_code(warmup, sandbox_paths)
    if warmup is not None and code is None and not requirements.strip():
        raise InvalidInput(f"cannot find the warmup's module {warmup.split(':')[0]!r} here (it must be "
                           "importable from the current directory or PYTHONPATH, or be installed by "
                           "--python-requirements)")
    path = templates_dir(data_dir) / name
    path.mkdir(parents=True, exist_ok=True)
    previous = None
    with contextlib.suppress(InvalidInput):
        previous = resolve(data_dir, name, build=False)
    files = tuple(sorted(str(p.relative_to(code.root)) for p in code.files)) if code else ()
    root = str(code.root) if code else None
    defn = TemplateDef(name, base=base, requirements=requirements, warmup=warmup, code=root,
                       code_digest=_digest(root, files) if root else None, files=files, created=time.time())
    staging = path / f".template-{uuid.uuid4().hex[:8]}.json"
    staging.write_text(json.dumps({k: v for k, v in asdict(defn).items() if k != "name"}))
    old = path / "template.json"
    saved = old.read_bytes() if old.exists() else None
    staging.rename(old)
    try:
        resolved = resolve(data_dir, name)
    except BaseException:
        if saved is None:
            shutil.rmtree(path, ignore_errors=True)
        else:
            old.write_bytes(saved)
        raise
    remove_stale_layers(data_dir, name, keep=set(resolved.layers))
    return resolved, previous is None or previous.key != resolved.key


def layers_in_use(data_dir: Path) -> set[Path]:
    """The layers live sandboxes have mounted (their host metadata says so)."""
    used: set[Path] = set()
    for meta_file in (data_dir / "sandboxes").glob(f"*/*/{META_FILE}"):
        with contextlib.suppress(OSError, ValueError, TypeError):
            used.update(Path(p) for p in json.loads(meta_file.read_text()).get("layers") or ())
    return used


def remove_stale_layers(data_dir: Path, name: str, keep: set[Path]) -> list[Path]:
    """Template `name`'s layers of earlier definitions that no live sandbox
    uses (a sandbox of the old build keeps its packages until it ends; a
    later create or `template rm` removes the layer then)."""
    removed = []
    busy = layers_in_use(data_dir)
    for stale in (templates_dir(data_dir) / name).glob("layer-*"):
        if stale not in keep and stale not in busy:
            shutil.rmtree(stale, ignore_errors=True)
            removed.append(stale)
    return removed


def remove(data_dir: Path, name: str) -> bool:
    """Remove template `name`'s definition and layers (a built-in's built
    layer only: it is rebuilt on next use); False when there was none."""
    check_name(name)
    path = templates_dir(data_dir) / name
    if name == "base":
        raise InvalidInput("'base' is built in and has nothing to remove")
    if not path.is_dir():
        if name in BUILTIN:
            return False
        definition(data_dir, name)  # says which exist
        return False
    busy = [p for p in layers_in_use(data_dir) if p.parent == path]
    if busy:
        raise InvalidInput(f"template {name!r} is in use by running sandboxes: delete them first "
                           "(tenantq sandbox ls, tenantq sandbox rm ID)")
    doomed = path.with_name(f".rm-{name}-{uuid.uuid4().hex[:6]}")
    path.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    return True


def python_path(resolved: Resolved) -> list[str]:
    """PYTHONPATH inside a sandbox of this template: its layers, then
    tenantq's code (the agent's)."""
    return [*resolved.python_path, *guest_python().sys_path]
