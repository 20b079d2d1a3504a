"""Fused Triton kernels for the sparse MLA attention core of GLM-5.3-Flash's DSA layers, forward and backward.

The maths is exactly that of the torch path :func:`glm53flash_hf.dsa_ops.sparse_mla_torch` (the kernels' oracle in
``tests/test_dsa_fused.py``): absorbed MLA form, one shared latent KV head (``K = V = c``), per-query token ids with
``-1`` padding (any id outside ``[0, S_kv)`` is padding), softmax scale ``qk_head_dim ** -0.5`` passed by the caller,
natural-log LSE — the contract of DeepSeek's FlashMLA sparse kernel (``flash_mla_sparse_fwd``) and of TileLang's
DeepSeek-V3.2 ``sparse_mla_fwd`` / ``sparse_mla_bwd`` examples, reference implementations of the same operator.

Kernels
-------
Forward (one program per ``(query row, block of BH heads)``): loads ``q_abs`` for its heads once, loops over the
query's index list in blocks of ``BW`` ids, gathers the valid latent rows ``c_w`` ``[BW, Dl]``, computes
``s = scale * q c^T`` ``[BH, BW]`` with ``tl.dot``, and keeps an online softmax in fp32 (running max ``m``, running
sum ``l``, output accumulator ``acc`` ``[BH, Dl]``); writes ``out = acc / l`` (in the dtype of ``q_abs``) and
``lse = m + ln(l)`` (fp32, natural log). A query with no valid id gets ``out = 0`` and ``lse = -inf``.

Backward (same grid, one pass over the index list): ``Delta = rowsum(dO * O) - dlse`` is computed in the program
from the stored output; per id block it recomputes ``p = exp(s - lse)``, ``dp = dO c^T``, ``ds = p * (dp - Delta)``,
accumulates ``dq += ds c`` (``dq = scale * sum_w ds_w c_w``) and adds
``dc_w = scale * ds_w^T q + p_w^T dO`` into an fp32 ``[B, S_kv, Dl]`` buffer with ``tl.atomic_add`` (cast to the
latent dtype at the end). Invalid ids, padded heads and empty rows contribute exactly zero (no NaN: every ``exp`` of
a masked slot is discarded by a ``where``).

Precision
---------
* fp32 inputs: every product and sum in fp32, ``tl.dot(..., input_precision="ieee")`` (no TF32), so the interpreter
  and GPUs agree with the fp32 torch path to fp32 summation-order noise.
* bf16 / fp16 inputs (``q_abs`` and ``latent`` of the same 16-bit dtype): the score products ``q c^T`` and
  ``dO c^T`` take the 16-bit operands directly (their products are exact in fp32, accumulation is fp32, as the torch
  path's fp32 matmul of the upcast values); the probability-weighted products (``p c``, ``ds c``, ``ds^T q``,
  ``p^T dO``) round ``p`` / ``ds`` once to the 16-bit dtype so they run on tensor cores, as FlashAttention and
  FlashMLA do — a relative error of at most the unit roundoff ``u`` (``2**-8`` bf16, ``2**-11`` fp16) per term
  that the fp32 torch path does not have. ``Delta`` uses the stored (rounded) output. Results are rounded once to
  their dtype with round-to-nearest-even (bf16 by integer rounding of the bits, because Triton's interpreter
  truncates in ``.to(tl.bfloat16)`` while GPUs round; this gives one rounding on both). Under the interpreter the
  16-bit ``tl.dot`` operands are widened to fp32 first (same values; see ``_dot``). The test tolerances follow.
* Mixed input dtypes (e.g. fp32 queries and a bf16 latent) run the fp32 path.

Supported: CUDA tensors (CPU only under ``TRITON_INTERPRET=1``, for tests), fp32/bf16/fp16 inputs, any ``H``,
``Dl <= MAX_LATENT_DIM`` (power-of-two block with masking), any ``W`` (masked tail block), int32/int64 ids. Block
sizes are fixed by :func:`_blocks` (no autotuner). Memory is ``O(S * W)`` for the ids plus the inputs, outputs and
the fp32 ``dlatent`` buffer: nothing scales with ``S * S_kv``. ``dlatent`` is accumulated with fp32 atomics, so its
fp32 summation order (and its last bits) may vary between GPU runs.

Custom ops
----------
The kernels run inside custom ops of the namespace ``glm53flash`` (registered at import by
:func:`glm53flash_hf.graph_ops.define_op` when triton is installed; also ``torch.ops.glm53flash.<name>``), with fake
implementations, so ``torch.compile(fullgraph=True)`` traces :func:`sparse_mla_fused` without a graph break:

* ``sparse_mla_fwd(q_abs, latent, indices, scale, block_h, block_w) -> (out, lse)``; its autograd formula saves the
  inputs, ``out`` and ``lse`` and calls
* ``sparse_mla_bwd(q_abs, latent, indices, out, lse, grad_out, grad_lse, scale, block_h, block_w, need_dq,
  need_dlatent) -> (dq, dlatent)``: ``grad_lse`` ``None`` when ``lse`` gets no gradient; a gradient that is not needed
  comes back as an empty tensor (the formula returns ``None`` for it).

This module imports without triton (:mod:`.triton_utils`): :func:`fused_dsa_available` then says so,
:func:`sparse_mla_fused` raises ``RuntimeError`` and no op is registered.
"""

from __future__ import annotations

import math

import torch

from .dsa_ops import check_sparse_mla_args
from .graph_ops import define_op
from .triton_utils import (
    TL_DTYPES,
    TRITON_AVAILABLE,
    check_device,
    check_dtype,
    interpreting,
    next_power_of_2,
    probe_tensors,
    require_triton,
    tl,
    triton,
)

MAX_LATENT_DIM = 1024  # Dl above this would need a split of the [BH, Dl] accumulator (the release uses 512)

__all__ = ["MAX_LATENT_DIM", "fused_dsa_available", "sparse_mla_fused"]


def fused_dsa_available(*tensors: torch.Tensor) -> tuple[bool, str]:
    """Availability probe registered as ``dispatch.FUSED_AVAILABILITY["dsa"]``.

    Args:
        tensors: the call's tensors ``(q_abs [B, S, H, Dl], latent [B, S_kv, Dl], indices [B, S, W])``.

    Returns:
        ``(True, "")`` when :func:`sparse_mla_fused` can run on them, else ``(False, reason)``: triton not
        importable, a tensor not on CUDA, a float dtype other than fp32/bf16/fp16 (fp64 runs the torch path), shapes
        that are not ``[B, S, H, Dl]`` / ``[B, S_kv, Dl]`` / integer ``[B, S, W]``, or ``Dl > MAX_LATENT_DIM``.
    """
    tensors, reason = probe_tensors("sparse MLA", tensors)
    if reason:
        return False, reason
    if len(tensors) != 3:
        return False, f"expected (q_abs, latent, indices); got {len(tensors)} tensors"
    try:
        _check_args(*tensors)
    except ValueError as exc:
        return False, str(exc)
    return True, ""


def _check_args(q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor) -> None:
    """Checks shared by the probe and :func:`sparse_mla_fused` (raise ``ValueError``): the torch path's
    :func:`.dsa_ops.check_sparse_mla_args`, then the kernel's dtype, width and device limits."""
    check_sparse_mla_args(q_abs, latent, indices)
    check_dtype("q_abs", q_abs)
    check_dtype("latent", latent)
    dim = q_abs.shape[-1]
    if dim > MAX_LATENT_DIM:
        raise ValueError(f"kv_lora_rank Dl={dim} exceeds MAX_LATENT_DIM={MAX_LATENT_DIM} of the fused sparse MLA")
    devices = {q_abs.device, latent.device, indices.device}
    if len(devices) != 1:
        raise ValueError(f"q_abs, latent and indices must be on one device; got {sorted(map(str, devices))}")
    check_device("q_abs", q_abs)


def _blocks(heads: int, dim: int, block_h: int | None, block_w: int | None, budget: int) -> tuple[int, int, int, int]:
    """``(BH heads, BW ids, BD features, num_warps)`` per program. ``tl.dot`` needs every block dim >= 16; the
    ``[BH, BD]`` and ``[BW, BD]`` tiles are capped at ``budget`` elements each (``_FWD_TILE``, ``_BWD_TILE``: the
    backward holds q, dO, the dq accumulator and the dc tile at once)."""
    bd = next_power_of_2(dim, 16)
    bh = block_h if block_h is not None else max(16, min(next_power_of_2(heads), 64, budget // bd))
    bw = block_w if block_w is not None else max(16, min(64, budget // bd))
    for name, value in (("block_h", bh), ("block_w", bw)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot tile); got {name}={value}")
    return bh, bw, bd, (8 if bd >= 256 else 4)


_FWD_TILE, _BWD_TILE = 16384, 8192


# ============================================================================================================ kernels
if TRITON_AVAILABLE:

    @triton.jit
    def _cast(x, DT: tl.constexpr):
        """fp32 -> DT with one round-to-nearest-even on GPUs and in the interpreter alike (the interpreter truncates
        in ``.to(tl.bfloat16)``; here bf16 is rounded on the integer bits first, so the final cast is exact). A NaN
        becomes a quiet NaN (the GPU's NaN pattern 0x7FFFFFFF would otherwise round to 0x80000000, -0.0, and a NaN with
        only low payload bits would truncate to inf)."""
        if DT == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            rounded = tl.where(x != x, bits | 0x7FC00000, rounded)
            return rounded.to(tl.float32, bitcast=True).to(tl.bfloat16)
        else:
            return x.to(DT)

    @triton.jit
    def _dot(a, b, acc, LOWP: tl.constexpr, UPCAST: tl.constexpr):
        """``acc + a @ b`` with fp32 accumulation. 16-bit operands go to the tensor cores as they are (their
        products are exact in fp32); under the interpreter (``UPCAST``) they are widened to fp32 first, because
        triton 3.9's interpreter multiplies bf16 bit patterns as integers in ``tl.dot`` (``create_dot``) — the
        widened values are identical, so the result is the same. fp32 operands: ``input_precision="ieee"``."""
        if LOWP and not UPCAST:
            return tl.dot(a, b, acc)
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")

    @triton.jit
    def _program_tile(S, H, DL, BH: tl.constexpr, BD: tl.constexpr):
        """This program's query row ``b * S + t`` (int64), batch row ``b``, heads ``h`` ``[BH]`` and features ``d``
        ``[BD]`` with their masks ``hm`` / ``dm``, the ``[BH, BD]`` mask ``qm`` and element offsets ``offs`` of its
        ``q_abs`` / ``out`` tile."""
        row = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        d = tl.arange(0, BD)
        hm = h < H
        dm = d < DL
        return row, row // S, h, hm, d, dm, hm[:, None] & dm[None, :], (row * H + h[:, None]) * DL + d[None, :]

    @triton.jit
    def _gather_block(idx_ptr, lat_ptr, row, b, w0, S_KV, W, DL, d, dm, BW: tl.constexpr, LOWP: tl.constexpr):
        """Ids ``w0 .. w0 + BW`` of query row ``row`` and their latent rows: ``valid`` ``[BW]`` (slot exists and
        ``0 <= id < S_KV``), element offsets ``offs`` and mask ``cm`` ``[BW, BD]`` of the rows, and the rows ``c``
        (0 where invalid; fp32 unless ``LOWP``)."""
        w = w0 + tl.arange(0, BW)
        ids = tl.load(idx_ptr + row * W + w, mask=w < W, other=-1).to(tl.int64)
        valid = (w < W) & (ids >= 0) & (ids < S_KV)
        offs = (b * S_KV + tl.where(valid, ids, 0)[:, None]) * DL + d[None, :]
        cm = valid[:, None] & dm[None, :]
        c = tl.load(lat_ptr + offs, mask=cm, other=0.0)
        if not LOWP:
            c = c.to(tl.float32)
        return valid, offs, cm, c

    @triton.jit
    def _sparse_mla_fwd_kernel(
        q_ptr, lat_ptr, idx_ptr, out_ptr, lse_ptr,
        S, S_KV, H, W, DL, scale,
        BH: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, LOWP: tl.constexpr, UPCAST: tl.constexpr,
        DT_OUT: tl.constexpr,
    ):
        row, b, h, hm, d, dm, qm, offs = _program_tile(S, H, DL, BH, BD)
        q = tl.load(q_ptr + offs, mask=qm, other=0.0)
        if not LOWP:
            q = q.to(tl.float32)
        m_i = tl.full((BH,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BH,), dtype=tl.float32)
        acc = tl.zeros((BH, BD), dtype=tl.float32)
        for w0 in range(0, W, BW):
            valid, _, _, c = _gather_block(idx_ptr, lat_ptr, row, b, w0, S_KV, W, DL, d, dm, BW, LOWP)
            s = _dot(q, tl.trans(c), tl.zeros((BH, BW), dtype=tl.float32), LOWP, UPCAST)
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid id seen yet: keep everything at 0
            alpha = tl.exp(m_i - m_ref)
            p = tl.exp(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if LOWP:  # q, latent and out share DT_OUT
                acc = _dot(_cast(p, DT_OUT), c, acc * alpha[:, None], LOWP, UPCAST)
            else:
                acc = _dot(p, c, acc * alpha[:, None], LOWP, UPCAST)
            m_i = m_new
        nonempty = l_i > 0.0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(out_ptr + offs, _cast(out, DT_OUT), mask=qm)
        tl.store(lse_ptr + row * H + h, lse, mask=hm)

    @triton.jit
    def _sparse_mla_bwd_kernel(
        q_ptr, lat_ptr, idx_ptr, out_ptr, dout_ptr, lse_ptr, dlse_ptr, dq_ptr, dlat_ptr,
        S, S_KV, H, W, DL, scale,
        BH: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, LOWP: tl.constexpr, UPCAST: tl.constexpr,
        DT_Q: tl.constexpr,
        HAS_DLSE: tl.constexpr, NEED_DQ: tl.constexpr, NEED_DLAT: tl.constexpr,
    ):
        row, b, h, hm, d, dm, qm, offs = _program_tile(S, H, DL, BH, BD)
        q = tl.load(q_ptr + offs, mask=qm, other=0.0)
        do = tl.load(dout_ptr + offs, mask=qm, other=0.0)
        o = tl.load(out_ptr + offs, mask=qm, other=0.0).to(tl.float32)
        delta = tl.sum(do.to(tl.float32) * o, axis=1)  # sum_w p_w (dO . c_w), from the stored output
        if HAS_DLSE:
            delta -= tl.load(dlse_ptr + row * H + h, mask=hm, other=0.0)
        if not LOWP:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse = tl.load(lse_ptr + row * H + h, mask=hm, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse)  # empty row: every slot is invalid, p = 0 below
        dq = tl.zeros((BH, BD), dtype=tl.float32)
        for w0 in range(0, W, BW):
            valid, lat_offs, cm, c = _gather_block(idx_ptr, lat_ptr, row, b, w0, S_KV, W, DL, d, dm, BW, LOWP)
            s = _dot(q, tl.trans(c), tl.zeros((BH, BW), dtype=tl.float32), LOWP, UPCAST)
            dp = _dot(do, tl.trans(c), tl.zeros((BH, BW), dtype=tl.float32), LOWP, UPCAST)
            keep = hm[:, None] & valid[None, :]
            p = tl.where(keep, tl.exp(tl.where(keep, s * scale - lse[:, None], 0.0)), 0.0)
            ds = p * (dp - delta[:, None])  # d loss / d (scaled score)
            if LOWP:  # q, latent and dO share DT_Q: the weights go to 16 bits for the tensor-core products
                ds_w = _cast(ds, DT_Q)
                p_w = _cast(p, DT_Q)
            else:
                ds_w = ds
                p_w = p
            if NEED_DQ:
                dq = _dot(ds_w, c, dq, LOWP, UPCAST)
            if NEED_DLAT:
                dc = _dot(tl.trans(ds_w), q, tl.zeros((BW, BD), dtype=tl.float32), LOWP, UPCAST) * scale
                dc = _dot(tl.trans(p_w), do, dc, LOWP, UPCAST)
                tl.atomic_add(dlat_ptr + lat_offs, dc, mask=cm, sem="relaxed")
        if NEED_DQ:
            tl.store(dq_ptr + offs, _cast(dq * scale, DT_Q), mask=qm)


# ======================================================================================================= custom ops
# The kernels run inside torch.library custom ops (namespace glm53flash, registered at import by
# graph_ops.define_op): glm53flash::sparse_mla_fwd with its fake and autograd formula, and
# glm53flash::sparse_mla_bwd, so torch.compile(fullgraph=True) traces sparse_mla_fused without a graph break.
def _as_index_tensor(indices: torch.Tensor) -> torch.Tensor:
    if indices.dtype not in (torch.int32, torch.int64):
        indices = indices.to(torch.int64)
    return indices.contiguous()


def _kernel_inputs(q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor):
    """``(q, latent, indices, lowp)`` as the kernels read them: contiguous, int32/int64 ids, and for mixed dtypes
    the latent upcast to fp32 (the pure fp32 variant); ``lowp``: ``q_abs`` and ``latent`` share a 16-bit dtype."""
    q_c, lat_c, idx_c = q_abs.contiguous(), latent.contiguous(), _as_index_tensor(indices)
    lowp = q_c.dtype == lat_c.dtype and q_c.dtype != torch.float32
    if not lowp and lat_c.dtype != torch.float32:  # mixed dtypes: run the pure fp32 variant (one upcast)
        lat_c = lat_c.float()
    return q_c, lat_c, idx_c, lowp


def _sparse_mla_fwd_impl(q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, scale: float,
                         block_h: int | None, block_w: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq_len, heads, dim = q_abs.shape
    kv_len, width = latent.shape[1], indices.shape[2]
    q_c, lat_c, idx_c, lowp = _kernel_inputs(q_abs, latent, indices)
    # fp32 tiles at half the budget: the fp32 (FMA, no tensor cores) dot over K = Dl holds twice the registers
    bh, bw, bd, warps = _blocks(heads, dim, block_h, block_w, _FWD_TILE if lowp else _FWD_TILE // 2)
    out = torch.empty_like(q_c)
    lse = torch.empty(batch, seq_len, heads, dtype=torch.float32, device=q_c.device)
    if lse.numel() > 0:
        _sparse_mla_fwd_kernel[(batch * seq_len, triton.cdiv(heads, bh))](
            q_ptr=q_c, lat_ptr=lat_c, idx_ptr=idx_c, out_ptr=out, lse_ptr=lse,
            S=seq_len, S_KV=kv_len, H=heads, W=width, DL=dim, scale=scale,
            BH=bh, BW=bw, BD=bd, LOWP=lowp, UPCAST=interpreting(), DT_OUT=TL_DTYPES[q_c.dtype], num_warps=warps,
        )
    return out, lse


def _sparse_mla_fwd_fake(q_abs, latent, indices, scale, block_h, block_w):
    return q_abs.new_empty(q_abs.shape), q_abs.new_empty(q_abs.shape[:3], dtype=torch.float32)


def _sparse_mla_bwd_impl(q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, grad_out: torch.Tensor, grad_lse: torch.Tensor | None, scale: float,
                         block_h: int | None, block_w: int | None, need_dq: bool, need_dlatent: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    q, lat, idx, lowp = _kernel_inputs(q_abs, latent, indices)
    batch, seq_len, heads, dim = q.shape
    bh, bw, bd, warps = _blocks(heads, dim, block_h, block_w, _BWD_TILE)
    kv_len, width = lat.shape[1], idx.shape[2]
    out, lse = out.contiguous(), lse.contiguous()
    grad_out = grad_out.to(out.dtype).contiguous()
    has_dlse = grad_lse is not None
    dlse = grad_lse.to(torch.float32).contiguous() if has_dlse else lse
    dq = torch.empty_like(q) if need_dq else q.new_empty(0)
    dlat32 = torch.zeros(lat.shape, dtype=torch.float32, device=lat.device) if need_dlatent else None
    if (need_dq or need_dlatent) and q.numel() > 0:
        _sparse_mla_bwd_kernel[(batch * seq_len, triton.cdiv(heads, bh))](
            q_ptr=q, lat_ptr=lat, idx_ptr=idx, out_ptr=out, dout_ptr=grad_out, lse_ptr=lse,
            dlse_ptr=dlse, dq_ptr=dq if need_dq else q, dlat_ptr=dlat32 if need_dlatent else lse,
            S=seq_len, S_KV=kv_len, H=heads, W=width, DL=dim, scale=scale,
            BH=bh, BW=bw, BD=bd, LOWP=lowp, UPCAST=interpreting(), DT_Q=TL_DTYPES[q.dtype],
            HAS_DLSE=has_dlse, NEED_DQ=need_dq, NEED_DLAT=need_dlatent, num_warps=warps,
        )
    elif need_dq:
        dq.zero_()
    # the latent gradient in the input's dtype (lat may be an fp32 upcast of a 16-bit latent: mixed dtypes)
    dlat = dlat32.to(latent.dtype) if need_dlatent else q.new_empty(0)
    return dq, dlat


def _sparse_mla_bwd_fake(q_abs, latent, indices, out, lse, grad_out, grad_lse, scale, block_h, block_w, need_dq,
                         need_dlatent):
    return (q_abs.new_empty(q_abs.shape) if need_dq else q_abs.new_empty(0),
            latent.new_empty(latent.shape) if need_dlatent else q_abs.new_empty(0))


def _sparse_mla_setup(ctx, inputs, output):
    q_abs, latent, indices, scale, block_h, block_w = inputs
    ctx.save_for_backward(q_abs, latent, indices, *output)
    ctx.cfg = (scale, block_h, block_w)
    ctx.set_materialize_grads(False)


def _sparse_mla_backward(ctx, grad_out, grad_lse):
    q_abs, latent, indices, out, lse = ctx.saved_tensors
    need_dq, need_dlat = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_dq or need_dlat):
        return None, None, None, None, None, None
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dlat = _SPARSE_MLA_BWD(q_abs, latent, indices, out, lse, grad_out, grad_lse, *ctx.cfg, need_dq, need_dlat)
    return (dq if need_dq else None), (dlat if need_dlat else None), None, None, None, None


if TRITON_AVAILABLE:
    _SPARSE_MLA_BWD = define_op("sparse_mla_bwd", _sparse_mla_bwd_impl, _sparse_mla_bwd_fake)
    _SPARSE_MLA_FWD = define_op("sparse_mla_fwd", _sparse_mla_fwd_impl, _sparse_mla_fwd_fake,
                                backward=_sparse_mla_backward, setup_context=_sparse_mla_setup)


# ====================================================================================================== public API
def sparse_mla_fused(
    q_abs: torch.Tensor,
    latent: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    *,
    block_h: int | None = None,
    block_w: int | None = None,
    query_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused sparse multi-query attention in the absorbed MLA form (Triton forward and backward).

    Same contract as :func:`glm53flash_hf.dsa_ops.sparse_mla_torch`: for batch row ``b``, query ``t`` and head ``h``,
    ``s[w] = scale * <q_abs[b,t,h], latent[b, indices[b,t,w]]>`` over the valid slots ``w`` (``0 <= id < S_kv``;
    ``-1`` and any other out-of-range id are padding), ``lse = ln(sum_w exp(s[w]))`` and
    ``out = sum_w softmax(s)[w] * latent[b, indices[b,t,w]]``. Ids are expected unique per query (a repeated id is
    counted twice, as in the torch path). A query without a valid id gets ``out = 0``, ``lse = -inf`` and zero
    gradients. Differentiable in ``q_abs`` and ``latent`` through ``out`` and ``lse`` (the kernels of the module
    docstring: FlashAttention-2's backward specialised to one shared KV head and gathered keys, as in FlashMLA /
    TileLang's DeepSeek-V3.2 sparse MLA), through the custom ops ``glm53flash::sparse_mla_fwd`` /
    ``sparse_mla_bwd`` (module docstring).

    Args:
        q_abs: ``[B, S, H, Dl]`` absorbed queries (``q_nope @ W_kc``), fp32/bf16/fp16, ``Dl <= MAX_LATENT_DIM``.
        latent: ``[B, S_kv, Dl]`` latent keys = values, fp32/bf16/fp16.
        indices: integer ``[B, S, W]`` row-local token ids (int32 or int64; other integer dtypes are widened).
        scale: finite softmax scale (``qk_head_dim ** -0.5``).
        block_h: heads per program (power of two >= 16; ``None``: automatic). Results do not depend on it beyond
            fp32 summation order.
        block_w: ids per inner-loop block (power of two >= 16; ``None``: automatic).
        query_chunk: accepted for the torch op's signature and ignored (the kernel's memory is ``O(S * W)``).

    Returns:
        ``(out [B, S, H, Dl] in q_abs.dtype, lse [B, S, H] fp32 natural log)`` — the torch path's dtypes for these
        inputs. Gradients come back in the dtypes of ``q_abs`` / ``latent``; see the module docstring for where the
        16-bit path rounds.

    Raises:
        RuntimeError: triton is not installed.
        ValueError: mismatched shapes, non-integer ``indices``, an unsupported dtype (fp64: use the torch path),
            ``Dl > MAX_LATENT_DIM``, tensors on different devices, CPU tensors outside ``TRITON_INTERPRET=1``,
            a non-finite ``scale`` or a bad ``block_h`` / ``block_w``.
    """
    require_triton("glm53flash_hf.dsa_fused")
    _check_args(q_abs, latent, indices)
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite; got scale={scale}")
    _blocks(q_abs.shape[2], q_abs.shape[3], block_h, block_w, _FWD_TILE)  # validate the block sizes before autograd
    return _SPARSE_MLA_FWD(q_abs, latent, indices, scale, block_h, block_w)
