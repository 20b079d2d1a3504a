"""Per-call choice between a torch op and its fused alternative, per family (``kda``, ``mhc``, ``dsa``, ``moe``).

``config.kernels[family]``: ``"torch"`` (the oracle, runs everywhere), ``"auto"`` (fused when the family's probe accepts
the tensors) or ``"fused"`` (the same, warning once per family and reason when the torch op runs instead).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable

import torch

from .configuration_glm53flash import KERNEL_CHOICES, KERNEL_FAMILIES

# family -> (kernel module, its probe): probe(*tensors) -> (can_run: bool, reason_if_not: str)
PROBES: dict[str, tuple[str, str]] = {
    "kda": ("kda_fused", "fused_kda_available"),
    "mhc": ("mhc_fused", "fused_mhc_available"),
    "dsa": ("dsa_fused", "fused_dsa_available"),
    "moe": ("moe_fused", "fused_moe_available"),
}

# torch op name -> (family, loader() -> its fused alternative with the same contract); filled by register_fused
FUSED_ALTERNATIVES: dict[str, tuple[str, Callable[[], Callable]]] = {}

# family -> the probe of PROBES, wrapped to import its module on first use (tests may replace an entry)
FUSED_AVAILABILITY: dict[str, Callable[..., tuple[bool, str]]] = {}

_warned: set[tuple[str, str]] = set()


def requested_backend(config, family: str) -> str:
    """``config.kernels[family]`` (default ``"auto"``); ``ValueError`` for an unknown family or choice."""
    if family not in KERNEL_FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; known: {KERNEL_FAMILIES}")
    kernels = getattr(config, "kernels", None)
    choice = kernels.get(family, "auto") if isinstance(kernels, dict) else (kernels or "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels[{family!r}] must be one of {KERNEL_CHOICES}; got {choice!r}")
    return choice


def choose_backend(family: str, requested: str, *tensors: torch.Tensor) -> str:
    """``"torch"`` or ``"fused"`` for a call on ``tensors`` given the ``requested`` choice (module docstring);
    ``ValueError`` for an unknown family or choice."""
    if family not in KERNEL_FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; known: {KERNEL_FAMILIES}")
    if requested not in KERNEL_CHOICES:
        raise ValueError(f"backend for {family} must be one of {KERNEL_CHOICES}; got {requested!r}")
    if requested == "torch":
        return "torch"
    probe = FUSED_AVAILABILITY.get(family)
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if probe is None:
        ok, reason = False, f"this version of glm53flash-hf has no fused {family} kernel"
    elif not tensors:
        ok, reason = False, "no input tensors were given to decide the device"
    elif not all(t.is_cuda for t in tensors):
        ok, reason = False, "the tensors are not on a CUDA device"
    else:
        ok, reason = probe(*tensors)
    if ok:
        return "fused"
    if requested == "fused" and (family, reason) not in _warned:
        _warned.add((family, reason))
        warnings.warn(
            f"kernels[{family!r}]='fused' was requested but cannot run: {reason}; using the torch path", stacklevel=3
        )
    return "torch"


def register_fused(family: str, torch_op: Callable, loader: Callable[[], Callable]) -> None:
    """Register the fused alternative of ``torch_op`` (same arguments and contract), imported by ``loader()`` on the
    first fused call; ``ValueError`` for an unknown family."""
    if family not in KERNEL_FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; known: {KERNEL_FAMILIES}")
    FUSED_ALTERNATIVES[torch_op.__name__] = (family, loader)


def op_for(torch_op: Callable, requested: str, *tensors: torch.Tensor) -> Callable:
    """``torch_op`` or its registered fused alternative, as :func:`choose_backend` decides; ``KeyError`` when
    ``torch_op`` has none registered."""
    family, loader = FUSED_ALTERNATIVES[torch_op.__name__]
    if choose_backend(family, requested, *tensors) == "fused":
        return loader()
    return torch_op


def _lazy_probe(module: str, probe: str) -> Callable[..., tuple[bool, str]]:
    """A probe importing its kernel module on first use; an import failure becomes the reason."""

    loaded: list = []  # [module] or [ImportError message], filled on the first call

    def run(*tensors: torch.Tensor) -> tuple[bool, str]:
        if not loaded:
            try:
                loaded.append(importlib.import_module(f"{__package__}.{module}"))
            except ImportError as exc:  # kernel module or its dependency (triton, fla-core) missing
                loaded.append(f"cannot import the {module} kernels ({exc})")
        if isinstance(loaded[0], str):
            return False, loaded[0]
        return getattr(loaded[0], probe)(*tensors)

    run.__name__ = f"probe_{module}"
    return run


FUSED_AVAILABILITY.update({family: _lazy_probe(*PROBES[family]) for family in KERNEL_FAMILIES})


def local_tensor(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor``, or a replicated DTensor's local tensor, for a kernel that reads raw storage; ``ValueError`` naming
    ``name`` and the placements for a sharded or partial DTensor."""
    try:
        from torch.distributed.tensor import DTensor, Replicate
    except ImportError:  # torch built without distributed
        return tensor
    if not isinstance(tensor, DTensor):
        return tensor
    if all(isinstance(p, Replicate) for p in tensor.placements):
        return tensor.to_local()
    raise ValueError(f"{name} arrives as a DTensor with placements {tuple(tensor.placements)}; the fused kernels need "
                     "the full tensor (replicate it, or run this family with kernels='torch')")
