"""Helpers for the stack tests: experiment variants built from the shipped example.
"""

from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import stacks  # noqa: F401  (environment defaults before cdktn loads)
from stacks.experiment import Experiment
from stacks.load import parse

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"
EXAMPLE = EXPERIMENTS / "example.toml"
FIXTURES = Path(__file__).parent / "fixtures"


def scrub_code_hashes(text: str) -> str:
    """The synthesized JSON with the delivered code's digests replaced by placeholders: the
    snapshot pins the infrastructure, not the trainer's bytes (which change with every edit)."""
    text = re.sub(r"\b[0-9a-f]{64}\b", "<sha256>", text)
    text = re.sub(r"(dependencies )[0-9a-f]{16}\b", r"\1<sha16>", text)
    # The bad-input stop marker is named by the startup script's digest, which holds the code's.
    text = re.sub(r"(bad-input-)[0-9a-f]{16}\b", r"\1<sha16>", text)
    # Object names appear plain and URL-encoded (code%2Ftrainer-...), where \\b finds no boundary.
    return re.sub(r"(?:\b|(?<=%2F))(trainer|user|wheels)-[0-9a-f]{16}\b", r"\1-<sha16>", text)


def unless_stopped(value: Any) -> Any:
    """A group size or coordinator status that a stop marker overrides (`stacks.scale_to_zero`
    synthesizes `marker-count > 0 ? 0 : N`): the value while no marker exists."""
    if isinstance(value, str) and value.startswith("${") and " ? " in value:
        return json.loads(value.rsplit(":", 1)[-1].strip(" }"))
    return value


def example_data() -> dict[str, Any]:
    return tomllib.loads(EXAMPLE.read_text())


def merged(overrides: dict[str, Any], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The example with `overrides` deep-merged in; a value of None removes the key."""
    data = copy.deepcopy(base if base is not None else example_data())
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = merged(value, data[key])
        elif value is None:
            data.pop(key, None)
        else:
            data[key] = value
    return data


def variant(overrides: dict[str, Any], name: str = "example") -> Experiment:
    return parse(merged(overrides), name, f"{name}.toml")


PASCAL_IMAGE = "pytorch-2-8-cu126-ubuntu-2204-nvidia-570"

#: Every configuration the suite synthesizes, by stack name.
VARIANTS: dict[str, dict[str, Any]] = {
    "example": {},
    "regional": {
        "gcp": {"zones": ["us-central1-a", "us-central1-b", "us-central1-c"]},
        "group": {"placement": "regional"},
    },
    "a3-h100": {"machine": {"machine_type": "a3-highgpu-8g", "gpu_type": "nvidia-h100-80gb",
                            "gpu_count": 8}},
    # Two GPUs (torchrun, two ranks) and the trainer's own settings ([trainer.config]).
    "a2-a100-40": {"machine": {"machine_type": "a2-highgpu-2g", "gpu_type": "nvidia-tesla-a100",
                               "gpu_count": 2}, "disk": {"local_ssd_count": 2},
                   "trainer": {"config": {"batch_size": 32, "precision": "bf16",
                                          "task_args": {"n_layer": 4, "dropout": 0.0},
                                          "tiers": {"local": {"every_steps": 50},
                                                    "gcs": {"every_seconds": 900.0}}}}},
    "a2-a100-80": {"machine": {"machine_type": "a2-ultragpu-1g", "gpu_type": "nvidia-a100-80gb",
                               "gpu_count": 1}},
    "g2-l4x4": {"machine": {"machine_type": "g2-standard-48", "gpu_type": "nvidia-l4",
                            "gpu_count": 4}},
    "n1-t4": {"machine": {"machine_type": "n1-standard-8", "gpu_type": "nvidia-tesla-t4",
                          "gpu_count": 1}},
    "n1-v100": {"machine": {"machine_type": "n1-highmem-8", "gpu_type": "nvidia-tesla-v100",
                            "gpu_count": 2}},
    # Pascal needs a PyTorch built for sm_60/61: the cu126 builds (not the default cu129).
    "n1-p100": {"machine": {"machine_type": "n1-standard-16", "gpu_type": "nvidia-tesla-p100",
                            "gpu_count": 1, "image_family": PASCAL_IMAGE}},
    "n1-p4": {"machine": {"machine_type": "n1-standard-4", "gpu_type": "nvidia-tesla-p4",
                          "gpu_count": 4, "image_family": PASCAL_IMAGE}},
    "standard": {"machine": {"provisioning": "standard", "termination_action": None}},
    # Capacity options (docs/capacity.md); each is synthesized, checked by checkov and tested in
    # tests/stacks/test_capacity.py.
    "flex-start": {"machine": {"provisioning": "flex-start", "termination_action": None},
                   "capacity": {"flex_max_run_hours": 72}},
    "flex-regional": {"machine": {"machine_type": "a3-highgpu-8g", "gpu_type": "nvidia-h100-80gb",
                                  "gpu_count": 8, "provisioning": "flex-start", "termination_action": None},
                      "gcp": {"zones": ["us-central1-a", "us-central1-b"]}, "group": {"placement": "regional"}},
    "ranked-types": {"gcp": {"zones": ["us-central1-a", "us-central1-b", "us-central1-c"]},
                     "group": {"placement": "regional"},
                     "capacity": {"machine_types": ["g2-standard-12", "g2-standard-16"]}},
    "zone-change": {"gcp": {"zones": ["us-central1-a", "us-central1-b"]}, "group": {"placement": "regional"},
                    "capacity": {"zone_change_on_repair": True}},
    "od-fallback": {"capacity": {"on_demand_fallback_minutes": 30, "fallback_check_minutes": 5}},
    "no-stop": {"group": {"stop_when_done": False}},
    # A dataset staged onto each VM before training (docs/data.md): read-only on its bucket.
    "data": {"data": {"source": "gs://my-datasets/openwebtext", "parallel": 8}},
    # Watching the run (docs/watch.md): every kind of notification channel and a billing budget;
    # and the alerts switched off.
    "watch": {"alerts": {"email": ["ml-team@example.com", "oncall@example.com"],
                         "webhook_url": "https://hooks.example.com/spottrain?token=abc123",
                         "pubsub_topic": "projects/my-project-123456/topics/spottrain-alerts",
                         "stall_minutes": 45, "notify_finished": False},
              "budget": {"billing_account": "012345-6789AB-CDEF01", "amount_usd": 500, "period": "quarter",
                         "thresholds": [0.25, 0.5, 1.0], "forecast": True}},
    "no-alerts": {"alerts": {"enabled": False}},
    "existing-net": {
        "network": {"mode": "existing", "network": "shared-vpc", "subnetwork": "trainers",
                    "subnetwork_project": "host-project-42", "subnet_cidr": None,
                    "shared_vpc_network_user": "grant",
                    "iap_ssh": False},
        "backend": {"type": "gcs", "bucket": "team-tf-state", "prefix": "spottrain/existing"},
        "bucket": {"name": "explicit-ckpt-bucket", "force_destroy": True},
    },
}




class Synthesized:
    """One variant: its model, its stack JSON (Testing.synth) and its cdk.tf.json path."""

    def __init__(self, name: str, spec: Experiment) -> None:
        from cdktn import Testing

        from stacks.stack import TrainingStack

        self.name, self.spec = name, spec
        app = Testing.app()
        self.stack = TrainingStack(app, name, spec)
        self.text = Testing.synth(self.stack)
        self.json = json.loads(self.text)
        self.file = Path(Testing.full_synth(self.stack)) / "stacks" / name / "cdk.tf.json"

    def resources(self, kind: str) -> list[dict[str, Any]]:
        return list(self.json.get("resource", {}).get(kind, {}).values())

    def one(self, kind: str) -> dict[str, Any]:
        found = self.resources(kind)
        assert len(found) == 1, f"{len(found)} x {kind}"
        return found[0]
