"""Sandbox API egress and templates under attack from inside their own sandboxes,
on both drivers (docs/sandbox-api.md "Egress", "Templates", "Ready pool";
docs/egress.md; docs/security.md rules E1, S1, H1, H3, P2).

Written from the promise and the guest-visible surface only (guest/agent.py,
guest/egress.py, the public `Sandbox` signatures, `tenantq template --help`):
the attacker controls every command and has read the guest code. The host side
(the process calling the Sandbox API, which also runs the egress proxy) runs in a
subprocess inside a 1 GiB memory cgroup and under a wall-clock bound
(tests/adversarial/attacks/api_egress.py: `child_main`), with every API call in a
thread with a deadline; it measures its own peak RSS.

1. egress: A may reach 127.0.0.1:p1 (and localhost:p1), B 127.0.0.1:p3 plus a
   list of rules that name non-global addresses (E1 must refuse every one), with
   the operator's TENANTQ_EGRESS_ALLOW_NETWORKS=127.0.0.1/32 (so the positive
   controls can reach upstreams on this host) and the ready pool on (B may be a
   pooled sandbox of A's kind: it must get B's rules, not A's). Forbidden
   listeners on every host address record any connection. The guests try other
   ports and names, Postgres on 127.0.0.1:5432, redis, metadata addresses, IPv6
   and tunnelled forms, names getaddrinfo turns into loopback, Host/target
   mismatches, userinfo and port confusion, pipelining and CL+TE smuggling,
   CONNECT inside a tunnel, malformed heads; then the egress dir (write, unlink,
   rename, symlink, bind, mount, umount, unshare), the network without the proxy,
   host Unix sockets (the data dir's, an abstract one), each other's secrets;
   then A floods the proxy (thousands of half-sent heads, an endless header,
   100,000 header lines, an absurd Content-Length) while B's request must still
   be served; on gVisor a fork child of A must have A's rules and no more, and
   keep them when A is deleted.
2. templates: a template whose warmup leaves a state file and a daemon; sandbox
   s1 tries to change the template (its layer, PYTHONPATH, mounts), rewrites its
   own state, leaves a daemon, then kills its own agent; s2 (made while s1 is
   alive), s3 (made after s1 died) and, on gVisor, a fork child of s2 must start
   from the warmup's state and see nothing of the others; the host's listing of
   the template must not change (rule S1).
3. template CLI and API: bad names, warmups, requirements and bases get one line
   and change nothing; a requirements file naming a local source tree must not
   run its build code on the host ("wheels only: nothing is compiled on the host").
4. the warmup module is found from the current directory, as documented.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.adversarial import host_side
from tests.adversarial.attacks.api_egress import EXIT_HUNG, EXIT_SECONDS, FORBIDDEN, sandbox_ids
from tests.adversarial.host import Marker, MemoryCgroup
from tests.adversarial.host_side import ROOT, show
from tests.sandbox.conftest import BWRAP_OK
from tests.sandbox_api.conftest import data_dir, driver_name  # noqa: F401

# the ready pool's refill and the flood make the egress run the longest
HOST_SIDE_SECONDS = 150.0
CLI_SECONDS = 90.0
FLOOD_CONNECTIONS = 2000
FLOOD_HOLD_SECONDS = 4.0


# -- the host side, in a memory-limited subprocess --------------------------------------


def run_host_side(
    attack: str,
    args: dict[str, Any],
    *,
    cgroup: MemoryCgroup,
    tmp_path: Path,
    env: dict[str, str] | None = None,
    timeout: float = HOST_SIDE_SECONDS,
) -> dict[str, Any]:
    """Run api_egress.ATTACKS[attack](**args) in a subprocess inside `cgroup`; its report."""
    return host_side.run_host_side(
        "tests.adversarial.attacks.api_egress", attack, args, cgroup=cgroup, tmp_path=tmp_path,
        timeout=timeout, env=env, exit_hung=EXIT_HUNG, exit_seconds=EXIT_SECONDS,
    )


# -- listeners on the host: the allowed upstreams and the forbidden ones --------------------


class Listeners:
    """U1 (A's upstream, 127.0.0.1:p1) and U2 (B's, 127.0.0.1:p3) answer with a
    marker; F (port p2 on every host address, both stacks), F6 ([::1]:p1), an
    abstract and a path Unix socket are forbidden: any connection to them is a hit
    (and F answers with FORBIDDEN, so the guest's report names the request)."""

    MAX_HANDLERS = 300

    def __init__(self, tmp_path: Path) -> None:
        token = uuid.uuid4().hex[:10]
        self.marks = {"a": f"tqadv-upstream-a-{token}", "b": f"tqadv-upstream-b-{token}"}
        self.abstract = f"tqadv-host-abstract-{token}"
        self.path = str(tmp_path / "tqadv-host.sock")
        self.seen: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.handlers = 0
        self.sockets: dict[socket.socket, str] = {}
        self.p1 = self._listen(socket.AF_INET, ("127.0.0.1", 0), "u1")
        self.p3 = self._listen(socket.AF_INET, ("127.0.0.1", 0), "u2")
        self.p2 = self._listen(socket.AF_INET6, ("::", 0), "F", v6only=False)
        self.f6 = False
        with contextlib.suppress(OSError):
            self._listen(socket.AF_INET6, ("::1", self.p1), "F6", v6only=True)
            self.f6 = True
        self._listen(socket.AF_UNIX, "\0" + self.abstract, "F-abstract")
        self._listen(socket.AF_UNIX, self.path, "F-path")
        self.thread = threading.Thread(target=self._serve, name="tqadv-listeners", daemon=True)
        self.thread.start()

    def _listen(self, family: int, address: Any, name: str, v6only: bool | None = None) -> int:
        sock = socket.socket(family, socket.SOCK_STREAM)
        if family != socket.AF_UNIX:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if v6only is not None:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
        try:
            sock.bind(address)
        except OSError:
            sock.close()
            raise
        sock.listen(512)
        sock.setblocking(False)
        self.sockets[sock] = name
        port = sock.getsockname()[1] if family != socket.AF_UNIX else 0
        return int(port)

    def _serve(self) -> None:
        import selectors

        with selectors.DefaultSelector() as sel:
            for sock in self.sockets:
                sel.register(sock, selectors.EVENT_READ)
            while not self.stop.is_set():
                for key, _ in sel.select(0.1):
                    listener: socket.socket = key.fileobj  # type: ignore[assignment]
                    try:
                        conn, peer = listener.accept()
                    except OSError:
                        continue
                    name = self.sockets[listener]
                    with self.lock:
                        busy = self.handlers >= self.MAX_HANDLERS
                        if not busy:
                            self.handlers += 1
                    if busy:
                        self._record(name, peer, b"(not read: too many connections)")
                        conn.close()
                        continue
                    threading.Thread(target=self._handle, args=(conn, peer, name), daemon=True).start()

    def _record(self, name: str, peer: Any, head: bytes) -> None:
        with self.lock:
            self.seen.append({"name": name, "peer": repr(peer), "head": head[:2048].decode("latin-1")})

    def _handle(self, conn: socket.socket, peer: Any, name: str) -> None:
        try:
            with conn:
                conn.settimeout(5)
                head = b""
                with contextlib.suppress(OSError):
                    while b"\r\n\r\n" not in head and len(head) < 65536:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        head += chunk
                self._record(name, peer, head)
                body = {"u1": self.marks["a"], "u2": self.marks["b"]}.get(name, FORBIDDEN).encode()
                with contextlib.suppress(OSError):
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                        % (len(body), body)
                    )
        except Exception as exc:  # reported, never raised in a thread
            self.errors.append(repr(exc))
        finally:
            with self.lock:
                self.handlers -= 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        for sock in self.sockets:
            sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def problems(self, secrets: dict[str, str]) -> list[str]:
        out = []
        with self.lock:
            seen = list(self.seen)
        for hit in seen:
            head = hit["head"]
            if hit["name"].startswith("F"):
                out.append(
                    f"egress: a forbidden listener ({hit['name']}) was reached from {hit['peer']}: "
                    f"{head[:300]!r}"
                )
            if hit["name"] == "u2" and ("/tqadv/a/" in head or "/tqadv/c/" in head):
                out.append(f"egress: B's upstream got a request of A (or A's fork child): {head[:300]!r}")
            if hit["name"] == "u1" and "/tqadv/b/" in head:
                out.append(f"egress: A's upstream got a request of B: {head[:300]!r}")
            if (hit["name"] == "u1" and secrets["b"] in head) or (
                hit["name"] == "u2" and secrets["a"] in head
            ):
                out.append(f"secrets: another sandbox's secret reached {hit['name']}: {head[:300]!r}")
        return out + [f"listener error: {e}" for e in self.errors]


def host_addresses() -> list[str]:
    """This host's own addresses but loopback and link-local (for E1: every one
    is non-global here, and a connection to one reaches a forbidden listener)."""
    out = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=10, check=False)
    found = []
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] in ("inet", "inet6"):
            address = parts[3].split("/")[0]
            if not address.startswith(("127.", "fe80")) and address != "::1":
                found.append(address)
    return found


def remove_sandboxes(ids: list[str], cwd: Path, data_dir: Path, problems: list[str]) -> None:  # noqa: F811
    """What the host process left: `tenantq sandbox rm` (its documented remover), then
    any work-dir mount still under the data dir (unmounted lazily, and reported)."""
    out = run_cli(["sandbox", "rm", *ids], cwd=cwd)
    print(f"sandbox rm {ids}: rc {out.returncode} {(out.stdout + out.stderr).strip()[:300]}")
    with open("/proc/self/mounts") as mounts:
        stuck = [line.split()[1] for line in mounts if str(data_dir) in line.split()[1]]
    for path in stuck:
        subprocess.run(["umount", "-l", path], capture_output=True, timeout=30, check=False)
    if stuck:
        problems.append(f"`tenantq sandbox rm` left mounts on the host (unmounted by the test): {stuck}")


# -- 1. egress -------------------------------------------------------------------------------


def test_api_egress_reaches_only_its_own_rules(
    driver_name: str,  # noqa: F811
    data_dir: Path,  # noqa: F811
    tmp_path: Path,
    memory_cgroup: MemoryCgroup,
) -> None:
    stamp = uuid.uuid4().hex
    secrets = {"a": f"tqadv-egress-secret-a-{stamp[:16]}", "b": f"tqadv-egress-secret-b-{stamp[16:]}"}
    listeners = Listeners(tmp_path)
    try:
        report = run_host_side(
            "egress",
            {
                "driver": driver_name,
                "p1": listeners.p1,
                "p2": listeners.p2,
                "p3": listeners.p3,
                "marks": listeners.marks,
                "secrets": secrets,
                "abstract": listeners.abstract,
                "host_path": listeners.path,
                "data": str(data_dir),
                "host_ips": host_addresses(),
                "flood_n": FLOOD_CONNECTIONS,
                "hold": FLOOD_HOLD_SECONDS,
            },
            cgroup=memory_cgroup,
            tmp_path=tmp_path,
            env={"TENANTQ_EGRESS_ALLOW_NETWORKS": "127.0.0.1/32", "TENANTQ_POOL_SIZE": "1"},
        )
    finally:
        listeners.close()
    problems = show(report)
    problems += listeners.problems(secrets)
    if "filedescriptor out of range in select()" in report["log"]:
        problems.append(
            "egress: the host process logged 'ValueError: filedescriptor out of range in select()' (a thread "
            "of the Sandbox API died once A's connections pushed the process's descriptors past 1024)"
        )
    print(f"listeners saw {len(listeners.seen)} connections (F6 on [::1]:p1: {listeners.f6})")
    # the ready pool deletes what it holds when the host process exits
    left = sandbox_ids(data_dir)
    if left:
        problems.append(f"sandboxes left on the host after the host process exited: {sorted(left)}")
        remove_sandboxes(sorted(left), tmp_path, data_dir, problems)
    assert not problems, "\n".join(problems)


# -- 2. templates ------------------------------------------------------------------------------


def cli_command() -> list[str]:
    return [sys.executable, "-m", "tenantq.cli"]


def run_cli(
    args: list[str],
    *,
    cwd: Path,
    cgroup: MemoryCgroup | None = None,
    cmd: list[str] | None = None,
    timeout: float = CLI_SECONDS,
) -> subprocess.CompletedProcess[str]:
    full = [*(cmd or cli_command()), *args]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        cgroup.wrap(full) if cgroup else full,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def make_warmup(where: Path, mark: str) -> str:
    from tests.adversarial.attacks.api_egress import WARMUP_SOURCE

    module = f"tqadv_tpl_{uuid.uuid4().hex[:8]}"
    package = where / module
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(WARMUP_SOURCE.replace("{mark}", mark))
    return module


@pytest.fixture
def template_name(data_dir: Path, tmp_path: Path) -> Iterator[list[str]]:  # noqa: F811
    """Names of the templates a test made: removed (`template rm`) afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        with contextlib.suppress(subprocess.TimeoutExpired):
            run_cli(["template", "rm", name], cwd=tmp_path)


def test_template_sandboxes_share_nothing_and_cannot_change_it(
    driver_name: str,  # noqa: F811
    data_dir: Path,  # noqa: F811
    tmp_path: Path,
    memory_cgroup: MemoryCgroup,
    template_name: list[str],
) -> None:
    stamp = uuid.uuid4().hex
    mark = f"tqadv-mark-{stamp[:10]}"
    src = tmp_path / "warmup-src"
    module = make_warmup(src, mark)
    name = f"tqadv-tpl-{stamp[10:18]}"
    template_name.append(name)
    made = run_cli(
        ["template", "create", name, "--warmup", f"{module}:warm", "--sandbox", driver_name],
        cwd=src,
        cgroup=memory_cgroup,
    )
    assert made.returncode == 0, f"template create: {made.stdout} {made.stderr}"
    print(f"template create: {made.stdout.strip()}")
    tokens = {k: f"tqadv-{k}-{uuid.uuid4().hex[:12]}" for k in ("s1", "s1later", "s2after", "child")}
    report = run_host_side(
        "templates",
        {
            "driver": driver_name,
            "name": name,
            "module": module,
            "mark": mark,
            "tokens": tokens,
            "cli": cli_command(),
        },
        cgroup=memory_cgroup,
        tmp_path=tmp_path,
    )
    problems = show(report)
    again = run_cli(
        ["template", "create", name, "--warmup", f"{module}:warm", "--sandbox", driver_name],
        cwd=src,
        cgroup=memory_cgroup,
    )
    if again.returncode != 0 or "up to date" not in again.stdout + again.stderr:
        problems.append(
            f"template: creating {name} again with the same inputs after the attack did not say "
            f"'is up to date': rc {again.returncode} {again.stdout.strip()} {again.stderr.strip()}"
        )
    assert not problems, "\n".join(problems)


# -- 3. the template CLI and API with bad input --------------------------------------------------


def tree(root: Path) -> dict[str, tuple[str, int, int, str]]:
    """Every path under root but the sandbox dirs: kind, size, mtime, content digest."""
    found: dict[str, tuple[str, int, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel.split(os.sep)[0] == "sandboxes":
            continue
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                is_dir = name in dirnames
                digest = "" if is_dir else hashlib.sha256(Path(path).read_bytes()).hexdigest()
                found[os.path.relpath(path, root)] = (
                    "dir" if is_dir else "file",
                    st.st_size,
                    st.st_mtime_ns,
                    digest,
                )
    return found


def one_line(out: subprocess.CompletedProcess[str]) -> bool:
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    return len(lines) == 1 and "Traceback" not in lines[0]


EVIL_BACKEND = """
from pathlib import Path
Path({ran!r}).write_text("the build backend ran on the host")

def get_requires_for_build_wheel(config_settings=None):
    return []

def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    raise RuntimeError("tqadv")
"""


@pytest.mark.skipif(
    not BWRAP_OK, reason="process: bubblewrap does not work here (templates are made with --sandbox process)"
)
def test_template_cli_and_api_bad_input_change_nothing(
    data_dir: Path,  # noqa: F811
    tmp_path: Path,
    memory_cgroup: MemoryCgroup,
    marker: Marker,
    template_name: list[str],
) -> None:
    from tenantq import InvalidInput, Sandbox

    work = tmp_path / "cli"
    work.mkdir()
    problems: list[str] = []
    for name, extra in (("tqadv-cyc1", []), ("tqadv-cyc2", ["--from", "tqadv-cyc1"])):
        template_name.insert(0, name)
        made = run_cli(
            ["template", "create", name, *extra, "--sandbox", "process"], cwd=work, cgroup=memory_cgroup
        )
        assert made.returncode == 0, f"template create {name}: {made.stdout} {made.stderr}"
    # source trees whose in-tree build backend (or setup.py) leaves a host file if anything runs it
    ran = {key: tmp_path / f"tqadv-build-ran-{key}" for key in ("local_tree", "editable_tree")}
    trees = {}
    for key, marker_file in ran.items():
        tree_dir = tmp_path / f"tqadv_evil_src_{key}"
        tree_dir.mkdir()
        (tree_dir / "pyproject.toml").write_text(
            '[build-system]\nrequires = []\nbuild-backend = "tqadv_backend"\n'
            'backend-path = ["."]\n\n[project]\nname = "tqadv-evil"\nversion = "1"\n'
        )
        (tree_dir / "tqadv_backend.py").write_text(EVIL_BACKEND.format(ran=str(marker_file)))
        (tree_dir / "setup.py").write_text(f"open({str(marker_file)!r}, 'w').write('setup.py ran')\n")
        trees[key] = tree_dir
    reqs = {
        "local_tree": f"{trees['local_tree']}\n",
        "editable_tree": f"-e {trees['editable_tree']}\n",
        "read_host_file": f"-r {marker.path}\n",
        "huge": "x" * (2 << 20),
    }
    req_files = {}
    for key, text in reqs.items():
        path = work / f"{key}.txt"
        path.write_text(text)
        req_files[key] = str(path)
    tc = ["template", "create"]
    proc = ["--sandbox", "process"]

    def with_reqs(name: str, key: str) -> list[str]:
        return [*tc, name, "--python-requirements", req_files[key], *proc]

    bad: list[tuple[str, list[str]]] = [
        ("name climbing out", [*tc, "../tqadv-evil", *proc]),
        ("name with a slash", [*tc, "tqadv/evil", *proc]),
        ("empty name", [*tc, "", *proc]),
        ("dot dot", [*tc, "..", *proc]),
        ("trailing newline", [*tc, "tqadv-evil\n", *proc]),
        ("escape sequence in the name", [*tc, "tqadv-evil\x1b[31m", *proc]),
        ("leading dash", [*tc, *proc, "--", "-tqadv-evil"]),
        # the CLI's own rule: 1-63 characters
        ("a 300-character name", [*tc, "t" * 300, *proc]),
        ("from a missing template", [*tc, "tqadv-evil-from", "--from", "tqadv-missing", *proc]),
        ("from a climbing name", [*tc, "tqadv-evil-from2", "--from", "../tqadv-cyc1", *proc]),
        ("from itself", [*tc, "tqadv-cyc1", "--from", "tqadv-cyc1", *proc]),
        ("a cycle", [*tc, "tqadv-cyc1", "--from", "tqadv-cyc2", *proc]),
        ("warmup without a function", [*tc, "tqadv-evil-w1", "--warmup", "tqadv_missing", *proc]),
        ("warmup of a missing module", [*tc, "tqadv-evil-w2", "--warmup", "tqadv_missing:warm", *proc]),
        ("warmup climbing", [*tc, "tqadv-evil-w4", "--warmup", "../../tqadv:warm", *proc]),
        ("warmup code", [*tc, "tqadv-evil-w5", "--warmup", "os:system('touch /tmp/tqadv-evil-w5')", *proc]),
        (
            "warmup module injection",
            [*tc, "tqadv-evil-w6", "--warmup", "os;open('/tmp/tqadv-evil-w6','w'):getcwd", *proc],
        ),
        (
            "requirements missing",
            [*tc, "tqadv-evil-r1", "--python-requirements", str(work / "no.txt"), *proc],
        ),
        ("requirements huge", with_reqs("tqadv-evil-r3", "huge")),
        ("requirements: a local source tree", with_reqs("tqadv-evil-r4", "local_tree")),
        ("requirements: an editable source tree", with_reqs("tqadv-evil-r5", "editable_tree")),
        ("rm climbing", ["template", "rm", "../tqadv-cyc1"]),
        ("build a missing app", ["template", "build", "--app", "tqadv_missing_app", "--sandbox", "auto"]),
    ]
    # not said by the docs either way: recorded (they run after the check that nothing changed)
    probes: list[tuple[str, list[str]]] = [
        ("requirements -r a host file", with_reqs("tqadv-evil-r7", "read_host_file")),
        ("redefine base", [*tc, "base", *proc]),
        ("rm base", ["template", "rm", "base"]),
    ]
    # the API: refused with one line (InvalidInput), before anything is made
    for bad_name in ("../tqadv-evil", "tqadv/evil", "tqadv-missing", "base\n", "", "t" * 300):
        ids = sandbox_ids(data_dir)
        try:
            sbx = Sandbox.create(template=bad_name, driver="process", ttl_seconds=30)
        except InvalidInput as exc:
            if "\n" in str(exc).strip():
                problems.append(f"Sandbox.create(template={bad_name!r}): InvalidInput of more than one line")
        except Exception as exc:
            problems.append(
                f"Sandbox.create(template={bad_name!r}) raised {type(exc).__name__}, not "
                f"InvalidInput: {str(exc)[:200]}"
            )
        else:
            sbx.delete()
            problems.append(f"Sandbox.create(template={bad_name!r}) made a sandbox")
        if sandbox_ids(data_dir) - ids:
            problems.append(f"Sandbox.create(template={bad_name!r}) left {sandbox_ids(data_dir) - ids}")
    before = tree(data_dir)
    listed_before = run_cli(["template", "list", "--json"], cwd=work)
    started = time.monotonic()

    def run_one(item: tuple[str, list[str]]) -> tuple[str, subprocess.CompletedProcess[str]]:
        label, args = item
        t0 = time.monotonic()
        out = run_cli(args, cwd=work, cgroup=memory_cgroup)
        print(f"  ({time.monotonic() - t0:.1f} s) {label}")
        if out.returncode == 0 and args[:2] == ["template", "create"]:
            template_name.append(args[2] if args[2] != "--sandbox" else args[-1])
        return label, out

    def run_all(items: list[tuple[str, list[str]]]) -> list[tuple[str, subprocess.CompletedProcess[str]]]:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            return list(pool.map(run_one, items))

    # a name the others' errors would list comes last, alone
    results = run_all([item for item in bad if item[0] != "trailing newline"])
    results += [run_one(item) for item in bad if item[0] == "trailing newline"]
    print(f"{len(results)} bad CLI calls in {time.monotonic() - started:.1f} s")
    for label, out in results:
        text = (out.stdout + out.stderr).strip()
        print(f"  {label}: rc {out.returncode}: {text[:300]!r}")
        if out.returncode == 0:
            problems.append(f"template CLI: {label!r} was accepted: {text[:300]!r}")
        elif not one_line(out):
            problems.append(f"template CLI: {label!r} did not fail with one line: {text[:600]!r}")
        if marker.content in text:
            problems.append(f"template CLI: {label!r} echoed a host file's content: {text[:300]!r}")
    for key, marker_file in ran.items():
        if marker_file.exists():
            problems.append(
                f"template CLI: a requirements file naming a local source tree ({key}: "
                f"{reqs[key].strip()!r}) ran its build code on the host ({marker_file.read_text()!r}; docs: "
                f"'wheels only: nothing is compiled on the host')"
            )
    after = tree(data_dir)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    rewritten = [
        k
        for k in changed
        if k in before and k in after and before[k][0] == "file" and before[k][3] == after[k][3]
    ]
    if rewritten:
        problems.append(
            f"template CLI: refused input rewrote files of the data dir (same content, new "
            f"mtime: written before the input was refused?): {rewritten[:10]}"
        )
    others = [k for k in changed if k not in rewritten and not (k in before and before[k][0] == "dir")]
    if others:
        how = [(k, "new" if k not in before else "gone" if k not in after else "changed") for k in others]
        problems.append(f"template CLI: bad input changed the data dir: {how[:10]}")
    listed_after = run_cli(["template", "list", "--json"], cwd=work)
    if listed_after.returncode != 0 or listed_after.stdout != listed_before.stdout:
        problems.append(
            f"template CLI: `template list` changed or broke after bad input: rc "
            f"{listed_after.returncode} {listed_after.stderr.strip()[-300:]}"
        )
    strays = [str(p) for root in (tmp_path, Path("/tmp")) for p in root.glob("*tqadv-evil*")]
    strays += [
        str(p)
        for p in tmp_path.rglob("*tqadv-evil*")
        if "tqadv_evil_src" not in str(p) and not p.name.endswith(".txt") and "tqadv-build-ran" not in p.name
    ]
    if strays:
        problems.append(f"template CLI: bad input made host paths: {sorted(set(strays))[:10]}")
    for label, out in run_all(probes):
        text = (out.stdout + out.stderr).strip()
        print(f"  probe {label}: rc {out.returncode}: {text[:300]!r}")
        if marker.content in text:
            print(
                f"  NOTE: {label!r}: the error shows the content of the host file the requirements "
                f"named (-r {marker.path})"
            )
    assert not problems, "\n".join(problems)


# -- 4. the warmup is found from the current directory ----------------------------------------------


@pytest.mark.skipif(not BWRAP_OK, reason="process: bubblewrap does not work here")
def test_template_warmup_is_found_from_the_current_directory(
    data_dir: Path,  # noqa: F811
    tmp_path: Path,
    memory_cgroup: MemoryCgroup,
    template_name: list[str],
) -> None:
    """docs/sandbox-api.md: 'the module is found from the current directory or
    PYTHONPATH'; the command as installed (the `tenantq` script), not `python -m`."""
    script = Path(sys.executable).with_name("tenantq")
    if not script.exists() and shutil.which("tenantq") is None:
        pytest.skip("no installed `tenantq` script next to this interpreter")
    src = tmp_path / "cwd-src"
    module = make_warmup(src, "tqadv-cwd")
    name = f"tqadv-cwd-{uuid.uuid4().hex[:8]}"
    template_name.append(name)
    env_path = os.environ.get("PYTHONPATH", "")
    assert str(src) not in env_path
    out = run_cli(
        ["template", "create", name, "--warmup", f"{module}:warm", "--sandbox", "process"],
        cwd=src,
        cgroup=memory_cgroup,
        cmd=[str(script if script.exists() else shutil.which("tenantq"))],
    )
    assert out.returncode == 0, (
        f"`tenantq template create {name} --warmup {module}:warm` run in the directory "
        f"that holds {module}/ failed: {(out.stdout + out.stderr).strip()}"
    )
