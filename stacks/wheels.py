"""Python dependencies as wheels: resolved at deploy time for the VM image's Python, shipped next
to the code, installed offline on the VM (docs/dependencies.md).

What a VM needs besides its image's torch: the trainer's own dependencies (`TRAINER_REQUIREMENTS`)
and the task's (`requirements.txt` in `trainer.code_dir`, requirement specifiers only). Resolving
them needs an index; installing them on a VM must not (a network without NAT reaches no PyPI).

1. **Resolve** (`resolve`), once per *wheel-set digest* (the requirements, the image's Python
   version, glibc and torch): `uv pip compile` pins every package for that Python and platform
   (markers evaluated for the target, which `pip download --python-version` does not do), with
   torch held to a stub of the image's version so that nothing pulls a second torch; then
   `pip download --no-deps --only-binary=:all: --platform manylinux_2_NN_x86_64 ...
   --python-version X.Y --implementation cp` fetches exactly those wheels. The result lands in
   `build/wheels/<digest>/` (`SPOTTRAIN_WHEEL_CACHE` moves it), atomically, with its lock file and
   SHA256SUMS: synthesis with a filled cache is offline and takes milliseconds.
2. **Ship**: the wheels directory is packed like the code (`stacks.delivery`, kind "wheels") and
   uploaded as `code/wheels-<sha256[:16]>.tar.gz`, content-hashed.
3. **Install** (the startup script): once per archive digest, offline (`pip install --no-index
   --no-deps --target`), into `/mnt/spottrain/deps/<sha256>` on the checkpoint disk, which a VM
   recreated with its disk keeps: same digest, nothing to install.

The index is PyPI unless `SPOTTRAIN_WHEEL_INDEX` names a directory of wheels (then nothing else
is asked: the tests' local index) or an index URL. A requirement that cannot be resolved for the
image's Python fails synthesis with exit 2 and the resolver's own words (`WheelsError`).
"""

from __future__ import annotations

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

#: The trainer's own dependencies besides torch: pyproject.toml's, as ranges (a test keeps them equal).
TRAINER_REQUIREMENTS = ("pydantic>=2.7", "tomli>=2; python_version < '3.11'", "google-cloud-storage>=2.14",
                        "google-crc32c>=1.5", "safetensors>=0.4")
#: The local version of the stub that stands for the image's torch during resolution.
TORCH_STUB = "spottrain.image"
_SPECIFIER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,\s-]+\])?\s*[^;]*(;.+)?$")


class WheelsError(InputError):
    """The wheels cannot be resolved (exit 2); `lines` say which requirement and why."""


@dataclass(frozen=True)
class WheelSet:
    requirements: tuple[str, ...]
    target: R.ImagePython

    @property
    def digest(self) -> str:
        spec = {"requirements": list(self.requirements), "python": self.target.version,
                "glibc": list(self.target.glibc), "torch": self.target.torch, "format": 1}
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def platforms(self) -> list[str]:
        """Every manylinux tag the image's glibc runs, newest first (pip takes several)."""
        major, minor = self.target.glibc
        tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 16, -1)]
        return tags + ["manylinux2014_x86_64"]


def user_requirements(code_dir: Path | None) -> list[str]:
    """`requirements.txt` of the code directory: one specifier per line; `#` comments and blank
    lines skipped. Options (`-r`, `--index-url`, `-e`), URLs and paths are refused (the wheels
    must come from the one index the stack resolves against)."""
    if code_dir is None or not (code_dir / "requirements.txt").is_file():
        return []
    path = code_dir / "requirements.txt"
    out, bad = [], []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
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


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def cached(ws: WheelSet, cache: Path | None = None) -> Path | None:
    """The resolved wheels directory of this set, or None when it was never resolved."""
    d = (cache or cache_root()) / ws.digest
    return d / "wheels" if (d / "SHA256SUMS").is_file() else None


def resolve(ws: WheelSet, cache: Path | None = None, index: str | None = None) -> Path:
    """The wheels of `ws` (a directory of *.whl), from the cache or resolved now."""
    found = cached(ws, cache)
    if found is not None:
        return found
    root = cache or cache_root()
    root.mkdir(parents=True, exist_ok=True)
    work = root / f".tmp-{ws.digest}-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    try:
        _resolve_into(ws, work, index if index is not None else os.environ.get(INDEX_ENV))
        final = root / ws.digest
        try:
            work.rename(final)  # atomic: a parallel synthesis of the same set may have won
        except OSError:
            if cached(ws, cache) is None:
                raise
        return final / "wheels"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _index_args(index: str | None) -> list[str]:
    if not index:
        return []
    if "://" in index:
        return ["--index-url", index]
    return ["--no-index", "--find-links", str(Path(index).resolve())]


def _run(cmd: list[str], what: str, ws: WheelSet) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "UV_PYTHON_DOWNLOADS": "never", "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    if proc.returncode != 0:
        said = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()][-12:]
        raise WheelsError([f"the wheels for Python {ws.target.version} (image torch "
                           f"{ws.target.torch or 'unknown'}) cannot be {what}: {' | '.join(said)}; "
                           f"requirements: {', '.join(ws.requirements)}"])


def _resolve_into(ws: WheelSet, work: Path, index: str | None) -> None:
    (work / "requirements.in").write_text("\n".join(ws.requirements) + "\n")
    stubs = work / "stubs"
    stubs.mkdir()
    constraints = work / "constraints.txt"
    extra: list[str] = []
    if ws.target.torch is not None:
        # The image brings torch: resolve against a stub of its version (no dependencies), so that
        # a requirement on torch is checked against the image's and nothing downloads CUDA wheels.
        build_wheel(stubs, "torch", f"{ws.target.torch}+{TORCH_STUB}")
        constraints.write_text(f"torch=={ws.target.torch}+{TORCH_STUB}\n")
        extra = ["--find-links", str(stubs), "--constraint", str(constraints), "--no-emit-package", "torch"]
    uv = Path(sys.executable).with_name("uv")
    major, minor = ws.target.glibc
    _run([str(uv), "pip", "compile", "--quiet", "--no-header", "--no-annotate", "--no-progress",
          "--python-version", ws.target.version, "--python-platform", f"x86_64-manylinux_{major}_{minor}",
          "--only-binary", ":all:", *_index_args(index), *extra, str(work / "requirements.in"),
          "-o", str(work / "requirements.lock")], "resolved", ws)
    pins = [ln for ln in (work / "requirements.lock").read_text().splitlines() if ln and not ln.startswith("#")]
    if any(re.match(r"torch\b", p) for p in pins):
        raise WheelsError([f"the requirements need torch ({', '.join(ws.requirements)}), and the image "
                           f"family's torch version is unknown; allowed: an image family named "
                           f"pytorch-<major>-<minor>-..., or requirements that do not need torch"])
    wheels = work / "wheels"
    wheels.mkdir()
    if pins:
        platforms = [a for p in ws.platforms for a in ("--platform", p)]
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
              *platforms, "--python-version", ws.target.version, "--implementation", "cp",
              *_index_args(index), "-d", str(wheels), "-r", str(work / "requirements.lock")],
             "downloaded", ws)
    shutil.copy(work / "requirements.lock", wheels / "requirements.lock")
    sums = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
                   for p in sorted(wheels.iterdir()))
    (work / "SHA256SUMS").write_text(sums)
    for p in (stubs, constraints, work / "requirements.in", work / "requirements.lock"):
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


def build_wheel(out_dir: Path, name: str, version: str, files: dict[str, str] | None = None,
                requires: tuple[str, ...] = ()) -> Path:
    """A minimal pure-Python wheel (py3-none-any), deterministic: the torch stub, and the tests'
    local index."""
    import base64
    import zipfile

    dist = re.sub(r"[-_.]+", "_", name)
    files = files if files is not None else {f"{dist}/__init__.py": f"__version__ = {version!r}\n"}
    info = f"{dist}-{version}.dist-info"
    meta = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            + "".join(f"Requires-Dist: {r}\n" for r in requires))
    contents = {**files, f"{info}/METADATA": meta,
                f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: spottrain\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    path = out_dir / f"{dist}-{version}-py3-none-any.whl"
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
    """`python -m stacks.wheels [EXPERIMENT]` (`make wheels`): resolve every experiment's wheels
    into the cache now (before going offline, or to see what a requirements change pulls in)."""
    from stacks.experiment import code_path
    from stacks.load import ExperimentError, load_all

    args = sys.argv[1:] if argv is None else argv
    try:
        experiments = load_all(Path(args[0]) if args else None)
        for e in experiments:
            code = code_path(e.spec.trainer.code_dir) if e.spec.trainer.code_dir else None
            ws = wheel_set(e.spec, code)
            was = cached(ws) is not None
            d = resolve(ws)
            names = sorted(p.name for p in d.glob("*.whl"))
            print(f"{e.path}: {len(names)} wheels for Python {ws.target.version} in {d.parent}"
                  f"{' (cached)' if was else ''}: {', '.join(names)}")
    except (ExperimentError, WheelsError) as err:
        for line in err.lines:
            print(line, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
