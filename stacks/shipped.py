"""Which entries of a source tree ship to the VM: the name rule the code archives apply
(`stacks.delivery`) and the check of `trainer.task` at synthesis relies on (`stacks.task_check`).

Names only, no file system: a directory ships unless it is hidden or a test or bytecode cache
directory; a file ships unless it is hidden or compiled bytecode.
"""

from __future__ import annotations

from pathlib import PurePath

EXCLUDED_DIRS = frozenset({"__pycache__", "tests", "test"})
EXCLUDED_SUFFIXES = (".pyc", ".pyo")


def ships_dir(name: str) -> bool:
    return name not in EXCLUDED_DIRS and not name.startswith(".")


def ships_file(name: str) -> bool:
    return not name.startswith(".") and not name.endswith(EXCLUDED_SUFFIXES)


def ships(rel: PurePath) -> bool:
    """Whether the file at `rel` (relative to the top of the tree) ships."""
    *dirs, name = rel.parts
    return all(ships_dir(d) for d in dirs) and ships_file(name)
