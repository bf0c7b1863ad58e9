"""Whether this PyTorch carries kernels for this GPU, checked once at start, before any kernel runs.

A PyTorch build carries machine code ("cubins", ``sm_XY`` in ``torch.cuda.get_arch_list()``) for
some compute capabilities, and maybe PTX (``compute_XY``) that the driver compiles for newer
ones. A GPU the build does not cover passes ``import torch`` and ``torch.cuda.is_available()``
and fails at its first kernel ("no kernel image is available for execution on the device"):
under systemd and autohealing, a restart loop at GPU prices. Here it is bad input (exit 2): no
restart fixes it, another image or GPU type does. E.g. the cu128/cu129 builds of PyTorch 2.8+
dropped Pascal (P100 sm_60, P4 sm_61).

The rule is NVIDIA's compatibility, as ``torch.cuda`` applies it: a cubin for ``sm_XY`` runs on
a GPU of the same major version X with minor >= Y; an architecture-specific one (``sm_90a``)
only on exactly that capability; PTX for ``compute_XY`` on any GPU of capability >= X.Y.
``stacks.gcp_rules`` applies the same rule to image families before deploying.
"""
from __future__ import annotations

import re
from typing import Any

Capability = tuple[int, int]

_ARCH = re.compile(r"^(sm|compute)_(\d+?)(\d)([af]?)$")


class UnsupportedGpu(Exception):
    """This PyTorch has no kernels for this GPU (bad input: exit 2)."""


def runs_on(capability: Capability, arch_list: list[str] | tuple[str, ...]) -> bool:
    """True when a build with `arch_list` (``torch.cuda.get_arch_list()``) has code the GPU of
    `capability` can run. An empty list (a CPU or ROCm build) has nothing to check: True."""
    if not arch_list:
        return True
    major, minor = capability
    for arch in arch_list:
        m = _ARCH.match(arch)
        if m is None:
            continue  # an entry this rule does not know: it proves nothing either way
        kind, a_major, a_minor, suffix = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        if kind == "compute":
            if (major, minor) >= (a_major, a_minor):
                return True
        elif suffix == "a":
            if (major, minor) == (a_major, a_minor):
                return True
        elif major == a_major and minor >= a_minor:
            return True
    return False


def sm(capability: Capability) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def problem(name: str, capability: Capability, arch_list: list[str] | tuple[str, ...],
            torch_version: str) -> str | None:
    """The bad-input message for a GPU this build cannot run, else None."""
    if runs_on(capability, arch_list):
        return None
    return (f"GPU {name} has compute capability {sm(capability)}, but this image's PyTorch "
            f"{torch_version} carries kernels only for {' '.join(arch_list)} "
            "(torch.cuda.get_arch_list()): its first kernel would fail. Use a GPU type it "
            f"supports, or an image family whose PyTorch includes {sm(capability)}")


def _describe(device: Any) -> tuple[str, Capability, list[str], str]:
    """(name, capability, arch list, torch version) of a CUDA device: the one place that asks
    the hardware (tests replace it to stand in for a GPU)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return (torch.cuda.get_device_name(device), (major, minor), list(torch.cuda.get_arch_list()),
            str(torch.__version__))


def check(device: Any) -> None:
    """Raise UnsupportedGpu when `device` is a GPU this PyTorch has no kernels for."""
    if getattr(device, "type", None) != "cuda":
        return
    name, capability, arch_list, version = _describe(device)
    msg = problem(name, (int(capability[0]), int(capability[1])), arch_list, version)
    if msg is not None:
        raise UnsupportedGpu(msg)
