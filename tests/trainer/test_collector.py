"""trainer/collector.py: `python -m trainer run` loads torch with the cyclic collector paused, then
collects again with the imports' objects frozen; a process that never paused it is left alone."""
from __future__ import annotations

import gc
import json
import os
from pathlib import Path

from tests.trainer.support import REPO, Proc, run_args, trainer_env, write_config
from trainer import collector


def test_a_fresh_run_collects_again_once_loaded_with_the_imports_frozen(tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    # The job's module is imported once the trainer has loaded: what it sees is what training sees.
    (code / "probe_task.py").write_text(
        "import gc, json, os, sys\n"
        "from trainer.tasks.gpt import build  # noqa: F401\n"
        "with open(os.environ['PROBE_OUT'], 'w') as f:\n"
        "    json.dump({'enabled': gc.isenabled(), 'frozen': gc.get_freeze_count(),\n"
        "               'torch': 'torch' in sys.modules}, f)\n")
    out = tmp_path / "probe.json"
    env = trainer_env(PYTHONPATH=os.pathsep.join([str(REPO), str(code)]), PROBE_OUT=str(out))
    p = Proc(run_args(tmp_path / "run", 1, write_config(tmp_path), "--task", "probe_task:build"), env=env, fork=False)
    assert p.wait() == 0, p.output[-3000:]
    seen = json.loads(out.read_text())
    # torch and the trainer make about 480,000 objects; frozen, later collections skip them.
    assert seen["enabled"] is True and seen["torch"] is True and seen["frozen"] > 100_000, seen


def test_resume_without_a_pause_changes_nothing() -> None:
    """The trainer called in-process (as tests do): the caller's collector is left as it was."""
    before = gc.get_freeze_count()
    collector.resume()
    assert gc.isenabled() and gc.get_freeze_count() == before
