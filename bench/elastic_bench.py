"""Time from a node's loss to training again, in parts: two torchrun agents on 127.0.0.1.

Like tests/trainer/e2e/test_e2e_elastic.py: nodes a (hosts the c10d rendezvous, survives) and b,
one gloo rank each on CPU, their own run dirs, the GCS emulator as the shared tier. Once both
train, node b is lost, two ways:
- power-off: agent b and every descendant SIGKILLed at once (a VM losing power);
- preemption: SIGTERM to agent b (systemd stopping the unit), which torchrun passes on: every rank
  stops at the same step and rank 0 saves it (a coordinated save).
Then, on node a (every time from the output lines' arrival, read as they come):
- detection: loss -> agent a logs its worker group's failure (`failed (exitcode: ...)`);
- rendezvous: -> agent a logs `Rendezvous complete for workers` (torchrun's INFO log);
- start-up: -> the new worker process logs `event=start` (Python, torch, the task built);
- restore: the trainer's own `event=restore ... seconds=` figure;
- first step: restore logged -> the first step logged (log_every_steps = 1);
- total: loss -> first step.
Each setting runs REPS times (SPOTTRAIN_BENCH_REPS, default 3): median and range. Two c10d
rendezvous settings side by side: torch's default keep-alive (a heartbeat every 5 s, a node
dead after 3 missed) and a 1 s heartbeat, to see whether the dead node's keep-alive is what the
rendezvous part waits for. last_call_timeout is 1 s in both (the stack's rendezvous_last_call_s,
30 s by default, adds to the rendezvous part whenever fewer than max_nodes come back).
"""
from __future__ import annotations

import contextlib
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from drill.gcs_emulator import StorageEmulator
from drill.net import free_port
from drill.procs import power_off
from drill.tiny_gpt import TASK_ARGS_TOML

REPO = Path(__file__).resolve().parent.parent
REPS = int(os.environ.get("SPOTTRAIN_BENCH_REPS", "3"))
GUARD_S = 300.0
STEPS = 100_000  # never reached: each repetition ends at the survivor's first step
LOSS_AFTER_STEP = 12
SETTINGS = {
    "torch default keep-alive (5 s x 3)": "",
    "keep-alive 1 s x 3": ",keep_alive_interval=1,keep_alive_max_attempt=3",
}
CONFIG = """\
log_every_steps = 1
batch_size = 4
global_batch_size = 8
health_port = 0
watch_metadata = false
progress_every_s = 0.5
""" + TASK_ARGS_TOML


class Agent:
    """A torchrun agent whose merged output is read line by line, each line with its arrival time."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                  env=env, cwd=REPO, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._done = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            with self._cond:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._cond.notify_all()
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def wait_for(self, pattern: str, after: float = 0.0) -> tuple[float, re.Match[str]]:
        """The first line arriving at or after `after` that matches: (arrival time, match)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + GUARD_S
        seen = 0
        with self._cond:
            while True:
                for t, line in self.lines[seen:]:
                    m = rx.search(line)
                    if m and t >= after:
                        return t, m
                seen = len(self.lines)
                if self._done:
                    raise RuntimeError(f"agent ended before {pattern!r}:\n" + self.tail())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"no {pattern!r} within {GUARD_S:g}s:\n" + self.tail())
                self._cond.wait(left)

    def tail(self, n: int = 40) -> str:
        return "\n".join(line for _, line in self.lines[-n:])

    def power_off(self) -> None:
        power_off(self.p.pid)

    def close(self) -> None:
        self.power_off()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(timeout=30)


def _agent(tmp: Path, node: str, port: int, host: bool, conf: str, gcs: StorageEmulator, prefix: str) -> Agent:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={prefix}",
            f"--rdzv-conf=is_host={'true' if host else 'false'},last_call_timeout=1{conf}",
            "--max-restarts=3", "--monitor-interval=0.5", "-m", "trainer", "run",
            "--run-dir", str(tmp / node), "--steps", str(STEPS), "--config", str(tmp / "trainer.toml"),
            "--checkpoint-every-steps", "5", "--gcs-uri", f"gs://{gcs.bucket}/runs/{prefix}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
               SPOTTRAIN_NODE=node, LOGLEVEL="INFO", STORAGE_EMULATOR_HOST=gcs.host,
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # as the pooled trainer.sh sets it
               GCE_METADATA_HOST=f"127.0.0.1:{free_port()}")
    return Agent(argv, env)


def one(kind: str, conf: str, gcs: StorageEmulator, rep: str) -> dict[str, float]:
    """One loss of node b; the parts in seconds."""
    with tempfile.TemporaryDirectory(prefix="elastic-bench-") as d:
        tmp = Path(d)
        (tmp / "trainer.toml").write_text(CONFIG)
        port = free_port()
        a = _agent(tmp, "a", port, True, conf, gcs, rep)
        b = _agent(tmp, "b", port, False, conf, gcs, rep)
        try:
            for p in (a, b):
                p.wait_for(r"event=start steps=\d+ world_size=2 ")
            # Rank 0 logs the steps, on whichever node the rendezvous put it.
            main = a if any(" INFO trainer event=start " in line for _, line in a.lines) else b
            main.wait_for(rf"event=step step={LOSS_AFTER_STEP}/")
            t0 = time.monotonic()
            if kind == "power-off":
                b.power_off()
            else:
                os.kill(b.p.pid, signal.SIGTERM)
            t_fail, _ = a.wait_for(r"failed \(exitcode: -?\d+\)", after=t0)
            t_rdzv, _ = a.wait_for(r"Rendezvous complete for workers", after=t_fail)
            t_start, _ = a.wait_for(r"event=start steps=\d+ world_size=1 .*restart=1 ", after=t_rdzv)
            t_restore, m = a.wait_for(r"event=restore step=\d+ tier=\S+ path=\S+ seconds=([\d.]+)", after=t_start)
            t_step, _ = a.wait_for(r"event=step step=\d+/", after=t_restore)
        finally:
            a.close()
            b.close()
    return {"detection": t_fail - t0, "rendezvous": t_rdzv - t_fail, "start-up": t_start - t_rdzv,
            "restore": float(m.group(1)), "first step": t_step - t_restore, "total": t_step - t0}


def _machine() -> str:
    import torch

    return (f"{platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}")


def main() -> None:
    parts = ("detection", "rendezvous", "start-up", "restore", "first step", "total")
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    with StorageEmulator("spottrain-bench") as gcs:
        for kind in ("power-off", "preemption"):
            for label, conf in SETTINGS.items():
                runs = results.setdefault((kind, label), [])
                for r in range(REPS):
                    runs.append(one(kind, conf, gcs, f"{kind}-{len(results)}-{r}"))
                    print(f"  {kind}, {label}, run {r + 1}/{REPS}: "
                          + ", ".join(f"{k} {v:.2f}" for k, v in runs[-1].items()), file=sys.stderr, flush=True)
    print(f"machine: {_machine()}; `make bench BENCH=elastic_bench` ({REPS} runs per row; "
          "seconds, median [min-max]; two torchrun agents on 127.0.0.1, gloo, one CPU rank each)\n")
    print("| loss | rendezvous setting | " + " | ".join(parts) + " |")
    print("|---|---|" + "---|" * len(parts))
    for (kind, label), runs in results.items():
        cells = []
        for part in parts:
            xs = [r[part] for r in runs]
            cells.append(f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]")
        print(f"| {kind} | {label} | " + " | ".join(cells) + " |")
    medians = {key: statistics.median(r["total"] for r in runs) for key, runs in results.items()}
    for kind in ("power-off", "preemption"):
        (slow, fast) = (medians[(kind, label)] for label in SETTINGS)
        print(f"\n{kind}: total {slow:.2f} s with torch's default keep-alive, {fast:.2f} s with a 1 s "
              f"keep-alive ({slow / fast:.2f}x)")
