"""A run at a glance, from its goodput ledger: the current step, steps/s, ETA, the age of the last
event, and whether a VM is up and what it is doing (`trainer status`, `--watch`).

Only the ledger is read (the run dir's copy merged with the bucket's mirror), so a laptop sees
what the VM last wrote: "up" means the newest session has not ended, not that the VM answers
now; a session whose last event is older than ``SILENT_S`` is said to be silent (a hung trainer,
or a VM that went away without a word, e.g. a repair).
"""
from __future__ import annotations

from typing import Any

from trainer.observe.events import (CapacityWait, CheckpointDurable, CheckpointSaved, DataWorkersDied, Failed,
                                    Finished, InitFrom, Notice, Paused, Preempted, Progress, Restored, SessionStarted,
                                    Stalled, StepsChanged, TierFailing, TierOk)

#: A session that wrote nothing for this long is called silent: three times the trainer's default
#: progress interval (``progress_every_s``, 60 s).
SILENT_S = 180.0

#: The newest session's last event -> what the job is doing (or why no VM is needed any more).
_DOING = {
    SessionStarted.kind: "starting", CapacityWait.kind: "starting", Restored.kind: "restored, starting to train",
    StepsChanged.kind: "starting", InitFrom.kind: "starting", Progress.kind: "training",
    CheckpointSaved.kind: "training", CheckpointDurable.kind: "training", TierOk.kind: "training",
    TierFailing.kind: "training (a checkpoint tier is failing)",
    Stalled.kind: "stalled (no step finished within the stall limit)",
    DataWorkersDied.kind: "training (a data worker died)",
    Notice.kind: "saving after a preemption notice",
}
#: Events that end a session: no trainer runs after them until a new session starts.
_ENDED = {
    Preempted.kind: "preempted: waiting for the group to recreate the VM",
    Paused.kind: "paused at stop_at_step",
    Finished.kind: "finished",
    Failed.kind: "stopped on an error",
}
_STEP_EVENTS = (Progress.kind, CheckpointSaved.kind, CheckpointDurable.kind, Paused.kind, Finished.kind,
                Preempted.kind, Restored.kind)


def glance(events: list[dict[str, Any]], now: float, steps: int | None = None) -> dict[str, Any]:
    """The glance as a dict: ``step``, ``steps`` (the run's total, if known), ``steps_per_s`` (the
    newest session's, between its first and last step event), ``eta_s``, ``last_event`` and
    ``last_event_age_s`` (None without events), ``session``, ``vm_up`` (the newest session has not
    ended), ``silent`` (up, but nothing for ``SILENT_S``) and ``doing``."""
    out: dict[str, Any] = {"step": None, "steps": steps, "steps_per_s": None, "eta_s": None,
                           "last_event": None, "last_event_age_s": None, "session": None,
                           "vm_up": False, "silent": False, "doing": "no session yet"}
    if not events:
        return out
    stepped = [e for e in events if e.get("event") in _STEP_EVENTS and isinstance(e.get("step"), (int, float))]
    if stepped:
        out["step"] = int(max(e["step"] for e in stepped))
    for e in events:  # a later --extend-steps changes the total
        if e.get("event") == StepsChanged.kind and isinstance(e.get("to"), int):
            out["steps"] = e["to"] if steps is None or e["to"] > steps else steps
    last = max(events, key=lambda e: (e["t"], str(e["session"]), e["seq"]))
    # The job's main session (rank 0's node) speaks for it; the other nodes' follow it.
    mains = {str(e["session"]) for e in events if e.get("event") == SessionStarted.kind and e.get("main", True)}
    newest = max(mains or {str(e["session"]) for e in events})
    own = sorted((e for e in events if str(e["session"]) == newest), key=lambda e: e["seq"])
    tail = own[-1]
    out.update(last_event=last["event"], last_event_age_s=max(0.0, now - last["t"]), session=newest)
    moving = [e for e in own if e.get("event") in _STEP_EVENTS and isinstance(e.get("step"), (int, float))]
    if len(moving) >= 2 and moving[-1]["t"] > moving[0]["t"] and moving[-1]["step"] > moving[0]["step"]:
        out["steps_per_s"] = (moving[-1]["step"] - moving[0]["step"]) / (moving[-1]["t"] - moving[0]["t"])
    ended = _ENDED.get(tail["event"])
    if ended is not None:
        if tail["event"] == Paused.kind and tail.get("reason") == "max_usd":
            ended = "paused at the spend cap (max_usd)"
        elif tail["event"] == Failed.kind and tail.get("reason"):
            ended = f"stopped on an error ({tail['reason']})"
        out["doing"] = ended
    else:
        out["vm_up"] = True
        out["doing"] = _DOING.get(tail["event"], tail["event"])
        out["silent"] = now - tail["t"] > SILENT_S
    total = out["steps"]
    if out["vm_up"] and out["steps_per_s"] and total is not None and out["step"] is not None:
        out["eta_s"] = max(0, total - out["step"]) / out["steps_per_s"]
    return out


def duration(s: float | None) -> str:
    """``s`` seconds as ``1h02m``, ``4m05s`` or ``12s``."""
    if s is None:
        return "unknown"
    s = int(round(s))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def lines(g: dict[str, Any]) -> list[str]:
    """The glance for a person: two lines."""
    if g["last_event"] is None:
        return ["at a glance: nothing in the ledger yet (no trainer has started)"]
    step = "none" if g["step"] is None else str(g["step"])
    if g["steps"]:
        step += f"/{g['steps']}" + ("" if g["step"] is None else f" ({100 * g['step'] / g['steps']:.1f}%)")
    rate = "unknown" if g["steps_per_s"] is None else f"{g['steps_per_s']:.3g}"
    eta = f", ETA {duration(g['eta_s'])}" if g["eta_s"] is not None else ""
    first = (f"at a glance: step {step}, {rate} steps/s{eta}; last event {duration(g['last_event_age_s'])} ago "
             f"({g['last_event']})")
    if g["vm_up"]:
        vm = f"VM: up (session {g['session']}), {g['doing']}"
        if g["silent"]:
            vm += f"; SILENT for {duration(g['last_event_age_s'])}: hung, or gone without a word"
    else:
        vm = f"VM: none running; {g['doing']}"
    return [first, vm]
