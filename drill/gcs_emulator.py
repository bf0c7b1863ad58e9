"""gcp-storage-emulator as a subprocess on a free 127.0.0.1 port: the drill's Cloud Storage.

The real google-cloud-storage client (in the trainer) talks to it through `STORAGE_EMULATOR_HOST`.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

EMULATOR = Path(sys.executable).with_name("gcp-storage-emulator")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StorageEmulator:
    """An in-memory emulator holding `bucket`; a context manager."""

    def __init__(self, bucket: str, *, log: Path | None = None) -> None:
        self.bucket = bucket
        self.port = free_port()
        self._log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        """The value for STORAGE_EMULATOR_HOST."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> "StorageEmulator":
        out = open(self._log, "ab") if self._log else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [str(EMULATOR), "start", "--host", "127.0.0.1", "--port", str(self.port), "--in-memory",
             "--default-bucket", self.bucket], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:  # wait for the socket to answer (the guard is the timeout)
            if self.proc.poll() is not None:
                raise RuntimeError(f"gcp-storage-emulator exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.host}/storage/v1/b/{self.bucket}", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"gcp-storage-emulator did not answer within {timeout}s")
            time.sleep(0.1)

    def stop(self) -> None:
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
