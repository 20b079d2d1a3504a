"""Fused Triton kernels of the sparse MLA core (forward and backward); oracle :func:`.dsa_ops.sparse_mla_torch`.

Sources: FlashAttention-2's online softmax and backward, specialised as in FlashMLA's sparse kernel
(``flash_mla_sparse_fwd``) and TileLang's DeepSeek-V3.2 ``sparse_mla_fwd`` / ``sparse_mla_bwd``: one program per
``(query row, block of heads)`` loops over the query's ids; the backward recomputes ``p = exp(s - lse)`` from the
stored ``lse``, uses ``Delta = rowsum(dO * O) - dlse`` and adds ``dc`` into an fp32 latent gradient with atomics
(its last bits may vary between GPU runs).

Precision: fp32 inputs compute in fp32 (``input_precision="ieee"``). bf16/fp16 inputs (``q_abs`` and ``latent`` of
one dtype) feed the score products ``q c^T``, ``dO c^T`` the 16-bit operands (exact products, fp32 accumulation)
and round ``p`` / ``ds`` once to 16 bits for ``p c``, ``ds c``, ``ds^T q``, ``p^T dO`` (relative ``u`` per term:
``2**-8`` bf16, ``2**-11`` fp16); ``Delta`` uses the stored, rounded output; results are rounded once to nearest
even. Mixed dtypes run the fp32 path.

The kernels run in the custom ops ``glm53flash::sparse_mla_fwd`` / ``sparse_mla_bwd`` (fakes and an autograd
formula: ``torch.compile(fullgraph=True)`` without a graph break). Without triton the module imports and
:func:`sparse_mla_fused` raises.
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
    round_to,
    tl,
    triton,
)

MAX_LATENT_DIM = 1024  # Dl above this would need a split of the [BH, Dl] accumulator (the release uses 512)

__all__ = ["MAX_LATENT_DIM", "fused_dsa_available", "sparse_mla_fused"]


def fused_dsa_available(*tensors: torch.Tensor) -> tuple[bool, str]:
    """Probe of ``dispatch``: ``(True, "")`` when :func:`sparse_mla_fused` can run on ``(q_abs, latent, indices)``,
    else ``(False, reason)`` (no triton, not CUDA, a dtype other than fp32/bf16/fp16, bad shapes,
    ``Dl > MAX_LATENT_DIM``)."""
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
    """:func:`.dsa_ops.check_sparse_mla_args`, then the kernel's dtype, width and device limits."""
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
    """``(BH, BW, BD, num_warps)``: every block dim a power of two >= 16 (``tl.dot``), tiles under ``budget``."""
    bd = next_power_of_2(dim, 16)
    bh = block_h if block_h is not None else max(16, min(next_power_of_2(heads), 64, budget // bd))
    bw = block_w if block_w is not None else max(16, min(64, budget // bd))
    for name, value in (("block_h", bh), ("block_w", bw)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot tile); got {name}={value}")
    return bh, bw, bd, (8 if bd >= 256 else 4)


_FWD_TILE, _BWD_TILE = 16384, 8192


if TRITON_AVAILABLE:

    @triton.jit
    def _dot(a, b, acc, LOWP: tl.constexpr, UPCAST: tl.constexpr):
        """``acc + a @ b`` accumulated in fp32 (``UPCAST``: 16-bit operands widened first, for the interpreter)."""
        if LOWP and not UPCAST:
            return tl.dot(a, b, acc)
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")

    @triton.jit
    def _program_tile(S, H, DL, BH: tl.constexpr, BD: tl.constexpr):
        """This program's query row, batch row, heads, features, their masks and ``q_abs`` / ``out`` offsets."""
        row = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        d = tl.arange(0, BD)
        hm = h < H
        dm = d < DL
        return row, row // S, h, hm, d, dm, hm[:, None] & dm[None, :], (row * H + h[:, None]) * DL + d[None, :]

    @triton.jit
    def _gather_block(idx_ptr, lat_ptr, row, b, w0, S_KV, W, DL, d, dm, BW: tl.constexpr, LOWP: tl.constexpr):
        """Ids ``w0 .. w0 + BW`` of query row ``row``: ``(valid, offsets, mask, rows c)``, ``c = 0`` where invalid."""
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
                acc = _dot(round_to(p, DT_OUT).to(DT_OUT), c, acc * alpha[:, None], LOWP, UPCAST)
            else:
                acc = _dot(p, c, acc * alpha[:, None], LOWP, UPCAST)
            m_i = m_new
        nonempty = l_i > 0.0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(out_ptr + offs, round_to(out, DT_OUT).to(DT_OUT), mask=qm)
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
                ds_w = round_to(ds, DT_Q).to(DT_Q)
                p_w = round_to(p, DT_Q).to(DT_Q)
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
            tl.store(dq_ptr + offs, round_to(dq * scale, DT_Q).to(DT_Q), mask=qm)


def _kernel_inputs(q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor):
    """``(q, latent, indices, lowp)`` as the kernels read them (mixed dtypes: the latent upcast to fp32)."""
    q_c, lat_c, idx_c = q_abs.contiguous(), latent.contiguous(), indices.contiguous()
    if idx_c.dtype not in (torch.int32, torch.int64):
        idx_c = idx_c.to(torch.int64)
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
    need_dq, need_dlat = ctx.needs_input_grad[:2]
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


def sparse_mla_fused(q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, scale: float, *,
                     block_h: int | None = None, block_w: int | None = None, query_chunk: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused sparse MLA: the contract of :func:`.dsa_ops.sparse_mla_torch`, with ``q_abs`` and ``latent`` in
    fp32/bf16/fp16 and ``Dl <= MAX_LATENT_DIM``. ``block_h``, ``block_w``: heads per program / ids per block (powers
    of two >= 16; ``None``: automatic); ``query_chunk`` is ignored. ``RuntimeError`` without triton; ``ValueError``
    also for another dtype, a larger ``Dl``, two devices, CPU outside ``TRITON_INTERPRET=1``, bad block sizes."""
    require_triton("glm53flash_hf.dsa_fused")
    _check_args(q_abs, latent, indices)
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite; got scale={scale}")
    _blocks(q_abs.shape[2], q_abs.shape[3], block_h, block_w, _FWD_TILE)  # validate the block sizes before autograd
    return _SPARSE_MLA_FWD(q_abs, latent, indices, scale, block_h, block_w)
