"""Tests of glm53flash_hf/moe_fused.py: fused clamped SwiGLU, weighted combine and the fused experts forward.

Oracles: the torch path (``glm53flash_hf.moe_ops.clamped_swiglu``, ``experts_forward_torch``, itself
tested against transformers' glm5_next in tests/test_moe.py) and float64 evaluations written here (the clamped
SwiGLU in float64; a float64 loop over experts). Values and the gradients of every differentiable input (tokens,
routing weights, ``gate_up_proj``, ``down_proj``).

CPU tests run the kernels under Triton's interpreter, in a child pytest started with ``TRITON_INTERPRET=1``
(:func:`test_interpreter_tests_in_subprocess`; the variable must be set before triton is imported and would leak
into later tests), as tests/test_mhc_fused.py does. ``TRITON_INTERPRET=1 pytest tests/test_moe_fused.py -m
interpreter`` runs them directly. The kernels have no autotuner.

Tolerances:
* fp32 vs the torch path: 1e-6 relative to the largest reference magnitude. The kernels evaluate the same fp32
  expressions; the differences are the ``exp`` implementation (numpy's under the interpreter vs ATen's, <= 1 fp32 ulp)
  and, for ``dweights``, the fp32 summation order over ``H`` (|error| <= H * 2**-24 * sum|terms|).
* bf16 vs the torch path: at most one bf16 ulp (``2**-7`` of the value, plus 1e-6 of the scale for values near zero).
  Both paths round the same fp32 quantities to bf16 after each op (the kernel by hand, to nearest even, as torch);
  an fp32 ``exp`` that differs by one ulp can move a value across a rounding boundary, which is one ulp.
* against float64: fp32 results 1e-5 relative (a few fp32 roundings per element, sums of <= 48 terms); bf16 results of
  the SwiGLU within 2 bf16 ulps (two roundings: of ``silu`` and of the product); bf16 experts outputs and gradients
  within 2**-6 of the largest value (see test_experts_bf16).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from interp import interpreted_module, run_interpreter_child

from glm53flash_hf import dispatch, moe, moe_ops  # noqa: F401  (importing moe registers the fused op)

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton; see setup.cfg [test])")


@pytest.fixture
def tm():
    """glm53flash_hf.moe_fused with interpreted kernels; one intra-op thread (tiny shapes)."""
    yield from interpreted_module("moe_fused")


@pytest.mark.interpreter
def test_interpreter_tests_in_subprocess():
    """Run this file's interpreter tests in a child pytest with TRITON_INTERPRET=1 set before triton is imported."""
    run_interpreter_child(__file__)


# ------------------------------------------------------------------------------------------------------------ helpers
def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max()).item()


def assert_rel(a, b, tol, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = rel(a, b)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"
    return err


def assert_ulps(ours, ref, what, ulps=1.0):
    """|ours - ref| <= ulps * 2**-7 * |ref| + 1e-6 * max|ref| elementwise: at most `ulps` bf16 ulps."""
    assert ours.shape == ref.shape, what
    o, r = ours.detach().double(), ref.detach().double()
    bound = ulps * 2.0**-7 * r.abs() + 1e-6 * r.abs().max()
    worst = ((o - r).abs() - bound).max().item()
    assert worst <= 0, f"{what}: exceeds {ulps} ulp by {worst:.3g} (max |diff| {(o - r).abs().max().item():.3g})"


def swiglu_f64(gate_up, limit):
    gate, up = gate_up.double().chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


def gate_up_input(rows, inter, dtype, limit, seed=0):
    """Values spread beyond the limit (both clamps active), plus exact boundary values g == L and u == +-L (torch's
    clamp passes the gradient there: the kernel must too)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * inter, generator=g) * 4.0
    if limit is not None:
        x[0, 0] = limit  # gate at the boundary
        x[0, inter] = limit  # up at the upper boundary
        x[1, inter + 1] = -limit  # up at the lower boundary
    return x.to(dtype).requires_grad_()


def routing(num_tokens, num_experts, k, seed=0, sentinel_rows=()):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(num_tokens)])
    for t, j in sentinel_rows:
        idx[t, j] = num_experts + j  # expert-parallel sentinel (distinct per token)
    w = (torch.rand(num_tokens, k, generator=g) + 0.1).requires_grad_()
    return idx, w


def experts_f64(x, idx, w, gate_up, down, limit, num_experts):
    """Float64 loop over (token, slot): y_t = sum_j w_tj * down_e @ act(gate_up_e @ x_t), e = idx_tj < E."""
    x, w, gate_up, down = (t.double() for t in (x, w, gate_up, down))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e >= num_experts:
                continue
            h = swiglu_f64((gate_up[e] @ x[t])[None], limit)[0]
            out[t] = out[t] + w[t, j] * (down[e] @ h)
    return out


def experts_inputs(tokens, hidden, inter, num_experts, k, dtype, seed=0, sentinel_rows=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.5).to(dtype).requires_grad_()
    down = (torch.randn(num_experts, hidden, inter, generator=g) * 0.3).to(dtype).requires_grad_()
    idx, w = routing(tokens, num_experts, k, seed=seed + 1, sentinel_rows=sentinel_rows)
    grad = torch.randn(tokens, hidden, generator=g).to(dtype)
    return x, idx, w, gate_up, down, grad


def run_experts(fn, x, idx, w, gate_up, down, grad, limit, **kw):
    out = fn(x, idx, w, gate_up, down, limit, **kw)
    grads = torch.autograd.grad(out, (x, w, gate_up, down), grad)
    return out.detach(), grads


# ------------------------------------------------------------------------------------------------ clamped SwiGLU
@pytest.mark.interpreter
@pytest.mark.parametrize("limit", [3.0, None])
def test_swiglu_fp32(tm, limit):
    """fp32 values and d(gate_up) vs the torch path and float64."""
    gu = gate_up_input(37, 24, torch.float32, limit)  # 37 rows: a partial row block; I = 24: a partial column block
    dact = torch.randn(37, 24, generator=torch.Generator().manual_seed(5))
    act = tm.clamped_swiglu_fused(gu, limit)
    (dgu,) = torch.autograd.grad(act, gu, dact)
    ref = moe_ops.clamped_swiglu(*gu.chunk(2, dim=-1), limit)
    (rdgu,) = torch.autograd.grad(ref, gu, dact)
    assert act.dtype == torch.float32 and dgu.dtype == torch.float32
    assert_rel(act, ref, 1e-6, "act vs torch")
    assert_rel(dgu, rdgu, 1e-6, "dgate_up vs torch")
    gu64 = gu.detach().double().requires_grad_()
    ref64 = swiglu_f64(gu64, limit)
    (dgu64,) = torch.autograd.grad(ref64, gu64, dact.double())
    assert_rel(act, ref64, 1e-5, "act vs float64")
    assert_rel(dgu, dgu64, 1e-5, "dgate_up vs float64")
    if limit is not None:  # boundary elements get the gradient, clamped ones do not (as torch)
        assert dgu[0, 0] != 0 and dgu[0, 24] != 0 and dgu[1, 25] != 0
        assert (dgu[:, :24][gu[:, :24] > limit] == 0).all() and (dgu[:, 24:][gu[:, 24:].abs() > limit] == 0).all()


@pytest.mark.interpreter
def test_swiglu_bf16(tm):
    """bf16: one rounding per op as torch, so at most one ulp from the torch path; within 2 ulps of the
    float64 SwiGLU of the same bf16 inputs (two roundings)."""
    limit = 3.0
    gu = gate_up_input(29, 40, torch.bfloat16, limit, seed=1)
    dact = torch.randn(29, 40, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    act = tm.clamped_swiglu_fused(gu, limit)
    (dgu,) = torch.autograd.grad(act, gu, dact)
    ref = moe_ops.clamped_swiglu(*gu.chunk(2, dim=-1), limit)
    (rdgu,) = torch.autograd.grad(ref, gu, dact)
    assert act.dtype == dgu.dtype == torch.bfloat16
    assert_ulps(act, ref, "act vs torch")
    assert_ulps(dgu, rdgu, "dgate_up vs torch")
    assert_ulps(act, swiglu_f64(gu.detach(), limit), "act vs float64", ulps=2.0)


@pytest.mark.interpreter
def test_swiglu_valid_rows(tm):
    """Rows at or past valid_rows are absent: zero output and gradient; NaN garbage there is never read."""
    gu = gate_up_input(10, 16, torch.float32, 2.0, seed=2)
    with torch.no_grad():
        gu[7:] = float("nan")
    n = torch.tensor([7], dtype=torch.int32)
    act = tm.clamped_swiglu_fused(gu, 2.0, valid_rows=n)
    (dgu,) = torch.autograd.grad(act, gu, torch.ones(10, 16))
    assert torch.equal(act[7:], torch.zeros(3, 16)) and torch.equal(dgu[7:], torch.zeros(3, 32))
    ref = moe_ops.clamped_swiglu(*gu[:7].chunk(2, dim=-1), 2.0)
    assert_rel(act[:7], ref, 1e-6, "valid rows")


# ------------------------------------------------------------------------------------------------- weighted combine
def combine_torch(rows, w, token_of_row, num_tokens, out_dtype):
    """The torch path's combine: fp32 weighted rows, fp32 index_add_, one cast."""
    weighted = rows * w.unsqueeze(-1)
    out = torch.zeros(num_tokens, rows.shape[1], dtype=weighted.dtype)
    out.index_add_(0, token_of_row, weighted)
    return out.to(out_dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine(tm, dtype):
    """Values, d(rows), d(weights) vs the torch combine (same expert order) and float64 (bf16: one
    rounding, <= 2**-8)."""
    g = torch.Generator().manual_seed(3)
    tokens, k, num_experts, hidden = 9, 3, 5, 40
    idx, w = routing(tokens, num_experts, k, seed=4)
    _, token_of_row, _, row_w = moe_ops.routing_metadata(idx, w, num_experts)
    token_rows = tm.rows_by_token(token_of_row, k)
    rows = torch.randn(tokens * k, hidden, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(tokens, hidden, generator=g).to(dtype)
    out = tm.weighted_combine_fused(rows, row_w, token_rows, token_of_row, out_dtype=dtype)
    drows, dw = torch.autograd.grad(out, (rows, w), grad, retain_graph=True)  # row_w's gather is shared with ref
    ref = combine_torch(rows, row_w, token_of_row, tokens, dtype)
    rdrows, rdw = torch.autograd.grad(ref, (rows, w), grad)
    assert out.dtype == drows.dtype == dtype and dw.dtype == torch.float32
    if dtype == torch.float32:
        assert_rel(out, ref, 1e-6, "out")
        assert_rel(drows, rdrows, 1e-6, "drows")
    else:
        assert_ulps(out, ref, "out")
        assert_ulps(drows, rdrows, "drows")
    assert_rel(dw, rdw, 1e-6, "dweights")
    # float64
    r64, w64 = rows.detach().double(), row_w.detach().double()
    out64 = torch.zeros(tokens, hidden, dtype=torch.float64).index_add_(0, token_of_row, r64 * w64[:, None])
    tol = 1e-5 if dtype == torch.float32 else 2.0**-8
    assert_rel(out, out64, tol, "out vs float64")


@pytest.mark.interpreter
def test_combine_valid_rows(tm):
    """Rows at or past valid_rows (expert-parallel sentinels) are never used: NaN garbage there (the unwritten rows of
    a grouped GEMM) neither reaches the output nor the gradients, and they get zero gradients."""
    tokens, k, num_experts, hidden = 6, 2, 4, 24
    idx, w = routing(tokens, num_experts, k, seed=5, sentinel_rows=((1, 1), (4, 0)))
    _, token_of_row, offsets, row_w = moe_ops.routing_metadata(idx, w, num_experts)
    token_rows = tm.rows_by_token(token_of_row, k)
    assert int(offsets[-1]) == tokens * k - 2
    rows = torch.randn(tokens * k, hidden, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        rows[-2:] = float("nan")
    rows.requires_grad_()
    out = tm.weighted_combine_fused(rows, row_w, token_rows, token_of_row, out_dtype=torch.float32,
                                    valid_rows=offsets[-1:])
    drows, dw = torch.autograd.grad(out, (rows, w), torch.ones(tokens, hidden), retain_graph=True)
    keep = (torch.arange(tokens * k) < tokens * k - 2).unsqueeze(-1)
    ref = combine_torch(rows.masked_fill(~keep, 0.0), row_w * keep[:, 0], token_of_row, tokens, torch.float32)
    assert torch.isfinite(out).all() and torch.isfinite(drows).all() and torch.isfinite(dw).all()
    assert_rel(out, ref, 1e-6, "out")
    assert torch.equal(drows[-2:], torch.zeros(2, hidden)) and dw[1, 1] == 0 and dw[4, 0] == 0


# --------------------------------------------------------------------------------------------------- experts forward
@pytest.mark.interpreter
@pytest.mark.parametrize("hidden,inter", [(32, 16), (40, 24)])  # (40, 24) fp32: 16-byte multiples; see odd sizes below
def test_experts_fp32(tm, hidden, inter):
    """Fused vs torch path and float64 loop: out, d(tokens), d(weights), d(gate_up_proj), d(down_proj)."""
    limit = 1.5  # activations of the (0.5-scaled) gate/up reach past it: clamps active
    x, idx, w, gate_up, down, grad = experts_inputs(11, hidden, inter, 6, 3, torch.float32)
    out, grads = run_experts(tm.experts_forward_fused, x, idx, w, gate_up, down, grad, limit)
    ref, ref_grads = run_experts(moe_ops.experts_forward_torch, x, idx, w, gate_up, down, grad, limit)
    assert_rel(out, ref, 1e-6, "out vs torch")
    for name, a, b in zip(("dx", "dweights", "dgate_up", "ddown"), grads, ref_grads):
        assert_rel(a, b, 1e-6, f"{name} vs torch")
    args64 = [t.detach().double().requires_grad_() for t in (x, w, gate_up, down)]
    out64 = experts_f64(args64[0], idx, args64[1], args64[2], args64[3], limit, 6)
    grads64 = torch.autograd.grad(out64, args64, grad.double())
    assert_rel(out, out64, 1e-5, "out vs float64")
    for name, a, b in zip(("dx", "dweights", "dgate_up", "ddown"), grads, grads64):
        assert_rel(a, b, 1e-5, f"{name} vs float64")


@pytest.mark.interpreter
@pytest.mark.parametrize("limit", [1.5, None])
def test_experts_bf16(tm, limit):
    """bf16: the GEMMs are the same torch calls, the kernels reproduce torch's roundings and the combine adds in the
    torch path's (CPU) order, so every bf16 tensor is within one ulp of the torch path and the
    fp32 d(weights) within 1e-6 of it (fp32 order).

    Against float64 (``limit=None`` only): max error 2**-6 of the largest value (the torch path's
    own error): each result passes through at most 4 bf16 roundings of relative size 2**-8 (GEMM output, activation,
    gradient ops, final cast). With an active clamp the float64 comparison is not meaningful: a bf16-rounded
    pre-activation a hair from the limit can sit on the other side of it than the float64 one, which switches that
    element's gradient on or off (the same for the torch path).
    """
    x, idx, w, gate_up, down, grad = experts_inputs(13, 32, 16, 6, 3, torch.bfloat16, seed=7)
    out, grads = run_experts(tm.experts_forward_fused, x, idx, w, gate_up, down, grad, limit)
    ref, ref_grads = run_experts(moe_ops.experts_forward_torch, x, idx, w, gate_up, down, grad, limit)
    assert out.dtype == torch.bfloat16 and grads[1].dtype == torch.float32
    assert_ulps(out, ref, "out vs torch")
    for name, a, b in zip(("dx", "dgate_up", "ddown"), (grads[0], grads[2], grads[3]),
                          (ref_grads[0], ref_grads[2], ref_grads[3])):
        assert a.dtype == torch.bfloat16
        assert_ulps(a, b, f"{name} vs torch")
    assert_rel(grads[1], ref_grads[1], 1e-6, "dweights vs torch")
    if limit is None:
        args64 = [t.detach().double().requires_grad_() for t in (x, w, gate_up, down)]
        out64 = experts_f64(args64[0], idx, args64[1], args64[2], args64[3], limit, 6)
        grads64 = torch.autograd.grad(out64, args64, grad.double())
        assert_rel(out, out64, 2.0**-6, "out vs float64")
        for name, a, b in zip(("dx", "dweights", "dgate_up", "ddown"), grads, grads64):
            assert_rel(a, b, 2.0**-6, f"{name} vs float64")


@pytest.mark.interpreter
def test_experts_sentinels_and_odd_sizes(tm):
    """Expert-parallel sentinels (ids >= E, drop_out_of_range=True) contribute nothing and get no gradient; sizes that
    are not 16-byte multiples go through transformers' grouped_mm fallback op, as in the torch path."""
    limit = 0.7
    x, idx, w, gate_up, down, grad = experts_inputs(7, 10, 6, 4, 2, torch.float32, seed=9,
                                                    sentinel_rows=((0, 1), (3, 0), (3, 1), (5, 0)))
    kw = dict(drop_out_of_range=True)
    out, grads = run_experts(tm.experts_forward_fused, x, idx, w, gate_up, down, grad, limit, **kw)
    ref, ref_grads = run_experts(moe_ops.experts_forward_torch, x, idx, w, gate_up, down, grad, limit, **kw)
    assert torch.equal(out[3], torch.zeros(10)) and torch.equal(grads[0][3], torch.zeros(10))
    assert grads[1][0, 1] == 0 and grads[1][5, 0] == 0
    assert_rel(out, ref, 1e-6, "out vs torch")
    for name, a, b in zip(("dx", "dweights", "dgate_up", "ddown"), grads, ref_grads):
        assert_rel(a, b, 1e-6, f"{name} vs torch")
    out64 = experts_f64(x, idx, w, gate_up, down, limit, 4)
    assert_rel(out, out64, 1e-5, "out vs float64")
    # empty batch
    empty = tm.experts_forward_fused(x[:0], idx[:0], w[:0], gate_up, down, limit)
    assert empty.shape == (0, 10)


@pytest.mark.interpreter
def test_entry_point_routes_to_fused(tm, monkeypatch):
    """The fused alternative that ``op_for`` picks for ``experts_forward_torch`` (as ``Glm53FlashExperts.forward``
    does) is ``experts_forward_fused`` when the dispatcher answers "fused" (forced here: on CPU it never does), with
    every argument passed through."""
    monkeypatch.setattr(dispatch, "choose_backend", lambda *a, **k: "fused")
    calls = []
    original = tm.experts_forward_fused
    monkeypatch.setattr(tm, "experts_forward_fused",
                        lambda *a, **kw: calls.append((len(a), sorted(kw))) or original(*a, **kw))
    x, idx, w, gate_up, down, _ = experts_inputs(5, 32, 16, 4, 2, torch.float32, seed=11)
    out = dispatch.op_for(moe_ops.experts_forward_torch, "fused", x, gate_up, down, w)(x, idx, w, gate_up, down, 1.0,
                                                                                       drop_out_of_range=False)
    # hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, swiglu_limit; drop_out_of_range by name
    assert calls == [(6, ["drop_out_of_range"])]
    monkeypatch.undo()
    assert_rel(out, moe_ops.experts_forward_torch(x, idx, w, gate_up, down, 1.0), 1e-6, "out")


@pytest.mark.interpreter
def test_entry_point_under_autocast(tm):
    """fp32 expert weights under CPU autocast (bf16): both experts ops cast them to bf16 first, so the fused path runs
    its bf16 GEMMs (bit-equal to it on bf16 copies of the weights without autocast) and agrees with the torch path
    under the same autocast as in :func:`test_experts_bf16` (one bf16 ulp: the same fp32 GEMM results rounded once to
    bf16); output and every gradient in their inputs' fp32."""
    x, idx, w, gate_up, down, grad = experts_inputs(13, 32, 16, 6, 3, torch.float32, seed=12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, ref_grads = run_experts(moe_ops.experts_forward_torch, x, idx, w, gate_up, down, grad, 1.5)
        out, grads = run_experts(tm.experts_forward_fused, x, idx, w, gate_up, down, grad, 1.5)
    bf16_weights = tm.experts_forward_fused(x, idx, w, gate_up.bfloat16(), down.bfloat16(), 1.5)
    assert torch.equal(out, bf16_weights.detach())
    assert out.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    assert_ulps(out, ref, "out vs torch under autocast")
    for name, a, b in zip(("dx", "dweights", "dgate_up", "ddown"), grads, ref_grads):
        assert_ulps(a, b, f"{name} vs torch under autocast")


@pytest.mark.interpreter
def test_errors(tm):
    gu = torch.randn(4, 8)
    with pytest.raises(ValueError, match="even last dim"):
        tm.clamped_swiglu_fused(gu[:, :7], 1.0)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        tm.clamped_swiglu_fused(gu.double(), 1.0)
    with pytest.raises(ValueError, match="unit stride"):
        tm.clamped_swiglu_fused(torch.randn(8, 4).t(), 1.0)
    with pytest.raises(ValueError, match="limit"):
        tm.clamped_swiglu_fused(gu, -1.0)
    with pytest.raises(ValueError, match="valid_rows"):
        tm.clamped_swiglu_fused(gu, 1.0, valid_rows=torch.tensor([2]))
    x, idx, w, gate_up, down, _ = experts_inputs(3, 32, 16, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="do not fit hidden size"):
        tm.experts_forward_fused(x[:, :16], idx, w, gate_up, down, 1.0)
    with pytest.raises(ValueError, match="twice"):
        tm.experts_forward_fused(x, idx, w, gate_up[:, :30], down, 1.0)
    with pytest.raises(ValueError, match="dtypes differ"):
        tm.experts_forward_fused(x, idx, w, gate_up, down.bfloat16(), 1.0)
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        moe_ops.routing_metadata(idx, w[:, :1], 4)
    with pytest.raises(ValueError, match="rows per token"):
        tm.rows_by_token(torch.zeros(5, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="row_weights"):
        tm.weighted_combine_fused(torch.randn(6, 8), torch.randn(5), idx, torch.zeros(6, dtype=torch.long),
                                  out_dtype=torch.float32)


def test_rows_by_token():
    """Each token's rows in increasing order (= increasing expert id), from the expert-sorted rows (torch only)."""
    from glm53flash_hf import moe_fused

    idx, w = routing(7, 6, 3, seed=12, sentinel_rows=((2, 1),))
    sorted_ids, token_of_row, _, _ = moe_ops.routing_metadata(idx, w, 6)
    token_rows = moe_fused.rows_by_token(token_of_row, 3)
    assert token_rows.dtype == torch.int32 and token_rows.shape == (7, 3)
    for t in range(7):
        rows = token_rows[t].long()
        assert torch.equal(token_of_row[rows], torch.full((3,), t)) and bool((rows.diff() > 0).all())
        assert torch.equal(sorted_ids[rows], idx[t].sort().values)


# ---------------------------------------------------------------------------------------------- custom ops, compile
OPCHECK_PASSED = {name: "SUCCESS" for name in ("test_schema", "test_autograd_registration", "test_faketensor",
                                                "test_aot_dispatch_dynamic")}


def opcheck(op, *args):
    """``torch.library.opcheck`` with its default tests (schema, autograd registration, fake tensor,
    aot_dispatch_dynamic), which raises on a failure; asserts that all four ran."""
    assert torch.library.opcheck(op, args) == OPCHECK_PASSED


@pytest.mark.interpreter
@pytest.mark.parametrize("limit", [3.0, None])
def test_opcheck_swiglu(tm, limit):
    """glm53flash::clamped_swiglu_fwd (differentiable in gate_up; the formula calls clamped_swiglu_bwd) and
    clamped_swiglu_bwd, with one absent row."""
    gate_up = gate_up_input(5, 16, torch.float32, limit, seed=40)
    valid = torch.tensor([4], dtype=torch.int32)
    opcheck(torch.ops.glm53flash.clamped_swiglu_fwd, gate_up, valid, limit)
    dact = torch.randn(5, 16, generator=torch.Generator().manual_seed(41))
    opcheck(torch.ops.glm53flash.clamped_swiglu_bwd, gate_up.detach(), dact, valid, limit)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_combine(tm, dtype):
    """glm53flash::weighted_combine_fwd (differentiable in rows and row_weights; the formula calls
    weighted_combine_bwd) and weighted_combine_bwd."""
    tokens, k, hidden = 4, 2, 24
    idx, w = routing(tokens, 5, k, seed=42)
    _, token_of_row, offsets, row_w = moe_ops.routing_metadata(idx, w, 5)
    token_rows = tm.rows_by_token(token_of_row, k)
    rows = torch.randn(tokens * k, hidden, generator=torch.Generator().manual_seed(43)).to(dtype).requires_grad_()
    row_w = row_w.detach().requires_grad_()
    opcheck(torch.ops.glm53flash.weighted_combine_fwd, rows, row_w, token_rows, token_of_row, offsets[-1:], dtype)
    grad = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(44)).to(dtype)
    opcheck(torch.ops.glm53flash.weighted_combine_bwd, grad, rows.detach(), row_w.detach(), token_of_row, offsets[-1:])


@pytest.mark.interpreter
def test_compile_fullgraph_equals_eager(tm):
    """``torch.compile(fullgraph=True)`` (inductor) of experts_forward_fused (routing metadata, grouped GEMMs and the
    two kernels' ops): no graph break, and the compiled function equals the eager one: values and the gradients of
    the tokens, the routing weights and both expert weights within 2e-6 relative (the grouped GEMMs and the routing
    gather/scatter are compiled by inductor, which sums in another fp32 order)."""
    x, idx, w, gate_up, down, grad = experts_inputs(7, 32, 16, 4, 2, torch.float32, seed=45)

    def experts(x, w, gate_up, down):
        return tm.experts_forward_fused(x, idx, w, gate_up, down, 1.5)

    torch._dynamo.reset()
    compiled = torch.compile(experts, fullgraph=True)
    results = []
    for fn in (experts, compiled):
        out = fn(x, w, gate_up, down)
        results.append((out.detach(), torch.autograd.grad(out, (x, w, gate_up, down), grad)))
    (out, grads), (cout, cgrads) = results
    assert_rel(cout, out, 2e-6, "compiled out")
    for name, a, b in zip(("dx", "dweights", "dgate_up", "ddown"), cgrads, grads):
        assert_rel(a, b, 2e-6, f"compiled {name}")


# ------------------------------------------------------------------------------------------------------------ dispatch
def test_dispatch_never_fused_on_cpu():
    """CPU tensors get the torch path even with triton installed; the probe names the reason."""
    from glm53flash_hf import moe_fused

    x, gate_up, down, w = torch.zeros(2, 32), torch.zeros(4, 32, 32), torch.zeros(4, 32, 16), torch.zeros(2, 2)
    assert dispatch.choose_backend("moe", "auto", x, gate_up, down, w) == "torch"
    assert moe_fused.fused_moe_available(x, gate_up, down, w) == (False, "the tensors are not on a CUDA device")
    assert moe_fused.fused_moe_available() == (False, "no tensors given")


@pytest.mark.interpreter
def test_frames_from_the_decoder_layer_to_the_fused_op(tm):
    """A model prefill on the fused MoE path: from the decoder layer's forward to the fused experts op, 3 frames of the
    package's own code (the MoE block, transformers' experts module, the op); the op composes torch's grouped GEMMs
    with the SwiGLU and combine kernels, each one more frame (its entry) above its custom-op body."""
    from tiny import frames_below_decoder_layer

    frames = frames_below_decoder_layer(lambda c: c.co_name == "_swiglu_fwd_impl", "moe")
    print(" -> ".join(frames))
    assert frames == ["Glm53FlashMoE.forward", "Glm53FlashExperts.forward", "experts_forward_fused",
                      "clamped_swiglu_fused", "_swiglu_fwd_impl"], frames
