"""trainer/cloud/vm_info.py: the session's zone, provisioning model and boot time, from the fake
metadata server, and nothing off GCE."""
from __future__ import annotations

import pytest

from drill.metadata_server import MetadataServer
from support import closed_metadata_host
from trainer.cloud import vm_info


def test_zone_and_the_templates_provisioning_model(monkeypatch: pytest.MonkeyPatch) -> None:
    with MetadataServer(attributes={vm_info.PROVISIONING_KEY: "FLEX_START"}, zone="us-central1-b") as md:
        monkeypatch.setenv("GCE_METADATA_HOST", md.host)
        found = vm_info.read()
    assert found is not None
    assert (found["zone"], found["provisioning"]) == ("us-central1-b", "FLEX_START")
    assert found["boot_time"] == vm_info.boot_time() and found["boot_time"] > 0


def test_without_the_attribute_preemptible_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    with MetadataServer(zone="europe-west4-a") as md:
        md.set_value("instance/scheduling/preemptible", "TRUE")
        monkeypatch.setenv("GCE_METADATA_HOST", md.host)
        assert vm_info.read()["provisioning"] == "SPOT"  # type: ignore[index]


def test_off_gce_nothing_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GCE_METADATA_HOST", closed_metadata_host())
    assert vm_info.read() is None
