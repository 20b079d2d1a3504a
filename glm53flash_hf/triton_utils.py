"""What the Triton kernel modules share: the optional ``triton`` import (``TRITON_AVAILABLE``), accepted dtypes,
availability probes and launch helpers."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - exercised on installs without triton
    triton = None
    tl = None
    TRITON_AVAILABLE = False

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# torch dtype -> Triton dtype of the kernels' constexpr dtype arguments (empty without triton)
TL_DTYPES: dict = (
    {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16} if TRITON_AVAILABLE else {}
)

__all__ = ["SUPPORTED_DTYPES", "TL_DTYPES", "TRITON_AVAILABLE", "check_device", "check_dtype", "interpreting",
           "next_power_of_2", "probe_tensors", "require_triton", "round_to", "tl", "triton"]


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def require_triton(module: str) -> None:
    """Raise ``RuntimeError`` naming ``module`` when triton is not importable."""
    if not TRITON_AVAILABLE:
        raise RuntimeError(f"{module} needs triton (pip install triton); use the torch path instead")


def next_power_of_2(x: int, lo: int = 1) -> int:
    """The smallest power of two ``>= max(x, lo)`` (Triton block sizes must be powers of two)."""
    return max(lo, 1 << max(0, int(x) - 1).bit_length())


def check_device(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``t`` is on CUDA (or the interpreter runs)."""
    if not t.is_cuda and not interpreting():
        raise ValueError(f"{name} must be a CUDA tensor for the Triton kernels (got device {t.device})")


def check_dtype(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``t`` is float32, bfloat16 or float16."""
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16; got dtype {t.dtype}")


def probe_tensors(family: str, tensors) -> tuple[list[torch.Tensor], str]:
    """The first half of a family's probe: ``(the tensor arguments, "")`` when triton imports and they are on CUDA
    with float32/bfloat16/float16 floats, else ``(tensors, reason)`` naming ``family``."""
    if not TRITON_AVAILABLE:
        return [], "triton is not installed"
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not tensors:
        return tensors, "no tensors given"
    if not all(t.is_cuda for t in tensors):
        return tensors, "the tensors are not on a CUDA device"
    bad = sorted({str(t.dtype) for t in tensors if t.dtype.is_floating_point and t.dtype not in SUPPORTED_DTYPES})
    if bad:
        return tensors, f"unsupported dtype(s) {bad} (fused {family} supports float32, bfloat16, float16)"
    return tensors, ""


if TRITON_AVAILABLE:

    @triton.jit
    def round_to(x, DT: tl.constexpr):
        """``x`` rounded to the nearest ``DT`` value, ties to even, as fp32 (bf16 by integer arithmetic on the fp32
        bits, the same on GPUs and the interpreter; a NaN stays a quiet NaN)."""
        x = x.to(tl.float32)
        if DT == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            return tl.where(x != x, bits | 0x7FC00000, rounded).to(tl.float32, bitcast=True)
        else:
            return x.to(DT).to(tl.float32)

else:  # pragma: no cover - installs without triton
    round_to = None
