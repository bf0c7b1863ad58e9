"""Where this session runs: the VM's zone and provisioning model, and when the VM booted.

Read once per session from the metadata server (`instance/zone`; the provisioning model from
the template's `spottrain-provisioning` attribute, else from `instance/scheduling/preemptible`)
and from the kernel (`btime`). The goodput ledger records them as a `placement` event, so that
the time a job spent without any VM (waiting for capacity) can be told apart from boot time and
attributed to the zone and provisioning model that finally served it. Off GCE the metadata
server does not answer and nothing is recorded.
"""
from __future__ import annotations

from typing import Any

from trainer.cloud.gce import ApiError, metadata

#: Instance metadata the stack sets on every template: the provisioning model, as the API names it.
PROVISIONING_KEY = "spottrain-provisioning"
PROVISIONING_MODELS = {"spot": "SPOT", "standard": "STANDARD", "flex-start": "FLEX_START"}


def boot_time() -> float | None:
    """When this machine booted (the kernel's btime), or None where /proc/stat has none."""
    try:
        with open("/proc/stat") as f:
            return float(next(line.split()[1] for line in f if line.startswith("btime")))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def read(timeout: float = 2.0) -> dict[str, Any] | None:
    """{"zone", "provisioning", "boot_time"}, or None off GCE."""
    try:
        zone = metadata("instance/zone", timeout).rsplit("/", 1)[-1]
    except ApiError:
        return None
    try:
        model = metadata(f"instance/attributes/{PROVISIONING_KEY}", timeout).strip()
    except ApiError:
        try:
            model = "SPOT" if metadata("instance/scheduling/preemptible", timeout).strip() == "TRUE" \
                else "STANDARD"
        except ApiError:
            model = "UNKNOWN"
    return {"zone": zone, "provisioning": model, "boot_time": boot_time()}
