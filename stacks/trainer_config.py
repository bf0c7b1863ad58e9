"""`[trainer.config]` of an experiment: the trainer's own settings, checked here, written for the VM.

The table takes any setting of the trainer's config file (`trainer.config.RunConfig`, the same
names, types and tables: `[trainer.config.task_args]`, `[trainer.config.tiers.gcs]`) and is
validated by that very model at synthesis, so a typo fails before anything is deployed. The VM
gets it as a TOML file (`to_toml`, written by the startup script) that the trainer reads with
`--config`: the values the user wrote, byte for byte what synthesis validated.

The settings the stack sets itself (`STACK_SETTINGS`) are refused here, each with the field that
sets it, and so is a setting that `trainer.args` passes as a flag too (flags would win silently).
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from trainer.config import RunConfig

Problem = tuple[str, str]

#: RunConfig settings the stack sets from other fields (or relies on), and where they come from.
STACK_SETTINGS: dict[str, str] = {
    "run_dir": "the stack: the checkpoint disk's run directory",
    "local_dir": "the stack from disk.local_ssd_count: the local SSD tier",
    "data_dir": "the stack from [data]: where the dataset was staged",
    "gcs_uri": "the stack: the experiment's bucket",
    "steps": "trainer.steps",
    "task": "trainer.task",
    "script": "trainer.script",
    "script_args": "trainer.script_args",
    "health_port": "trainer.health_port",
    "startup_grace_s": "group.initial_delay_sec",
    "preemption_budget_s": "the stack from machine.provisioning: the VM's shutdown window",
    "health_host": "the stack: the group's health check reaches every address",
    "health_request": "the stack: the group's health check sends this request",
    "parallelism": "trainer.parallelism",
    "price_per_hour": "the stack from [cost] or the price catalog",
    "on_demand_price_per_hour": "the stack from [cost] or the price catalog",
}
#: Sinks of the trainer's events (`[trainer.config.sinks.NAME]`) the stack turns on itself.
STACK_SINKS: dict[str, str] = {
    "monitoring": "the stack: the run's goodput, cost and step as Cloud Monitoring metrics (docs/watch.md)",
}
#: Placeholders for what the stack sets, so that the trainer's cross-field rules can run.
_PLACEHOLDERS = {"run_dir": "/mnt/spottrain/run", "gcs_uri": "gs://bucket/runs/experiment"}
REFERENCE = "docs/reference/trainer.md"


def _file_values(config: dict[str, Any]) -> dict[str, Any]:
    """What `trainer.config.load_run_config` makes of a file's top-level keys ("none": unset)."""
    return {k: None if v == "none" else v for k, v in config.items()}


def fingerprint_settings() -> list[str]:
    """The settings the trainer's resume fingerprint holds (`RunConfig.fingerprint`, asked, not
    listed here): a change to any of them is refused by the run's existing checkpoints."""
    keys: list[str] = []
    for extra in ({}, {"global_batch_size": 1}):
        cfg = RunConfig.model_validate({**_PLACEHOLDERS, "steps": 1, **extra})
        keys += [k for k in cfg.fingerprint(dataset_len=0) if k in RunConfig.model_fields and k not in keys]
    return keys


def flag_settings() -> dict[str, str]:
    """`python -m trainer run` flags by the setting they set (`--seed` -> seed): from the trainer's
    own parser, so that a new flag is known here without a list to keep."""
    import argparse

    from trainer.cli import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    run = sub.choices["run"]
    return {opt: a.dest for a in run._actions for opt in a.option_strings if a.dest != "help"}


def problems(config: dict[str, Any], *, steps: int, task: str, local_ssd: bool,
             args: list[str]) -> Iterator[Problem]:
    """Every problem of `[trainer.config]`, paths relative to `trainer`."""
    for key in config:
        if key in STACK_SETTINGS:
            source = STACK_SETTINGS[key]
            yield (f"config.{key}", f"is set by {source}; allowed: remove it here"
                   + (f" and set {source}" if source.startswith(("trainer.", "group.")) else ""))
    sinks = config.get("sinks")
    for name in sinks if isinstance(sinks, dict) else ():
        if name in STACK_SINKS:
            yield f"config.sinks.{name}", f"is set by {STACK_SINKS[name]}; allowed: remove it here"
    flags = flag_settings()
    for i, arg in enumerate(args):
        setting = flags.get(arg.split("=", 1)[0])
        if setting == "config" and config:
            yield (f"args[{i}]", "--config names another settings file while [trainer.config] is "
                   "set; allowed: one of the two ([trainer.config] is checked before deploying)")
        elif setting in config:
            yield (f"args[{i}]", f"{arg.split('=', 1)[0]} sets {setting}, which [trainer.config] "
                   "sets too (the flag would win); allowed: one of the two")
    own = {k: v for k, v in _file_values(config).items() if k not in STACK_SETTINGS}
    if isinstance(own.get("sinks"), dict):
        own["sinks"] = {k: v for k, v in own["sinks"].items() if k not in STACK_SINKS}
    values = {**own, **_PLACEHOLDERS, "steps": steps, "task": task}
    if local_ssd:
        values["local_dir"] = "/mnt/localssd/run"
    try:
        RunConfig.model_validate(values)
    except ValidationError as err:
        for e in err.errors(include_url=False):
            loc = [str(p) for p in e["loc"]]
            if not loc or loc[0] not in own:
                continue  # a placeholder's rule: the stack's own values always pass
            yield "config." + ".".join(loc), _message(e, loc, local_ssd)


def _message(e: Any, loc: list[str], local_ssd: bool) -> str:
    if e["type"] == "extra_forbidden":
        known = _known(loc[:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return f"unknown setting; {hint}allowed: a setting in {REFERENCE}"
    msg = e["msg"].removeprefix("Value error, ")
    if loc[0] == "tiers" and "local_dir" in msg and not local_ssd:
        msg += "; allowed: disk.local_ssd_count > 0 for the local tier"
    if e["type"] not in ("value_error",):
        msg = f"{msg}, got {e.get('input')!r}"
    return msg


def _known(parent: list[str]) -> list[str]:
    """The settings allowed where an unknown one was found (top level or a tier's table)."""
    if not parent:
        return [k for k in RunConfig.model_fields if k not in STACK_SETTINGS]
    if parent[0] == "tiers" and len(parent) == 2:
        from trainer.config import TierCadence

        return list(TierCadence.model_fields)
    return []


# --- the file the VM's trainer reads ----------------------------------------------------------

def vm_config(config: dict[str, Any], *, project: str, experiment: str) -> dict[str, Any]:
    """`[trainer.config]` with the sinks the stack turns on (`STACK_SINKS`): the custom metrics
    of the experiment's dashboard, written by the job's rank 0 (`trainer.observe.sinks.monitoring`)."""
    sinks = dict(config.get("sinks") or {})
    sinks["monitoring"] = {"project": project, "experiment": experiment, "run": f"runs/{experiment}"}
    return {**config, "sinks": sinks}


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def to_toml(config: dict[str, Any]) -> str:
    """`config` as a TOML document that `tomllib` reads back equal (tables inline, keys sorted:
    the same table always renders the same bytes). "" for an empty table."""
    return "".join(f"{_key(k)} = {_value(config[k])}\n" for k in sorted(config))


def _key(k: str) -> str:
    return k if _BARE_KEY.match(k) else _string(k)


def _string(s: str) -> str:
    # JSON's escapes (\" \\ \n \t \uXXXX ...) are TOML's too; DEL is the one control character
    # JSON leaves raw and TOML refuses.
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v[k])}" for k in sorted(v)) + "}"
    raise TypeError(f"{type(v).__name__} has no TOML form here: {v!r}")
