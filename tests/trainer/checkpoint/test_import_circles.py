"""trainer.checkpoint's modules import one another without a circle (at the top of a module, inside
a function or under TYPE_CHECKING alike): each can be read, and tested, on top of what it imports."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "trainer" / "checkpoint"


def _graph() -> dict[str, set[str]]:
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    graph: dict[str, set[str]] = {}
    for name in modules:
        deps: set[str] = set()
        for node in ast.walk(ast.parse((PACKAGE / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if module == "trainer.checkpoint":
                    deps |= {a.name for a in node.names if a.name in modules}
                elif module.startswith("trainer.checkpoint."):
                    deps.add(module.split(".")[2])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[2] for a in node.names if a.name.startswith("trainer.checkpoint.")}
        graph[name] = deps - {name}
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []

    def walk(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (found := walk(d)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := walk(m)) is not None:
            return found
    return None


def test_no_module_of_the_checkpoint_package_imports_itself_through_another() -> None:
    graph = _graph()
    assert {"checkpointer", "uploader", "survey", "emergency", "disk_writer", "bookkeeping"} <= set(graph)
    circle = _circle(graph)
    assert circle is None, " -> ".join(circle)


def test_a_circle_is_found() -> None:
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None
