"""Fused MoE pieces for GLM-5.3-Flash's routed experts: Triton clamped-SwiGLU and weighted-combine kernels with
custom autograd, around torch's grouped GEMM.

Our own kernels (liger-kernel's ``fused_moe``, xtuner and transformers were read for facts only). The maths and the
rounding are those of the torch path :func:`glm53flash_hf.moe.grouped_experts_forward` (the oracle of
``tests/test_triton_moe.py``), itself equal to transformers' ``Glm5NextTextExperts`` (model-spec §8, §13 item 14;
kernels.md §5).

Pipeline of :func:`fused_experts_forward` (``T`` tokens, ``k`` experts each, ``S = T * k`` (token, expert) rows,
``E`` experts, ``H`` hidden, ``I`` expert width)
----------------------------------------------------------------------------------------------------------------
1. Routing metadata, built once, static shapes, no host sync (the torch path's recipe): the ``S`` pairs sorted by
   expert id, each row's token, the int32 cumulative group offsets ``[E]`` (``searchsorted``), the rows' routing
   weights, and, new here, each token's ``k`` rows in increasing row (= expert) order ``[T, k]``.
2. One gather of the token rows, then ``torch`` grouped GEMM ``[S, H] x [E, H, 2I] -> [S, 2I]``
   (:func:`glm53flash_hf.moe._grouped_mm`, the same call as the torch path).
3. :func:`clamped_swiglu_fused` (Triton, one kernel each way): ``act = silu(min(gate, L)) * clamp(up, -L, L)``
   ``[S, 2I] -> [S, I]``. The torch path needs 4 elementwise kernels forward (2 clamps, silu, mul) and keeps the
   silu output and clamp masks for backward; this kernel keeps only ``gate_up`` and recomputes.
4. ``torch`` grouped GEMM ``[S, I] x [E, I, H] -> [S, H]``.
5. :func:`weighted_combine_fused` (Triton, one kernel each way): ``out[t] = sum_j w[r_tj] * rows[r_tj]`` over the
   token's ``k`` rows in expert order, in fp32, rounded once to the output dtype. The torch path materialises the
   fp32 ``[S, H]`` weighted rows, a zeroed fp32 ``[T, H]`` buffer and an ``index_add_`` (atomics on CUDA, so its
   summation order varies run to run); this kernel reads each row once, needs no atomics (deterministic) and writes
   ``[T, H]`` once in the output dtype. Backward: ``drows[r] = rd(g[t_r] * w[r])``, ``dw[r] = sum_h g[t_r] * rows[r]``
   (fp32), one pass.

The routing weight multiplies the down-projection output (as in the reference), so fusing it into the activation
(before the second GEMM) would change the rounding; it is fused into the combine instead.

Rounding (what makes bf16 results equal the torch path's): ``rd`` rounds fp32 to the activation dtype to nearest
even. Forward ``act = rd(rd(silu(gc)) * uc)``; backward ``ds = rd(da * uc)``, ``duc = rd(da * rd(silu(gc)))``,
``dgc = rd(ds * sig * (1 + gc * (1 - sig)))`` -- exactly torch's bf16 op sequence (each bf16 op computes in fp32 and
rounds once; ``silu_backward`` is ``dy * sig * (1 + x * (1 - sig))``). Clamp gradients pass where ``gate <= L`` and
``-L <= up <= L`` (torch's ``clamp`` backward, boundary included). The only expected differences from the torch path
are fp32 ``exp`` and division implementations (Triton's approximate GPU instructions vs ATen's, a few fp32 ulps,
visible after bf16 rounding in about 1 element in 2**15) and the fp32 summation order of the combine (the torch
path's order on CPU; CUDA's ``index_add_`` has none).

Expert-parallel sentinels (ids ``>= E`` with ``drop_out_of_range=True``) sort to the end; rows at or past the last
group offset are treated as absent by both kernels (zero activation, zero contribution, zero gradients), so the
grouped GEMMs' unwritten rows are never read.

Supported: CUDA tensors (CPU only under ``TRITON_INTERPRET=1``, for the tests), activations and weights in fp32,
bf16 or fp16 (one dtype for both weights), any ``H``/``I`` (blocks are masked). Routing weights are used in fp32.
``triton`` is an optional import: without it ``TRITON_AVAILABLE`` is False, :func:`fused_moe_available` says so and
the fused functions raise ``RuntimeError``.
"""

from __future__ import annotations

import os

import torch

try:  # optional dependency: the package must import without triton (remote-code check_imports exempts try-imports)
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - exercised on installs without triton
    triton = None
    tl = None
    TRITON_AVAILABLE = False

from .dispatch import local_tensor

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

__all__ = [
    "TRITON_AVAILABLE",
    "clamped_swiglu_fused",
    "fused_experts_forward",
    "fused_moe_available",
    "routing_metadata",
    "weighted_combine_fused",
]


def fused_moe_available(*tensors: torch.Tensor) -> tuple[bool, str]:
    """Availability probe registered as ``dispatch.FUSED_AVAILABILITY["moe"]``.

    Args:
        tensors: the call's tensors, as :func:`glm53flash_hf.moe.grouped_experts_forward` passes them:
            ``(hidden_states [T, H], gate_up_proj [E, 2I, H], down_proj [E, H, I], top_k_weights [T, k])``.
            Integer tensors are ignored; DTensor parameters are judged by their dtype and device.

    Returns:
        ``(True, "")`` when the fused path can run on them, else ``(False, reason)``: triton not importable, no
        tensors, a tensor not on CUDA, a floating dtype other than fp32/bf16/fp16, or expert weights of two dtypes.
    """
    if not TRITON_AVAILABLE:
        return False, "triton is not installed"
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not tensors:
        return False, "no tensors given"
    if not all(t.is_cuda for t in tensors):
        return False, "the tensors are not on a CUDA device"
    floats = [t for t in tensors if t.dtype.is_floating_point]
    bad = sorted({str(t.dtype) for t in floats if t.dtype not in SUPPORTED_DTYPES})
    if bad:
        return False, f"unsupported dtype(s) {bad} (fused MoE supports float32, bfloat16, float16)"
    weights = [t for t in floats if t.dim() == 3]
    if len({t.dtype for t in weights}) > 1:
        return False, f"expert weights of different dtypes {sorted(str(t.dtype) for t in weights)}"
    return True, ""


def _require_triton() -> None:
    if not TRITON_AVAILABLE:
        raise RuntimeError("glm53flash_hf.triton_moe needs triton (pip install triton); use the torch path instead")


def _check_device(name: str, t: torch.Tensor) -> None:
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{name} must be a CUDA tensor for the Triton kernels (got device {t.device})")


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16; got dtype {t.dtype}")


def _p2(x: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, int(x) - 1).bit_length())


_TL_DTYPES: dict = {}
if TRITON_AVAILABLE:
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ============================================================================================================ kernels
if TRITON_AVAILABLE:

    @triton.jit
    def _round(x, DT: tl.constexpr):
        """fp32 ``x`` rounded to the nearest ``DT`` value (ties to even), returned as fp32.

        bf16 is rounded on the bit pattern because Triton's interpreter truncates in ``.to(tl.bfloat16)`` while the
        GPU rounds to nearest even; doing it by hand gives one rounding rule on both. A NaN becomes a quiet NaN (one
        with only low payload bits would otherwise become inf in a later bf16 cast)."""
        if DT == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            lsb = (bits >> 16) & 1
            rounded = (bits + 0x7FFF + lsb) & 0xFFFF0000
            return tl.where(x != x, bits | 0x7FC00000, rounded).to(tl.float32, bitcast=True)
        elif DT == tl.float16:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x

    @triton.jit
    def _swiglu_fwd_kernel(
        gu_ptr, act_ptr, nvalid_ptr,
        n_rows, inter, stride_gu, stride_act,
        limit, limit_value,
        HAS_LIMIT: tl.constexpr, DT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """act[r, c] = rd(rd(silu(min(g, L))) * clamp(u, -L, L)), g = gu[r, c], u = gu[r, I + c]; rows >= nvalid
        give 0."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        nvalid = tl.load(nvalid_ptr)
        col_ok = cols < inter
        store_mask = (rows < n_rows)[:, None] & col_ok[None, :]
        load_mask = (rows < nvalid)[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        src = gu_ptr + rows64[:, None] * stride_gu + cols[None, :]
        g = tl.load(src, mask=load_mask, other=0.0).to(tl.float32)
        u = tl.load(src + inter, mask=load_mask, other=0.0).to(tl.float32)
        if HAS_LIMIT:  # tl.where keeps NaN as torch.clamp does
            g = tl.where(g > limit, limit_value, g)
            u = tl.where(u > limit, limit_value, tl.where(u < -limit, -limit_value, u))
        s = _round(g / (1.0 + tl.exp(-g)), DT)
        a = _round(s * u, DT)
        tl.store(act_ptr + rows64[:, None] * stride_act + cols[None, :], a.to(DT), mask=store_mask)

    @triton.jit
    def _swiglu_bwd_kernel(
        gu_ptr, dact_ptr, dgu_ptr, nvalid_ptr,
        n_rows, inter, stride_gu, stride_dact, stride_dgu,
        limit, limit_value,
        HAS_LIMIT: tl.constexpr, DT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """dgu[r, :I] = dgate, dgu[r, I:] = dup for the forward above (torch's bf16 op sequence, see the module doc)."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        nvalid = tl.load(nvalid_ptr)
        col_ok = cols < inter
        store_mask = (rows < n_rows)[:, None] & col_ok[None, :]
        load_mask = (rows < nvalid)[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        src = gu_ptr + rows64[:, None] * stride_gu + cols[None, :]
        g = tl.load(src, mask=load_mask, other=0.0).to(tl.float32)
        u = tl.load(src + inter, mask=load_mask, other=0.0).to(tl.float32)
        da = tl.load(dact_ptr + rows64[:, None] * stride_dact + cols[None, :], mask=load_mask, other=0.0)
        da = da.to(tl.float32)
        gc = g
        uc = u
        if HAS_LIMIT:
            gc = tl.where(g > limit, limit_value, g)
            uc = tl.where(u > limit, limit_value, tl.where(u < -limit, -limit_value, u))
        e = tl.exp(-gc)
        s = _round(gc / (1.0 + e), DT)
        sig = 1.0 / (1.0 + e)
        ds = _round(da * uc, DT)
        duc = _round(da * s, DT)
        dgc = _round(ds * sig * (1.0 + gc * (1.0 - sig)), DT)
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
        """out[t, h] = rd(sum_j w[r_j] * rows[r_j, h]) over the token's K rows r_j = order[t, j] (fp32 sum in j order);
        rows >= nvalid contribute nothing."""
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
        tl.store(out_ptr + t * stride_out + cols, _round(acc, OUT_DT).to(OUT_DT), mask=col_ok)

    @triton.jit
    def _combine_bwd_kernel(
        g_ptr, rows_ptr, w_ptr, token_ptr, nvalid_ptr, drows_ptr, dw_ptr,
        hidden, stride_g, stride_rows, stride_drows,
        ROW_DT: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        """For row r of token t: drows[r] = rd(g[t] * w[r]) (row dtype), dw[r] = sum_h g[t, h] * rows[r, h] (fp32);
        rows >= nvalid get zeros."""
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
            tl.store(drows_ptr + r * stride_drows + cols, _round(g * w, ROW_DT).to(ROW_DT), mask=col_ok)
            acc += g * v
        tl.store(dw_ptr + r, tl.sum(acc, axis=0))


# ======================================================================================================= launchers
def _swiglu_blocks(inter: int) -> tuple[int, int]:
    block_c = min(1024, _p2(inter, 16))
    return max(1, 2048 // block_c), block_c


def _limits(limit: float | None, dtype: torch.dtype) -> tuple[bool, float, float]:
    """(has_limit, compare value, clamped value): torch's ``clamp`` compares with ``limit`` and stores it rounded to
    the tensor's dtype (10.0, the release value, is exact in every supported dtype)."""
    if limit is None:
        return False, 0.0, 0.0
    return True, float(limit), float(torch.tensor(float(limit), dtype=torch.float32).to(dtype).item())


class _ClampedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, limit, nvalid):
        rows, two_i = gate_up.shape
        inter = two_i // 2
        has_limit, lim, lim_value = _limits(limit, gate_up.dtype)
        act = torch.empty(rows, inter, device=gate_up.device, dtype=gate_up.dtype)
        if rows and inter:
            block_r, block_c = _swiglu_blocks(inter)
            grid = (triton.cdiv(rows, block_r), triton.cdiv(inter, block_c))
            _swiglu_fwd_kernel[grid](
                gu_ptr=gate_up, act_ptr=act, nvalid_ptr=nvalid,
                n_rows=rows, inter=inter, stride_gu=gate_up.stride(0), stride_act=act.stride(0),
                limit=lim, limit_value=lim_value,
                HAS_LIMIT=has_limit, DT=_TL_DTYPES[gate_up.dtype], BLOCK_R=block_r, BLOCK_C=block_c,
            )
        ctx.save_for_backward(gate_up, nvalid)
        ctx.limit = limit
        return act

    @staticmethod
    def backward(ctx, dact):
        gate_up, nvalid = ctx.saved_tensors
        rows, two_i = gate_up.shape
        inter = two_i // 2
        dact = dact.to(gate_up.dtype)
        if dact.stride(-1) != 1:
            dact = dact.contiguous()
        has_limit, lim, lim_value = _limits(ctx.limit, gate_up.dtype)
        dgu = torch.empty_like(gate_up, memory_format=torch.contiguous_format)
        if rows and inter:
            block_r, block_c = _swiglu_blocks(inter)
            grid = (triton.cdiv(rows, block_r), triton.cdiv(inter, block_c))
            _swiglu_bwd_kernel[grid](
                gu_ptr=gate_up, dact_ptr=dact, dgu_ptr=dgu, nvalid_ptr=nvalid,
                n_rows=rows, inter=inter, stride_gu=gate_up.stride(0), stride_dact=dact.stride(0),
                stride_dgu=dgu.stride(0), limit=lim, limit_value=lim_value,
                HAS_LIMIT=has_limit, DT=_TL_DTYPES[gate_up.dtype], BLOCK_R=block_r, BLOCK_C=block_c,
            )
        return dgu, None, None


class _WeightedCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, row_weights, token_rows, token_of_row, nvalid, out_dtype):
        num_tokens, k = token_rows.shape
        hidden = rows.shape[1]
        w32 = row_weights.to(torch.float32).contiguous()
        out = torch.empty(num_tokens, hidden, device=rows.device, dtype=out_dtype)
        if num_tokens and hidden:
            block_h = min(1024, _p2(hidden, 16))
            _combine_fwd_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
                rows_ptr=rows, w_ptr=w32, order_ptr=token_rows, nvalid_ptr=nvalid, out_ptr=out,
                hidden=hidden, stride_rows=rows.stride(0), stride_out=out.stride(0),
                K=k, OUT_DT=_TL_DTYPES[out_dtype], BLOCK_H=block_h,
            )
        ctx.save_for_backward(rows, w32, token_of_row, nvalid)
        ctx.weight_dtype = row_weights.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, w32, token_of_row, nvalid = ctx.saved_tensors
        num_rows, hidden = rows.shape
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        drows = torch.empty(num_rows, hidden, device=rows.device, dtype=rows.dtype)
        dw = torch.empty(num_rows, device=rows.device, dtype=torch.float32)
        if num_rows and hidden:
            block_h = min(1024, _p2(hidden, 16))
            _combine_bwd_kernel[(num_rows,)](
                g_ptr=grad, rows_ptr=rows, w_ptr=w32, token_ptr=token_of_row, nvalid_ptr=nvalid,
                drows_ptr=drows, dw_ptr=dw, hidden=hidden, stride_g=grad.stride(0), stride_rows=rows.stride(0),
                stride_drows=drows.stride(0), ROW_DT=_TL_DTYPES[rows.dtype], BLOCK_H=block_h,
            )
        return drows, dw.to(ctx.weight_dtype), None, None, None, None


# ====================================================================================================== public API
def clamped_swiglu_fused(gate_up: torch.Tensor, limit: float | None, *, valid_rows: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """Clamped SwiGLU of the grouped gate/up projection, Triton forward and backward.

    ``act = silu(min(gate, limit)) * clamp(up, -limit, limit)`` with ``gate = gate_up[:, :I]``,
    ``up = gate_up[:, I:]`` (gate columns first, the layout of ``experts.gate_up_proj``). Equal to
    :func:`glm53flash_hf.moe.clamped_swiglu` on ``gate_up.chunk(2, -1)``, rounding included (module docstring).
    Source: model-spec §8; ``Glm5NextTextExperts._apply_gate``.

    Args:
        gate_up: ``[S, 2I]`` fp32/bf16/fp16, unit stride in the last dim (any row stride), CUDA (or CPU under
            ``TRITON_INTERPRET=1``).
        limit: ``config.swiglu_limit`` (10.0 in the release); ``None`` = plain SwiGLU.
        valid_rows: optional int32 device tensor with one element ``n``: rows ``>= n`` are absent (activation 0, no
            gradient; their input is never read). ``None``: all rows.

    Returns:
        ``[S, I]`` in ``gate_up.dtype``, differentiable w.r.t. ``gate_up``.

    Raises:
        RuntimeError: triton is not installed.
        ValueError: ``gate_up`` not 2-D with an even last dim, an unsupported dtype or device, a non-unit last
            stride, a negative ``limit``, or a ``valid_rows`` that is not a one-element int32 tensor on that device.
    """
    _require_triton()
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [S, 2I] with an even last dim; got shape {tuple(gate_up.shape)}")
    _check_dtype("gate_up", gate_up)
    _check_device("gate_up", gate_up)
    if gate_up.shape[1] and gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must have unit stride in its last dim; got strides {gate_up.stride()}")
    if limit is not None and not float(limit) >= 0:
        raise ValueError(f"limit must be None or >= 0; got limit={limit}")
    if valid_rows is None:
        valid_rows = torch.full((1,), gate_up.shape[0], dtype=torch.int32, device=gate_up.device)
    elif valid_rows.numel() != 1 or valid_rows.dtype != torch.int32 or valid_rows.device != gate_up.device:
        raise ValueError(
            f"valid_rows must be a one-element int32 tensor on {gate_up.device}; got {valid_rows.numel()} "
            f"element(s) of {valid_rows.dtype} on {valid_rows.device}"
        )
    return _ClampedSwiGLU.apply(gate_up, limit, valid_rows)


def weighted_combine_fused(
    rows: torch.Tensor,
    row_weights: torch.Tensor,
    token_rows: torch.Tensor,
    token_of_row: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    valid_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted sum of each token's expert rows, Triton forward and backward (deterministic, no atomics).

    ``out[t] = sum_j row_weights[r] * rows[r]`` for ``r = token_rows[t, j]``, ``j = 0..k-1`` in that order, in fp32,
    rounded once to ``out_dtype``. Equal to the torch path's ``(rows * w[:, None])`` + fp32 ``index_add_`` + cast
    (summation order aside). Source: ``Glm5NextTextExperts.forward`` (weight applied after the down projection).

    Args:
        rows: ``[S, H]`` down-projection outputs (fp32/bf16/fp16), unit last stride.
        row_weights: ``[S]`` routing weight of each row (any float dtype; used in fp32); differentiable.
        token_rows: integer ``[T, k]`` row ids of each token (from :func:`routing_metadata`).
        token_of_row: integer ``[S]`` token of each row (the inverse map, used by the backward).
        out_dtype: dtype of the result (fp32/bf16/fp16).
        valid_rows: optional one-element int32 tensor ``n``: rows ``>= n`` are absent (contribute 0, get 0 gradient).

    Returns:
        ``[T, H]`` in ``out_dtype``, differentiable w.r.t. ``rows`` and ``row_weights`` (``drows`` in ``rows.dtype``,
        ``dw`` accumulated in fp32 and cast to ``row_weights.dtype``).

    Raises:
        RuntimeError: triton is not installed.
        ValueError: shapes that do not fit, unsupported dtypes or devices, a non-unit last stride.
    """
    _require_triton()
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
    _check_dtype("rows", rows)
    if out_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16; got out_dtype={out_dtype}")
    for name, t in (("rows", rows), ("row_weights", row_weights), ("token_rows", token_rows),
                    ("token_of_row", token_of_row)):
        _check_device(name, t)
        if t.device != rows.device:
            raise ValueError(f"{name} is on {t.device} but rows is on {rows.device}")
    if rows.shape[1] and rows.stride(1) != 1:
        raise ValueError(f"rows must have unit stride in its last dim; got strides {rows.stride()}")
    if valid_rows is None:
        valid_rows = torch.full((1,), num_rows, dtype=torch.int32, device=rows.device)
    elif valid_rows.numel() != 1 or valid_rows.dtype != torch.int32 or valid_rows.device != rows.device:
        raise ValueError(f"valid_rows must be a one-element int32 tensor on {rows.device}")
    return _WeightedCombine.apply(rows, row_weights, token_rows.contiguous(), token_of_row.contiguous(), valid_rows,
                                  out_dtype)


def routing_metadata(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int):
    """Routing metadata of one MoE call, built once (sort by expert, no host sync, static shapes).

    Same recipe as the torch path of :func:`glm53flash_hf.moe.grouped_experts_forward`, plus each token's rows.

    Args:
        top_k_index: integer ``[T, k]`` expert ids (``>= num_experts`` = expert-parallel sentinels, sorted last).
        top_k_weights: ``[T, k]`` routing weights (differentiable).
        num_experts: ``E``.

    Returns:
        ``(sorted_ids [S], token_of_row int64 [S], offsets int32 [E], row_weights [S], token_rows int32 [T, k])``:
        rows sorted by expert id; ``offsets[e]`` = rows with id ``<= e`` (so ``offsets[-1]`` counts the rows that
        have a local expert); ``token_rows[t]`` = token ``t``'s rows in increasing order (= increasing expert id).

    Raises:
        ValueError: index/weight shapes differ or are not ``[T, k]``; ``num_experts < 1``.
    """
    if top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape:
        raise ValueError(f"top_k_index and top_k_weights must both be [T, k]; got {tuple(top_k_index.shape)} and "
                         f"{tuple(top_k_weights.shape)}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1; got num_experts={num_experts}")
    num_tokens, k = top_k_index.shape
    device = top_k_index.device
    sorted_ids, order = torch.sort(top_k_index.reshape(-1))
    token_of_row = torch.div(order, k, rounding_mode="floor")
    expert_range = torch.arange(num_experts, device=device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, expert_range, right=True).to(torch.int32)
    row_weights = top_k_weights.reshape(-1).index_select(0, order)
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=device, dtype=order.dtype)
    token_rows = position.view(num_tokens, k).sort(dim=1).values.to(torch.int32)
    return sorted_ids, token_of_row, offsets, row_weights, token_rows


def fused_experts_forward(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    swiglu_limit: float | None,
    *,
    drop_out_of_range: bool = False,
) -> torch.Tensor:
    """Routed experts, fused path: ``y_t = sum_j w_tj * down_e(clamped_swiglu(gate_up_e(x_t)))``, ``e = idx_tj``.

    Same contract as :func:`glm53flash_hf.moe.grouped_experts_forward` (which calls this for ``backend`` "fused" /
    "auto" on CUDA tensors); the pipeline is in the module docstring. Gradients flow to ``hidden_states``,
    ``top_k_weights``, ``gate_up_proj`` and ``down_proj``. Parameters arriving as DTensors are unwrapped with
    :func:`glm53flash_hf.dispatch.local_tensor` (replicated only).

    Args:
        hidden_states: ``[T, H]`` (cast to the weights' dtype for the GEMMs).
        top_k_index: integer ``[T, k]``, ids distinct per token, in ``[0, E)`` (ids ``>= E`` only with
            ``drop_out_of_range``).
        top_k_weights: ``[T, k]`` routing weights (fp32 from the router).
        gate_up_proj: ``[E, 2I, H]``, gate rows first. down_proj: ``[E, H, I]``; one dtype (fp32/bf16/fp16).
        swiglu_limit: clamp limit (``None``: plain SwiGLU).
        drop_out_of_range: ids ``>= E`` contribute zero (expert-parallel sentinels).

    Returns:
        ``[T, H]`` in ``hidden_states.dtype``; each token's k contributions summed in fp32 and rounded once.

    Raises:
        RuntimeError: triton is not installed.
        ValueError: shapes that do not fit, unsupported dtypes or devices, a sharded DTensor weight.
    """
    _require_triton()
    gate_up_proj = local_tensor(gate_up_proj, "experts.gate_up_proj")
    down_proj = local_tensor(down_proj, "experts.down_proj")
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [T, H]; got shape {tuple(hidden_states.shape)}")
    num_tokens, hidden = hidden_states.shape
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(f"gate_up_proj and down_proj must be 3-D; got {tuple(gate_up_proj.shape)} and "
                         f"{tuple(down_proj.shape)}")
    num_experts = gate_up_proj.shape[0]
    if gate_up_proj.shape[-1] != hidden or down_proj.shape[:2] != (num_experts, hidden):
        raise ValueError(f"expert weights do not fit hidden size {hidden}: gate_up_proj {tuple(gate_up_proj.shape)}, "
                         f"down_proj {tuple(down_proj.shape)}")
    if gate_up_proj.shape[1] != 2 * down_proj.shape[2]:
        raise ValueError(f"gate_up_proj rows ({gate_up_proj.shape[1]}) must be twice down_proj's intermediate size "
                         f"({down_proj.shape[2]})")
    if gate_up_proj.dtype != down_proj.dtype:
        raise ValueError(f"gate_up_proj ({gate_up_proj.dtype}) and down_proj ({down_proj.dtype}) dtypes differ")
    _check_dtype("gate_up_proj", gate_up_proj)
    _check_dtype("hidden_states", hidden_states)
    if top_k_index.dim() != 2 or top_k_index.shape[0] != num_tokens:
        raise ValueError(f"top_k_index must be [T={num_tokens}, k]; got {tuple(top_k_index.shape)}")
    if top_k_index.numel() == 0:
        return torch.zeros(num_tokens, hidden, device=hidden_states.device, dtype=hidden_states.dtype)
    from .moe import _grouped_mm  # moe imports this module lazily (at call time): no import cycle

    sorted_ids, token_of_row, offsets, row_weights, token_rows = routing_metadata(
        top_k_index, top_k_weights, num_experts
    )
    valid_rows = offsets[-1:]  # rows with a local expert; sentinels (ids >= E) sort after them
    x = hidden_states.index_select(0, token_of_row).to(gate_up_proj.dtype)
    if drop_out_of_range:
        # grouped_mm leaves the input gradient of rows past offsets[-1] unwritten: zero it (as the torch path).
        x = x.masked_fill((sorted_ids >= num_experts).unsqueeze(-1), 0.0)
    gate_up = _grouped_mm(x, gate_up_proj.transpose(-2, -1), offsets)  # [S, 2I]
    act = clamped_swiglu_fused(gate_up, swiglu_limit, valid_rows=valid_rows)  # [S, I]
    out_rows = _grouped_mm(act, down_proj.transpose(-2, -1), offsets)  # [S, H]
    return weighted_combine_fused(out_rows, row_weights, token_rows, token_of_row, out_dtype=hidden_states.dtype,
                                  valid_rows=valid_rows)
