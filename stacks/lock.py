"""`make lock` (`python -m stacks.lock [EXPERIMENT ...] [--upgrade] [--no-drill]`): resolve the
VM's dependencies into the lock files that are committed and reviewed (docs/dependencies.md).

For each experiment (default: every file in experiments/, drill/experiments/ and the stack tests'
fixtures) it locks the wheel set (`stacks.wheels.WheelSet`) of the image's Python and, unless
`--no-drill`, of the Python that runs `make drill` (this interpreter: the drill's VM stand-in runs
the host's Python, so it installs a lock made for that one).

Resolving: `uv pip compile` pins every package for the target Python and platform (environment
markers judged for the target, which `pip download --python-version` alone does not do), with
torch held at a stub of the image's version so that nothing pulls a second torch; then `pip
download --no-deps --only-binary=:all: --platform ... --python-version X.Y --implementation cp`
picks the one wheel file per pin that the target installs, and its sha256 goes into the lock. The
downloaded wheels fill the cache, so the synthesis after a lock is offline.

A lock whose inputs have not changed is left alone (no index asked) unless `--upgrade`; a lock
that must be made again keeps every version it had that still satisfies the requirements (uv's
preferences), so locking one new requirement moves nothing else. `--upgrade` takes the newest
releases. Each lock written is printed with its version changes: commit it with the change that
needs it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from stacks.errors import InputError, report
from stacks.wheels import (
    INDEX_ENV, REPO, TORCH_STUB, Lock, Pin, WheelSet, WheelsError, build_wheel, cache_root, check, for_python,
    index_env, lock_path, normalize, read_lock, render_lock, run_tool, seal, stale, wheel_set,
)

#: What `make lock` locks without arguments: every experiment file the repository synthesizes.
DEFAULT_FOLDERS = (REPO / "experiments", REPO / "drill" / "experiments", REPO / "tests" / "stacks" / "fixtures")
_WHEEL = re.compile(r"^([^-]+)-([^-]+)(?:-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


def this_python() -> str:
    """The Python running this: the drill's VM stand-in runs it (drill/sandbox.py)."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


@dataclass(frozen=True)
class Outcome:
    path: Path
    written: bool
    changes: list[str]
    packages: int


def resolve(ws: WheelSet, work: Path, index: str | None = None, previous: Lock | None = None,
            upgrade: bool = False) -> tuple[list[Pin], list[str]]:
    """(one pin per package with its wheel file downloaded into work/wheels, the packages that
    need torch) for `ws`."""
    (work / "requirements.in").write_text("\n".join(ws.requirements) + "\n")
    out = work / "compiled.txt"
    if previous is not None and not upgrade:  # uv prefers the versions already in the output file
        out.write_text("".join(f"{p.name}=={p.version}\n" for p in previous.pins))
    extra: list[str] = []
    if ws.target.torch is not None:
        # The image brings torch: resolve against a stub of its version (no dependencies), so that
        # a requirement on torch is checked against the image's and nothing downloads CUDA wheels.
        stubs = work / "stubs"
        stubs.mkdir()
        build_wheel(stubs, "torch", f"{ws.target.torch}+{TORCH_STUB}")
        (work / "constraints.txt").write_text(f"torch=={ws.target.torch}+{TORCH_STUB}\n")
        extra = ["--find-links", str(stubs), "--constraint", str(work / "constraints.txt")]
    uv = Path(sys.executable).with_name("uv")
    args, env = index_env(index, uv=True)
    major, minor = ws.target.glibc
    what = f"the requirements cannot be resolved for {ws.describe()} ({', '.join(ws.requirements)})"
    run_tool([str(uv), "pip", "compile", "--quiet", "--no-header", "--annotation-style", "line",
              "--no-progress", "--python-version", ws.target.version,
              "--python-platform", f"x86_64-manylinux_{major}_{minor}", "--only-binary", ":all:",
              *(["--upgrade"] if upgrade else []), *args, *extra, str(work / "requirements.in"),
              "-o", str(out)], env, what)
    pins: list[tuple[str, str]] = []
    dependents: list[str] = []
    for line in out.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)(?:\s+#\s*via\s+(.*))?$", line.strip())
        if not m:
            continue
        if normalize(m[1]) == "torch":
            if ws.target.torch is None:
                raise WheelsError([f"the requirements need torch ({', '.join(ws.requirements)}), and the "
                                   f"image family's torch version is unknown; allowed: an image family "
                                   f"named pytorch-<major>-<minor>-..., or requirements that do not need torch"])
            # "# via tinydep, -r requirements.in, -c constraints.txt": the stub's constraint is ours.
            dependents = ["(the requirements)" if v.startswith("-r") else normalize(v)
                          for v in re.split(r",\s*", m[3] or "") if v and not v.startswith("-c")]
            continue
        pins.append((normalize(m[1]), m[2]))
    wheels = work / "wheels"
    wheels.mkdir()
    if pins:
        (work / "pins.txt").write_text("".join(f"{n}=={v}\n" for n, v in pins))
        pip_index, env = index_env(index)
        platforms = [a for p in ws.platforms for a in ("--platform", p)]
        run_tool([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                  *platforms, "--python-version", ws.target.version, "--implementation", "cp",
                  *pip_index, "-d", str(wheels), "-r", str(work / "pins.txt")], env,
                 f"the wheels of {ws.describe()} cannot be downloaded")
    files = {}
    for f in wheels.glob("*.whl"):
        m = _WHEEL.match(f.name)
        if m:
            files[normalize(m[1])] = f
    missing = [n for n, _ in pins if n not in files]
    if missing:
        raise WheelsError([f"no wheel for {', '.join(missing)} ({ws.describe()})"])
    return ([Pin(n, v, hashlib.sha256(files[n].read_bytes()).hexdigest(), files[n].name) for n, v in pins],
            sorted(set(dependents)))


def lock(ws: WheelSet, path: Path, *, index: str | None = None, upgrade: bool = False,
         cache: Path | None = None) -> Outcome:
    """Make (or keep) the lock of `ws` at `path` (`stacks.wheels.lock_path` says where it
    belongs) against `index` (default: $SPOTTRAIN_WHEEL_INDEX, else the index pip is configured
    with); its wheels go into the cache."""
    index = index if index is not None else os.environ.get(INDEX_ENV)
    previous = None
    if path.is_file():
        try:
            previous = read_lock(path)
        except WheelsError:
            previous = None  # unreadable: made anew
    if previous is not None and not upgrade and not stale(ws, previous):
        return Outcome(path, False, [], len(previous.pins))  # what synthesis checks holds
    root = cache or cache_root()
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".lock-", dir=root))
    try:
        pins, dependents = resolve(ws, work, index, previous, upgrade)
        text = render_lock(ws, pins, dependents)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
        new = read_lock(path)
        # The wheels just downloaded are the lock's: the cache has them now.
        check(new, work / "wheels")
        seal(new, work)
        for p in ("requirements.in", "compiled.txt", "pins.txt", "constraints.txt", "stubs"):
            q = work / p
            shutil.rmtree(q) if q.is_dir() else q.unlink(missing_ok=True)
        if not (root / new.digest).exists():
            try:
                work.rename(root / new.digest)
            except OSError:
                pass  # a parallel lock or synthesis filled it
        return Outcome(path, True, changes(previous, new), len(new.pins))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def changes(old: Lock | None, new: Lock) -> list[str]:
    """`name a -> b`, `+name v`, `-name v` between two locks (by package)."""
    a, b = (old.versions() if old else {}), new.versions()
    out = []
    for name in sorted(a.keys() | b.keys()):
        if name not in a:
            out.append(f"+{name} {b[name]}")
        elif name not in b:
            out.append(f"-{name} {a[name]}")
        elif a[name] != b[name]:
            out.append(f"{name} {a[name]} -> {b[name]}")
    return out


def targets(files: list, drill: bool) -> dict[Path, tuple[WheelSet, list[str]]]:
    """{lock path: (wheel set, the experiment files that use it)}; InputError when two experiments
    would need one lock file to say two different things."""
    from stacks.experiment import code_path
    from stacks.load import display

    found: dict[Path, tuple[WheelSet, list[str]]] = {}
    clash = []
    for e in files:
        code = code_path(e.spec.trainer.code_dir) if e.spec.trainer.code_dir else None
        specs = [e.spec] + ([for_python(e.spec, this_python())] if drill else [])
        for spec in specs:
            ws = wheel_set(spec, code)
            path = lock_path(ws, code)
            if path in found and found[path][0] != ws:
                other = found[path][0]
                if other.requirements != ws.requirements:
                    clash.append(f"{display(e.path)}: shares {display(path)} with "
                                 f"{', '.join(found[path][1])} but not its requirements")
                    continue
            users = found.setdefault(path, (ws, []))[1]
            if display(e.path) not in users:
                users.append(display(e.path))
    if clash:
        raise InputError(clash)
    return found


def main(argv: list[str] | None = None) -> int:
    from stacks.load import argument, display, load_all

    p = argparse.ArgumentParser(prog="python -m stacks.lock", description=__doc__.split("\n\n")[0])
    p.add_argument("experiments", nargs="*", help="experiment files, folders or names "
                   "(default: experiments/, drill/experiments/, tests/stacks/fixtures/)")
    p.add_argument("--upgrade", action="store_true", help="take the newest releases, not the locked ones")
    p.add_argument("--no-drill", action="store_true",
                   help=f"only the image's Python, not this one ({this_python()}, the drill's)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        sources = [argument(a) for a in args.experiments] or [f for f in DEFAULT_FOLDERS if f.is_dir()]
        files = [e for s in sources for e in load_all(s)]
        for path, (ws, users) in sorted(targets(files, not args.no_drill).items()):
            out = lock(ws, path, upgrade=args.upgrade)
            what = "written" if out.written else "up to date"
            if out.written and not out.changes:
                what += ", the same versions"
            print(f"{display(path)}: {what}, {out.packages} packages ({ws.describe()}; for "
                  f"{', '.join(users)})")
            for change in out.changes:  # one a line: what a reviewer of the lock's diff reads
                print(f"  {change}")
    except InputError as err:
        return report(err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
