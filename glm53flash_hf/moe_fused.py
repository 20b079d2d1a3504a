"""Fused pieces of the routed experts: Triton clamped-SwiGLU and weighted-combine kernels around torch's grouped GEMM.

Oracle: :func:`.moe_ops.experts_forward_torch` (maths and rounding). Bf16/fp16 results equal the torch path's
because the kernels round like torch's op sequence (``rd``: fp32 to the activation dtype, nearest even): forward
``act = rd(rd(silu(gc)) * uc)``; backward ``ds = rd(da * uc)``, ``duc = rd(da * rd(silu(gc)))``,
``dgc = rd(ds * sig * (1 + gc * (1 - sig)))``; clamp gradients pass where ``gate <= L`` and ``-L <= up <= L``.
Left: fp32 ``exp`` / division implementations (a few ulps) and the combine's fp32 summation order. Rows at or past
``valid_rows`` (expert-parallel sentinels) are absent: zero activation, contribution and gradients.

The kernels run in custom ops ``glm53flash::clamped_swiglu_fwd`` / ``_bwd`` and ``weighted_combine_fwd`` / ``_bwd``
(fakes and autograd formulas: ``torch.compile(fullgraph=True)`` without a graph break). CUDA tensors (CPU under
``TRITON_INTERPRET=1``), fp32/bf16/fp16. Without triton the module imports and the fused functions raise.
"""

from __future__ import annotations

import torch

from .dispatch import local_tensor
from .graph_ops import define_op, to_autocast_dtype
from .moe_ops import check_experts_args, grouped_mm, routing_metadata, rows_by_token
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

__all__ = ["clamped_swiglu_fused", "experts_forward_fused", "fused_moe_available", "rows_by_token",
           "weighted_combine_fused"]


def fused_moe_available(*tensors: torch.Tensor) -> tuple[bool, str]:
    """Probe of ``dispatch``: ``(True, "")`` when the fused path can run on ``(hidden_states, gate_up_proj, down_proj,
    top_k_weights)`` (DTensors judged by dtype and device), else ``(False, reason)``: no triton, not CUDA, a dtype
    other than fp32/bf16/fp16, expert weights of two dtypes."""
    tensors, reason = probe_tensors("MoE", tensors)
    if reason:
        return False, reason
    weights = [t for t in tensors if t.dtype.is_floating_point and t.dim() == 3]
    if len({t.dtype for t in weights}) > 1:
        return False, f"expert weights of different dtypes {sorted(str(t.dtype) for t in weights)}"
    return True, ""


def _valid_rows(valid_rows: torch.Tensor | None, num_rows: int, device: torch.device) -> torch.Tensor:
    if valid_rows is None:
        return torch.full((1,), num_rows, dtype=torch.int32, device=device)
    if valid_rows.numel() != 1 or valid_rows.dtype != torch.int32 or valid_rows.device != device:
        raise ValueError(f"valid_rows must be a one-element int32 tensor on {device}; got {valid_rows.numel()} "
                         f"element(s) of {valid_rows.dtype} on {valid_rows.device}")
    return valid_rows


if TRITON_AVAILABLE:

    @triton.jit
    def _swiglu_tile(
        gu_ptr, nvalid_ptr,
        n_rows, inter, stride_gu,
        limit, limit_value,
        HAS_LIMIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """This program's ``gate_up`` tile: rows, columns, store / load masks, ``g``, ``u`` and their clamps (fp32)."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_ok = cols < inter
        store_mask = (rows < n_rows)[:, None] & col_ok[None, :]
        load_mask = (rows < tl.load(nvalid_ptr))[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        src = gu_ptr + rows64[:, None] * stride_gu + cols[None, :]
        g = tl.load(src, mask=load_mask, other=0.0).to(tl.float32)
        u = tl.load(src + inter, mask=load_mask, other=0.0).to(tl.float32)
        gc = g
        uc = u
        if HAS_LIMIT:  # tl.where keeps NaN as torch.clamp does
            gc = tl.where(g > limit, limit_value, g)
            uc = tl.where(u > limit, limit_value, tl.where(u < -limit, -limit_value, u))
        return rows64, cols, store_mask, load_mask, g, u, gc, uc

    @triton.jit
    def _swiglu_fwd_kernel(
        gu_ptr, act_ptr, nvalid_ptr,
        n_rows, inter, stride_gu, stride_act,
        limit, limit_value,
        HAS_LIMIT: tl.constexpr, DT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        rows64, cols, store_mask, load_mask, g, u, gc, uc = _swiglu_tile(
            gu_ptr, nvalid_ptr, n_rows, inter, stride_gu, limit, limit_value, HAS_LIMIT, BLOCK_R, BLOCK_C
        )
        s = round_to(gc / (1.0 + tl.exp(-gc)), DT)
        a = round_to(s * uc, DT)
        tl.store(act_ptr + rows64[:, None] * stride_act + cols[None, :], a.to(DT), mask=store_mask)

    @triton.jit
    def _swiglu_bwd_kernel(
        gu_ptr, dact_ptr, dgu_ptr, nvalid_ptr,
        n_rows, inter, stride_gu, stride_dact, stride_dgu,
        limit, limit_value,
        HAS_LIMIT: tl.constexpr, DT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        rows64, cols, store_mask, load_mask, g, u, gc, uc = _swiglu_tile(
            gu_ptr, nvalid_ptr, n_rows, inter, stride_gu, limit, limit_value, HAS_LIMIT, BLOCK_R, BLOCK_C
        )
        da = tl.load(dact_ptr + rows64[:, None] * stride_dact + cols[None, :], mask=load_mask, other=0.0)
        da = da.to(tl.float32)
        e = tl.exp(-gc)
        s = round_to(gc / (1.0 + e), DT)
        sig = 1.0 / (1.0 + e)
        ds = round_to(da * uc, DT)
        duc = round_to(da * s, DT)
        dgc = round_to(ds * sig * (1.0 + gc * (1.0 - sig)), DT)
        if HAS_LIMIT:
            dgc = tl.where(g <= limit, dgc, 0.0)
            duc = tl.where((u >= -limit) & (u <= limit), duc, 0.0)
        dst = dgu_ptr + rows64[:, None] * stride_dgu + cols[None, :]
        tl.store(dst, dgc.to(DT), mask=store_mask)
        tl.store(dst + inter, duc.to(DT), mask=store_mask)

    @triton.jit
    def _combine_fwd_kernel(
        rows_ptr, w_ptr, order_ptr, nvalid_ptr, out_ptr,
        hidden, stride_rows, stride_out,
        K: tl.constexpr, OUT_DT: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        col_ok = cols < hidden
        nvalid = tl.load(nvalid_ptr)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            r = tl.load(order_ptr + t * K + j).to(tl.int64)
            live = r < nvalid  # r < S always: the loads stay in bounds; absent rows (garbage) are zeroed
            w = tl.where(live, tl.load(w_ptr + r).to(tl.float32), 0.0)
            v = tl.load(rows_ptr + r * stride_rows + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc += tl.where(live, v, 0.0) * w
        tl.store(out_ptr + t * stride_out + cols, round_to(acc, OUT_DT).to(OUT_DT), mask=col_ok)

    @triton.jit
    def _combine_bwd_kernel(
        g_ptr, rows_ptr, w_ptr, token_ptr, nvalid_ptr, drows_ptr, dw_ptr,
        hidden, stride_g, stride_rows, stride_drows,
        ROW_DT: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        """Row ``r`` of token ``t``: ``drows[r] = rd(g[t] * w[r])``, ``dw[r] = sum_h g[t, h] * rows[r, h]`` (fp32)."""
        r = tl.program_id(0).to(tl.int64)
        t = tl.load(token_ptr + r).to(tl.int64)
        live = r < tl.load(nvalid_ptr)  # absent rows: token ids are still in range, so the loads are in bounds
        w = tl.where(live, tl.load(w_ptr + r).to(tl.float32), 0.0)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(0, hidden, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            col_ok = cols < hidden
            g = tl.load(g_ptr + t * stride_g + cols, mask=col_ok, other=0.0).to(tl.float32)
            v = tl.load(rows_ptr + r * stride_rows + cols, mask=col_ok, other=0.0).to(tl.float32)
            g = tl.where(live, g, 0.0)
            v = tl.where(live, v, 0.0)
            tl.store(drows_ptr + r * stride_drows + cols, round_to(g * w, ROW_DT).to(ROW_DT), mask=col_ok)
            acc += g * v
        tl.store(dw_ptr + r, tl.sum(acc, axis=0))


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim has unit stride (what the kernels index), else a contiguous copy."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _swiglu_launch(kernel, gate_up: torch.Tensor, valid_rows: torch.Tensor, limit: float | None, **outputs) -> None:
    """Run a clamped-SwiGLU ``kernel`` over ``gate_up [S, 2I]`` (unit last stride) with its other pointers and
    strides ``outputs``."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    # the kernels compare with ``limit`` and store it rounded to the dtype, as torch's ``clamp``
    lim = 0.0 if limit is None else float(limit)
    lim_value = 0.0 if limit is None else float(torch.tensor(lim, dtype=torch.float32).to(gate_up.dtype).item())
    if rows and inter:
        block_c = min(1024, next_power_of_2(inter, 16))
        block_r = max(1, 2048 // block_c)
        kernel[(triton.cdiv(rows, block_r), triton.cdiv(inter, block_c))](
            gu_ptr=gate_up, nvalid_ptr=valid_rows, n_rows=rows, inter=inter, stride_gu=gate_up.stride(0),
            limit=lim, limit_value=lim_value,
            HAS_LIMIT=limit is not None, DT=TL_DTYPES[gate_up.dtype], BLOCK_R=block_r, BLOCK_C=block_c, **outputs,
        )


def _swiglu_fwd_impl(gate_up: torch.Tensor, valid_rows: torch.Tensor, limit: float | None) -> torch.Tensor:
    gate_up = _unit_last_stride(gate_up)
    act = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, device=gate_up.device, dtype=gate_up.dtype)
    _swiglu_launch(_swiglu_fwd_kernel, gate_up, valid_rows, limit, act_ptr=act, stride_act=act.stride(0))
    return act


def _swiglu_fwd_fake(gate_up, valid_rows, limit):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


def _swiglu_bwd_impl(gate_up: torch.Tensor, dact: torch.Tensor, valid_rows: torch.Tensor, limit: float | None
                     ) -> torch.Tensor:
    gate_up = _unit_last_stride(gate_up)
    dact = _unit_last_stride(dact.to(gate_up.dtype))
    dgu = torch.empty_like(gate_up, memory_format=torch.contiguous_format)
    _swiglu_launch(_swiglu_bwd_kernel, gate_up, valid_rows, limit, dact_ptr=dact, dgu_ptr=dgu,
                   stride_dact=dact.stride(0), stride_dgu=dgu.stride(0))
    return dgu


def _swiglu_bwd_fake(gate_up, dact, valid_rows, limit):
    return gate_up.new_empty(gate_up.shape)


def _swiglu_setup(ctx, inputs, output):
    gate_up, valid_rows, limit = inputs
    ctx.save_for_backward(gate_up, valid_rows)
    ctx.limit = limit


def _swiglu_backward(ctx, dact):
    gate_up, valid_rows = ctx.saved_tensors
    return _SWIGLU_BWD(gate_up, dact, valid_rows, ctx.limit), None, None


def _combine_fwd_impl(rows: torch.Tensor, row_weights: torch.Tensor, token_rows: torch.Tensor,
                      token_of_row: torch.Tensor, valid_rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    rows = _unit_last_stride(rows)
    num_tokens, k = token_rows.shape
    hidden = rows.shape[1]
    w32 = row_weights.to(torch.float32).contiguous()
    token_rows = token_rows.contiguous()
    out = torch.empty(num_tokens, hidden, device=rows.device, dtype=out_dtype)
    if num_tokens and hidden:
        block_h = min(1024, next_power_of_2(hidden, 16))
        _combine_fwd_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
            rows_ptr=rows, w_ptr=w32, order_ptr=token_rows, nvalid_ptr=valid_rows, out_ptr=out,
            hidden=hidden, stride_rows=rows.stride(0), stride_out=out.stride(0),
            K=k, OUT_DT=TL_DTYPES[out_dtype], BLOCK_H=block_h,
        )
    return out


def _combine_fwd_fake(rows, row_weights, token_rows, token_of_row, valid_rows, out_dtype):
    return rows.new_empty((token_rows.shape[0], rows.shape[1]), dtype=out_dtype)


def _combine_bwd_impl(grad: torch.Tensor, rows: torch.Tensor, row_weights: torch.Tensor, token_of_row: torch.Tensor,
                      valid_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, grad = _unit_last_stride(rows), _unit_last_stride(grad)
    num_rows, hidden = rows.shape
    w32 = row_weights.to(torch.float32).contiguous()
    token_of_row = token_of_row.contiguous()
    drows = torch.empty(num_rows, hidden, device=rows.device, dtype=rows.dtype)
    dw = torch.empty(num_rows, device=rows.device, dtype=torch.float32)
    if num_rows and hidden:
        block_h = min(1024, next_power_of_2(hidden, 16))
        _combine_bwd_kernel[(num_rows,)](
            g_ptr=grad, rows_ptr=rows, w_ptr=w32, token_ptr=token_of_row, nvalid_ptr=valid_rows,
            drows_ptr=drows, dw_ptr=dw, hidden=hidden, stride_g=grad.stride(0), stride_rows=rows.stride(0),
            stride_drows=drows.stride(0), ROW_DT=TL_DTYPES[rows.dtype], BLOCK_H=block_h,
        )
    return drows, dw


def _combine_bwd_fake(grad, rows, row_weights, token_of_row, valid_rows):
    return rows.new_empty(rows.shape), rows.new_empty((rows.shape[0],), dtype=torch.float32)


def _combine_setup(ctx, inputs, output):
    rows, row_weights, token_rows, token_of_row, valid_rows, out_dtype = inputs
    ctx.save_for_backward(rows, row_weights, token_of_row, valid_rows)


def _combine_backward(ctx, grad):
    rows, row_weights, token_of_row, valid_rows = ctx.saved_tensors
    drows, dw = _COMBINE_BWD(grad, rows, row_weights, token_of_row, valid_rows)
    return drows, dw.to(row_weights.dtype), None, None, None, None


if TRITON_AVAILABLE:
    _SWIGLU_BWD = define_op("clamped_swiglu_bwd", _swiglu_bwd_impl, _swiglu_bwd_fake)
    _SWIGLU_FWD = define_op("clamped_swiglu_fwd", _swiglu_fwd_impl, _swiglu_fwd_fake, backward=_swiglu_backward,
                            setup_context=_swiglu_setup)
    _COMBINE_BWD = define_op("weighted_combine_bwd", _combine_bwd_impl, _combine_bwd_fake)
    _COMBINE_FWD = define_op("weighted_combine_fwd", _combine_fwd_impl, _combine_fwd_fake,
                             backward=_combine_backward, setup_context=_combine_setup)


def clamped_swiglu_fused(gate_up: torch.Tensor, limit: float | None, *, valid_rows: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """:func:`.moe_ops.clamped_swiglu` in Triton (rounding included): ``gate_up [S, 2I]`` fp32/bf16/fp16 with unit
    last stride -> ``[S, I]``. ``valid_rows``: one-element int32 device tensor ``n``, rows ``>= n`` give 0 and no
    gradient (``None``: all rows). ``RuntimeError`` without triton; ``ValueError`` for a bad shape, dtype, device,
    stride, negative ``limit`` or ``valid_rows``."""
    require_triton("glm53flash_hf.moe_fused")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [S, 2I] with an even last dim; got shape {tuple(gate_up.shape)}")
    check_dtype("gate_up", gate_up)
    check_device("gate_up", gate_up)
    if gate_up.shape[1] and gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must have unit stride in its last dim; got strides {gate_up.stride()}")
    if limit is not None and not float(limit) >= 0:
        raise ValueError(f"limit must be None or >= 0; got limit={limit}")
    valid_rows = _valid_rows(valid_rows, gate_up.shape[0], gate_up.device)
    return _SWIGLU_FWD(gate_up, valid_rows, None if limit is None else float(limit))


def weighted_combine_fused(rows: torch.Tensor, row_weights: torch.Tensor, token_rows: torch.Tensor,
                           token_of_row: torch.Tensor, *, out_dtype: torch.dtype,
                           valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_j row_weights[r] * rows[r]``, ``r = token_rows[t, j]`` in order, in fp32 rounded once to
    ``out_dtype`` (Triton, no atomics). ``rows [S, H]`` fp32/bf16/fp16 with unit last stride, ``row_weights [S]``,
    integer ``token_rows [T, k]`` (:func:`rows_by_token`) and its inverse ``token_of_row [S]``; ``valid_rows`` as
    :func:`clamped_swiglu_fused`. Returns ``[T, H]``. ``RuntimeError`` without triton; ``ValueError`` for shapes
    that do not fit, unsupported dtypes or devices, a non-unit last stride."""
    require_triton("glm53flash_hf.moe_fused")
    if rows.dim() != 2:
        raise ValueError(f"rows must be [S, H]; got shape {tuple(rows.shape)}")
    num_rows = rows.shape[0]
    if row_weights.shape != (num_rows,) or not row_weights.dtype.is_floating_point:
        raise ValueError(f"row_weights must be a float [S={num_rows}] tensor; got {tuple(row_weights.shape)} "
                         f"{row_weights.dtype}")
    if token_rows.dim() != 2 or token_rows.numel() != num_rows or token_rows.dtype.is_floating_point:
        raise ValueError(f"token_rows must be an integer [T, k] tensor with T * k = S = {num_rows}; got "
                         f"{tuple(token_rows.shape)} {token_rows.dtype}")
    if token_of_row.shape != (num_rows,) or token_of_row.dtype.is_floating_point:
        raise ValueError(f"token_of_row must be an integer [S={num_rows}] tensor; got {tuple(token_of_row.shape)} "
                         f"{token_of_row.dtype}")
    check_dtype("rows", rows)
    if out_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16; got out_dtype={out_dtype}")
    for name, t in (("rows", rows), ("row_weights", row_weights), ("token_rows", token_rows),
                    ("token_of_row", token_of_row)):
        check_device(name, t)
        if t.device != rows.device:
            raise ValueError(f"{name} is on {t.device} but rows is on {rows.device}")
    if rows.shape[1] and rows.stride(1) != 1:
        raise ValueError(f"rows must have unit stride in its last dim; got strides {rows.stride()}")
    valid_rows = _valid_rows(valid_rows, num_rows, rows.device)
    return _COMBINE_FWD(rows, row_weights, token_rows.contiguous(), token_of_row.contiguous(), valid_rows, out_dtype)


def experts_forward_fused(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                          gate_up_proj: torch.Tensor, down_proj: torch.Tensor, swiglu_limit: float | None, *,
                          drop_out_of_range: bool = False) -> torch.Tensor:
    """Routed experts, fused path: the contract of :func:`.moe_ops.experts_forward_torch` (its oracle).

    Expert weights of one dtype (fp32/bf16/fp16), cast to the autocast dtype under autocast as there; DTensor
    parameters are unwrapped by :func:`.dispatch.local_tensor` (replicated only). Raises ``RuntimeError`` without
    triton and ``ValueError`` for shapes that do not fit, unsupported dtypes or devices, or a sharded DTensor weight.
    """
    require_triton("glm53flash_hf.moe_fused")
    gate_up_proj = local_tensor(gate_up_proj, "experts.gate_up_proj")
    down_proj = local_tensor(down_proj, "experts.down_proj")
    check_experts_args(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
    gate_up_proj, down_proj = to_autocast_dtype(gate_up_proj, down_proj)
    if gate_up_proj.dtype != down_proj.dtype:
        raise ValueError(f"gate_up_proj ({gate_up_proj.dtype}) and down_proj ({down_proj.dtype}) dtypes differ")
    check_dtype("gate_up_proj", gate_up_proj)
    check_dtype("hidden_states", hidden_states)
    if top_k_index.numel() == 0:
        return torch.zeros(hidden_states.shape, device=hidden_states.device, dtype=hidden_states.dtype)
    num_experts = gate_up_proj.shape[0]
    sorted_ids, token_of_row, offsets, row_weights = routing_metadata(top_k_index, top_k_weights, num_experts)
    valid_rows = offsets[-1:]  # rows with a local expert; sentinels (ids >= E) sort after them
    x = hidden_states.index_select(0, token_of_row).to(gate_up_proj.dtype)
    if drop_out_of_range:
        # grouped_mm leaves the input gradient of rows past offsets[-1] unwritten: zero it (as the torch path).
        x = x.masked_fill((sorted_ids >= num_experts).unsqueeze(-1), 0.0)
    gate_up = grouped_mm(x, gate_up_proj.transpose(-2, -1), offsets)  # [S, 2I]
    act = clamped_swiglu_fused(gate_up, swiglu_limit, valid_rows=valid_rows)  # [S, I]
    out_rows = grouped_mm(act, down_proj.transpose(-2, -1), offsets)  # [S, H]
    token_rows = rows_by_token(token_of_row, top_k_index.shape[1])
    return weighted_combine_fused(out_rows, row_weights, token_rows, token_of_row, out_dtype=hidden_states.dtype,
                                  valid_rows=valid_rows)
