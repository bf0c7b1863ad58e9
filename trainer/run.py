"""Your own loop, kept: the run API a training script iterates instead of being rewritten into a task.

A script keeps its model, optimizers, data and loop, and adds a handful of lines::

    import trainer.run

    run = trainer.run.start()                    # the run's settings, device, lock and lease
    model = run.wrap(Net().to(run.device))       # under DDP on several ranks
    optimizer = torch.optim.AdamW(model.parameters())
    batches = run.batches(train_set)             # map-style: the trainer's exact order; or a stream
    run.track(model=model, optimizer=optimizer, ema=ema)   # every state, by name; restores them
    for step in run.steps():                     # from the restored step on
        x, y = next(batches)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(); loss.backward(); optimizer.step()
        run.log(loss)

and gets the bundled loop's promise, kept by the same code (``trainer.loop.steps.Steps``): exact
resume from the newest valid checkpoint on any tier, saves at the configured cadence, the notice
heard and the emergency save inside the window between two steps, the health beat, goodput, events,
the writer lease, torchrun on N GPUs and several VMs. ``run.steps()`` ends normally when the run's
steps are done (after the final checkpoint; the code after the loop then runs, e.g. an export);
every other end (a preemption after its emergency save, a pause, a lost lease) leaves the loop
with ``SystemExit`` and the trainer's exit status, so the code after the loop runs only for a
finished run. State the script changes but did not track is refused after the first step (exit
2, ``trainer.loop.undeclared``), before anything is saved.

An experiment names the script (``script = "train.py"`` in ``[trainer]``, ``script_args`` its
command line): the VM runs ``python -m trainer run``, which sets the run up and runs the script as
``__main__`` (``own_loop``); ``start()`` returns that run. A script started by hand
(``python train.py``) gets a run of its own from ``start(config=...)``.
"""
from __future__ import annotations

import atexit
import os
import runpy
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

from trainer import EXIT_FAILED, task as tasks
from trainer.loop.named_state import NamedStates, StateError, unwrap
from trainer.loop.steps import Steps

_current: "Run | None" = None


def start(config: str | Path | None = None, **settings: Any) -> "Run":
    """The run this process trains: the one ``python -m trainer run`` set up for the script, or,
    in a script started by hand, a new one from ``config`` (a trainer TOML; default the file
    ``$SPOTTRAIN_CONFIG`` names) and ``settings`` (``RunConfig`` fields), which exits the process
    with the trainer's status when it ends."""
    global _current
    if _current is not None:
        return _current
    if config is None and os.environ.get("SPOTTRAIN_CONFIG"):
        config = os.environ["SPOTTRAIN_CONFIG"]
    from trainer.cli import _process_start
    from trainer.config import ConfigError, load_run_config
    from trainer.train import open_session

    script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else "script.py"
    try:
        cfg = load_run_config({"script": script, "script_args": sys.argv[1:], **settings},
                              Path(config) if config is not None else None)
    except ConfigError as e:
        for line in e.lines:
            print(line, file=sys.stderr)
        raise SystemExit(2) from None
    s, close = open_session(cfg, process_start=_process_start())
    atexit.register(close)
    _current = prepare(s)
    return _current


def prepare(s: Any) -> "Run":
    """The session set up for an own loop: the device, the run dir's lock, the checkpointer, the
    lease (``trainer.train`` does the same before it builds a task)."""
    from trainer.loop.session import BadWorld

    cfg = s.cfg
    s.stop_if_noticed("session", "before the run was set up")
    device, mixed, accum = s.hardware()
    if cfg.parallelism == "fsdp":
        raise BadWorld("script: parallelism = 'fsdp' is not yet offered to an own loop (the sharded layout binds the "
                       "model it shards); use parallelism = 'ddp', or a task")
    if accum != 1:
        raise BadWorld("script: an own loop accumulates gradients itself: leave grad_accum_steps and "
                       "global_batch_size unset")
    s.open(lambda: None)
    s.take_lease()
    return Run(s, device, mixed)


class Run:
    """One session of a job whose script keeps its own loop; see the module docstring."""

    def __init__(self, s: Any, device: torch.device, mixed: Any):
        self._s, self.device, self._mixed = s, device, mixed
        cfg, world = s.cfg, s.world
        self.cfg = cfg
        self.rank, self.world_size, self.local_rank = world.rank, world.size, world.local_rank
        self.is_main = world.is_main
        self.seed, self.total_steps = cfg.seed, cfg.steps
        self.artifacts_dir: Path = cfg.run_dir / "artifacts"
        self.data_dir: Path | None = cfg.data_dir
        self.data_url: str | None = cfg.data_url
        self.start_step = 0
        self._data: Any = None
        self._batches: Any = None
        self._batch_size = cfg.batch_size
        self._dataset_len: int | None = None
        self._job: Any = None
        self.outcome: Steps | None = None
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank and in every restart

    # ------------------------------------------------------------------ before the steps
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` as it must train on this world: under DDP on several ranks, as it is on one."""
        from trainer.loop import parallel

        return parallel.wrap(model, self._s.world, parallelism="ddp", device=self.device, optimizer=None)

    def autocast(self) -> Any:
        """The run's precision (``precision`` in the experiment) as an autocast context."""
        return self._mixed.autocast()

    def batches(self, dataset: Any, *, batch_size: int | None = None) -> Iterator[tuple]:
        """This rank's micro-batches of ``dataset`` (``batch_size``, default the run's), on the device,
        without end (epoch after epoch); their position is part of every checkpoint. Map-style: the
        trainer's order (exact, and a resume may change the world size); an ``IterableDataset``:
        its own order, its position kept per rank (``trainer.data.streaming``). Before ``track``."""
        from trainer.data.batches import Batches
        from trainer.data.sampler import DataOrder
        from trainer.data.streaming import Stream

        if self._job is not None:
            raise StateError("run.batches() after run.track(): the data position must be known before the restore")
        cfg, world = self.cfg, self._s.world
        size = batch_size or cfg.batch_size
        if tasks.streaming(dataset):
            self._data = self._batches = Stream(dataset, batch_size=size, workers=cfg.data_workers, device=self.device,
                                                seed=cfg.seed, log=self._s.log.getChild("data"))
        else:
            if isinstance(dataset, torch.utils.data.DataLoader) or not hasattr(dataset, "__len__"):
                raise StateError(f"run.batches(): a {type(dataset).__name__} is neither a map-style dataset (len, "
                                 "[i]) nor an IterableDataset; pass the dataset, not a DataLoader")
            self._dataset_len = len(dataset)
            self._data = DataOrder(len(dataset), seed=cfg.seed, batch_size=size, rank=world.rank, world_size=world.size)
            self._batches = Batches(dataset, self._data, workers=cfg.data_workers, device=self.device, seed=cfg.seed,
                                    log=self._s.log.getChild("data"), on_died=self._s._workers_died)
        self._s.batches = self._batches
        self._batch_size = size
        return _Each(self._batches)

    def track(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None,
              **states: Any) -> int:
        """Declare every state the job's result depends on, by name, and restore them from the
        newest valid checkpoint (or keep them as built: a new run). ``model`` and ``optimizer`` are
        the main ones (the model is what ``export`` writes as the model, and ``status`` digests);
        ``scheduler`` is stepped by your loop; ``states`` are any more: a second model and
        optimizer, an EMA, a GradScaler, a StatefulDataLoader, a custom object. Pass models as your
        loop calls them (under ``run.wrap`` on several ranks). Returns the step to continue from."""
        from trainer.loop.session import BadWorld

        s, world = self._s, self._s.world
        if self._job is not None:
            raise StateError("run.track() was called twice: declare every state in one call")
        where = f"script {self.cfg.script}"
        task = tasks.Task(model=unwrap(model), optimizer=optimizer, dataset=[], scheduler=scheduler)
        named = NamedStates.declare(states, where=where, optimizers=[optimizer])
        named.check(where)
        optimized = {id(p) for opt in [optimizer, *named.optimizers().values()] for g in opt.param_groups
                     for p in g["params"]}
        trained = {"model": model, **named.trained_models(optimized)}
        if world.distributed:
            bare = [n for n, m in trained.items() if not isinstance(m, torch.nn.parallel.DistributedDataParallel)]
            if bare:
                raise BadWorld(f"{where}: on {world.size} ranks {', '.join(bare)} must train under DDP, or the ranks' "
                               "weights drift apart: model = run.wrap(model) before the optimizer and run.track")
        job = s.adopt(task, named, self._data, self._batches, device=self.device, mixed=self._mixed, accum=1,
                      dataset_len=self._dataset_len, where=where, wrapped=trained)
        job.fingerprint["batch_size"] = self._batch_size
        s.log_start(job, self.device, f"script={self.cfg.script}")
        self._job = job
        self.start_step = s.restore(job)
        return self.start_step

    # ------------------------------------------------------------------ the steps
    def steps(self) -> Iterator[int]:
        """Each step still to train, from the restored one on; see the module docstring."""
        if self._job is None:
            raise StateError("run.steps() before run.track(): declare the model, the optimizer and every other state "
                             "first (the restore puts them back)")
        if self.outcome is not None:
            raise StateError("run.steps() was iterated twice: a session has one run of steps")
        self.outcome = Steps(self._s, self._job, self.start_step)
        yield from self.outcome
        code, reason = self.outcome.outcome or (EXIT_FAILED, "")
        if code != 0:
            if reason:
                print(reason, file=sys.stderr)
            raise SystemExit(code)

    def log(self, loss: Any, **metrics: Any) -> None:
        """This step's loss (a number or a one-element tensor) and your own metrics, for the step's
        log line and TensorBoard (the last call of a step counts)."""
        if self.outcome is None:
            raise StateError("run.log() outside run.steps()")
        bad = [k for k in metrics if k in tasks.RESERVED_METRICS]
        if bad:
            raise StateError(f"run.log(): metric names {', '.join(bad)} are the trainer's own")
        self.outcome.report(loss, metrics)


class _Each:
    """``next(batches)``: the next micro-batch of ``Batches`` or ``Stream``."""

    def __init__(self, source: Any):
        self._source = source

    def __iter__(self) -> "_Each":
        return self

    def __next__(self) -> tuple:
        return self._source.next()


def own_loop(s: Any) -> tuple[int, int, str]:
    """Run the experiment's script as ``__main__`` in this session (``python -m trainer run`` with
    ``script``): (exit status, steps trained, reason). Its ``sys.argv`` is the script and
    ``script_args``; its directory comes first on ``sys.path``, as ``python SCRIPT`` has it."""
    global _current
    from trainer.loop.session import BadWorld

    cfg = s.cfg
    path = Path(cfg.script)
    if not path.is_file():
        raise BadWorld(f"script: {cfg.script}: no such file (relative to {Path.cwd()})")
    _current = run = prepare(s)
    argv, syspath = sys.argv, list(sys.path)
    sys.argv = [str(path), *cfg.script_args]
    sys.path.insert(0, str(path.resolve().parent))
    code: int | None = None
    try:
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_FAILED)
    finally:
        sys.argv, sys.path[:] = argv, syspath
        _current = None
    steps = run.outcome
    if steps is None:
        raise tasks.TaskError(f"script: {cfg.script} ended without iterating run.steps() (code {code}): nothing was "
                              "trained; see docs/bring-your-own-model.md")
    done = steps.done - run.start_step
    if steps.outcome is None:
        if code not in (None, 0):
            return code, done, ""
        raise tasks.TaskError(f"script: {cfg.script} left run.steps() at step {steps.done} of {cfg.steps}: the steps "
                              "after the last checkpoint are not saved; end a run early with stop_at_step")
    out, reason = steps.outcome
    return (out if code in (None, 0, out) else code), done, reason

