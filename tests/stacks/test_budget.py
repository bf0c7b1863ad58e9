"""The emergency-save budget: the worst moment a notice can find the trainer in (the step in
flight, a periodic save still writing, the copy to host, the disk write) against the window."""

from __future__ import annotations

import pytest
from stack_support import variant

from stacks.budget import (BYTES_PER_PARAM, COPY, PARALLEL_MIN_BYTES, PERIODIC, STEP, UPLOAD_CHUNK_BYTES, WRITE,
                           estimate)

GPT2_SMALL = {"trainer": {"param_count": 124_000_000}}
MB = 124_000_000 * BYTES_PER_PARAM / 1e6  # its state


def test_the_example_declares_its_tasks_true_size():
    b = estimate(variant({}))
    assert b.state_bytes == 111_616 * BYTES_PER_PARAM  # the bundled GPT task's parameters
    assert b.fits is True
    assert b.describe().startswith("emergency save: 1.8 MB (111,616 params x 16 B)")


def test_every_part_of_the_worst_case_is_counted_in_order():
    b = estimate(variant({**GPT2_SMALL, "disk": {"checkpoint_disk_gb": 500}}))
    assert b.state_bytes == 124_000_000 * BYTES_PER_PARAM
    assert b.write_mb_s == 240  # 500 GB x 0.48, capped by g2-standard-8's 8 vCPUs
    assert (b.window_s, b.available_s) == (30, 20)
    parts = dict(b.parts)
    assert [p for p, _ in b.parts] == [STEP, PERIODIC, COPY, WRITE]  # the order they happen in
    assert parts[STEP] == 1.0  # 1 / cost.steps_per_second
    # ... and the upload chunk in flight of each of its 8 streams (the trainer's gcs_streams) to stop
    assert parts[PERIODIC] == pytest.approx(MB / 240 + 8 * UPLOAD_CHUNK_BYTES / 1e6 / 2000)
    assert parts[COPY] == pytest.approx(1.984 / 24)  # one L4 over PCIe 4.0
    assert parts[WRITE] == pytest.approx(MB / 240)  # (1984 + 8 x 33.6 MB) / 2000 MB/s of egress is less
    assert b.seconds == pytest.approx(sum(parts.values()))
    assert b.fits is True and b.warning() is None
    assert "worst case the step in flight 1.0 s" in b.describe() and ": fits" in b.describe()


def test_the_disk_write_alone_would_fit_but_the_worst_case_does_not():
    # Counting only the disk write: 1984 MB at 144 MB/s = 13.8 s of 20 s, "fits".
    b = estimate(variant(GPT2_SMALL))
    assert dict(b.parts)[WRITE] == pytest.approx(MB / 144) and dict(b.parts)[WRITE] < b.available_s
    assert b.fits is False
    warning = b.warning()
    assert warning.startswith("WARNING: emergency save: 1.98 GB")
    assert "DOES NOT FIT. Most of it is a periodic save still writing (13.9 s)" in warning
    # Both disk writes must fit beside the step, the copy and the chunks in flight: 2 x 1984 MB in 18.8 s.
    assert "raise disk.checkpoint_disk_gb to at least 441" in warning
    assert estimate(variant({**GPT2_SMALL, "disk": {"checkpoint_disk_gb": 441}})).fits is True
    assert estimate(variant({**GPT2_SMALL, "disk": {"checkpoint_disk_gb": 440}})).fits is False  # the least, not more


def test_a_slow_step_dominates_and_is_named():
    b = estimate(variant({"cost": {"steps_per_second": 0.05}}))  # 20 s per step
    assert b.dominant == (STEP, 20.0)
    assert "Most of it is the step in flight (20.0 s): one optimizer step takes that long" in b.warning()


def test_a_vm_cap_no_disk_size_can_beat_is_said():
    # g2-standard-4 has 4 vCPUs: PD-SSD capped at 240 MB/s whatever the disk size.
    b = estimate(variant({"machine": {"machine_type": "g2-standard-4"}, "disk": {"checkpoint_disk_gb": 10000},
                          "trainer": {"param_count": None, "state_bytes": 4_000_000_000}}))
    assert b.write_mb_s == 240
    assert "this VM caps PD-SSD writes at 240 MB/s: use a machine type with more vCPUs" in b.warning()


def test_local_ssds_add_their_write_to_the_periodic_save_waited_for():
    over = {**GPT2_SMALL, "machine": {"machine_type": "n1-standard-8", "gpu_type": "nvidia-tesla-t4",
                                      "gpu_count": 1}, "disk": {"local_ssd_count": 2}}
    b = estimate(variant(over))
    assert dict(b.parts)[PERIODIC] == pytest.approx(MB / 700 + MB / 144 + 8 * UPLOAD_CHUNK_BYTES / 1e6 / 2000)
    assert "local SSD, then its whole disk write" in b.describe()
    assert dict(b.parts)[COPY] == pytest.approx(1.984 / 12)  # a T4 on PCIe 3.0


def test_declared_state_bytes_win():
    b = estimate(variant({"trainer": {"param_count": None, "state_bytes": 1_000_000_000}}))
    assert b.state_bytes == 1_000_000_000
    assert b.source == "declared state_bytes"


def test_standard_vms_have_a_longer_window():
    b = estimate(variant({**GPT2_SMALL, "machine": {"provisioning": "standard", "termination_action": None},
                          "disk": {"checkpoint_disk_gb": 100}}))
    assert (b.window_s, b.available_s) == (120, 110)
    assert b.fits is True


def test_unknown_size_says_what_to_declare():
    b = estimate(variant({"trainer": {"param_count": None}}))
    assert b.fits is None and b.warning() is None
    assert "declare trainer.param_count or trainer.state_bytes" in b.describe()


def test_the_upload_chunk_is_the_trainers():
    from trainer.checkpoint.stores import GcsStore

    assert UPLOAD_CHUNK_BYTES == GcsStore.CHUNK_SIZE
    assert PARALLEL_MIN_BYTES == GcsStore.PARALLEL_MIN_BYTES


def test_one_chunk_per_upload_stream_is_in_flight():
    def periodic(config, **trainer):
        return dict(estimate(variant({"trainer": {**trainer, "config": config}})).parts)[PERIODIC]

    one = periodic({"gcs_streams": 1}, param_count=124_000_000)
    assert periodic({}, param_count=124_000_000) == pytest.approx(one + 7 * UPLOAD_CHUNK_BYTES / 1e6 / 2000)
    assert periodic({"gcs_streams": 4}, param_count=124_000_000) == pytest.approx(one + 3 * UPLOAD_CHUNK_BYTES / 1e6 / 2000)
    small = {"param_count": None, "state_bytes": 32 << 20}  # under 64 MiB: one stream, one chunk
    assert periodic({}, **small) == pytest.approx(periodic({"gcs_streams": 1}, **small))
