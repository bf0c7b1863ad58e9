"""`python -m trainer status --plot FILE.png`: the job's timeline, drawn from the goodput ledger.

Four panels over the job's wall time (from the first session's start):

- sessions per node: one bar per session, coloured by how it ended (finished, preempted,
  crashed, failed, paused, still running), its start-up and restore lighter, the work a later
  restore threw away hatched red, a triangle at each preemption notice, the time without a VM
  (waiting for capacity) as a grey gap marked on the axis;
- steps: where each rank-0 session stood over time; a later session starting lower shows the
  lost steps;
- checkpoints per tier: a mark when a save became durable on ``local``, ``persistent`` or
  ``gcs`` (the ledger's ``durable`` events), emergency saves as larger marks;
- goodput and cost so far: the report of the events up to each moment (``goodput.report``).

matplotlib is optional (a dev dependency); without it the command says how to install it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.checkpoint.tiers import TIER_NAMES
from trainer.observe.events import (CheckpointDurable, CheckpointSaved, Failed, Finished, Notice, Paused, Preempted,
                                    Progress, Restored, SessionStarted)
from trainer.observe.goodput import report

OUTCOME_COLOURS = {"finished": "#2e7d32", "preempted": "#ef6c00", "crashed": "#c62828", "failed": "#6a1b9a",
                   "paused": "#757575", "running": "#1565c0"}
TIER_ROWS = TIER_NAMES  # the tier table's, fastest first
#: Events that say which step the session stood at.
_STEPS = (Progress.kind, CheckpointSaved.kind, Finished.kind, Preempted.kind, Paused.kind)


class PlotUnavailable(Exception):
    """matplotlib is not installed."""


@dataclass
class Session:
    """One session's bar: where it ran, when, how it ended, the steps it reached."""

    session: str
    node: str
    main: bool
    t0: float
    t_ready: float | None  # restore done (None: it never restored)
    t1: float
    outcome: str  # a key of OUTCOME_COLOURS, or "ended" until ``sessions`` judges it
    restored: int | None  # the step it restored
    points: list[tuple[float, int]]  # (t, step) it reached
    notices: list[float]
    durable: list[tuple[float, str]]  # (t, tier) a save became durable
    emergency: list[tuple[float, str]]  # (t, tier) of the emergency save on a notice
    t_lost: float | None = None  # from when its work was thrown away by a later restore


def sessions(events: list[dict[str, Any]]) -> list[Session]:
    """Per session: node, main, t0, t_ready (restore done), t1, outcome, restored step, the
    (t, step) points it reached, notices, and t_lost (from when its work was thrown away)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for ev in sorted(events, key=lambda e: (str(e["session"]), int(e["seq"]))):
        by.setdefault(str(ev["session"]), []).append(ev)
    out = []
    for sid, evs in by.items():
        start = next((e for e in evs if e["event"] == SessionStarted.kind), {})
        restore = next((e for e in evs if e["event"] == Restored.kind), None)
        kinds = {e["event"] for e in evs}
        outcome = ("finished" if Finished.kind in kinds else "failed" if Failed.kind in kinds
                   else "paused" if Paused.kind in kinds else "preempted" if Notice.kind in kinds else "ended")
        t0 = float(start.get("started", evs[0]["t"]))
        points = [(float(restore["t"]), int(restore["step"]))] if restore else []
        points += [(float(e["t"]), int(e["step"])) for e in evs if e["event"] in _STEPS and "step" in e]
        out.append(Session(
            session=sid, node=str(start.get("node") or start.get("host") or "?"),
            main=start.get("main", True) is not False, t0=t0,
            t_ready=float(restore["t"]) if restore else None,
            t1=max(float(e["t"]) for e in evs), outcome=outcome,
            restored=int(restore["step"]) if restore else None, points=sorted(points),
            notices=[float(e["t"]) for e in evs if e["event"] == Notice.kind],
            durable=[(float(e["t"]), str(e["tier"])) for e in evs if e["event"] == CheckpointDurable.kind],
            emergency=[(float(e["t"]), tier) for e in evs if e["event"] == Preempted.kind
                       for tier in TIER_ROWS if e.get(f"{tier}_ok") is True]))
    out.sort(key=lambda s: s.t0)
    mains = [s for s in out if s.main]
    for i, s in enumerate(out):
        if s.outcome == "ended":  # the newest session may still run; an older one crashed
            s.outcome = "running" if s is mains[-1] or not s.main and s.t1 >= mains[-1].t0 else "crashed"
        later = [x.restored for x in mains if x.t0 > s.t1 and x.restored is not None]
        if later and s.points and s.points[-1][1] > min(later):
            cut = min(later)
            s.t_lost = max((t for t, step in s.points if step <= cut), default=s.t0)
    return out


def draw(events: list[dict[str, Any]], path: Path, *, title: str = "") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.artist import Artist
        from matplotlib.patches import Patch
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install matplotlib (or the dev extra: "
                              "pip install 'spottrain[dev]')") from None
    ss = sessions(events)
    if not ss:
        raise PlotUnavailable("the ledger holds no events yet: nothing to draw")
    origin = ss[0].t0
    end = max(s.t1 for s in ss)
    span = max(end - origin, 1e-9)
    unit, scale = ("h", 3600.0) if span > 3 * 3600 else ("min", 60.0) if span > 180 else ("s", 1.0)

    def x(t: float) -> float:
        return (t - origin) / scale

    nodes = sorted({s.node for s in ss}, key=lambda n: min(s.t0 for s in ss if s.node == n))
    fig, axes = plt.subplots(4, 1, sharex=True, figsize=(12, 3.0 + 0.45 * len(nodes) + 6.5),
                             gridspec_kw={"height_ratios": [0.6 + 0.45 * len(nodes), 2.2, 1.2, 2.0]})
    ax_s, ax_p, ax_c, ax_g = axes

    for row, node in enumerate(nodes):
        for s in (s for s in ss if s.node == node):
            colour = OUTCOME_COLOURS[s.outcome]
            ax_s.barh(row, x(s.t1) - x(s.t0), left=x(s.t0), height=0.6, color=colour, edgecolor="black",
                      linewidth=0.5)
            if s.t_ready is not None:  # start-up and restore: badput before the first step
                ax_s.barh(row, x(s.t_ready) - x(s.t0), left=x(s.t0), height=0.6, color="white", alpha=0.55)
            if s.t_lost is not None:
                ax_s.barh(row, x(s.t1) - x(s.t_lost), left=x(s.t_lost), height=0.6, facecolor="none",
                          edgecolor="black", hatch="xxx", linewidth=0.5)
            for t in s.notices:
                ax_s.plot(x(t), row + 0.42, marker="v", color="black", markersize=7)
    mains = [s for s in ss if s.main]
    for a, b in zip(mains, mains[1:]):  # time with no session of the job: VM recreation, capacity
        if b.t0 > a.t1:
            ax_s.axvspan(x(a.t1), x(b.t0), color="#9e9e9e", alpha=0.18, linewidth=0)
    ax_s.set_yticks(range(len(nodes)), nodes)
    ax_s.set_ylim(-0.6, len(nodes) - 0.2)
    ax_s.invert_yaxis()
    ax_s.set_title("sessions per node", loc="left", fontsize=10)
    legend: list[Artist] = [Patch(color=c, label=k) for k, c in OUTCOME_COLOURS.items() if any(s.outcome == k for s in ss)]
    legend += [Patch(facecolor="white", alpha=0.55, edgecolor="black", label="start-up, restore"),
               Patch(facecolor="none", edgecolor="black", hatch="xxx", label="lost work"),
               Patch(color="#9e9e9e", alpha=0.3, label="no session (down)")]
    legend += [plt.Line2D([], [], marker="v", color="black", linestyle="none", label="preemption notice")]
    ax_s.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)

    for s in mains:
        if s.points:
            ts, steps = zip(*s.points)
            ax_p.plot([x(t) for t in ts], steps, drawstyle="steps-post", color=OUTCOME_COLOURS[s.outcome],
                      linewidth=1.6)
            if s.t_lost is not None:
                lost = [(t, st) for t, st in s.points if t >= s.t_lost]
                ax_p.plot([x(t) for t, _ in lost], [st for _, st in lost], drawstyle="steps-post", color="black",
                          linewidth=1.2, linestyle=":")
    ax_p.set_ylabel("step")
    ax_p.set_title("steps reached by the job's rank 0 (dotted: work a later restore threw away)", loc="left",
                   fontsize=10)
    ax_p.grid(alpha=0.3)

    for s in ss:
        for t, tier in s.durable:
            if tier in TIER_ROWS:
                ax_c.plot(x(t), TIER_ROWS.index(tier), marker="|", color="#37474f", markersize=12)
        for t, tier in s.emergency:
            if tier in TIER_ROWS:
                ax_c.plot(x(t), TIER_ROWS.index(tier), marker="*", color="#ef6c00", markersize=11)
    ax_c.set_yticks(range(len(TIER_ROWS)), TIER_ROWS)
    ax_c.set_ylim(-0.6, len(TIER_ROWS) - 0.4)
    ax_c.invert_yaxis()
    ax_c.set_title("checkpoints durable per tier (star: emergency save on a notice)", loc="left", fontsize=10)
    ax_c.grid(axis="x", alpha=0.3)

    times = sorted({float(e["t"]) for e in events})
    if len(times) > 300:
        times = [times[i * (len(times) - 1) // 299] for i in range(300)]
    ordered = sorted(events, key=lambda e: float(e["t"]))
    good, cost = [], []
    for t in times:
        r = report([e for e in ordered if float(e["t"]) <= t])
        good.append(100 * r.goodput)
        cost.append(r.cost.cost_so_far)
    ax_g.plot([x(t) for t in times], good, color="#2e7d32", linewidth=1.6, label="goodput %")
    ax_g.set_ylim(0, 100)
    ax_g.set_ylabel("goodput %", color="#2e7d32")
    ax_g.grid(alpha=0.3)
    panel = "goodput so far"
    if any(c is not None for c in cost):
        ax_cost = ax_g.twinx()
        ax_cost.plot([x(t) for t, c in zip(times, cost) if c is not None], [c for c in cost if c is not None],
                     color="#1565c0", linewidth=1.6)
        ax_cost.set_ylabel("cost so far (USD)", color="#1565c0")
        panel += " and cost so far"
    ax_g.set_title(panel, loc="left", fontsize=10)
    ax_g.set_xlabel(f"time since the job started ({unit})")
    ax_g.set_xlim(0, x(end) * 1.01)

    r = report(events)
    fig.suptitle(title or (f"{r.sessions} sessions, {r.preemptions} preemptions, {r.crashes} crashes; goodput "
                           f"{100 * r.goodput:.1f}%; step {r.steps}" + (" (finished)" if r.finished else "")),
                 fontsize=12, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
