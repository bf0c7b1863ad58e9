"""The chaos matrix's report: a markdown table, one row per cell, and the violations."""
from __future__ import annotations

import os
import platform
import subprocess
import time

from drill.chaos.faults import FAULTS
from drill.chaos.matrix import Result
from drill.chaos.rig import REPO

HEADER = ("| fault | moment | resumed from | steps lost | exit codes | unpickled | fresh start | digest equal "
          "| verdict | notes |\n|---|---|---|---|---|---|---|---|---|---|")


def _cell(x: object) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def row(r: Result) -> str:
    title = FAULTS[r.fault].title
    if r.na is not None:
        return f"| {_cell(title)} | {r.moment} | — | — | — | — | — | — | n/a | {_cell(r.na)} |"
    exits = ", ".join(f"{role} {code}" for role, code in r.exits)
    notes = "; ".join([*r.notes, *r.violations])
    return (f"| {_cell(title)} | {r.moment} | {'—' if r.resumed is None else r.resumed} "
            f"| {'—' if r.lost is None else r.lost}{f' ({r.allowed} allowed)' if r.allowed else ''} "
            f"| {_cell(exits)} | {r.unpickled} "
            f"| {'YES' if r.fresh_start else 'no'} | {'—' if r.digest_equal is None else 'yes' if r.digest_equal else 'NO'} "
            f"| {r.verdict} | {_cell(notes)} |")


def table(results: list[Result]) -> str:
    return "\n".join([HEADER, *(row(r) for r in results)])


def machine(load_at_start: tuple[float, ...] | None = None) -> str:
    """Cores, memory, load (at the start and the end), kernel and the torch version of this run."""
    import torch

    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    start = "" if load_at_start is None else " ".join(f"{x:.2f}" for x in load_at_start) + " at the start, "
    return (f"{os.cpu_count()} cores{mem}, load average {start}{load} at the end, Linux {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return (out.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty else "")


def summary(results: list[Result], seconds: float, command: str, load_at_start: tuple[float, ...] | None = None) -> str:
    run = [r for r in results if r.na is None]
    failed = [r for r in run if not r.ok]
    lines = [f"`{command}` on {time.strftime('%Y-%m-%d')}, commit {commit()}: {len(run)} cells run "
             f"({len(results) - len(run)} n/a), {len(run) - len(failed)} kept the promise, {len(failed)} did not; "
             f"{seconds / 60:.1f} minutes.", "", f"Machine: {machine(load_at_start)}.", "", table(results)]
    if failed:
        lines += ["", "Violations:", ""]
        lines += [f"- {FAULTS[r.fault].title} at {r.moment}: {'; '.join(r.violations)}" for r in failed]
    return "\n".join(lines)


def fault_model() -> str:
    """RELIABILITY.md's fault model (generated from drill.chaos.faults; a test keeps the file current)."""
    lines = ["| fault | what it reproduces | how `make chaos` injects it | moments with a cell |", "|---|---|---|---|"]
    for f in FAULTS.values():
        moments = ", ".join(f.moments()) or "none (n/a at every moment)"
        lines.append(f"| {_cell(f.title)} | {_cell(f.reproduces)} | {_cell(f.injects)} | {moments} |")
    return "\n".join(lines)


def embed(text: str, block: str, content: str) -> str:
    """``text`` with what lies between ``<!-- block -->`` and ``<!-- /block -->`` replaced."""
    start, end = f"<!-- {block} -->\n", f"<!-- /{block} -->"
    i, j = text.index(start) + len(start), text.index(end)
    return text[:i] + content.rstrip("\n") + "\n" + text[j:]


def embedded(text: str, block: str) -> str:
    start, end = f"<!-- {block} -->\n", f"<!-- /{block} -->"
    return text[text.index(start) + len(start):text.index(end)].rstrip("\n")
