"""The emergency-save budget: state size over PD-SSD write speed against the shutdown window."""

from __future__ import annotations

import pytest
from stack_support import variant

from stacks.budget import BYTES_PER_PARAM, estimate


GPT2_SMALL = {"trainer": {"param_count": 124_000_000}}


def test_the_example_declares_its_tasks_true_size():
    b = estimate(variant({}))
    assert b.state_bytes == 111_616 * BYTES_PER_PARAM  # the bundled GPT task's parameters
    assert b.fits is True
    assert b.describe().startswith("emergency save: 1.8 MB (111,616 params x 16 B)")


def test_a_gpt2_small_fits():
    b = estimate(variant(GPT2_SMALL))
    assert b.state_bytes == 124_000_000 * BYTES_PER_PARAM
    assert b.write_mb_s == pytest.approx(300 * 0.48)
    assert (b.window_s, b.available_s) == (30, 20)
    assert b.seconds == pytest.approx(1984 / 144)
    assert b.fits is True
    assert b.warning() is None
    assert "fits" in b.describe()


def test_small_disk_warns_with_a_remedy():
    b = estimate(variant({**GPT2_SMALL, "disk": {"checkpoint_disk_gb": 100}}))
    assert b.write_mb_s == pytest.approx(48)
    assert b.fits is False
    warning = b.warning()
    assert warning.startswith("WARNING: emergency save: 1.98 GB")
    assert "DOES NOT FIT" in warning
    assert "checkpoint_disk_gb to at least 207" in warning  # 1984 MB / 20 s / 0.48


def test_vm_cap_bounds_a_large_disk():
    # g2-standard-4 has 4 vCPUs: capped at 240 MB/s whatever the disk size.
    b = estimate(variant({"machine": {"machine_type": "g2-standard-4"},
                          "disk": {"checkpoint_disk_gb": 10000}}))
    assert b.write_mb_s == 240


def test_declared_state_bytes_win():
    b = estimate(variant({"trainer": {"param_count": None, "state_bytes": 1_000_000_000}}))
    assert b.state_bytes == 1_000_000_000
    assert b.source == "declared state_bytes"


def test_standard_vms_have_a_longer_window():
    b = estimate(variant({"machine": {"provisioning": "standard", "termination_action": None},
                          "disk": {"checkpoint_disk_gb": 100}}))
    assert (b.window_s, b.available_s) == (120, 110)
    assert b.fits is True


def test_unknown_size_says_what_to_declare():
    b = estimate(variant({"trainer": {"param_count": None}}))
    assert b.fits is None and b.warning() is None
    assert "declare trainer.param_count or trainer.state_bytes" in b.describe()
