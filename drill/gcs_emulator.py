"""gcp-storage-emulator as a subprocess on a free 127.0.0.1 port: Cloud Storage for the drill and
the tests.

The real google-cloud-storage client (in the trainer) talks to it through `STORAGE_EMULATOR_HOST`.
It can be stopped and started again on the same port, which is how the tests stage a GCS outage
(in-memory: it comes back with the default bucket, empty).
"""
from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from drill.net import free_port

__all__ = ["EMULATOR", "StorageEmulator"]

EMULATOR = Path(sys.executable).with_name("gcp-storage-emulator")

# Readiness is polled without proxies: it is always loopback.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class StorageEmulator:
    """An in-memory emulator holding `bucket`; a context manager.

    `port` defaults to a free one and is kept across `stop()`/`start()`. Its own log goes to `log`
    when given; without one it runs with `-q` (its per-request logging costs CPU and goes nowhere)
    unless `quiet=False`.
    """

    def __init__(self, bucket: str, *, log: Path | None = None, port: int | None = None,
                 quiet: bool | None = None) -> None:
        self.bucket = bucket
        self.port = port or free_port()
        self._log = log
        self._quiet = log is None if quiet is None else quiet
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        """The value for STORAGE_EMULATOR_HOST."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> "StorageEmulator":
        """Start it (again) on `port` and return once the default bucket answers."""
        argv = [str(EMULATOR), "start", "--host", "127.0.0.1", "--port", str(self.port), "--in-memory",
                "--default-bucket", self.bucket] + (["-q"] if self._quiet else [])
        if self._log:
            with open(self._log, "ab") as out:  # the child keeps its own copy of the descriptor
                self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        else:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:  # wait for the bucket to answer (the guard is the timeout)
            if self.proc.poll() is not None:
                raise RuntimeError(f"gcp-storage-emulator exited with {self.proc.returncode}")
            try:
                with _OPENER.open(f"{self.host}/storage/v1/b/{self.bucket}", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"gcp-storage-emulator did not answer within {timeout}s")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop it; everything it held is gone (in-memory). The port stays this emulator's."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "StorageEmulator":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
