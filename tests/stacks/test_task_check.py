"""`trainer.task` resolved at synthesis from the code the VM gets, without importing it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from stack_support import EXAMPLE, ROOT, variant

from stacks.load import ExperimentError
from stacks.task_check import problems


def user_code(tmp_path: Path, files: dict[str, str]) -> Path:
    code = tmp_path / "mycode"
    for rel, text in files.items():
        (code / rel).parent.mkdir(parents=True, exist_ok=True)
        (code / rel).write_text(text)
    code.mkdir(exist_ok=True)
    return code


def test_a_task_typo_exits_2_at_synthesis(tmp_path):
    bad = tmp_path / "typo.toml"
    bad.write_text(EXAMPLE.read_text().replace('task = "trainer.tasks.gpt:build"',
                                               'task = "nanotsk:build"'))
    env = {**os.environ, "SPOTTRAIN_EXPERIMENTS": str(bad), "CDKTF_OUTDIR": str(tmp_path / "out")}
    proc = subprocess.run([sys.executable, str(ROOT / "main.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"{bad}: trainer.task: module 'nanotsk' is not in the code the "
                                  "VM gets: no nanotsk.py or nanotsk/__init__.py in trainer.code_dir "
                                  "(not set) or in the trainer package")
    assert not (tmp_path / "out").exists()


def test_the_bundled_task_and_a_misspelled_callable():
    assert list(problems("trainer.tasks.gpt:build", None)) == []
    ((path, msg),) = problems("trainer.tasks.gpt:buld", None)
    assert path == "task" and msg.startswith(
        "'buld' is not defined at the top level of trainer/tasks/gpt.py (the trainer package) "
        "(did you mean 'build'?)")
    # Only the trainer package of the repository is shipped.
    assert [p for p, _ in problems("stacks.app:main", None)] == ["task"]


BINDINGS = """\
import os.path
from functools import partial as make
try:
    from fast import tuned
except ImportError:
    def tuned(ctx): ...
if os.path.sep:
    class Model: ...
build = make(print)
scaled: int = 3
async def later(ctx): ...
def _private(ctx, *, width=1): ...
"""


@pytest.mark.parametrize("name", ["os", "make", "tuned", "Model", "build", "scaled", "later", "_private"])
def test_every_top_level_binding_counts(tmp_path, name):
    code = user_code(tmp_path, {"pkg/task.py": BINDINGS})
    assert list(problems(f"pkg.task:{name}", code)) == []


def test_names_inside_functions_do_not_count_and_code_is_never_run(tmp_path):
    canary = tmp_path / "ran"
    code = user_code(tmp_path, {"task.py": f"open({str(canary)!r}, 'w')\ndef outer():\n"
                                           "    def build(ctx): ...\n"})
    ((_, msg),) = problems("task:build", code)
    assert "'build' is not defined at the top level of" in msg and "task.py (code_dir" in msg
    assert not canary.exists()


def test_dynamic_modules_pass_unchecked(tmp_path):
    code = user_code(tmp_path, {"star.py": "from elsewhere import *\n",
                                "lazy.py": "def __getattr__(name): ...\n"})
    assert list(problems("star:build", code)) == list(problems("lazy:build", code)) == []


def test_packages_namespace_packages_and_what_is_not_shipped(tmp_path):
    code = user_code(tmp_path, {"a/__init__.py": "def build(ctx): ...\n",
                                "ns/deep/mod.py": "def build(ctx): ...\n",
                                "tests/helpers.py": "def build(ctx): ...\n",
                                "broken.py": "def build(ctx:\n"})
    assert list(problems("a:build", code)) == list(problems("ns.deep.mod:build", code)) == []
    ((_, msg),) = problems("tests.helpers:build", code)  # tests/ is not packed (stacks.delivery)
    assert "is not in the code the VM gets" in msg
    ((_, msg),) = problems("broken:build", code)
    assert "broken.py (code_dir" in msg and "is not valid Python: line 1" in msg


def test_task_args_are_checked_against_the_callables_parameters(tmp_path):
    code = user_code(tmp_path, {"t.py": "def build(ctx, width=1, *, depth=2): ...\n"
                                        "def loose(ctx, **kw): ...\n"})
    assert list(problems("t:build", code, {"width": 3, "depth": 1})) == []
    assert list(problems("t:loose", code, {"anything": 1})) == []
    ((path, msg),) = problems("t:build", code, {"widht": 3})
    assert path == "config.task_args"
    assert msg.startswith("build() takes no argument(s) 'widht'; allowed: depth, width")


def test_the_experiment_reports_it_under_trainer(tmp_path):
    code = user_code(tmp_path, {"mymodel/task.py": "def build(ctx, size=1): ...\n"})
    variant({"trainer": {"code_dir": str(code), "task": "mymodel.task:build",
                         "config": {"task_args": {"size": 2}}}}, "x")  # valid
    with pytest.raises(ExperimentError) as err:
        variant({"trainer": {"code_dir": str(code), "task": "mymodel.task:biuld",
                             "config": {"task_args": {"size": 2}}}}, "x")
    assert [line.split(": ", 2)[1] for line in err.value.lines] == ["trainer.task"]


# --- trainer.script: your own loop, named instead of a task ----------------------------------------

OWN_LOOP = ROOT / "examples" / "own_loop"


def script_variant(trainer: dict) -> object:
    return variant({"trainer": {"task": None, "code_dir": str(OWN_LOOP), **trainer}}, "x")


def test_a_script_in_code_dir_is_accepted_and_reaches_the_trainer_command():
    from stacks.boot import Release, boot_props, render

    exp = script_variant({"script": "train.py", "script_args": ["--lr", "0.5 $(reboot)"]})
    assert exp.trainer.script == "train.py" and exp.trainer.script_args == ["--lr", "0.5 $(reboot)"]
    releases = (Release("trainer", "code/trainer-0.tar.gz", "a" * 64), Release("user", "code/user-0.tar.gz", "b" * 64))
    trainer_sh = render(boot_props("x", exp, releases=releases)).trainer_sh
    # The script runs from the user code's release, by its relative path (the fingerprint holds
    # it, so it must not change with the release); each argument is one quoted word.
    assert f"cd /opt/spottrain/releases/{'b' * 64}\n" in trainer_sh
    assert "--script train.py \\\n  --script-arg=--lr \\\n  '--script-arg=0.5 $(reboot)' \\\n" in trainer_sh
    assert "--task" not in trainer_sh


def test_a_task_experiment_renders_no_script():
    from stacks.boot import Release, boot_props, render

    exp = variant({}, "x")
    trainer_sh = render(boot_props("x", exp, releases=(Release("trainer", "code/t.tar.gz", "a" * 64),))).trainer_sh
    assert "--task trainer.tasks.gpt:build \\\n" in trainer_sh and "--script" not in trainer_sh


def fields(err: pytest.ExceptionInfo) -> list[str]:
    return [line.split(": ", 2)[1] for line in err.value.lines]


def test_a_missing_script_names_the_file_and_the_field(tmp_path):
    with pytest.raises(ExperimentError) as err:
        script_variant({"script": "trian.py"})
    assert fields(err) == ["trainer.script"]
    assert "trian.py is not in the code the VM gets: no file" in err.value.lines[0]
    assert str(OWN_LOOP / "trian.py") in err.value.lines[0]


@pytest.mark.parametrize("script, says", [
    ("../own_loop/train.py", "is not a path inside code_dir"),
    ("/etc/passwd.py", "is not a path inside code_dir"),
    ("train", "is not a Python file"),
    ("tests/train.py", "is not shipped to the VM"),
    ("broken.py", "is not valid Python: line 1"),
    ("train\n.py", "contains a control character"),
])
def test_a_script_must_be_a_shipped_python_file_inside_code_dir(tmp_path, script, says):
    code = user_code(tmp_path, {"train.py": "print('hi')\n", "tests/train.py": "", "broken.py": "def (:\n"})
    with pytest.raises(ExperimentError) as err:
        variant({"trainer": {"task": None, "code_dir": str(code), "script": script}}, "x")
    assert fields(err) == ["trainer.script"] and says in err.value.lines[0], err.value.lines


def test_a_script_needs_code_dir_and_excludes_task_and_task_args(tmp_path):
    with pytest.raises(ExperimentError) as err:
        variant({"trainer": {"task": None, "script": "train.py"}}, "x")
    assert fields(err) == ["trainer.script"] and "needs trainer.code_dir" in err.value.lines[0]
    with pytest.raises(ExperimentError) as err:
        # The example names its task; with a script as well, which one trains is not clear.
        variant({"trainer": {"code_dir": str(OWN_LOOP), "script": "train.py",
                             "config": {"task_args": {"n_layer": 1}}}}, "x")
    assert fields(err) == ["trainer.task", "trainer.config.task_args"]
    with pytest.raises(ExperimentError) as err:
        variant({"trainer": {"script_args": ["--epochs", "1"]}}, "x")
    assert fields(err) == ["trainer.script_args"]


def test_script_settings_are_the_stacks_own(tmp_path):
    code = user_code(tmp_path, {"train.py": "", "trainer/__init__.py": ""})
    with pytest.raises(ExperimentError) as err:
        # A `trainer` package in code_dir would hide the real one from `python -m trainer`.
        variant({"trainer": {"task": None, "code_dir": str(code), "script": "train.py"}}, "x")
    assert fields(err) == ["trainer.script"] and "hide the trainer package" in err.value.lines[0]
    with pytest.raises(ExperimentError) as err:
        script_variant({"script": "train.py", "args": ["--script-arg=--x", "--script", "other.py"],
                        "script_args": ["--ok", "bad\x07"], "config": {"script": "x.py", "script_args": []}})
    assert set(fields(err)) == {"trainer.config.script", "trainer.config.script_args", "trainer.args[0]",
                                "trainer.args[1]", "trainer.script_args[1]"}, err.value.lines
    assert "x.toml: trainer.args[1]: --script is set by the stack from other fields; allowed: any other flag" \
        in err.value.lines
