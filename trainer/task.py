"""The user task protocol and ``module:callable`` loading.

A task is a callable ``build(ctx: TaskContext, **task_args) -> Task``. It builds the model, the
optimizer, an optional LR scheduler and a dataset (map-style, or an iterable that streams), and
may name more state (``states``: a GAN's second model and optimizer, an EMA) and its own step
(``step``); the trainer owns everything else: the loop, the data order, mixed precision, gradient
accumulation, clipping, DDP, checkpoints. A script that keeps its own loop uses ``trainer.run``.

The trainer seeds Python and torch from ``ctx.seed`` before calling the task, so a model built
with ordinary ``torch.nn`` init is the same on every rank and in every restart.

``ctx.steps`` is the job's total; after ``extend_steps`` it is the new total, and a schedule built
on it runs on over the new total (docs/runs.md). ``ctx.artifacts_dir`` is the run's directory for
files that are not checkpoints (samples, a best-validation copy, tokenizer files): rank 0's is
copied to ``<gcs_uri>/artifacts/`` after every checkpoint save, at the end and, time allowing,
after an emergency save, and comes back to a fresh disk before the task is built. Write files
there with ``trainer.artifacts.atomic(path)`` (or to ``.tmp-NAME`` and rename) so they appear
complete or not at all; see ``trainer.artifacts`` and docs/runs.md.
"""
from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, Sized, cast

import torch


@dataclass(frozen=True)
class TaskContext:
    """What the trainer tells the task about the run."""

    seed: int
    steps: int  # total optimizer steps of the job, for LR schedules (the new total after extend_steps)
    device: torch.device
    rank: int
    world_size: int
    #: The run's artifacts directory (``RUN_DIR/artifacts``): files a task keeps besides the
    #: checkpoints (samples, a best-validation copy, tokenizer files), copied to
    #: ``<gcs_uri>/artifacts/`` and back to a fresh disk; see ``trainer.artifacts``.
    artifacts_dir: Path | None = None
    data_dir: Path | None = None  # the staged dataset (`[data]` in the experiment), None without one
    #: The dataset streamed from the bucket (``[data]`` with ``stream = true``; ``--data-url``), a
    #: ``gs://`` URL, e.g. of webdataset shards (``trainer.data.bucket_shards``); None without one.
    data_url: str | None = None


class Dataset(Protocol):
    """Map-style: ``len(ds)`` samples; ``ds[i]`` is a tensor or a tuple of tensors.

    Must be a pure function of ``i``: the trainer chooses the order and needs to replay it.
    """

    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> Any: ...


@dataclass
class Task:
    """What a task callable returns.

    ``model(*batch)`` must return the scalar loss, where ``batch`` is the collated micro-batch
    (a tuple of tensors on the device), unless ``loss_fn(model, batch)`` is given. ``loss_fn`` may
    return the loss, or ``(loss, {name: value})``: the task's own per-step metrics (accuracy, a
    perplexity, a gradient-free statistic), each a number or a one-element tensor. The trainer
    averages them over the gradient-accumulation micro-batches and the logging interval like the
    loss, and shows them in the ``event=step`` line and in TensorBoard as ``train/NAME`` (and over
    the eval set as ``eval/NAME``). They change nothing in training: exact resume holds with them.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    #: Map-style (``Dataset``: the trainer chooses the order, exact and elastic), or a
    #: ``torch.utils.data.IterableDataset`` that streams (its position kept per rank).
    dataset: Sequence[Any] | Dataset | torch.utils.data.IterableDataset
    scheduler: Any | None = None  # torch.optim.lr_scheduler.LRScheduler (stepped once per step)
    loss_fn: Callable[[torch.nn.Module, tuple], Any] | None = None
    tokens_per_sample: int = 0  # for the tokens/s figure in the logs; 0 reports samples/s
    info: dict[str, Any] = field(default_factory=dict)  # free-form, logged once at start-up
    #: Optional held-out set, map-style like ``dataset``; evaluated with the same loss every
    #: ``eval_every_steps`` (see ``trainer.loop.evaluation``).
    eval_dataset: Sequence[Any] | Dataset | None = None
    #: Or a callable ``evaluate(model) -> loss`` (a float, or a dict of named floats) run on every
    #: rank in its place; the trainer restores every RNG and module mode it could touch.
    evaluate: Callable[[torch.nn.Module], Any] | None = None
    #: Every other object the job's result depends on, by name: a second model and its optimizer
    #: (a GAN's discriminator), an EMA or ``AveragedModel``, more schedulers, a custom object with
    #: ``state_dict()``/``load_state_dict()``. Saved, restored and fingerprinted with the rest
    #: (``trainer.loop.named_state``); models among them are exported by name; a model with
    #: parameters in a declared optimizer trains under DDP like ``model``; under ``parallelism =
    #: "fsdp"`` every model among them is sharded like ``model`` (docs/porting.md).
    states: dict[str, Any] = field(default_factory=dict)
    #: Your own step: ``step(s, batch)`` runs in place of ``loss_fn`` for each micro-batch, with
    #: ``s`` a ``trainer.loop.step.OwnStep`` (the models as trained, the optimizers by name,
    #: ``s.autocast()``, ``s.backward(loss)``, ``s.step(optimizer)``); it returns what ``loss_fn``
    #: would (the loss to log, or ``(loss, {name: value})``). See docs/bring-your-own-model.md.
    step: Callable[[Any, tuple], Any] | None = None


class TaskError(Exception):
    """The task could not be loaded or returned something unusable (a user error: exit 2)."""


#: A metric's name: what a log line's ``key=value`` and a TensorBoard tag can carry.
_METRIC_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]{0,63}$")
#: Names the trainer's own figures use (``trainer.observe.progress.WINDOW_FIGURES``).
RESERVED_METRICS = ("loss", "lr", "steps_per_s", "tokens_per_s", "samples_per_s", "eta_s")


def loss_and_metrics(out: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """What ``loss_fn`` returned as (loss, metrics); ``TaskError`` for anything else."""
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], dict):
            raise TaskError("task: loss_fn must return the loss or (loss, {name: value}), "
                            f"got a tuple of {len(out)} ({', '.join(type(x).__name__ for x in out)})")
        loss, metrics = out
        for name, value in metrics.items():
            if not (isinstance(name, str) and _METRIC_NAME.match(name)) or name in RESERVED_METRICS:
                raise TaskError(f"task: loss_fn's metric name {name!r} is not allowed: letters, digits, _ . / - "
                                f"(64 at most, not starting with a digit), and none of {', '.join(RESERVED_METRICS)}")
            if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                    or torch.is_tensor(value) and value.numel() == 1):
                raise TaskError(f"task: loss_fn's metric {name!r} must be a number or a one-element tensor, "
                                f"got {type(value).__name__}")
        return loss, metrics
    return out, {}


def streaming(dataset: Any) -> bool:
    """An iterable dataset (webdataset shards, a Hugging Face streaming dataset): read in order, its
    position kept by torchdata's ``StatefulDataLoader`` (``trainer.data.streaming``)."""
    return isinstance(dataset, torch.utils.data.IterableDataset)


def _check_fields(spec: str, task: Task) -> None:
    """A wrong type in a field is a refusal naming it, before any step (not a traceback later)."""
    def wrong(name: str, want: str, got: Any) -> TaskError:
        return TaskError(f"task: {spec} returned Task.{name} = {type(got).__name__}, expected {want}")

    if not isinstance(task.model, torch.nn.Module):
        raise wrong("model", "a torch.nn.Module", task.model)
    if not isinstance(task.optimizer, torch.optim.Optimizer):
        hint = " (more optimizers: name them in Task.states, and step them in Task.step)" if isinstance(
            task.optimizer, (list, tuple, dict)) else ""
        raise TaskError(f"task: {spec} returned Task.optimizer = {type(task.optimizer).__name__}, expected one "
                        f"torch.optim.Optimizer{hint}")
    if task.scheduler is not None and not (callable(getattr(task.scheduler, "step", None))
                                           and callable(getattr(task.scheduler, "state_dict", None))):
        raise wrong("scheduler", "an LR scheduler (step(), state_dict()) or None", task.scheduler)
    for name in ("loss_fn", "step", "evaluate"):
        if getattr(task, name) is not None and not callable(getattr(task, name)):
            raise wrong(name, "a callable or None", getattr(task, name))
    if not isinstance(task.states, dict):
        raise wrong("states", "a dict of name: object with state_dict()/load_state_dict()", task.states)
    data = task.dataset
    if isinstance(data, torch.utils.data.DataLoader) or (hasattr(data, "__next__") and not streaming(data)):
        raise wrong("dataset", "the dataset itself (map-style, or an IterableDataset), not a DataLoader or an "
                    "iterator: the trainer loads batches and keeps their position", data)
    if not streaming(data) and not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise wrong("dataset", "a map-style dataset (len, [i]) or a torch IterableDataset", data)


def load(spec: str) -> Callable[..., Task]:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskError(f"task: cannot import module {module_name!r}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TaskError(f"task: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TaskError(f"task: {spec} is not callable")
    return obj


def build(spec: str, ctx: TaskContext, args: dict[str, Any]) -> Task:
    fn = load(spec)
    try:
        inspect.signature(fn).bind(ctx, **args)
    except TypeError as e:
        raise TaskError(f"task_args: {spec} does not take these arguments: {e}") from None
    except ValueError:  # no signature to inspect (a builtin): let the call decide
        pass
    task = fn(ctx, **args)
    if not isinstance(task, Task):
        raise TaskError(f"task: {spec} returned {type(task).__name__}, expected trainer.task.Task")
    _check_fields(spec, task)
    if task.loss_fn is not None and task.step is not None:
        raise TaskError(f"task: {spec} returned both loss_fn and step: step replaces loss_fn, give one")
    if not streaming(task.dataset) and len(cast(Sized, task.dataset)) == 0:
        raise TaskError(f"task: {spec} returned an empty dataset")
    if task.eval_dataset is not None and len(task.eval_dataset) == 0:
        raise TaskError(f"task: {spec} returned an empty eval_dataset")
    return task
