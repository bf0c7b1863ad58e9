"""The training loop: build the task, restore, train, checkpoint, stop cleanly on preemption.

Read ``train()`` top to bottom: build, restore, the step loop, save and stop. The machinery sits
behind small interfaces: ``Session`` (``trainer.loop.session``: the start-up rule, the machinery one
process per VM runs, building the task, putting a checkpoint back), ``Writers`` (one trainer per
run dir and per job: ``trainer.loop.writers``), ``restore.newest`` (the checkpoint every rank
continues from: ``trainer.loop.restore``), ``Finish`` (the saves and the ways a session ends, with
the durability retries: ``trainer.loop.finish``), ``Checkpointer`` (tiers, layouts, asynchronous
saves: ``trainer.checkpoint``), ``StepFn`` (one optimizer step: ``trainer.loop.step``), ``Steps``
(the steps handed out one at a time, and every promise kept between two of them:
``trainer.loop.steps``, which a user's own loop iterates too, through ``trainer.run``) and the
event ``Bus`` its sinks watch the run through (``trainer.observe``).

Every decision that changes control flow (stop, save, pause) is agreed on by all ranks in one
small all-reduce per step, so a notice on any node stops every node at the same step.
"""
from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from trainer import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_PREEMPTED, EXIT_UNAVAILABLE, distributed, startup_notice
from trainer import task as tasks
from trainer.checkpoint import host_copy, state_codec, tier_wait
from trainer.checkpoint.key import KeyProblem
from trainer.checkpoint.lease import LeaseHeld, RunDirBusy
from trainer.config import RunConfig
from trainer.gpu import UnsupportedGpu
from trainer.loop import precision, state
from trainer.loop.evaluation import Evaluator
from trainer.loop.init_from import InitFromError
from trainer.loop.preemption import Preemption
from trainer.loop.session import BadWorld, Session, StoppedDuringStartup
from trainer.loop.step import StepFn
from trainer.loop.steps import Steps
from trainer.loop.named_state import StateError
from trainer.loop.undeclared import Undeclared
from trainer.data.streaming import StreamError
from trainer.observe.health import PortInUse
from trainer.observe.progress import setup_logging
from trainer.observe.sinks import SinkUnavailable

#: What exits 2: bad input, a resume with other settings, another trainer on the run dir or the job.
BAD_INPUT = (state.ResumeMismatch, tasks.TaskError, BadWorld, UnsupportedGpu, PortInUse, InitFromError, RunDirBusy,
             LeaseHeld, KeyProblem, state_codec.NotPlainData, precision.UnsupportedPrecision, host_copy.Unsupported,
             SinkUnavailable, StateError, Undeclared, StreamError)


@dataclass
class Outcome:
    code: int
    steps_run: int = 0  # optimizer steps this session completed
    loop_s: float = 0.0  # wall seconds of the training loop (bench)
    loop_cpu_s: float = 0.0  # CPU seconds of this process (all threads) during the loop (bench)
    reason: str = ""  # why, for a bad-input exit


def open_session(cfg: RunConfig, *, make_checkpointer: Callable[..., Any] | None = None,
                 process_start: float | None = None) -> tuple[Session, Callable[[], None]]:
    """The process's world, logging, notice handlers and session; and what closes them."""
    world = distributed.init(cfg.collective_timeout_s)
    log = setup_logging(world.rank)
    if not world.is_node_leader:  # rank 0 speaks for the job, leaders for their node; others warn
        logging.getLogger().setLevel(logging.WARNING)
    startup_notice.hold("run")  # a notice here is remembered by start-up's own handlers, and adopted:
    preempt = Preemption(log.getChild("preemption"))
    preempt.install_signal_handlers()
    s = Session(cfg, world, log, preempt, make_checkpointer or _default_checkpointer, process_start or time.time())
    closed: list[bool] = []

    def close() -> None:
        if not closed:
            closed.append(True)
            s.close()
            preempt.close()
            world.close()
    return s, close


def run(cfg: RunConfig, *, make_checkpointer: Callable[..., Any] | None = None,
        process_start: float | None = None) -> Outcome:
    """One session of the job; its exit status (``trainer.cli`` documents them)."""
    s, close = open_session(cfg, make_checkpointer=make_checkpointer, process_start=process_start)
    try:
        if cfg.script is not None:  # the user's own loop (``trainer.run``)
            from trainer.run import own_loop

            code, steps_run, reason = own_loop(s)
            return Outcome(code, steps_run, reason=reason)
        return train(s)
    except BAD_INPUT as e:
        s.failed("bad_input", str(e))
        return Outcome(EXIT_BAD_INPUT, reason=str(e))
    except tier_wait.StillUnknown as e:
        s.failed("tier_unknown", str(e))
        return Outcome(EXIT_UNAVAILABLE)
    except (tier_wait.Stopped, StoppedDuringStartup) as e:
        s.stopped_during_startup(str(e))
        return Outcome(EXIT_PREEMPTED)
    except Exception as e:
        s.failed("exception", f"{type(e).__name__}: {e}", trace=traceback.format_exc())
        return Outcome(EXIT_FAILED)
    finally:
        close()


def train(s: Session) -> Outcome:
    """Build, restore, the step loop, save and stop."""
    cfg, world = s.cfg, s.world
    s.stop_if_noticed("session", "before the run was set up")
    device, mixed, accum = s.hardware()
    s.open(lambda: _sharded_checkpointer(cfg, world))  # the run dir's lock, the checkpointer, the sinks
    s.take_lease()  # nothing writes the job's remote tiers without it
    job = s.build(device, mixed, accum)  # the task, its model under DDP or FSDP, the data, the batches
    start = s.restore(job)  # the newest checkpoint any node holds, else init_from's weights, else step 0
    step_fn = StepFn(cfg, job, mixed, device)
    evaluator = Evaluator(job.task, cfg, step_fn, world, sharded=job.in_place, interrupted=lambda: s.preempt.requested)
    steps = Steps(s, job, start, evaluator=evaluator)  # the promise between two steps: saves, notices, the end
    for _ in steps:
        steps.report(*step_fn())
    code, reason = steps.outcome  # type: ignore[misc]
    return Outcome(code, steps.done - start, steps.loop_s, steps.loop_cpu_s, reason)


def _sharded_checkpointer(cfg: RunConfig, world: distributed.World) -> Any:
    """Every rank's checkpointer of the sharded layout (they make it together: it opens process
    groups of its own)."""
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.sharded import NEEDS_KEY, Sharded

    why = host_copy.unavailable()
    if why is not None:  # every rank has the same PyTorch: every rank refuses, before any collective
        raise host_copy.Unsupported(f"{cfg.source_of('parallelism')}: parallelism: 'fsdp' cannot run here: "
                                    f"{why}; allowed: 'ddp', or an image with a newer PyTorch")
    key = cfg.run_key()
    if key is None:
        raise KeyProblem(NEEDS_KEY)  # before the collective that builds the layout's groups
    return Checkpointer(cfg.tier_table(), Sharded(world, run_dir=cfg.run_dir,
                                                  collective_timeout_s=cfg.collective_timeout_s),
                        key=key, mtbf_s=cfg.mtbf_s, log=logging.getLogger("trainer.checkpoint"))


def _default_checkpointer(cfg: RunConfig) -> Any:
    """A node leader's checkpointer of the whole-model layout (rank 0 saves; every leader's tiers
    are offered at a restore)."""
    from trainer.checkpoint.checkpointer import Checkpointer

    return Checkpointer(cfg.tier_table(), key=cfg.run_key(), mtbf_s=cfg.mtbf_s,
                        log=logging.getLogger("trainer.checkpoint"))
