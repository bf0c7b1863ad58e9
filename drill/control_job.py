"""The experiment's control job (`trainer.cloud.control`) as Cloud Run runs it, for the drill and tests.

`ControlJob(fake, settings, account=...)` makes the fake Google APIs (`drill.fake_gcp.FakeGcp`)
start one execution of the job for every `jobs.run` call they accept: a `python -m trainer.cloud.control`
process with the job's settings (`SPOTTRAIN_CONTROL`, built by `stacks.control.control_settings`
as the stack builds them), its own metadata server (so its own token, which the fake maps to the
job's service account: the stack's grants for that account are all it has), and the fakes'
endpoints (Compute, Cloud Storage, Secret Manager: it reads the checkpoint key to verify a stop marker). Each execution's exit status and output are kept (`runs`), so a test or the drill can
say what the job did and whether Google would have let it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drill.fake_gcp import FakeGcp
from drill.metadata_server import MetadataServer
from stacks.boot import control_job_name


@dataclass
class Execution:
    job: str
    returncode: int
    output: str


class ControlJob:
    def __init__(self, fake: FakeGcp, settings: dict[str, Any], *, account: str, storage: str,
                 name: str | None = None, pythonpath: Path | None = None, poll_s: float = 0.05,
                 timeout_s: float = 300.0) -> None:
        """`account`: the job's service-account email; `storage`: STORAGE_EMULATOR_HOST; `name`:
        the job's (default: the stack's, from the settings' `runs/<experiment>` prefix);
        `pythonpath`: where `trainer` is imported from (default: this repository)."""
        self.fake, self.account, self.storage = fake, account, storage
        self.settings = {**settings, "poll_s": poll_s, "confirm_s": timeout_s}
        self.pythonpath = pythonpath or Path(__file__).resolve().parents[1]
        self.timeout_s = timeout_s
        self.token = f"control-token-{account}"
        self.runs: list[Execution] = []
        self._lock = threading.Lock()
        self.metadata = MetadataServer(token=self.token, email=account, instance_name="cloud-run-job",
                                       project_id=fake.project)
        fake.add_identity(self.token, f"serviceAccount:{account}")
        self.job = fake.add_job(settings["region"], name or control_job_name(settings["prefix"].rsplit("/", 1)[-1]))

    def __enter__(self) -> "ControlJob":
        self.metadata.start()
        self.fake.job_runner = self
        return self

    def __exit__(self, *exc: object) -> None:
        self.fake.job_runner = None
        self.metadata.stop()

    def __call__(self, job: str) -> None:
        if job != self.job:
            return  # another job of the project: not ours to run
        env = {**os.environ, "SPOTTRAIN_CONTROL": json.dumps(self.settings), "GCE_METADATA_HOST": self.metadata.host,
               "SPOTTRAIN_COMPUTE_API": self.fake.compute_api, "STORAGE_EMULATOR_HOST": self.storage,
               "SPOTTRAIN_SECRETMANAGER_API": self.fake.secretmanager_api, "PYTHONPATH": str(self.pythonpath)}
        try:
            proc = subprocess.run([sys.executable, "-m", "trainer.cloud.control"], env=env, cwd=self.pythonpath,
                                  capture_output=True, text=True, timeout=self.timeout_s)
            run = Execution(job, proc.returncode, proc.stdout + proc.stderr)
        except subprocess.TimeoutExpired as e:
            run = Execution(job, -1, f"timed out after {self.timeout_s:.0f}s: {e}")
        with self._lock:
            self.runs.append(run)

    def failed(self) -> list[Execution]:
        with self._lock:
            return [r for r in self.runs if r.returncode != 0]
