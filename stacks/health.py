"""The trainer's health check in numbers: how often the group probes, how long a probe waits, and
how many failures in a row make a VM unhealthy (and so recreated by autohealing).

A single VM gets the fixed timing below. A pool's workers answer no probe while torchrun re-forms
the world after a node was lost, so their check must tolerate that long (`pool_timing`). The
Compute API takes at most `gcp_rules.HEALTH_THRESHOLD_MAX` failures at most
`gcp_rules.HEALTH_INTERVAL_MAX_S` apart: a longer tolerance is expressed by probing less often,
never by a threshold the API refuses. Pure arithmetic, shared by the stack and the experiment's
validation (which refuses a last call no check can tolerate).
"""

from __future__ import annotations

from dataclasses import dataclass

from stacks import gcp_rules as R

#: A single VM: probe every 10 s with a 5 s timeout; 2 passes make it healthy, 6 failures (a
#: minute) unhealthy, so one slow answer during a checkpoint never recreates it.
CHECK_INTERVAL_S, TIMEOUT_S, HEALTHY_THRESHOLD, UNHEALTHY_THRESHOLD = 10, 5, 2, 6
#: What a pool's survivor needs besides the rendezvous last call before it answers again: the dead
#: node's keep-alive expiring (3 x 1 s, set in trainer.sh), then worker start-up and restore (a
#: minute allowed).
REJOIN_OVERHEAD_S = 3 + 60


@dataclass(frozen=True)
class HealthTiming:
    """The four numbers of a `google_compute_health_check`."""

    interval_s: int
    timeout_s: int
    healthy_threshold: int
    unhealthy_threshold: int

    @property
    def tolerated_s(self) -> int:
        """Seconds of failed probes in a row before the VM counts as unhealthy."""
        return self.interval_s * self.unhealthy_threshold


SINGLE_VM = HealthTiming(CHECK_INTERVAL_S, TIMEOUT_S, HEALTHY_THRESHOLD, UNHEALTHY_THRESHOLD)
#: The longest run of failed probes any health check can tolerate.
MAX_TOLERATED_S = R.HEALTH_THRESHOLD_MAX * R.HEALTH_INTERVAL_MAX_S
#: The longest `pool.rendezvous_last_call_s` a pool's health check can tolerate.
MAX_LAST_CALL_S = MAX_TOLERATED_S - REJOIN_OVERHEAD_S


def tolerating(seconds: int) -> HealthTiming:
    """A timing that tolerates at least `seconds` of failed probes, never less than a single VM's,
    at the shortest interval whose threshold the API accepts."""
    if seconds > MAX_TOLERATED_S:
        raise ValueError(f"{seconds} s of failed probes cannot be tolerated: at most "
                         f"{R.HEALTH_THRESHOLD_MAX} probes {R.HEALTH_INTERVAL_MAX_S} s apart")
    interval = max(CHECK_INTERVAL_S, -(-seconds // R.HEALTH_THRESHOLD_MAX))
    threshold = max(UNHEALTHY_THRESHOLD, -(-seconds // interval))
    return HealthTiming(interval, TIMEOUT_S, HEALTHY_THRESHOLD, threshold)


def pool_timing(last_call_s: int) -> HealthTiming:
    """A pool worker's check: it may answer nothing for the rejoin overhead plus the last call.
    Without it, autohealing would recreate healthy survivors mid-rendezvous."""
    return tolerating(REJOIN_OVERHEAD_S + last_call_s)
