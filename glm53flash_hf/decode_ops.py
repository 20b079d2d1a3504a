"""Low-overhead building blocks for decode-sized CPU inference (a few fp32 tokens, no autograd).

A cached decode step multiplies one token by ~80 small weight matrices and runs a few hundred tiny elementwise ops.
On CPU its time is per-call overhead (``nn.Module.__call__`` ~3.5 us, a torch op ~1-2 us) plus streaming the
weights (memory-bound GEMVs), not arithmetic. These helpers take the shortest route when it is safe and fall back
to the ordinary module call otherwise:

* :func:`call_linear` runs a plain ``nn.Linear`` (exact class, no hooks, no patched ``forward``) as ``F.linear``
  without ``nn.Module.__call__`` (the same op: the same bits); a PEFT/LoRA-wrapped or accelerate-hooked layer is
  called as a module.
* :func:`numpy_linear` is the GEMV of the decode-sized paths on numpy arrays (faster than ``F.linear`` for one row).
* :func:`small_rms_norm` is the fp32 RMSNorm of a few rows in numpy (``F.rms_norm`` costs ~10 us per call here).

Results equal the torch path to fp32 rounding (BLAS and torch may sum a dot product in a different order).
Every user keeps its torch path; tests compare the two (tests/test_decode_ops.py) and the cached decode with the
uncached forward (tests/test_generation.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module_mod

try:
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None

__all__ = [
    "SMALL_NUMEL",
    "SMALL_TOKENS",
    "call_linear",
    "matvec_rows",
    "numpy_linear",
    "numpy_ok",
    "plain_module",
    "rms_norm_rows",
    "small_rms_norm",
]

# The decode-sized paths of this package (numpy or lean torch, CPU, grad mode off) take at most this many tokens (rows
# of queries): a decode step of a few sequences. Anything larger -- a prefill, a training step, the no-grad forward of
# a reentrant activation checkpoint over more tokens -- runs the general torch path (so such a recompute matches its
# forward bit for bit; at <= 8 tokens the two agree to fp32 rounding).
SMALL_TOKENS = 8
# ... and inputs of at most this many elements (the release's widest activation, 8 tokens x 6144, fits).
SMALL_NUMEL = 1 << 16


def _global_hooks() -> bool:
    return bool(
        _module_mod._global_forward_hooks
        or _module_mod._global_forward_pre_hooks
        or _module_mod._global_backward_hooks
        or _module_mod._global_backward_pre_hooks
    )


def plain_module(module: nn.Module, cls: type) -> bool:
    """Whether calling ``module`` is exactly ``cls.forward``: ``type(module) is cls``, no forward/backward hooks
    (module or global), and no instance-level ``forward`` (accelerate's hooks patch one in)."""
    return (
        type(module) is cls
        and not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)
        and not module._backward_pre_hooks
        and "forward" not in module.__dict__
        and not _global_hooks()
    )


def numpy_ok(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``x`` (at most ``SMALL_NUMEL`` elements) and ``weights`` can go through numpy: CPU, fp32, grad mode
    off (``torch.no_grad()`` / ``inference_mode``, as ``generate`` runs), not compiling."""
    return (
        _np is not None
        and x.is_cpu
        and x.dtype == torch.float32
        and x.numel() <= SMALL_NUMEL
        and all(w.dtype == torch.float32 and w.is_cpu for w in weights)
        and not torch.is_grad_enabled()  # under grad mode always torch: results never depend on requires_grad
        and not torch.compiler.is_compiling()
    )


def call_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``: a plain ``nn.Linear`` (exact class, no hooks, no patched ``forward``; see
    :func:`plain_module`) runs ``F.linear(x, weight, bias)`` directly, anything else (a PEFT/LoRA layer, an
    accelerate-hooked one) is called as a module.

    The same op as the module call, so the same bits in every mode (a LoRA adapter at init reproduces the base model
    exactly); it only skips ``nn.Module.__call__``'s bookkeeping (~3.5 us per call, ~80 calls per decode token).
    """
    if plain_module(module, nn.Linear):
        return F.linear(x, module.weight, module.bias)
    return module(x)


def matvec_rows(weight, x):
    """``x @ weight.T`` for numpy ``x [T, in]`` and ``weight [out, in]``; one row runs as a matrix-vector product
    (BLAS ``gemv``: ~10% faster than a one-row ``gemm`` when the weight streams from memory)."""
    if x.shape[0] == 1:
        return (weight @ x[0])[None]
    return x @ weight.T


def numpy_linear(module: nn.Module, x):
    """A linear layer on a numpy fp32 array ``x [T, in]`` inside a decode-sized path (see :data:`SMALL_TOKENS`):
    a plain fp32 ``nn.Linear`` is one numpy ``x @ W.T (+ b)`` on the weight's memory (BLAS; about half of
    ``F.linear``'s cost for one row of a cached weight, ~20% less for a weight streamed from memory), anything else
    (a PEFT/LoRA layer, a hooked one, other dtypes) goes through :func:`call_linear`. Returns a numpy fp32 array
    ``[T, out]`` (a module that returns another dtype is cast to fp32, as the fp32 ops after it would promote).

    Only the decode-sized paths use it: their results already equal the general path to fp32 rounding only (BLAS
    may sum a dot product in another order than torch), while :func:`call_linear` keeps torch's bits.
    """
    if plain_module(module, nn.Linear):
        params = module._parameters  # direct reads (nn.Module.__getattr__ costs ~0.5 us; ~70 calls per token)
        weight, bias = params["weight"], params["bias"]
        if weight.dtype == torch.float32 and weight.is_cpu and (bias is None or bias.dtype == torch.float32):
            out = matvec_rows(weight.detach().numpy(), x)
            if bias is not None:
                out += bias.detach().numpy()
            return out
    return call_linear(module, torch.from_numpy(x)).to(torch.float32).numpy()


def rms_norm_rows(x, weight, eps: float):
    """RMSNorm over the last dim of a numpy fp32 array ``x [..., D]``: ``x / sqrt(mean(x^2) + eps) (* weight)``
    (``weight`` a numpy ``[D]`` array or ``None``). The one numpy RMSNorm of the decode-sized paths."""
    f32 = _np.float32
    mean_sq = _np.einsum("...d,...d->...", x, x)[..., None] / f32(x.shape[-1])
    out = x * (f32(1.0) / _np.sqrt(mean_sq + f32(eps)))
    if weight is not None:
        out *= weight
    return out


def small_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """fp32 RMSNorm of a few rows: ``x * rsqrt(mean(x^2) + eps) (* weight)`` over the last dim.

    numpy when :func:`numpy_ok` holds (``x`` and ``weight`` fp32 CPU, no autograd), else ``F.rms_norm``. Same
    formula as :class:`glm53flash_hf.norm.Glm53FlashRMSNorm`'s fp32 path; fp32 rounding of the mean may differ.
    """
    ws = (weight,) if weight is not None else ()
    if not numpy_ok(x, *ws):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xn = x.detach().numpy() if x.is_contiguous() else x.detach().contiguous().numpy()
    return torch.from_numpy(rms_norm_rows(xn, None if weight is None else weight.detach().numpy(), eps))
