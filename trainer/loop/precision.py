"""Mixed precision: the autocast and the grad scaler that a run's ``precision`` asks for, on the
device the run resolved to.

bf16 and fp16 autocast the same way on CUDA and on the CPU (the fingerprint records the setting,
so a run trains the way it says it does); fp16 adds a grad scaler. What the installed PyTorch
cannot do on that device is bad input (exit 2), never a silent fp32.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class UnsupportedPrecision(Exception):
    """The installed PyTorch cannot train in the requested precision on this device."""


@dataclass(frozen=True)
class MixedPrecision:
    autocast: Callable[[], Any]
    """A new context manager per call: the forward pass (and the loss) run inside it."""
    scaler: Any | None
    """``torch.amp.GradScaler`` for fp16, None otherwise."""


def setup(precision: str, device: torch.device, source: str) -> MixedPrecision:
    """The autocast and scaler for ``precision`` on ``device``; ``source`` names where the setting
    came from (the config file), for the refusal."""
    dtype = DTYPES.get(precision)
    if dtype is None:
        return MixedPrecision(contextlib.nullcontext, None)
    kind = device.type
    why = _cannot_autocast(device, dtype)
    if why is not None:
        raise UnsupportedPrecision(_refusal(source, precision, kind, why))
    scaler = None
    if precision == "fp16":
        try:
            scaler = torch.amp.GradScaler(kind)
        except (AttributeError, TypeError, ValueError, RuntimeError) as e:  # torch without a scaler for it
            raise UnsupportedPrecision(_refusal(source, precision, kind, f"no grad scaler ({e})")) from None
    return MixedPrecision(lambda: torch.autocast(kind, dtype=dtype), scaler)


def _cannot_autocast(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why autocast on ``device`` does not compute in ``dtype``, or None when it does. Tried, not
    looked up: an older PyTorch switches autocast off for a dtype it does not support with only a
    warning, and a GPU without bf16 refuses it when the context is entered."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autocast(device.type, dtype=dtype):
                a = torch.ones(2, 2, device=device)
                got = torch.mm(a, a).dtype
    except (RuntimeError, ValueError, TypeError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None if got == dtype else f"autocast computes in {got} instead"


def _refusal(source: str, precision: str, kind: str, why: str) -> str:
    return (f"{source}: precision: {precision!r} cannot train on {kind} with PyTorch {torch.__version__}: "
            f"{why}; allowed: 'fp32' here, or a device and PyTorch that support {precision}")
