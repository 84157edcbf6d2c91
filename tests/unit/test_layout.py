"""The layout shows the flow: store -> fairness -> dispatch -> sandbox ->
guest, with web and the CLI at the edge. Checked on the source's imports
(every import, also those inside functions; not those under TYPE_CHECKING)."""

from __future__ import annotations

import ast
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


def imports(path: Path, *, module_level: bool) -> set[str]:
    """The tenantq modules `path` imports (at module level only, or anywhere)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            test = child.test if isinstance(child, ast.If) else None
            if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
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
