"""What an experiment's `[pool]` means in numbers and names: one place for the stack, the boot
scripts, the budget and the cost report.

A pool is `nodes` training VMs: the Spot workers of the group plus, when it trains, the on-demand
coordinator. torchrun gets `--nnodes=MIN:MAX` counting the coordinator when it trains, so the
group's target size is max_nodes less one in that case. `group.workers = 0` stops the whole pool:
the group's target size is 0 and the coordinator is stopped (its disks and static IP are kept).
The coordinator's stable name is `coordinator.<experiment>.spottrain.internal`, an A record in a
private Cloud DNS zone bound to the experiment's network.
"""

from __future__ import annotations

from dataclasses import dataclass

from stacks import gcp_rules as R
from stacks.experiment import Experiment

#: Instance metadata key that tells a VM its part in the pool (read by trainer.sh / startup.sh).
ROLE_KEY = "spottrain-role"
COORDINATOR, WORKER = "coordinator", "worker"

#: torchrun's join_timeout (torch's default, pinned): how long a node waits in the rendezvous for
#: min_nodes (a survivor for a preempted node's replacement) before its agent gives up, exits 1
#: and, ending so, closes that rendezvous id (trainer.sh then joins the next epoch). The unit
#: restarts it 10 s later; it must not exhaust spottrain.service's 5 starts in 1800 s however long
#: a stockout lasts, or the node stops for good: at least 1800 / 5 = 360 s apart
#: (tests/stacks/test_pool.py checks it against the unit).
JOIN_TIMEOUT_S = 600


@dataclass(frozen=True)
class PoolLayout:
    """The pool of one experiment, defaults applied and `group.workers` taken into account."""

    name: str  # the experiment (stack) name
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    coordinator_trains: bool
    coordinator_machine_type: str
    rendezvous_port: int
    max_restarts: int
    last_call_s: int
    running: bool  # group.workers = 1; 0 stops the pool

    @property
    def join_timeout_s(self) -> int:
        return JOIN_TIMEOUT_S

    @property
    def coordinator_name(self) -> str:
        return f"{self.name}-coordinator"

    @property
    def dns_domain(self) -> str:
        """The private zone's domain, with the trailing dot Cloud DNS wants."""
        return f"{self.name}.{R.POOL_DOMAIN}."

    @property
    def coordinator_host(self) -> str:
        """The coordinator's stable internal DNS name (no trailing dot), torchrun's endpoint."""
        return f"coordinator.{self.name}.{R.POOL_DOMAIN}"

    @property
    def endpoint(self) -> str:
        return f"{self.coordinator_host}:{self.rendezvous_port}"

    @property
    def coordinator_nodes(self) -> int:
        return 1 if self.coordinator_trains else 0

    @property
    def worker_target(self) -> int:
        """The Spot group's target size."""
        return self.max_nodes - self.coordinator_nodes if self.running else 0

    @property
    def min_workers(self) -> int:
        return max(self.min_nodes - self.coordinator_nodes, 0)

    @property
    def max_workers(self) -> int:
        return self.max_nodes - self.coordinator_nodes


def layout(name: str, exp: Experiment) -> PoolLayout | None:
    """The experiment's pool, or None for a single VM."""
    p = exp.pool
    if p is None:
        return None
    return PoolLayout(
        name=name,
        min_nodes=p.min_nodes,
        max_nodes=p.max_nodes,
        nproc_per_node=exp.machine.gpu_count,
        coordinator_trains=p.coordinator_trains,
        coordinator_machine_type=p.coordinator_type(exp.machine),
        rendezvous_port=p.rendezvous_port,
        max_restarts=p.max_restarts,
        last_call_s=p.rendezvous_last_call_s,
        running=exp.group.workers > 0,
    )
