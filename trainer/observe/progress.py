"""Logs: structured ``key=value`` lines, the step window, and a live line when stderr is a terminal.

Every line the trainer logs is ``TIME LEVEL LOGGER event=NAME key=value ...`` so that journald,
Cloud Logging and tests can pick fields out of it. Terminal escape sequences that a library puts
into its messages (torch's unpickling errors bold their advice) are removed from every line: in a
journal or a log file they are noise (``setup_logging``).

On a VM the first line of every record the trainer's own loggers (``trainer``, ``trainer.*``) write
ends in a signature under the VM's log key (``trainer.cloud.log_shipper.sign``; the key file is
``SPOTTRAIN_LOG_KEY_FILE``): the log shipper takes events and fields only from signed lines, so
that nothing the task prints, no library's output and no text from a bucket, the data or an
exception that reaches a line can pass for one of the trainer's events. Without the variable (a
terminal, the tests) nothing is signed and the lines are as they were.

``StepWindow`` turns the steps into the figures of each logging interval (the mean loss and task
metrics, the learning rate, steps/s, tokens/s or samples/s, the ETA): the ``Step`` event carries
them (``trainer.observe.events``), and the log line (``trainer.observe.sinks.log``) and
TensorBoard both show them. ``LiveLine`` is the progress bar a terminal gets.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import time
from typing import Callable, TextIO

from trainer.cloud.log_shipper import KEY_ENV, load_key, sign


_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")


class _PlainFormatter(logging.Formatter):
    """The log format, without terminal escape sequences (in messages and tracebacks)."""

    def format(self, record: logging.LogRecord) -> str:
        return _ANSI.sub("", super().format(record))


class _LiveAwareHandler(logging.StreamHandler):
    """Clears the live progress line before a log line, so the two do not interleave; signs the
    trainer's own records where the VM has a log key (see the module docstring)."""

    live: "LiveLine | None" = None

    def __init__(self, stream: TextIO, key_file: str | None = None) -> None:
        super().__init__(stream)
        self.key_file = key_file
        self.key: bytes | None = None

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if self.key_file and (record.name == "trainer" or record.name.startswith("trainer.")):
            # Read until it is there: the shipper creates the key at its start, which a trainer
            # started at the same moment may precede; its first lines then go unsigned (plain messages).
            if self.key is None:
                self.key = load_key(self.key_file, create=False)
            if self.key is not None:
                text = sign(self.key, text)
        return text

    def emit(self, record: logging.LogRecord) -> None:
        if self.live is not None:
            self.live.clear()
        super().emit(record)


def setup_logging(rank: int = 0, stream: TextIO | None = None) -> logging.Logger:
    stream = stream or sys.stderr
    handler = _LiveAwareHandler(stream, os.environ.get(KEY_ENV) or None)
    prefix = f"rank={rank} " if rank else ""
    handler.setFormatter(_PlainFormatter(
        f"%(asctime)s.%(msecs)03d %(levelname)s %(name)s {prefix}%(message)s", "%Y-%m-%dT%H:%M:%S"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return logging.getLogger("trainer")


#: How often a node that trains but does not log the step lines says so (`Heartbeat`), and how often
#: a coordinator that only hosts the rendezvous store says it is up: well under the shortest stall
#: alert (`[alerts] stall_minutes` >= 5), at a few hundred short lines a day.
HEARTBEAT_S = 60.0


class Heartbeat:
    """``event=heartbeat step=N``, at most once every ``every_s``: what a node of a pool that trains
    without rank 0 (whose step lines speak for the job) logs, so that its own log shipper's stall
    clock sees the training go on (trainer/cloud/log_shipper.py counts step and heartbeat lines)."""

    def __init__(self, log: logging.Logger, every_s: float = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.every_s, self.clock = log, every_s, clock
        self._due = clock()  # the first step says so at once

    def beat(self, step: int) -> None:
        now = self.clock()
        if now >= self._due:
            self._due = now + self.every_s
            self.log.info("event=heartbeat step=%d (this node trains; rank 0 logs the step lines)", step)


class StepWindow:
    """The figures of each logging interval: ``add`` after every step returns them at every
    ``every``-th step and at the last one (None otherwise). ``step`` counts optimizer steps
    completed; the task's metrics are averaged over the interval like the loss."""

    def __init__(self, *, total_steps: int, start_step: int, every: int, tokens_per_step: int,
                 samples_per_step: int = 1, clock: Callable[[], float] = time.monotonic):
        self.total, self.every, self.clock = total_steps, every, clock
        self.tokens_per_step = tokens_per_step
        self.samples_per_step = samples_per_step  # the global batch: samples/s without tokens
        self.unit = "tokens_per_s" if tokens_per_step else "samples_per_s"
        self._mark_step, self._mark_time = start_step, clock()
        self.rate = 0.0
        self._sums: dict[str, float] = {}
        self._n = 0

    def add(self, step: int, loss: float, lr: float, metrics: dict[str, float] | None = None) -> dict[str, float] | None:
        self._n += 1
        for name, v in {"loss": loss, **(metrics or {})}.items():
            self._sums[name] = self._sums.get(name, 0.0) + v
        if not (step % self.every == 0 or step == self.total):
            return None
        now = self.clock()
        dt = now - self._mark_time
        if dt > 0 and step > self._mark_step:
            self.rate = (step - self._mark_step) / dt
        out = {name: total / self._n for name, total in self._sums.items()}
        out.update({"lr": lr, "steps_per_s": self.rate,
                    self.unit: self.rate * (self.tokens_per_step or self.samples_per_step),
                    "eta_s": (self.total - step) / self.rate if self.rate > 0 else float("nan")})
        self._sums, self._n = {}, 0
        self._mark_step, self._mark_time = step, now
        return out


#: The window's own figures; every other key of a window is a metric of the task's.
WINDOW_FIGURES = ("loss", "lr", "steps_per_s", "tokens_per_s", "samples_per_s", "eta_s")


class LiveLine:
    """A progress bar redrawn in place on a terminal (nothing otherwise); a log line first clears it."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self._drawn = False
        for h in logging.getLogger().handlers:
            if isinstance(h, _LiveAwareHandler):
                h.live = self if self.live else None

    def draw(self, step: int, total: int, loss: float, rate: float) -> None:
        if not self.live:
            return
        width = 30
        done = int(width * step / max(1, total))
        eta = (total - step) / rate if rate > 0 else 0.0
        self.stream.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} "
                          f"loss {loss:.4f} {rate:.1f} it/s eta {eta:.0f}s \x1b[K")
        self.stream.flush()
        self._drawn = True

    def clear(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self._drawn = False

    def close(self) -> None:
        self.clear()
        for h in logging.getLogger().handlers:
            if isinstance(h, _LiveAwareHandler) and h.live is self:
                h.live = None
