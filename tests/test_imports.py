"""The project's modules import one another without a cycle (harness.program.decode and
harness.program.kernel_decode once did), counting imports inside functions too: a cycle there works only
by the order in which things happen to load, and hides which module depends on which."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "reference", "harness")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (any scope; `from pkg import mod` counts mod)."""
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    assert "harness.program.models" in graph["harness.program.decode"]  # top level
    assert "kernels.gemv" in graph["harness.program.kernel_decode"]  # inside functions only


def test_no_import_cycle_among_the_projects_modules():
    assert cycles(import_graph()) == []


def test_every_import_of_the_project_resolves():
    """Each `import` or `from ... import` of a project module, at any scope, in the packages, the
    tests and the notebook builders, names a module that exists and, for `from m import x`, a
    submodule of m or a name m defines at its top level. An import inside a function of a GPU test
    or a device-only path runs nowhere in CI: a module moved or a name renamed would otherwise
    break it only on the device."""
    modules = _modules()
    sources = [p for package in (*PACKAGES, "tests", "notebooks") for p in (ROOT / package).rglob("*.py")]
    top_names: dict[str, set[str]] = {}

    def defined(module: str) -> set[str]:
        if module not in top_names:
            tree = ast.parse(modules[module].read_text())
            names = set()
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                        names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    names |= {(a.asname or a.name).split(".")[0] for a in node.names}
                elif isinstance(node, (ast.If, ast.Try)):  # names bound under a guard count
                    names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
                    names |= {(a.asname or a.name).split(".")[0] for n in ast.walk(node)
                              if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
            top_names[module] = names
        return top_names[module]

    broken = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in PACKAGES and alias.name not in modules:
                        broken.append(f"{path.relative_to(ROOT)}:{node.lineno}: import {alias.name}")
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module \
                    and node.module.split(".")[0] in PACKAGES:
                if node.module not in modules:
                    broken.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module}")
                    continue
                for alias in node.names:
                    if alias.name != "*" and f"{node.module}.{alias.name}" not in modules \
                            and alias.name not in defined(node.module):
                        broken.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {alias.name}")
    assert not broken, "\n".join(broken)
