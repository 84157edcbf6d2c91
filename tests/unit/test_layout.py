"""The layout shows the flow: store -> fairness -> dispatch -> sandbox ->
guest, with web and the CLI at the edge. Checked on the source's imports:
every import, also those inside functions; the circle test counts those
under TYPE_CHECKING too (a type-only import is still a dependency)."""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


@cache
def modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(path: Path, *, module_level: bool, type_only: bool = False,
            third_party: bool = False) -> set[str]:
    """The tenantq modules `path` imports (at module level only, or anywhere;
    with `type_only`, those under TYPE_CHECKING too; with `third_party`, the
    top-level names of every other package it imports as well)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            test = child.test if isinstance(child, ast.If) else None
            if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" and not type_only:
                continue
            if module_level and isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.add(child.module)
                found.update(f"{child.module}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    if third_party:
        return {name if name in modules() else name.split(".")[0] for name in found}
    return {name for name in found if name in modules()}


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def package_imports(pkg: str) -> set[str]:
    out: set[str] = set()
    for name, path in modules().items():
        if package(name) == pkg:
            out |= {package(m) for m in imports(path, module_level=False)} - {pkg}
    return out


def test_the_domain_stands_alone() -> None:
    """Validation, cron, records and formatting import nothing of tenantq but its errors."""
    assert package_imports("tenantq.domain") <= {"tenantq.errors"}


def test_the_store_and_the_schedule_know_nothing_of_what_runs_jobs() -> None:
    assert package_imports("tenantq.store") <= {"tenantq.errors", "tenantq.settings", "tenantq.domain"}
    assert package_imports("tenantq.fairness") <= {"tenantq.store", "tenantq.errors", "tenantq.domain"}


def test_handler_side_code_does_not_load_the_store() -> None:
    """The registry, the secrets and the settings validate through the domain, not the store."""
    for name in ("tenantq.registry", "tenantq.secrets", "tenantq.settings"):
        store = {m for m in imports(modules()[name], module_level=False) if m.startswith("tenantq.store")}
        assert store == set(), name


def test_the_sandbox_api_and_its_drivers_know_nothing_of_the_queue() -> None:
    """The queue's executors (dispatch/executors/) are built on the sandbox
    layer, never the other way round."""
    queue_side = {"tenantq.dispatch", "tenantq.fairness", "tenantq.store", "tenantq.client", "tenantq.queue",
                  "tenantq.registry", "tenantq.secrets", "tenantq.host_functions", "tenantq.tenant_data",
                  "tenantq.web", "tenantq.cli"}
    assert package_imports("tenantq.sandbox") & queue_side == set()


def test_nothing_but_the_edge_imports_the_edge() -> None:
    edge = {name for name in {package(m) for m in modules()} if name.startswith(("tenantq.cli", "tenantq.web",
                                                                                "tenantq.demo"))}
    for pkg in ("tenantq.store", "tenantq.fairness", "tenantq.dispatch", "tenantq.sandbox", "tenantq.guest"):
        assert package_imports(pkg) & edge == set(), pkg


def test_the_driver_contract_imports_no_driver() -> None:
    contract = modules()["tenantq.sandbox.driver"]
    assert not {m for m in imports(contract, module_level=False) if m.startswith("tenantq.sandbox.drivers")}


def test_no_module_level_import_cycle() -> None:
    graph = {name: imports(path, module_level=True) - {name} for name, path in modules().items()}
    # a package's module importing its own package's __init__ is not a cycle of the layout
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name)
    assert not cycles, cycles[:3]


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_circle_of_modules_through_any_import() -> None:
    """Not even through an import inside a function or under TYPE_CHECKING:
    two modules that know each other are one module in two files. (A
    module importing its own package's __init__ is not counted.)"""
    graph = {name: {m for m in imports(path, module_level=False, type_only=True)
                    if m != name and not name.startswith(m + ".")}
             for name, path in modules().items()}
    assert _strongly_connected(graph) == []


def test_the_public_sandbox_api_never_loads_the_store_or_the_database_driver() -> None:
    """`Sandbox.create(egress=...)` and the rest of the Sandbox API (a product
    of its own): importing every module of the sandbox and egress packages,
    in a fresh interpreter, loads no `tenantq.store` and no psycopg."""
    names = sorted(n for n in modules() if n.startswith(("tenantq.sandbox", "tenantq.egress"))
                   and not n.endswith("__main__"))
    code = ("import importlib, sys\n"
            "from tenantq import Sandbox, AsyncSandbox\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('tenantq.store', 'psycopg'))))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=SRC.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_guest_imports_only_the_guest_the_registry_and_errors() -> None:
    """What runs inside a sandbox: its own package, the handler registry the
    app's handlers register in, and the error types; nothing of the host."""
    allowed = ("tenantq.guest", "tenantq.registry", "tenantq.errors")
    for name, path in modules().items():
        if package(name) != "tenantq.guest":
            continue
        outside = {m for m in imports(path, module_level=False) if not m.startswith(allowed)}
        assert outside == set(), name
