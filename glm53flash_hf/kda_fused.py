"""Fused KDA path: fla-core's Triton kernels as ``torch.library`` custom ops (namespace ``glm53flash``) with fakes
and autograd formulas, the maths of the torch path :mod:`.kda_ops`; the ops' bodies (the fla calls) are in
:mod:`.fla_compat`, and importing this module never imports fla. Besides the errors each function lists, a kernel call
raises ``TypeError`` when the installed fla rejects an argument and ``ImportError`` when fla-core is missing.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from .dispatch import local_tensor
from .fla_compat import (
    chunk_backward,
    chunk_forward,
    conv_backward,
    conv_forward,
    import_error,
    norm_backward,
    norm_forward,
    recurrent_step,
)
from .graph_ops import define_op, no_output
from .kda_ops import _conv_fake, check_conv_inputs, check_core_inputs, check_gate_params, check_norm_inputs, check_state

__all__ = ["fused_kda_available", "chunk_kda_fused", "chunk_arguments", "causal_conv1d_fused", "rms_norm_gated_fused",
           "recurrent_kda_fused"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_HEAD_DIM = 16  # tl.dot's smallest K
MAX_HEAD_DIM = 256  # asserted by fla's chunk_kda
FLA_CHUNK_SIZES = (32, 64)
SAFE_GATE_RANGE = (-5.0, 0.0)  # fla: safe_gate with the in-kernel gate needs lower_bound in [-5, 0)


def fused_kda_available(*tensors: Tensor) -> tuple[bool, str]:
    """The KDA probe of :mod:`.dispatch`: ``(True, "")`` when fla's kernels can run on ``tensors``, else
    ``(False, reason)``. Floating tensors must be float32/bfloat16/float16 on CUDA (CPU under ``TRITON_INTERPRET=1``),
    a 4-D tensor ``[B, T, H, K]`` with ``K`` in ``[16, 256]``, and fla-core must import."""
    tensors = [t for t in tensors if isinstance(t, Tensor)]
    if not tensors:
        return False, "no tensors given"
    bad = sorted({str(t.dtype) for t in tensors if t.is_floating_point() and t.dtype not in SUPPORTED_DTYPES})
    if bad:
        return False, f"unsupported dtype(s) {bad} (fused KDA supports float32, bfloat16, float16)"
    wrong = sorted({t.shape[-1] for t in tensors if t.dim() == 4 and not MIN_HEAD_DIM <= t.shape[-1] <= MAX_HEAD_DIM})
    if wrong:
        return False, f"head dim {wrong[0]} is outside fla's supported range [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" and all(t.device.type == "cpu" for t in tensors)
    if not (all(t.is_cuda for t in tensors) or interpreted):
        return False, "the tensors are not on a CUDA device"
    error = import_error()
    return (False, error) if error is not None else (True, "")


def _safe_gate(lower_bound: float | None) -> bool:
    return lower_bound is not None and SAFE_GATE_RANGE[0] <= lower_bound < SAFE_GATE_RANGE[1]


def _indices_fake(like: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """Fake of the chunk-index output: ``[NT, 2]`` long with a data-dependent ``NT``, ``[0, 2]`` without documents."""
    rows = 0 if cu_seqlens is None else torch.library.get_ctx().new_dynamic_size()
    return like.new_empty((rows, 2), dtype=torch.long)


def _chunk_fwd_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, output_final_state,
                    use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, safe_gate, lower_bound,
                    chunk_size):
    B, T, H, K = q.shape
    V = v.shape[-1]
    n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    f32 = torch.float32
    l2 = use_qk_l2norm_in_kernel
    return (
        q.new_empty((B, T, H, V)),  # o
        q.new_empty((n, H, K, V), dtype=f32) if output_final_state else no_output(q),  # final state
        q.new_empty(q.shape) if l2 else no_output(q),  # l2-normalised q
        q.new_empty((B, T, H), dtype=f32) if l2 else no_output(q),  # its reciprocal norms
        k.new_empty(k.shape) if l2 else no_output(q),
        k.new_empty((B, T, H), dtype=f32) if l2 else no_output(q),
        beta.new_empty(beta.shape, dtype=f32) if use_beta_sigmoid_in_kernel else no_output(q),  # sigmoid(beta)
        g.new_empty(g.shape, dtype=f32) if not use_gate_in_kernel else no_output(q),  # the gate's chunk-local cumsum
        k.new_empty((B, T, H, chunk_size)),  # Aqk
        k.new_empty((B, T, H, chunk_size)),  # Akk
        _indices_fake(q, cu_seqlens),
    )


def _chunk_bwd_fake(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, *rest):
    inputs = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    return tuple(no_output(q) if t is None else t.new_empty(t.shape) for t in inputs)


_CHUNK_FLAGS = ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "safe_gate",
                "lower_bound", "chunk_size")


def _chunk_setup(ctx, inputs, output):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, output_final_state, *flags = inputs
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *output[2:])
    ctx.mark_non_differentiable(*output[2:])
    ctx.scale, ctx.output_final_state, ctx.flags = scale, output_final_state, dict(zip(_CHUNK_FLAGS, flags))


def _chunk_backward(ctx, do, dht, *_):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *residuals = ctx.saved_tensors
    if do is None:
        do = torch.zeros(q.shape[:3] + v.shape[-1:], dtype=q.dtype, device=q.device)
    dht = dht if ctx.output_final_state else None
    dq, dk, dv, dg, db, dA, dbias, dh0 = _CHUNK_BWD(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state,
                                                    cu_seqlens, *residuals, ctx.scale, **ctx.flags)
    return (dq, dk, dv, dg, db, dA if A_log is not None else None, dbias if dt_bias is not None else None,
            dh0 if initial_state is not None else None) + (None,) * 9


_CHUNK_BWD = define_op("fla_chunk_kda_bwd", chunk_backward, _chunk_bwd_fake)
_CHUNK_FWD = define_op("fla_chunk_kda_fwd", chunk_forward, _chunk_fwd_fake, backward=_chunk_backward,
                       setup_context=_chunk_setup)


def _conv_fwd_fake(x, weight, initial_state, cu_seqlens, activation, output_final_state):
    y, final = _conv_fake(x, weight, initial_state, cu_seqlens, activation=activation,
                          output_final_state=output_final_state)
    return y, final, _indices_fake(x, cu_seqlens)


def _conv_bwd_fake(dy, dht, x, weight, initial_state, cu_seqlens, chunk_indices, activation):
    return (torch.empty_like(x), weight.new_empty(weight.shape),
            no_output(x) if initial_state is None else initial_state.new_empty(initial_state.shape))


def _conv_setup(ctx, inputs, output):
    x, weight, initial_state, cu_seqlens, activation, output_final_state = inputs
    ctx.save_for_backward(x, weight, initial_state, cu_seqlens, output[2])
    ctx.mark_non_differentiable(output[2])
    ctx.activation, ctx.output_final_state = activation, output_final_state


def _conv_backward(ctx, dy, dht, _):
    x, weight, initial_state, cu_seqlens, indices = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(x, memory_format=torch.contiguous_format)
    dx, dw, dh0 = _CONV_BWD(dy, dht if ctx.output_final_state else None, x, weight, initial_state, cu_seqlens,
                            indices, ctx.activation)
    return dx, dw, dh0 if initial_state is not None else None, None, None, None


_CONV_BWD = define_op("fla_causal_conv1d_bwd", conv_backward, _conv_bwd_fake)
_CONV_FWD = define_op("fla_causal_conv1d_fwd", conv_forward, _conv_fwd_fake, backward=_conv_backward,
                      setup_context=_conv_setup)


def _norm_fwd_fake(x, gate, weight, eps):
    return x.new_empty(x.shape), x.new_empty((math.prod(x.shape[:-1]),), dtype=torch.float32)


def _norm_bwd_fake(dy, x, gate, weight, rstd, eps):
    return x.new_empty(x.shape), x.new_empty(gate.shape), weight.new_empty(weight.shape)


def _norm_setup(ctx, inputs, output):
    x, gate, weight, eps = inputs
    ctx.save_for_backward(x, gate, weight, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.eps = eps


def _norm_backward(ctx, dy, _):
    x, gate, weight, rstd = ctx.saved_tensors
    dx, dg, dw = _NORM_BWD(dy, x, gate, weight, rstd, ctx.eps)
    return dx, dg, dw, None


_NORM_BWD = define_op("fla_rms_norm_gated_bwd", norm_backward, _norm_bwd_fake)
_NORM_FWD = define_op("fla_rms_norm_gated_fwd", norm_forward, _norm_fwd_fake, backward=_norm_backward,
                      setup_context=_norm_setup)


def _recurrent_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, lower_bound):
    B, _, H, K = q.shape
    return v.new_empty(v.shape), q.new_empty((B, H, K, v.shape[-1]), dtype=torch.float32)


def _recurrent_backward(ctx, *grads):
    raise RuntimeError("fla's fused_recurrent_kda has no backward (inference only); use the chunked path "
                       "(chunk_kda_fused) for training")


_RECURRENT = define_op("fla_fused_recurrent_kda", recurrent_step, _recurrent_fake, backward=_recurrent_backward)


def chunk_kda_fused(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, A_log: Tensor | None = None,
                    dt_bias: Tensor | None = None, lower_bound: float | None = None, scale: float | None = None,
                    initial_state: Tensor | None = None, output_final_state: bool = False,
                    cu_seqlens: Tensor | None = None, chunk_size: int = 64,
                    use_qk_l2norm_in_kernel: bool = True) -> tuple[Tensor, Tensor | None]:
    """Chunked KDA by fla's chunked kernels (fla's ``chunk_kda``), with ``A_log`` the forget gate and the beta sigmoid
    computed in fp32 inside the kernel; differentiable in every tensor argument.

    The contract of :func:`.kda_ops.chunk_kda_torch` (float32/bfloat16/float16 inputs; fla computes the gate and the
    state in fp32), except ``chunk_size``: 32 or 64 (the maths does not depend on it).

    Raises:
        ValueError: shape mismatches, head dims outside ``[16, 256]``, a chunk size other than 32/64, bad
            ``cu_seqlens`` or gate parameters, a sharded DTensor ``A_log`` / ``dt_bias``.
    """
    o, final = _CHUNK_FWD(**chunk_arguments(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                            chunk_size, (A_log, dt_bias, lower_bound), use_qk_l2norm_in_kernel))[:2]
    return o, final if output_final_state else None


def chunk_arguments(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size, gate,
                    use_qk_l2norm_in_kernel=True) -> dict:
    """The checked keyword arguments of fla's chunked KDA (the op ``fla_chunk_kda_fwd``, fla's ``chunk_kda``) for
    :func:`chunk_kda_fused`'s arguments; ``gate = (A_log, dt_bias, lower_bound)`` with an ``A_log`` puts the forget
    gate and the beta sigmoid in the kernel, ``(None, None, None)`` takes them activated.

    Raises:
        ValueError: as :func:`chunk_kda_fused`.
    """
    check_core_inputs(q, k, v, g, beta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    for name, d in (("K", K), ("V", V)):
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            raise ValueError(f"fused KDA needs head dim {name} in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]; got {name}={d}")
    A_log, dt_bias, lower_bound = gate
    in_kernel = check_gate_params(A_log, dt_bias, lower_bound, H, K)
    if in_kernel:
        A_log, dt_bias = local_tensor(A_log, "forget_gate.A_log"), local_tensor(dt_bias, "forget_gate.dt_bias")
    if chunk_size not in FLA_CHUNK_SIZES:
        raise ValueError(f"fused KDA chunk_size must be one of {FLA_CHUNK_SIZES}; got chunk_size={chunk_size!r}")
    if cu_seqlens is None:  # with documents, the op checks the state against the boundaries it reads
        check_state(initial_state, B, H, K, V)
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                initial_state=None if initial_state is None else initial_state.float(), cu_seqlens=cu_seqlens,
                scale=float(K**-0.5 if scale is None else scale), output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=in_kernel,
                use_beta_sigmoid_in_kernel=in_kernel, safe_gate=_safe_gate(lower_bound),
                lower_bound=lower_bound, chunk_size=chunk_size)


def causal_conv1d_fused(x: Tensor, weight: Tensor, *, cu_seqlens: Tensor | None = None, activation: str | None = "silu",
                        initial_state: Tensor | None = None, output_final_state: bool = False
                        ) -> tuple[Tensor, Tensor | None]:
    """Depthwise causal convolution (+SiLU) by fla's convolution kernels: the contract of
    :func:`.kda_ops.causal_conv1d_torch`, accumulated in fp32 whatever the weight dtype.

    Raises:
        ValueError: shapes, activation, bad ``cu_seqlens``; a sharded DTensor weight.
    """
    weight = local_tensor(weight, "conv1d.weight")
    if cu_seqlens is None:  # with documents, the op runs these checks with the boundaries it reads
        check_conv_inputs(x, weight, activation, initial_state, None)
    y, final, _ = _CONV_FWD(x, weight, initial_state, cu_seqlens, activation, output_final_state)
    return y, final if output_final_state else None


def rms_norm_gated_fused(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``(RMSNorm_fp32(x) * weight * sigmoid(gate)).to(x.dtype)`` for ``x, gate`` ``[..., K]``, ``weight`` ``[K]``, by
    fla's ``rms_norm_gated(activation="sigmoid")`` kernels (:class:`.kda.Glm53FlashRMSNormGated`).

    Raises:
        ValueError: shape mismatch, or a sharded DTensor weight.
    """
    weight = local_tensor(weight, "o_norm.weight")
    check_norm_inputs(x, gate, weight)
    return _NORM_FWD(x, gate, weight, float(eps))[0]


def recurrent_kda_fused(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, A_log: Tensor | None = None,
                        dt_bias: Tensor | None = None, lower_bound: float | None = None, scale: float | None = None,
                        initial_state: Tensor | None = None, output_final_state: bool = False,
                        use_qk_l2norm_in_kernel: bool = True) -> tuple[Tensor, Tensor | None]:
    """KDA decode step(s): the contract of :func:`.kda_ops.recurrent_kda_torch`. Without gradients, with ``A_log`` and
    the q/k l2-norm, fla's ``fused_recurrent_kda`` (gate, beta sigmoid, l2-norm in the kernel; it has no backward);
    otherwise :func:`chunk_kda_fused`, the same maths, differentiable. ``initial_state`` is not modified.

    Raises:
        ValueError: shape mismatches, head dims outside ``[16, 256]``, bad gate parameters, a sharded DTensor.
    """
    inputs = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    if needs_grad or A_log is None or not use_qk_l2norm_in_kernel:
        return chunk_kda_fused(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
                               initial_state=initial_state, output_final_state=output_final_state,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    args = chunk_arguments(q, k, v, g, beta, scale, initial_state, output_final_state, None, 64,
                           (A_log, dt_bias, lower_bound))
    o, final = _RECURRENT(q, k, v, g, beta, args["A_log"], args["dt_bias"], args["initial_state"],
                          None if scale is None else float(scale), lower_bound)
    return o, final if output_final_state else None
