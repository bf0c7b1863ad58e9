"""Reading experiment files: TOML in, validated `Experiment` out, or every problem at once.

Each problem is one line, `experiments/x.toml: field.path: what is wrong and what is allowed`.
All of a file's problems (and of every file asked for) are gathered before `ExperimentError` is
raised, so a user fixes a file in one pass.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from stacks.errors import InputError
from stacks.experiment import SECTIONS, Experiment, check_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ENV_VAR = "SPOTTRAIN_EXPERIMENTS"
#: The repository's experiments/, wherever the app is started from.
DEFAULT_DIR = Path(__file__).resolve().parent.parent / "experiments"


class ExperimentError(InputError):
    """Bad experiment input; `lines` holds one human-readable line per problem."""


@dataclass(frozen=True)
class ExperimentFile:
    """A validated experiment and where it came from."""

    name: str
    path: Path
    spec: Experiment


def display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _pydantic_lines(err: ValidationError, prefix: str, model: type[BaseModel]) -> list[str]:
    lines = []
    for e in err.errors(include_url=False):
        loc = ".".join(
            f"[{p}]" if isinstance(p, int) else str(p) for p in (prefix, *e["loc"]) if p != ""
        ).replace(".[", "[")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown key; allowed: {', '.join(_allowed_keys(model, e['loc'][:-1]))}"
        elif e["type"] == "missing":
            msg = "is required"
        elif e["type"] not in ("value_error",):
            msg = f"{msg}, got {e.get('input')!r}"
        lines.append(f"{loc}: {msg}")
    return lines


def _allowed_keys(model: type[BaseModel], parent: tuple[Any, ...]) -> list[str]:
    for part in parent:
        field = model.model_fields.get(str(part))
        ann = field.annotation if field else None
        # An optional section (`Pool | None`): its model.
        ann = next((a for a in get_args(ann) if a is not type(None)), ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return []
    return list(model.model_fields)


_ORDER = ["(file name)", "labels", *SECTIONS]


def _file_order(line: str) -> int:
    head = line.split(":", 1)[0].split(".", 1)[0].split("[", 1)[0]
    return _ORDER.index(head) if head in _ORDER else len(_ORDER)


def parse(data: dict[str, Any], name: str, source: str = "<experiment>") -> Experiment:
    """Validate parsed TOML; raise ExperimentError naming every problem."""
    problems = [f"{p}: {m}" for p, m in check_name(name)]
    try:
        exp = Experiment.model_validate(data)
    except ValidationError as err:
        problems += _pydantic_lines(err, "", Experiment)
        # The whole file failed; still report the cross-field rules of every section that holds.
        for key, cls in SECTIONS.items():
            raw = data.get(key, {})
            if not isinstance(raw, dict):
                continue
            known = {k: v for k, v in raw.items() if k in cls.model_fields}  # unknown keys
            try:  # are already reported and never change what the other rules decide
                section = cls.model_validate(known)
            except ValidationError:
                continue
            problems += [f"{key}.{p}: {m}" for p, m in section.problems()]
    else:
        problems += [f"{p}: {m}" for p, m in exp.problems(name)]
    if problems:
        problems.sort(key=_file_order)  # stable: within a section, pydantic's order
        raise ExperimentError([f"{source}: {line}" for line in problems])
    return exp


def load_file(path: Path) -> ExperimentFile:
    source = display(path)
    try:
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:  # its message names the line and column...
        msg = str(err)
        if "end of document" in msg:  # ...except at the very end
            msg = f"{msg.rstrip(')')}, line {len(text.rstrip().splitlines())})"
        raise ExperimentError([f"{source}: TOML syntax error: {msg}"]) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ExperimentError([f"{source}: cannot read: {err}"]) from None
    return ExperimentFile(path.stem, path, parse(data, path.stem, source))


def resolve(experiment: str | Path) -> Path:
    """One experiment named on a command line (`make deploy EXPERIMENT=...`): a file path, or a
    name that stands for experiments/NAME.toml."""
    text = str(experiment)
    path = Path(text) if text.endswith(".toml") or os.sep in text else DEFAULT_DIR / f"{text}.toml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in DEFAULT_DIR.glob("*.toml"))) or "none"
        raise ExperimentError([f"{display(path)}: no such experiment file (experiments/: {names})"])
    return path


def argument(arg: str) -> Path:
    """An experiment argument of a command (`make cost EXPERIMENT=...`): a file or folder as
    given, or NAME for experiments/NAME.toml (as `make deploy` takes it)."""
    path = Path(arg)
    return path if path.exists() or arg.endswith(".toml") or os.sep in arg else resolve(arg)


def discover(target: Path | None = None) -> list[Path]:
    """The experiment files: `target` (file or folder), else $SPOTTRAIN_EXPERIMENTS, else
    experiments/."""
    if target is None:
        env = os.environ.get(ENV_VAR)
        target = Path(env) if env else DEFAULT_DIR
    if target.is_dir():
        files = sorted(target.glob("*.toml"))
        if not files:
            raise ExperimentError([f"{display(target)}: no *.toml experiment files"])
        return files
    if target.is_file():
        return [target]
    raise ExperimentError([f"{display(target)}: no such experiment file or folder"])


def load_all(target: Path | None = None) -> list[ExperimentFile]:
    lines: list[str] = []
    loaded: list[ExperimentFile] = []
    for path in discover(target):
        try:
            loaded.append(load_file(path))
        except ExperimentError as err:
            lines += err.lines
    if lines:
        raise ExperimentError(lines)
    return loaded
