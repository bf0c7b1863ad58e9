"""trainer.checkpoint.state_codec: a state's structure as JSON, the replacement for pickle in checkpoints."""
from __future__ import annotations

import json
import math
import random
from collections import OrderedDict

import pytest
import torch

from trainer.checkpoint import state_codec as plain


def roundtrip(obj):
    return plain.loads(plain.dumps(obj))


def test_what_json_lacks_round_trips_with_its_type() -> None:
    odict = torch.nn.Linear(2, 2).state_dict()  # an OrderedDict with torch's _metadata
    obj = {
        "python_rng": random.Random(5).getstate(),  # a tuple of ints, with a nested tuple
        "param_ids": {0: {"step": 3}, 1: [1, 2]},  # the optimizer's int keys
        "betas": (0.9, 0.999), "floats": [float("inf"), -float("inf"), -0.0, 1e-310, 0.1],
        "raw": b"\x00\xff", "buf": bytearray(b"ab"), "set": {3, 1}, "frozen": frozenset({"a"}),
        "complex": 1 - 2j, "dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2, 3]),
        "dollar": {"$": "not a tag"}, "tuple_key": {(1, "a"): None}, "model": odict, "big": 2**80,
    }
    back = roundtrip(obj)
    assert back["python_rng"] == obj["python_rng"] and type(back["python_rng"]) is tuple
    assert back["param_ids"] == obj["param_ids"] and list(back["param_ids"]) == [0, 1]
    assert back["betas"] == (0.9, 0.999)
    f = back["floats"]
    assert f[0] == math.inf and f[1] == -math.inf and math.copysign(1, f[2]) == -1 and f[3:] == [1e-310, 0.1]
    assert math.isnan(roundtrip(float("nan")))
    for k in ("raw", "buf", "set", "frozen", "complex", "dtype", "device", "size", "dollar", "tuple_key", "big"):
        assert back[k] == obj[k] and type(back[k]) is type(obj[k]), k
    assert type(back["model"]) is OrderedDict and back["model"]._metadata == odict._metadata
    assert all(torch.equal(back["model"][k], v) for k, v in odict.items())


def test_tensors_keep_dtype_shape_and_flags() -> None:
    p = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    obj = [p, torch.tensor([True, False]), torch.zeros(0, 4, dtype=torch.float16), torch.arange(4)[::2]]
    back = roundtrip(obj)
    assert type(back[0]) is torch.nn.Parameter and back[0].requires_grad
    for a, b in zip(obj, back):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach(), b.detach())


def test_decoding_builds_only_plain_values() -> None:
    def doc(tree: object) -> bytes:
        return json.dumps({"format": plain.FORMAT, "version": plain.VERSION, "tree": tree}).encode()

    with pytest.raises(plain.DecodeError, match="unknown tag 'reduce'"):
        plain.loads(doc({"$": "reduce", "fn": "os.system", "args": ["touch x"]}))
    with pytest.raises(plain.DecodeError, match="unknown dtype 'load'"):
        plain.loads(doc({"$": "dtype", "v": "load"}))  # torch.load is an attribute, never a dtype
    with pytest.raises(plain.DecodeError, match="not JSON"):
        plain.loads(b"\x80\x04K\x01.")  # a pickle
    with pytest.raises(plain.DecodeError, match="not a spottrain plain-data document"):
        plain.loads(b'{"format": "something else"}')
    with pytest.raises(plain.DecodeError, match="unhashable"):
        plain.loads(doc({"$": "dict", "items": [[[1], 2]]}))


def test_anything_else_is_refused_naming_its_path() -> None:
    with pytest.raises(plain.NotPlainData, match=r"^state\['a'\]\[0\]\[1\] is a builtins.function, not plain"):
        plain.dumps({"a": [{1: lambda: 0}]})
    with pytest.raises(plain.NotPlainData, match=r"^state\['a'\]\[0\]<key <object .*>> is a builtins.object"):
        plain.dumps({"a": [{object(): 1}]})
