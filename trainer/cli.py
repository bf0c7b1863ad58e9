"""Command line: ``python -m trainer run|status|export|stage|logs|rendezvous|rendezvous-id ...`` (a stable contract).

``logs`` shows a run's sessions across VMs and how each ended, from Cloud Logging or a local file
(trainer.cloud.logs).

``export`` writes a run's trained weights as a plain state dict in safetensors (trainer.export).

``stage`` copies a ``gs://`` prefix onto a local disk before training, verified and resumable
(``trainer.data.staging``; its exit codes: 0 staged, 1 failed, run it again to resume, 2 bad input).

``rendezvous`` hosts the c10d rendezvous store of a multi-node job on a coordinator that does not
train (when it trains, its torchrun agent hosts the store itself). ``rendezvous-id`` prints the id
the nodes of such a job join (``<name>-<epoch>``, trainer.rendezvous): exit 1 when the store does
not answer.

Exit codes of ``run``:

- 0: finished: the final checkpoint is durable on every durable tier (the run dir and, when set,
  GCS; read back after writing). Also a re-run of a finished job, once it has written any copy
  that was missing. A VM may record the run as finished and stop paying.
- 75: stopped by a preemption notice (or paused by ``--stop-at-step``) after the checkpoint was
  saved on a tier that outlives the VM (the run dir or GCS; the local SSD alone does not count):
  run the same command again to resume.
- 74: trained to the end (or to the pause) but its checkpoint could not be made durable on every
  durable tier within ``durable_timeout_s`` (GCS down or refusing, a full or read-only run dir):
  not finished. Run the same command again: it writes the missing copies, then exits 0 (or 75).
  A VM keeps its disk (it may hold the only copy) and its unit restarts the trainer.
- 77: paused at the spend cap: what the job has cost so far reached ``max_usd`` and its
  checkpoint is durable on every durable tier (``event=paused reason=max_usd``). Run again with a
  higher ``max_usd`` to continue; a VM stops paying (its group goes to zero).
- 69: a checkpoint tier stayed unreadable for ``wait_for_tiers_s``, or a verified checkpoint's load
  kept failing on I/O, memory or a peer (nothing trained; run again: docs/resume.md).
- 2: bad input or a resume with other settings, or another trainer holds the run dir or the job's
  GCS lease (restarting cannot fix it).
- 1: failed (also: a notice whose emergency save reached no tier that outlives the VM). Also data
  workers that kept dying, once the step reached is durable on every tier (``event=failed
  reason=data_workers``): run again, it resumes from that step with new workers.

With ``SPOTTRAIN_BAD_INPUT_FILE`` set (the VM's trainer.sh sets it), an exit 2 of ``run`` also
writes its reason there, for the VM's state output (health answer, guest attributes, stop marker);
under torchrun, whose own exit status hides the workers', the file is what tells bad input apart.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from typing import NoReturn

from trainer import EXIT_BAD_INPUT, EXIT_PREEMPTED, collector, retry, startup_notice
from trainer.config import ConfigError, RunConfig, load_export_config, load_run_config, load_status_config


class _UsageError(SystemExit):
    """argparse refused the command line (exit 2); `main` logs it as a failure of a `run`."""

    def __init__(self, line: str) -> None:
        super().__init__(EXIT_BAD_INPUT)
        self.line = line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's own errors: same format and exit code as ours
        self.print_usage(sys.stderr)
        print(f"command line: {message}", file=sys.stderr)
        record_bad_input([f"command line: {message}"])
        raise _UsageError(f"command line: {message}")


def log_bad_input(lines: list[str]) -> None:
    """Log a refused input as the trainer's structured failure (``event=failed reason=bad_input``),
    the line the stack's `failures` metric and its "run stopped" alert count (stacks.run_metrics):
    without it a VM whose trainer refuses its command line stops itself and no alert says why."""
    from trainer.observe.progress import setup_logging  # light: no torch

    setup_logging(int(os.environ.get("RANK", "0"))).error("event=failed reason=bad_input %s", "; ".join(lines))


def record_bad_input(lines: list[str]) -> None:
    """Write why the run refused its input to ``$SPOTTRAIN_BAD_INPUT_FILE`` (best effort)."""
    path = os.environ.get("SPOTTRAIN_BAD_INPUT_FILE")
    if not path:
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write("\n".join(lines)[:4000] + "\n")
        os.replace(tmp, path)
    except OSError:
        pass


def _stopped_before_loading(reason: str) -> int:
    """A notice before the trainer loaded: nothing trained or written yet, nothing to save."""
    from trainer.observe.progress import setup_logging  # light: no torch

    setup_logging(int(os.environ.get("RANK", "0"))).warning(
        "event=preempted step=none detail=notice during start-up (%s before the trainer loaded torch); "
        "nothing was trained, nothing to save", reason)
    return EXIT_PREEMPTED


def _process_start() -> float:
    """Wall time this process started (interpreter start-up counts as start-up badput)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        import os

        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m trainer", description="Preemption-proof PyTorch trainer.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    r = sub.add_parser("run", help="train (or resume; a finished run checks its final checkpoint's copies, exit 0)")
    r.add_argument("--run-dir", type=Path, help="persistent checkpoint tier (PD-SSD on a VM); holds the ledger")
    r.add_argument("--steps", type=int, help="total optimizer steps of the job")
    r.add_argument("--seed", type=int, help="seed of init, dropout and data order (default 0)")
    r.add_argument("--gcs-uri", help="durable tier gs://BUCKET/PREFIX")
    r.add_argument("--task", help="module:callable returning a trainer.task.Task (default trainer.tasks.gpt:build)")
    r.add_argument("--script", help="your own training script, run in place of a task (it iterates trainer.run's "
                                    "steps: docs/bring-your-own-model.md)")
    r.add_argument("--script-arg", dest="script_args", action="append", metavar="ARG",
                   help="one argument of the script's command line (repeat it; default: script_args in the config)")
    r.add_argument("--checkpoint-every-steps", type=int, help="save every K steps")
    r.add_argument("--checkpoint-every-seconds", type=float, help="save every T seconds")
    r.add_argument("--local-dir", type=Path, help="optional fast tier (local SSD)")
    r.add_argument("--data-dir", type=Path, help="the staged dataset, handed to the task as ctx.data_dir")
    r.add_argument("--data-url", help="the dataset streamed from the bucket (gs://...), handed to the task as "
                                      "ctx.data_url")
    r.add_argument("--health-port", type=int, help="TCP health port (default 8471; 0 = any free port)")
    r.add_argument("--price-per-hour", type=float,
                   help="USD per hour of this VM as provisioned, for the cost in `status` (may change on resume)")
    r.add_argument("--on-demand-price-per-hour", type=float,
                   help="USD per hour of the same VM on demand, for the comparison in `status`")
    r.add_argument("--parallelism", choices=("ddp", "fsdp"),
                   help="ddp: whole model per rank (default); fsdp: sharded, saved per rank")
    r.add_argument("--global-batch-size", type=int,
                   help="samples per optimizer step over all ranks, constant across world sizes")
    r.add_argument("--stop-at-step", type=int, help="pause after this step: save, exit 75 once durable")
    r.add_argument("--startup-grace-s", type=float,
                   help="health answers 'ok starting' this long after start, then 'starting' until the first step "
                        "(default 900; the stack: group.initial_delay_sec)")
    r.add_argument("--preemption-budget-s", type=float,
                   help="seconds from a preemption notice by which the emergency save must be durable "
                        "(default 20, a Spot VM's; the stack: the VM's shutdown window)")
    r.add_argument("--durable-timeout-s", type=float,
                   help="how long the final save keeps trying to be durable on every tier before exit 74 "
                        "(default 600)")
    r.add_argument("--data-workers", type=int, help="worker processes loading batches ahead (default 0: inline)")
    r.add_argument("--eval-every-steps", type=int, help="evaluate the task's eval set every K steps")
    r.add_argument("--extend-steps", action="store_const", const=True,
                   help="resume a run whose checkpoint has another --steps total (raise it: extend the run)")
    r.add_argument("--allow-rollback", action="store_const", const=True,
                   help="resume although the run's ledger records a newer checkpoint in the bucket than any "
                        "tier holds (you deleted them, to go back)")
    r.add_argument("--init-from", metavar="SOURCE",
                   help="start this new run from another run's checkpoint (its run dir or gs:// prefix)")
    r.add_argument("--init-from-step", type=int, help="the step of --init-from to start from (default: newest)")
    r.add_argument("--init-from-optimizer", action="store_const", const=True,
                   help="with --init-from: also take its optimizer state (default: weights only)")
    r.add_argument("--checkpoint-key-file", type=Path,
                   help="the run's checkpoint key (default: $SPOTTRAIN_CHECKPOINT_KEY_FILE, else "
                        "~/.config/spottrain/checkpoint.key, created on first use)")
    r.add_argument("--config", type=Path, help="TOML file with any setting; flags override it")

    s = sub.add_parser("status", help="checkpoints on each tier, the newest valid one, goodput")
    s.add_argument("--run-dir", type=Path, help="persistent tier to inspect (read only); optional with --gcs-uri")
    s.add_argument("--gcs-uri", help="durable tier to inspect, gs://BUCKET/PREFIX (and the ledger mirror)")
    s.add_argument("--local-dir", type=Path, help="fast tier to inspect")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--plot", type=Path, metavar="FILE.png",
                   help="also draw the job's timeline from the goodput ledger (needs matplotlib)")
    s.add_argument("--checkpoint-key-file", type=Path, help="the run's checkpoint key (as for run)")
    s.add_argument("--watch", type=float, nargs="?", const=30.0, metavar="SECONDS",
                   help="print the report again every SECONDS (default 30) until interrupted (Ctrl-C)")
    s.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N reports")

    e = sub.add_parser("export", help="write a run's weights as a plain state dict in safetensors (+ JSON sidecar)")
    e.add_argument("--run-dir", type=Path, help="the run's run dir")
    e.add_argument("--gcs-uri", help="the run's gs://BUCKET/PREFIX")
    e.add_argument("--local-dir", type=Path, help="the run's local tier, if any")
    e.add_argument("--step", type=int, help="the checkpoint to export (default: the newest valid one)")
    e.add_argument("--checkpoint-key-file", type=Path, help="the run's checkpoint key (as for run)")
    e.add_argument("--out", type=Path, required=True, help="FILE.safetensors to write (sidecar: FILE.json)")
    g = sub.add_parser("stage", help="copy gs://BUCKET/PREFIX into a directory, verified and resumable")
    g.add_argument("--from", dest="source", required=True, help="gs://BUCKET/PREFIX to stage")
    g.add_argument("--to", dest="dest", type=Path, required=True, help="local directory (created if missing)")
    g.add_argument("--parallel", type=int, default=16, help="downloads at once (default 16)")
    g.add_argument("--rehash", action="store_true",
                   help="recompute the CRC32C of every file already staged instead of trusting size and mtime")
    g.add_argument("--run-dir", type=Path, help="the run's persistent dir: its goodput ledger gets a staging event")
    g.add_argument("--health-port", type=int, help="answer the health check on this TCP port while staging")
    g.add_argument("--stall-timeout-s", type=float, default=600.0,
                   help="health answers 'stalled' after this long without a byte (default 600)")
    g.add_argument("--forbidden-retry-s", type=float, default=retry.IAM_GRANT.grace_s,
                   help="keep retrying HTTP 403 this long: a new bucket grant takes minutes "
                        f"(default {retry.IAM_GRANT.grace_s:g})")

    from trainer.cloud.logs import add_arguments as logs_arguments  # standard library only

    lg = sub.add_parser("logs", help="a run's sessions across VMs and how each ended, from Cloud Logging or a file")
    logs_arguments(lg)

    z = sub.add_parser("rendezvous", help="host a multi-node job's c10d rendezvous store until SIGTERM")
    z.add_argument("--port", type=int, default=29400, help="TCP port (default 29400)")
    z.add_argument("--host", default="0.0.0.0", help="address to listen on (default all)")

    zi = sub.add_parser("rendezvous-id",
                        help="print the id of a multi-node job's open rendezvous (NAME-EPOCH) from its store")
    zi.add_argument("--endpoint", required=True, help="the store's HOST:PORT (torchrun's --rdzv-endpoint)")
    zi.add_argument("--name", required=True, help="the job's name (the experiment)")
    zi.add_argument("--timeout-s", type=float, default=60.0,
                    help="give up (exit 1) when the store does not answer within this long (default 60, "
                         "as torchrun's own read_timeout)")
    return p


def _check_rendezvous_id_args(args: argparse.Namespace) -> None:
    errors = []
    host, sep, port = args.endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        errors.append(f"command line: endpoint: must be HOST:PORT with a port 1..65535, got {args.endpoint!r}")
    # torchrun's --rdzv-id and a store key: letters, digits and . _ - only.
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", args.name):
        errors.append(f"command line: name: must be 1-100 letters, digits, '.', '_' or '-', got {args.name!r}")
    if not 0 < args.timeout_s <= 3600:
        errors.append(f"command line: timeout_s: must be > 0 and at most 3600, got {args.timeout_s:g}")
    if errors:
        raise ConfigError(errors)


def run_config(args: argparse.Namespace) -> RunConfig:
    """`run`'s settings: its config file, then every flag that was given (flags win)."""
    flags = {a.dest for a in _run_parser()._actions if a.dest not in ("help", "config")}
    return load_run_config({k: getattr(args, k) for k in sorted(flags)}, args.config)


def _run_parser() -> argparse.ArgumentParser:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def main(argv: list[str] | None = None) -> int:
    started = _process_start()
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parser().parse_args(argv)
    except _UsageError as e:
        if argv[:1] == ["run"]:
            log_bad_input([e.line])
        raise
    try:
        if args.command == "run":
            cfg = run_config(args)
        elif args.command == "export":
            ecfg = load_export_config({k: getattr(args, k) for k in ("run_dir", "gcs_uri", "local_dir", "step", "out",
                                                                     "checkpoint_key_file")})
        elif args.command == "stage":
            if args.health_port is not None and not 0 <= args.health_port <= 65535:
                raise ConfigError([f"command line: health_port: must be 0..65535, got {args.health_port}"])
        elif args.command == "logs":
            pass  # trainer.cloud.logs checks its own arguments
        elif args.command == "rendezvous":
            if not 1 <= args.port <= 65535:
                raise ConfigError([f"command line: port: must be 1..65535, got {args.port}"])
        elif args.command == "rendezvous-id":
            _check_rendezvous_id_args(args)
        else:
            if args.count is not None and args.watch is None:
                raise ConfigError(["command line: count: --count bounds --watch; give --watch too"])
            scfg = load_status_config({"run_dir": args.run_dir, "gcs_uri": args.gcs_uri,
                                       "local_dir": args.local_dir, "json_output": args.json,
                                       "plot": args.plot, "checkpoint_key_file": args.checkpoint_key_file,
                                       "watch_s": args.watch, "count": args.count})
    except ConfigError as e:
        for line in e.lines:
            print(line, file=sys.stderr)
        if args.command == "run":
            record_bad_input(e.lines)
            log_bad_input(e.lines)
        return EXIT_BAD_INPUT

    if args.command == "run":
        startup_notice.hold("imports")
        notice = startup_notice.pending()
        if notice is not None:  # a notice already: do not even load torch
            return _stopped_before_loading(notice[0])
        import torch._dynamo  # noqa: F401  (every optimizer's first step imports it: loaded here, collector paused)

        from trainer.train import run  # torch loads only once the input is known to be good

        collector.resume()
        outcome = run(cfg, process_start=started)
        if outcome.code == EXIT_BAD_INPUT:
            record_bad_input([outcome.reason])
        return outcome.code
    if args.command == "export":
        from trainer.export import main as export_main

        return export_main(ecfg)
    if args.command == "stage":
        from trainer.data.staging import main as stage_main

        return stage_main(args)
    if args.command == "logs":
        from trainer.cloud.logs import run as logs_run

        return logs_run(args)
    if args.command == "rendezvous":
        from trainer.rendezvous import serve

        return serve(args.host, args.port)
    if args.command == "rendezvous-id":
        from trainer.rendezvous import print_id

        return print_id(args.endpoint, args.name, args.timeout_s)
    from trainer.status import main as status_main

    return status_main(scfg)
