"""tests/cpu_ledger.py: a test's CPU is its process tree's, live or reaped."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.cpu_ledger import tree_cpu

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint(time.process_time())"


def test_a_reaped_child_and_a_live_grandchild_count_to_the_tree() -> None:
    before = tree_cpu(os.getpid())
    done = subprocess.run([sys.executable, "-c", BURN], capture_output=True, text=True, check=True)
    child_cpu = float(done.stdout)
    # The reaped child's time is in our cutime; a live grandchild (under a shell we started) is read live.
    live = subprocess.Popen(["/bin/sh", "-c", f"{sys.executable} -c '{BURN}\nimport sys; sys.stdin.read()'"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout is not None
        grandchild_cpu = float(live.stdout.readline())
        # /proc counts whole clock ticks per field: up to 4 lost a process, far less than either's 0.3 s.
        slack = 8 / os.sysconf("SC_CLK_TCK")
        assert tree_cpu(os.getpid()) - before >= child_cpu + grandchild_cpu - slack
        assert tree_cpu(live.pid) >= grandchild_cpu - slack  # a subtree counts from its root
    finally:
        live.communicate("")
