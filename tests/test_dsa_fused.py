"""Tests of glm53flash_hf/dsa_fused.py: the fused sparse MLA kernels (Triton forward + backward, custom autograd).

Oracles: ``glm53flash_hf.dsa_ops.sparse_mla_torch`` (itself tested against a dense float64 evaluation and, through the
attention module, against transformers' glm5_next in tests/test_dsa.py) and an independent float64 evaluation
written here (:func:`dense64`: a dense ``[B, S, H, S_kv]`` softmax over a multiplicity mask, differentiated by torch
autograd). Values, natural-log LSE and the gradients of ``q_abs`` and ``latent`` through both ``out`` and ``lse``.

CPU tests run the kernels under Triton's interpreter in a child pytest process (``TRITON_INTERPRET=1`` must be set
before triton is imported; see tests/interp.py), with one torch thread and tiny shapes; in this process they
are skipped with that reason. ``TRITON_INTERPRET=1 pytest tests/test_dsa_fused.py -m interpreter`` runs them
directly.

Tolerances:

* fp32: 1e-5 relative to the largest reference magnitude, for the torch path and float64 alike: both paths compute
  the same fp32 products; only the summation order and the online-softmax rescaling differ, a few fp32 ulps (6e-8
  each) per sum of at most a few dozen terms. LSE: ``1e-5 * (1 + |lse|)`` absolute.
* bf16 / fp16: elementwise first-order rounding bounds with unit roundoff ``u`` (``2**-8`` / ``2**-11``), derived
  from where the kernel rounds (module docstring of dsa_fused) and evaluated in float64 from the oracle's own
  quantities (:func:`rounding_bounds`): ``out`` rounds each probability once (``u * sum_w P_w |c_w|``) and the
  result once (``u |out|``); ``Delta`` uses the rounded output; ``dq`` rounds each ``ds`` once and the result once;
  ``dlatent`` rounds each ``ds`` and ``p`` once and the fp32 sum once. The bounds carry a factor 1.01 (the O(u^2)
  cross terms are at most ``u`` = 0.4% of a first-order term; fp32 rounding is 2**-24) and ``1e-6 * max|ref|``
  for fp32 noise around zeros. Against the torch path the torch path's own rounding is added: one rounding of
  ``out`` and ``dq``, and for ``dlatent`` (cast per gathered contribution and scatter-added in 16 bits) ``n_j * u``
  times the sum of the absolute contributions to latent row ``j`` selected ``n_j`` times.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from interp import INTERPRETING, interpreted_module, run_interpreter_child

from glm53flash_hf import dispatch, dsa  # noqa: F401  (importing dsa registers the fused sparse_mla)
from glm53flash_hf.dsa_ops import sparse_mla_torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton; see setup.cfg [test])")

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.fixture
def td():
    """glm53flash_hf.dsa_fused with interpreted kernels; one intra-op thread (tiny shapes)."""
    yield from interpreted_module("dsa_fused")


@pytest.mark.interpreter
def test_interpreter_tests_in_subprocess():
    """Run this file's interpreter tests in a child pytest with TRITON_INTERPRET=1 set before triton is imported."""
    run_interpreter_child(__file__)


# ------------------------------------------------------------------------------------------------------------ oracles
def dense64(q, lat, idx, scale):
    """Float64 sparse MLA by a dense softmax over a multiplicity mask (a repeated id counts twice, ids outside
    ``[0, S_kv)`` are padding). Returns ``out, lse, P`` (``P`` the dense ``[B, S, H, S_kv]`` probabilities) as
    functions of float64 leaves ``(q64, c64)``; differentiate them with torch autograd. Empty rows: out 0, lse -inf."""
    q64 = q.detach().double().requires_grad_()
    c64 = lat.detach().double().requires_grad_()
    kv_len = lat.shape[1]
    ids = idx.long()
    valid = (ids >= 0) & (ids < kv_len)
    count = torch.zeros(*ids.shape[:2], kv_len, dtype=torch.float64, device=ids.device)
    count.scatter_add_(2, torch.where(valid, ids, 0), valid.double())  # [B, S, S_kv] multiplicities
    empty = count.sum(-1) == 0  # [B, S]
    s = torch.einsum("bshd,bkd->bshk", q64, c64) * scale
    logw = torch.where(count > 0, count.log(), float("-inf"))[:, :, None, :]
    z = torch.where(empty[:, :, None, None], 0.0, s + logw)  # empty rows: a dummy finite softmax, masked below
    lse_safe = torch.logsumexp(z, dim=-1)
    P = torch.where(empty[:, :, None, None], 0.0, torch.exp(z - lse_safe[..., None]))
    out = torch.einsum("bshk,bkd->bshd", P, c64)
    lse = torch.where(empty[:, :, None], float("-inf"), lse_safe)
    return q64, c64, out, lse, P, count


def loss_grads(out, lse, leaves, g_out, g_lse):
    """Gradients of ``sum(out * g_out) + sum(lse * g_lse over finite lse)`` w.r.t. ``leaves``."""
    finite = torch.isfinite(lse.detach())
    total = (out * g_out.to(out.dtype)).sum() + (torch.where(finite, lse, 0.0) * g_lse.to(lse.dtype)).sum()
    return torch.autograd.grad(total, leaves)


def fused_and_torch(td, q, lat, idx, scale, g_out, g_lse, **blocks):
    """The fused kernel and the torch path on the same inputs: ``((out, lse, dq, dlat), (the torch path's))``, the
    gradients those of :func:`loss_grads` w.r.t. ``(q, lat)``; ``blocks``: ``block_h`` / ``block_w`` of the kernel."""
    out, lse = td.sparse_mla_fused(q, lat, idx, scale, **blocks)
    fused = (out, lse, *loss_grads(out, lse, (q, lat), g_out, g_lse))
    ref_out, ref_lse = sparse_mla_torch(q, lat, idx, scale)
    return fused, (ref_out, ref_lse, *loss_grads(ref_out, ref_lse, (q, lat), g_out, g_lse))


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def assert_rel(a, b, tol, what):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    err = rel(a, b)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"
    return err


def assert_lse(lse, ref, what, tol=1e-5):
    assert lse.dtype == torch.float32 and lse.shape == ref.shape, what
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: -inf pattern differs"
    assert bool((lse[~finite] == float("-inf")).all()), f"{what}: empty rows must give -inf (not NaN/+inf)"
    diff = (lse[finite].double() - ref[finite].double()).abs()
    worst = (diff - tol * (1 + ref[finite].double().abs())).max().item() if diff.numel() else -1.0
    assert worst <= 0, f"{what}: exceeds 1e-5 (1 + |lse|) by {worst:.3g}"
    return diff.max().item() if diff.numel() else 0.0


def assert_bound(ours, ref, bound, what):
    """``|ours - ref| <= 1.01 * bound + 1e-6 * max|ref|`` elementwise (see the module docstring)."""
    assert ours.shape == ref.shape, what
    o, r = ours.detach().double(), ref.detach().double()
    assert torch.isfinite(o).all(), f"{what}: non-finite values"
    excess = ((o - r).abs() - 1.01 * bound - 1e-6 * r.abs().max()).max().item()
    assert excess <= 0, f"{what}: exceeds its rounding bound by {excess:.3g} (max |diff| {(o - r).abs().max():.3g})"
    return ((o - r).abs() / (bound + 1e-30)).max().item()  # fraction of the bound used


def rounding_bounds(q, lat, g_out, g_lse, out64, lse64, P, count, dq64, dc64, scale, u):
    """First-order float64 bounds of the kernel's 16-bit rounding (module docstring): returns
    ``(e_out, e_dq, e_dlat, g_abs)``; ``g_abs`` ``[B, S_kv, Dl]`` sums the absolute per-query contributions to
    each latent row (for the torch path's own bound)."""
    q64, c64, do = q.detach().double(), lat.detach().double(), g_out.double()
    out64, lse64, P, dq64, dc64 = (t.detach() for t in (out64, lse64, P, dq64, dc64))
    finite = torch.isfinite(lse64)
    dlse = torch.where(finite, g_lse.double(), 0.0)
    delta = (do * out64).sum(-1) - dlse  # [B, S, H]
    dp = torch.einsum("bshd,bkd->bshk", do, c64)
    ds = P * (dp - delta[..., None])
    a_abs = torch.einsum("bshk,bkd->bshd", P, c64.abs())
    e_out = u * (out64.abs() + a_abs)
    e_delta = (do.abs() * e_out).sum(-1)  # Delta from the rounded output
    e_dq = scale * (e_delta[..., None] * a_abs + u * torch.einsum("bshk,bkd->bshd", ds.abs(), c64.abs()))
    e_dq = e_dq + u * dq64.abs()
    w_ds = scale * (P * e_delta[..., None] + u * ds.abs())
    e_dlat = torch.einsum("bshk,bshd->bkd", w_ds, q64.abs()) + u * torch.einsum("bshk,bshd->bkd", P, do.abs())
    e_dlat = e_dlat + u * dc64.abs()
    g_abs = scale * torch.einsum("bshk,bshd->bkd", ds.abs(), q64.abs()) + torch.einsum("bshk,bshd->bkd", P, do.abs())
    return e_out, e_dq, e_dlat, g_abs


# ------------------------------------------------------------------------------------------------------ index lists
def random_ids(batch, seq, width, kv_len, gen, causal=True):
    """Unique ids per query (causal: ``<= t + kv_len - seq``) scattered over the ``width`` slots with ``-1`` holes."""
    idx = torch.full((batch, seq, width), -1, dtype=torch.int64)
    for b in range(batch):
        for t in range(seq):
            limit = t + 1 + kv_len - seq if causal else kv_len
            cand = torch.randperm(limit, generator=gen)[: max(1, width - 3)]
            slots = torch.randperm(width, generator=gen)[: cand.numel()]
            idx[b, t, slots] = cand
    return idx


def spoil(idx, kv_len):
    """Out-of-range ids (``S_kv``, ``S_kv + 5``, ``-7``) in some slots and one all-invalid query (row 0, query 2)."""
    idx = idx.clone()
    idx[0, 1, 0] = kv_len
    idx[-1, -1, -1] = kv_len + 5
    idx[0, 3, 1] = -7
    idx[0, 2] = -1
    idx[0, 2, 0] = kv_len  # all-invalid: only padding and an out-of-range id
    return idx


def packed_causal_ids(doc_lengths, width):
    """One packed row: query ``t`` of a document selects every earlier-or-equal token of its own document (the
    causal pattern), right-padded with ``-1`` to ``width``; documents never see each other."""
    seq = sum(doc_lengths)
    idx = torch.full((1, seq, width), -1, dtype=torch.int32)
    start = 0
    for n in doc_lengths:
        for i in range(n):
            ids = torch.arange(start, start + i + 1, dtype=torch.int32)[-width:]
            idx[0, start + i, : ids.numel()] = ids
        start += n
    return idx


def inputs(batch, seq, heads, dim, kv_len, dtype, seed, q_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=gen).to(q_dtype or dtype).requires_grad_()
    lat = torch.randn(batch, kv_len, dim, generator=gen).to(dtype).requires_grad_()
    g_out = torch.randn(batch, seq, heads, dim, generator=gen).to(q_dtype or dtype)
    g_lse = torch.randn(batch, seq, heads, generator=gen)
    return q, lat, g_out, g_lse, gen


# ------------------------------------------------------------------------------------------------------------- fp32
FP32_CASES = {
    # B, S, H, Dl, S_kv, W, block_h, block_w, index dtype
    "W37_not_multiple_of_16_H3_padded": (2, 13, 3, 20, 13, 37, None, 16, torch.int64),
    "H20_two_head_blocks_Skv_gt_S": (1, 9, 20, 16, 12, 24, 16, 16, torch.int32),
    "Dl48_default_blocks": (2, 7, 4, 48, 7, 5, None, None, torch.int32),
}


@pytest.mark.interpreter
@pytest.mark.parametrize("case", sorted(FP32_CASES))
def test_fp32_matches_torch_and_float64(td, case):
    """Values, LSE and both gradients (through out and lse) vs the torch path and float64; -1 holes, out-of-range ids
    (``S_kv``, ``S_kv + 5``, ``-7``), one all-invalid query (out 0, lse -inf, zero gradients, no NaN); W not a
    multiple of the id block, H not a multiple of the head block, Dl not a power of two."""
    batch, seq, heads, dim, kv_len, width, bh, bw, idx_dtype = FP32_CASES[case]
    scale = dim**-0.5
    q, lat, g_out, g_lse, gen = inputs(batch, seq, heads, dim, kv_len, torch.float32, seed=len(case))
    idx = spoil(random_ids(batch, seq, width, kv_len, gen), kv_len).to(idx_dtype)

    fused, ref = fused_and_torch(td, q, lat, idx, scale, g_out, g_lse, block_h=bh, block_w=bw)
    (out, lse, dq, dlat), (ref_out, ref_lse, rdq, rdlat) = fused, ref
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and out.shape == q.shape
    q64, c64, out64, lse64, _, _ = dense64(q, lat, idx, scale)
    dq64, dc64 = loss_grads(out64, lse64, (q64, c64), g_out.double(), g_lse.double())

    errs = {}
    for name, ours, ref, ref64 in (("out", out, ref_out, out64), ("dq", dq, rdq, dq64), ("dlat", dlat, rdlat, dc64)):
        errs[name] = (assert_rel(ours, ref, 1e-5, f"{name} vs torch"), assert_rel(ours, ref64, 1e-5, f"{name} vs f64"))
    errs["lse"] = (assert_lse(lse, ref_lse, "lse vs torch"), assert_lse(lse, lse64, "lse vs f64"))
    print(case, {k: tuple(f"{e:.2g}" for e in v) for k, v in errs.items()})

    # the all-invalid query: exactly zero output and gradient, -inf LSE
    assert bool((out[0, 2] == 0).all()) and bool((lse[0, 2] == float("-inf")).all())
    assert bool((dq[0, 2] == 0).all())
    # latent rows nobody selected get exactly zero gradient
    selected = torch.zeros(batch, kv_len, dtype=torch.bool)
    ids = idx.long()
    ok = (ids >= 0) & (ids < kv_len)
    for b in range(batch):
        selected[b, ids[b][ok[b]]] = True
    assert bool((dlat[~selected] == 0).all())


@pytest.mark.interpreter
def test_fp32_partial_gradients_and_unused_lse(td):
    """Only ``q_abs`` or only ``latent`` requires grad (the kernel skips the other), ``lse`` unused (no lse
    gradient reaches the kernel): same gradients as the torch path."""
    q, lat, g_out, _, gen = inputs(1, 6, 2, 16, 6, torch.float32, seed=5)
    idx = random_ids(1, 6, 5, 6, gen)
    for leaf, frozen in ((q, lat), (lat, q)):
        frozen.requires_grad_(False)
        (got,) = torch.autograd.grad(td.sparse_mla_fused(q, lat, idx, 0.3)[0], leaf, g_out)
        (ref,) = torch.autograd.grad(sparse_mla_torch(q, lat, idx, 0.3)[0], leaf, g_out)
        frozen.requires_grad_(True)
        assert_rel(got, ref, 1e-5, "partial gradient")


@pytest.mark.interpreter
def test_duplicate_ids_count_twice(td):
    """The contract shared with the torch path: a repeated id is counted twice (values and gradients)."""
    q, lat, g_out, g_lse, _ = inputs(1, 2, 2, 16, 4, torch.float32, seed=6)
    idx = torch.tensor([[[1, 1, 2, -1], [0, 3, 3, 3]]])
    out, lse = td.sparse_mla_fused(q, lat, idx, 0.5)
    q64, c64, out64, lse64, _, _ = dense64(q, lat, idx, 0.5)
    assert_rel(out, out64, 1e-5, "out")
    assert_lse(lse, lse64, "lse")
    got = loss_grads(out, lse, (q, lat), g_out, g_lse)
    ref = loss_grads(out64, lse64, (q64, c64), g_out.double(), g_lse.double())
    for name, a, b in zip(("dq", "dlat"), got, ref):
        assert_rel(a, b, 1e-5, name)


@pytest.mark.interpreter
def test_packed_documents_and_causal_pattern(td):
    """Indices built like a packed row (documents of 5, 7 and 4 tokens; each query selects only earlier tokens of
    its own document, W = 6 truncates the longer histories): equal to the torch path, and document 2 computed in the
    packed row equals document 2 run alone (values and its latent gradient), while no gradient crosses documents."""
    docs = [5, 7, 4]
    width = 6
    q, lat, g_out, g_lse, _ = inputs(1, sum(docs), 3, 24, sum(docs), torch.float32, seed=7)
    idx = packed_causal_ids(docs, width)
    (out, lse, dq, dlat), (ref_out, ref_lse, rdq, rdlat) = fused_and_torch(td, q, lat, idx, 0.25, g_out, g_lse,
                                                                            block_w=16)
    assert_rel(out, ref_out, 1e-5, "out")
    assert_lse(lse, ref_lse, "lse")
    assert_rel(dq, rdq, 1e-5, "dq")
    assert_rel(dlat, rdlat, 1e-5, "dlat")

    lo, hi = docs[0], docs[0] + docs[1]  # document 2 (index 1)
    q2 = q.detach()[:, lo:hi].clone().requires_grad_()
    lat2 = lat.detach()[:, lo:hi].clone().requires_grad_()
    alone_idx = packed_causal_ids([docs[1]], width)
    a_out, a_lse = td.sparse_mla_fused(q2, lat2, alone_idx, 0.25, block_w=16)
    a_dq, a_dlat = loss_grads(a_out, a_lse, (q2, lat2), g_out[:, lo:hi], g_lse[:, lo:hi])
    assert_rel(out[:, lo:hi], a_out, 1e-6, "document 2 alone: out")
    assert_rel(lse[:, lo:hi], a_lse, 1e-6, "document 2 alone: lse")
    assert_rel(dq[:, lo:hi], a_dq, 1e-6, "document 2 alone: dq")
    assert_rel(dlat[:, lo:hi], a_dlat, 1e-6, "document 2 alone: dlat")


@pytest.mark.interpreter
def test_empty_shapes(td):
    """W = 0 (no ids at all) and S = 0: the torch path's zeros / -inf, and zero gradients."""
    q, lat, _, _, _ = inputs(2, 3, 2, 16, 3, torch.float32, seed=8)
    out, lse = td.sparse_mla_fused(q, lat, torch.empty(2, 3, 0, dtype=torch.int64), 0.5)
    ref_out, ref_lse = sparse_mla_torch(q, lat, torch.empty(2, 3, 0, dtype=torch.int64), 0.5)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    dq, dlat = torch.autograd.grad(out.sum(), (q, lat))
    assert bool((dq == 0).all()) and bool((dlat == 0).all())
    out0, lse0 = td.sparse_mla_fused(q[:, :0], lat, torch.empty(2, 0, 4, dtype=torch.int64), 0.5)
    assert out0.shape == (2, 0, 2, 16) and lse0.shape == (2, 0, 2)


@pytest.mark.interpreter
def test_argument_errors(td):
    q, lat, _, _, gen = inputs(1, 4, 2, 16, 4, torch.float32, seed=9)
    idx = random_ids(1, 4, 3, 4, gen)
    with pytest.raises(ValueError, match="indices must be an integer"):
        td.sparse_mla_fused(q, lat, idx.float(), 0.5)
    with pytest.raises(ValueError, match="latent must be"):
        td.sparse_mla_fused(q, lat[..., :8], idx, 0.5)
    with pytest.raises(ValueError, match="indices must be"):
        td.sparse_mla_fused(q, lat, idx[:, :3], 0.5)
    with pytest.raises(ValueError, match="must be float32, bfloat16 or float16"):
        td.sparse_mla_fused(q.double(), lat.double(), idx, 0.5)
    with pytest.raises(ValueError, match="block_w"):
        td.sparse_mla_fused(q, lat, idx, 0.5, block_w=24)
    with pytest.raises(ValueError, match="block_h"):
        td.sparse_mla_fused(q, lat, idx, 0.5, block_h=8)
    with pytest.raises(ValueError, match="scale"):
        td.sparse_mla_fused(q, lat, idx, float("nan"))
    with pytest.raises(ValueError, match="MAX_LATENT_DIM"):
        td.sparse_mla_fused(torch.zeros(1, 1, 1, 2048), torch.zeros(1, 1, 2048), idx[:, :1], 0.5)


# -------------------------------------------------------------------------------------------------------- bf16/fp16
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_within_rounding_bounds(td, dtype):
    """16-bit inputs: every output and gradient within the elementwise rounding bounds of the module docstring, vs
    float64 (from the same 16-bit inputs) and vs the torch path (its own rounding added); LSE (fp32 from exact
    products) within the fp32 tolerance. Several id blocks (W = 37, block 16), padded heads (H = 3)."""
    u = UNIT_ROUNDOFF[dtype]
    batch, seq, heads, dim, width = 2, 11, 3, 24, 37
    scale = 0.2
    q, lat, g_out, g_lse, gen = inputs(batch, seq, heads, dim, seq, dtype, seed=10)
    idx = spoil(random_ids(batch, seq, width, seq, gen), seq)

    fused, ref = fused_and_torch(td, q, lat, idx, scale, g_out, g_lse, block_w=16)
    (out, lse, dq, dlat), (ref_out, ref_lse, rdq, rdlat) = fused, ref
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert dq.dtype == dtype and dlat.dtype == dtype
    q64, c64, out64, lse64, P, count = dense64(q, lat, idx, scale)
    dq64, dc64 = loss_grads(out64, lse64, (q64, c64), g_out.double(), g_lse.double())
    e_out, e_dq, e_dlat, g_abs = rounding_bounds(q, lat, g_out, g_lse, out64, lse64, P, count, dq64, dc64, scale, u)

    used = {
        "out/f64": assert_bound(out, out64, e_out, "out vs float64"),
        "dq/f64": assert_bound(dq, dq64, e_dq, "dq vs float64"),
        "dlat/f64": assert_bound(dlat, dc64, e_dlat, "dlat vs float64"),
        "out/torch": assert_bound(out, ref_out, e_out + u * out64.abs(), "out vs torch"),
        "dq/torch": assert_bound(dq, rdq, e_dq + u * dq64.abs(), "dq vs torch"),
    }
    n_sel = count.sum(1)[..., None]  # [B, S_kv, 1]: how many (query, slot) pairs selected each latent row
    used["dlat/torch"] = assert_bound(dlat, rdlat, e_dlat + n_sel * u * g_abs, "dlat vs torch")
    lse_err = (assert_lse(lse, lse64, "lse vs float64"), assert_lse(lse, ref_lse, "lse vs torch"))
    print(dtype, "fraction of bound used", {k: f"{v:.2f}" for k, v in used.items()}, "lse", lse_err,
          "rel vs f64", {n: f"{rel(a, b):.2g}" for n, a, b in (("out", out, out64), ("dq", dq, dq64),
                                                              ("dlat", dlat, dc64))})
    assert bool((out[0, 2] == 0).all()) and bool((dq[0, 2] == 0).all())


@pytest.mark.interpreter
def test_mixed_dtypes_run_the_fp32_path(td):
    """fp32 queries with a bf16 latent (the fp32 path): out/lse/dq within the fp32 tolerance of the torch path (which
    also works in fp32); dlatent is the fp32 sum rounded once, so within one bf16 rounding of float64."""
    q, lat, g_out, g_lse, gen = inputs(1, 7, 2, 16, 7, torch.bfloat16, seed=11, q_dtype=torch.float32)
    idx = random_ids(1, 7, 6, 7, gen)
    (out, lse, dq, dlat), (ref_out, ref_lse, rdq, _) = fused_and_torch(td, q, lat, idx, 0.3, g_out, g_lse)
    assert out.dtype == torch.float32
    assert_rel(out, ref_out, 1e-5, "out")
    assert_lse(lse, ref_lse, "lse")
    assert_rel(dq, rdq, 1e-5, "dq")
    q64, c64, out64, lse64, _, _ = dense64(q, lat, idx, 0.3)
    _, dc64 = loss_grads(out64, lse64, (q64, c64), g_out.double(), g_lse.double())
    assert dlat.dtype == torch.bfloat16
    assert_bound(dlat, dc64, 2.0**-8 * dc64.abs(), "dlat vs float64")


# ------------------------------------------------------------------------------------------------------ module level
@pytest.mark.interpreter
def test_module_fused_matches_torch(td, monkeypatch):
    """``Glm53FlashAttention`` with ``kernels={"dsa": "fused"}`` vs ``"torch"`` (same weights, a packed row of two
    documents plus a left-padded row): outputs and every parameter gradient. On CPU the dispatcher never picks the
    fused path, so it is forced here for the "fused" module and the calls are counted."""
    from tiny import PARITY_TEXT, randomize_

    from glm53flash_hf.configuration_glm53flash import Glm53FlashTextConfig
    from glm53flash_hf.dsa import Glm53FlashAttention
    from glm53flash_hf.packing import build_document_layout

    calls = []
    real_choose = dispatch.choose_backend
    monkeypatch.setattr(dispatch, "choose_backend", lambda family, requested, *tensors: calls.append(requested) or (
        "fused" if requested == "fused" else real_choose(family, requested, *tensors)))
    text = dict(PARITY_TEXT)
    layer = text["layer_types"].index("indexed_attention")
    modules = {}
    for choice in ("torch", "fused"):
        config = Glm53FlashTextConfig(**dict(text, kernels={"dsa": choice}))
        modules[choice] = Glm53FlashAttention(config, layer)
        randomize_(modules[choice], seed=3)
    assert modules["fused"].backend == "fused"
    modules["fused"].load_state_dict(modules["torch"].state_dict())

    seq = 19
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(2, seq, text["hidden_size"], generator=gen)
    grad = torch.randn(2, seq, text["hidden_size"], generator=gen)
    pos = torch.cat([torch.arange(11), torch.arange(8)]).unsqueeze(0).expand(2, -1).clone()
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, :4] = 0
    pos[1] = torch.clamp(torch.arange(seq) - 4, min=0)
    layout = build_document_layout(2, seq, "cpu", attention_mask=mask, position_ids=pos)
    results = {}
    for choice, module in modules.items():
        out, _, _ = module(x, layout)
        (out * grad).sum().backward()
        results[choice] = (out.detach(), {n: p.grad for n, p in module.named_parameters() if p.grad is not None})
    assert calls.count("fused") == 1 and calls.count("torch") == 1
    out_f, grads_f = results["fused"]
    out_t, grads_t = results["torch"]
    worst = assert_rel(out_f, out_t, 1e-5, "attention output")
    assert sorted(grads_f) == sorted(grads_t) and len(grads_t) >= 7
    for name, g in grads_t.items():
        worst = max(worst, assert_rel(grads_f[name], g, 1e-5, f"grad {name}"))
    print("module fused vs torch: worst relative error", worst)


# ---------------------------------------------------------------------------------------------- custom ops, compile
OPCHECK_PASSED = {name: "SUCCESS" for name in ("test_schema", "test_autograd_registration", "test_faketensor",
                                                "test_aot_dispatch_dynamic")}


def opcheck(op, *args):
    """``torch.library.opcheck`` with its default tests (schema, autograd registration, fake tensor,
    aot_dispatch_dynamic), which raises on a failure; asserts that all four ran."""
    assert torch.library.opcheck(op, args) == OPCHECK_PASSED


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_sparse_mla(td, dtype):
    """glm53flash::sparse_mla_fwd (differentiable in q_abs and latent through out and lse; its autograd formula calls
    sparse_mla_bwd) and sparse_mla_bwd with and without an lse gradient, one and both input gradients."""
    q, lat, g_out, g_lse, gen = inputs(1, 4, 2, 16, 5, dtype, seed=30)
    idx = random_ids(1, 4, 3, 5, gen)
    opcheck(torch.ops.glm53flash.sparse_mla_fwd, q, lat, idx, 0.5, None, None)
    q, lat = q.detach(), lat.detach()
    out, lse = torch.ops.glm53flash.sparse_mla_fwd(q, lat, idx, 0.5, None, 16)
    for grad_lse, need in ((g_lse, (True, True)), (None, (True, False)), (g_lse, (False, True))):
        opcheck(torch.ops.glm53flash.sparse_mla_bwd, q, lat, idx, out, lse, g_out, grad_lse, 0.5, None, 16, *need)


@pytest.mark.interpreter
def test_compile_fullgraph_equals_eager(td):
    """``torch.compile(fullgraph=True)`` (inductor) of a torch op -> sparse_mla_fused: no graph break, and the compiled
    function equals the eager one bit for bit: out, lse and the gradients of q_abs and latent through both (the
    kernels run inside the ops; the torch op around them is one exact product by a power of two)."""
    q, lat, g_out, g_lse, gen = inputs(1, 5, 3, 16, 6, torch.float32, seed=31)
    idx = random_ids(1, 5, 4, 6, gen)

    def attend(q, lat):
        return td.sparse_mla_fused(q * 0.5, lat, idx, 0.25)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)
    results = []
    for fn in (attend, compiled):
        out, lse = fn(q, lat)
        results.append((out.detach(), lse.detach(), *torch.autograd.grad((out, lse), (q, lat), (g_out, g_lse))))
    for name, a, b in zip(("out", "lse", "dq", "dlatent"), *results):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------------------------- dispatch (no kernels)
def test_fused_on_cpu_warns_once_and_falls_back(monkeypatch):
    """``backend="fused"`` with CPU tensors: one warning naming the reason (however many calls), and exactly the
    torch path's result."""
    monkeypatch.setattr(dispatch, "_warned", set())
    gen = torch.Generator().manual_seed(13)
    q, lat = torch.randn(1, 5, 2, 16, generator=gen), torch.randn(1, 5, 16, generator=gen)
    idx = random_ids(1, 5, 4, 5, gen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = (dispatch.op_for(sparse_mla_torch, "fused", q, lat, idx)(q, lat, idx, 0.5) for _ in range(2))
    messages = [str(w.message) for w in caught if "kernels['dsa']='fused'" in str(w.message)]
    assert len(messages) == 1 and "not on a CUDA device" in messages[0], messages
    ref = sparse_mla_torch(q, lat, idx, 0.5)
    for got in (first, second):
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_auto_on_cpu_never_imports_the_kernels(monkeypatch):
    """``backend="auto"`` (and "fused") on CPU decide without importing glm53flash_hf.dsa_fused."""
    monkeypatch.delitem(sys.modules, "glm53flash_hf.dsa_fused", raising=False)
    monkeypatch.setattr(dispatch, "_warned", set())
    gen = torch.Generator().manual_seed(14)
    q, lat = torch.randn(1, 3, 2, 16, generator=gen), torch.randn(1, 3, 16, generator=gen)
    idx = random_ids(1, 3, 2, 3, gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for requested in ("auto", "fused"):
            dispatch.op_for(sparse_mla_torch, requested, q, lat, idx)(q, lat, idx, 0.5)
    assert dispatch.choose_backend("dsa", "auto", q, lat, idx) == "torch"
    assert "glm53flash_hf.dsa_fused" not in sys.modules


@pytest.mark.skipif(INTERPRETING, reason="checks the refusal outside the interpreter")
def test_kernel_refuses_cpu_tensors_outside_interpreter():
    """Called directly on CPU tensors without TRITON_INTERPRET=1, the kernel entry raises a clear error, and the
    probe reports the device."""
    from glm53flash_hf import dsa_fused

    q, lat = torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 16)
    idx = torch.zeros(1, 2, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        dsa_fused.sparse_mla_fused(q, lat, idx, 0.5)
    assert dsa_fused.fused_dsa_available(q, lat, idx) == (False, "the tensors are not on a CUDA device")


# ----------------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(INTERPRETING, reason="TRITON_INTERPRET=1: kernels would run interpreted")
def test_gpu_release_shapes_bf16():
    """Release head count and latent width (H = 64, Dl = 512, W = 2051, causal ids with -1 tail), bf16, S = 1024:
    dispatch picks the fused path; values and gradients within the bounds of the CPU tests (vs float64 and vs the
    torch path), LSE within the fp32 tolerance."""
    dev = torch.device("cuda")
    u = UNIT_ROUNDOFF[torch.bfloat16]
    batch, seq, heads, dim, width = 1, 1024, 64, 512, 2051
    scale = 256**-0.5
    gen = torch.Generator().manual_seed(15)
    q = torch.randn(batch, seq, heads, dim, generator=gen).bfloat16().to(dev).requires_grad_()
    lat = torch.randn(batch, seq, dim, generator=gen).bfloat16().to(dev).requires_grad_()
    g_out = torch.randn(batch, seq, heads, dim, generator=gen).bfloat16().to(dev)
    g_lse = torch.randn(batch, seq, heads, generator=gen).to(dev)
    idx = torch.arange(width, device=dev).expand(batch, seq, -1).to(torch.int32)
    idx = torch.where(idx <= torch.arange(seq, device=dev)[None, :, None], idx, -1)
    assert dispatch.choose_backend("dsa", "auto", q, lat, idx) == "fused"
    out, lse = dispatch.op_for(sparse_mla_torch, "fused", q, lat, idx)(q, lat, idx, scale)
    dq, dlat = loss_grads(out, lse, (q, lat), g_out, g_lse)
    ref_out, ref_lse = sparse_mla_torch(q, lat, idx, scale)
    rdq, rdlat = loss_grads(ref_out, ref_lse, (q, lat), g_out, g_lse)
    q64, c64, out64, lse64, P, count = dense64(q, lat, idx, scale)
    dq64, dc64 = loss_grads(out64, lse64, (q64, c64), g_out.double(), g_lse.double())
    e_out, e_dq, e_dlat, g_abs = rounding_bounds(q, lat, g_out, g_lse, out64, lse64, P, count, dq64, dc64, scale, u)
    assert_bound(out, out64, e_out, "out vs float64")
    assert_bound(dq, dq64, e_dq, "dq vs float64")
    assert_bound(dlat, dc64, e_dlat, "dlat vs float64")
    assert_bound(out, ref_out, e_out + u * out64.abs(), "out vs torch")
    assert_bound(dq, rdq, e_dq + u * dq64.abs(), "dq vs torch")
    assert_bound(dlat, rdlat, e_dlat + count.sum(1)[..., None] * u * g_abs, "dlat vs torch")
    assert_lse(lse, lse64, "lse vs float64")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(INTERPRETING, reason="TRITON_INTERPRET=1: kernels would run interpreted")
def test_gpu_memory_linear_in_seq_len():
    """Peak extra memory of forward + backward at S = 16384 is at most 4.5x that at S = 4096 (linear: 4x; the dense
    built-in's S x S mask/scores would give 16x). Release shapes H = 64, Dl = 512, W = 2051, bf16."""
    from glm53flash_hf.dsa_fused import sparse_mla_fused

    dev = torch.device("cuda")

    def peak(seq):
        q = torch.randn(1, seq, 64, 512, device=dev, dtype=torch.bfloat16, requires_grad=True)
        lat = torch.randn(1, seq, 512, device=dev, dtype=torch.bfloat16, requires_grad=True)
        idx = torch.randint(0, seq, (1, seq, 2051), device=dev, dtype=torch.int32)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out, _ = sparse_mla_fused(q, lat, idx, 0.0625)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    small, large = peak(4096), peak(16384)
    assert large <= 4.5 * small, (small, large)


@pytest.mark.interpreter
def test_frames_from_the_decoder_layer_to_the_kernel(td):
    """A model prefill on the fused DSA path: from the decoder layer's forward to the custom-op body that launches the
    sparse-attention kernel, at most 3 frames of the package's own code."""
    from tiny import frames_below_decoder_layer

    frames = frames_below_decoder_layer(lambda c: c.co_name == "_sparse_mla_fwd_impl", "dsa")
    print(" -> ".join(frames))
    assert frames == ["Glm53FlashAttention.forward", "sparse_mla_fused", "_sparse_mla_fwd_impl"], frames
