"""The on-demand fallback: a second group on demand, and the check that moves the job between them.

`capacity.on_demand_fallback_minutes` adds, beside the Spot group:
- `<experiment>-od-group`: the same VM with standard provisioning (its own template), created at
  target size 0. From then on the check owns both groups' sizes: Terraform ignores `target_size`
  on both (`group.workers = 0` reaches the check as `paused`, and it takes both to zero).
- The capacity check (`trainer.cloud.capacity`), which the experiment's control job (`stacks.control`)
  runs at each execution; Cloud Scheduler starts that job every `capacity.fallback_check_minutes`,
  and the job's account gets `roles/compute.viewer` for the Compute API's capacity advice (the
  narrowest documented role that includes `compute.advice.capacity`). Its state lives in
  `runs/<exp>/control/capacity.json`, with the job's other objects.
Nothing runs between checks: a check costs a few seconds of Cloud Run CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FallbackProps:
    project: str
    region: str
    name: str  # the experiment
    location: str  # zones/<zone> or regions/<region>
    spot_group: str
    od_group: str
    machine_type: str
    zones: tuple[str, ...]
    bucket: str
    stop_markers: tuple[str, ...]
    paused: bool
    fallback_after_s: int
    min_on_demand_s: int
    back_to_spot: float


def check_settings(p: FallbackProps) -> dict[str, Any]:
    """`trainer.cloud.capacity.Settings` as the control job receives it (`capacity` of its settings)."""
    return {"project": p.project, "region": p.region, "location": p.location, "spot_group": p.spot_group,
            "od_group": p.od_group, "machine_type": p.machine_type, "zones": list(p.zones),
            "bucket": p.bucket, "state_object": f"runs/{p.name}/control/capacity.json",
            "stop_markers": list(p.stop_markers), "paused": p.paused,
            "fallback_after_s": p.fallback_after_s, "min_on_demand_s": p.min_on_demand_s,
            "back_to_spot": p.back_to_spot}
