"""Checkpoints planted in the bucket of a run that has none of its own (issue 28, item 2).

Someone who can write the bucket but lacks the key copies another run's authentic checkpoint, or
an unsigned forgery, into the prefix of a run with no checkpoint of its own left. The run decides
from its own signed run record (``trainer.checkpoint.run_record``) whether it saved before; either
way it sets them aside (never loaded, deleted or overwritten) and trains, saying so
(``Checkpointer.set_aside``; the session turns it into the ``checkpoints_set_aside`` event). What a
bucket writer cannot do: plant a record that makes the run believe it saved, or have a tier it
cannot read decide "never saved". Unauthenticated checkpoints on a disk tier (the run's own under
a lost key) still stop the run: no bucket writer can put them there.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from drill.attacker import copy_step, delete_step, plant
from tests.trainer.support import Policy, bucket_names, checkpointer, code_running_pickle, forge_in_bucket, run_key
from trainer.checkpoint import run_record
from trainer.checkpoint.key import CheckpointKey
from trainer.checkpoint.manifest import MANIFEST, ResumeMismatch
from trainer.checkpoint.tier_wait import TierUnknown
from trainer.checkpoint.whole_model import STATE

EVERY = Policy(every_steps=1, keep=10)
KEY = run_key()


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(4, 4, generator=g)}, "step": step}


def ckpt(run_dir: Path, uri: str, client, *, key: CheckpointKey | None = None):
    """A run's checkpointer: its disk ``run_dir`` and its bucket prefix ``uri``, its key bound to
    that prefix as ``trainer run`` binds it."""
    return checkpointer(run_dir=run_dir, gcs_uri=uri, gcs_client=client,
                        policies={"persistent": EVERY, "gcs": EVERY}, key=(key or KEY).bound_to(uri))


def save(c, steps) -> None:
    for s in steps:
        c.save(s, state(s), meta={"world_size": 1})
        c.wait()


def manifests(client, uri: str) -> dict[str, bytes]:
    bucket, _, prefix = uri[len("gs://"):].partition("/")
    return {n: client.bucket(bucket).blob(f"{prefix}/{n}").download_as_bytes()
            for n in bucket_names(client, uri) if n.endswith(MANIFEST)}


def another_runs_step(tmp_path: Path, emu, step: int) -> str:
    """Another run of the experiment (same key, its own prefix) saves ``step``; its prefix."""
    other = emu.uri + "-other"
    c = ckpt(tmp_path / "other-run", other, emu.client)
    save(c, [step])
    c.close()
    return other


def test_planted_checkpoints_at_a_first_boot_are_set_aside_and_the_run_trains(gcs_emulator, tmp_path: Path) -> None:
    emu = gcs_emulator
    other = another_runs_step(tmp_path, emu, 5)
    copy_step(emu.client, other, emu.uri, 5)  # authentic, signed for the other run
    ran = tmp_path / "ran"
    forge_in_bucket(emu.client, emu.uri, 5, 7, {STATE: code_running_pickle(ran)})  # no HMAC
    planted = manifests(emu.client, emu.uri)

    c = ckpt(tmp_path / "run", emu.uri, emu.client)
    assert c.restore() is None  # a fresh start, not exit 2
    aside = c.set_aside
    assert aside is not None and not aside.saved_before and aside.steps == (5, 7)
    assert any("another run's: signed for the run at" in f for f in aside.found)
    assert any("unauthenticated: its manifest carries no HMAC" in f for f in aside.found)
    assert "this run never saved a checkpoint (no run record at gs://" in aside.message
    # It trains and saves beside them: its own step 5 skips the bucket rather than overwrite.
    save(c, [1, 5, 6])
    assert "StepOccupied" in c.stats["last_error"]
    c.close()
    assert {k: v for k, v in manifests(emu.client, emu.uri).items() if k in planted} == planted
    assert not ran.exists()
    # Its own record is there now, and the next boot (a blank disk) resumes its own newest step.
    assert run_record.read(c.tiers["gcs"].store, KEY.bound_to(emu.uri))[0]
    shutil.rmtree(tmp_path / "run")
    again = ckpt(tmp_path / "run", emu.uri, emu.client)
    r = again.restore()
    assert (r.step, r.tier) == (6, "gcs") and again.set_aside is None
    assert not ran.exists()


def test_a_run_that_saved_before_says_so_and_trains(gcs_emulator, tmp_path: Path) -> None:
    """Its checkpoints deleted from the bucket, its disk blank, another run's planted: the run's
    own record proves it saved. It does not stop for good (a mere deleter could do that); it says
    its checkpoints are gone, and trains."""
    emu = gcs_emulator
    c = ckpt(tmp_path / "run", emu.uri, emu.client)
    save(c, [1, 2])
    c.close()
    for s in (1, 2):
        delete_step(emu.client, emu.uri, s)
    shutil.rmtree(tmp_path / "run")
    copy_step(emu.client, another_runs_step(tmp_path, emu, 3), emu.uri, 3)

    c = ckpt(tmp_path / "run", emu.uri, emu.client)
    assert c.restore() is None
    assert c.set_aside.saved_before and c.set_aside.steps == (3,)
    assert "this run saved before (the run record at gs://" in c.set_aside.message
    assert "soft delete" in c.set_aside.message


@pytest.mark.parametrize("record", ["another run's", "unsigned", "garbage"])
def test_a_bucket_writer_cannot_plant_a_record_that_the_run_saved(gcs_emulator, tmp_path: Path, record: str) -> None:
    emu = gcs_emulator
    other = another_runs_step(tmp_path, emu, 4)
    copy_step(emu.client, other, emu.uri, 4)
    bucket, _, prefix = other[len("gs://"):].partition("/")
    genuine = emu.client.bucket(bucket).blob(f"{prefix}/{run_record.RECORD_KEY}").download_as_bytes()
    data = {"another run's": genuine,
            "unsigned": genuine.replace(b'"hmac"', b'"hmac_"').replace(other.encode(), emu.uri.encode()),
            "garbage": b"[" * 100_000}[record]
    plant(emu.client, emu.uri, run_record.RECORD_KEY, data)

    c = ckpt(tmp_path / "run", emu.uri, emu.client)
    assert c.restore() is None
    assert not c.set_aside.saved_before  # the planted record proves nothing
    assert "proves nothing" in c.set_aside.record


def test_a_record_that_cannot_be_read_is_unknown_never_never_saved(gcs_proxy, tmp_path: Path) -> None:
    """The listing answers, the run record's download does not (403): the tier is unknown, so the
    restore waits (start-up's wait, then exit 69) rather than decide that the run never saved."""
    other = gcs_proxy.uri + "-other"
    c = ckpt(tmp_path / "other-run", other, gcs_proxy.client())
    save(c, [2])
    c.close()
    copy_step(gcs_proxy.client(), other, gcs_proxy.uri, 2)
    plant(gcs_proxy.client(), gcs_proxy.uri, run_record.RECORD_KEY, b"{}")
    gcs_proxy.proxy.add("GET", r"alt=media.* object=.*run-record\.json", "status", status=403, times=None)
    c = ckpt(tmp_path / "run", gcs_proxy.uri, gcs_proxy.client())
    with pytest.raises(TierUnknown, match="gcs: run record: Forbidden"):
        c.restore()
    assert c.set_aside is None
    gcs_proxy.proxy.clear()
    assert c.restore() is None and not c.set_aside.saved_before


def test_a_lost_key_stops_the_run_while_its_disk_holds_them_and_not_with_a_blank_disk(gcs_emulator,
                                                                                       tmp_path: Path) -> None:
    """Checkpoints signed with a key the run no longer has: on its own disk they can only be its
    own (no bucket writer writes there): exit 2, as always. With the disk gone, the bucket's copies
    and record cannot be told from a forgery: the run starts beside them, never deleting them."""
    emu, lost = gcs_emulator, CheckpointKey(b"L" * 32, "the key that was lost")
    save(ckpt(tmp_path / "run", emu.uri, emu.client, key=lost), [1, 2])
    with pytest.raises(ResumeMismatch, match=rf"no checkpoint on any tier is authentic under this run's checkpoint "
                                             rf"key {KEY.id}.*persistent step 2 "):
        ckpt(tmp_path / "run", emu.uri, emu.client).restore()
    shutil.rmtree(tmp_path / "run")
    before = manifests(emu.client, emu.uri)
    c = ckpt(tmp_path / "run", emu.uri, emu.client)
    assert c.restore() is None and not c.set_aside.saved_before
    assert f'names checkpoint key "{lost.id}"' in c.set_aside.record  # bucket text, quoted
    save(c, [3])
    c.close()
    assert {k: v for k, v in manifests(emu.client, emu.uri).items() if k in before} == before
    assert ckpt(tmp_path / "blank", emu.uri, emu.client, key=lost).restore().step == 2  # the right key resumes
