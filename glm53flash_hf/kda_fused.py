"""The fused KDA path: fla-core's Triton kernels as ``torch.library`` custom ops, with the maths of the torch path in
:mod:`glm53flash_hf.kda_ops` (which equals transformers' ``Glm5NextTextLinearAttention``).

What runs where in one call of the KDA layer on the fused path (each function's docstring states its contract):

* the projections: torch ``nn.Linear``, as in the torch path;
* the short convolution + SiLU over ``[q|k|v]``: :func:`causal_conv1d_fused`;
* the forget gate, the beta sigmoid, the q/k l2-norm and the chunked delta rule: :func:`chunk_kda_gate_in_kernel`
  (one call of fla's chunked kernels; gradients reach ``A_log`` and ``dt_bias`` from the kernel), or, for a cached
  decode step without gradients, :func:`fused_recurrent_step`;
* the gated RMSNorm of the output: :func:`rms_norm_gated_fused`;
* a sequence-parallel shard, where fla's context-parallel path applies: :func:`chunk_kda_context_parallel`.

:func:`chunk_kda_fused` is the chunked core with an activated gate and beta (the contract of
:func:`glm53flash_hf.kda_ops.chunk_kda_torch`).

Custom ops (namespace ``glm53flash``, :func:`glm53flash_hf.graph_ops.define_op`, registered at import without
importing fla): ``fla_chunk_kda_fwd`` / ``_bwd``, ``fla_causal_conv1d_fwd`` / ``_bwd``, ``fla_rms_norm_gated_fwd`` /
``_bwd`` (forward and backward ops whose bodies are those of fla's ``ChunkKDAFunction``, ``CausalConv1dFunction``
and ``LayerNormGatedFunction``; what those Functions save for backward is returned as extra non-differentiable
outputs of the forward op) and the inference-only ``fla_fused_recurrent_kda``. Each has a fake implementation, so
``torch.compile(fullgraph=True)`` traces these functions without a graph break; the checks that read ``cu_seqlens``
(one host sync) run inside the ops, every other check in the Python functions before the op.

The fla calls of those bodies, with fla's argument lists, are in :mod:`.fla_compat` (every call by keyword through
:func:`.fla_compat.call_checked`); this module names no fla function. :func:`fused_kda_available` is the probe behind
``dispatch.choose_backend("kda", ...)``. Importing this module never imports fla. Parameters handed to kernels pass
through :func:`glm53flash_hf.dispatch.local_tensor`. Reasons and the precision of fla's kernels: ``docs/design.md``,
section "KDA".
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

from .dispatch import local_tensor
from .fla_compat import (
    call_checked,
    chunk_backward,
    chunk_forward,
    chunk_indices_of,
    conv_backward,
    conv_forward,
    cp_device_error,
    import_error,
    load_cp,
    norm_backward,
    norm_forward,
    recurrent_step,
)
from .graph_ops import define_op
from .kda_ops import check_conv_inputs, check_core_inputs, check_cu_seqlens, check_state

__all__ = [
    "fused_kda_available",
    "chunk_kda_fused",
    "chunk_kda_gate_in_kernel",
    "chunk_kda_context_parallel",
    "fla_cp_available",
    "fla_cp_context",
    "fla_cp_refusal",
    "causal_conv1d_fused",
    "rms_norm_gated_fused",
    "fused_recurrent_step",
    "kernel_params",
]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_HEAD_DIM = 16  # tl.dot's smallest K
MAX_HEAD_DIM = 256  # asserted by fla's chunk_kda
FLA_CHUNK_SIZES = (32, 64)
SAFE_GATE_RANGE = (-5.0, 0.0)  # fla: safe_gate with the in-kernel gate needs lower_bound in [-5, 0)


# ========================================================================================================= fla access
def fla_cp_available(device: torch.device) -> tuple[bool, str]:
    """Whether fla's context-parallel KDA kernels (``fla.ops.cp``) can run on ``device``.

    Returns:
        ``(True, "")``, or ``(False, reason)``: fla's CP modules cannot be imported, or fla's own device check refuses
        the device (it requires an NVIDIA GPU of compute capability >= 8.0, or Ascend).
    """
    try:
        error = cp_device_error(device)
    except ImportError as exc:
        return False, str(exc)
    if error is not None:
        return False, f"fla refuses the device {device}: {error}"
    return True, ""


def fla_cp_refusal(sp, device) -> str | None:
    """Why fla's context-parallel KDA cannot run the shard of ``sp`` (a
    :class:`~glm53flash_hf.sequence_parallel.SequenceParallelContext`), ``None`` when it can: the global batch must
    be one token row, and :func:`fla_cp_available` must accept ``device``."""
    if sp.global_layout.batch_size != 1:
        return (f"it chains one token row and this batch has {sp.global_layout.batch_size} rows; pack the "
                "documents into one row per step to use it")
    ok, reason = fla_cp_available(device)
    return None if ok else reason


def fla_cp_context(sp, cu_seqlens: torch.Tensor):
    """fla's ``FLACPContext`` of this rank, built once per forward (kept in ``sp.memo``) by fla's
    ``build_cp_context`` from the global row's boundaries and the SP group.

    Args:
        sp: the :class:`~glm53flash_hf.sequence_parallel.SequenceParallelContext` of the forward.
        cu_seqlens: this rank's local segment boundaries.

    Raises:
        RuntimeError: fla's local boundaries differ from ``cu_seqlens``, i.e. fla and this package would split the
            row differently.
    """
    if "fla_cp" not in sp.memo:
        glob = sp.global_layout.cu_seqlens
        ctx = load_cp().build_cp_context(cu_seqlens=glob, group=sp.group, cu_seqlens_cpu=glob.cpu())
        mine = cu_seqlens.tolist()
        if ctx.cu_seqlens_cpu.tolist() != mine:
            raise RuntimeError(
                f"fla's context-parallel split of the row differs from this rank's layout: fla "
                f"{ctx.cu_seqlens_cpu.tolist()}, layout {mine} (rank {sp.rank} of {sp.world})"
            )
        sp.memo["fla_cp"] = ctx
    return sp.memo["fla_cp"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# ============================================================================================================== probe
def fused_kda_available(*tensors: torch.Tensor) -> tuple[bool, str]:
    """Availability probe registered as ``dispatch.FUSED_AVAILABILITY["kda"]``.

    Args:
        tensors: the call's tensors. Floating tensors must be float32/bfloat16/float16 (integer ones, such as
            ``cu_seqlens``, are allowed); every 4-D tensor is read as ``[B, T, H, K]`` (q, k, v, g; the layer passes
            its ``o_norm.weight`` viewed ``[1, 1, 1, K]``) and its last dim must be in ``[16, 256]``.

    Returns:
        ``(True, "")`` when fla's kernels can run on them, else ``(False, reason)``: no tensors, an unsupported dtype,
        an unsupported head dim, a tensor not on CUDA (CPU tensors are accepted only under ``TRITON_INTERPRET=1``),
        fla-core not importable.
    """
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not tensors:
        return False, "no tensors given"
    bad = sorted({str(t.dtype) for t in tensors if t.is_floating_point() and t.dtype not in SUPPORTED_DTYPES})
    if bad:
        return False, f"unsupported dtype(s) {bad} (fused KDA supports float32, bfloat16, float16)"
    dims = sorted({t.shape[-1] for t in tensors if t.dim() == 4})
    wrong = [d for d in dims if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM]
    if wrong:
        return False, f"head dim {wrong[0]} is outside fla's supported range [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
    if not all(t.is_cuda for t in tensors):
        if not (_interpreting() and all(t.device.type == "cpu" for t in tensors)):
            return False, "the tensors are not on a CUDA device"
    error = import_error()
    if error is not None:
        return False, error
    return True, ""


# ============================================================================================================ helpers
def _check_head_dim(k: int, v: int) -> None:
    for name, d in (("K", k), ("V", v)):
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            raise ValueError(f"fused KDA needs head dim {name} in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]; got {name}={d}")


def _safe_gate(lower_bound: float | None) -> bool:
    return lower_bound is not None and SAFE_GATE_RANGE[0] <= lower_bound < SAFE_GATE_RANGE[1]


def _check_gate_params(A_log: torch.Tensor, dt_bias: torch.Tensor, H: int, K: int, lower_bound) -> None:
    if tuple(A_log.shape) != (H,):
        raise ValueError(f"A_log must be [H={H}]; got shape {tuple(A_log.shape)}")
    if tuple(dt_bias.shape) != (H * K,):
        raise ValueError(f"dt_bias must be [H*K={H * K}]; got shape {tuple(dt_bias.shape)}")
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"lower_bound must be negative or None; got lower_bound={lower_bound}")


def _device(t: torch.Tensor):
    """The CUDA device context of ``t`` (Triton launches on the current device), a null context on CPU."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def _empty(like: torch.Tensor) -> torch.Tensor:
    """The placeholder an op returns for an output that does not exist (custom ops return no ``None``)."""
    return like.new_empty(0)


def _or_none(t: torch.Tensor, exists: bool) -> torch.Tensor | None:
    return t if exists else None


def _chunk_indices(cu_seqlens: torch.Tensor | None, cu_host: list[int] | None, chunk_size: int):
    """``(cu_seqlens long, its host copy, fla's chunk indices [NT, 2] long)`` for the validated boundaries
    ``cu_host`` (whose check made the one host sync), or three ``None``."""
    if cu_seqlens is None:
        return None, None, None
    cu = cu_seqlens.to(torch.long)
    cu_cpu = torch.tensor(cu_host, dtype=torch.long)
    return cu, cu_cpu, chunk_indices_of(cu, cu_cpu, chunk_size)


def _indices_fake(like: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Fake of the chunk-index output: ``[NT, 2]`` long with a data-dependent ``NT``, ``[0, 2]`` without documents."""
    rows = 0 if cu_seqlens is None else torch.library.get_ctx().new_dynamic_size()
    return like.new_empty((rows, 2), dtype=torch.long)


# ======================================================================================================= custom ops
# ---------------------------------------------------------------------------------------------------------- chunk_kda
def _chunk_fwd_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    safe_gate: bool,
    lower_bound: float | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, H, K = q.shape
    cu_host = None
    if cu_seqlens is not None:  # the checks that read the boundaries run here: a traced graph cannot read data
        cu_host = check_cu_seqlens(cu_seqlens, T, B, "q.shape[0]")
        check_state(initial_state, len(cu_host) - 1, H, K, v.shape[-1])
    with _device(q):
        q, k, v, g, beta, A_log, dt_bias, initial_state = map(
            _contiguous, (q, k, v, g, beta, A_log, dt_bias, initial_state))
        cu, cu_cpu, indices = _chunk_indices(cu_seqlens, cu_host, chunk_size)
        o, final, q, q_rstd, k, k_rstd, beta_act, g_cumsum, Aqk, Akk = chunk_forward(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state, cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu, chunk_indices=indices, scale=scale, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, safe_gate=safe_gate, lower_bound=lower_bound,
            chunk_size=chunk_size)
    l2 = use_qk_l2norm_in_kernel
    return (
        o.type_as(q),
        final if final is not None else _empty(q),
        q if l2 else _empty(q),
        q_rstd if l2 else _empty(q),
        k if l2 else _empty(q),
        k_rstd if l2 else _empty(q),
        beta_act if use_beta_sigmoid_in_kernel else _empty(q),
        g_cumsum if g_cumsum is not None else _empty(q),
        Aqk,
        Akk,
        indices if indices is not None else q.new_empty((0, 2), dtype=torch.long),
    )


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
        q.new_empty((n, H, K, V), dtype=f32) if output_final_state else _empty(q),  # final state
        q.new_empty(q.shape) if l2 else _empty(q),  # l2-normalised q
        q.new_empty((B, T, H), dtype=f32) if l2 else _empty(q),  # its reciprocal norms
        k.new_empty(k.shape) if l2 else _empty(q),
        k.new_empty((B, T, H), dtype=f32) if l2 else _empty(q),
        beta.new_empty(beta.shape, dtype=f32) if use_beta_sigmoid_in_kernel else _empty(q),  # sigmoid(beta)
        g.new_empty(g.shape, dtype=f32) if not use_gate_in_kernel else _empty(q),  # the gate's chunk-local cumsum
        k.new_empty((B, T, H, chunk_size)),  # Aqk
        k.new_empty((B, T, H, chunk_size)),  # Akk
        _indices_fake(q, cu_seqlens),
    )


def _chunk_bwd_impl(
    do: torch.Tensor,
    dht: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    q_normed: torch.Tensor,
    q_rstd: torch.Tensor,
    k_normed: torch.Tensor,
    k_rstd: torch.Tensor,
    beta_act: torch.Tensor,
    g_cumsum: torch.Tensor,
    Aqk: torch.Tensor,
    Akk: torch.Tensor,
    chunk_indices: torch.Tensor,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    safe_gate: bool,
    lower_bound: float | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    l2 = use_qk_l2norm_in_kernel
    with _device(q):
        qk_q = q_normed if l2 else q.contiguous()
        qk_k = k_normed if l2 else k.contiguous()
        g_in, A_log_in, dt_bias_in, h0 = map(_contiguous, (g, A_log, dt_bias, initial_state))
        dq, dk, dv, db, dg, dh0, dA, dbias = chunk_backward(
            do, dht, qk_q, qk_k, v, beta, beta_act, g_in, g_cumsum, A_log_in, dt_bias_in, h0, Aqk, Akk, cu_seqlens,
            chunk_indices, q_normed=q_normed, q_rstd=q_rstd, k_normed=k_normed, k_rstd=k_rstd, scale=scale,
            use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, safe_gate=safe_gate, lower_bound=lower_bound,
            chunk_size=chunk_size)
    return (dq.to(q), dk.to(k), dv.to(v), dg.to(g), db.to(beta), dA if dA is not None else _empty(q),
            dbias if dbias is not None else _empty(q), dh0 if dh0 is not None else _empty(q))


def _chunk_bwd_fake(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, *rest):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), _empty(q) if A_log is None else A_log.new_empty(A_log.shape),
            _empty(q) if dt_bias is None else dt_bias.new_empty(dt_bias.shape),
            _empty(q) if initial_state is None else initial_state.new_empty(initial_state.shape))


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
    return (dq, dk, dv, dg, db, _or_none(dA, A_log is not None), _or_none(dbias, dt_bias is not None),
            _or_none(dh0, initial_state is not None)) + (None,) * 9


_CHUNK_BWD = define_op("fla_chunk_kda_bwd", _chunk_bwd_impl, _chunk_bwd_fake)
_CHUNK_FWD = define_op("fla_chunk_kda_fwd", _chunk_fwd_impl, _chunk_fwd_fake, backward=_chunk_backward,
                       setup_context=_chunk_setup)


# ----------------------------------------------------------------------------------------------------- causal_conv1d
_CONV_CHUNK = 64  # fla's CausalConv1dFunction default chunk size


def _conv_fwd_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    activation: str | None,
    output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cu_host = None
    if cu_seqlens is not None:  # reads the boundaries (one host sync); the shape checks ran in the caller
        cu_host = check_conv_inputs(x, weight, activation, initial_state, cu_seqlens)
    with _device(x):
        weight, initial_state = weight.contiguous(), _contiguous(initial_state)
        cu, cu_cpu, indices = _chunk_indices(cu_seqlens, cu_host, _CONV_CHUNK)
        y, final = conv_forward(x, weight, initial_state=initial_state, output_final_state=output_final_state,
                                activation=activation, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, chunk_indices=indices,
                                chunk_size=_CONV_CHUNK)
    return (y, final if final is not None else _empty(x),
            indices if indices is not None else x.new_empty((0, 2), dtype=torch.long))


def _conv_fwd_fake(x, weight, initial_state, cu_seqlens, activation, output_final_state):
    n = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = x.new_empty((n, x.shape[2], weight.shape[1])) if output_final_state else _empty(x)
    return x.new_empty(x.shape), final, _indices_fake(x, cu_seqlens)


def _conv_bwd_impl(
    dy: torch.Tensor,
    dht: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    chunk_indices: torch.Tensor,
    activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with _device(x):
        dx, dw, dh0 = conv_backward(x, dy, dht, weight, initial_state=initial_state, activation=activation,
                                    cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=_CONV_CHUNK)
    return dx, dw, dh0 if dh0 is not None else _empty(x)


def _conv_bwd_fake(dy, dht, x, weight, initial_state, cu_seqlens, chunk_indices, activation):
    return (torch.empty_like(x), weight.new_empty(weight.shape),
            _empty(x) if initial_state is None else initial_state.new_empty(initial_state.shape))


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
    return dx, dw, _or_none(dh0, initial_state is not None), None, None, None


_CONV_BWD = define_op("fla_causal_conv1d_bwd", _conv_bwd_impl, _conv_bwd_fake)
_CONV_FWD = define_op("fla_causal_conv1d_fwd", _conv_fwd_impl, _conv_fwd_fake, backward=_conv_backward,
                      setup_context=_conv_setup)


# ---------------------------------------------------------------------------------------------------- rms_norm_gated
def _norm_fwd_impl(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    dim = x.shape[-1]
    with _device(x):
        y, rstd = norm_forward(x.contiguous().reshape(-1, dim), gate.contiguous().reshape(-1, dim),
                               weight.contiguous(), eps)
    return y.reshape(x.shape), rstd


def _norm_fwd_fake(x, gate, weight, eps):
    return x.new_empty(x.shape), x.new_empty((math.prod(x.shape[:-1]),), dtype=torch.float32)


def _norm_bwd_impl(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dim = x.shape[-1]
    with _device(x):
        dx, dg, dw = norm_backward(dy.contiguous().reshape(-1, dim), x.contiguous().reshape(-1, dim),
                                   gate.contiguous().reshape(-1, dim), weight.contiguous(), rstd, eps, x.dtype)
    return dx.reshape(x.shape), dg.reshape(gate.shape), dw


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


_NORM_BWD = define_op("fla_rms_norm_gated_bwd", _norm_bwd_impl, _norm_bwd_fake)
_NORM_FWD = define_op("fla_rms_norm_gated_fwd", _norm_fwd_impl, _norm_fwd_fake, backward=_norm_backward,
                      setup_context=_norm_setup)


# ----------------------------------------------------------------------------------------------- fused_recurrent_kda
def _recurrent_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float | None,
    lower_bound: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return recurrent_step(q, k, v, g, beta, A_log, dt_bias, initial_state=initial_state, scale=scale,
                          lower_bound=lower_bound)


def _recurrent_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, lower_bound):
    B, _, H, K = q.shape
    return v.new_empty(v.shape), q.new_empty((B, H, K, v.shape[-1]), dtype=torch.float32)


def _recurrent_backward(ctx, *grads):
    raise RuntimeError("fla's fused_recurrent_kda has no backward (inference only); use the chunked path "
                       "(chunk_kda_gate_in_kernel) for training")


_RECURRENT = define_op("fla_fused_recurrent_kda", _recurrent_impl, _recurrent_fake, backward=_recurrent_backward)


# ============================================================================================== kernels, one by one
def chunk_kda_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    use_qk_l2norm_in_kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA with an *activated* gate and beta: the contract of :func:`glm53flash_hf.kda_ops.chunk_kda_torch`, run
    by fla's chunked kernels (``use_gate_in_kernel=False``, ``safe_gate=False``: the gate's bound is unknown here)
    through the custom ops ``glm53flash::fla_chunk_kda_fwd`` / ``fla_chunk_kda_bwd``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log decay (``<= 0``); beta: ``[B, T, H]``
            (after the sigmoid). Any of float32/bfloat16/float16; fla computes the gate and state in fp32.
        scale: query scale, default ``K ** -0.5``.
        initial_state: optional ``[N, H, K, V]`` (``N`` documents with ``cu_seqlens``, else ``B``), K-first; cast to
            fp32 (fla requires fp32).
        output_final_state: also return the fp32 state after every document.
        cu_seqlens: optional integer ``[N + 1]`` document boundaries (requires ``B == 1``); validated inside the op
            (one host sync), so a compiled graph does not read them.
        chunk_size: 32 or 64 (fla's choices; the maths does not depend on it).
        use_qk_l2norm_in_kernel: l2-normalise q and k in the kernel.

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state fp32 [N, H, K, V] or None)``.

    Raises:
        ValueError: shape mismatches, head dims outside ``[16, 256]``, a chunk size other than 32/64, bad
            ``cu_seqlens``.
        TypeError: the installed fla does not accept an argument (:func:`call_checked`).
        ImportError: fla-core missing.
    """
    o, final = _CHUNK_FWD(*_chunk_args(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False,
    ))[:2]
    return o, final if output_final_state else None


def _check_chunk_call(q, k, v, g, beta, chunk_size: int, gate=None) -> None:
    """The argument checks of every fused chunked-KDA entry point (:func:`chunk_kda_fused`,
    :func:`chunk_kda_gate_in_kernel`, :func:`chunk_kda_context_parallel`): shapes, head dims, the gate's parameters
    (``gate = (A_log, dt_bias, lower_bound)`` when the gate runs in the kernel) and fla's chunk sizes.

    Raises:
        ValueError: naming the argument, its value and what was expected.
    """
    check_core_inputs(q, k, v, g, beta)
    H, K = q.shape[2], q.shape[3]
    _check_head_dim(K, v.shape[-1])
    if gate is not None:
        A_log, dt_bias, lower_bound = gate
        _check_gate_params(A_log, dt_bias, H, K, lower_bound)
    if chunk_size not in FLA_CHUNK_SIZES:
        raise ValueError(f"fused KDA chunk_size must be one of {FLA_CHUNK_SIZES}; got chunk_size={chunk_size!r}")


def _chunk_args(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size, gate=None,
                **flags):
    """The checked arguments of ``fla_chunk_kda_fwd``, shared by :func:`chunk_kda_fused` and
    :func:`chunk_kda_gate_in_kernel`. ``gate``: ``(A_log, dt_bias, lower_bound)`` when the gate runs in the kernel;
    ``flags``: the kernel's ``use_*`` switches."""
    _check_chunk_call(q, k, v, g, beta, chunk_size, gate)
    B, T, H, K = q.shape
    V = v.shape[-1]
    A_log, dt_bias, lower_bound = gate if gate is not None else (None, None, None)
    if cu_seqlens is None:  # with documents, the op checks the state against the boundaries it reads
        check_state(initial_state, B, H, K, V)
    return (
        q, k, v, g, beta, A_log, dt_bias,
        initial_state.float() if initial_state is not None else None,
        cu_seqlens,
        float(K**-0.5 if scale is None else scale),
        output_final_state,
        flags["use_qk_l2norm_in_kernel"],
        flags["use_gate_in_kernel"],
        flags["use_beta_sigmoid_in_kernel"],
        _safe_gate(lower_bound) if gate is not None else False,
        lower_bound,
        chunk_size,
    )


def chunk_kda_gate_in_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_raw: torch.Tensor,
    beta_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GLM's KDA core in one call of fla's chunked kernels: forget gate, beta sigmoid, q/k l2-norm and the chunked delta
    rule (``glm53flash::fla_chunk_kda_fwd`` / ``fla_chunk_kda_bwd``).

    Equals ``chunk_kda_torch(q, k, v, forget_gate(...), sigmoid(beta_logits))`` with the gate of
    :class:`glm53flash_hf.kda.Glm53FlashForgetGate`: ``g = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias))``
    (or ``-exp(A_log[h]) * softplus(g_raw + dt_bias)`` when ``lower_bound`` is None), in fp32 inside the kernel.
    ``safe_gate=True`` (fla's bounded-gate fast path) when ``lower_bound`` is in ``[-5, 0)``.

    Args:
        q, k: ``[B, T, H, K]`` after the short convolution (not normalised); v: ``[B, T, H, V]``.
        g_raw: ``[B, T, H, K]`` the gate's pre-activation ``f_b_proj(f_a_proj(x))`` (without ``dt_bias``).
        beta_logits: ``[B, T, H]`` ``b_proj(x)`` before the sigmoid.
        A_log: fp32 ``[H]``; dt_bias: fp32 ``[H * K]`` (the gate's parameters; pass local tensors).
        lower_bound: ``config.linear_lower_bound`` (negative) or None.
        scale, initial_state, output_final_state, cu_seqlens, chunk_size: as :func:`chunk_kda_fused`.

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state fp32 [N, H, K, V] or None)``. Differentiable in q, k, v, g_raw,
        beta_logits, A_log, dt_bias and initial_state.

    Raises:
        ValueError / TypeError / ImportError: as :func:`chunk_kda_fused`; wrong ``A_log``/``dt_bias`` shapes or a
            non-negative ``lower_bound``.
    """
    o, final = _CHUNK_FWD(*_chunk_args(
        q, k, v, g_raw, beta_logits, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
        gate=(A_log, dt_bias, lower_bound),
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
    ))[:2]
    return o, final if output_final_state else None


def chunk_kda_context_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_raw: torch.Tensor,
    beta_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    *,
    cp_context,
    scale: float | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """One rank's shard of a context-parallel chunked KDA: fla's ``chunk_kda`` entry point with ``cp_context``
    (``fla.ops.cp``), the gate, beta sigmoid and q/k l2-norm in the kernel as :func:`chunk_kda_gate_in_kernel`.

    fla's scheme (as :func:`glm53flash_hf.kda.sp_chunk_kda`, in fla's kernels):
    each rank computes its first document's state transition and last document's contribution, the ranks
    all-gather them and fold the prefix, and the backward passes the state gradient back the same way. No initial or
    final state; one flattened token row (``B == 1``); documents from ``cp_context.cu_seqlens`` (the rank's local
    boundaries, built by fla's ``build_cp_context`` from the global ones). fla's own autograd Function (not a custom
    op here): fla wraps it in ``torch.compiler.disable``, so a compiled model breaks its graph around this call.

    Args:
        q, k: ``[1, T, H, K]`` after the short convolution; v: ``[1, T, H, V]``; g_raw: ``[1, T, H, K]``;
            beta_logits: ``[1, T, H]`` (the rank's ``T`` tokens, as :func:`chunk_kda_gate_in_kernel`).
        A_log, dt_bias, lower_bound: the gate's parameters, as :func:`chunk_kda_gate_in_kernel`.
        cp_context: fla's ``FLACPContext`` for this rank (its process group, local boundaries, neighbour counts).
        scale, chunk_size: as :func:`chunk_kda_fused`.

    Returns:
        ``o`` ``[1, T, H, V]`` in q's dtype. Differentiable in q, k, v, g_raw, beta_logits, A_log and dt_bias.

    Raises:
        ValueError: as :func:`chunk_kda_gate_in_kernel`, or ``q.shape[0] != 1``.
        TypeError: the installed fla does not accept an argument (:func:`call_checked`).
        ImportError: fla-core's CP modules missing.
    """
    _check_chunk_call(q, k, v, g_raw, beta_logits, chunk_size, (A_log, dt_bias, lower_bound))
    if q.shape[0] != 1:
        raise ValueError(f"context-parallel KDA takes one flattened token row; got q of shape {tuple(q.shape)}")
    K = q.shape[3]
    cp = load_cp()
    with _device(q):
        o, _ = call_checked(
            cp.chunk_kda,
            "chunk_kda",
            q=q,
            k=k,
            v=v,
            g=g_raw,
            beta=beta_logits,
            scale=float(K**-0.5 if scale is None else scale),
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            safe_gate=_safe_gate(lower_bound),
            lower_bound=lower_bound,
            A_log=A_log,
            dt_bias=dt_bias,
            chunk_size=chunk_size,
            cp_context=cp_context,
        )
    return o.type_as(q)


def causal_conv1d_fused(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal convolution (+SiLU) by fla's Triton convolution kernels (``glm53flash::fla_causal_conv1d_fwd``
    / ``fla_causal_conv1d_bwd``): the contract of :func:`glm53flash_hf.kda_ops.causal_conv1d_torch`.

    Args:
        x: ``[B, T, D]`` time-major (strided views accepted).
        weight: ``[D, W]`` (``conv1d.weight[:, 0, :]``); a replicated DTensor is unwrapped.
        cu_seqlens: optional integer ``[N + 1]`` (requires ``B == 1``); the convolution restarts at every boundary.
            Validated inside the op (one host sync).
        activation: ``"silu"``/``"swish"`` or None.
        initial_state: optional ``[N, D, W]``, the last ``W`` inputs before each document (oldest first).
        output_final_state: also return the last ``W`` inputs of every document, ``[N, D, W]`` in x's dtype.

    Returns:
        ``(y [B, T, D] in x's dtype, final_state or None)``. fla accumulates in fp32 whatever the weight dtype (the
        torch path computes in the weight's dtype; identical for GLM's fp32 conv weight).

    Raises:
        ValueError: shapes, activation, bad ``cu_seqlens``; a sharded DTensor weight.
        TypeError / ImportError: as :func:`chunk_kda_fused`.
    """
    weight = local_tensor(weight, "conv1d.weight")
    if cu_seqlens is None:  # with documents, the op runs these checks with the boundaries it reads
        check_conv_inputs(x, weight, activation, initial_state, None)
    y, final, _ = _CONV_FWD(x, weight, initial_state, cu_seqlens, activation, output_final_state)
    return y, final if output_final_state else None


def rms_norm_gated_fused(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(RMSNorm_fp32(x) * weight * sigmoid(gate)).to(x.dtype)`` by fla's gated-norm kernels
    (``glm53flash::fla_rms_norm_gated_fwd`` / ``fla_rms_norm_gated_bwd``, the kernels of
    ``rms_norm_gated(activation="sigmoid")``): the maths of :class:`glm53flash_hf.kda.Glm53FlashRMSNormGated` (and
    fla's ``FusedRMSNormGated``).

    Args:
        x: ``[..., K]``; gate: same shape; weight: ``[K]`` (a replicated DTensor is unwrapped); eps: variance epsilon.

    Returns:
        ``[..., K]`` in x's dtype; differentiable in x, gate and weight.

    Raises:
        ValueError: shape mismatch, or a sharded DTensor weight. TypeError / ImportError: as :func:`chunk_kda_fused`.
    """
    weight = local_tensor(weight, "o_norm.weight")
    if gate.shape != x.shape:
        raise ValueError(f"gate must have the shape of x {tuple(x.shape)}; got {tuple(gate.shape)}")
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}]; got shape {tuple(weight.shape)}")
    return _NORM_FWD(x, gate, weight, float(eps))[0]


def fused_recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_raw: torch.Tensor,
    beta_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    state: torch.Tensor | None,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """No-grad KDA decode step(s) by fla's ``fused_recurrent_kda`` (``glm53flash::fla_fused_recurrent_kda``), gate,
    beta sigmoid and q/k l2-norm in the kernel.

    The core of a cached decode step without gradients (``Glm53FlashLinearAttention``): ``o, new_state =
    fused_recurrent_step(q, k, v, forget_gate.f_b_proj(forget_gate.f_a_proj(x)).view(B, S, H, K), b_proj(x),
    forget_gate.A_log, forget_gate.dt_bias, forget_gate.lower_bound, recurrent_state)``. Equals
    :func:`glm53flash_hf.kda_ops.recurrent_kda_torch` on ``(q, k, v, forget_gate(x), sigmoid(b_proj(x)))`` with
    ``use_qk_l2norm_in_kernel=True``. Each of the ``T`` tokens of a row advances that row's state (no
    ``cu_seqlens``; rows are independent).

    Args:
        q, k: ``[B, T, H, K]`` (after the conv, not normalised); v: ``[B, T, H, V]``.
        g_raw: ``[B, T, H, K]`` gate pre-activation (without ``dt_bias``).
        beta_logits: ``[B, T, H]`` before the sigmoid.
        A_log: ``[H]``; dt_bias: ``[H * K]`` (replicated DTensors are unwrapped).
        lower_bound: negative float or None (softplus gate).
        state: fp32 ``[B, H, K, V]`` (K-first, the transformers cache layout) or None (zeros). Not modified.
        scale: default ``K ** -0.5``.

    Returns:
        ``(o [B, T, H, V] in v's dtype, new_state fp32 [B, H, K, V])`` (a new tensor; no autograd graph).

    Raises:
        RuntimeError: grad mode is on and an input requires grad (fla's kernel has no backward and would return a
            result silently detached from the graph): run under ``torch.no_grad()`` / ``torch.inference_mode()``.
        ValueError: shape mismatches, head dims outside ``[16, 256]``, a state that is not fp32, a sharded DTensor.
        TypeError / ImportError: as :func:`chunk_kda_fused`.
    """
    A_log = local_tensor(A_log, "forget_gate.A_log")
    dt_bias = local_tensor(dt_bias, "forget_gate.dt_bias")
    inputs = (q, k, v, g_raw, beta_logits, A_log, dt_bias, state)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        raise RuntimeError(
            "fused_recurrent_step has no backward (fla's fused_recurrent_kda is inference-only) but an input requires "
            "grad: call it under torch.no_grad(), or use the chunked path for training"
        )
    check_core_inputs(q, k, v, g_raw, beta_logits)
    B, T, H, K = q.shape
    V = v.shape[-1]
    _check_head_dim(K, V)
    _check_gate_params(A_log, dt_bias, H, K, lower_bound)
    check_state(state, B, H, K, V)
    if state is not None and state.dtype != torch.float32:
        raise ValueError(f"state must be float32 (the recurrent cache is fp32); got dtype {state.dtype}")
    return _RECURRENT(q, k, v, g_raw, beta_logits, A_log, dt_bias, state,
                      None if scale is None else float(scale), lower_bound)


def kernel_params(layer) -> dict:
    """The parameters of a :class:`glm53flash_hf.kda.Glm53FlashLinearAttention` that its fused ops read directly:
    ``gate`` (``A_log``, ``dt_bias``, ``lower_bound``), ``conv`` (``conv1d.weight[:, 0, :]``), ``norm``
    (``o_norm.weight``), replicated DTensors unwrapped.

    Raises:
        ValueError: a sharded DTensor among them (named with the layer index).
    """
    where = f"KDA layer {layer.layer_idx}"
    gate = layer.forget_gate
    return {
        "gate": dict(A_log=local_tensor(gate.A_log, f"{where} forget_gate.A_log"),
                     dt_bias=local_tensor(gate.dt_bias, f"{where} forget_gate.dt_bias"),
                     lower_bound=gate.lower_bound),
        "conv": local_tensor(layer.conv1d.weight, f"{where} conv1d.weight")[:, 0, :],
        "norm": local_tensor(layer.o_norm.weight, f"{where} o_norm.weight"),
    }
