"""Per-call choice between the torch path and a fused kernel, for each operator family.

``config.kernels[family]`` (family in ``kda``, ``mhc``, ``dsa``, ``moe``) says what the caller wants:

* ``"torch"``: always the torch path (the oracle; runs everywhere);
* ``"auto"``: the fused kernel when it can run on these tensors (CUDA tensors, kernel installed), else torch;
* ``"fused"``: the fused kernel; when it cannot run, a warning says why (once per family and reason) and the
  torch path runs instead — a forward never fails because a kernel is missing.

The choice is made per call from the tensors' device, never from ``module.training`` (an activation-checkpoint
recompute in eval mode must pick the same path as the forward it replays) and never at import time: CPU tensors
never reach a GPU-only kernel even when fla/triton are installed.

Fused kernels are probed through :data:`FUSED_AVAILABILITY` (family → callable returning ``(ok, reason)`` for the
given tensors). The probes import their kernel module ``glm53flash_hf.<family>_fused`` lazily, only for CUDA
tensors: ``kda_fused`` (fla-core), ``mhc_fused``, ``dsa_fused`` and ``moe_fused`` (our Triton kernels); each exposes
``fused_<family>_available(*tensors) -> (ok, reason)``.

:func:`local_tensor` unwraps parameters that arrive as DTensors (FSDP2 / tensor parallel) before a fused kernel
reads their storage: replicated ones become their local tensor, sharded ones raise naming the parameter.
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


def _lazy_probe(module: str, probe: str) -> Callable[..., tuple[bool, str]]:
    """A probe that imports ``glm53flash_hf.<module>`` on first use (only ever for CUDA tensors, so CPU runs never
    import triton or fla) and calls its ``probe`` function; an import failure is reported as the reason."""

    loaded: list = []  # [module] or [ImportError message], filled on the first call

    def run(*tensors: torch.Tensor) -> tuple[bool, str]:
        if not loaded:
            import importlib

            try:
                loaded.append(importlib.import_module(f"{__package__}.{module}"))
            except ImportError as exc:  # kernel module or its dependency (triton, fla-core) missing
                loaded.append(f"cannot import the {module} kernels ({exc})")
        if isinstance(loaded[0], str):
            return False, loaded[0]
        return getattr(loaded[0], probe)(*tensors)

    run.__name__ = f"probe_{module}"
    return run


for _family in KERNEL_FAMILIES:
    FUSED_AVAILABILITY[_family] = _lazy_probe(f"{_family}_fused", f"fused_{_family}_available")


def local_tensor(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """The plain tensor a fused kernel may read, for a parameter that may arrive as a DTensor.

    FSDP2 all-gathers parameters to plain tensors for the forward, but under tensor/expert parallelism (or a
    module used outside its FSDP forward hooks) a parameter can still be a ``DTensor``; Triton/fla kernels read raw
    storage and would silently use one shard. Replicated DTensors are unwrapped to their (full) local tensor.

    Args:
        tensor: a tensor or ``torch.distributed.tensor.DTensor``.
        name: the parameter's name, for the error message.

    Returns:
        ``tensor`` itself when it is not a DTensor, else its local tensor (all placements ``Replicate``).

    Raises:
        ValueError: a DTensor with any non-replicated placement (``Shard``, ``Partial``), naming ``name`` and the
            placements.
    """
    try:
        from torch.distributed.tensor import DTensor, Replicate
    except ImportError:  # torch built without distributed
        return tensor
    if not isinstance(tensor, DTensor):
        return tensor
    if all(isinstance(p, Replicate) for p in tensor.placements):
        return tensor.to_local()
    raise ValueError(
        f"{name} arrives as a DTensor with placements {tuple(tensor.placements)}; the fused kernels need the full "
        "tensor (replicate it, or run this family with kernels='torch')"
    )
