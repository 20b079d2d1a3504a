"""Per-call choice between the torch path and a fused kernel, for each operator family.

``config.kernels[family]`` (family in ``kda``, ``mhc``, ``dsa``, ``moe``) says what the caller wants:

* ``"torch"``: always the torch path (the oracle; runs everywhere);
* ``"auto"``: the fused kernel when it can run on these tensors (CUDA tensors, kernel installed), else torch;
* ``"fused"``: the fused kernel; when it cannot run, a warning says why (once per family and reason) and the
  torch path runs instead — a forward never fails because a kernel is missing.

The choice is made per call from the tensors' device, never from ``module.training`` (an activation-checkpoint
recompute in eval mode must pick the same path as the forward it replays) and never at import time: CPU tensors
never reach a GPU-only kernel even when fla/triton are installed.

Fused kernels register themselves in :data:`FUSED_AVAILABILITY` (family → callable returning ``(ok, reason)``
for the given tensors); none is registered in this version.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from .configuration_glm53flash import KERNEL_CHOICES, KERNEL_FAMILIES

# family -> function(*tensors) -> (can_run: bool, reason_if_not: str)
FUSED_AVAILABILITY: dict[str, Callable[..., tuple[bool, str]]] = {}

_warned: set[tuple[str, str]] = set()


def requested_backend(config, family: str) -> str:
    """``config.kernels[family]`` (``"auto"`` when the config has no ``kernels`` setting).

    Raises:
        ValueError: unknown family or choice.
    """
    if family not in KERNEL_FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; known: {KERNEL_FAMILIES}")
    kernels = getattr(config, "kernels", None)
    choice = kernels.get(family, "auto") if isinstance(kernels, dict) else (kernels or "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels[{family!r}] must be one of {KERNEL_CHOICES}; got {choice!r}")
    return choice


def choose_backend(family: str, requested: str, *tensors: torch.Tensor) -> str:
    """Return ``"torch"`` or ``"fused"`` for this call (see the module docstring).

    Args:
        family: operator family (``kda``, ``mhc``, ``dsa``, ``moe``).
        requested: ``"auto"``, ``"torch"`` or ``"fused"``.
        tensors: the call's input tensors (their device decides).

    Raises:
        ValueError: unknown family or choice.
    """
    if family not in KERNEL_FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; known: {KERNEL_FAMILIES}")
    if requested not in KERNEL_CHOICES:
        raise ValueError(f"backend for {family} must be one of {KERNEL_CHOICES}; got {requested!r}")
    if requested == "torch":
        return "torch"
    probe = FUSED_AVAILABILITY.get(family)
    if probe is None:
        ok, reason = False, f"this version of glm53flash-hf has no fused {family} kernel"
    elif not all(t.is_cuda for t in tensors if isinstance(t, torch.Tensor)):
        ok, reason = False, "the tensors are not on a CUDA device"
    else:
        ok, reason = probe(*tensors)
    if ok:
        return "fused"
    if requested == "fused" and (family, reason) not in _warned:
        _warned.add((family, reason))
        warnings.warn(f"kernels[{family!r}]='fused' was requested but cannot run: {reason}; using the torch path")
    return "torch"


def _mhc_fused_available(*tensors: torch.Tensor) -> tuple[bool, str]:
    """Probe of the Triton mHC kernels (imported only here, on a CUDA call: CPU runs never import triton)."""
    from .triton_mhc import fused_mhc_available

    return fused_mhc_available(*tensors)


FUSED_AVAILABILITY["mhc"] = _mhc_fused_available
