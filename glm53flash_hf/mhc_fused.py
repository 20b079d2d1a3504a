"""Fused path of the mHC family: our Triton kernels for ``hc_post`` (forward and backward fused) and ``hc_pre``
(the reductions over the ``N*D`` streams fused, the small per-token part in torch via :func:`.mhc_ops.mix_weights`),
as ``torch.library`` custom ops with fakes and autograd formulas (``torch.compile(fullgraph=True)`` without a graph
break). Same maths as :mod:`.mhc_ops`.

CUDA tensors (CPU only under ``TRITON_INTERPRET=1``), activations fp32/bf16/fp16, any ``N`` and ``D``. Without triton
the module imports; :func:`fused_mhc_available` says why and the fused functions raise ``RuntimeError``.
"""

from __future__ import annotations

import torch

from .dispatch import local_tensor
from .graph_ops import define_op
from .mhc_ops import check_hc_post_args, check_hc_pre_args, mix_weights
from .triton_utils import (
    SUPPORTED_DTYPES,
    TL_DTYPES,
    TRITON_AVAILABLE,
    check_device,
    check_dtype,
    next_power_of_2,
    probe_tensors,
    require_triton,
    round_to,
    tl,
    triton,
)

__all__ = ["fused_mhc_available", "hc_post_fused", "hc_pre_fused"]


def fused_mhc_available(*tensors: torch.Tensor) -> tuple[bool, str]:
    """The mHC family's registered probe on the call's tensors (``hc_pre``'s ``X, fn, base, scale`` or ``hc_post``'s
    ``y, residual, post, comb``): ``(True, "")``, or ``(False, reason)`` for no triton, a tensor not on CUDA, a dtype
    other than fp32/bf16/fp16, an activation not ``[B, S, N, D]``, or a ``y`` wider than ``residual``."""
    tensors, reason = probe_tensors("mHC", tensors)
    if reason:
        return False, reason
    if len(tensors) >= 2 and tensors[0].dim() == 3 and tensors[1].dim() == 4:  # hc_post(y, residual, ...)
        if torch.promote_types(tensors[0].dtype, tensors[1].dtype) != tensors[1].dtype:
            return False, f"y ({tensors[0].dtype}) is wider than residual ({tensors[1].dtype})"
    elif tensors[0].dim() != 4:
        return False, f"streams must be [B, S, N, D]; got {tuple(tensors[0].shape)}"
    return True, ""


if TRITON_AVAILABLE:

    @triton.jit
    def _hc_post_fwd_kernel(
        y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr,
        D,
        N: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, DT: tl.constexpr,
    ):
        # one program: one token t, one block of BD features; out[t, h, d] for all h
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        dm = d < D
        h = tl.arange(0, NP)
        hm = h < N
        y = tl.load(y_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)
        post = round_to(tl.load(post_ptr + t * N + h, mask=hm, other=0.0), DT)
        mixed = tl.zeros((NP, BD), dtype=tl.float32)
        for i in tl.static_range(N):
            r = tl.load(res_ptr + (t * N + i) * D + d, mask=dm, other=0.0).to(tl.float32)
            c = round_to(tl.load(comb_ptr + (t * N + i) * N + h, mask=hm, other=0.0), DT)  # comb[t, i, :]
            mixed += c[:, None] * r[None, :]
        expanded = round_to(post[:, None] * y[None, :], DT)
        out = round_to(round_to(mixed, DT) + expanded, DT).to(DT)
        tl.store(out_ptr + (t * N + h[:, None]) * D + d[None, :], out, mask=hm[:, None] & dm[None, :])

    @triton.jit
    def _hc_post_bwd_kernel(
        g_ptr, y_ptr, res_ptr, post_ptr, comb_ptr,
        dy_ptr, dres_ptr, dpost_ptr, dcomb_ptr,
        D,
        N: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, DT: tl.constexpr,
    ):
        # one program: one token, loops over D; reads g, y, residual once
        t = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, NP)
        rm = rows < N
        post = round_to(tl.load(post_ptr + t * N + rows, mask=rm, other=0.0), DT)
        dpost = tl.zeros((NP,), dtype=tl.float32)
        dcomb = tl.zeros((NP, NP), dtype=tl.float32)  # [i, h]
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            dm = d < D
            m2 = rm[:, None] & dm[None, :]
            y = tl.load(y_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)
            res = tl.load(res_ptr + (t * N + rows[:, None]) * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
            dres = tl.zeros((NP, BD), dtype=tl.float32)
            dy = tl.zeros((BD,), dtype=tl.float32)
            for hh in tl.static_range(N):
                g = tl.load(g_ptr + (t * N + hh) * D + d, mask=dm, other=0.0).to(tl.float32)
                ccol = round_to(tl.load(comb_ptr + (t * N + rows) * N + hh, mask=rm, other=0.0), DT)
                ph = tl.sum(tl.where(rows == hh, post, 0.0), axis=0)
                dres += ccol[:, None] * g[None, :]
                dy += ph * g
                dpost += tl.where(rows == hh, tl.sum(g * y, axis=0), 0.0)
                dcomb += tl.where(rows[None, :] == hh, tl.sum(res * g[None, :], axis=1)[:, None], 0.0)
            tl.store(dy_ptr + t * D + d, round_to(dy, DT).to(DT), mask=dm)
            tl.store(dres_ptr + (t * N + rows[:, None]) * D + d[None, :], round_to(dres, DT).to(DT), mask=m2)
        tl.store(dpost_ptr + t * N + rows, dpost, mask=rm)
        tl.store(dcomb_ptr + (t * N + rows[:, None]) * N + rows[None, :], dcomb, mask=rm[:, None] & rm[None, :])

    @triton.jit
    def _hc_pre_reduce_kernel(
        x_ptr, fn_ptr, proj_ptr, sumsq_ptr,
        T, K,
        M: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    ):
        # one program: BT tokens; loops over K = N*D: proj = x @ fn^T (fp32, ieee), sumsq = sum x^2
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        tm = t < T
        j = tl.arange(0, MP)
        jm = j < M
        acc = tl.zeros((BT, MP), dtype=tl.float32)
        ss = tl.zeros((BT,), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            km = k < K
            x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=tm[:, None] & km[None, :], other=0.0).to(tl.float32)
            w = tl.load(fn_ptr + j[None, :] * K + k[:, None], mask=jm[None, :] & km[:, None], other=0.0).to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision="ieee")
            ss += tl.sum(x * x, axis=1)
        tl.store(proj_ptr + t[:, None] * M + j[None, :], acc, mask=tm[:, None] & jm[None, :])
        tl.store(sumsq_ptr + t, ss, mask=tm)

    @triton.jit
    def _hc_collapse_kernel(
        x_ptr, pre_ptr, out_ptr,
        D,
        N: tl.constexpr, BD: tl.constexpr, DT: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        dm = d < D
        acc = tl.zeros((BD,), dtype=tl.float32)
        for n in tl.static_range(N):
            p = tl.load(pre_ptr + t * N + n).to(tl.float32)
            acc += p * tl.load(x_ptr + (t * N + n) * D + d, mask=dm, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * D + d, round_to(acc, DT).to(DT), mask=dm)

    @triton.jit
    def _hc_dpre_kernel(
        x_ptr, dc_ptr, dpre_ptr,
        D,
        N: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr,
    ):
        # dpre[t, n] = sum_d dcollapsed[t, d] * X[t, n, d] (fp32)
        t = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, NP)
        rm = rows < N
        acc = tl.zeros((NP,), dtype=tl.float32)
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            dm = d < D
            dc = tl.load(dc_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + (t * N + rows[:, None]) * D + d[None, :], mask=rm[:, None] & dm[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(x * dc[None, :], axis=1)
        tl.store(dpre_ptr + t * N + rows, acc, mask=rm)

    @triton.jit
    def _hc_pre_dx_kernel(
        x_ptr, fn_ptr, dproj_ptr, dsumsq_ptr, pre_ptr, dc_ptr, dx_ptr,
        T, D,
        N: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
        HAS_DC: tl.constexpr, DT: tl.constexpr,
    ):
        # dX[t, n, d] = sum_j dproj[t, j] fn[j, n*D + d] + 2 dsumsq[t] X[t, n, d] + pre[t, n] dcollapsed[t, d]
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        n = tl.program_id(1)
        d = tl.program_id(2) * BD + tl.arange(0, BD)
        tm = t < T
        dm = d < D
        j = tl.arange(0, MP)
        jm = j < M
        K = N * D
        m2 = tm[:, None] & dm[None, :]
        dp = tl.load(dproj_ptr + t[:, None] * M + j[None, :], mask=tm[:, None] & jm[None, :], other=0.0)
        w = tl.load(fn_ptr + j[:, None] * K + n * D + d[None, :], mask=jm[:, None] & dm[None, :],
                    other=0.0).to(tl.float32)
        acc = tl.dot(dp, w, input_precision="ieee")
        x = tl.load(x_ptr + (t[:, None] * N + n) * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        ds = tl.load(dsumsq_ptr + t, mask=tm, other=0.0)
        acc += (2.0 * ds)[:, None] * x
        if HAS_DC:
            p = tl.load(pre_ptr + t * N + n, mask=tm, other=0.0)
            dc = tl.load(dc_ptr + t[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
            acc += p[:, None] * dc
        tl.store(dx_ptr + (t[:, None] * N + n) * D + d[None, :], round_to(acc, DT).to(DT), mask=m2)

    @triton.jit
    def _hc_pre_dfn_kernel(
        x_ptr, dproj_ptr, dfn_ptr,
        T, K,
        M: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    ):
        # dfn[j, k] = sum_t dproj[t, j] x[t, k] (fp32), one program per block of BK columns, loops over tokens
        j = tl.arange(0, MP)
        jm = j < M
        k = tl.program_id(0).to(tl.int64) * BK + tl.arange(0, BK)
        km = k < K
        acc = tl.zeros((MP, BK), dtype=tl.float32)
        for t0 in range(0, T, BT):
            t = (t0 + tl.arange(0, BT)).to(tl.int64)
            tm = t < T
            dp = tl.load(dproj_ptr + t[:, None] * M + j[None, :], mask=tm[:, None] & jm[None, :], other=0.0)
            x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=tm[:, None] & km[None, :], other=0.0).to(tl.float32)
            acc = tl.dot(tl.trans(dp), x, acc, input_precision="ieee")
        tl.store(dfn_ptr + j[:, None] * K + k[None, :], acc, mask=jm[:, None] & km[None, :])


def _post_blocks(dim: int) -> tuple[int, int]:
    return min(next_power_of_2(dim, 16), 1024), min(next_power_of_2(dim, 16), 512)  # forward BD, backward BD


def _hc_post_fwd_impl(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
                      ) -> torch.Tensor:
    b, s, n, d = residual.shape
    t = b * s
    y_c, res_c, post_c, comb_c = (x.contiguous() for x in (y, residual, post, comb))
    out = torch.empty_like(res_c)
    bd_fwd, _ = _post_blocks(d)
    if t > 0 and d > 0:
        _hc_post_fwd_kernel[(t, triton.cdiv(d, bd_fwd))](
            y_ptr=y_c, res_ptr=res_c, post_ptr=post_c, comb_ptr=comb_c, out_ptr=out, D=d,
            N=n, NP=next_power_of_2(n), BD=bd_fwd, DT=TL_DTYPES[residual.dtype],
        )
    return out


def _hc_post_fwd_fake(y, residual, post, comb):
    return residual.new_empty(residual.shape)


def _hc_post_bwd_impl(grad: torch.Tensor, y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                      comb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b, s, n, d = residual.shape
    t = b * s
    y, res, post, comb, g = (x.contiguous() for x in (y, residual, post, comb, grad))
    dy, dres = torch.empty_like(y), torch.empty_like(res)
    dpost, dcomb = (torch.empty(x.shape, dtype=torch.float32, device=x.device) for x in (post, comb))
    _, bd_bwd = _post_blocks(d)
    if t > 0:
        _hc_post_bwd_kernel[(t,)](
            g_ptr=g, y_ptr=y, res_ptr=res, post_ptr=post, comb_ptr=comb,
            dy_ptr=dy, dres_ptr=dres, dpost_ptr=dpost, dcomb_ptr=dcomb, D=d,
            N=n, NP=next_power_of_2(n), BD=bd_bwd, DT=TL_DTYPES[res.dtype],
        )
    return dy, dres, dpost, dcomb


def _hc_post_bwd_fake(grad, y, residual, post, comb):
    f32 = torch.float32
    return (y.new_empty(y.shape), residual.new_empty(residual.shape), post.new_empty(post.shape, dtype=f32),
            comb.new_empty(comb.shape, dtype=f32))


def _hc_post_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _hc_post_backward(ctx, grad):
    y, residual, post, comb = ctx.saved_tensors
    dy, dres, dpost, dcomb = _HC_POST_BWD(grad, y, residual, post, comb)
    return dy, dres, dpost.to(post.dtype), dcomb.to(comb.dtype)


def _pre_blocks(t: int, k: int, d: int) -> tuple[int, int, int]:
    """(BT tokens per program, BK columns of N*D, BD features) for the hc_pre kernels."""
    return min(32, next_power_of_2(t, 16)), min(128, next_power_of_2(k, 16)), min(256, next_power_of_2(d, 16))


# Column blocks of the two backward dot kernels (dX: BD, dfn: BK): their fp32 ``ieee`` dots unroll to FMAs whose
# [BT, BD] / [MP, BK] accumulators must stay in registers at 4 warps; larger tiles spill to local memory.
_DX_BD, _DFN_BK = 32, 64


def _small_graph(proj, sumsq, base, scale, n, k, cfg):
    """The torch part of hc_pre on ``[T, M]`` (:func:`~glm53flash_hf.mhc_ops.mix_weights`, the torch path's ops)."""
    sinkhorn_iters, hc_eps, norm_eps = cfg
    return mix_weights(proj, sumsq.unsqueeze(-1) / k, base, scale, n=n, sinkhorn_iters=sinkhorn_iters,
                       hc_eps=hc_eps, norm_eps=norm_eps)


def _hc_pre_fwd_impl(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     sinkhorn_iters: int, hc_eps: float, norm_eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b, s, n, d = x.shape
    t, k, m = b * s, n * d, fn.shape[0]
    x_c, fn_c = x.contiguous(), fn.contiguous()
    bt, bk, bd = _pre_blocks(t, k, d)
    proj = torch.empty(t, m, dtype=torch.float32, device=x.device)
    sumsq = torch.empty(t, dtype=torch.float32, device=x.device)
    if t > 0:
        _hc_pre_reduce_kernel[(triton.cdiv(t, bt),)](
            x_ptr=x_c, fn_ptr=fn_c, proj_ptr=proj, sumsq_ptr=sumsq, T=t, K=k,
            M=m, MP=next_power_of_2(m, 16), BT=bt, BK=bk,
        )
    with torch.no_grad():
        pre, post, comb = _small_graph(proj, sumsq, base, scale, n, k, (sinkhorn_iters, hc_eps, norm_eps))
    pre = pre.contiguous()
    collapsed = torch.empty(b, s, d, dtype=x.dtype, device=x.device)
    if t > 0 and d > 0:
        _hc_collapse_kernel[(t, triton.cdiv(d, bd))](
            x_ptr=x_c, pre_ptr=pre, out_ptr=collapsed, D=d, N=n, BD=bd, DT=TL_DTYPES[x.dtype],
        )
    return post.reshape(b, s, n).contiguous(), comb.reshape(b, s, n, n).contiguous(), collapsed, proj, sumsq


def _hc_pre_fwd_fake(x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps):
    b, s, n, d = x.shape
    proj = x.new_empty((b * s, fn.shape[0]), dtype=torch.float32)
    sumsq = x.new_empty((b * s,), dtype=torch.float32)
    _, post, comb = _small_graph(proj, sumsq, base, scale, n, n * d, (sinkhorn_iters, hc_eps, norm_eps))
    return (post.new_empty((b, s, n)), comb.new_empty((b, s, n, n)), x.new_empty((b, s, d)), proj, sumsq)


def _hc_pre_dpre_impl(x: torch.Tensor, dcollapsed: torch.Tensor) -> torch.Tensor:
    b, s, n, d = x.shape
    t = b * s
    x_c, dc = x.contiguous(), dcollapsed.contiguous()
    dpre = torch.empty(t, n, dtype=torch.float32, device=x.device)
    if t > 0:
        _hc_dpre_kernel[(t,)](x_ptr=x_c, dc_ptr=dc, dpre_ptr=dpre, D=d, N=n, NP=next_power_of_2(n),
                              BD=_pre_blocks(t, n * d, d)[2])
    return dpre


def _hc_pre_dpre_fake(x, dcollapsed):
    b, s, n, _ = x.shape
    return x.new_empty((b * s, n), dtype=torch.float32)


def _hc_pre_dx_impl(x: torch.Tensor, fn: torch.Tensor, dproj: torch.Tensor, dsumsq: torch.Tensor, pre: torch.Tensor,
                    dcollapsed: torch.Tensor | None) -> torch.Tensor:
    b, s, n, d = x.shape
    t, m = b * s, fn.shape[0]
    bt, _, bd = _pre_blocks(t, n * d, d)
    bd = min(bd, _DX_BD)
    x_c, fn_c, dproj, dsumsq, pre = (v.contiguous() for v in (x, fn, dproj, dsumsq, pre))
    dc = dcollapsed.contiguous() if dcollapsed is not None else None
    dx = torch.empty_like(x_c)
    if t > 0 and d > 0:
        _hc_pre_dx_kernel[(triton.cdiv(t, bt), n, triton.cdiv(d, bd))](
            x_ptr=x_c, fn_ptr=fn_c, dproj_ptr=dproj, dsumsq_ptr=dsumsq, pre_ptr=pre,
            dc_ptr=dc if dc is not None else dproj, dx_ptr=dx, T=t, D=d,
            N=n, M=m, MP=next_power_of_2(m, 16), BT=bt, BD=bd, HAS_DC=dc is not None, DT=TL_DTYPES[x.dtype],
        )
    return dx


def _hc_pre_dx_fake(x, fn, dproj, dsumsq, pre, dcollapsed):
    return x.new_empty(x.shape)


def _hc_pre_dfn_impl(x: torch.Tensor, dproj: torch.Tensor) -> torch.Tensor:
    b, s, n, d = x.shape
    t, k, m = b * s, n * d, dproj.shape[1]
    bt, bk, _ = _pre_blocks(t, k, d)
    bk = min(bk, _DFN_BK)
    x_c, dproj = x.contiguous(), dproj.contiguous()
    dfn = torch.zeros(m, k, dtype=torch.float32, device=x.device)
    if t > 0 and k > 0:
        _hc_pre_dfn_kernel[(triton.cdiv(k, bk),)](
            x_ptr=x_c, dproj_ptr=dproj, dfn_ptr=dfn, T=t, K=k, M=m, MP=next_power_of_2(m, 16), BT=bt, BK=bk,
        )
    return dfn


def _hc_pre_dfn_fake(x, dproj):
    _, _, n, d = x.shape
    return x.new_empty((dproj.shape[1], n * d), dtype=torch.float32)


def _hc_pre_setup(ctx, inputs, output):
    x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps = inputs
    proj, sumsq = output[3], output[4]
    ctx.save_for_backward(x, fn, base, scale, proj, sumsq)
    ctx.mark_non_differentiable(proj, sumsq)
    ctx.cfg = (sinkhorn_iters, hc_eps, norm_eps)


def _hc_pre_backward(ctx, dpost, dcomb, dcollapsed, _dproj, _dsumsq):
    """Pass 1 over X (``dpre``, a kernel), the small ``[T, M]`` graph recomputed from the saved ``proj``/``sumsq``
    and differentiated by torch autograd (every Sinkhorn step), then passes 2 (``dX``) and 3 (``dfn``) over X."""
    x, fn, base, scale, proj, sumsq = ctx.saved_tensors
    n, d = x.shape[2], x.shape[3]
    k = n * d
    dpre = _HC_PRE_DPRE(x, dcollapsed) if dcollapsed is not None else None
    need_base, need_scale = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
    with torch.enable_grad():
        proj_r = proj.detach().requires_grad_(True)
        sumsq_r = sumsq.detach().requires_grad_(True)
        base_r = base.detach().requires_grad_(need_base)
        scale_r = scale.detach().requires_grad_(need_scale)
        pre, post, comb = _small_graph(proj_r, sumsq_r, base_r, scale_r, n, k, ctx.cfg)
        outs, grads = [], []
        for o, g in ((pre, dpre), (post, dpost), (comb, dcomb)):
            if g is not None:
                outs.append(o)
                grads.append(g.reshape(o.shape).to(o.dtype))
        inputs = [proj_r, sumsq_r] + ([base_r] if need_base else []) + ([scale_r] if need_scale else [])
        got = torch.autograd.grad(outs, inputs, grads, allow_unused=True) if outs else [None] * len(inputs)
    dproj, dsumsq, *rest = [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, got)]
    dbase = rest.pop(0) if need_base else None
    dscale = rest.pop(0) if need_scale else None
    dx = _HC_PRE_DX(x, fn, dproj, dsumsq, pre.detach(), dcollapsed) if ctx.needs_input_grad[0] else None
    dfn = _HC_PRE_DFN(x, dproj).to(fn.dtype) if ctx.needs_input_grad[1] else None
    return dx, dfn, dbase, dscale, None, None, None


if TRITON_AVAILABLE:
    _HC_POST_BWD = define_op("hc_post_bwd", _hc_post_bwd_impl, _hc_post_bwd_fake)
    _HC_POST_FWD = define_op("hc_post_fwd", _hc_post_fwd_impl, _hc_post_fwd_fake, backward=_hc_post_backward,
                             setup_context=_hc_post_setup)
    _HC_PRE_DPRE = define_op("hc_pre_dpre", _hc_pre_dpre_impl, _hc_pre_dpre_fake)
    _HC_PRE_DX = define_op("hc_pre_dx", _hc_pre_dx_impl, _hc_pre_dx_fake)
    _HC_PRE_DFN = define_op("hc_pre_dfn", _hc_pre_dfn_impl, _hc_pre_dfn_fake)
    _HC_PRE_FWD = define_op("hc_pre_fwd", _hc_pre_fwd_impl, _hc_pre_fwd_fake, backward=_hc_pre_backward,
                            setup_context=_hc_pre_setup)


def hc_post_fused(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Fused alternative of :func:`.mhc_ops.hc_post_torch` (its contract; ``residual`` fp32/bf16/fp16, ``y`` of its
    dtype or narrower; ``dpost``/``dcomb`` accumulated in fp32). A narrower ``y`` (a bf16 sub-block output beside fp32
    streams: autocast with fp32 weights) is upcast first, which is exact: the torch op's promotion gives the same
    values. ``RuntimeError`` without triton; ``ValueError`` also for unsupported dtypes or a ``y`` wider than
    ``residual``."""
    require_triton("glm53flash_hf.mhc_fused")
    check_hc_post_args(y, residual, post, comb)
    check_device("residual", residual)
    if y.dtype != residual.dtype and torch.promote_types(y.dtype, residual.dtype) == residual.dtype:
        y = y.to(residual.dtype)
    if residual.dtype not in SUPPORTED_DTYPES or y.dtype != residual.dtype:
        raise ValueError(f"fused hc_post needs y and residual of one dtype in fp32/bf16/fp16; got {y.dtype}, "
                         f"{residual.dtype}")
    return _HC_POST_FWD(y, residual, post, comb)


def hc_pre_fused(hidden_streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                 sinkhorn_iters: int, hc_eps: float, norm_eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused alternative of :func:`.mhc_ops.hc_pre_torch` (its contract; ``X`` and ``fn`` in fp32/bf16/fp16).
    ``RuntimeError`` without triton; ``ValueError`` also for unsupported dtypes and a sharded DTensor parameter."""
    require_triton("glm53flash_hf.mhc_fused")
    # Parameters may arrive as DTensors (sharded or tensor-parallel models): replicated ones are unwrapped
    # (differentiably), sharded ones raise.
    fn, base, scale = (local_tensor(t, f"hc {name}") for t, name in ((fn, "fn"), (base, "base"), (scale, "scale")))
    check_hc_pre_args(hidden_streams, fn, base, scale, sinkhorn_iters)
    check_device("hidden_streams", hidden_streams)
    check_dtype("hidden_streams", hidden_streams)
    check_dtype("fn", fn)
    return _HC_PRE_FWD(hidden_streams, fn, base, scale, int(sinkhorn_iters), float(hc_eps), float(norm_eps))[:3]

