"""The training loop: build the task, restore, train, checkpoint, stop cleanly on preemption.

Read ``train()`` top to bottom: build, restore, the step loop, save and stop. The machinery sits
behind small interfaces: ``Session`` (``trainer.loop.session``: the start-up rule, the machinery one
process per VM runs, building the task, putting a checkpoint back), ``Writers`` (one trainer per
run dir and per job: ``trainer.loop.writers``), ``restore.newest`` (the checkpoint every rank
continues from: ``trainer.loop.restore``), ``Finish`` (the saves and the ways a session ends, with
the durability retries: ``trainer.loop.finish``), ``Checkpointer`` (tiers, layouts, asynchronous
saves: ``trainer.checkpoint``), ``StepFn`` (one optimizer step: ``trainer.loop.step``) and the
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
from trainer.observe.health import PortInUse
from trainer.observe.progress import setup_logging
from trainer.observe.sinks import SinkUnavailable

#: What exits 2: bad input, a resume with other settings, another trainer on the run dir or the job.
BAD_INPUT = (state.ResumeMismatch, tasks.TaskError, BadWorld, UnsupportedGpu, PortInUse, InitFromError, RunDirBusy,
             LeaseHeld, KeyProblem, state_codec.NotPlainData, precision.UnsupportedPrecision, host_copy.Unsupported,
             SinkUnavailable)


@dataclass
class Outcome:
    code: int
    steps_run: int = 0  # optimizer steps this session completed
    loop_s: float = 0.0  # wall seconds of the training loop (bench)
    loop_cpu_s: float = 0.0  # CPU seconds of this process (all threads) during the loop (bench)
    reason: str = ""  # why, for a bad-input exit


def run(cfg: RunConfig, *, make_checkpointer: Callable[..., Any] | None = None,
        process_start: float | None = None) -> Outcome:
    """One session of the job; its exit status (``trainer.cli`` documents them)."""
    world = distributed.init(cfg.collective_timeout_s)
    log = setup_logging(world.rank)
    if not world.is_node_leader:  # rank 0 speaks for the job, leaders for their node; others warn
        logging.getLogger().setLevel(logging.WARNING)
    startup_notice.hold("run")  # a notice here is remembered by start-up's own handlers, and adopted:
    preempt = Preemption(log.getChild("preemption"))
    preempt.install_signal_handlers()
    s = Session(cfg, world, log, preempt, make_checkpointer or _default_checkpointer, process_start or time.time())
    try:
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
        s.close()
        preempt.close()
        world.close()


def train(s: Session) -> Outcome:
    """Build, restore, the step loop, save and stop."""
    cfg, world = s.cfg, s.world
    s.stop_if_noticed("session", "before the run was set up")
    device, mixed, accum = s.hardware()
    s.open(lambda: _sharded_checkpointer(cfg, world))  # the run dir's lock, the checkpointer, the sinks
    s.take_lease()  # nothing writes the job's remote tiers without it
    job = s.build(device, mixed, accum)  # the task, its model under DDP or FSDP, the data, the batches
    start = s.restore(job)  # the newest checkpoint any node holds, else init_from's weights, else step 0
    if start >= cfg.steps:  # finished before: the final checkpoint where a copy is missing
        return Outcome(s.finish.final(start, again=True))
    if s.noticed_before_training(start):
        return Outcome(EXIT_PREEMPTED)
    if cfg.stop_at_step is not None and start >= cfg.stop_at_step:
        if world.is_main:
            s.log.warning("event=stop_at_step stop_at_step=%d step=%d (already there: pausing at once)",
                          cfg.stop_at_step, start)
        return Outcome(s.finish.pause(start))
    cap = s.spend_cap(check=True) if cfg.max_usd is not None else None
    if cap is not None:
        return Outcome(s.finish.pause(start, cap=cap))

    step_fn = StepFn(cfg, job, mixed, device)
    evaluator = Evaluator(job.task, cfg, step_fn, world, sharded=job.in_place, interrupted=lambda: s.preempt.requested)
    t_loop, cpu_loop = time.monotonic(), time.process_time()
    done, stop, lost, capped, starved = start, False, False, False, False
    for step in range(start, cfg.steps):
        t0 = time.monotonic()
        loss, metrics = step_fn()
        s.productive_s += time.monotonic() - t0
        done = step + 1
        s.completed(done, loss, job.lr, metrics)
        stop, due, lost, capped, starved = world.any_flags(s.preempt.requested, world.is_main and s.ckpt.due(done),
                                                           s.writers.lost, s.capped is not None,
                                                           job.batches.failure is not None)
        if not (stop or lost) and evaluator.due(done):
            s.evaluated(done, evaluator())
        if stop or lost or capped or starved or done == cfg.steps or done == cfg.stop_at_step:
            break
        if due:
            s.finish.save(done)
        s.progress(done)
    loop_s, loop_cpu_s = time.monotonic() - t_loop, time.process_time() - cpu_loop
    s.loop_over()

    if done < cfg.steps and stop:
        code, reason = s.finish.emergency(done), ""
    elif lost:
        code, reason = EXIT_BAD_INPUT, s.finish.lost_lease(done)
    elif capped and done < cfg.steps:
        code, reason = s.finish.pause(done, cap=s.spend_cap()), ""
    elif starved and done < cfg.steps and done != cfg.stop_at_step:  # data workers that kept dying
        why = job.batches.failure or "the data workers of another rank kept dying"
        code, reason = s.finish.workers_failed(done, why), ""
    elif done < cfg.steps:
        code, reason = s.finish.pause(done), ""
    else:
        code, reason = s.finish.final(done, noticed=stop), ""
    return Outcome(code, done - start, loop_s, loop_cpu_s, reason)


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
