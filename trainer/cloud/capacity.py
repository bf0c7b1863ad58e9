"""The on-demand fallback: one check of the job's capacity, as a scheduled Cloud Run job runs it.

Cloud Scheduler starts this every `capacity.fallback_check_minutes`; nothing of ours runs in
between (the stack, `stacks.fallback`, builds the job). Each run reads the job's groups and its
own state (an object in the bucket), decides, resizes, and writes the state back:

- **spot**: the Spot group has target size 1. While it has no running VM, the wait is timed;
  after `fallback_after_s` the Spot group goes to 0 and the on-demand group to 1.
- **on-demand**: after at least `min_on_demand_s`, once the Compute API's capacity advice gives
  Spot an obtainability score of `back_to_spot` or more in one of the zones, the on-demand group
  goes to 0: its VM gets the shutdown signal, the trainer saves and exits 75, and the VM is
  deleted (`to-spot`).
- **to-spot**: only when the on-demand group has no VM left does the Spot group go back to 1.
  So two VMs never train at once: every switch goes through a save, and a VM starts only after
  the other is gone. (A trainer that is slow to die is still covered by the job's GCS writer
  lease: the newcomer cannot write the job's prefix until the lease is released or expires.)
- **stopped**: a stop marker (`trainer.cloud.scale`) that the control job verified
  (`trainer.cloud.stop_marker`) is in the bucket: both groups go to 0 and stay.
- **paused**: the experiment says `group.workers = 0`: both groups go to 0; when it says 1
  again, the job starts over in `spot`.

`decide()` is the whole policy, a pure function of (state, what the groups look like, time);
the capacity simulation (`bench/capacity_bench.py`) drives the same code against the fake Compute
API. The experiment's control job (`trainer.cloud.control`) runs one `Check` per execution, with
`Settings` from its own settings. A resize is not waited on (its operation is Compute's, which
no role of ours may read): the next check sees the group's target size; every shrink is tried
even when another failed, a grow only once every shrink went through (never two VMs by mistake),
and each failure is reported (`Check.failures`).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

from trainer.cloud.gce import ApiError, Client

MODES = ("spot", "on-demand", "to-spot", "stopped", "paused")
HISTORY = 50  # decisions kept in the state object, for `status` and post-mortems


@dataclass(frozen=True)
class Settings:
    project: str
    region: str
    location: str  # zones/<zone> or regions/<region> (both groups)
    spot_group: str
    od_group: str
    machine_type: str
    zones: tuple[str, ...]
    bucket: str
    state_object: str  # runs/<experiment>/control/capacity.json
    stop_markers: tuple[str, ...]  # the job's marker names (the control job verifies them: `Check.stopped`)
    paused: bool
    fallback_after_s: int
    min_on_demand_s: int
    back_to_spot: float

    @classmethod
    def from_json(cls, text: str) -> "Settings":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Settings":
        return cls(**{**data, "zones": tuple(data["zones"]), "stop_markers": tuple(data["stop_markers"])})


@dataclass(frozen=True)
class Observation:
    """What the check saw at `now`."""

    spot_target: int
    spot_running: int
    spot_live: int  # managed instances in any state (a VM being deleted counts)
    od_target: int
    od_running: int
    od_live: int
    stopped: bool  # a stop marker is in the bucket
    spot_obtainability: float | None = None  # asked only when it matters


@dataclass(frozen=True)
class State:
    mode: str = "spot"
    since: float | None = None  # when this mode began
    waiting_since: float | None = None  # spot: when the group was first seen without a VM
    history: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "history": list(self.history)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | None) -> "State":
        if not text:
            return cls()
        data = json.loads(text)
        if data.get("mode") not in MODES:
            return cls()
        return cls(mode=data["mode"], since=data.get("since"), waiting_since=data.get("waiting_since"),
                   history=tuple(data.get("history", ()))[-HISTORY:])


@dataclass(frozen=True)
class Decision:
    state: State
    resize: tuple[tuple[str, int], ...]  # ("spot" | "od", new target size), in this order
    note: str
    needs_advice: bool = False  # decide again with spot_obtainability filled in


def decide(state: State, obs: Observation, now: float, s: Settings) -> Decision:
    """The fallback policy (see the module docstring). Pure: no I/O, no clock."""
    def go(mode: str, note: str, *resize: tuple[str, int], waiting: float | None = None) -> Decision:
        new = State(mode, state.since if mode == state.mode else now, waiting,
                    (*state.history, {"t": now, "mode": mode, "note": note})[-HISTORY:]
                    if mode != state.mode or resize else state.history)
        return Decision(new, tuple(resize), note)

    def ensure(spot: int, od: int) -> tuple[tuple[str, int], ...]:
        # Shrinking first: a new VM starts only after the other is told to go.
        out = [(k, v) for k, v, cur in (("spot", spot, obs.spot_target), ("od", od, obs.od_target))
               if v != cur]
        return tuple(sorted(out, key=lambda kv: kv[1]))

    if obs.stopped:
        return go("stopped", "a stop marker is in the bucket: the job is done", *ensure(0, 0))
    if s.paused:
        return go("paused", "group.workers = 0", *ensure(0, 0))
    mode = "spot" if state.mode in ("stopped", "paused") else state.mode

    if mode == "spot":
        fix = ensure(1, 0)
        if obs.spot_running:
            return go("spot", "a Spot VM is running", *fix, waiting=None)
        waiting = state.waiting_since if state.waiting_since is not None and state.mode == "spot" else now
        if now - waiting >= s.fallback_after_s and obs.od_live == 0:
            return go("on-demand", f"no Spot VM for {(now - waiting) / 60:.0f} min: on-demand fallback",
                      *ensure(0, 1))
        return go("spot", f"waiting for Spot capacity for {(now - waiting) / 60:.0f} min", *fix,
                  waiting=waiting)

    if mode == "on-demand":
        fix = ensure(0, 1)
        dwell = now - (state.since if state.since is not None else now)
        if not obs.od_running or dwell < s.min_on_demand_s:
            return go("on-demand", "on demand" + ("" if obs.od_running else ", waiting for its VM"), *fix)
        if obs.spot_obtainability is None:
            return Decision(state, fix, "asking the capacity advice about Spot", needs_advice=True)
        if obs.spot_obtainability >= s.back_to_spot:
            return go("to-spot", f"Spot obtainability {obs.spot_obtainability:.2f}: back to Spot at a "
                      "checkpoint (the on-demand VM saves and goes)", *ensure(0, 0))
        return go("on-demand", f"Spot obtainability {obs.spot_obtainability:.2f} < {s.back_to_spot:g}", *fix)

    # to-spot: the on-demand VM is saving and going; Spot starts only once it is gone.
    if obs.od_live:
        return go("to-spot", "waiting for the on-demand VM to save and go", *ensure(0, 0))
    return go("spot", "the on-demand VM is gone: Spot again", *ensure(1, 0), waiting=now)


class Check:
    """One run of the check against the real APIs (or the fakes), with an injectable clock."""

    def __init__(self, settings: Settings, client: Client, clock: Callable[[], float] = time.time,
                 log: Callable[[str], None] = lambda line: print(line, flush=True), *, stopped: bool) -> None:
        """``stopped``: the control job's verdict on the stop markers (`trainer.cloud.control.verified`):
        a marker's presence is not enough, since whoever writes the bucket can plant one, and taking
        the groups to zero deletes their checkpoint disks."""
        self.s, self.c, self.clock, self.log = settings, client, clock, log
        self.stopped = stopped
        self.failures: list[str] = []  # what the last run() could not do, one line each

    def _group(self, name: str) -> tuple[int, int, int]:
        path = f"projects/{self.s.project}/{self.s.location}/instanceGroupManagers/{name}"
        target = int(self.c.compute_call("GET", path).get("targetSize", 0))
        managed = self.c.compute_call("POST", f"{path}/listManagedInstances").get("managedInstances", [])
        running = sum(1 for m in managed if m.get("instanceStatus") == "RUNNING")
        live = sum(1 for m in managed if m.get("instanceStatus"))
        return target, running, live

    def obtainability(self) -> float:
        """The best Spot obtainability score over the zones (capacity advice, one call per zone)."""
        best = 0.0
        for zone in self.s.zones:
            body = {"instanceProperties": {"scheduling": {"provisioningModel": "SPOT"}},
                    "instanceFlexibilityPolicy": {"instanceSelections": {
                        "trainer": {"machineTypes": [self.s.machine_type]}}},
                    "distributionPolicy": {"targetShape": "ANY_SINGLE_ZONE", "zones": [{"zone": f"zones/{zone}"}]},
                    "size": 1}
            answer = self.c.compute_call("POST", f"projects/{self.s.project}/regions/{self.s.region}/advice/capacity",
                                         body=body)
            for rec in answer.get("recommendations", []):
                best = max(best, float(rec.get("scores", {}).get("obtainability", 0.0)))
        return best

    def run(self) -> Decision:
        now = self.clock()
        state = State.from_json((self.c.read_object(self.s.bucket, self.s.state_object) or b"").decode() or None)
        stopped = self.stopped
        spot, od = self._group(self.s.spot_group), self._group(self.s.od_group)
        obs = Observation(*spot, *od, stopped=stopped)
        decision = decide(state, obs, now, self.s)
        if decision.needs_advice:
            decision = decide(state, replace(obs, spot_obtainability=self.obtainability()), now, self.s)
        self.failures = []
        shrunk = True
        for kind, size in decision.resize:  # shrinks first (decide() orders them)
            group = self.s.spot_group if kind == "spot" else self.s.od_group
            grows = size > (obs.spot_target if kind == "spot" else obs.od_target)
            if grows and not shrunk:
                self.failures.append(f"{group}: not resized to {size}: a shrink before it failed")
                continue
            path = f"projects/{self.s.project}/{self.s.location}/instanceGroupManagers/{group}"
            try:
                self.c.compute_call("POST", f"{path}/resize", query={"size": size})
            except ApiError as e:
                self.failures.append(f"{group}: resize to {size}: {e}")
                if not grows:
                    shrunk = False
        self.c.write_object(self.s.bucket, self.s.state_object, decision.state.to_json().encode())
        self.log(json.dumps({"event": "capacity_check", "mode": decision.state.mode, "note": decision.note,
                             "resize": dict(decision.resize), "spot": spot, "od": od,
                             **({"failures": self.failures} if self.failures else {})}))
        return decision
