"""trainer.checkpoint.format, .manifest and .whole_model: the on-disk/on-GCS format, verification
and listing, with whole-model checkpoints."""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from trainer.checkpoint.format import delete_checkpoint, download_dir, tensor_digest
from trainer.checkpoint.manifest import (MANIFEST, CheckpointInvalid, CheckpointUnloadable, build_manifest, parse_step,
                                         quarantined, step_name)
from trainer.checkpoint.whole_model import (STATE, TENSORS, SnapshotBuffer, load_dir, parse_manifest, verify_dir,
                                            write_dir)
from trainer.checkpoint.whole_model import list_whole as list_checkpoints
from trainer.checkpoint.key import CheckpointKey
from trainer.checkpoint.state_codec import NotPlainData
from trainer.checkpoint.stores import DirStore, GcsStore

KEY = CheckpointKey(b"k" * 32, "test key")
OTHER_KEY = CheckpointKey(b"o" * 32, "another key")


def nested_state() -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 6, generator=g)
    return {
        "model": OrderedDict([("w", w), ("tied", w), ("b", torch.zeros(6, dtype=torch.bfloat16))]),
        "optim": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(8, 6, generator=g)}},
                  "param_groups": [{"lr": 1e-3, "params": [0]}]},
        "odd": [torch.arange(12).reshape(3, 4).t(),  # non-contiguous
                torch.zeros(0, 3), torch.tensor([True, False]), torch.randn(2, dtype=torch.complex64, generator=g),
                torch.nn.Parameter(torch.ones(2)),
                torch.randn(3, dtype=torch.complex64, generator=g).conj(),  # lazy conjugate view
                torch.randn(4, generator=g)[1:3]],  # view with a storage offset
        "rng": {"python": random.Random(1).getstate(), "torch": torch.get_rng_state()},
        "data": {"epoch": 2, "index": 1234, "order": (3, 1, 2), "name": "tiny", "none": None, "set": {1, 2}},
        "step": 42,
    }


def assert_same(a, b) -> None:
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        assert type(a) is type(b) and a.requires_grad == b.requires_grad
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def write(root: Path, step: int, state=None, meta=None, key: CheckpointKey | None = KEY) -> Path:
    snap = SnapshotBuffer().take(step, nested_state() if state is None else state, meta or {"world_size": 4})
    folder, _ = write_dir(snap, root, key=key, writer="test")
    return folder


def test_roundtrip_nested_state(tmp_path: Path) -> None:
    state = nested_state()
    folder = write(tmp_path, 42, state)
    assert folder.name == "step-00000042" and parse_step(folder.name) == 42
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, STATE, TENSORS]
    manifest, loaded = load_dir(folder, key=KEY)
    assert_same(state, loaded)
    # Tied weights stay tied; nothing else aliases.
    assert loaded["model"]["w"] is loaded["model"]["tied"]
    assert loaded["model"]["b"].data_ptr() != loaded["model"]["w"].data_ptr()


def test_manifest_contents(tmp_path: Path) -> None:
    folder = write(tmp_path, 7, meta={"world_size": 4, "fingerprint": "abc"})
    m = json.loads((folder / MANIFEST).read_text())
    assert m["step"] == 7 and m["world_size"] == 4 and m["meta"]["fingerprint"] == "abc"
    assert m["torch_version"] == torch.__version__ and m["created"].endswith("Z")
    import blake3

    def tree(data: bytes) -> str:  # independent re-implementation of the documented digest
        chunks = [data[i : i + (16 << 20)] for i in range(0, len(data), 16 << 20)]
        return blake3.blake3(b"".join(blake3.blake3(c).digest() for c in chunks)).hexdigest()

    assert m["hash"] == "blake3-of-16MiB-chunk-blake3s"
    for name in (STATE, TENSORS):
        data = (folder / name).read_bytes()
        assert m["files"][name] == {"size": len(data), "blake3": tree(data)}
    assert verify_dir(folder, key=KEY)["step"] == 7


def test_snapshot_is_isolated_from_later_mutation(tmp_path: Path) -> None:
    state = {"w": torch.zeros(4), "pos": {"i": 1}, "hist": [1]}
    buf = SnapshotBuffer()
    snap = buf.take(1, state)
    state["w"].add_(5)
    state["pos"]["i"] = 99
    state["hist"].append(2)
    folder, _ = write_dir(snap, tmp_path)
    _, loaded = load_dir(folder)
    assert torch.equal(loaded["w"], torch.zeros(4))
    assert loaded["pos"] == {"i": 1} and loaded["hist"] == [1]


def test_snapshot_buffer_is_reused(tmp_path: Path) -> None:
    buf = SnapshotBuffer()
    state = {"a": torch.randn(100), "b": torch.randn(10)}
    a1 = buf.take(1, state).arena
    a2 = buf.take(2, state).arena
    assert buf.allocations == 1 and a1.data_ptr() == a2.data_ptr()
    buf.take(3, {"a": torch.randn(50)})  # smaller: reused
    assert buf.allocations == 1
    buf.take(4, {"a": torch.randn(1000)})  # bigger: reallocated once
    assert buf.allocations == 2


def test_numpy_rng_state_round_trips_exactly_without_pickle(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    from trainer.loop.state import rng_state, set_rng_state

    np.random.seed(3)
    np.random.standard_normal()  # a cached Gaussian is part of the state too
    saved = rng_state()
    want = np.random.random(5)
    np.random.seed(99)
    _, loaded = load_dir(write(tmp_path, 1, {"rng": saved, "w": torch.ones(3)}), key=KEY)
    set_rng_state(loaded["rng"])
    assert np.array_equal(np.random.random(5), want)
    assert "pickle" not in (tmp_path / step_name(1) / STATE).read_text()  # plain JSON: ints, floats


def test_state_that_is_not_plain_data_fails_at_save_naming_where(tmp_path: Path) -> None:
    class Schedule:  # a custom object in a task's scheduler state
        pass

    with pytest.raises(NotPlainData, match=r"state\['scheduler'\]\['fns'\]\[1\] is a .*Schedule, not plain data"):
        SnapshotBuffer().take(1, {"scheduler": {"fns": [None, Schedule()]}, "w": torch.ones(2)})
    np = pytest.importorskip("numpy")
    with pytest.raises(NotPlainData, match=r"state\['pos'\] is a numpy.int64, not plain data \(numpy: use"):
        SnapshotBuffer().take(1, {"pos": np.int64(3)})
    with pytest.raises(NotPlainData, match=r"state\['q'\] is a Tensor \(layout torch.sparse_coo"):
        SnapshotBuffer().take(1, {"q": torch.eye(2).to_sparse()})


def truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [
    (lambda f: truncate(f / TENSORS), "truncated"),
    (lambda f: flip(f / TENSORS), "tensors.bin blake3 mismatch"),
    (lambda f: flip(f / STATE), "state.json blake3 mismatch"),
    (lambda f: (f / STATE).unlink(), "missing"),
    (lambda f: (f / MANIFEST).unlink(), "no manifest"),
    (lambda f: truncate(f / MANIFEST), "not valid JSON"),
    (lambda f: (f / MANIFEST).write_text((f / MANIFEST).read_text().replace('"step": 5', '"step": 6')),
     "manifest checksum mismatch"),
])
def test_corruption_is_detected(tmp_path: Path, damage, reason: str) -> None:
    folder = write(tmp_path, 5)
    damage(folder)
    with pytest.raises(CheckpointInvalid, match=reason):
        load_dir(folder, key=KEY)
    with pytest.raises(CheckpointInvalid) as e:
        verify_dir(folder, key=KEY)
    assert not quarantined(str(e.value))  # corruption, not a checkpoint to keep


def test_listing_quick_check(tmp_path: Path) -> None:
    store = DirStore(tmp_path, "persistent")
    for s in (1, 2, 3):
        write(tmp_path, s)
    (tmp_path / step_name(2) / MANIFEST).unlink()
    truncate(tmp_path / step_name(3) / TENSORS)
    (tmp_path / ".tmp-step-00000009-x").mkdir()  # an interrupted write: invisible
    (tmp_path / "ledger.json").write_text("{}")   # other files in the run dir are ignored
    infos = list_checkpoints(store)
    assert [(i.step, i.valid) for i in infos] == [(3, False), (2, False), (1, True)]
    assert "truncated" in infos[0].reason and "no manifest" in infos[1].reason
    delete_checkpoint(store, 3)
    assert [i.step for i in list_checkpoints(store)] == [2, 1]


def test_write_refuses_existing_step(tmp_path: Path) -> None:
    write(tmp_path, 1)
    with pytest.raises(FileExistsError):
        write(tmp_path, 1)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_gcs_upload_download_and_partial_uploads(gcs_emulator, tmp_path: Path) -> None:
    gcs = GcsStore(gcs_emulator.uri, client=gcs_emulator.client)
    state = nested_state()
    folder = write(tmp_path / "src", 10, state)
    for name in (TENSORS, STATE, MANIFEST):  # what an upload does: the payload, the manifest last
        gcs.put_file(folder / name, f"{step_name(10)}/{name}")
    # Partial upload: payload without a manifest.
    f11 = write(tmp_path / "src", 11)
    gcs.put_file(f11 / TENSORS, f"{step_name(11)}/{TENSORS}")
    gcs.put_file(f11 / STATE, f"{step_name(11)}/{STATE}")
    # Manifest referencing a missing object.
    f12 = write(tmp_path / "src", 12)
    gcs.put_file(f12 / STATE, f"{step_name(12)}/{STATE}")
    gcs.put_bytes(f"{step_name(12)}/{MANIFEST}", (f12 / MANIFEST).read_bytes())
    # Manifest referencing a short object.
    f13 = write(tmp_path / "src", 13)
    gcs.put_bytes(f"{step_name(13)}/{TENSORS}", (f13 / TENSORS).read_bytes()[:100])
    gcs.put_file(f13 / STATE, f"{step_name(13)}/{STATE}")
    gcs.put_bytes(f"{step_name(13)}/{MANIFEST}", (f13 / MANIFEST).read_bytes())
    infos = {i.step: i for i in list_checkpoints(gcs)}
    assert infos[10].valid
    assert not infos[11].valid and "no manifest" in infos[11].reason
    assert not infos[12].valid and "missing" in infos[12].reason
    assert not infos[13].valid and "truncated or partial" in infos[13].reason
    got = download_dir(gcs, 10, tmp_path / "dst", parse_manifest, key=KEY)
    assert got == tmp_path / "dst" / step_name(10)
    _, loaded = load_dir(got, key=KEY)
    assert_same(state, loaded)
    with pytest.raises(CheckpointInvalid):
        download_dir(gcs, 13, tmp_path / "dst", parse_manifest)
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == [step_name(10)]


def test_tensor_digest() -> None:
    a = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)}
    d = tensor_digest(a)
    assert d == tensor_digest({"b": torch.zeros(3), "w": torch.arange(6.0).reshape(2, 3)})
    assert d == tensor_digest({"w": torch.arange(6.0).reshape(3, 2).t().contiguous().t().reshape(2, 3), "b": torch.zeros(3)})
    assert d != tensor_digest({"w": torch.arange(6.0).reshape(3, 2), "b": torch.zeros(3)})  # shape
    assert d != tensor_digest({"w": torch.arange(6.0).reshape(2, 3).double(), "b": torch.zeros(3)})  # dtype
    assert d != tensor_digest({"v": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)})  # name
    c = {k: v.clone() for k, v in a.items()}
    c["w"][1, 2] += 1e-6
    assert d != tensor_digest(c)  # one value
    assert len(d) == 64


@pytest.mark.parametrize("hashed", ["blake3", "sha256"])
def test_multi_chunk_hashing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashed: str) -> None:
    import dataclasses
    import hashlib

    import blake3

    from trainer.checkpoint import file_hash

    fh = dataclasses.replace(file_hash.BLAKE3 if hashed == "blake3" else file_hash.SHA256, chunk=4096)
    monkeypatch.setitem(file_hash.HASHES, fh.name, fh)  # many chunks with small tensors
    monkeypatch.setattr(file_hash, "for_writing", lambda: fh)
    state = {"w": torch.randn(10000), "v": torch.randn(333)}
    folder = write(tmp_path, 1, state)
    data = (folder / TENSORS).read_bytes()
    chunks = [data[i : i + 4096] for i in range(0, len(data), 4096)]
    assert len(chunks) > 5
    fn = (lambda b: blake3.blake3(b).digest()) if hashed == "blake3" else (lambda b: hashlib.sha256(b).digest())
    want = fn(b"".join(fn(c) for c in chunks)).hex()
    m = json.loads((folder / MANIFEST).read_text())
    assert m["hash"] == fh.name and m["files"][TENSORS][hashed] == want
    _, loaded = load_dir(folder)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["v"], state["v"])
    b = bytearray(data)
    b[3 * 4096 + 17] ^= 0x10  # one bit in a middle chunk
    (folder / TENSORS).write_bytes(bytes(b))
    with pytest.raises(CheckpointInvalid, match=f"{hashed} mismatch"):
        load_dir(folder)
    with pytest.raises(CheckpointInvalid, match=f"{hashed} mismatch"):
        verify_dir(folder)


def test_reserve_allocates_once_for_the_first_save() -> None:
    state = {"a": torch.randn(100), "b": [torch.randn(7, dtype=torch.float64)]}
    buf = SnapshotBuffer()
    buf.reserve(state)
    assert buf.allocations == 1
    buf.take(1, state)
    assert buf.allocations == 1 and buf.last_alloc_s == 0.0  # no allocation during the save


# ----------------------------------------------------------------------------- authentication


def test_the_hmac_authenticates_the_manifest(tmp_path: Path) -> None:
    from tests.trainer.support import forge

    folder = write(tmp_path / "a", 3)
    m = verify_dir(folder, key=KEY)
    assert m["auth"] == {"alg": "hmac-sha256", "key_id": KEY.id} and m["writer"] == "test"
    assert verify_dir(folder)["step"] == 3  # without a key: integrity only (nothing is unpickled)

    def refused(f: Path, key: CheckpointKey | None = KEY) -> str:
        with pytest.raises(CheckpointInvalid) as e:
            load_dir(f, key=key)
        assert quarantined(str(e.value))  # never deleted, never overwritten
        return str(e.value)

    assert f"names checkpoint key \"{KEY.id}\", this run's key is {OTHER_KEY.id}" in refused(folder, OTHER_KEY)
    # A bucket writer changes the data position and recomputes every sha256: no HMAC to show.
    state = folder / STATE
    state.write_text(state.read_text().replace('"index":1234', '"index":0'))
    (folder / MANIFEST).write_bytes(forge((folder / MANIFEST).read_bytes(), 3, {STATE: state.read_bytes()}))
    assert verify_dir(folder)["step"] == 3  # consistent: only the key tells it apart
    assert "unauthenticated: its manifest carries no HMAC" in refused(folder)
    # Keeping the old HMAC does not help.
    good = json.loads((write(tmp_path / "b", 3) / MANIFEST).read_text())
    forged = json.loads((folder / MANIFEST).read_text())
    forged.update(hmac=good["hmac"])
    (folder / MANIFEST).write_text(json.dumps(forged))
    assert "HMAC does not verify with this run's checkpoint key" in refused(folder)
    # A checkpoint written without a key is unauthenticated to a run with one.
    assert "carries no HMAC" in refused(write(tmp_path / "c", 3, key=None))


def test_a_format_1_checkpoint_is_never_unpickled(tmp_path: Path) -> None:
    from tests.trainer.support import code_running_pickle, forge

    folder = write(tmp_path, 4)
    marker = tmp_path / "code-ran"
    legacy = code_running_pickle(marker)
    (folder / "state.pt").write_bytes(legacy)
    (folder / MANIFEST).write_bytes(forge((folder / MANIFEST).read_bytes(), 4, {"state.pt": legacy}, legacy=True))
    with pytest.raises(CheckpointInvalid, match=r"^unauthenticated: checkpoint format 1, written by an older "
                                                 r"spottrain: its state is a pickled state.pt"):
        load_dir(folder, key=KEY)
    with pytest.raises(CheckpointInvalid, match=r"^other format: checkpoint format 1"):
        load_dir(folder)
    assert list_checkpoints(DirStore(tmp_path, "persistent"), key=KEY)[0].reason.startswith("unauthenticated")
    assert not marker.exists()


def test_verified_but_undecodable_is_unloadable_not_corrupt(tmp_path: Path) -> None:
    """Bytes a key holder wrote that this version cannot decode (a newer spottrain's structure):
    a resume mismatch upstream, never a fallback that retention would follow with deletions."""
    from trainer.checkpoint.file_hash import BLAKE3

    folder = write(tmp_path, 5)
    state = (folder / STATE).read_text().replace('"$":"tuple"', '"$":"quaternion"', 1)
    (folder / STATE).write_text(state)
    files = json.loads((folder / MANIFEST).read_text())["files"]
    files[STATE] = BLAKE3.entry(len(state.encode()), BLAKE3.of(state.encode()))
    (folder / MANIFEST).write_bytes(build_manifest(5, files, {"world_size": 4}, 0.0, key=KEY))
    assert verify_dir(folder, key=KEY)["step"] == 5
    with pytest.raises(CheckpointUnloadable, match="unknown tag 'quaternion'"):
        load_dir(folder, key=KEY)


def test_a_step_written_again_with_replace_swaps_atomically(tmp_path: Path) -> None:
    write(tmp_path, 6, {"w": torch.zeros(3)})
    snap = SnapshotBuffer().take(6, {"w": torch.ones(3)})
    with pytest.raises(FileExistsError):
        write_dir(snap, tmp_path, key=KEY)
    write_dir(snap, tmp_path, key=KEY, replace=True)
    assert torch.equal(load_dir(tmp_path / step_name(6), key=KEY)[1]["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_name(6)]


def test_garbage_manifests_planted_in_the_bucket_are_no_checkpoints(gcs_emulator, tmp_path: Path,
                                                                     monkeypatch) -> None:
    """Bytes a bucket writer plants as manifests: each step is invalid with its reason, the
    listing answers (never an exception, which the survey would call a tier unknown)."""
    from trainer import untrusted

    gcs = GcsStore(gcs_emulator.uri, client=gcs_emulator.client)
    folder = write(tmp_path / "src", 10)
    for name in (TENSORS, STATE, MANIFEST):
        gcs.put_file(folder / name, f"{step_name(10)}/{name}")
    bucket_name, _, prefix = gcs_emulator.uri[len("gs://"):].partition("/")
    bucket = gcs_emulator.client.bucket(bucket_name)
    planted = {20: b"[" * 200_000, 21: b"\xff\xfe{}", 22: b'{"format": ' + b" " * 300_000 + b'"x"}'}
    for step, data in planted.items():
        bucket.blob(f"{prefix}/{step_name(step)}/{MANIFEST}").upload_from_string(data)
    monkeypatch.setattr(untrusted, "MANIFEST_MAX_BYTES", 250_000)  # step 22's 300 KB are too many
    infos = {i.step: i for i in list_checkpoints(gcs, key=KEY)}
    assert infos[10].valid
    assert not infos[20].valid and infos[20].reason == "manifest is nested too deeply to be one"
    assert not infos[21].valid and infos[21].reason.startswith("manifest is not valid JSON")
    assert not infos[22].valid and infos[22].reason == "manifest is 300015 bytes, more than the 250000 it may be"
