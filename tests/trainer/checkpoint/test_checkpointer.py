"""trainer.checkpoint.checkpointer: tiers, async saves, restore with fallback, retention, emergency save."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.trainer.support import Policy, bucket_names, checkpointer, code_running_pickle, forge_in_bucket, run_key
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.key import CheckpointKey
from trainer.checkpoint import yielding
from trainer.checkpoint.manifest import MANIFEST, ResumeMismatch, step_name
from trainer.checkpoint.tier_wait import TierUnknown
from trainer.checkpoint.whole_model import STATE, TENSORS, verify_dir
from trainer.checkpoint.whole_model import list_whole as list_checkpoints

GUARD = 60.0  # failure guard for waits; never reached when the code is right


def make_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)},
            "optim": {"state": {0: {"exp_avg": torch.randn(16, 8, generator=g)}}, "param_groups": [{"lr": 0.1}]},
            "rng": torch.get_rng_state(), "data": {"index": step * 10, "epoch": 0}, "step": step}


def same(a: dict, b: dict) -> bool:
    return (torch.equal(a["model"]["w"], b["model"]["w"]) and torch.equal(a["model"]["b"], b["model"]["b"])
            and torch.equal(a["optim"]["state"][0]["exp_avg"], b["optim"]["state"][0]["exp_avg"])
            and torch.equal(a["rng"], b["rng"]) and a["data"] == b["data"] and a["step"] == b["step"])


EVERY = Policy(every_steps=1, keep=10)


KEY = run_key()


def ckpt(tmp_path: Path, emu=None, *, client=None, with_local=True, key: CheckpointKey | None = KEY,
         **policies) -> Checkpointer:
    pol = {"local": EVERY, "persistent": EVERY, "gcs": EVERY}
    pol.update(policies)
    return checkpointer(run_dir=tmp_path / "run", local_dir=(tmp_path / "local") if with_local else None,
                        gcs_uri=emu.uri if emu else None, gcs_client=client or (emu.client if emu else None),
                        policies={k: v for k, v in pol.items() if v is not None}, key=key)


def due(c: Checkpointer, step: int) -> list[str]:
    return [t.name for t in c._book.due_tiers(step)]


def save_steps(c: Checkpointer, steps) -> None:
    for s in steps:
        c.save(s, make_state(s), meta={"world_size": 1})
        c.wait()


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("tier", ["local", "persistent", "gcs"])
def test_roundtrip_from_each_tier(gcs_emulator, tmp_path: Path, tier: str) -> None:
    c = ckpt(tmp_path, gcs_emulator)
    save_steps(c, [3])
    c.close()
    # Leave the checkpoint only on the tier under test.
    if tier != "local":
        shutil.rmtree(tmp_path / "local")
    if tier != "persistent":
        shutil.rmtree(tmp_path / "run" / step_name(3))
    if tier != "gcs":
        c.tiers["gcs"].store.delete_prefix(step_name(3) + "/")
    r = ckpt(tmp_path, gcs_emulator).restore(download=False)
    assert r is not None and r.step == 3 and r.tier == tier and same(r.state, make_state(3))
    if tier == "gcs":  # download=False leaves the persistent tier alone
        assert not (tmp_path / "run" / step_name(3)).exists()


#: A process that restores and ends without close(): the first save's buffer is still being
#: reserved in the background when the interpreter exits.
_RESTORE_THEN_EXIT = r"""
import sys
from pathlib import Path
from tests.trainer.support import checkpointer
from trainer.checkpoint.key import CheckpointKey
print("restored", checkpointer(run_dir=Path(sys.argv[1]), key=CheckpointKey(b"k" * 32, "test")).restore().step)
"""


def test_a_process_that_exits_right_after_its_restore_exits_cleanly(tmp_path: Path) -> None:
    """The reservation of the first save's buffer ran in a daemon thread; one still inside torch
    when the interpreter exited aborted the process (SIGABRT, "terminate called without an
    active exception"), so a trainer stopped just after its restore exited 134, not its code."""
    import subprocess
    import sys

    c = checkpointer(run_dir=tmp_path, key=CheckpointKey(b"k" * 32, "test"))
    c.save(1, {"w": torch.ones(16 << 20), "step": 1}, meta={"world_size": 1})
    c.close()
    repo = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", _RESTORE_THEN_EXIT, str(tmp_path)], cwd=repo,
                         capture_output=True, text=True, timeout=240)
    assert (out.returncode, out.stdout.split()) == (0, ["restored", "1"]), out.stderr[-2000:]


def test_fresh_run_restores_nothing(tmp_path: Path, logwatch) -> None:
    assert ckpt(tmp_path).restore() is None
    assert "starting from scratch" in logwatch.text()


def test_restore_prefers_fastest_tier_for_equal_steps(gcs_emulator, tmp_path: Path) -> None:
    c = ckpt(tmp_path, gcs_emulator)
    save_steps(c, [1, 2])
    r = ckpt(tmp_path, gcs_emulator).restore()
    assert (r.step, r.tier) == (2, "local")


def test_lost_disks_resume_from_gcs(gcs_emulator, tmp_path: Path, logwatch) -> None:
    c = ckpt(tmp_path, gcs_emulator)
    save_steps(c, [1, 2])
    c.close()
    # The VM came back in another zone: fresh local SSD and a fresh persistent disk.
    shutil.rmtree(tmp_path / "local")
    shutil.rmtree(tmp_path / "run")
    c2 = ckpt(tmp_path, gcs_emulator)
    r = c2.restore()
    assert (r.step, r.tier) == (2, "gcs") and same(r.state, make_state(2))
    # Downloaded into the persistent tier, atomically and verified.
    assert verify_dir(tmp_path / "run" / step_name(2))["step"] == 2
    assert "downloaded step 2" in logwatch.text()
    # The next start finds it on disk.
    assert ckpt(tmp_path, gcs_emulator).restore().tier == "persistent"


def test_gcs_newer_than_disk_is_downloaded(gcs_emulator, tmp_path: Path) -> None:
    c = ckpt(tmp_path, gcs_emulator, with_local=False)
    save_steps(c, [1, 2, 3])
    shutil.rmtree(tmp_path / "run" / step_name(3))  # persistent has 2, GCS has 3
    r = ckpt(tmp_path, gcs_emulator, with_local=False).restore()
    assert (r.step, r.tier) == (3, "gcs")
    assert (tmp_path / "run" / step_name(3) / MANIFEST).exists()


@pytest.mark.parametrize("broken", ["fill", "readonly"])
def test_a_run_dir_that_cannot_take_the_download_still_resumes_from_gcs(
        gcs_emulator, tmp_path: Path, small_fs, logwatch, monkeypatch: pytest.MonkeyPatch, broken: str) -> None:
    """The disk's failure is not the checkpoint's: never fall back to an older one, or to none."""
    save_steps(ckpt(tmp_path, gcs_emulator, with_local=False), [1, 2, 3])
    disk = small_fs("run", 8 << 20, fstype="ext4")  # a new VM's blank disk over the old run dir
    getattr(disk, broken)()  # full (the staged data filled it) or failed read-only
    r = ckpt(tmp_path, gcs_emulator, with_local=False).restore()
    assert r is not None and (r.step, r.tier) == (3, "gcs") and same(r.state, make_state(3))
    assert "falling back" not in logwatch.text()
    logwatch.wait_for("the run dir cannot take the download of step 3 ")
    # Nowhere to put it at all: the run dir is unknown (start-up waits), never a fresh start.
    tmp = small_fs("tmp", 1 << 20)
    tmp.fill()
    monkeypatch.setattr("tempfile.tempdir", str(tmp.path))
    with pytest.raises(TierUnknown) as e:
        ckpt(tmp_path, gcs_emulator, with_local=False).restore()
    assert "persistent" in e.value.tiers and "cannot store the download of step 3" in str(e.value)


def test_a_read_only_run_dir_with_leftovers_of_a_cut_write_still_restores(tmp_path: Path, small_fs) -> None:
    disk = small_fs("run", 8 << 20, fstype="ext4")
    save_steps(ckpt(tmp_path, with_local=False), [1, 2])
    (disk.path / ".tmp-step-00000003-abcd").mkdir()  # saves cut short, then the disk failed
    (disk.path / ".tmp-step-00000003-abcd" / TENSORS).write_bytes(b"x")
    (disk.path / ".tmp-manifest.json-abcd").write_bytes(b"x")
    import os

    os.sync()
    disk.readonly()
    r = ckpt(tmp_path, with_local=False).restore()
    assert (r.step, r.tier) == (2, "persistent") and same(r.state, make_state(2))


# ----------------------------------------------------------------------------- corruption


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-7])


def _flip(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 3] ^= 1
    p.write_bytes(bytes(b))


@pytest.mark.parametrize("damage, reason", [
    (lambda f: _truncate(f / TENSORS), "truncated"),
    (lambda f: (f / MANIFEST).unlink(), "no manifest"),
    (lambda f: _flip(f / TENSORS), "tensors.bin blake3 mismatch"),
    (lambda f: _flip(f / STATE), "state.json blake3 mismatch"),
])
def test_corrupt_newest_falls_back_and_logs_why(tmp_path: Path, logwatch, damage, reason) -> None:
    c = ckpt(tmp_path, with_local=False)
    save_steps(c, [1, 2])
    damage(tmp_path / "run" / step_name(2))
    r = ckpt(tmp_path, with_local=False).restore()
    assert r.step == 1 and same(r.state, make_state(1))
    line = next(x for x in logwatch.records if "step 2" in x and reason in x)
    assert "persistent" in line


def test_corrupt_everywhere_falls_back_across_tiers(gcs_emulator, tmp_path: Path, logwatch) -> None:
    c = ckpt(tmp_path, gcs_emulator)
    save_steps(c, [1, 2])
    _flip(tmp_path / "local" / step_name(2) / TENSORS)
    _truncate(tmp_path / "run" / step_name(2) / STATE)
    r = ckpt(tmp_path, gcs_emulator).restore()
    # Step 2 is still intact on GCS: it wins over step 1 and replaces the bad persistent copy.
    assert (r.step, r.tier) == (2, "gcs") and same(r.state, make_state(2))
    verify_dir(tmp_path / "run" / step_name(2))
    assert "replacing invalid persistent copy of step 2" in logwatch.text()


def test_partial_gcs_uploads_are_never_chosen(gcs_emulator, tmp_path: Path, logwatch) -> None:
    c = ckpt(tmp_path, gcs_emulator, with_local=False)
    save_steps(c, [1, 2, 3, 4])
    c.close()
    shutil.rmtree(tmp_path / "run")
    gcs = c.tiers["gcs"].store
    gcs.delete(f"{step_name(4)}/{MANIFEST}")                  # payload without manifest
    gcs.delete(f"{step_name(3)}/{TENSORS}")                   # manifest -> missing object
    data = gcs.get_bytes(f"{step_name(2)}/{TENSORS}")
    gcs.delete(f"{step_name(2)}/{TENSORS}")
    gcs.put_bytes(f"{step_name(2)}/{TENSORS}", data[:-1])     # manifest -> short object
    r = ckpt(tmp_path, gcs_emulator, with_local=False).restore()
    assert (r.step, r.tier) == (1, "gcs") and same(r.state, make_state(1))
    text = logwatch.text()
    assert "step 4" in text and "no manifest" in text
    assert "step 3" in text and "missing" in text
    assert "step 2" in text and "truncated or partial" in text


def test_corrupt_payload_on_gcs_with_right_sizes_falls_back(gcs_emulator, tmp_path: Path, logwatch) -> None:
    c = ckpt(tmp_path, gcs_emulator, with_local=False)
    save_steps(c, [1, 2])
    shutil.rmtree(tmp_path / "run")
    data = bytearray(c.tiers["gcs"].store.get_bytes(f"{step_name(2)}/{TENSORS}"))
    data[5] ^= 0xFF
    c.tiers["gcs"].store.delete(f"{step_name(2)}/{TENSORS}")
    c.tiers["gcs"].store.put_bytes(f"{step_name(2)}/{TENSORS}", bytes(data))
    r = ckpt(tmp_path, gcs_emulator, with_local=False).restore()
    assert r.step == 1
    assert "tensors.bin blake3 mismatch" in logwatch.text()
    assert not (tmp_path / "run" / step_name(2)).exists()  # the bad download never became visible


# ----------------------------------------------------------------------------- GCS outages


def test_emulator_down_mid_upload_then_back(gcs_emulator, faulty_gcs, tmp_path: Path, logwatch) -> None:
    emu = gcs_emulator.emulator
    c = ckpt(tmp_path, gcs_emulator, client=faulty_gcs, with_local=False)
    c.tiers["gcs"].store.initial_backoff_s = 0.05
    c.tiers["gcs"].store.max_backoff_s = 0.2
    # The first payload upload finds the emulator gone.
    faulty_gcs.plan.add("upload", f"*{step_name(5)}/{STATE}", "hook", hook=emu.stop)
    c.save(5, make_state(5))
    logwatch.wait_for("retrying", GUARD)
    # Training goes on meanwhile, and so do the disk saves: the upload holds none of them back.
    assert c.uploading() and not c._writer.busy() and c.due(6)
    emu.start()
    c.wait()
    assert c.stats["tier_writes_failed"] == 0
    infos = {i.step: i for i in list_checkpoints(c.tiers["gcs"].store)}
    assert infos[5].valid
    shutil.rmtree(tmp_path / "run")
    r = ckpt(tmp_path, gcs_emulator, with_local=False).restore()
    assert (r.step, r.tier) == (5, "gcs") and same(r.state, make_state(5))


def test_emulator_down_upload_fails_cleanly(gcs_emulator, faulty_gcs, tmp_path: Path, logwatch) -> None:
    emu = gcs_emulator.emulator
    c = ckpt(tmp_path, gcs_emulator, client=faulty_gcs, with_local=False)
    save_steps(c, [1])
    c.tiers["gcs"].store.retry_timeout_s = 0.5
    c.tiers["gcs"].store.initial_backoff_s = 0.05
    # Outage right before the manifest: payload is up, the manifest never makes it.
    faulty_gcs.plan.add("upload", f"*{step_name(2)}/{MANIFEST}", "hook", hook=emu.stop)
    c.save(2, make_state(2))
    c.wait()
    assert c.stats["tier_writes_failed"] == 1
    assert "on gcs failed" in logwatch.text() and "training continues" in logwatch.text()
    emu.start()  # back, but empty (in-memory): nothing on GCS at all now
    r = ckpt(tmp_path, gcs_emulator, with_local=False).restore()
    assert (r.step, r.tier) == (2, "persistent")


def test_manifest_without_payload_after_outage_is_not_chosen(gcs_emulator, faulty_gcs, tmp_path: Path) -> None:
    # The emulator restarts empty between the payload and the manifest: the retried manifest lands
    # and references objects that are gone. Restore must see that and skip it.
    emu = gcs_emulator.emulator
    c = ckpt(tmp_path, gcs_emulator, client=faulty_gcs, with_local=False)
    c.tiers["gcs"].store.initial_backoff_s = 0.05

    def bounce() -> None:
        emu.stop()
        emu.start()

    faulty_gcs.plan.add("upload", f"*{step_name(2)}/{MANIFEST}", "hook", hook=bounce)
    save_steps(c, [2])
    infos = {i.step: i for i in list_checkpoints(c.tiers["gcs"].store)}
    assert not infos[2].valid and "missing" in infos[2].reason
    shutil.rmtree(tmp_path / "run")
    assert ckpt(tmp_path, gcs_emulator, with_local=False).restore() is None


# ----------------------------------------------------------------------------- async


def test_save_does_not_wait_for_the_upload_and_newer_uploads_replace_queued_ones(
        gcs_emulator, faulty_gcs, tmp_path: Path, logwatch) -> None:
    release = threading.Event()
    entered = threading.Event()

    def block() -> None:
        entered.set()
        assert release.wait(GUARD)

    faulty_gcs.plan.add("upload", f"*{step_name(1)}/{TENSORS}", "hook", hook=block)
    c = ckpt(tmp_path, gcs_emulator, client=faulty_gcs)
    done = threading.Event()
    threading.Thread(target=lambda: (c.save(1, make_state(1)), done.set()), daemon=True).start()
    assert done.wait(GUARD), "save() blocked on the background upload"
    assert entered.wait(GUARD) and not release.is_set()  # the upload of step 1 is still held
    # The disk saves go on meanwhile; their uploads queue behind it, the newest replacing the older.
    for step in (2, 3):
        c._writer.thread.join(GUARD)  # the previous save's disk writer
        assert c.due(step)
        c.save(step, make_state(step))
    c._writer.thread.join(GUARD)
    assert c.stats["waited"] == 0 and c.stats["uploads_superseded"] == 1
    assert "upload of step 2 to gcs dropped: step 3 is newer" in logwatch.text()
    release.set()
    c.wait()
    text = logwatch.records
    i1 = next(i for i, x in enumerate(text) if "step 1 durable on gcs" in x)
    i3 = next(i for i, x in enumerate(text) if "step 3 durable on gcs" in x)
    assert i1 < i3
    assert {i.step for i in list_checkpoints(c.tiers["gcs"].store) if i.valid} == {1, 3}
    assert {i.step for i in list_checkpoints(c.tiers["persistent"].store) if i.valid} == {1, 2, 3}


def test_background_error_never_raises_into_the_loop(tmp_path: Path, logwatch) -> None:
    (tmp_path / "file").write_text("not a directory")
    c = checkpointer(run_dir=tmp_path / "file" / "run", policies={"persistent": EVERY})
    c.save(1, make_state(1))  # returns; the failure happens in the background
    c.wait()
    assert c.stats["tier_writes_failed"] == 1 and "persistent step 1" in c.stats["last_error"]
    assert "failed (training continues" in logwatch.text()


def test_meta_must_be_json(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="JSON"):
        ckpt(tmp_path).save(1, make_state(1), meta={"x": object()})


def test_unknown_tier_policy_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown checkpoint tier"):
        checkpointer(run_dir=tmp_path, policies={"ram": Policy()})
    from trainer.checkpoint.tiers import Cadence, tier_table

    for bad in ({"every_steps": 0}, {"every_seconds": -1.0}):
        with pytest.raises(ValueError):
            Cadence(**bad)
    with pytest.raises(ValueError, match="keep"):
        tier_table(tmp_path, keep={"persistent": 0})


# ----------------------------------------------------------------------------- schedules


def test_due_by_steps_per_tier(tmp_path: Path) -> None:
    c = checkpointer(run_dir=tmp_path / "run", local_dir=tmp_path / "local",
                     policies={"local": Policy(every_steps=2), "persistent": Policy(every_steps=5)})
    assert [s for s in range(1, 7) if c._book.due_tiers(s)] == [2, 3, 4, 5, 6]  # nothing saved yet: stays due
    c.save(2, make_state(2))
    c.wait()
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == [step_name(2)]
    assert not (tmp_path / "run").exists()  # persistent was not due at step 2
    assert due(c, 3) == [] and due(c, 4) == ["local"] and due(c, 5) == ["local", "persistent"]


def test_due_after_restore_counts_from_the_restored_step(tmp_path: Path) -> None:
    c = ckpt(tmp_path, with_local=False, persistent=Policy(every_steps=10))
    c.save(13, make_state(13))
    c.wait()
    c2 = ckpt(tmp_path, with_local=False, persistent=Policy(every_steps=10))
    assert c2.restore().step == 13
    assert not c2.due(14) and not c2.due(19) and c2.due(20)


def test_due_by_seconds(tmp_path: Path) -> None:
    c = ckpt(tmp_path, with_local=False, persistent=Policy(every_seconds=3600))
    assert not c.due(1)
    c2 = ckpt(tmp_path, with_local=False, persistent=Policy(every_seconds=1e-9))
    assert c2.due(1)


def test_automatic_interval_uses_measured_cost(tmp_path: Path, logwatch) -> None:
    c = checkpointer(run_dir=tmp_path / "run", mtbf_s=3600)
    assert c.interval_s("persistent") == 60.0 and not c.due(1)  # first save after 60 s
    for s in range(2, 50):
        c.due(s)
    first = [x for x in logwatch.records if "checkpoint interval for persistent" in x]
    assert len(first) == 1 and "no cost measured yet" in first[0]  # logged once, not per step
    c.save(50, make_state(50))
    c.wait()
    auto = c._book.schedule["persistent"].auto
    assert auto.blocked_s is not None and auto.write_s is not None
    assert c.interval_s("persistent") == auto.decide().seconds
    c.due(51)
    assert "Young/Daly" in logwatch.text()


# ----------------------------------------------------------------------------- priority

needs_lift = pytest.mark.skipif(not yielding.possible(), reason="needs Linux and the privilege to raise a "
                                "thread's priority (root, as on a VM)")


def nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def after_a_first_save(c: Checkpointer, step: int = 1) -> None:
    """``c`` saved ``step`` (a process's first save never yields), and an hour passes on the clock
    its writes yield by, so that its next periodic write has room to yield."""
    hour = [0.0]
    c._writer.yielding = yielding.YieldingWrites(lambda: hour[0])
    c.save(step, make_state(step))
    assert c.wait(GUARD)
    hour[0] = 3600.0


@needs_lift
def test_a_periodic_save_is_written_at_the_lowest_priority_a_final_one_and_uploads_at_normal(
        gcs_emulator, tmp_path: Path) -> None:
    c = ckpt(tmp_path, gcs_emulator, local=None, with_local=False)
    seen: dict[tuple[str, int], int] = {}
    written = threading.Event()  # waited for here, since c.wait() would lift the write

    def on_durable(tier: str, step: int) -> None:
        seen.setdefault((tier, step), nice())
        if (tier, step) == ("gcs", 1):
            written.set()

    after_a_first_save(c, 0)
    c.on_durable = on_durable
    c.save(1, make_state(1))  # periodic, while training
    assert written.wait(GUARD)
    c.save(2, make_state(2), every_tier=True)  # the final save: the loop has stopped
    assert c.wait(GUARD)
    c.close()
    assert seen[("persistent", 1)] == yielding.LOWEST
    assert seen[("persistent", 2)] == nice()
    assert seen[("gcs", 1)] == seen[("gcs", 2)] == nice()  # the uploader never inherits it


class HeldWrites:
    """The disk writes of a checkpointer report their nice value, wait to be let go, and report
    it again before they write."""

    def __init__(self, c: Checkpointer) -> None:
        self.seen: list[int] = []
        self.running, self._go, self._seen_again = threading.Event(), threading.Event(), threading.Event()
        self._c, self._write = c, c.layout.write
        c.layout.write = self._held  # type: ignore[method-assign]

    def _held(self, *a, **kw):
        self.seen.append(nice())
        self.running.set()
        assert self._go.wait(GUARD)
        self.seen.append(nice())
        self._seen_again.set()
        return self._write(*a, **kw)

    def let_go(self) -> list[int]:
        """Let the held write go on (later writes are not held); what it saw."""
        self._c.layout.write = self._write  # type: ignore[method-assign]
        self._go.set()
        assert self._seen_again.wait(GUARD)  # before anything that waits for the write lifts it
        return self.seen


@needs_lift
def test_a_yielding_write_is_lifted_when_the_next_save_comes_due(tmp_path: Path) -> None:
    c = ckpt(tmp_path, with_local=False, persistent=Policy(every_steps=2))
    after_a_first_save(c, 0)
    held = HeldWrites(c)
    c.save(2, make_state(2))
    assert held.running.wait(GUARD)
    assert not c.due(3) and held.seen == [yielding.LOWEST]  # not due yet: it goes on yielding
    assert not c.due(4)  # due, deferred while the write runs: lifted so that it ends soonest
    assert held.let_go() == [yielding.LOWEST, nice()] and c.stats["writes_lifted"] == 1
    assert c.wait(GUARD)
    assert c.due(4)
    c.close()


@needs_lift
def test_an_emergency_save_lifts_the_periodic_write_it_waits_for(tmp_path: Path, monkeypatch) -> None:
    c = ckpt(tmp_path, with_local=False)
    after_a_first_save(c, 0)
    held = HeldWrites(c)
    lifted = threading.Event()
    lift = yielding.lift
    monkeypatch.setattr(yielding, "lift", lambda: (lift(), lifted.set()))
    c.save(1, make_state(1))
    assert held.running.wait(GUARD)
    report: list = []
    t = threading.Thread(target=lambda: report.append(c.emergency_save(2, make_state(2),
                                                                       deadline=time.monotonic() + GUARD)))
    t.start()
    assert lifted.wait(GUARD)
    assert held.let_go() == [yielding.LOWEST, nice()]
    t.join(GUARD)
    assert report[0].persistent_ok
    c.close()


# ----------------------------------------------------------------------------- retention


def test_retention_keeps_last_k_per_tier(gcs_emulator, tmp_path: Path) -> None:
    c = ckpt(tmp_path, gcs_emulator, local=Policy(every_steps=1, keep=1),
             persistent=Policy(every_steps=1, keep=2), gcs=Policy(every_steps=1, keep=3))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / step_name(0)).mkdir()  # an old invalid leftover
    save_steps(c, range(1, 6))
    steps = lambda tier: [i.step for i in list_checkpoints(c.tiers[tier].store)]  # noqa: E731
    assert steps("local") == [5]
    assert steps("persistent") == [5, 4]
    assert steps("gcs") == [5, 4, 3]


def test_retention_never_deletes_the_newest_valid(tmp_path: Path) -> None:
    c = ckpt(tmp_path, with_local=False, persistent=Policy(every_steps=1, keep=1))
    save_steps(c, [1])
    # A newer, corrupt checkpoint appears (e.g. bit rot on an old disk); then a save of an older
    # step (after resuming from step 1). The valid newest is the one just written; the corrupt
    # newer folder is not counted as valid and step 1 stays... until a newer valid exists.
    (tmp_path / "run" / step_name(9)).mkdir()
    save_steps(c, [2])
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert step_name(2) in names and step_name(1) not in names and step_name(9) in names


# ----------------------------------------------------------------------------- emergency


def test_emergency_save_within_deadline(gcs_emulator, tmp_path: Path) -> None:
    c = ckpt(tmp_path, gcs_emulator)
    rep = c.emergency_save(7, make_state(7), deadline=time.monotonic() + 120, meta={"world_size": 1})
    assert rep.step == 7 and rep.persistent_ok and rep.gcs_ok is True
    assert "persistent saved" in rep.detail and "gcs uploaded" in rep.detail and "\n" not in rep.detail
    verify_dir(tmp_path / "run" / step_name(7))
    assert {i.step for i in list_checkpoints(c.tiers["gcs"].store) if i.valid} == {7}
    # The local SSD got it too: it dies with the VM, but serves a restart of the trainer in place.
    assert rep.local_ok and rep.complete and rep.saved
    verify_dir(tmp_path / "local" / step_name(7))


def test_emergency_save_without_gcs(tmp_path: Path) -> None:
    rep = ckpt(tmp_path, with_local=False).emergency_save(3, make_state(3), deadline=time.monotonic() + 60)
    assert rep.persistent_ok and rep.gcs_ok is None


def test_emergency_deadline_too_short_for_gcs(gcs_emulator, tmp_path: Path) -> None:
    c = ckpt(tmp_path, gcs_emulator)
    rep = c.emergency_save(8, make_state(8), deadline=time.monotonic() - 1)
    assert rep.persistent_ok and rep.gcs_ok is False and "gcs not done" in rep.detail
    assert not [i for i in list_checkpoints(c.tiers["gcs"].store) if i.valid]
    assert rep.saved and not rep.complete
    r = ckpt(tmp_path, gcs_emulator, with_local=False).restore()
    assert (r.step, r.tier) == (8, "persistent")


def test_emergency_upload_running_past_deadline_leaves_nothing_valid(gcs_emulator, faulty_gcs,
                                                                     tmp_path: Path) -> None:
    release = threading.Event()
    faulty_gcs.plan.add("upload", f"*{step_name(9)}/{TENSORS}", "hook", hook=lambda: release.wait(GUARD))
    c = ckpt(tmp_path, gcs_emulator, client=faulty_gcs)
    # The upload is held until after emergency_save has returned, i.e. past the deadline.
    rep = c.emergency_save(9, make_state(9), deadline=time.monotonic() + 1.0)
    assert rep.persistent_ok and rep.gcs_ok is False and "gcs not done" in rep.detail
    release.set()
    for th in threading.enumerate():
        if th.name == "checkpoint-emergency-upload":
            th.join(GUARD)
    assert not [i for i in list_checkpoints(c.tiers["gcs"].store) if i.valid]
    assert not any(name.endswith(MANIFEST) for name in c.tiers["gcs"].store.names(""))
    assert ckpt(tmp_path, gcs_emulator, with_local=False).restore().tier == "persistent"


def test_emergency_cuts_short_an_in_flight_upload(gcs_emulator, faulty_gcs, tmp_path: Path, logwatch) -> None:
    c = ckpt(tmp_path, gcs_emulator, client=faulty_gcs)
    other: list = []

    entered = threading.Event()

    def hang_until_aborted() -> None:
        job = c._uploads._active
        entered.set()
        assert job.abort.wait(GUARD)
        # Meanwhile the store still works for others sharing it (the goodput ledger mirror).
        def put() -> None:
            try:
                other.append(c.tiers["gcs"].store.put_bytes("ledger/e1", b"{}"))
            except Exception as e:  # noqa: BLE001
                other.append(e)

        th = threading.Thread(target=put)
        th.start()
        th.join(GUARD)

    # The periodic upload of step 4 hangs until the emergency save aborts it.
    faulty_gcs.plan.add("upload", f"*{step_name(4)}/{TENSORS}", "hook", hook=hang_until_aborted)
    c.save(4, make_state(4))
    assert entered.wait(GUARD)  # the upload of step 4 is in flight
    rep = c.emergency_save(5, make_state(5), deadline=time.monotonic() + 120)
    assert rep.persistent_ok and rep.gcs_ok is True
    valid = {i.step for i in list_checkpoints(c.tiers["gcs"].store) if i.valid}
    assert valid == {5}
    # The emergency save did not wait for it: the abandoned upload stops by itself afterwards.
    logwatch.wait_for("step 4 on gcs failed", GUARD)
    assert other == [None] and c.tiers["gcs"].store.get_bytes("ledger/e1") == b"{}"
    assert {i.step for i in list_checkpoints(c.tiers["persistent"].store) if i.valid} == {4, 5}


def test_emergency_save_of_an_already_saved_step(gcs_emulator, tmp_path: Path) -> None:
    c = ckpt(tmp_path, gcs_emulator)
    save_steps(c, [6])
    rep = c.emergency_save(6, make_state(6), deadline=time.monotonic() + 60)
    assert rep.persistent_ok and rep.gcs_ok is True


# ----------------------------------------------------------------------------- describe


def test_describe(gcs_emulator, tmp_path: Path) -> None:
    c = ckpt(tmp_path, gcs_emulator)
    save_steps(c, [1, 2])
    (tmp_path / "run" / step_name(2) / MANIFEST).unlink()
    d = c.describe()
    assert set(d["tiers"]) == {"local", "persistent", "gcs"}
    p = d["tiers"]["persistent"]
    assert p["newest_valid"] == 1
    assert [(x["step"], x["valid"]) for x in p["checkpoints"]] == [(2, False), (1, True)]
    assert "no manifest" in p["checkpoints"][0]["reason"]
    assert d["tiers"]["gcs"]["newest_valid"] == 2 and d["tiers"]["local"]["newest_valid"] == 2
    _flip(tmp_path / "local" / step_name(2) / TENSORS)
    deep = c.describe(deep=True)["tiers"]["local"]
    assert deep["newest_valid"] == 1 and "blake3 mismatch" in deep["checkpoints"][0]["reason"]
    assert d["stats"]["saves"] == 2


def test_restore_waits_for_an_in_flight_save_without_deadlock(gcs_emulator, faulty_gcs, tmp_path: Path) -> None:
    release = threading.Event()
    faulty_gcs.plan.add("upload", f"*{step_name(2)}/{TENSORS}", "hook", hook=lambda: release.wait(GUARD))
    c = ckpt(tmp_path, gcs_emulator, client=faulty_gcs, gcs=Policy(every_steps=1, keep=1))
    save_steps(c, [1])
    c.save(2, make_state(2))
    got: list = []
    th = threading.Thread(target=lambda: got.append(c.restore()), daemon=True)
    th.start()
    release.set()
    th.join(GUARD)
    assert not th.is_alive() and got[0].step == 2
    # Retention of the finished save ran: GCS keeps only step 2.
    assert [i.step for i in list_checkpoints(c.tiers["gcs"].store)] == [2]


def test_restore_with_gcs_unreachable_is_unknown_not_empty(gcs_emulator, tmp_path: Path, logwatch) -> None:
    # GCS may hold a newer checkpoint than the disk: a trainer's restore does not choose without
    # it (the caller waits); a read-only look (status) answers from the disk and says so.
    c = ckpt(tmp_path, gcs_emulator, with_local=False)
    save_steps(c, [1])
    gcs_emulator.emulator.stop()
    c2 = ckpt(tmp_path, gcs_emulator, with_local=False)
    c2.LIST_TIMEOUT_S = 0.5
    c2.tiers["gcs"].store.initial_backoff_s = 0.05
    with pytest.raises(TierUnknown) as e:
        c2.restore()
    assert list(e.value.tiers) == ["gcs"]
    with pytest.raises(TierUnknown):
        c2.newest_valid_step()
    r = c2.restore(download=False)
    assert (r.step, r.tier) == (1, "persistent")
    assert "cannot list checkpoints on gcs" in logwatch.text()
    assert "error" in c2.describe()["tiers"]["gcs"]
    gcs_emulator.emulator.start()
    assert c2.restore().step == 1


def test_retention_after_falling_back_keeps_what_was_just_written(tmp_path: Path) -> None:
    c = ckpt(tmp_path, with_local=False, persistent=Policy(every_steps=1, keep=2))
    save_steps(c, [2, 9])
    _flip(tmp_path / "run" / step_name(9) / TENSORS)  # sizes still right: passes the quick check
    c2 = ckpt(tmp_path, with_local=False, persistent=Policy(every_steps=1, keep=1))
    assert c2.restore().step == 2
    save_steps(c2, [3])
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names == [step_name(3), step_name(9)]  # 3 (just written) kept; newer 9 untouched
    assert ckpt(tmp_path, with_local=False).restore().step == 3


def test_reupload_replaces_a_partial_upload_of_the_same_step(gcs_emulator, faulty_gcs, tmp_path: Path,
                                                             logwatch) -> None:
    c = ckpt(tmp_path, gcs_emulator, client=faulty_gcs, with_local=False)
    c.tiers["gcs"].store.retry_timeout_s = 0.0  # fail at once
    faulty_gcs.plan.add("upload", f"*{step_name(4)}/{MANIFEST}", "503")
    save_steps(c, [4])
    assert c.stats["tier_writes_failed"] == 1
    info = {i.step: i for i in list_checkpoints(c.tiers["gcs"].store)}[4]
    assert not info.valid
    # Resumed from an older step, trained to step 4 again (different bytes): uploads cleanly,
    # although the leftover objects are create-only.
    shutil.rmtree(tmp_path / "run" / step_name(4))
    c.tiers["gcs"].store.retry_timeout_s = 30.0
    c.save(4, make_state(40))
    c.wait()
    assert "removing partial upload of step 4" in logwatch.text()
    shutil.rmtree(tmp_path / "run")
    r = ckpt(tmp_path, gcs_emulator, with_local=False).restore()
    assert r.step == 4 and same(r.state, make_state(40))


def test_second_interrupt_does_not_abort_the_emergency_save(gcs_emulator, faulty_gcs, tmp_path: Path,
                                                             logwatch) -> None:
    import signal

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals need the main thread")
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        def interrupt() -> None:  # a second Ctrl-C/SIGINT lands while the upload runs
            signal.raise_signal(signal.SIGINT)
            logwatch.wait_for("interrupt ignored", GUARD)

        faulty_gcs.plan.add("upload", f"*{step_name(3)}/{TENSORS}", "hook", hook=interrupt)
        c = ckpt(tmp_path, gcs_emulator, client=faulty_gcs)
        rep = c.emergency_save(3, make_state(3), deadline=time.monotonic() + 120)
    finally:
        signal.signal(signal.SIGINT, old)
    assert rep.persistent_ok and rep.gcs_ok is True
    assert {i.step for i in list_checkpoints(c.tiers["gcs"].store) if i.valid} == {3}


def test_restore_reserves_the_snapshot_buffer(tmp_path: Path) -> None:
    c = ckpt(tmp_path, with_local=False)
    save_steps(c, [1])
    c2 = ckpt(tmp_path, with_local=False)
    c2.restore()
    c2._survey._reserver.join(GUARD)
    assert c2.layout.buffers[0].allocations == 1
    c2.save(2, make_state(2))
    c2.wait()
    assert c2.layout.buffers[0].allocations == 1 and c2.layout.buffers[0].last_alloc_s == 0.0
    c3 = ckpt(tmp_path, with_local=False)
    c3.restore(download=False)
    assert c3._survey._reserver is None  # read-only look (status): no buffer


def test_the_other_layout_is_never_deleted_and_blocks_a_fresh_start(tmp_path: Path) -> None:
    """A run dir with sharded (fsdp) checkpoints: a whole-model checkpointer's retention keeps
    them, and its restore refuses to start afresh over them (exit 2 upstream)."""
    from trainer.checkpoint.sharded import Sharded

    run_dir = tmp_path / "run"
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sharded = checkpointer(run_dir=run_dir, layout=Sharded(), key=KEY)
    sharded.bind(model, opt)
    sharded.save(2, {"step": 2})
    sharded.close()
    plain = checkpointer(run_dir=run_dir, policies={"persistent": Policy(keep=1)}, key=KEY)
    for s in (4, 6):
        plain.save(s, make_state(s))
        plain.wait()
    assert (run_dir / step_name(2)).is_dir()  # retention kept the other layout's checkpoint
    assert not (run_dir / step_name(4)).exists()  # and applied keep=1 to its own
    with pytest.raises(ResumeMismatch, match=r'parallelism = "ddp", but its tiers hold .*persistent step 2'):
        plain.restore()
    plain.close()


# ----------------------------------------------------------------------------- written by others


def test_forged_newer_checkpoints_on_gcs_are_refused_kept_and_the_newest_authentic_restored(
        gcs_emulator, tmp_path: Path, logwatch) -> None:
    c = ckpt(tmp_path, gcs_emulator, with_local=False, gcs=Policy(every_steps=1, keep=2))
    save_steps(c, [1, 2])
    current, legacy = tmp_path / "ran-current-format", tmp_path / "ran-legacy"
    forge_in_bucket(gcs_emulator.client, gcs_emulator.uri, 2, 9, {STATE: code_running_pickle(current)})
    forge_in_bucket(gcs_emulator.client, gcs_emulator.uri, 2, 8, {"state.pt": code_running_pickle(legacy)},
                    legacy=True)
    shutil.rmtree(tmp_path / "run")  # a fresh disk: GCS decides
    for download in (False, True):
        r = ckpt(tmp_path, gcs_emulator, with_local=False).restore(download=download)
        assert (r.step, r.tier) == (2, "gcs") and same(r.state, make_state(2))
    assert not current.exists() and not legacy.exists()
    text = logwatch.text()
    assert "refusing gcs checkpoint step 9" in text and "unauthenticated: its manifest carries no HMAC" in text
    assert "refusing gcs checkpoint step 8" in text and "checkpoint format 1, written by an older spottrain" in text
    # Retention (keep=2) deletes older authentic ones and never the forged ones.
    save_steps(c, [3, 4, 5])
    names = bucket_names(gcs_emulator.client, gcs_emulator.uri)
    assert {n.split("/")[0] for n in names if n.endswith(MANIFEST)} == {step_name(s) for s in (4, 5, 8, 9)}


def test_only_unauthenticated_checkpoints_block_a_fresh_start_and_are_kept(tmp_path: Path) -> None:
    other = CheckpointKey(b"x" * 32, "the key that was lost")
    save_steps(ckpt(tmp_path, key=other, with_local=False), [1, 2])
    c = ckpt(tmp_path, with_local=False)
    with pytest.raises(ResumeMismatch, match=rf"no checkpoint on any tier is authentic under this run's "
                                             rf"checkpoint key {KEY.id}.*persistent step 2 .*names checkpoint key "
                                             rf'"{other.id}"'):
        c.restore()
    assert c.restore(download=False) is None  # a read-only look (status) just sees none
    # A save at an occupied step skips that tier rather than overwrite the kept checkpoint.
    save_steps(c, [2])
    assert "StepOccupied" in c.stats["last_error"]
    assert verify_dir(tmp_path / "run" / step_name(2), key=other)["step"] == 2
    assert ckpt(tmp_path, key=other, with_local=False).restore().step == 2  # the right key resumes


def test_a_verified_checkpoint_this_version_cannot_decode_is_a_resume_mismatch(tmp_path: Path) -> None:
    import json

    from trainer.checkpoint.file_hash import BLAKE3
    from trainer.checkpoint.manifest import build_manifest

    save_steps(ckpt(tmp_path, with_local=False), [1, 2])
    folder = tmp_path / "run" / step_name(2)
    state = (folder / STATE).read_text().replace('"$":"dict"', '"$":"newer-type"', 1)
    (folder / STATE).write_text(state)
    m = json.loads((folder / MANIFEST).read_text())
    m["files"][STATE] = BLAKE3.entry(len(state.encode()), BLAKE3.of(state.encode()))
    (folder / MANIFEST).write_bytes(build_manifest(2, m["files"], m["meta"], m["created_unix"], key=KEY))
    with pytest.raises(ResumeMismatch, match=r"cannot resume from step 2 on persistent .*verified but cannot be "
                                             r"decoded .*unknown tag 'newer-type'"):
        ckpt(tmp_path, with_local=False).restore()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [step_name(1), step_name(2)]


def test_the_same_step_again_keeps_this_sessions_copy_and_replaces_other_state(tmp_path: Path, logwatch) -> None:
    first = ckpt(tmp_path, with_local=False)
    save_steps(first, [3])
    folder = tmp_path / "run" / step_name(3)
    inode = (folder / TENSORS).stat().st_ino
    rep = first.emergency_save(3, make_state(3), deadline=time.monotonic() + GUARD)
    assert rep.persistent_ok and (folder / TENSORS).stat().st_ino == inode  # kept: same session, same state
    # Another session (an abandoned trajectory's step 3 is on disk) saves its own step 3.
    second = ckpt(tmp_path, with_local=False)
    second.save(3, make_state(33))
    second.wait()
    assert "verifies but holds other state" in logwatch.text()
    r = ckpt(tmp_path, with_local=False).restore()
    assert r.step == 3 and same(r.state, make_state(33))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [step_name(3)]


def test_a_download_that_fails_is_unknown_not_a_reason_to_fall_back(gcs_proxy, tmp_path: Path, logwatch) -> None:
    c = checkpointer(run_dir=tmp_path / "run", gcs_uri=gcs_proxy.uri, gcs_client=gcs_proxy.client(),
                     policies={"persistent": EVERY, "gcs": EVERY})
    save_steps(c, [1, 2])
    c.close()
    shutil.rmtree(tmp_path / "run")  # a blank disk: the checkpoints are only in GCS
    # The listing and the manifests answer; step 2's payload does not (403).
    gcs_proxy.proxy.add("GET", r"alt=media.* object=.*step-00000002/(?!manifest)", "status", status=403, times=None)
    c2 = checkpointer(run_dir=tmp_path / "run", gcs_uri=gcs_proxy.uri, gcs_client=gcs_proxy.client())
    with pytest.raises(TierUnknown, match="gcs: Forbidden"):
        c2.restore()  # not step 1 (older), not "nothing": step 2 exists
    assert "falling back" not in logwatch.text()
    gcs_proxy.proxy.clear()
    assert c2.restore().step == 2


@pytest.mark.parametrize(("what", "after"), [("payload", 0), ("manifest", 0), ("manifest", 1)],
                         ids=["payload", "manifest-quick-check", "manifest-download"])
def test_bytes_flipped_in_transit_are_read_again_not_a_bad_checkpoint(gcs_proxy, tmp_path: Path, logwatch,
                                                                       what: str, after: int) -> None:
    """One read of step 2 arrives with a byte flipped (the object in the bucket is intact): the
    payload or the manifest the download reads, or the manifest the restore's quick check reads
    first. The restore reads it again and resumes from step 2, not from step 1 (nor nothing)."""
    c = checkpointer(run_dir=tmp_path / "run", gcs_uri=gcs_proxy.uri, gcs_client=gcs_proxy.client(),
                     policies={"persistent": EVERY, "gcs": EVERY}, key=KEY)
    save_steps(c, [1, 2])
    c.close()
    shutil.rmtree(tmp_path / "run")  # a blank disk: the checkpoints are only in GCS
    name = r"manifest\.json" if what == "manifest" else r"(?!manifest)"
    rule = gcs_proxy.proxy.add("GET", rf"alt=media.* object=.*step-00000002/{name}", "flip", times=1, after=after)
    r = checkpointer(run_dir=tmp_path / "run", gcs_uri=gcs_proxy.uri, gcs_client=gcs_proxy.client(), key=KEY).restore()
    assert rule.hits == 1, gcs_proxy.proxy.seen("GET")
    assert (r.step, r.tier) == (2, "gcs"), logwatch.text()
    assert "falling back" not in logwatch.text()
    if (what, after) != ("manifest", 0):
        assert "event=download_retry tier=gcs step=2 read=1" in logwatch.text()


def test_a_copy_corrupt_on_every_read_is_still_bad(gcs_proxy, tmp_path: Path, logwatch) -> None:
    """Flipped on every read (or corrupt in the bucket): after DOWNLOAD_READS reads it is invalid,
    and the restore falls back to step 1."""
    from trainer.checkpoint.checkpointer import DOWNLOAD_READS

    c = checkpointer(run_dir=tmp_path / "run", gcs_uri=gcs_proxy.uri, gcs_client=gcs_proxy.client(),
                     policies={"persistent": EVERY, "gcs": EVERY}, key=KEY)
    save_steps(c, [1, 2])
    c.close()
    shutil.rmtree(tmp_path / "run")
    gcs_proxy.proxy.add("GET", r"alt=media.* object=.*step-00000002/(?!manifest)", "flip", times=None)
    r = checkpointer(run_dir=tmp_path / "run", gcs_uri=gcs_proxy.uri, gcs_client=gcs_proxy.client(), key=KEY).restore()
    assert r.step == 1
    text = logwatch.text()
    assert text.count("event=download_retry tier=gcs step=2") == DOWNLOAD_READS - 1
    assert not (tmp_path / "run" / step_name(2)).exists()


# ----------------------------------------------------------------------------- real faults
# Cloud Storage behind the fault proxy (tests/conftest.py: gcs_proxy) and real small filesystems
# that fill up or turn read-only (small_fs).


def proxied(tmp_path: Path, gcs_proxy, *, run_dir: Path | None = None, with_local: bool = False,
            **policies) -> Checkpointer:
    pol = {"local": EVERY, "persistent": EVERY, "gcs": EVERY}
    pol.update(policies)
    c = checkpointer(run_dir=run_dir or tmp_path / "run", local_dir=(tmp_path / "local") if with_local else None,
                     gcs_uri=gcs_proxy.uri, gcs_client=gcs_proxy.client(),
                     policies={k: v for k, v in pol.items() if v is not None})
    c.tiers["gcs"].store.initial_backoff_s, c.tiers["gcs"].store.max_backoff_s = 0.05, 0.2
    # A stalled request is held until the test releases it: the client must never be what ends it.
    c.tiers["gcs"].store.request_timeout_s = 3600
    return c


def obj(gcs_proxy, step: int, name: str) -> str:
    """The fault proxy's pattern for one object of one checkpoint."""
    prefix = gcs_proxy.uri.split("/", 3)[3]
    return rf"object={prefix}/{step_name(step)}/{name.replace('.', '[.]')}$"


def in_thread(fn) -> list:
    """Run ``fn`` on a thread and wait for it (at most GUARD); its result in a list (empty when
    it did not return)."""
    out: list = []
    th = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    th.start()
    th.join(GUARD)
    return out


def gcs_steps(c: Checkpointer) -> set[int]:
    return {i.step for i in list_checkpoints(c.tiers["gcs"].store) if i.valid}


def test_a_403_on_the_final_manifest_is_not_durable_until_saved_again(gcs_proxy, tmp_path: Path) -> None:
    c = proxied(tmp_path, gcs_proxy)
    rule = gcs_proxy.proxy.add("POST", obj(gcs_proxy, 5, MANIFEST), "status", status=403, times=None)
    c.save(5, make_state(5), every_tier=True)
    d = c.durable(5, deadline=time.monotonic() + GUARD)
    assert not d.ok and d.missing == ["gcs"] and d.tiers["persistent"] == "ok"
    assert "no manifest" in d.tiers["gcs"] and "gcs NOT DURABLE" in d.detail
    assert "gcs" in c.failing() and "403" in c.failing()["gcs"]["error"]
    disk_copy = (tmp_path / "run" / step_name(5) / TENSORS).stat()
    # Saving again writes only what is missing: the disk copy stays as it was, GCS gets it.
    gcs_proxy.proxy.release(rule)
    c.save(5, make_state(5), every_tier=True)
    assert c.durable(5, deadline=time.monotonic() + GUARD).ok
    assert (tmp_path / "run" / step_name(5) / TENSORS).stat().st_ino == disk_copy.st_ino
    assert gcs_steps(c) == {5} and not c.failing()


def test_gcs_down_at_the_end_is_not_durable_by_the_deadline(gcs_proxy, tmp_path: Path) -> None:
    c = proxied(tmp_path, gcs_proxy)
    gcs_proxy.proxy.down()
    c.save(6, make_state(6), every_tier=True)
    d = c.durable(6, deadline=time.monotonic() + 1.0)  # the upload keeps retrying: cut short
    assert not d.ok and d.missing == ["gcs"] and "cannot check it" in d.tiers["gcs"]
    assert not c.uploading() and c.abandoned == 1
    gcs_proxy.proxy.up()
    c.save(6, make_state(6), every_tier=True)
    assert c.durable(6, deadline=time.monotonic() + GUARD).ok and gcs_steps(c) == {6}


def test_a_full_run_dir_still_gets_the_save_to_gcs_from_host_memory(gcs_proxy, small_fs, tmp_path: Path,
                                                                    logwatch) -> None:
    pd = small_fs("pd", 1 << 20)
    (pd.path / "run").mkdir()
    pd.fill()
    c = proxied(tmp_path, gcs_proxy, run_dir=pd.path / "run")
    c.save(3, make_state(3))
    c.wait()
    assert "step 3 on persistent failed" in logwatch.text() and "No space left" in c.failing()["persistent"]["error"]
    assert "uploading it to gcs from host memory" in logwatch.text()
    assert gcs_steps(c) == {3}
    d = c.durable(3, deadline=time.monotonic() + GUARD)
    assert d.tiers == {"persistent": "step 3 is not there", "gcs": "ok"}
    c.close()
    r = proxied(tmp_path, gcs_proxy, run_dir=tmp_path / "fresh").restore()
    assert (r.step, r.tier) == (3, "gcs") and same(r.state, make_state(3))


def test_a_read_only_run_dir_emergency_save_uses_the_local_ssd_and_gcs(gcs_proxy, small_fs, tmp_path: Path) -> None:
    pd = small_fs("pd", 4 << 20)
    c = proxied(tmp_path, gcs_proxy, run_dir=pd.path / "run", with_local=True)
    save_steps(c, [1])
    pd.readonly()  # ext4's errors=remount-ro after an I/O error
    rep = c.emergency_save(2, make_state(2), deadline=time.monotonic() + GUARD)
    assert (rep.local_ok, rep.persistent_ok, rep.gcs_ok) == (True, False, True), rep.detail
    assert rep.saved and not rep.complete
    assert "persistent FAILED" in rep.detail and "Read-only file system" in rep.detail
    assert gcs_steps(c) >= {2}
    verify_dir(tmp_path / "local" / step_name(2))


def test_an_emergency_save_only_the_local_ssd_got_is_not_saved(gcs_proxy, small_fs, tmp_path: Path) -> None:
    pd = small_fs("pd", 4 << 20)
    c = proxied(tmp_path, gcs_proxy, run_dir=pd.path / "run", with_local=True)
    pd.readonly()
    gcs_proxy.proxy.down()
    rep = c.emergency_save(2, make_state(2), deadline=time.monotonic() + 1.0)
    assert (rep.local_ok, rep.persistent_ok, rep.gcs_ok) == (True, False, False), rep.detail
    assert not rep.saved and "only on local" in rep.detail and "lost with the VM" in rep.detail
    verify_dir(tmp_path / "local" / step_name(2))  # a restart of the trainer on this VM resumes from it


def test_a_stalled_upload_never_holds_the_emergency_save(gcs_proxy, tmp_path: Path) -> None:
    c = proxied(tmp_path, gcs_proxy)
    stall = gcs_proxy.proxy.add("POST", obj(gcs_proxy, 1, TENSORS), "stall")
    c.save(1, make_state(1))
    assert gcs_proxy.proxy.wait_stalled(stall, timeout=GUARD)
    got = in_thread(lambda: c.emergency_save(2, make_state(2), deadline=time.monotonic() + GUARD))
    assert got, "the emergency save waited for the stalled upload"
    assert got[0].persistent_ok and got[0].gcs_ok is True and got[0].complete, got[0].detail
    assert stall.held == 1  # still stalled: nothing waited for it
    assert gcs_steps(c) == {2}


def test_a_stalled_retention_listing_never_holds_the_emergency_save(gcs_proxy, tmp_path: Path, logwatch) -> None:
    c = proxied(tmp_path, gcs_proxy, gcs=Policy(every_steps=1, keep=1))
    save_steps(c, [1])
    prefix = gcs_proxy.uri.split("/", 3)[3].replace("/", "%2F")
    # Retention lists every checkpoint (prefix "step-"); a check of one step lists "step-N/".
    stall = gcs_proxy.proxy.add("GET", rf"/o\?(.*&)?prefix={prefix}%2Fstep-(&|$)", "stall")
    c.save(2, make_state(2))
    assert gcs_proxy.proxy.wait_stalled(stall, timeout=GUARD)
    assert "step 2 durable on gcs" in logwatch.text()  # retention comes after the upload
    # The next disk save and its retention go on meanwhile (GCS retention holds no disk tier up).
    c.save(3, make_state(3))
    c._writer.thread.join(GUARD)
    assert not c._writer.busy(), "the disk writer waited for GCS retention"
    got = in_thread(lambda: c.emergency_save(4, make_state(4), deadline=time.monotonic() + GUARD))
    assert got and got[0].complete, got[0].detail if got else "the emergency save waited for retention"
    assert stall.held == 1
    assert gcs_steps(c) == {1, 2, 4}  # retention was cut short: nothing it would delete is gone yet
    assert {i.step for i in list_checkpoints(c.tiers["persistent"].store) if i.valid} == {1, 2, 3, 4}


def test_a_stalled_upload_never_holds_the_disk_saves_hostage(gcs_proxy, tmp_path: Path, logwatch) -> None:
    c = proxied(tmp_path, gcs_proxy)
    stall = gcs_proxy.proxy.add("POST", obj(gcs_proxy, 1, TENSORS), "stall")
    c.save(1, make_state(1))
    assert gcs_proxy.proxy.wait_stalled(stall, timeout=GUARD)
    for step in (2, 3, 4):
        c._writer.thread.join(GUARD)  # the previous save's disk writer: done, while the upload is stalled
        assert c.due(step)
        c.save(step, make_state(step))
    c._writer.thread.join(GUARD)
    assert {i.step for i in list_checkpoints(c.tiers["persistent"].store) if i.valid} == {1, 2, 3, 4}
    assert stall.held == 1 and c.stats["uploads_superseded"] == 2  # 2 and 3 gave way to 4
    gcs_proxy.proxy.release(stall)
    c.wait()
    assert gcs_steps(c) == {1, 4}


def test_host_buffers_stay_at_two_while_uploads_from_memory_are_stalled(gcs_proxy, small_fs, tmp_path: Path) -> None:
    pd = small_fs("pd", 4 << 20)
    c = proxied(tmp_path, gcs_proxy, run_dir=pd.path / "run")
    pd.readonly()  # every save has to go to GCS from host memory
    stall = gcs_proxy.proxy.add("POST", obj(gcs_proxy, 1, TENSORS), "stall")
    c.save(1, make_state(1))  # its upload owns the first buffer while it is stalled
    assert gcs_proxy.proxy.wait_stalled(stall, timeout=GUARD)
    for step in (2, 3):
        c._writer.thread.join(GUARD)
        assert c.due(step)  # a second buffer; then the queued upload of 2 gives its buffer to 3
        c.save(step, make_state(step))
    c._writer.thread.join(GUARD)
    assert len(c.layout.buffers) == 2 and c.stats["uploads_superseded"] == 1
    gcs_proxy.proxy.release(stall)
    c.wait()
    assert gcs_steps(c) == {1, 3} and not c.layout._buffers.held
    r = proxied(tmp_path, gcs_proxy, run_dir=tmp_path / "fresh").restore()
    assert r.step == 3 and same(r.state, make_state(3))


# ----------------------------------------------------------------------------- a tier is a record


def test_a_second_remote_tier_is_one_more_row_of_the_table(gcs_emulator, tmp_path: Path) -> None:
    """A second bucket (another region) needs a store and a row, nothing in the checkpointer:
    saves and the emergency save reach it, durability asks it, a restore takes it."""
    from trainer.checkpoint.stores import DirStore, GcsStore
    from trainer.checkpoint.tiers import Cadence, Roles, Tier, Tiers

    def table(run: Path) -> Tiers:
        every = Cadence(every_steps=1)
        return Tiers([Tier("persistent", DirStore(run, "persistent"), durable=True, remote=False, cadence=every),
                      Tier("gcs", GcsStore(gcs_emulator.uri, client=gcs_emulator.client), durable=True, remote=True,
                           cadence=every),
                      Tier("gcs-eu", GcsStore(gcs_emulator.uri + "-eu", client=gcs_emulator.client), durable=True,
                           remote=True, cadence=every)],
                     Roles(home="persistent", lease="gcs", mirror="gcs"))

    c = Checkpointer(table(tmp_path / "run"), key=KEY)
    save_steps(c, [1, 2])
    for name in ("gcs", "gcs-eu"):
        assert [i.step for i in list_checkpoints(c.tiers[name].store) if i.valid] == [2, 1]
    assert c.durable(2, deadline=time.monotonic() + GUARD).tiers == {"persistent": "ok", "gcs": "ok", "gcs-eu": "ok"}
    rep = c.emergency_save(3, make_state(3), deadline=time.monotonic() + GUARD)
    assert rep.ok == {"persistent": True, "gcs": True, "gcs-eu": True} and rep.complete, rep.detail
    c.close()
    # Only the second bucket still has step 3 (a lost disk, the first region down for good).
    c.tiers["gcs"].store.delete_prefix(step_name(3) + "/")
    r = Checkpointer(table(tmp_path / "blank"), key=KEY).restore()
    assert r is not None and (r.step, r.tier) == (3, "gcs-eu") and same(r.state, make_state(3))
