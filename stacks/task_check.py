"""`trainer.task` (or `trainer.script`) resolved at synthesis, without running anyone's code.

The VM imports `module:callable` from the code it is given: the trainer package and the
experiment's `code_dir` (PYTHONPATH in that order). So the module must be a file shipped in one of
them (`a/b.py` or `a/b/__init__.py`, in a directory the archive keeps: `stacks.shipped` leaves out
tests/, __pycache__ and hidden entries), and the name must be bound at its top level. The file
is parsed with `ast`, never imported: a binding is a `def`, a `class`, an assignment or an import
at module level (also inside a top-level `if`/`try`/`with`). With `task_args` and a plain
`def`, the keyword arguments are checked against its parameters, as the trainer does at start.

Limits, decided: a module that defines `__getattr__` or does `from x import *` may provide any
name, so those pass unchecked; a name made at run time some other way (`globals()[...]`,
`exec`) is not seen and fails: bind it with one of the forms above.
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from stacks.shipped import ships

Problem = tuple[str, str]
REPO = Path(__file__).resolve().parent.parent


def find_module(module: str, roots: list[tuple[str, Path]]) -> tuple[str, Path] | None:
    """(root label, file) of `module` in the first root that ships it, as Python would find it."""
    parts = module.split(".")
    for label, root in roots:
        if root == REPO and parts[0] != "trainer":
            continue  # of the repository, only the trainer package is shipped
        for rel in (Path(*parts[:-1], parts[-1] + ".py"), Path(*parts, "__init__.py")):
            if (root / rel).is_file() and ships(rel):
                return label, root / rel
    return None


def _bindings(tree: ast.Module) -> tuple[dict[str, ast.AST], bool]:
    """Top-level names -> their binding statement, and whether anything may bind any name."""
    names: dict[str, ast.AST] = {}
    dynamic = False

    def visit(body: list[ast.stmt]) -> None:
        nonlocal dynamic
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = node
                dynamic |= node.name == "__getattr__"
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names[n.id] = node
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    if alias.name == "*":
                        dynamic = True
                    else:
                        names[alias.asname or alias.name.split(".")[0]] = node
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return names, dynamic


def _args_problem(fn: ast.FunctionDef | ast.AsyncFunctionDef, task_args: dict[str, Any]) -> str | None:
    a = fn.args
    if a.kwarg is not None:
        return None
    positional = [p.arg for p in (*a.posonlyargs, *a.args)]
    takes = set(positional[1:]) - {p.arg for p in a.posonlyargs} | {p.arg for p in a.kwonlyargs}
    unknown = sorted(set(task_args) - takes)
    if not unknown:
        return None
    return (f"{fn.name}() takes no argument(s) {', '.join(map(repr, unknown))}; allowed: "
            f"{', '.join(sorted(takes)) or 'none besides the context'}")


def problems(task: str, code_dir: Path | None, task_args: Any = None) -> Iterator[Problem]:
    """Problems of `trainer.task` (path "task") and of `[trainer.config.task_args]`."""
    module, _, attr = task.partition(":")
    roots = [("the trainer package", REPO)]
    if code_dir is not None:
        roots.append((f"code_dir {code_dir}", code_dir))
    found = find_module(module, roots)
    if found is None:
        where = f"trainer.code_dir ({code_dir})" if code_dir is not None else \
            "trainer.code_dir (not set)"
        rel = module.replace(".", "/")
        yield ("task", f"module {module!r} is not in the code the VM gets: no {rel}.py or "
               f"{rel}/__init__.py in {where} or in the trainer package; allowed: a module of "
               "trainer.tasks, or of your code_dir (not under tests/ or a hidden directory)")
        return
    label, path = found
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as e:
        yield "task", f"{shown} ({label}) is not valid Python: line {e.lineno}: {e.msg}"
        return
    except (OSError, ValueError) as e:
        yield "task", f"cannot read {shown} ({label}): {e}"
        return
    names, dynamic = _bindings(tree)
    node = names.get(attr)
    if node is None:
        if dynamic:
            return  # `__getattr__` or a star import may provide it: the VM will tell
        close = difflib.get_close_matches(attr, [n for n in names if not n.startswith("_")], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        yield ("task", f"{attr!r} is not defined at the top level of {shown} ({label}){hint}; "
               "allowed: a def, class, assignment or import of that name at module level")
        return
    if isinstance(task_args, dict) and task_args and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        msg = _args_problem(node, task_args)
        if msg is not None:
            yield "config.task_args", f"{msg} ({shown})"


def script_problems(script: str, code_dir: Path | None) -> Iterator[Problem]:
    """Problems of `trainer.script` (path "script"): a `.py` file inside `code_dir` that ships
    with it (the VM runs it from the unpacked code directory) and parses. Never imported."""
    rel = PurePosixPath(script)
    if any(ord(c) < 32 or ord(c) == 127 for c in script):
        yield "script", f"{script!r} contains a control character; allowed: a printable path"
        return
    if code_dir is None:
        yield ("script", f"{script!r} needs trainer.code_dir (not set): the script is a file of your code, "
               "shipped to the VM; allowed: set code_dir to the directory that holds it")
        return
    if rel.is_absolute() or ".." in rel.parts or "\\" in script or not rel.parts:
        yield ("script", f"{script!r} is not a path inside code_dir ({code_dir}); allowed: a relative path such as "
               "\"train.py\", without '..'")
        return
    if rel.suffix != ".py":
        yield "script", f"{script!r} is not a Python file; allowed: a path ending in .py, relative to code_dir"
        return
    path = code_dir / rel
    if not path.is_file():
        yield ("script", f"{script} is not in the code the VM gets: no file {path} in trainer.code_dir "
               f"({code_dir}); allowed: a .py file of your code_dir")
        return
    if not ships(Path(rel)):
        yield ("script", f"{script} is in code_dir ({code_dir}) but is not shipped to the VM (tests/, __pycache__ "
               "and hidden entries stay behind); allowed: a .py file elsewhere in code_dir")
        return
    for shadow in ("trainer.py", "trainer"):
        if (code_dir / shadow).exists() and ships(Path(shadow)):
            yield ("script", f"code_dir ({code_dir}) holds {shadow} at its top, which would hide the trainer package "
                   "from `python -m trainer` (a script runs from code_dir); allowed: rename it")
            return
    try:
        ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as e:
        yield "script", f"{path} (code_dir {code_dir}) is not valid Python: line {e.lineno}: {e.msg}"
    except (OSError, ValueError) as e:
        yield "script", f"cannot read {path}: {e}"
