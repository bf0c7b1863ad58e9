"""The shutdown window: how long a VM has from the notice to the power-off, by provisioning, and
how those seconds are shared out. The one place the stack (the unit's `TimeoutStopSec`, the
trainer's budget it passes, the emergency-save estimate), the drill and the trainer read.

Standard library only: `stacks/` imports it without torch, and the trainer's default budget is
read from here.

Google's numbers (docs/vm.md):

- "120 seconds between GCE ACPI G2 Soft Off and ACPI G3 Mechanical Off for Standard VMs and 30
  seconds for Spot VMs" (Compute Engine API, `Scheduling.skipGuestOsShutdown`). A preemption
  notice is that soft-off: the metadata server's `instance/preempted` turns TRUE at the same
  moment (compute/docs/instances/spot).
- A shutdown script gets "90 seconds after you stop or delete" an on-demand instance and "30
  seconds after instance preemption begins" for a preemptible one, best effort
  (compute/docs/shutdownscript). The trainer does not depend on it: systemd stops the trainer's
  unit at the soft-off by itself, with the unit's `TimeoutStopSec`, so the power-off bounds it.
- A flex-start VM deleted at the end of its run duration is given no documented window: plan as
  for Spot (its trainer stops before the end anyway, `capacity.flex_stop_before_minutes`).

The window from the notice, in order:

    |<------------------------------ window_s ------------------------------>|
    |<----- trainer_budget_s ----->|<-- MARGIN_S -->|<-- UNIT_SLACK_S -->|
    notice          the save is durable    the unit stops     power-off
                                            (TimeoutStopSec)

- `trainer_budget_s`: the trainer's emergency save (and whatever of its uploads fits) must be
  durable by then (`RunConfig.preemption_budget_s`); it is also what the stack's estimate of the
  save must fit in (`stacks/budget.py`).
- `MARGIN_S`: the trainer's part after its budget and before the unit's stop timeout: the notice
  reaching it late (the metadata watch, the shutdown script starting), closing and exiting 75.
- `UNIT_SLACK_S`: after `TimeoutStopSec` (then SIGKILL) the kernel's own power-off: unmounting,
  syncing the disk.
"""

from __future__ import annotations

#: Seconds from the soft-off (the notice) to the hard power-off, by provisioning.
WINDOW_S: dict[str, int] = {"spot": 30, "standard": 120, "flex-start": 30}
#: Seconds of the window after the unit's stop timeout, for the kernel's own power-off.
UNIT_SLACK_S = 5
#: Seconds between the end of the trainer's budget and the unit's stop timeout.
MARGIN_S = 5


def window_s(provisioning: str) -> int:
    """Seconds from the notice to the power-off of a `provisioning` VM."""
    try:
        return WINDOW_S[provisioning]
    except KeyError:
        raise ValueError(f"unknown provisioning {provisioning!r}; known: {sorted(WINDOW_S)}") from None


def stop_timeout_s(provisioning: str) -> int:
    """The trainer unit's `TimeoutStopSec`: the window less the kernel's slack."""
    return window_s(provisioning) - UNIT_SLACK_S


def trainer_budget_s(provisioning: str) -> int:
    """The trainer's `preemption_budget_s`: seconds from the notice by which its emergency save
    must be durable; also what the stack's estimate of that save must fit in."""
    return stop_timeout_s(provisioning) - MARGIN_S
