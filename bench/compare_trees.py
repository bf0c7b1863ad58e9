"""Run benchmarks against two source trees in one session, alternating, and print them side by side.

    python -m bench.compare_trees BEFORE AFTER --rounds 3 \\
        --bench "trainer_bench --steps 150 --rounds 1" --bench checkpoint_bench

BEFORE and AFTER are checkouts of the repository (for instance `git archive <commit> | tar -x -C
DIR`, with `.venv` linked in): each round runs every benchmark once in each tree, each tree with
its own Python (`TREE/.venv/bin/python`), its own `bench/` and its own code, so the comparison
holds across refactors that move modules. The trees take turns, and the tree that goes first
alternates from round to round (before-after, after-before, ...), so neither always meets a cold
page cache or the start of a burst of load from other jobs on the machine.

A benchmark with arguments runs as `python -m bench.NAME ARGS`, one without as `python -m bench
NAME`. Every run gets the same throwaway checkpoint key (as `python -m bench` gives one) and the
tree as PYTHONPATH; `--env KEY=VALUE` adds variables (e.g. `SPOTTRAIN_BENCH_GB=0.5`).

The output is markdown: the machine's load average (/proc/loadavg) before and after each run,
then per benchmark one row per (table row, numeric column) of what the benchmark printed: every
run's value in each tree, the medians, the ratio after/before of the medians, and whether the
two trees' ranges overlap (a first reading of noise: ranges that do not overlap deserve a second
look, ranges that do are not a difference the rounds can show). A cell equal in every run of
both trees (a size, a count) is left out; text cells are shown when they differ. `--json PATH`
keeps every run's output, timings and load, rewritten after each run; `--from-json PATH` prints
the table again from such a file (of a session cut short, say) without running anything.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class Run:
    tree: str  # "before" or "after"
    bench: str
    round: int
    code: int
    wall_s: float
    load_before: str
    load_after: str
    stdout: str
    stderr_tail: str
    #: table title (its header) -> row key -> column header -> cell text
    cells: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def parse_tables(text: str) -> dict[str, dict[str, dict[str, str]]]:
    """Every markdown table in ``text``: {header line: {row key: {column: cell}}}. The row key is
    the first cell, or the first two where the first repeats (a measure at several sizes)."""
    tables: dict[str, dict[str, dict[str, str]]] = {}
    block: list[list[str]] = []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 3:
            header, rows = block[0], [r for r in block[2:] if len(r) == len(block[0])]
            firsts = [r[0] for r in rows]
            table: dict[str, dict[str, str]] = {}
            for r in rows:
                key = r[0] if firsts.count(r[0]) == 1 else f"{r[0]} / {r[1]}"
                table[key] = dict(zip(header[1:], r[1:]))
            tables[" | ".join(header)] = table
        block = []
    return tables


def _number(cell: str) -> str | None:
    """The cell's first number as the benchmark printed it (its precision is the benchmark's)."""
    m = _NUMBER.search(cell.replace("**", ""))
    return m.group(0) if m else None


def _like(x: float, printed: list[str]) -> str:
    """``x`` with as many decimals as the most precise of ``printed``."""
    decimals = max(len(t.partition(".")[2]) for t in printed)
    return f"{x:.{decimals}f}"


def run_one(tree: Path, name: str, spec: list[str], env: dict[str, str], label: str, rnd: int,
            timeout_s: float) -> Run:
    argv = [str(tree / ".venv" / "bin" / "python"), "-m"] + ([f"bench.{name}", *spec] if spec else ["bench", name])
    load0, t0 = _load(), time.monotonic()
    try:
        p = subprocess.run(argv, cwd=tree, env={**os.environ, **env, "PYTHONPATH": str(tree)},
                           capture_output=True, text=True, timeout=timeout_s)
        code, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        code, out, err = 124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), \
            f"timed out after {timeout_s:g} s"
    run = Run(label, name, rnd, code, time.monotonic() - t0, load0, _load(), out, err[-3000:])
    run.cells = parse_tables(out) if code == 0 else {}
    return run


def side_by_side(runs: list[Run], benches: list[str]) -> str:
    lines: list[str] = []
    lines += ["### Load average (1, 5, 15 min) around each run", "",
              "| round | bench | tree | wall s | exit | load before | load after |", "|---|---|---|---:|---:|---|---|"]
    for r in runs:
        lines.append(f"| {r.round} | {r.bench} | {r.tree} | {r.wall_s:.0f} | {r.code} | {r.load_before} | {r.load_after} |")
    for name in benches:
        lines += ["", f"### {name}: after / before", ""]
        mine = [r for r in runs if r.bench == name]
        failed = [r for r in mine if r.code != 0]
        for r in failed:
            last = (r.stderr_tail.strip().splitlines() or [""])[-1]
            lines.append(f"- {r.tree}, round {r.round}: FAILED (exit {r.code}): `{last}`")
        ok = {t: [r for r in mine if r.tree == t and r.code == 0] for t in ("before", "after")}
        if not ok["before"] or not ok["after"]:
            lines.append("- no comparison: a tree has no successful run")
            continue
        lines += ["| table row | column | before (each run) | after (each run) | before median | after median "
                  "| after / before | ranges overlap |", "|---|---|---|---|---:|---:|---:|---|"]
        first = ok["before"][0].cells
        for title, table in first.items():
            for row, cols in table.items():
                for col in cols:
                    vals = {t: [rr.cells.get(title, {}).get(row, {}).get(col) for rr in ok[t]] for t in ok}
                    if any(v is None for vs in vals.values() for v in vs):
                        continue  # the row is not in every run (a table that changed shape)
                    texts = {t: [str(v) for v in vs] for t, vs in vals.items()}
                    nums = {t: [_number(v) for v in vs] for t, vs in texts.items()}
                    numeric = all(x is not None for xs in nums.values() for x in xs)
                    if numeric and len({float(x) for xs in nums.values() for x in xs if x is not None}) == 1:
                        continue  # equal everywhere: a size, a count, a constant
                    if not numeric:
                        if len({x for xs in texts.values() for x in xs}) > 1:
                            lines.append(f"| {row} | {col} | {'; '.join(texts['before'])} | {'; '.join(texts['after'])} "
                                         "| | | | |")
                        continue
                    shown = {t: [x for x in nums[t] if x is not None] for t in nums}
                    b, a = ([float(x) for x in shown[t]] for t in ("before", "after"))
                    mb, ma = statistics.median(b), statistics.median(a)
                    every = shown["before"] + shown["after"]
                    ratio = f"{ma / mb:.3f}" if mb else "—"
                    overlap = "yes" if max(b) >= min(a) and max(a) >= min(b) else "**no**"
                    lines.append(f"| {row} | {col} | {', '.join(shown['before'])} | {', '.join(shown['after'])} "
                                 f"| {_like(mb, every)} | {_like(ma, every)} | {ratio} | {overlap} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", type=Path, nargs="?", help="the tree measured as 'before' (a checkout with .venv)")
    p.add_argument("after", type=Path, nargs="?", help="the tree measured as 'after'")
    p.add_argument("--bench", action="append", default=[], metavar='"NAME [ARGS]"',
                   help="a benchmark module stem and its arguments; repeat for several")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs every benchmark once in each tree")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment for every run")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    p.add_argument("--json", type=Path, help="write every run (output, timings, load) here")
    p.add_argument("--from-json", type=Path, help="print the table from a --json file of an earlier session; run nothing")
    a = p.parse_args(argv)
    if a.from_json:
        saved = json.loads(a.from_json.read_text())
        runs = [Run(**r) for r in saved["runs"]]
        print(f"Trees: before {saved['trees']['before']}, after {saved['trees']['after']}; "
              f"{max(r.round for r in runs)} rounds run.\n")
        print(side_by_side(runs, list(dict.fromkeys(r.bench for r in runs))))
        return 0
    if a.before is None or a.after is None or not a.bench:
        p.error("BEFORE, AFTER and at least one --bench are needed (or --from-json)")
    trees = {"before": a.before.resolve(), "after": a.after.resolve()}
    for label, tree in trees.items():
        if not (tree / "bench").is_dir() or not (tree / ".venv" / "bin" / "python").exists():
            print(f"compare_trees: {label} tree {tree} has no bench/ or no .venv/bin/python", file=sys.stderr)
            return 2
    specs = [shlex.split(s) for s in a.bench]
    env = dict(kv.split("=", 1) for kv in a.env)
    if "SPOTTRAIN_CHECKPOINT_KEY_FILE" not in os.environ and "SPOTTRAIN_CHECKPOINT_KEY_FILE" not in env:
        key = Path(tempfile.mkdtemp(prefix="spottrain-bench-key-")) / "checkpoint.key"
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
        env["SPOTTRAIN_CHECKPOINT_KEY_FILE"] = str(key)
    runs: list[Run] = []
    t0 = time.monotonic()
    for rnd in range(1, a.rounds + 1):
        order = ["before", "after"] if rnd % 2 else ["after", "before"]
        for name, *spec in specs:
            for label in order:
                r = run_one(trees[label], name, spec, env, label, rnd, a.timeout)
                runs.append(r)
                print(f"round {rnd} {name} {label}: exit {r.code}, {r.wall_s:.0f} s, load {r.load_before} -> "
                      f"{r.load_after}", file=sys.stderr, flush=True)
                if a.json:  # after every run: a session cut short keeps what it measured
                    a.json.write_text(json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "benches": a.bench,
                                                  "rounds": a.rounds,
                                                  "env": {k: v for k, v in env.items() if "KEY" not in k},
                                                  "runs": [asdict(r) for r in runs]}, indent=1))
    print(f"Trees: before {trees['before']}, after {trees['after']}; {a.rounds} rounds, the first tree of a round "
          f"alternating; {os.cpu_count()} CPUs; {time.monotonic() - t0:.0f} s in all.\n")
    print(side_by_side(runs, [s[0] for s in specs]))
    return 1 if any(r.code != 0 for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
