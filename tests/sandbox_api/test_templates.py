"""Templates of the Sandbox API (docs/sandbox-api.md, "Templates"): a custom
template's requirements layer and warmup, its checkpoint on gVisor, rebuilds
when its inputs change, the built-in code-interpreter, `tenantq template
create|list|rm`, and one-line errors. The requirements are a wheel this test
writes itself (no network needed), except code-interpreter's, which come
from PyPI as they would for a user."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tenantq import InvalidInput, Sandbox
from tenantq.sandbox import templates
from tenantq.sandbox.snapshots import SnapshotStore

TENANTQ = str(Path(sys.executable).parent / "tenantq")


def make_wheel(directory: Path, name: str, version: str, body: str) -> Path:
    """A minimal pure-Python wheel of module `name` (PEP 427 layout)."""
    path = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": body,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                               "Tag: py3-none-any\n")}
    record = []
    for file_name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{file_name},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    with zipfile.ZipFile(path, "w") as zf:
        for file_name, text in files.items():
            zf.writestr(file_name, text)
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


@pytest.fixture
def warm_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A warmup on this host's path: it writes a token no two runs share, and
    leaves a background process running."""
    code = tmp_path / "code"
    (code / "warmpkg").mkdir(parents=True)
    (code / "warmpkg" / "__init__.py").write_text(
        "import os, subprocess\n"
        "def warm():\n"
        "    os.makedirs('/opt/warm', exist_ok=True)\n"
        "    with open('/opt/warm/token', 'w') as fh:\n"
        "        fh.write(os.urandom(8).hex())\n"
        "    subprocess.Popen(['sleep', '3600'], start_new_session=True)\n"
        "def broken():\n"
        "    raise RuntimeError('the model file is missing')\n")
    monkeypatch.syspath_prepend(str(code))
    return "warmpkg"


def test_a_custom_template_has_its_packages_and_its_warmup(driver_name: str, data_dir: Path, tmp_path: Path,
                                                            warm_module: str) -> None:
    wheel = make_wheel(tmp_path, "greeting", "1.0", "WORD = 'hello from the layer'\n")
    resolved, built = templates.create(data_dir, "acme-deps", requirements=f"{wheel}\n",
                                       warmup=f"{warm_module}:warm")
    assert built and len(resolved.layers) == 1
    tokens = []
    for _ in range(2):
        with Sandbox.create(template="acme-deps", driver=driver_name, ttl_seconds=120) as sbx:
            assert sbx.template == "acme-deps"
            result = sbx.run("python3 -c 'import greeting; print(greeting.WORD)'")
            assert result.stdout == "hello from the layer\n", result
            tokens.append(sbx.filesystem.read_text("/opt/warm/token"))
            # the layer is read-only inside
            assert not sbx.run(f"touch {resolved.layers[0]}/site/x").ok
            # the process the warmup left running is there
            assert "sleep 3600" in sbx.run("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
    store = SnapshotStore(data_dir, driver_name)
    checkpoints = [t for t in store.templates() if t.meta.get("template") == "acme-deps"]
    if driver_name == "gvisor":
        # one checkpoint, restored twice: the warmup ran once
        assert len(checkpoints) == 1 and tokens[0] == tokens[1]
    else:
        # no checkpoints here: the warmup runs in each new sandbox
        assert not checkpoints and tokens[0] != tokens[1]


def test_a_changed_input_is_a_new_build_and_the_same_inputs_are_not(data_dir: Path, tmp_path: Path) -> None:
    one = make_wheel(tmp_path, "greeting", "1.0", "WORD = 'one'\n")
    two = make_wheel(tmp_path, "greeting", "2.0", "WORD = 'two'\n")
    first, built = templates.create(data_dir, "acme", requirements=f"{one}\n")
    assert built
    again, built = templates.create(data_dir, "acme", requirements=f"{one}\n")
    assert not built and again.key == first.key
    with Sandbox.create(template="acme", ttl_seconds=60) as sbx:
        assert sbx.run("python3 -c 'import greeting; print(greeting.WORD)'").stdout == "one\n"
    changed, built = templates.create(data_dir, "acme", requirements=f"{two}\n")
    assert built and changed.key != first.key
    assert not first.layers[0].exists()  # the old layer went
    with Sandbox.create(template="acme", ttl_seconds=60) as sbx:
        assert sbx.run("python3 -c 'import greeting; print(greeting.WORD)'").stdout == "two\n"


def test_a_template_from_another_stacks_their_layers(data_dir: Path, tmp_path: Path) -> None:
    base = make_wheel(tmp_path, "lower", "1.0", "X = 1\n")
    top = make_wheel(tmp_path, "upper", "1.0", "from lower import X\nY = X + 1\n")
    templates.create(data_dir, "team-base", requirements=f"{base}\n")
    resolved, _ = templates.create(data_dir, "team-app", base="team-base", requirements=f"{top}\n")
    assert len(resolved.layers) == 2
    with Sandbox.create(template="team-app", ttl_seconds=60) as sbx:
        assert sbx.run("python3 -c 'import upper; print(upper.Y)'").stdout == "2\n"


def test_a_failing_warmup_is_one_line_and_leaves_nothing(data_dir: Path, warm_module: str) -> None:
    templates.create(data_dir, "broken", warmup=f"{warm_module}:broken")
    with pytest.raises(InvalidInput, match=r"warmup warmpkg:broken failed .*RuntimeError: the model file is "
                                           r"missing") as info:
        Sandbox.create(template="broken", ttl_seconds=60)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("call", "message"), [
    (lambda d: Sandbox.create(template="nope"), r"unknown template 'nope': the templates are base, "
                                                 r"code-interpreter"),
    (lambda d: Sandbox.create(template="../etc"), "a template name is"),
    (lambda d: templates.create(d, "base"), "'base' is a built-in template"),
    (lambda d: templates.create(d, "x", base="missing"), "unknown template 'missing'"),
    (lambda d: templates.create(d, "x", base="x"), "cannot be built from itself"),
    (lambda d: templates.create(d, "x", warmup="no-colon"), "--warmup takes MODULE:FUNCTION"),
    (lambda d: templates.create(d, "x", warmup="not_here_at_all:f"), "cannot find the warmup's module"),
    (lambda d: templates.create(d, "x", requirements="no-such-package-tenantq-test==0.0.1\n"),
     "pip could not install its requirements"),
    # pip would build a source tree (its backend runs on the host) or read a host file
    (lambda d: templates.create(d, "x", requirements="-e /tmp\n"), "requirements line 1: '-e /tmp': options"),
    (lambda d: templates.create(d, "x", requirements="numpy\n-r /etc/shadow\n"),
     "requirements line 2: '-r /etc/shadow': options are not allowed"),
    (lambda d: templates.create(d, "x", requirements="/tmp\n"),
     "requirements line 1: '/tmp' is not a package"),
    (lambda d: templates.create(d, "x", requirements="evil @ file:///tmp/evil\n"),
     "a URL or path is not allowed"),
    (lambda d: templates.create(d, "x", requirements="/tmp/none.whl\n"), "no such wheel file"),
    (lambda d: templates.create(d, "x\n"), "a template name is"),
    (lambda d: templates.create(d, "x" * 300), "a template name is"),
    (lambda d: templates.remove(d, "base"), "'base' is built in"),
    (lambda d: templates.remove(d, "nope"), "unknown template 'nope'"),
])
def test_bad_templates_are_one_line_errors_that_change_nothing(data_dir: Path, call: object,
                                                               message: str) -> None:
    with pytest.raises(InvalidInput, match=message) as info:
        call(data_dir)  # type: ignore[operator]
    assert "\n" not in str(info.value)
    assert not (data_dir / "templates" / "x").exists()


def run_cli(*args: str, data_dir: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "TENANTQ_DATA_DIR": str(data_dir),
           "TENANTQ_POOL_SIZE": "0", "PYTHONPATH": str(cwd)}
    return subprocess.run([TENANTQ, *args], capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


def test_the_command_line_creates_lists_and_removes_templates(data_dir: Path, tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "warmmod").mkdir(parents=True)
    (project / "warmmod" / "__init__.py").write_text(
        "import os\ndef go():\n    os.makedirs('/opt', exist_ok=True)\n"
        "    open('/opt/ready', 'w').write('yes')\n")
    wheel = make_wheel(tmp_path, "greeting", "1.0", "WORD = 'cli'\n")
    (project / "requirements.txt").write_text(f"{wheel}\n")
    made = run_cli("template", "create", "cli-made", "--python-requirements", "requirements.txt",
                   "--warmup", "warmmod:go", data_dir=data_dir, cwd=project)
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith("template cli-made built: layer "), made.stdout
    again = run_cli("template", "create", "cli-made", "--python-requirements", "requirements.txt",
                    "--warmup", "warmmod:go", data_dir=data_dir, cwd=project)
    assert again.returncode == 0 and "is up to date" in again.stdout, again.stdout + again.stderr
    listed = run_cli("template", "list", "--json", data_dir=data_dir, cwd=project)
    rows = json.loads(listed.stdout)
    names = {r["name"]: r for r in rows["templates"]}
    assert names["base"]["kind"] == "built-in" and names["code-interpreter"]["kind"] == "built-in"
    assert names["cli-made"]["kind"] == "custom" and names["cli-made"]["built"] is True
    assert names["cli-made"]["warmup"] == "warmmod:go" and names["cli-made"]["packages"] == [str(wheel)]
    has_checkpoint = any(r["of"] == "template:cli-made" for r in rows["checkpoints"])
    assert has_checkpoint == ("gvisor" in made.stdout or "checkpoint" in made.stdout)
    bad = run_cli("template", "create", "cli-bad", "--warmup", "nowhere:go", data_dir=data_dir, cwd=project)
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1
    assert "cannot find the warmup's module" in bad.stderr
    gone = run_cli("template", "rm", "cli-made", data_dir=data_dir, cwd=project)
    assert gone.returncode == 0, gone.stderr
    rows = json.loads(run_cli("template", "list", "--json", data_dir=data_dir, cwd=project).stdout)
    assert "cli-made" not in {r["name"] for r in rows["templates"]}
    assert not any(r["of"] == "template:cli-made" for r in rows["checkpoints"])
    assert not (data_dir / "templates" / "cli-made").exists()


def test_code_interpreter_has_its_data_packages(data_dir: Path) -> None:
    """Built on first use (pip, from PyPI), then in every sandbox of it."""
    with Sandbox.create(template="code-interpreter", ttl_seconds=300, memory_mb=1024) as sbx:
        result = sbx.run("python3 -c 'import numpy, pandas; "
                         "print(int(pandas.DataFrame({\"a\": numpy.arange(4)}).a.sum()))'",
                         timeout_seconds=120)
        assert result.stdout == "6\n", result
    names = {d.name: d for d in templates.definitions(data_dir)}
    assert set(templates.CODE_INTERPRETER_PACKAGES) <= set(names["code-interpreter"].requirements.split())
