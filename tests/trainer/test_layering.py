"""The trainer's packages import downwards only (docs/development.md draws the layers).

Every ``import`` of the trainer's own modules, at the top of a module or inside a function, goes to
a module of the same layer or a lower one: checkpointing knows nothing of the observers, the data
or the loop; the observers nothing of the data or the loop; and so on up to the commands.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Layers, lowest first: a module may import its own layer and those below.
LAYERS = [
    ("foundation", ["trainer", "trainer.collector", "trainer.exit_status", "trainer.startup_notice", "trainer.distributed", "trainer.gpu",
                    "trainer.manifest_auth",
                    "trainer.cloud", "trainer.retry", "trainer.shutdown_window", "trainer.untrusted"]),
    ("checkpoint", ["trainer.checkpoint"]),
    ("observe", ["trainer.observe"]),
    ("data and the task contract", ["trainer.data", "trainer.task"]),
    ("the loop's parts and a run's outputs", ["trainer.loop", "trainer.artifacts", "trainer.export"]),
    ("the loop and the commands", ["trainer.train", "trainer.status", "trainer.config", "trainer.cli",
                                   "trainer.__main__", "trainer.rendezvous", "trainer.tasks",
                                   "trainer.checkpoint_key", "trainer.run"]),
]


def _layer(module: str) -> int:
    """The layer of ``module`` (its longest matching prefix)."""
    best, depth = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and p.count(".") > depth:
                best, depth = i, p.count(".")
    assert best >= 0, f"{module} is in no layer: add it to LAYERS (and to docs/development.md)"
    return best


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, module: str) -> list[str]:
    out = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "trainer"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "trainer":
                continue
            for a in node.names:  # ``from trainer.x import y``: y may be a module of its own
                full = f"{base}.{a.name}"
                out.append(full if (ROOT / Path(*full.split("."))).with_suffix(".py").exists()
                           or (ROOT / Path(*full.split("."))).is_dir() else base)
    return out


def test_every_import_of_the_trainer_goes_down_or_across() -> None:
    upwards = []
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        module = _module_of(path)
        here = _layer(module)
        for target in _imports(path, module):
            if _layer(target) > here:
                upwards.append(f"{module} ({LAYERS[here][0]}) imports {target} ({LAYERS[_layer(target)][0]})")
    assert not upwards, "imports that go up a layer:\n" + "\n".join(upwards)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The check itself can fail: an import from the loop inside checkpointing is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from trainer.loop.session import Session\n    from . import stores\n")
    got = _imports(probe, "trainer.checkpoint.probe")
    assert got == ["trainer.loop.session", "trainer.checkpoint.stores"]
    assert _layer(got[0]) > _layer("trainer.checkpoint.probe") == _layer(got[1])
