"""The VM's Python dependencies as wheels: locked in the repository, fetched by hash at
synthesis, shipped next to the code, installed offline on the VM (docs/dependencies.md).

What a VM needs besides its image's torch: the trainer's own dependencies (`TRAINER_REQUIREMENTS`)
and the task's (`requirements.txt` in `trainer.code_dir`, requirement specifiers only), for the
image's Python and glibc (`WheelSet`).

1. **Lock** (`make lock`, `stacks.lock`): resolved once, by a person, into a lock file that is
   committed and reviewed like code: every package at one version, one wheel file each, by
   sha256, with a header naming what was locked for which Python. Where it lives (`lock_path`):
   next to `requirements.txt` in the code directory when there is one
   (`requirements.py3.10-glibc2.35.lock`), else in the repository's `locks/`
   (`locks/py3.10-glibc2.35.lock`).
2. **Fetch** (`locked_wheels`, at synthesis): exactly the lock, never resolved again: from the
   cache `build/wheels/<lock digest>/` (`SPOTTRAIN_WHEEL_CACHE` moves it), or from the index with
   `pip download --no-deps --require-hashes`, every file's sha256 checked against the lock. A
   missing lock, or one made for other requirements or another Python, stops synthesis with one
   line saying to run `make lock`; nothing is resolved behind a reviewer's back, so the same
   commit ships the same wheels on any day.
3. **Ship**: the wheels folder (the wheels and their pins as `requirements.lock`) is packed like
   the code (`stacks.delivery`, kind "wheels") as `code/wheels-<sha256[:16]>.tar.gz`.
4. **Install** (the startup script): once per archive digest, offline (`pip install --no-index
   --no-deps --no-compile --target`), into `/mnt/spottrain/deps/<sha256>` on the checkpoint disk.

The index is the one pip is configured with (`pip config list`: the same for uv, `uv_options`)
unless `SPOTTRAIN_WHEEL_INDEX` names a directory of wheels or an index URL (then nothing else is
asked: the tests' local indexes).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from stacks import gcp_rules as R
from stacks.errors import InputError

REPO = Path(__file__).resolve().parent.parent
CACHE_ENV = "SPOTTRAIN_WHEEL_CACHE"
INDEX_ENV = "SPOTTRAIN_WHEEL_INDEX"
DEFAULT_CACHE = REPO / "build" / "wheels"
#: The locks of the trainer's own requirements (an experiment without a requirements.txt).
LOCK_DIR = REPO / "locks"
#: The pins inside the shipped wheels folder (and archive): what the VM's log and a review read.
PINS_FILE = "requirements.lock"

#: The trainer's own dependencies besides torch: pyproject.toml's, as ranges (a test keeps them equal).
TRAINER_REQUIREMENTS = ("pydantic>=2.7", "tomli>=2; python_version < '3.11'", "google-cloud-storage>=2.14",
                        "google-crc32c>=1.5", "safetensors>=0.4", "blake3>=1.0")
#: The local version of the stub that stands for the image's torch during resolution.
TORCH_STUB = "spottrain.image"
_SPECIFIER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,\s-]+\])?\s*[^;]*(;.+)?$")
#: Bumped when what a lock means changes: every lock then asks for `make lock`.
LOCK_FORMAT = 2


class WheelsError(InputError):
    """The wheels cannot be shipped (exit 2): no lock, a stale lock, or a fetch that failed;
    `lines` say which file and what to do."""


@dataclass(frozen=True)
class WheelSet:
    """What a lock is made for: the requirements, the image's Python, glibc and torch."""

    requirements: tuple[str, ...]
    target: R.ImagePython

    @property
    def digest(self) -> str:
        """Of the inputs that decide the resolution, torch aside (`Lock.torch_dependents`)."""
        spec = {"requirements": list(self.requirements), "python": self.target.version,
                "glibc": list(self.target.glibc), "format": LOCK_FORMAT}
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def key(self) -> str:
        """The lock file's name part: `py3.10-glibc2.35`."""
        major, minor = self.target.glibc
        return f"py{self.target.version}-glibc{major}.{minor}"

    @property
    def platform(self) -> str:
        major, minor = self.target.glibc
        return f"manylinux_{major}_{minor}_x86_64"

    @property
    def platforms(self) -> list[str]:
        """Every manylinux tag the image's glibc runs, newest first (pip takes several)."""
        major, minor = self.target.glibc
        tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 16, -1)]
        return tags + ["manylinux2014_x86_64"]

    def describe(self) -> str:
        major, minor = self.target.glibc
        return (f"Python {self.target.version}, glibc {major}.{minor}, image torch "
                f"{self.target.torch or 'unknown'}")


def user_requirements(code_dir: Path | None) -> list[str]:
    """`requirements.txt` of the code directory: one specifier per line; `#` comments and blank
    lines skipped. Options (`-r`, `--index-url`, `-e`), URLs and paths are refused (the wheels
    must come from the one index the lock is made against)."""
    if code_dir is None or not (code_dir / "requirements.txt").is_file():
        return []
    path = code_dir / "requirements.txt"
    out, bad = [], []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise WheelsError([f"{path}: cannot read: {err}"]) from None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-") or "://" in line or " @ " in line or "/" in line.split(";")[0] \
                or not _SPECIFIER.match(line):
            bad.append(f"{path}:{n}: {line!r} is not a requirement specifier; allowed: "
                       "name[extras] with version specifiers and markers, e.g. \"numpy>=1.26\"")
            continue
        out.append(line)
    if bad:
        raise WheelsError(bad)
    return out


def wheel_set(exp, code_dir: Path | None) -> WheelSet:  # exp: stacks.experiment.Experiment
    target = R.image_python(exp.machine.image_family, exp.machine.python_version)
    assert target is not None  # validated: Machine.problems
    return WheelSet(tuple(TRAINER_REQUIREMENTS) + tuple(user_requirements(code_dir)), target)


def for_python(exp, version: str):  # Experiment -> Experiment
    """The experiment as run by another Python (the drill's VM runs the host's)."""
    return exp.model_copy(update={"machine": exp.machine.model_copy(update={"python_version": version})})


def lock_path(ws: WheelSet, code_dir: Path | None) -> Path:
    """Where the lock of `ws` lives: next to the code directory's requirements.txt, or, for the
    trainer's requirements alone, in the repository's locks/."""
    if code_dir is not None and (code_dir / "requirements.txt").is_file():
        return code_dir / f"requirements.{ws.key}.lock"
    return LOCK_DIR / f"{ws.key}.lock"


def is_lock_file(path: Path) -> bool:
    """A lock next to a requirements.txt (kept out of the code archive: it ships as the wheels)."""
    return re.fullmatch(r"requirements\.py3\.\d+-glibc\d+\.\d+\.lock", path.name) is not None


# --- the lock file -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pin:
    name: str  # normalized: lowercase, runs of -_. as "-"
    version: str
    sha256: str
    file: str  # the wheel's file name on the index

    def line(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"


@dataclass(frozen=True)
class Lock:
    path: Path
    python: str
    glibc: tuple[int, int]
    torch: str | None  # the image torch the resolution held torch at
    torch_dependents: tuple[str, ...]  # locked packages that require torch ("none": any torch fits)
    requirements: tuple[str, ...]
    inputs: str  # WheelSet.digest of what was locked
    pins: tuple[Pin, ...]

    @property
    def pinned(self) -> str:
        """The pins alone, one `name==version --hash=sha256:...` a line: what ships with the
        wheels (comments and header wording changes do not roll a VM)."""
        return "".join(p.line() + "\n" for p in self.pins)

    @property
    def digest(self) -> str:
        """Of the pins: names the cache folder (two locks with the same pins share it)."""
        return hashlib.sha256(self.pinned.encode()).hexdigest()[:16]

    def versions(self) -> dict[str, str]:
        return {p.name: p.version for p in self.pins}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


HEADER = """\
# The Python packages the training VM installs, locked: one version and one wheel file each,
# checked by sha256 (pip's --require-hashes format). Produced by `make lock` (python -m
# stacks.lock); do not edit it: change the requirements and run `make lock` again. Review a
# change here like code: a new lock rolls the VM (the group recreates it). docs/dependencies.md
#
"""


def render_lock(ws: WheelSet, pins: list[Pin], torch_dependents: list[str]) -> str:
    major, minor = ws.target.glibc
    lines = [HEADER.rstrip("\n"),
             f"# python: {ws.target.version}",
             f"# platform: {ws.platform} (wheels for glibc {major}.{minor} and older, x86_64)",
             f"# torch: {ws.target.torch or 'unknown'} (the image's: resolved against, never shipped)",
             f"# torch needed by: {', '.join(sorted(torch_dependents)) or 'none'}",
             *(f"# requirement: {r}" for r in ws.requirements),
             f"# inputs: {ws.digest}",
             "#"]
    for p in sorted(pins, key=lambda p: p.name):
        lines += [f"# {p.file}", f"{p.name}=={p.version} \\", f"    --hash=sha256:{p.sha256}"]
    return "\n".join(lines) + "\n"


_FIELD = re.compile(r"^# (python|platform|torch|torch needed by|requirement|inputs): (.*)$")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+) --hash=sha256:([0-9a-f]{64})$")


def read_lock(path: Path) -> Lock:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise WheelsError([f"{path}: cannot read the lock: {err}"]) from None
    fields: dict[str, list[str]] = {}
    pins: list[Pin] = []
    file = None
    bad = None
    for n, line in enumerate(text.replace("\\\n    ", "").splitlines(), 1):
        m = _FIELD.match(line)
        if m:
            fields.setdefault(m[1], []).append(m[2])
        elif line.startswith("# ") and line.endswith(".whl"):
            file = line[2:]
        elif line.startswith("#") or not line.strip():
            continue
        elif (p := _PIN.match(line)) and file is not None:
            pins.append(Pin(normalize(p[1]), p[2], p[3], file))
            file = None
        else:
            bad = bad or f"line {n}: {line[:60]!r}"
    platform = re.match(r"manylinux_(\d+)_(\d+)_x86_64", (fields.get("platform") or [""])[0])
    if bad or platform is None or not fields.get("python") or not fields.get("inputs"):
        raise WheelsError([f"{path}: not a lock that `make lock` wrote ({bad or 'its header is incomplete'}); "
                           "run `make lock` again"])
    torch = (fields.get("torch") or ["unknown"])[0].split(" ", 1)[0]
    needed = (fields.get("torch needed by") or ["none"])[0]
    return Lock(path, fields["python"][0], (int(platform[1]), int(platform[2])),
                None if torch == "unknown" else torch,
                () if needed == "none" else tuple(x.strip() for x in needed.split(",")),
                tuple(fields.get("requirement", [])), fields["inputs"][0], tuple(pins))


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def locked(ws: WheelSet, code_dir: Path | None, experiment: str | None = None) -> Lock:
    """The lock of `ws`, checked against it: WheelsError (run `make lock`) when it is missing or
    was made for other requirements, another Python or (for a torch-dependent set) another torch."""
    path = lock_path(ws, code_dir)
    what = f"EXPERIMENT={experiment}" if experiment else "EXPERIMENT=<experiment file>"
    todo = f"run `make lock {what}` and commit the lock"
    if not path.is_file():
        raise WheelsError([f"{_display(path)}: no lock of the VM's dependencies for {ws.describe()} "
                           f"(synthesis installs exactly a committed lock, it never resolves): {todo}"])
    lock = read_lock(path)
    why = stale(ws, lock)
    if why:
        raise WheelsError([f"{_display(path)}: the lock no longer matches: {'; '.join(why)}: {todo}"])
    return lock


def stale(ws: WheelSet, lock: Lock) -> list[str]:
    """Why `lock` is not the lock of `ws` (nothing: it is)."""
    why = []
    if (lock.python, lock.glibc) != (ws.target.version, ws.target.glibc):
        why.append(f"it is for Python {lock.python}, glibc {lock.glibc[0]}.{lock.glibc[1]}")
    added = [r for r in ws.requirements if r not in lock.requirements]
    dropped = [r for r in lock.requirements if r not in ws.requirements]
    if added or dropped:
        why.append("the requirements changed since (" + ", ".join(
            [f"+{r!r}" for r in added] + [f"-{r!r}" for r in dropped]) + ")")
    elif not why and lock.inputs != ws.digest:
        why.append("its inputs differ (requirements reordered, or a lock of an older format)")
    if lock.torch != ws.target.torch and lock.torch_dependents:
        why.append(f"{', '.join(lock.torch_dependents)} need torch, resolved against "
                   f"{lock.torch or 'an unknown torch'}, and the image has {ws.target.torch or 'an unknown one'}")
    return why


# --- fetching what a lock names ------------------------------------------------------------------


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def cached(lock: Lock, cache: Path | None = None) -> Path | None:
    """The wheels folder of this lock in the cache, or None when it was never fetched."""
    d = (cache or cache_root()) / lock.digest
    sums = d / "SHA256SUMS"
    if not sums.is_file():
        return None
    # The sums were checked against a lock with the same pins when the folder was filled.
    expected = "".join(f"{p.sha256}  {p.file}\n" for p in sorted(lock.pins, key=lambda p: p.file))
    return d / "wheels" if sums.read_text() == expected else None


def index_env(index: str | None, uv: bool = False) -> tuple[list[str], dict[str, str]]:
    """(pip's index arguments, or uv's with `uv`; the environment to run it with) for `index`: a
    directory of wheels or an index URL, and then nothing else; None: the index pip is
    configured with (uv reads no pip.conf: `uv_options` carries pip's over)."""
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    if not index:
        if not uv:
            return [], env
        options, cert = uv_options()
        if cert and "SSL_CERT_FILE" not in env:
            env["SSL_CERT_FILE"] = cert
        return options, env
    # Only this index: pip's configuration (files and PIP_* variables) and uv's are left out.
    env = {k: v for k, v in env.items() if not k.startswith(("PIP_", "UV_INDEX", "UV_EXTRA_INDEX",
                                                              "UV_FIND_LINKS", "UV_NO_INDEX"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", UV_PYTHON_DOWNLOADS="never")
    if "://" in index:
        return ["--index-url", index], env
    return ["--no-index", "--find-links", str(Path(index).resolve())], env


def uv_options() -> tuple[list[str], str | None]:
    """uv's arguments for the index pip is configured with, and pip's CA file: index-url,
    extra-index-url, find-links, no-index and trusted-host from `pip config list` (its files and
    PIP_* variables; a variable wins, then the download section, then global), resolved the way
    pip picks across indexes (the best version from any of them)."""
    found = _pip_config()
    out = ["--index-strategy", "unsafe-best-match"]
    if found.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        out.append("--no-index")
    if found.get("index-url"):
        out += ["--index-url", found["index-url"]]
    for url in found.get("extra-index-url", "").split():
        out += ["--extra-index-url", url]
    for link in found.get("find-links", "").split():
        out += ["--find-links", link]
    for host in found.get("trusted-host", "").split():
        out += ["--allow-insecure-host", host]
    return out, found.get("cert") or None


def _pip_config() -> dict[str, str]:
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    ranked: dict[str, tuple[int, str]] = {}
    rank = {":env:": 3, "download": 2, "global": 1}
    for line in proc.stdout.splitlines():
        m = re.match(r"^(:env:|[a-z]+)\.([a-z-]+)=(.*)$", line.strip())
        if not m or m[1] not in rank:
            continue
        try:
            value = str(ast.literal_eval(m[3]))
        except (ValueError, SyntaxError):
            continue
        if m[2] not in ranked or ranked[m[2]][0] <= rank[m[1]]:
            ranked[m[2]] = (rank[m[1]], value)
    return {k: v for k, (_, v) in ranked.items()}


def run_tool(cmd: list[str], env: dict[str, str], what: str) -> None:
    """Run pip or uv; WheelsError with its last words (one line) when it fails."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    except OSError as err:  # no uv next to this Python (make setup installs it), no pip
        raise WheelsError([f"{what}: cannot run {cmd[0]}: {err.strerror or err}"]) from None
    if proc.returncode != 0:
        said = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()][-12:]
        raise WheelsError([f"{what}: {' | '.join(said) or f'exit status {proc.returncode}'}"])


def locked_wheels(lock: Lock, cache: Path | None = None, index: str | None = None) -> Path:
    """The wheels folder of `lock` (its wheels and their pins), from the cache or fetched now,
    exactly: `pip download --no-deps --require-hashes`, each file's sha256 checked again."""
    found = cached(lock, cache)
    if found is not None:
        return found
    root = cache or cache_root()
    work = root / f".tmp-{lock.digest}-{uuid.uuid4().hex[:8]}"
    try:
        (work / "wheels").mkdir(parents=True)
        fetch(lock, work / "wheels", index if index is not None else os.environ.get(INDEX_ENV))
        seal(lock, work)
        try:
            work.rename(root / lock.digest)  # atomic: a parallel synthesis may have won
        except OSError:
            if cached(lock, cache) is None:
                raise
        return root / lock.digest / "wheels"
    except OSError as err:
        raise WheelsError([f"{root}: cannot fill the wheel cache: {err}"]) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def fetch(lock: Lock, dest: Path, index: str | None) -> None:
    """Download exactly the lock's wheels into `dest` and check them."""
    if not lock.pins:
        return
    pip_index, env = index_env(index)
    req = dest.parent / "require-hashes.txt"
    req.write_text(lock.pinned)
    ws_platforms = WheelSet((), R.ImagePython(lock.python, lock.glibc, lock.torch)).platforms
    platforms = [a for p in ws_platforms for a in ("--platform", p)]
    run_tool([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes",
              "--only-binary=:all:", *platforms, "--python-version", lock.python, "--implementation", "cp",
              *pip_index, "-d", str(dest), "-r", str(req)], env,
             f"{_display(lock.path)}: cannot fetch the locked wheels from "
             f"{index or 'the index pip is configured with'}")
    req.unlink()
    check(lock, dest)


def check(lock: Lock, folder: Path) -> None:
    """Exactly the lock's files, each with its sha256, or WheelsError naming the first that is not."""
    have = {p.name: p for p in folder.glob("*.whl")}
    for pin in lock.pins:
        got = have.pop(pin.file, None)
        if got is None:
            raise WheelsError([f"{_display(lock.path)}: the index gave no {pin.file} for {pin.name}=={pin.version}"])
        digest = hashlib.sha256(got.read_bytes()).hexdigest()
        if digest != pin.sha256:
            raise WheelsError([f"{_display(lock.path)}: {pin.file} has sha256 {digest}, the lock says "
                               f"{pin.sha256}: not shipping it"])
    if have:
        raise WheelsError([f"{_display(lock.path)}: unlocked wheels fetched: {', '.join(sorted(have))}"])


def seal(lock: Lock, work: Path) -> None:
    """Write the pins and SHA256SUMS next to checked wheels: the folder is complete."""
    (work / "wheels" / PINS_FILE).write_text(lock.pinned)
    (work / "SHA256SUMS").write_text(
        "".join(f"{p.sha256}  {p.file}\n" for p in sorted(lock.pins, key=lambda p: p.file)))


def shipped_wheels(exp, code_dir: Path | None, experiment: str | None = None) -> Path:
    """The wheels folder the VM of `exp` gets: its lock, checked, fetched (or cached)."""
    ws = wheel_set(exp, code_dir)
    return locked_wheels(locked(ws, code_dir, experiment))


# --- tests' local indexes ------------------------------------------------------------------------


def build_wheel(out_dir: Path, name: str, version: str, files: dict[str, str] | None = None,
                requires: tuple[str, ...] = (), tag: str = "py3-none-any") -> Path:
    """A minimal pure-Python wheel, deterministic: the torch stub, and the tests' local indexes
    (`tag` gives it a platform-tagged, and so longer, file name)."""
    import base64
    import zipfile

    dist = re.sub(r"[-_.]+", "_", name)
    files = files if files is not None else {f"{dist}/__init__.py": f"__version__ = {version!r}\n"}
    info = f"{dist}-{version}.dist-info"
    meta = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            + "".join(f"Requires-Dist: {r}\n" for r in requires))
    contents = {**files, f"{info}/METADATA": meta,
                f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: spottrain\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    record = []
    path = out_dir / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as z:
        for arcname, text in contents.items():
            data = text.encode()
            z.writestr(zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0)), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{arcname},sha256={digest},{len(data)}")
        record.append(f"{info}/RECORD,,")
        z.writestr(zipfile.ZipInfo(f"{info}/RECORD", date_time=(1980, 1, 1, 0, 0, 0)), "\n".join(record) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m stacks.wheels [EXPERIMENT]` (`make wheels`): fetch every experiment's locked
    wheels into the cache now (before going offline). Resolves nothing: that is `make lock`."""
    from stacks.errors import report
    from stacks.experiment import code_path
    from stacks.load import argument, display, load_all

    args = sys.argv[1:] if argv is None else argv
    try:
        experiments = load_all(argument(args[0]) if args else None)
        for e in experiments:
            code = code_path(e.spec.trainer.code_dir) if e.spec.trainer.code_dir else None
            lock = locked(wheel_set(e.spec, code), code, e.name)
            was = cached(lock) is not None
            d = locked_wheels(lock)
            print(f"{display(e.path)}: {len(lock.pins)} wheels of {_display(lock.path)} in {d.parent}"
                  f"{' (cached)' if was else ''}")
    except InputError as err:
        return report(err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
