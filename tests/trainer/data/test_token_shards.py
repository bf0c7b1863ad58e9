"""trainer/token_shards.py: nanoGPT-format shards, windows within files, uint16 and uint32, clear
errors, and the gpt task training on them from ctx.data_dir."""
from __future__ import annotations

import array
import re
from pathlib import Path

import pytest
import torch

from trainer.config import RunConfig, StatusConfig
from trainer.data.sampler import DataOrder
from trainer.status import collect
from trainer.data.token_shards import TokenShardError, TokenShards, find_shards
from trainer.train import run
from tests.trainer.support import restore_logging  # noqa: F401  (fixture)


def _write(path: Path, tokens: list[int], typecode: str = "H") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(array.array(typecode, tokens).tobytes())  # little-endian on every host we run
    return path


def test_windows_stay_inside_their_file_and_cover_it_in_order(tmp_path: Path) -> None:
    a = _write(tmp_path / "d" / "train_000.bin", list(range(0, 10)))  # 10 tokens: windows at 0, 3
    b = _write(tmp_path / "d" / "train_001.bin", list(range(100, 104)))  # too short for a window
    c = _write(tmp_path / "d" / "train_002.bin", list(range(200, 207)))  # one window at 0
    ds = TokenShards(find_shards("d", tmp_path), block_size=4, stride=3)
    assert ds.files == [a, b, c] and len(ds) == 3
    assert [ds.window(i).tolist() for i in range(3)] == [[0, 1, 2, 3, 4], [3, 4, 5, 6, 7], [200, 201, 202, 203, 204]]
    x, y = ds[1]
    assert x.tolist() == [3, 4, 5, 6] and y.tolist() == [4, 5, 6, 7] and x.dtype == torch.int64
    with pytest.raises(IndexError):
        ds[3]


def test_uint16_and_uint32_tokens_above_the_signed_range(tmp_path: Path) -> None:
    big16 = _write(tmp_path / "a.bin", [65535, 40000, 1, 2])
    big32 = _write(tmp_path / "b.bin", [4_000_000_000, 70000, 3, 4], "I")
    assert TokenShards([big16], block_size=3).window(0).tolist() == [65535, 40000, 1, 2]
    assert TokenShards([big32], block_size=3, dtype="uint32").window(0).tolist() == [4_000_000_000, 70000, 3, 4]


def test_bad_shards_are_named(tmp_path: Path) -> None:
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 7)
    with pytest.raises(TokenShardError, match=r"odd.bin: 7 bytes is not a whole number of uint32 tokens"):
        TokenShards([odd], block_size=1, dtype="uint32")
    with pytest.raises(TokenShardError, match=r"nope.bin: no such file"):
        find_shards("nope.bin", tmp_path)
    with pytest.raises(TokenShardError, match="needs a data_dir"):
        find_shards("train.bin", None)
    with pytest.raises(TokenShardError, match="no window of 9 tokens fits"):
        TokenShards([_write(tmp_path / "s.bin", [1, 2, 3])], block_size=8)


def test_ten_billion_windows_in_constant_memory(tmp_path: Path) -> None:
    """A sparse 20 GB file of uint16 (10^10 tokens, stride 1): ~10^10 windows, indexed through the
    bijection order without materialising anything per window."""
    f = tmp_path / "huge.bin"
    with open(f, "wb") as fh:
        fh.truncate(2 * 10**10)
    ds = TokenShards([f], block_size=8, stride=1)
    assert len(ds) == 10**10 - 8
    order = DataOrder(len(ds), seed=1, batch_size=4)
    for i in order.next_indices():
        assert ds[i][0].tolist() == [0] * 8


@pytest.mark.usefixtures("restore_logging")
def test_the_gpt_task_trains_on_shards_in_the_data_dir(tmp_path: Path) -> None:
    data = tmp_path / "staged"
    tokens = [(i * 7919) % 300 for i in range(6000)]
    _write(data / "train.bin", tokens[:5000])
    _write(data / "val.bin", tokens[5000:])
    args = {"data": "train.bin", "eval_data": "val.bin", "vocab_size": 300, "n_layer": 1, "n_head": 2,
            "n_embd": 16, "block_size": 16, "stride": 16}
    cfg = RunConfig(run_dir=tmp_path / "run", steps=6, task_args=args, data_dir=data, batch_size=4,
                    health_port=None, watch_metadata=False, eval_every_steps=3, eval_batches=2)
    assert run(cfg).code == 0
    s = collect(StatusConfig(run_dir=tmp_path / "run"))
    assert s["latest_step"] == 6 and s["fingerprint"]["dataset_len"] == (5000 - 17) // 16 + 1
    # A data path that is not there: bad input, exit 2.
    bad = cfg.model_copy(update={"run_dir": tmp_path / "run2", "task_args": {**args, "data": "missing.bin"}})
    assert run(bad).code == 2


@pytest.mark.usefixtures("restore_logging")
def test_a_token_id_beyond_the_vocabulary_is_bad_input_naming_the_shard(tmp_path: Path, capfd) -> None:
    """A bit flipped in a staged shard after a run started (or the wrong token_dtype): every
    resume used to crash with IndexError in the embedding, in a loop; now exit 2 naming the file."""
    data = tmp_path / "staged"
    tokens = [(i * 7919) % 300 for i in range(6000)]
    shard = _write(data / "train.bin", tokens)
    args = {"data": "train.bin", "vocab_size": 300, "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16}
    cfg = RunConfig(run_dir=tmp_path / "run", steps=4, task_args=args, data_dir=data, batch_size=4,
                    health_port=None, watch_metadata=False)
    assert run(cfg).code == 0
    raw = bytearray(shard.read_bytes())
    raw[2 * 4321 + 1] ^= 0x80  # token 4321's high bit: an id above 32767
    shard.write_bytes(bytes(raw))
    capfd.readouterr()
    resumed = cfg.model_copy(update={"steps": 400, "extend_steps": True})
    assert run(resumed).code == 2
    out = "".join(capfd.readouterr())
    assert "Traceback" not in out
    assert re.search(r"event=failed reason=bad_input task_args: data: \S*train\.bin holds token id \d+ at token "
                     r"4321; vocab_size is 300 \(a corrupt shard, or token_dtype is not uint16\)", out), out[-2000:]
    # Read as uint32, the same (intact) uint16 pairs are ids far beyond the vocabulary.
    shard.write_bytes(array.array("H", tokens).tobytes())
    with pytest.raises(TokenShardError, match=r"train\.bin holds token id \d+ at token \d+; vocab_size is 300 "
                                              r"\(a corrupt shard, or token_dtype is not uint32\)"):
        TokenShards([shard], block_size=16, dtype="uint32", vocab_size=300)
    assert TokenShards([shard], block_size=16, vocab_size=300).vocab_size == 300


def test_each_shard_is_read_once_until_it_changes(tmp_path: Path, monkeypatch) -> None:
    from trainer.data import token_shards

    scanned: list[Path] = []
    real = token_shards._scan
    monkeypatch.setattr(token_shards, "_scan", lambda path, dtype: scanned.append(path) or real(path, dtype))
    monkeypatch.setattr(token_shards, "_largest", {})
    shard = _write(tmp_path / "train.bin", [1, 7, 3, 7, 2])
    assert token_shards.largest_token(shard, "uint16") == (7, 1)
    TokenShards([shard], block_size=2, vocab_size=8)
    monkeypatch.setattr(token_shards, "_largest", {})  # a new process: the file cache answers
    TokenShards([shard], block_size=2, vocab_size=8)
    assert scanned == [shard]
    _write(shard, [1, 9, 3, 7, 2, 4])  # rewritten: read again
    with pytest.raises(TokenShardError, match=r"holds token id 9 at token 1; vocab_size is 8"):
        TokenShards([shard], block_size=2, vocab_size=8)
    assert scanned == [shard, shard]
