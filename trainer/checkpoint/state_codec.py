"""A state's structure as plain JSON: what replaces pickle wherever a checkpoint is read.

``encode(obj, tensor)`` turns nested containers of plain values into JSON-ready data, asking
``tensor(t)`` what to put in place of each tensor (a reference into a tensor table, or the bytes
inline); ``decode(data, tensor)`` is its inverse. Decoding builds nothing but the types listed
below, so reading a checkpoint can never run code chosen by whoever wrote it (pickle, and
``torch.load(weights_only=False)``, run whatever the file names).

Plain data: None, bool, int, float (inf and nan included), str, bytes, list, tuple, set,
frozenset, complex, dict with any plain keys (the optimizer's int parameter ids), OrderedDict
(with the ``_metadata`` a module's ``state_dict()`` carries), torch.dtype, torch.device,
torch.Size and tensors. JSON carries None, bool, int, finite floats, str, lists and dicts with
string keys as they are; everything else is a tagged object ``{"$": TAG, ...}``. A dict with a
non-string key, or with a ``"$"`` key of its own, is tagged too (its items as pairs).

Anything else (a custom object in a scheduler's state, a numpy array, a function) raises
``NotPlainData`` naming where it is, e.g. ``state['scheduler']['fn']``: at save time, never at
restore.
"""
from __future__ import annotations

import base64
import ctypes
import json
import math
from collections import OrderedDict
from typing import Any, Callable

import torch

TAG = "$"


class NotPlainData(TypeError):
    """Something in a state that a checkpoint cannot hold without pickle (bad input: exit 2)."""


class DecodeError(ValueError):
    """Structure that this version cannot decode (an unknown tag, a malformed value)."""


def _where(path: tuple) -> str:
    """``state['a'][0]`` for a path of (kind, value) steps (formatted only for an error)."""
    out = "state"
    for kind, v in path:
        out += (f"[{v}]" if kind == "index" else f"[{v!r}]" if kind == "key" else
                f"<key {v!r}>" if kind == "dict key" else "{…}" if kind == "item" else f".{v}")
    return out


def encode(obj: Any, tensor: Callable[[torch.Tensor, tuple], Any], path: tuple = ()) -> Any:
    """JSON-ready data for ``obj``; ``tensor(t, path)`` gives what stands in for a tensor (``path``
    says where it is, for ``where``)."""
    return _encode(obj, tensor, path)


def _encode(obj: Any, tensor: Callable[[torch.Tensor, tuple], Any], path: tuple) -> Any:
    t = type(obj)
    if obj is None or t is bool or t is str:
        return obj
    if isinstance(obj, torch.Tensor):
        return tensor(obj, path)
    if t is int:
        return obj
    if t is float:
        return obj if math.isfinite(obj) else {TAG: "float", "v": repr(obj)}
    if t is list:
        return [_encode(v, tensor, path + (("index", i),)) for i, v in enumerate(obj)]
    if t is dict:
        if all(type(k) is str for k in obj) and TAG not in obj:
            return {k: _encode(v, tensor, path + (("key", k),)) for k, v in obj.items()}
        return {TAG: "dict", "items": _items(obj, tensor, path)}
    if t is OrderedDict:
        out = {TAG: "odict", "items": _items(obj, tensor, path)}
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out["meta"] = _encode(meta, tensor, path + (("attr", "_metadata"),))
        return out
    if t is tuple:
        return {TAG: "tuple", "items": [_encode(v, tensor, path + (("index", i),)) for i, v in enumerate(obj)]}
    if t is torch.Size:
        return {TAG: "size", "items": list(obj)}
    if t in (set, frozenset):
        items = list(obj)
        try:
            items.sort()  # a stable order where there is one: equal states encode alike
        except TypeError:
            pass
        return {TAG: t.__name__, "items": [_encode(v, tensor, path + (("item", None),)) for v in items]}
    if t in (bytes, bytearray):
        return {TAG: t.__name__, "b64": base64.b64encode(obj).decode()}
    if t is complex:
        return {TAG: "complex", "re": _encode(obj.real, tensor, path), "im": _encode(obj.imag, tensor, path)}
    if t is torch.dtype:
        return {TAG: "dtype", "v": str(obj).removeprefix("torch.")}
    if t is torch.device:
        return {TAG: "device", "v": str(obj)}
    if isinstance(obj, (int, float, str)):  # IntEnum, numpy.float64: kept as the plain value
        return _encode((int if isinstance(obj, int) else float if isinstance(obj, float) else str)(obj),
                       tensor, path)
    hint = (" (numpy: use .tolist()/.item() or a torch tensor)" if type(obj).__module__.startswith("numpy")
            else " (functions and objects cannot be checkpointed without pickle: store plain values "
                 "in state_dict())")
    raise NotPlainData(f"{_where(path)} is a {t.__module__}.{t.__qualname__}, not plain data{hint}")


def _items(obj: dict, tensor: Callable, path: tuple) -> list[list[Any]]:
    return [[_encode(k, tensor, path + (("dict key", k),)), _encode(v, tensor, path + (("key", k),))]
            for k, v in obj.items()]


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor of ``obj``, in ``encode``'s order (one that appears twice, twice)."""
    found: list[torch.Tensor] = []
    encode(obj, lambda t, path: found.append(t))
    return found


def decode(data: Any, tensor: Callable[[dict], torch.Tensor]) -> Any:
    """The value ``encode`` was given; ``tensor(tagged)`` resolves a tensor's stand-in."""
    t = type(data)
    if data is None or t in (bool, int, float, str):
        return data
    if t is list:
        return [decode(v, tensor) for v in data]
    if t is not dict:
        raise DecodeError(f"unexpected JSON value of type {t.__name__}")
    tag = data.get(TAG)
    if tag is None:
        return {k: decode(v, tensor) for k, v in data.items()}
    try:
        if tag in ("t", "tensor"):
            return tensor(data)
        if tag == "dict":
            return {_key(decode(k, tensor)): decode(v, tensor) for k, v in data["items"]}
        if tag == "odict":
            # A module's state dict: an OrderedDict that carries torch's ``_metadata`` attribute.
            out: Any = OrderedDict((_key(decode(k, tensor)), decode(v, tensor)) for k, v in data["items"])
            if "meta" in data:
                out._metadata = decode(data["meta"], tensor)
            return out
        if tag == "tuple":
            return tuple(decode(v, tensor) for v in data["items"])
        if tag == "size":
            return torch.Size(int(v) for v in data["items"])
        if tag == "set":
            return {_key(decode(v, tensor)) for v in data["items"]}
        if tag == "frozenset":
            return frozenset(_key(decode(v, tensor)) for v in data["items"])
        if tag in ("bytes", "bytearray"):
            raw = base64.b64decode(data["b64"], validate=True)
            return raw if tag == "bytes" else bytearray(raw)
        if tag == "float":
            if data["v"] not in ("inf", "-inf", "nan"):
                raise DecodeError(f"bad float {data['v']!r}")
            return float(data["v"])
        if tag == "complex":
            return complex(decode(data["re"], tensor), decode(data["im"], tensor))
        if tag == "dtype":
            return dtype(data["v"])
        if tag == "device":
            return torch.device(str(data["v"]))
    except DecodeError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise DecodeError(f"malformed {tag!r} value ({type(e).__name__}: {e})") from None
    raise DecodeError(f"unknown tag {tag!r} (written by a newer spottrain?)")


def _key(k: Any) -> Any:
    if isinstance(k, (list, dict, set, bytearray)):
        raise DecodeError(f"unhashable dict key or set item of type {type(k).__name__}")
    return k


def dtype(name: str) -> torch.dtype:
    """``torch.<name>`` when that is a dtype; DecodeError otherwise (never any other attribute)."""
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise DecodeError(f"unknown dtype {name!r}")
    return dt


# --------------------------------------------------------------------------------------------
# Small self-contained states (the sharded layout's extras): tensors inline
# --------------------------------------------------------------------------------------------

FORMAT = "spottrain-plain"
VERSION = 1


def dumps(obj: Any) -> bytes:
    """``obj`` as one JSON document, tensors inline (base64): for small states only."""

    def inline(t: torch.Tensor, path: tuple) -> dict:
        check_tensor(t, path)
        c = t.detach().to("cpu").contiguous()
        raw = ctypes.string_at(c.data_ptr(), c.numel() * c.element_size()) if c.numel() else b""
        return {TAG: "tensor", "dtype": str(c.dtype).removeprefix("torch."), "shape": list(c.shape),
                "rg": bool(t.requires_grad), "param": type(t) is torch.nn.Parameter,
                "b64": base64.b64encode(raw).decode()}

    doc = {"format": FORMAT, "version": VERSION, "tree": encode(obj, inline)}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def loads(raw: bytes) -> Any:
    """The inverse of ``dumps``; DecodeError when it is not such a document."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise DecodeError(f"not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise DecodeError("not a spottrain plain-data document of a known version")

    def inline(d: dict) -> torch.Tensor:
        dt = dtype(d["dtype"])
        shape = tuple(int(x) for x in d["shape"])
        raw = bytearray(base64.b64decode(d["b64"], validate=True))
        t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        t = t.view(dt).reshape(shape) if raw else torch.empty(shape, dtype=dt)
        return torch.nn.Parameter(t, requires_grad=bool(d.get("rg"))) if d.get("param") else \
            t.requires_grad_(True) if d.get("rg") else t

    return decode(doc.get("tree"), inline)


def check_tensor(t: torch.Tensor, path: tuple) -> None:
    """Tensors a checkpoint holds as raw bytes: strided, not quantized or nested, on a real
    device, a plain tensor or a Parameter (subclasses would need pickle)."""
    if not (t.layout == torch.strided and not t.is_quantized and t.device.type != "meta"
            and not t.is_nested and type(t) in (torch.Tensor, torch.nn.Parameter)):
        raise NotPlainData(f"{_where(path)} is a {type(t).__qualname__} (layout {t.layout}, device "
                           f"{t.device.type}); a checkpoint holds plain strided tensors only")
