"""stacks/wheels.py: the dependencies resolved at deploy time for the image's Python (real uv and
pip against a local wheel index, never PyPI), shipped as a content-named archive and installed
offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from stack_support import EXAMPLE

from stacks import gcp_rules as R
from stacks.wheels import (INDEX_ENV, TRAINER_REQUIREMENTS, WheelSet, WheelsError, build_wheel, cached,
                           resolve, user_requirements)

ROOT = Path(__file__).resolve().parents[2]
IMAGE = R.ImagePython("3.10", (2, 35), "2.9.0")


@pytest.fixture
def index(tmp_path: Path) -> Path:
    """The suite's local index (the trainer's stand-in wheels) plus a tiny package with code."""
    idx = tmp_path / "index"
    idx.mkdir()
    for wheel in Path(os.environ[INDEX_ENV]).glob("*.whl"):
        (idx / wheel.name).write_bytes(wheel.read_bytes())
    build_wheel(idx, "tinydep", "1.0", files={"tinydep/__init__.py": "ANSWER = 42\n"},
                requires=("torch>=2.0", "oldonly; python_version < '3.11'"))
    build_wheel(idx, "oldonly", "1.0")
    build_wheel(idx, "extradep", "1.0")
    return idx


def names(d: Path) -> list[str]:
    return sorted(p.name.split("-")[0] for p in d.glob("*.whl"))


def test_markers_are_evaluated_for_the_image_python_and_torch_stays_the_images(index, tmp_path):
    reqs = TRAINER_REQUIREMENTS + ("tinydep",)
    old = resolve(WheelSet(reqs, IMAGE), tmp_path / "c", str(index))
    new = resolve(WheelSet(reqs, R.ImagePython("3.12", (2, 39), "2.9.0")), tmp_path / "c", str(index))
    # tomli and oldonly only below 3.11: pip download alone would judge by the Python running it.
    assert names(old) == ["google_cloud_storage", "google_crc32c", "oldonly", "pydantic", "safetensors", "tinydep",
                          "tomli"]
    assert names(new) == ["google_cloud_storage", "google_crc32c", "pydantic", "safetensors", "tinydep"]
    assert "torch" not in (old / "requirements.lock").read_text()  # the image brings it


def test_a_torch_the_image_does_not_have_is_refused(index, tmp_path):
    with pytest.raises(WheelsError, match=r"torch>=2\.10") as err:
        resolve(WheelSet(TRAINER_REQUIREMENTS + ("torch>=2.10",), IMAGE), tmp_path / "c", str(index))
    assert "2.9.0" in str(err.value)


def test_an_unknown_package_fails_naming_it(index, tmp_path):
    with pytest.raises(WheelsError, match="no-such-package"):
        resolve(WheelSet(TRAINER_REQUIREMENTS + ("no-such-package",), IMAGE), tmp_path / "c", str(index))
    assert not list((tmp_path / "c").glob("*"))  # nothing half-resolved is left in the cache


def test_a_resolved_set_comes_from_the_cache_without_any_index(index, tmp_path):
    ws = WheelSet(TRAINER_REQUIREMENTS, IMAGE)
    first = resolve(ws, tmp_path / "c", str(index))
    assert cached(ws, tmp_path / "c") == first
    assert resolve(ws, tmp_path / "c", str(tmp_path / "no-index-here")) == first
    assert WheelSet(TRAINER_REQUIREMENTS + ("tinydep",), IMAGE).digest != ws.digest


def test_the_shipped_wheels_install_offline_and_import(index, tmp_path):
    wheels = resolve(WheelSet(TRAINER_REQUIREMENTS + ("tinydep",), IMAGE), tmp_path / "c", str(index))
    target = tmp_path / "deps"
    env = {**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/unreachable"}  # any index use fails
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                           "--target", str(target), *map(str, wheels.glob("*.whl"))],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    out = subprocess.run([sys.executable, "-c", "import tinydep; print(tinydep.ANSWER)"],
                         capture_output=True, text=True, env={**env, "PYTHONPATH": str(target)})
    assert out.stdout.strip() == "42"


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


def test_synthesis_ships_the_wheels_and_a_requirements_change_rolls_the_template(index, tmp_path, monkeypatch):
    from test_delivery import synth, template_and_objects

    monkeypatch.setenv(INDEX_ENV, str(index))
    code = tmp_path / "code"
    code.mkdir()
    (code / "task.py").write_text("")
    (code / "requirements.txt").write_text("tinydep\n")
    one = template_and_objects(synth("example", {"trainer": {"code_dir": str(code)}}))
    (code / "requirements.txt").write_text("tinydep==1.0\n")  # the same wheels, the same object
    same = template_and_objects(synth("example", {"trainer": {"code_dir": str(code)}}))
    (code / "requirements.txt").write_text("tinydep\nextradep\n")
    two = template_and_objects(synth("example", {"trainer": {"code_dir": str(code)}}))
    wheels = [next(o for o in objs.values() if o["name"].startswith("code/wheels-"))
              for _, objs in (one, same, two)]
    assert wheels[0]["name"] == wheels[1]["name"]
    assert wheels[0]["name"] != wheels[2]["name"]
    wheels = [wheels[0], wheels[2]]
    for (template, _), obj in zip((one, two), wheels):
        script = template["metadata"]["startup-script"]
        sha = obj["source"].split("/")[2]
        assert f"/mnt/spottrain/deps/{sha}" in script and "--no-index" in script
        assert "pip install --quiet --constraint" not in script  # no index at boot, ever


def test_unresolvable_requirements_exit_2_from_main_py(index, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "requirements.txt").write_text("no-such-package>=1\n")
    exp = tmp_path / "x.toml"
    exp.write_text(EXAMPLE.read_text().replace("[trainer]\n", f"[trainer]\ncode_dir = {json.dumps(str(code))}\n"))
    env = {**os.environ, "SPOTTRAIN_EXPERIMENTS": str(exp), "CDKTF_OUTDIR": str(tmp_path / "out"),
           INDEX_ENV: str(index)}
    proc = subprocess.run([sys.executable, str(ROOT / "main.py")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "no-such-package" in proc.stderr


def test_the_trainer_requirements_are_pyprojects_without_torch() -> None:
    import re
    import tomllib

    deps = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["dependencies"]
    assert set(TRAINER_REQUIREMENTS) == {d for d in deps if not re.match(r"torch\b", d)}
