"""The import graph of `stacks/`: which modules import which, read with `ast` (imports inside
functions count: a lazy import is still a dependency, and a circle through one is still a circle).

No circle anywhere, and the experiment model at the bottom: validated once at the edge, it
imports no construct (nothing that imports cdktn) and neither the boot scripts nor the delivery.
"""

from __future__ import annotations

import ast
from pathlib import Path

STACKS = Path(__file__).resolve().parents[2] / "stacks"
CDK = ("cdktn", "cdktn_provider_google", "constructs")


def _imports(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(modules of stacks/, other top-level packages) that `tree` imports anywhere in it."""
    ours: set[str] = set()
    others: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "stacks":
                    ours.update(parts[1:2])
                else:
                    others.add(parts[0])
        elif isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".") if node.module else []
            if node.level == 1 or parts[:1] == ["stacks"]:
                rest = parts if node.level == 1 else parts[1:]
                # `from stacks import x` / `from . import x` name modules; `from stacks.x import y` one.
                ours.update(rest[:1] or [a.name for a in node.names])
            elif node.level == 0:
                others.add(parts[0])
    return ours, others


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> the stacks modules it imports, module -> the other packages it imports)."""
    modules = {p.stem: p for p in STACKS.glob("*.py") if p.stem != "__init__"}
    edges, outside = {}, {}
    for name, path in sorted(modules.items()):
        ours, others = _imports(ast.parse(path.read_text(), filename=str(path)))
        edges[name] = {m for m in ours if m in modules and m != name}
        outside[name] = others
    return edges, outside


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), each as the
    path `a -> b -> ... -> a` through that component, starting from its first module by name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_circle(edges, c) for c in components]


def _circle(edges: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself (breadth first)."""
    start = min(component)
    paths = {w: [start, w] for w in sorted(edges[start] & component)}
    queue = list(paths)
    while start not in paths:
        v = queue.pop(0)
        for w in sorted(edges[v] & component):
            if w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    return paths[start]


def below(edges: dict[str, set[str]], module: str) -> set[str]:
    """Every stacks module that `module` imports, directly or not."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for w in edges[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_the_graph_sees_every_kind_of_import():
    """So that an empty graph cannot pass: a top-level, a `from stacks import`, a function-level
    and a relative import each make an arrow."""
    edges, outside = graph()
    assert "boot" in edges["stack"]  # from stacks.boot import ...
    assert "gcp_rules" in edges["experiment"]  # from stacks import gcp_rules as R
    assert "wheels" in edges["delivery"]  # inside user_archive()
    assert "cdktn" in outside["stack"]
    ours, _ = _imports(ast.parse("def f():\n    from . import pool\n    from .boot import x\n"))
    assert ours == {"pool", "boot"}


def test_cycles_names_each_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert cycles(edges) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_stacks():
    edges, _ = graph()
    found = cycles(edges)
    assert not found, "import cycles in stacks/: " + "; ".join(" -> ".join(c) for c in found)


def test_the_experiment_model_imports_no_construct():
    edges, outside = graph()
    under = below(edges, "experiment") | {"experiment"}
    assert not under & {"boot", "delivery", "stack", "instance_template", "coordinator"}, sorted(under)
    constructs = sorted(m for m in under if outside[m] & set(CDK))
    assert not constructs, f"the experiment model reaches cdktn through {constructs}"
