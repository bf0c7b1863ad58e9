"""stacks/wheels.py and stacks/lock.py: the VM's dependencies locked in the repository, shipped
exactly as locked, and installed offline.

The resolver's tests run real uv and pip against local indexes of tiny wheels (a controlled index:
what is newest there is chosen by the test); the synthesis tests ship the committed lock's real
wheels (the suite's wheel cache, tests/conftest.py) or those plus a tiny package of the test's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from stack_support import EXAMPLE

from stacks import gcp_rules as R
from stacks import wheels as W
from stacks.lock import lock
from stacks.wheels import (CACHE_ENV, INDEX_ENV, TRAINER_REQUIREMENTS, WheelSet, WheelsError, build_wheel,
                           locked_wheels, read_lock, user_requirements)

ROOT = Path(__file__).resolve().parents[2]
IMAGE = R.ImagePython("3.10", (2, 35), "2.9.0")
#: The committed lock of the trainer's requirements for the example's image (Python 3.10).
EXAMPLE_LOCK = ROOT / "locks" / "py3.10-glibc2.35.lock"


@pytest.fixture
def index(tmp_path: Path) -> Path:
    """A controlled local index: a tiny package with code that needs torch (and, below Python
    3.11, another package), and one more."""
    idx = tmp_path / "index"
    idx.mkdir()
    build_wheel(idx, "tinydep", "1.0", files={"tinydep/__init__.py": "ANSWER = 42\n"},
                requires=("torch>=2.0", "oldonly; python_version < '3.11'"))
    build_wheel(idx, "oldonly", "1.0")
    build_wheel(idx, "extradep", "1.0")
    return idx


def real_index(tmp_path: Path, python: str = "3.10") -> Path:
    """A local index holding the committed lock's real wheels (from the suite's cache), to which a
    test adds its own packages."""
    idx = tmp_path / "real-index"
    idx.mkdir(parents=True)
    for wheel in locked_wheels(read_lock(ROOT / "locks" / f"py{python}-glibc2.35.lock")).glob("*.whl"):
        os.link(wheel, idx / wheel.name)
    return idx


def names(lock_file: Path) -> list[str]:
    return sorted(read_lock(lock_file).versions())


def test_markers_are_judged_for_the_image_python_and_torch_stays_the_images(index, tmp_path):
    old = lock(WheelSet(("tinydep",), IMAGE), tmp_path / "a.lock", index=str(index), cache=tmp_path / "c")
    new = lock(WheelSet(("tinydep",), R.ImagePython("3.12", (2, 39), "2.9.0")), tmp_path / "b.lock",
               index=str(index), cache=tmp_path / "c")
    # oldonly only below 3.11: pip download alone would judge by the Python running it.
    assert names(old.path) == ["oldonly", "tinydep"] and names(new.path) == ["tinydep"]
    text = old.path.read_text()
    assert "torch==" not in text  # the image brings it
    assert "# torch: 2.9.0 (" in text and "# torch needed by: tinydep" in text
    assert "# python: 3.10" in text and "manylinux_2_35_x86_64" in text
    # pip's --require-hashes format, one wheel file each, named above its pin.
    assert "# tinydep-1.0-py3-none-any.whl\ntinydep==1.0 \\\n    --hash=sha256:" in text


def test_a_torch_the_image_does_not_have_is_refused(index, tmp_path):
    with pytest.raises(WheelsError, match=r"torch>=2\.10") as err:
        lock(WheelSet(("tinydep", "torch>=2.10"), IMAGE), tmp_path / "x.lock", index=str(index),
             cache=tmp_path / "c")
    assert "2.9.0" in str(err.value)


def test_an_unknown_package_fails_naming_it_and_writes_nothing(index, tmp_path):
    with pytest.raises(WheelsError, match="no-such-package"):
        lock(WheelSet(("no-such-package",), IMAGE), tmp_path / "x.lock", index=str(index), cache=tmp_path / "c")
    assert not (tmp_path / "x.lock").exists()
    assert not list((tmp_path / "c").iterdir())  # nothing half-resolved is left in the cache


def test_a_lock_is_made_again_only_when_its_inputs_change_and_keeps_its_versions(index, tmp_path):
    path, cache = tmp_path / "x.lock", tmp_path / "c"
    assert lock(WheelSet(("tinydep",), IMAGE), path, index=str(index), cache=cache).written
    text = path.read_text()
    # Nothing changed: no index is asked (this one does not exist) and the file stays.
    again = lock(WheelSet(("tinydep",), IMAGE), path, index=str(tmp_path / "no-index"), cache=cache)
    assert not again.written and path.read_text() == text
    # A newer release appears; a new requirement is locked without moving the old ones...
    build_wheel(index, "tinydep", "2.0", requires=("torch>=2.0",))
    more = lock(WheelSet(("tinydep", "extradep"), IMAGE), path, index=str(index), cache=cache)
    assert more.written and more.changes == ["+extradep 1.0"]
    # ...and --upgrade takes the newest.
    up = lock(WheelSet(("tinydep", "extradep"), IMAGE), path, index=str(index), cache=cache, upgrade=True)
    assert up.changes == ["-oldonly 1.0", "tinydep 1.0 -> 2.0"]


def test_synthesis_fetches_exactly_the_lock_and_refuses_other_bytes(index, tmp_path):
    made = lock(WheelSet(("tinydep",), IMAGE), tmp_path / "x.lock", index=str(index), cache=tmp_path / "c")
    locked = read_lock(made.path)
    # An empty cache and an index that now serves a newer release: the locked one is fetched.
    build_wheel(index, "tinydep", "3.0", requires=("torch>=2.0",))
    got = locked_wheels(locked, tmp_path / "empty", str(index))
    assert sorted(p.name for p in got.glob("*.whl")) == ["oldonly-1.0-py3-none-any.whl",
                                                         "tinydep-1.0-py3-none-any.whl"]
    assert (got / "requirements.lock").read_text() == locked.pinned
    # The same file name with other bytes (a re-uploaded or tampered wheel) is never shipped.
    (index / "tinydep-1.0-py3-none-any.whl").unlink()
    build_wheel(index, "tinydep", "1.0", files={"tinydep/__init__.py": "ANSWER = 666\n"})
    with pytest.raises(WheelsError, match="x.lock: cannot fetch the locked wheels") as err:
        locked_wheels(locked, tmp_path / "empty-2", str(index))
    assert "HASH" in str(err.value).upper() and len(err.value.lines) == 1
    assert not list((tmp_path / "empty-2").iterdir())


def test_the_shipped_wheels_install_offline_and_import(index, tmp_path):
    made = lock(WheelSet(("tinydep",), IMAGE), tmp_path / "x.lock", index=str(index), cache=tmp_path / "c")
    wheels = locked_wheels(read_lock(made.path), tmp_path / "c")
    target = tmp_path / "deps"
    env = {**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/unreachable"}  # any index use fails
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                           "--target", str(target), *map(str, wheels.glob("*.whl"))],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    out = subprocess.run([sys.executable, "-c", "import tinydep; print(tinydep.ANSWER)"],
                         capture_output=True, text=True, env={**env, "PYTHONPATH": str(target)})
    assert out.stdout.strip() == "42"


def test_the_committed_lock_is_what_pip_require_hashes_installs(tmp_path):
    """The lock file itself is pip's format: pip takes it as it is, hashes checked, offline."""
    wheels = locked_wheels(read_lock(EXAMPLE_LOCK))
    platforms = [a for p in WheelSet((), IMAGE).platforms for a in ("--platform", p)]
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes",
                           "--only-binary=:all:", *platforms, "--python-version", "3.10", "--implementation", "cp",
                           "--no-index", "--find-links", str(wheels), "-d", str(tmp_path / "d"),
                           "-r", str(EXAMPLE_LOCK)],
                          capture_output=True, text=True, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == sorted(p.name for p in wheels.glob("*.whl"))


def test_uv_is_given_the_index_pip_is_configured_with(tmp_path, monkeypatch):
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = https://mirror.example/simple\nfind-links = /srv/wheels\n"
                    "cert = /etc/my-ca.pem\n[download]\ntrusted-host = mirror.example\n")
    for k in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://a.example/simple https://b.example/simple")
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    args, env = W.index_env(None, uv=True)
    assert args == ["--index-strategy", "unsafe-best-match", "--index-url", "https://mirror.example/simple",
                    "--extra-index-url", "https://a.example/simple", "--extra-index-url",
                    "https://b.example/simple", "--find-links", "/srv/wheels",
                    "--allow-insecure-host", "mirror.example"]
    assert env["SSL_CERT_FILE"] == "/etc/my-ca.pem"
    # A local index stands alone: pip's configuration is left out for pip, and uv gets only it.
    pip_args, env = W.index_env(str(tmp_path))
    assert pip_args == ["--no-index", "--find-links", str(tmp_path)]
    assert env["PIP_CONFIG_FILE"] == os.devnull and "PIP_EXTRA_INDEX_URL" not in env


def test_requirements_txt_takes_specifiers_only(tmp_path):
    (tmp_path / "requirements.txt").write_text(
        "# comment\nnumpy>=1.26  # inline\n\nrich[jupyter]==13.*; python_version >= '3.10'\n"
        "-r other.txt\nhttps://example.com/x.whl\nmypkg @ file:///tmp/x\n")
    with pytest.raises(WheelsError) as err:
        user_requirements(tmp_path)
    assert [ln.split(": ")[0].rsplit(":", 1)[1] for ln in err.value.lines] == ["5", "6", "7"]
    (tmp_path / "requirements.txt").write_text("numpy>=1.26  # inline\nrich[jupyter]==13.*\n")
    assert user_requirements(tmp_path) == ["numpy>=1.26", "rich[jupyter]==13.*"]
    assert user_requirements(None) == [] and user_requirements(tmp_path / "nothing") == []


def code_dir(tmp_path: Path, requirements: str) -> Path:
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "task.py").write_text("")
    (code / "requirements.txt").write_text(requirements)
    return code


def lock_code(code: Path, idx: Path, cache: Path) -> Path:
    """`make lock` for the example with this code_dir, against `idx`."""
    from stack_support import variant

    spec = variant({"trainer": {"code_dir": str(code)}})
    ws = W.wheel_set(spec, code)
    return lock(ws, W.lock_path(ws, code), index=str(idx), cache=cache).path


@pytest.mark.xdist_group("stacks")
def test_synthesis_ships_the_lock_and_a_requirements_change_needs_a_new_one(tmp_path, monkeypatch):
    from test_delivery import synth, template_and_objects

    idx, cache = real_index(tmp_path), tmp_path / "cache"
    build_wheel(idx, "tinydep", "1.0")
    build_wheel(idx, "extradep", "1.0")
    monkeypatch.setenv(INDEX_ENV, str(idx))
    monkeypatch.setenv(CACHE_ENV, str(cache))
    code = code_dir(tmp_path, "tinydep\n")
    lock_file = lock_code(code, idx, cache)
    assert lock_file == code / "requirements.py3.10-glibc2.35.lock"
    one = template_and_objects(synth("example", {"trainer": {"code_dir": str(code)}}))
    # requirements.txt changes: synthesis resolves nothing and says what to run.
    (code / "requirements.txt").write_text("tinydep==1.0\n")
    with pytest.raises(WheelsError, match=r"the lock no longer matches: the requirements changed since "
                                          r"\(\+'tinydep==1.0', -'tinydep'\): run `make lock EXPERIMENT=example`"):
        synth("example", {"trainer": {"code_dir": str(code)}})
    lock_code(code, idx, cache)  # the same wheels: the same object, the same template
    same = template_and_objects(synth("example", {"trainer": {"code_dir": str(code)}}))
    (code / "requirements.txt").write_text("tinydep\nextradep\n")
    lock_code(code, idx, cache)
    two = template_and_objects(synth("example", {"trainer": {"code_dir": str(code)}}))
    wheels = [next(o for o in objs.values() if o["name"].startswith("code/wheels-"))
              for _, objs in (one, same, two)]
    assert wheels[0]["name"] == wheels[1]["name"] != wheels[2]["name"]
    for (template, _), obj in zip((one, two), (wheels[0], wheels[2])):
        script = template["metadata"]["startup-script"]
        sha = obj["source"].split("/")[2]
        assert f"/mnt/spottrain/deps/{sha}" in script and "--no-index" in script
        assert "pip install --quiet --constraint" not in script  # no index at boot, ever
    # The lock stays out of the code archive (its pins ship as the wheels'): a lock for another
    # Python (the drill's) changes nothing a VM runs.
    users = [next(o for o in objs.values() if o["name"].startswith("code/user-")) for _, objs in (one, two)]
    assert users[0]["name"] != users[1]["name"]  # requirements.txt itself did change
    (code / "requirements.py3.11-glibc2.35.lock").write_text("# another Python's lock\n")
    again = template_and_objects(synth("example", {"trainer": {"code_dir": str(code)}}))
    assert again == two


def test_make_lock_writes_each_lock_once_and_says_what_moved(tmp_path, monkeypatch, capsys):
    from stacks.lock import main

    idx = real_index(tmp_path)
    build_wheel(idx, "tinydep", "1.0")
    monkeypatch.setenv(INDEX_ENV, str(idx))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    code = code_dir(tmp_path, "tinydep\n")
    exp = tmp_path / "mine.toml"
    exp.write_text(EXAMPLE.read_text().replace("[trainer]\n", f"[trainer]\ncode_dir = {json.dumps(str(code))}\n"))
    assert main([str(exp), "--no-drill"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"{code}/requirements.py3.10-glibc2.35.lock: written, {len(read_lock(EXAMPLE_LOCK).pins) + 1} "
                      f"packages (Python 3.10, glibc 2.35, image torch 2.9.0; for {exp})")
    assert "  +tinydep 1.0" in out and all(line.startswith("  +") for line in out[1:])
    assert main([str(exp), "--no-drill"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(": up to date, "
                                                            f"{len(read_lock(EXAMPLE_LOCK).pins) + 1} packages "
                                                            f"(Python 3.10, glibc 2.35, image torch 2.9.0; for {exp})")
    exp.write_text("labels = 3\n")
    assert main([str(exp)]) == 2
    assert "labels: Input should be a valid dictionary" in capsys.readouterr().err


#: A wheel file name as long as the index serves (charset_normalizer 3.5.3's is 101 characters).
LONG_TAG = "cp310-cp310-manylinux1_x86_64.manylinux_2_28_x86_64.manylinux_2_5_x86_64"


@pytest.mark.xdist_group("stacks")
def test_a_wheel_name_over_100_characters_synthesizes_and_reaches_the_vm_intact(tmp_path, monkeypatch):
    from test_delivery import synth, template_and_objects

    from stacks.delivery import BUILD_DIR

    idx, cache = real_index(tmp_path), tmp_path / "cache"
    probe = build_wheel(idx, "spottrain-long-name-probe", "1.0", tag=LONG_TAG)
    assert len(probe.name) > 100
    code = code_dir(tmp_path, "spottrain-long-name-probe\n")
    lock_code(code, idx, cache)
    monkeypatch.setenv(INDEX_ENV, str(idx))
    monkeypatch.setenv(CACHE_ENV, str(cache))
    _, objects = template_and_objects(synth("example", {"trainer": {"code_dir": str(code)}}))
    (wheels,) = [o for o in objects.values() if o["name"].startswith("code/wheels-")]
    out = tmp_path / "vm"
    out.mkdir()
    archive = BUILD_DIR / wheels["name"].removeprefix("code/")  # what the stack uploads
    subprocess.run(["tar", "-xzf", str(archive), "-C", str(out)], check=True)  # as the VM unpacks it
    assert (out / probe.name).read_bytes() == probe.read_bytes()


def run_main(tmp_path: Path, exp: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "main.py")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "SPOTTRAIN_EXPERIMENTS": str(exp),
                                            "CDKTF_OUTDIR": str(tmp_path / "out"), **env})


def test_a_missing_lock_exits_2_from_main_py_in_one_line(tmp_path, index):
    code = code_dir(tmp_path, "tinydep\n")
    exp = tmp_path / "x.toml"
    exp.write_text(EXAMPLE.read_text().replace("[trainer]\n", f"[trainer]\ncode_dir = {json.dumps(str(code))}\n"))
    proc = run_main(tmp_path, exp, {INDEX_ENV: str(index), CACHE_ENV: str(tmp_path / "cache")})
    assert proc.returncode == 2, proc.stderr
    # The example names no alert channel, so a warning about that may come first; the failure is
    # the one line that ends the output.
    *warnings, failure = proc.stderr.splitlines()
    assert failure == (
        f"{code}/requirements.py3.10-glibc2.35.lock: no lock of the VM's dependencies for Python 3.10, "
        "glibc 2.35, image torch 2.9.0 (synthesis installs exactly a committed lock, it never resolves): "
        "run `make lock EXPERIMENT=x` and commit the lock")
    assert all(line.startswith(f"{exp}: ") for line in warnings), warnings


def test_a_lock_not_written_by_make_lock_or_for_another_python_is_refused(tmp_path):
    code = code_dir(tmp_path, "tinydep\n")
    ws = WheelSet(TRAINER_REQUIREMENTS + ("tinydep",), IMAGE)
    (code / "requirements.py3.10-glibc2.35.lock").write_text("not a lock\n")
    with pytest.raises(WheelsError) as err:
        W.locked(ws, code)
    assert err.value.lines == [f"{code}/requirements.py3.10-glibc2.35.lock: not a lock that `make lock` wrote "
                               "(line 1: 'not a lock'); run `make lock` again"]
    # The committed trainer lock for 3.10, read as if it were the lock of a 3.11 image.
    lock = read_lock(EXAMPLE_LOCK)
    assert W.stale(WheelSet(TRAINER_REQUIREMENTS, IMAGE), lock) == []
    other = WheelSet(TRAINER_REQUIREMENTS, R.ImagePython("3.11", (2, 35), "2.9.0"))
    assert W.stale(other, lock) == ["it is for Python 3.10, glibc 2.35"]
    # No locked package needs torch: any image torch fits.
    assert W.stale(WheelSet(TRAINER_REQUIREMENTS, R.ImagePython("3.10", (2, 35), "2.8.0")), lock) == []


@pytest.mark.xdist_group("stacks")
def test_the_same_commit_deploys_the_same_vm_whatever_the_index_serves_newest(tmp_path, monkeypatch):
    """The example and its committed lock, synthesized with two empty caches against two indexes:
    one serves exactly the locked wheels, the other newer releases of the trainer's dependencies
    besides. The JSON is byte-identical (and equal to the suite's own synthesis from the real
    index), so a fresh clone deploys no new VM."""
    from test_delivery import synth

    a = real_index(tmp_path / "a")
    b = real_index(tmp_path / "b")
    for name in ("pydantic", "google-cloud-storage", "safetensors", "certifi"):
        build_wheel(b, name, "99.0")
    out = []
    for idx in (a, b):
        monkeypatch.setenv(INDEX_ENV, str(idx))
        monkeypatch.setenv(CACHE_ENV, str(tmp_path / f"cache-{idx.parent.name}"))
        out.append(synth("example"))
    monkeypatch.delenv(INDEX_ENV)
    monkeypatch.delenv(CACHE_ENV)
    assert out[0] == out[1] == synth("example")
    assert (tmp_path / "cache-a").is_dir() and (tmp_path / "cache-b").is_dir()  # both fetched anew


def test_the_trainer_requirements_are_pyprojects_without_torch() -> None:
    import re
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert set(TRAINER_REQUIREMENTS) == {d for d in deps if not re.match(r"torch\b", d)}


def test_every_committed_lock_is_current_for_what_the_repository_synthesizes():
    """`make lock` would change nothing: each experiment (and its drill) has its lock and it matches."""
    from stacks.lock import DEFAULT_FOLDERS, targets
    from stacks.load import load_all

    files = [e for f in DEFAULT_FOLDERS for e in load_all(f)]
    for path, (ws, _) in targets(files, drill=True).items():
        assert path.is_file(), path
        assert W.stale(ws, read_lock(path)) == [], path
