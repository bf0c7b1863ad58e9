"""tests/trainer/support.py: no trainer a test started outlives it."""
from __future__ import annotations

import signal
import sys

from tests.trainer.support import Proc, power_off_leftovers


def test_a_process_left_running_is_powered_off_and_a_finished_one_left_alone() -> None:
    done = Proc([sys.executable, "-c", "print('done')"])
    assert done.wait() == 0
    left = Proc([sys.executable, "-c", "import time; print('parked', flush=True); time.sleep(600)"], new_session=True)
    left.wait_for("parked")
    assert power_off_leftovers() == [left.p.pid]
    assert left.wait() == -signal.SIGKILL
    assert power_off_leftovers() == []
