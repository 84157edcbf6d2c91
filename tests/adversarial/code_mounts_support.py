"""The throwaway project the M1 tests attack (docs/security.md, rule M1), and
the checks of what its sandboxes saw.

`build_project` makes, under the test's tmp dir:

- proj/PKG/: an honest app (jobs.py registers `m1.hunt`, whose handler is
  the attacker of code_mounts_guest.py; it lazily imports helpers.py, which
  imports sub/ and, lazily and relatively, relhelp.py; it loads dynmod.py by
  `importlib.import_module("a.literal")`; warm.py is a template warmup), and
  next to it every file M1 says never reaches a sandbox, each holding a
  token of its own (settings*.py, local_settings.py, settings/, .env*,
  *.env, secrets.*, credentials*, keys, .netrc, .pgpass, .pypirc, pip.conf,
  modules and notes outside the import closure, and the project's .git);
- extra/site-packages/: a site-packages directory on the worker's sys.path
  (PYTHONPATH) with an ordinary package the handler uses (and a CA bundle
  it needs) and every start-up or credential file M1 hides in an
  installation tree (.pth, sitecustomize.py, pip.conf, .env, .git, *.key, a
  .pem holding a private key), at the top and deeper;
- hostcfg/tenants.json: the worker's --secrets file (host configuration).

Every token is `<tag>x<16 hex>`: the guest finds any of them wherever it
looks, and the host knows which file each came from."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tenantq

GUEST = Path(__file__).with_name("code_mounts_guest.py")
REPO = Path(__file__).resolve().parents[2]
KIND = "m1.hunt"
HANDLER_TIMEOUT = 200
HELPERS_VALUE = "helpers:relhelp-ok:sub-ok"
EXTRA_VALUE = 50  # compute(7)

JOBS = '''"""The honest app of the M1 test; its one handler is the attacker."""

import importlib
import secrets as stdlib_secrets  # the standard library's module, not the app's

import tenantq
from PKG import hunt
TOP_IMPORTS


@tenantq.handler("KIND", timeout=TIMEOUT, memory_mb=512)
def run(payload, ctx):
    LAZY_IMPORTS
    honest = {"stdlib_secrets": len(stdlib_secrets.token_hex(4))}
    try:
        from PKG import helpers  # lazy: found only by reading the function's source

        honest["helpers"] = helpers.value()
    except Exception as exc:
        honest["helpers"] = f"{type(exc).__name__}: {exc}"
    try:
        from PKG.plugins import plug  # a namespace package: no __init__.py on the way

        honest["plugin"] = plug.VALUE
    except Exception as exc:
        honest["plugin"] = f"{type(exc).__name__}: {exc}"
    try:
        honest["dynmod"] = importlib.import_module("PKG.dynmod").VALUE
    except Exception as exc:
        honest["dynmod"] = f"{type(exc).__name__}: {exc}"
    try:
        import EXTRA

        honest["extra"] = EXTRA.compute(7)
    except Exception as exc:
        honest["extra"] = f"{type(exc).__name__}: {exc}"
    report = hunt.hunt(payload)
    report["honest"] = honest
    return report
'''
HELPERS = '''from PKG import sub
HELPERS_IMPORTS


def value():
    from .relhelp import VALUE

    return "helpers:" + VALUE + ":" + sub.NAME
'''
WARM = '''"""A template warmup: its import closure is what the template's layer gets."""
WARM_IMPORTS


def load():
    from PKG import helpers

    return helpers.value()
'''
# app tree: every name M1 says is never in a sandbox (relative to PKG/, or to the project root with "/")
APP_SECRETS = (
    "settings.py", "settings_prod.py", "local_settings.py", "config/settings/__init__.py",
    "config/settings/base.py",
    ".env", ".env.production", "prod.env", "secrets.json", "secrets.py", "credentials.yaml",
    "credentials_store.py", "deploy.pem", "server.key", "id_rsa", "id_rsa.pub", ".netrc", ".pgpass",
    ".pypirc", "pip.conf", "pip.ini", ".npmrc", "keystore.jks", "client.p12", "client.pfx", "id_ecdsa",
    "unused_module.py", "notes.txt", "sub/.env", "sub/id_ed25519", "sub/unused.py", "plugins/.env",
    "/.env", "/local_settings.py", "/id_rsa", "/notes.txt", "/.git/config", "/.git/HEAD",
    "/.git/objects/ab/cdef0123456789", "/.git-credentials", "/.npmrc",
)
# installation tree (the extra site-packages): hidden at the top, or at any depth
SITE_SECRETS = (
    "zz_marker.pth", "sitecustomize.py", "usercustomize.py", "pip.conf", "pip.ini", ".env", ".env.local",
    ".netrc", ".pgpass", ".pypirc", ".npmrc", ".git-credentials", ".git/config", ".git/HEAD", "deploy.key",
    "private.pem", "EXTRA/conf/pip.conf", "EXTRA/.env", "EXTRA/keys/signing.key", "EXTRA/.git/config",
    "EXTRA/certs/client.p12", "EXTRA/certs/client.pfx", "EXTRA/certs/chain-with-key.pem",
    "EXTRA/certs/big-bundle-key-last.pem",
)
CERT = "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIUZm9vYmFyYmF6cXV4\n-----END CERTIFICATE-----\n"
PEMS = {  # every .pem of SITE_SECRETS holds a private key block, anywhere in it
    "private.pem": "-----BEGIN PRIVATE KEY-----\nTOKEN\n-----END PRIVATE KEY-----\n",
    "EXTRA/certs/chain-with-key.pem": CERT + "-----BEGIN RSA PRIVATE KEY-----\r\nTOKEN\r\n"
                                      "-----END RSA PRIVATE KEY-----\r\n",
    # the key after 2 MiB of certificates: a check that looks at the head alone misses it
    "EXTRA/certs/big-bundle-key-last.pem": CERT * (2 * 1024 * 1024 // len(CERT) + 1)
    + "-----BEGIN EC PRIVATE KEY-----\nTOKEN\n-----END EC PRIVATE KEY-----\n",
}


@dataclass
class Planted:
    label: str
    path: Path
    token: str


@dataclass
class Project:
    tmp: Path
    root: Path
    pkg: str
    extra_site: Path
    extra_pkg: str
    tag: str
    secrets_file: Path
    secret: dict[str, Planted] = field(default_factory=dict)  # token -> where it was planted
    visible: dict[str, Planted] = field(default_factory=dict)  # token -> a file a sandbox must see
    honest: dict[Path, str] = field(default_factory=dict)  # closure file -> sha256

    def token(self) -> str:
        return f"{self.tag}x{secrets.token_hex(8)}"

    def plant(self, path: Path, label: str, text: str = "", *, visible: bool = False) -> Planted:
        token = self.token()
        path.parent.mkdir(parents=True, exist_ok=True)
        if "TOKEN" not in text:  # Python and .pth files stay valid: a comment (host processes load them)
            text = f"# {label} TOKEN\n" if path.suffix in (".py", ".pth") else f"{label} TOKEN\n"
        path.write_text(text.replace("TOKEN", token))
        path.chmod(0o644)
        planted = Planted(label, path, token)
        (self.visible if visible else self.secret)[token] = planted
        return planted

    def short(self, path: Path) -> str:
        """`path` relative to the test's tmp dir, for messages."""
        return f"<tmp>/{path.relative_to(self.tmp)}" if path.is_relative_to(self.tmp) else str(path)

    def path(self, relative: str) -> Path:
        if relative.startswith("/"):
            return self.root / relative.lstrip("/")
        return self.root / self.pkg / relative

    @property
    def module(self) -> str:
        return f"{self.pkg}.jobs"

    def worker_env(self, base: dict[str, str], data_dir: Path) -> dict[str, str]:
        env = {k: v for k, v in base.items() if k != "TENANTQ_SANDBOX_PATHS"}
        # the extra site-packages first; then whatever the test's own tenantq needs
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.extra_site), base.get("PYTHONPATH")]))
        env["TENANTQ_DATA_DIR"] = str(data_dir)
        return env

    def order(self, *, walk: bool, data_dir: Path, visible: list[Path] | None = None,
              follow: list[Path] | None = None) -> dict[str, Any]:
        """What the guest is told: everything a hunt needs but the tokens themselves."""
        empty = must_be_empty()
        listings = [str(data_dir), str(self.secrets_file.parent), *(str(p) for p in hidden_site_dirs())]
        return {"tag": self.tag, "walk": walk, "skip_trees": skip_trees(),
                "planted": sorted({str(p.path) for p in [*self.secret.values(), *self.visible.values()]}
                                  | {str(p) for p in empty}),
                "follow": [str(p) for p in follow or []],
                "listings": listings, "hashes": [str(p) for p in self.honest],
                "visible": [str(p) for p in visible or []]}


def skip_trees() -> list[str]:
    """Host trees that existed before the test and hold no token of it: listed, not read whole."""
    return sorted({"/usr", sys.base_prefix, sys.prefix, str(Path(tenantq.__file__).resolve().parent)})


def hidden_site_dirs() -> list[Path]:
    """Site-packages directories of the Python installation that this (the
    worker's) sys.path does not use: M1 covers each with an empty directory."""
    used = {str(Path(p).resolve()) for p in sys.path if p}
    base = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    found = [base / "site-packages", base / "dist-packages"]
    return [p for p in found if p.is_dir() and str(p.resolve()) not in used and any(p.iterdir())]


def must_be_empty() -> list[Path]:
    """Host files that exist but a sandbox must never read: the virtualenv's
    own .pth files (top of a site-packages dir on sys.path) and the
    repository's .git (outside every mounted tree)."""
    out = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    paths = [pth for site in out for pth in sorted(Path(site).glob("*.pth"))]
    return paths + [p for p in (REPO / ".git" / "config", REPO / ".git" / "HEAD") if p.is_file()]


def build_project(tmp_path: Path, *, top_imports: str = "", lazy_imports: str = "",
                  helpers_imports: str = "", warm_imports: str = "", plant_app: bool = True,
                  extra_files: tuple[str, ...] = ()) -> Project:
    tmp_path.chmod(0o755)  # a uid-65534 job could read every planted file if it were mounted
    stamp = uuid.uuid4().hex
    root = tmp_path / "proj"
    proj = Project(tmp=tmp_path, root=root, pkg=f"mproj_{stamp[:8]}",
                   extra_site=tmp_path / "extra" / "site-packages", extra_pkg=f"tqm1extra_{stamp[8:14]}",
                   tag=f"tqm1{stamp[14:24]}",
                   secrets_file=tmp_path / "hostcfg" / "tenants.json")

    def fill(text: str) -> str:
        return (text.replace("PKG", proj.pkg).replace("EXTRA", proj.extra_pkg).replace("KIND", KIND)
                .replace("TIMEOUT", str(HANDLER_TIMEOUT)))

    pkg = root / proj.pkg
    honest = {
        "__init__.py": '"""The app\'s top-level package."""\n',
        "jobs.py": fill(JOBS).replace("TOP_IMPORTS", top_imports)
        .replace("LAZY_IMPORTS", lazy_imports or "pass"),
        "hunt.py": GUEST.read_text(),
        "helpers.py": fill(HELPERS).replace("HELPERS_IMPORTS", helpers_imports),
        "relhelp.py": 'VALUE = "relhelp-ok"\n',
        "dynmod.py": 'VALUE = "dynmod-ok"\n',
        "sub/__init__.py": 'NAME = "sub-ok"\n',
        "plugins/plug.py": 'VALUE = "plugin-ok"\n',
        "warm.py": fill(WARM).replace("WARM_IMPORTS", warm_imports),
        "config/__init__.py": "",
    }
    outside = ("warm.py", "config/__init__.py")  # honest, but outside the handler's import closure
    for name, text in honest.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fill(text) if name != "hunt.py" else text)
        path.chmod(0o644)
        if name not in outside:
            proj.honest[path] = sha256(path)
    for name in (APP_SECRETS if plant_app else ()) + extra_files:
        proj.plant(proj.path(name), f"app tree: {name}",
                   "VALUE = 'TOKEN'\n" if name.endswith(".py") else "")
    for d in [root, *root.rglob("*")]:
        if d.is_dir():
            d.chmod(0o755)

    site = proj.extra_site
    extra = site / proj.extra_pkg
    extra.mkdir(parents=True)
    (extra / "__init__.py").write_text("def compute(n):\n    return n * n + 1\n")
    proj.honest[extra / "__init__.py"] = sha256(extra / "__init__.py")
    proj.plant(extra / "cacert.pem", "installation tree: a CA bundle (no private key: stays visible)",
               "-----BEGIN CERTIFICATE-----\nTOKEN\n-----END CERTIFICATE-----\n", visible=True)
    for name in SITE_SECRETS:
        proj.plant(site / fill(name), f"installation tree: {name}", PEMS.get(name, ""))
    for d in [tmp_path / "extra", *(tmp_path / "extra").rglob("*")]:
        if d.is_dir():
            d.chmod(0o755)

    cfg = proj.secrets_file
    cfg.parent.mkdir(mode=0o700)
    acme, mallory = proj.token(), proj.token()
    proj.secret[acme] = Planted("the worker's --secrets file: acme's value (acme runs nothing)", cfg, acme)
    proj.secret[mallory] = Planted("mallory's own secret (its environment only, never a file)", cfg, mallory)
    cfg.write_text(json.dumps({"acme": {"ACME_TOKEN": acme}, "mallory": {"MALLORY_TOKEN": mallory}}))
    cfg.chmod(0o600)
    return proj


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def leaks(proj: Project, report: dict[str, Any], *, allowed: tuple[Path, ...] = (),
          layer: Callable[[str], bool] | None = None) -> list[str]:
    """Every M1 break in a hunt report: a planted token the sandbox read
    (but those of `allowed`, files the operator named), a hidden file or
    directory with content, a file of the host-only dirs visible (but those
    `layer` accepts: a template's layer, under the data dir)."""
    problems: list[str] = []
    hits: dict[str, list[str]] = dict(report.get("walk", {}).get("hits", {}))
    for path, seen in report.get("direct", {}).items():
        for token in seen.get("tokens", []):
            hits.setdefault(token, [])
            if path not in hits[token]:
                hits[token].append(path)
    for token, paths in sorted(hits.items()):
        planted = proj.secret.get(token)
        if planted is not None and planted.path not in allowed:
            where = "" if paths == [str(planted.path)] else f", seen at {paths}"
            problems.append(f"M1: the sandbox read {planted.label} (host {proj.short(planted.path)}{where})")
        elif planted is None and token not in proj.visible:
            problems.append(f"a token of this run the test did not plant was found at {paths}")
    direct = report.get("direct", {})
    for path in must_be_empty():
        seen = direct.get(str(path), {})
        if seen.get("state") == "read" and seen.get("size"):
            problems.append(f"M1: the sandbox read {seen['size']} bytes of the host's {path} (hidden)")
    for path, names in report.get("listings", {}).items():
        if not isinstance(names, list):
            continue
        shown = [n for n in names if layer is None or not layer(n)]
        if shown:
            problems.append(f"M1: the sandbox sees files in {path} (host-only or hidden): {shown[:8]}")
    return problems


def honest_problems(proj: Project, report: dict[str, Any], *, queue: bool = True) -> list[str]:
    """What the honest app needs must still be there, exactly as on the host."""
    problems: list[str] = []
    if queue:
        got = report.get("honest", {})
        expected = {"helpers": HELPERS_VALUE, "dynmod": "dynmod-ok", "plugin": "plugin-ok",
                    "extra": EXTRA_VALUE, "stdlib_secrets": 8}
        for key, value in expected.items():
            if got.get(key) != value:
                problems.append(f"the honest app broke: {key} gave {got.get(key)!r}, not {value!r}")
        for path, digest in proj.honest.items():
            seen = report.get("hashes", {}).get(str(path))
            if seen != digest:
                problems.append(f"the app's {path} is not in the sandbox as it is on the host: {seen}")
    direct = report.get("direct", {})
    for token, planted in proj.visible.items():
        seen = direct.get(str(planted.path), {})
        if token not in seen.get("tokens", []):
            problems.append(f"{planted.label} ({planted.path}) is not readable in the sandbox: {seen}")
    return problems


WARM_CLOSURE = ("__init__", "warm", "helpers", "relhelp", "sub/__init__")


def in_warm_closure(proj: Project, data_dir: Path) -> Callable[[str], bool]:
    """Is `path` a file of PKG.warm's import closure (source or bytecode) in a
    template's layer under the data dir? Nothing else of the data dir may be seen."""
    def accept(path: str) -> bool:
        parts = Path(path).parts
        if not Path(path).is_relative_to(data_dir) or proj.pkg not in parts:
            return False
        rel = [p for p in parts[parts.index(proj.pkg) + 1:] if p != "__pycache__"]
        if not rel:
            return False
        module = "/".join([*rel[:-1], rel[-1].split(".")[0]])
        return module in WARM_CLOSURE and rel[-1].endswith((".py", ".pyc"))
    return accept

