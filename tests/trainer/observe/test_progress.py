"""trainer.observe.progress and the log sink: one structured line per interval, the task's own
metrics in it; a live line only on a terminal."""
from __future__ import annotations

import io
import re

import pytest

from tests.trainer.support import restore_logging  # noqa: F401  (fixture)
from trainer.observe.events import Step
from trainer.observe.progress import StepWindow, setup_logging
from trainer.observe.sinks.log import LogSink

pytestmark = pytest.mark.usefixtures("restore_logging")


class Progress:
    """The loop's side (the window each Step event carries) and the log sink's, together."""

    def __init__(self, log, *, total_steps: int, start_step: int, every: int, tokens_per_step: int,
                 samples_per_step: int = 1, stream=None) -> None:
        self.total = total_steps
        self.window = StepWindow(total_steps=total_steps, start_step=start_step, every=every,
                                 tokens_per_step=tokens_per_step, samples_per_step=samples_per_step)
        self.sink = LogSink(log, main=True, stream=stream)

    def update(self, step: int, loss: float, lr: float, metrics: dict | None = None) -> None:
        self.sink.handle(Step(step, self.total, loss, lr, metrics or {}, self.window.add(step, loss, lr, metrics)))

    def close(self) -> None:
        self.sink.close(0.0)


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_interval_lines_are_structured() -> None:
    out = io.StringIO()
    log = setup_logging(stream=out)
    p = Progress(log, total_steps=10, start_step=0, every=5, tokens_per_step=100, stream=out)
    for step in range(1, 11):
        p.update(step, loss=2.0 + step, lr=1e-3)
    p.close()
    lines = [line for line in out.getvalue().splitlines() if "event=step" in line]
    assert len(lines) == 2 and "\r" not in out.getvalue()
    m = re.search(r"INFO trainer event=step step=5/10 loss=(\S+) lr=1.000e-03 steps_per_s=\S+ tokens_per_s=\S+ eta_s=\S+$",
                  lines[0])
    assert m and float(m.group(1)) == pytest.approx(5.0)  # mean loss over the interval
    assert "step=10/10" in lines[1]


def test_live_line_on_a_terminal() -> None:
    tty = Tty()
    log = setup_logging(stream=tty)
    p = Progress(log, total_steps=4, start_step=0, every=2, tokens_per_step=0, stream=tty)
    p.update(1, loss=1.0, lr=0.1)
    assert tty.getvalue().startswith("\r[")
    p.update(2, loss=1.0, lr=0.1)  # the log line first clears the live line
    text = tty.getvalue()
    assert "\r\x1b[K" in text and "samples_per_s" in text
    p.close()


def test_no_terminal_escapes_in_log_lines() -> None:
    """torch's unpickling errors bold their advice (ESC[1m ... ESC[0m); a restore logged them."""
    out = io.StringIO()
    log = setup_logging(stream=out)
    log.getChild("checkpoint").info("state.pt: \x1b[1mdo those steps only if you trust\x1b[0m the source")
    try:
        raise ValueError("\x1b[31mred\x1b[0m")
    except ValueError:
        log.exception("event=failed")
    text = out.getvalue()
    assert "\x1b" not in text
    assert "state.pt: do those steps only if you trust the source" in text and "ValueError: red" in text


def test_samples_per_s_counts_the_samples_of_a_step() -> None:
    """A task without tokens (an image classifier) gets samples/s: steps/s x the global batch,
    not steps/s again."""
    out = io.StringIO()
    log = setup_logging(stream=out)
    p = Progress(log, total_steps=4, start_step=0, every=2, tokens_per_step=0, samples_per_step=32, stream=out)
    for step in range(1, 5):
        p.update(step, loss=1.0, lr=0.1)
    p.close()
    for line in (x for x in out.getvalue().splitlines() if "event=step" in x):
        m = re.search(r"steps_per_s=(\S+) samples_per_s=(\S+) ", line)
        assert m, line
        assert float(m.group(2)) == pytest.approx(32 * float(m.group(1)), abs=1.0)


def test_the_tasks_metrics_are_averaged_over_the_interval_and_logged_after_the_figures() -> None:
    out = io.StringIO()
    log = setup_logging(stream=out)
    p = Progress(log, total_steps=4, start_step=0, every=2, tokens_per_step=0, stream=out)
    for step, acc in zip(range(1, 5), (0.5, 0.7, 0.8, 1.0)):
        p.update(step, loss=1.0, lr=0.1, metrics={"acc": acc, "top5": 1.0})
    p.close()
    lines = [x for x in out.getvalue().splitlines() if "event=step" in x]
    assert len(lines) == 2
    assert re.search(r"event=step step=2/4 loss=1\.0000 lr=\S+ steps_per_s=\S+ samples_per_s=\S+ eta_s=\S+ "
                     r"acc=0\.6 top5=1$", lines[0]), lines[0]
    assert lines[1].endswith(" acc=0.9 top5=1")
