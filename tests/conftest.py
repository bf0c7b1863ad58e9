"""Suite-wide setup: a private temporary folder per pytest process.

cdktn's `Testing.app()` leaves a `cdktf.outdir.*` folder behind in the jsii runtime's temporary
folder for every synthesis. Each pytest process (every xdist worker is one) points TMPDIR at a
folder of its own before anything starts that runtime, and removes it whole at the end, so one
worker's cleanup can never delete a folder another worker is still synthesizing into.
"""

from __future__ import annotations

import os
import shutil
import tempfile

_PRIVATE_TMP = tempfile.mkdtemp(prefix="spottrain-tests-")
os.environ["TMPDIR"] = _PRIVATE_TMP  # read by child processes, the jsii runtime among them


def pytest_sessionfinish(session, exitstatus) -> None:
    shutil.rmtree(_PRIVATE_TMP, ignore_errors=True)
