"""`python -m trainer status`: the checkpoints on each tier, the newest valid one, and goodput.

Read-only: it never downloads into, repairs or deletes anything on a tier, and it never unpickles
anything a tier holds: whole-model checkpoints are JSON and raw tensors, and a sharded one reaches
DCP only after its manifest's HMAC verified under the run's checkpoint key
(``--checkpoint-key-file``, as for ``run``; exit 2 without one for a sharded run). Checkpoints
that do not authenticate are listed as invalid with the reason. ``--plot FILE.png`` also draws
the job's timeline (``trainer.observe.timeline``).
``--json`` prints one object: ``latest_step``, ``model_digest`` (sha256 over the newest valid
checkpoint's model tensors in a canonical order, see ``state.model_digest``), ``tier``, ``tiers``
(the checkpointer's per-tier description), ``failing`` (the checkpoint tiers whose writes the
newest session saw failing, and not working again since: tier -> {since, failures, error}, from
the ledger), ``unknown_tiers`` (tier -> error for those that could
not be read: the newest checkpoint may be there), ``goodput`` (see ``goodput.Report``; its
``cost`` object is ``goodput.Cost``; for a multi-node job ``goodput.nodes`` has one report per
node; ``ledger_errors`` and ``skipped_events`` say what the ledger could not write or read, and
``skipped`` lists the first malformed events left out), ``stopped`` (why the newest session
stopped on an error: its ledger's ``failed`` event, e.g. bad input; None otherwise) and
``history`` (changes of the run: ``steps_changed`` and ``init_from`` events). With ``--gcs-uri``
alone (a deployed run, from any machine) it reports the bucket and the ledger's copy there.
The report begins with the run at a glance (``glance``: ``trainer.observe.glance``; in the JSON,
``glance``). ``--watch [SECONDS]`` prints it again every SECONDS until interrupted, ``--count N``
times at most.
"""
from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trainer import EXIT_BAD_INPUT, EXIT_FINISHED
from trainer.checkpoint.checkpointer import describe_failing
from trainer.config import StatusConfig
from trainer.observe.events import Failed, InitFrom, SessionStarted, StepsChanged, TierFailing, TierOk
from trainer.observe.glance import glance, lines as glance_lines
from trainer.observe.goodput import report
from trainer.observe.ledger import LEDGER_DIR, LEDGER_FILE, merge, read_events, read_store_events


def collect(cfg: StatusConfig, events_out: list[dict[str, Any]] | None = None, *,
            stand_in: bool = False) -> dict[str, Any]:
    """The report; ``events_out`` (if given) receives the job's ledger events. ``KeyProblem`` when
    the key cannot be read (or a sharded run has none). ``stand_in``: ``cfg.run_dir`` only stands
    in for the run dir of a run known by its bucket (left out of the report)."""
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.key import resolve
    from trainer.checkpoint.sharded import Sharded
    from trainer.checkpoint.tier_wait import TierUnknown
    from trainer.checkpoint.tiers import tier_table
    from trainer.loop.state import ResumeMismatch, model_digest

    log = logging.getLogger("trainer.status")
    key = resolve(cfg.checkpoint_key_file, create_default=False)
    if key is None:
        log.warning("no checkpoint key (--checkpoint-key-file): whole-model checkpoints are shown without "
                    "authentication, sharded ones not at all")
    table = tier_table(cfg.run_dir, local_dir=cfg.local_dir, gcs_uri=cfg.gcs_uri)
    ckpt = Checkpointer(table, key=key, log=log)
    tiers = ckpt.describe().get("tiers", {})
    sharded = _sharded(tiers)
    if sharded:  # the same look with the sharded layout (KeyProblem without a key)
        ckpt.close()
        ckpt = Checkpointer(table, Sharded(), key=key, log=log)
        tiers = ckpt.describe().get("tiers", {})
    error = None
    try:
        try:
            restored = ckpt.restore(download=False)
        except ResumeMismatch as e:  # the newest verified checkpoint cannot be decoded
            restored, error = None, str(e)
        except TierUnknown as e:  # nor read just now (I/O, memory): say so, as for any unknown tier
            restored, error = None, f"cannot read the newest checkpoint just now: {e}"
        mirror = table.role("mirror")
        events, skipped = _events(cfg, mirror.store if mirror is not None else None, log)
    finally:
        ckpt.close()
    if events_out is not None:
        events_out.extend(events)
    out: dict[str, Any] = {
        "latest_step": restored.step if restored else None,
        "model_digest": model_digest(restored.model) if restored and restored.model is not None else None,
        "tier": restored.tier if restored else None,
        "path": restored.path if restored else None,
        "tiers": tiers,
        "failing": failing_tiers(events),
        "unknown_tiers": _unknown(tiers),
        "goodput": _goodput(events, skipped),
        **_story(events),
    }
    fp = restored.state.get("fingerprint") if restored is not None and isinstance(restored.state, dict) else None
    out["glance"] = glance(events, time.time(), fp.get("steps") if isinstance(fp, dict) else None)
    if stand_in:  # the run dir is a stand-in (a run known by its bucket): not part of the report
        out["tiers"].pop(table.roles.home, None)
    if sharded:
        out["sharded"] = True
    if error is not None:
        out["error"] = error
    if restored is not None and isinstance(restored.state, dict):
        out["data"] = restored.state.get("data")
        out["fingerprint"] = restored.state.get("fingerprint")
    return out


def failing_tiers(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The checkpoint tiers the job's newest session saw failing (``tier_failing`` events) and
    not working again since (``tier_ok``): tier -> {since, failures, error}."""
    mains = [e["session"] for e in events if e["event"] == SessionStarted.kind and e.get("main", True)]
    if not mains:
        return {}
    newest = max(mains)
    out: dict[str, dict[str, Any]] = {}
    for e in sorted((e for e in events if e["session"] == newest), key=lambda e: e["seq"]):
        if e["event"] == TierFailing.kind and isinstance(e.get("tier"), str):
            out[e["tier"]] = {k: e.get(k) for k in ("since", "failures", "error")}
        elif e["event"] == TierOk.kind:
            out.pop(e.get("tier"), None)
    return out


def _events(cfg: StatusConfig, gcs: Any, log: logging.Logger) -> tuple[list[dict[str, Any]], list[str]]:
    """The ledger's events from the run dir and the mirror, and a note per malformed one skipped."""
    skipped: list[str] = []
    events = read_events(cfg.run_dir / LEDGER_DIR / LEDGER_FILE, skipped=skipped)
    if gcs is not None:
        try:
            mirrored = read_store_events(gcs, skip={(e["session"], e["seq"]) for e in events}, skipped=skipped)
        except Exception as e:  # noqa: BLE001 - the report from what can be read, saying what could not
            log.warning("the goodput mirror on GCS cannot be read (%s: %s); the report covers the run dir only",
                        type(e).__name__, e)
            mirrored = []
        events = merge(events, mirrored)
    return events, skipped


def _goodput(events: list[dict[str, Any]], skipped: list[str]) -> dict[str, Any]:
    g = report(events).as_dict()
    g["skipped_events"] += len(skipped)
    g["skipped"] = skipped[:20]
    return g


def _unknown(tiers: dict[str, Any]) -> dict[str, str]:
    """Tiers that could not be listed: the newest checkpoint may be there."""
    return {name: t["error"] for name, t in tiers.items() if t.get("error")}


def _sharded(tiers: dict[str, Any]) -> bool:
    from trainer.checkpoint.manifest import OTHER_LAYOUT

    return any(c["reason"].startswith(OTHER_LAYOUT + "a sharded")
               for t in tiers.values() for c in t.get("checkpoints", []))


def _story(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Why the newest session stopped on an error, and the run's changes (see the docstring)."""
    newest = max((str(e["session"]) for e in events), default=None)
    failed = [e for e in events if str(e["session"]) == newest and e["event"] == Failed.kind]
    stopped = {k: failed[-1].get(k) for k in ("reason", "detail", "t")} if failed else None
    history = [{k: v for k, v in e.items() if k not in ("session", "seq")} for e in events
               if e["event"] in (StepsChanged.kind, InitFrom.kind)]
    return {"stopped": stopped, "history": history}


def _human(s: dict[str, Any]) -> str:
    lines = glance_lines(s["glance"])
    if s.get("error"):
        lines.append(s["error"])
    if s["latest_step"] is None:
        lines.append("newest valid checkpoint: none")
    else:
        lines.append(f"newest valid checkpoint: step {s['latest_step']} on {s['tier']} ({s['path']})")
        lines.append(f"model digest: {s['model_digest']}")
    if s.get("failing"):
        lines.append("degraded: " + describe_failing(s["failing"]))
    lines.append("tiers:")
    for tier, desc in (s["tiers"] or {}).items():
        cps = ", ".join(f"{c['step']}" + ("" if c["valid"] else f" (INVALID: {c['reason']})")
                        for c in desc.get("checkpoints", []))
        err = f" error: {desc['error']}" if desc.get("error") else ""
        lines.append(f"  {tier} {desc.get('location')}: newest valid {desc.get('newest_valid')}; "
                     f"steps: {cps or 'none'}{err}")
    for tier, error in sorted((s.get("unknown_tiers") or {}).items()):
        lines.append(f"WARNING: {tier} cannot be read ({error}): it may hold a newer checkpoint than the one above")
    g = s["goodput"]
    lines.append(
        f"goodput: {100 * g['goodput']:.1f}% of {g['wall_s']:.1f}s wall over {g['sessions']} session(s); "
        f"productive {g['productive_s']:.1f}s, start-up {g['startup_s']:.1f}s, restore {g['restore_s']:.1f}s, "
        f"checkpoint blocked {g['checkpoint_blocked_s']:.1f}s, lost {g['lost_s']:.1f}s, "
        f"down {g['downtime_s']:.1f}s; preemptions {g['preemptions']}, crashes {g['crashes']}, "
        f"failures {g['failures']}, "
        f"finished {'yes' if g['finished'] else 'no'}")
    if g.get("staging_s"):
        lines.append(f"staging the dataset: {g['staging_s']:.1f}s before training, "
                     f"{(g.get('staging_bytes') or 0) / 1e6:.1f} MB downloaded")
    waits = g.get("capacity_wait") or {}
    if waits:
        lines.append(f"waiting for capacity: {g['capacity_wait_s']:.1f}s without a VM ("
                     + ", ".join(f"{k} {v:.1f}s" for k, v in sorted(waits.items())) + ")")
    lines.append(_cost_line(g.get("cost") or {}))
    errors = g.get("ledger_errors") or {}
    if errors or g.get("skipped_events"):
        lines.append("ledger: " + ", ".join([f"{n} failed write(s) to the {'run dir' if w == 'local' else w}"
                                             for w, n in sorted(errors.items())]
                                            + [f"{g.get('skipped_events', 0)} malformed event(s) skipped"]))
    for h in s.get("history") or []:
        if h["event"] == StepsChanged.kind:
            lines.append(f"steps changed at step {h.get('step')}: {h.get('from')} -> {h.get('to')} (extend_steps)")
        else:
            lines.append(f"started from {h.get('location')} (step {h.get('step')}, "
                         f"{'weights and optimizer' if h.get('optimizer') else 'weights'}; init_from)")
    if s.get("stopped"):
        lines.append(f"STOPPED: the newest session failed ({s['stopped']['reason']}): {s['stopped']['detail']}")
    for node, n in sorted((g.get("nodes") or {}).items()):
        lines.append(
            f"  node {node}: goodput {100 * n['goodput']:.1f}% of {n['wall_s']:.1f}s over {n['sessions']} "
            f"session(s); productive {n['productive_s']:.1f}s, lost {n['lost_s']:.1f}s; preemptions "
            f"{n['preemptions']}, crashes {n['crashes']}, failures {n['failures']}; "
            f"cost {_usd((n.get('cost') or {}).get('cost_so_far'))}")
    return "\n".join(lines)


def _usd(v: float | None) -> str:
    return "unknown" if v is None else f"${v:,.4f}"


def _cost_line(c: dict[str, Any]) -> str:
    priced, unpriced = c.get("priced_sessions", 0), c.get("unpriced_sessions", 0)
    if not priced:
        return (f"cost: unknown ({unpriced} session(s) without a price; "
                "pass --price-per-hour and --on-demand-price-per-hour to `trainer run`)")
    partial = f", {unpriced} without a price not counted" if unpriced else ""
    savings = c.get("savings")
    return (f"cost: {_usd(c.get('cost_so_far'))} so far over {priced} priced session(s){partial}; "
            f"{_usd(c.get('cost_per_1000_steps'))} per 1000 steps; "
            f"on demand (goodput 1) {_usd(c.get('on_demand_equivalent'))}; "
            f"savings {'unknown' if savings is None else _usd(savings)}")


def main(cfg: StatusConfig) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
    if cfg.run_dir is not None and not cfg.run_dir.is_dir() and cfg.gcs_uri is None:
        print(f"command line: run_dir: {cfg.run_dir} is not a directory", file=sys.stderr)
        return EXIT_BAD_INPUT
    if cfg.watch_s is None:
        return _once(cfg)
    # --watch: the report again every watch_s seconds, until interrupted or `count` reports.
    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() and not cfg.json_output else ""
    shown = 0
    try:
        while True:
            if clear:
                print(clear, end="")
            elif shown and not cfg.json_output:
                print()
            code = _once(cfg)
            shown += 1
            sys.stdout.flush()
            if code != EXIT_FINISHED or (cfg.count is not None and shown >= cfg.count):
                return code
            time.sleep(cfg.watch_s)
    except KeyboardInterrupt:
        return EXIT_FINISHED


def _once(cfg: StatusConfig) -> int:
    from trainer.checkpoint.key import KeyProblem

    events: list[dict[str, Any]] = []
    try:
        if cfg.run_dir is None:
            # A run known only by its bucket (a deployed run, seen from a laptop): an empty stand-in
            # for its disk, never written, and left out of the report.
            with tempfile.TemporaryDirectory(prefix="spottrain-status-") as tmp:
                s = collect(cfg.model_copy(update={"run_dir": Path(tmp) / "no-run-dir"}), events, stand_in=True)
        else:
            s = collect(cfg, events)
    except KeyProblem as e:
        print(f"command line: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(s, default=str, sort_keys=True) if cfg.json_output else _human(s))
    if cfg.plot is not None:
        from trainer.observe.timeline import PlotUnavailable, draw

        try:
            draw(events, cfg.plot)
        except PlotUnavailable as e:
            print(f"command line: plot: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except OSError as e:
            print(f"command line: plot: cannot write {cfg.plot}: {e.strerror}", file=sys.stderr)
            return EXIT_BAD_INPUT
        print(f"timeline written to {cfg.plot}", file=sys.stderr)
    return EXIT_FINISHED
