"""trainer.checkpoint.file_hash: the per-file digests (BLAKE3 written, SHA-256 still read), hashing
while reading, and a trainer without the blake3 package."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import blake3
import pytest
import torch

from tests.trainer.support import REPO, forge
from trainer.checkpoint import file_hash
from trainer.checkpoint.file_hash import BLAKE3, SHA256, hash_file
from trainer.checkpoint.key import CheckpointKey
from trainer.checkpoint.manifest import MANIFEST, CheckpointInvalid, quarantined, step_name
from trainer.checkpoint.whole_model import STATE, TENSORS, load_dir, verify_dir

#: A whole-model checkpoint written by the version before BLAKE3 (its manifest names
#: sha256-of-64MiB-chunk-sha256s), signed with this key.
OLD = Path(__file__).parent / "fixtures" / "sha256-checkpoint" / step_name(3)
OLD_KEY = CheckpointKey(b"k" * 32, "test key")


def reference(name: str, data: bytes, chunk: int) -> str:
    """The documented constructions, written independently of the module."""
    fn = (lambda b: blake3.blake3(b).digest()) if name == "blake3" else (lambda b: hashlib.sha256(b).digest())
    return fn(b"".join(fn(data[i : i + chunk]) for i in range(0, len(data), chunk))).hex()


@pytest.mark.parametrize("name", ["blake3", "sha256"])
def test_digests_are_the_documented_constructions_in_memory_and_while_reading(tmp_path: Path, name: str) -> None:
    import concurrent.futures as cf

    fh = dataclasses.replace(BLAKE3 if name == "blake3" else SHA256, chunk=1000)
    for n in (0, 1, 999, 1000, 1001, 3005):
        data = os.urandom(n)
        want = reference(name, data, 1000)
        path = tmp_path / f"f{n}"
        path.write_bytes(data)
        with cf.ThreadPoolExecutor(2) as pool:
            assert fh.of(data, pool) == fh.of(data) == want
        assert hash_file(path, fh) == (n, want)
        into = torch.empty(n, dtype=torch.uint8)
        assert hash_file(path, fh, into=into) == (n, want)
        assert bytes(into.numpy()) == data
    # The file is longer or shorter than the buffer the manifest's size made: the size says so.
    path.write_bytes(data + b"x")
    assert hash_file(path, fh, into=torch.empty(len(data), dtype=torch.uint8))[0] == len(data) + 1
    path.write_bytes(data[:-1])
    assert hash_file(path, fh, into=torch.empty(len(data), dtype=torch.uint8))[0] == len(data) - 1
    assert fh.name in file_hash.HASHES and file_hash.FIELDS[fh.name] == name


def test_a_checkpoint_written_with_sha256_restores_and_is_verified_as_before(tmp_path: Path) -> None:
    """What the version before BLAKE3 wrote (a committed checkpoint) loads, and every guarantee
    holds for it: a flipped bit is caught, and a forged manifest is unauthenticated."""
    from tests.trainer.support import checkpointer

    m = json.loads((OLD / MANIFEST).read_text())
    assert m["hash"] == SHA256.name and set(m["files"][TENSORS]) == {"size", "sha256"}
    run = tmp_path / "run"
    shutil.copytree(OLD, run / OLD.name)
    r = checkpointer(run_dir=run, key=OLD_KEY).restore()
    assert r.step == 3 and r.state["data"] == {"epoch": 1, "index": 77}
    g = torch.Generator().manual_seed(3)
    assert torch.equal(r.state["model"]["w"], torch.randn(64, 32, generator=g))
    assert torch.equal(r.state["optimizer"]["state"][0]["exp_avg"], torch.randn(64, 32, generator=g))
    # The next save of the same run writes BLAKE3 beside it; both stay readable.
    c = checkpointer(run_dir=run, key=OLD_KEY)
    c.save(4, r.state, meta={"world_size": 1})
    c.close()
    assert json.loads((run / step_name(4) / MANIFEST).read_text())["hash"] == BLAKE3.name
    assert verify_dir(run / step_name(3), key=OLD_KEY)["step"] == 3

    for name in (TENSORS, STATE):
        folder = tmp_path / f"flip-{name}" / OLD.name
        shutil.copytree(OLD, folder)
        data = bytearray((folder / name).read_bytes())
        data[len(data) // 2] ^= 1
        (folder / name).write_bytes(bytes(data))
        with pytest.raises(CheckpointInvalid, match=f"{name} sha256 mismatch"):
            load_dir(folder, key=OLD_KEY)
        with pytest.raises(CheckpointInvalid, match=f"{name} sha256 mismatch"):
            verify_dir(folder, key=OLD_KEY)

    # A bucket writer rewrites the data position and recomputes the sha256s: consistent, not signed.
    folder = tmp_path / "forged" / OLD.name
    shutil.copytree(OLD, folder)
    state = (folder / STATE).read_text().replace('"index":77', '"index":0')
    (folder / STATE).write_text(state)
    (folder / MANIFEST).write_bytes(forge((folder / MANIFEST).read_bytes(), 3, {STATE: state.encode()}))
    assert verify_dir(folder)["step"] == 3  # every sha256 matches
    with pytest.raises(CheckpointInvalid, match="^unauthenticated: its manifest carries no HMAC") as e:
        load_dir(folder, key=OLD_KEY)
    assert quarantined(str(e.value))


#: Run in a Python where ``import blake3`` fails, as in an image without the package.
_WITHOUT_BLAKE3 = r"""
import json, logging, sys
from pathlib import Path
sys.modules["blake3"] = None  # import blake3 raises ImportError
import torch
from tests.trainer.support import checkpointer
from trainer.checkpoint.key import CheckpointKey
from trainer.checkpoint.manifest import ResumeMismatch, step_name

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
key = CheckpointKey(b"k" * 32, "test key")
run, blake3_run = Path(sys.argv[1]), Path(sys.argv[2])
c = checkpointer(run_dir=run, key=key)
for step in (1, 2):
    c.save(step, {"w": torch.full((4,), float(step)), "step": step}, meta={"world_size": 1})
    c.wait()
c.close()
r = checkpointer(run_dir=run, key=key).restore()
try:
    checkpointer(run_dir=blake3_run, key=key).restore()
    refused = None
except ResumeMismatch as e:
    refused = str(e)
print("RESULT " + json.dumps({
    "hashes": [json.loads((run / step_name(s) / "manifest.json").read_text())["hash"] for s in (1, 2)],
    "restored": [r.step, r.state["w"].tolist()], "refused": refused}))
"""


def test_without_the_blake3_package_the_trainer_writes_sha256_says_so_once_and_keeps_blake3_checkpoints(
        tmp_path: Path) -> None:
    from tests.trainer.support import checkpointer

    blake3_run = tmp_path / "blake3-run"
    c = checkpointer(run_dir=blake3_run, key=OLD_KEY)
    c.save(5, {"w": torch.zeros(4), "step": 5}, meta={"world_size": 1})
    c.close()
    out = subprocess.run([sys.executable, "-c", _WITHOUT_BLAKE3, str(tmp_path / "run"), str(blake3_run)],
                         cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    got = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert got["hashes"] == [SHA256.name, SHA256.name]
    assert got["restored"] == [2, [2.0, 2.0, 2.0, 2.0]]
    warnings = [x for x in out.stdout.splitlines() if "checkpoints are written with" in x]
    assert len(warnings) == 1 and "WARNING the blake3 package is not installed" in warnings[0], out.stdout
    # A checkpoint it cannot verify is never loaded, never deleted, and no fresh start over it.
    assert "cannot be checked here: the blake3 package is not installed" in (got["refused"] or "")
    assert sorted(p.name for p in blake3_run.iterdir()) == [step_name(5)]
    assert verify_dir(blake3_run / step_name(5), key=OLD_KEY)["hash"] == BLAKE3.name
