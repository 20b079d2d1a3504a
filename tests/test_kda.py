"""Tests of the KDA (Kimi Delta Attention) family's torch path: the operators of ``glm53flash_hf/kda_ops.py`` and the
layer of ``glm53flash_hf/kda.py``.

Oracles: a float64 token-by-token recurrence written here (the update rule of Kimi Linear, arXiv:2510.26692 §3), and
transformers' ``glm5_next`` modules with the same weights (``Glm5NextTextLinearAttention``, ``causal_conv1d_fn``,
``causal_conv1d_update``, ``chunk_kimi_delta_attention``, ``Glm5NextTextForgetGate``, ``Glm5NextTextRMSNormGated``,
``Glm5NextPreTrainedModel._init_weights``).
"""

import math

import pytest
import torch
from tiny import fp32_sum_tol
from transformers import DynamicCache
from transformers.models.glm5_next import modeling_glm5_next as hf

import glm53flash_hf.kda_ops as kda_ops
from glm53flash_hf.configuration_glm53flash import Glm53FlashTextConfig
from glm53flash_hf.kda import (
    Glm53FlashForgetGate,
    Glm53FlashLinearAttention,
    Glm53FlashRMSNormGated,
    init_kda_weights,
)
from glm53flash_hf.kda_ops import causal_conv1d_torch, chunk_kda_torch, recurrent_kda_torch
from glm53flash_hf.packing import build_document_layout

# fp32 kernel vs float64 recurrence, max error / max |ref| (values and grads; docs/design.md, section "KDA").
CORE_TOL = 2e-6
# fp32 layer vs HF's fp32 layer (target of the project).
LAYER_TOL = 1e-4


def tiny_config(**overrides) -> Glm53FlashTextConfig:
    kwargs = dict(
        hidden_size=64,
        linear_num_heads=2,
        linear_head_dim=16,
        linear_conv_kernel_dim=4,
        num_hidden_layers=4,
        index_kpool=4,
        index_topk=16,
    )
    kwargs.update(overrides)
    return Glm53FlashTextConfig(**kwargs)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (b is the reference)."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def naive_kda(q, k, v, g, beta, initial_state=None, cu_seqlens=None, scale=None):
    """float64 token loop of the KDA recurrence (module docstring of kda_ops); restarts the state at every cu_seqlens
    boundary.

    Returns (o [B,T,H,V], final states [N,H,K,V]) in float64; differentiable.
    """
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    B, T, H, K = q.shape
    V = v.shape[-1]
    bounds = [(0, T)] * B if cu_seqlens is None else list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    outs, finals = [], []
    for n, (a, b) in enumerate(bounds):
        row = n if cu_seqlens is None else 0
        S = initial_state[n].double() if initial_state is not None else q.new_zeros(H, K, V)
        for t in range(a, b):
            S = S * g[row, t].exp()[..., None]
            u = beta[row, t, :, None] * (v[row, t] - torch.einsum("hk,hkv->hv", k[row, t], S))
            S = S + k[row, t][..., None] * u[:, None, :]
            outs.append(torch.einsum("hk,hkv->hv", q[row, t], S))
        finals.append(S)
    o = torch.stack(outs).view(B, T, H, V)
    return o, torch.stack(finals)


def make_inputs(B, T, H, K, V, n_states, gate="bounded", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    if gate == "bounded":  # release gate form, values in (-5, 0)
        g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    else:  # unbounded softplus form, occasionally large
        g = -torch.nn.functional.softplus(2.0 * torch.randn(B, T, H, K, generator=gen))
    beta = torch.rand(B, T, H, generator=gen)
    h0 = 0.5 * torch.randn(n_states, H, K, V, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta, h0)]


def grads_of(outputs, weights, inputs):
    loss = sum((o * w.to(o.dtype)).sum() for o, w in zip(outputs, weights))
    return torch.autograd.grad(loss, inputs, retain_graph=True)


def check_against_naive(o, ht, ref_o, ref_ht, inputs, ref_inputs, tol=CORE_TOL, what=""):
    gen = torch.Generator().manual_seed(123)
    wo = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    wh = torch.randn(ht.shape, generator=gen, dtype=torch.float64)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_err(o, ref_o) < tol, f"{what} output rel err {rel_err(o, ref_o):.2e}"
    assert rel_err(ht, ref_ht) < tol, f"{what} final state rel err {rel_err(ht, ref_ht):.2e}"
    got = grads_of([o, ht], [wo, wh], inputs)
    ref = grads_of([ref_o, ref_ht], [wo, wh], ref_inputs)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), got, ref):
        assert torch.isfinite(a).all(), f"{what} non-finite grad of {name}"
        assert rel_err(a, b) < tol, f"{what} grad {name} rel err {rel_err(a, b):.2e}"


def as_f64_leaves(tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


# ---------------------------------------------------------------------------------------------------------------------
# chunk_kda_torch / recurrent_kda_torch vs the float64 recurrence
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("T", [1, 17, 64, 100, 130])
def test_chunk_matches_naive(T, chunk_size):
    inputs = make_inputs(2, T, 2, 16, 24, n_states=2, seed=T + chunk_size)
    o, ht = chunk_kda_torch(*inputs[:5], initial_state=inputs[5], output_final_state=True, chunk_size=chunk_size)
    assert o.dtype == torch.float32 and ht.dtype == torch.float32
    assert o.shape == (2, T, 2, 24) and ht.shape == (2, 2, 16, 24)
    ref_inputs = as_f64_leaves(inputs)
    ref_o, ref_ht = naive_kda(*ref_inputs[:5], initial_state=ref_inputs[5])
    check_against_naive(o, ht, ref_o, ref_ht, inputs, ref_inputs, what=f"T={T} C={chunk_size}")


def test_chunk_unbounded_gate_and_custom_scale():
    inputs = make_inputs(1, 90, 2, 16, 16, n_states=1, gate="softplus", seed=5)
    o, ht = chunk_kda_torch(*inputs[:5], initial_state=inputs[5], output_final_state=True, scale=0.3)
    ref_inputs = as_f64_leaves(inputs)
    ref_o, ref_ht = naive_kda(*ref_inputs[:5], initial_state=ref_inputs[5], scale=0.3)
    check_against_naive(o, ht, ref_o, ref_ht, inputs, ref_inputs, what="softplus gate")


def test_chunk_without_l2norm_and_bf16_inputs():
    inputs = make_inputs(1, 40, 2, 16, 16, n_states=1, seed=6)
    q, k, v, g, beta, _ = inputs
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    a, _ = chunk_kda_torch(qn, kn, v, g, beta, use_qk_l2norm_in_kernel=False)
    b, _ = chunk_kda_torch(q, k, v, g, beta)
    assert rel_err(a, b) < 1e-6
    o16, ht16 = chunk_kda_torch(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, output_final_state=True)
    assert o16.dtype == torch.bfloat16 and ht16.dtype == torch.float32
    ref, _ = naive_kda(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta)
    assert rel_err(o16, ref) < 1e-2  # one bf16 rounding of the output


def test_recurrent_matches_naive_and_chunk():
    inputs = make_inputs(2, 23, 2, 16, 8, n_states=2, seed=7)
    o, ht = recurrent_kda_torch(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    ref_inputs = as_f64_leaves(inputs)
    ref_o, ref_ht = naive_kda(*ref_inputs[:5], initial_state=ref_inputs[5])
    check_against_naive(o, ht, ref_o, ref_ht, inputs, ref_inputs, what="recurrent")
    co, cht = chunk_kda_torch(*inputs[:5], initial_state=inputs[5], output_final_state=True, chunk_size=16)
    assert rel_err(co, o) < CORE_TOL and rel_err(cht, ht) < CORE_TOL
    _, none = recurrent_kda_torch(*inputs[:5])
    assert none is None


def test_decode_step_matches_naive_and_keeps_the_state():
    """The layer's decode step, recurrent_kda_torch on one token from a given state, equals the float64 recurrence to
    CORE_TOL and the chunked form from the same state; the input state is not modified."""
    for seed in range(3):
        inputs = make_inputs(2, 1, 2, 16, 8, n_states=2, seed=40 + seed)
        q, k, v, g, beta, h0 = (t.detach() for t in inputs)
        h0_copy = h0.clone()
        o, ht = recurrent_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        assert o.shape == (2, 1, 2, 8) and ht.dtype == torch.float32
        assert torch.equal(h0, h0_copy)
        n_o, n_ht = naive_kda(*(t.double() for t in (q, k, v, g, beta)), initial_state=h0.double())
        assert rel_err(o, n_o) < CORE_TOL and rel_err(ht, n_ht) < CORE_TOL
        c_o, c_ht = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        assert rel_err(o, c_o) < CORE_TOL and rel_err(ht, c_ht) < CORE_TOL


def test_chunk_matches_hf_eager():
    """Same maths as transformers' torch chunk_kimi_delta_attention (values and grads, no initial state).

    The gap is HF's own fp32 error against the float64 recurrence (its decays are differences of chunk cumulative
    sums, G_i - G_j), larger than ours: hence the project's HF-parity tolerance (1e-4) here, while the float64 tests
    use ``CORE_TOL``.
    """
    inputs = make_inputs(2, 100, 2, 16, 16, n_states=2, seed=8)
    o, _ = chunk_kda_torch(*inputs[:5])
    ref, _ = hf.chunk_kimi_delta_attention(*inputs[:5], use_qk_l2norm_in_kernel=True)
    assert rel_err(o, ref) < LAYER_TOL
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(0))
    for a, b in zip(grads_of([o], [w], inputs[:5]), grads_of([ref], [w], inputs[:5])):
        assert rel_err(a, b) < LAYER_TOL


# ---------------------------------------------------------------------------------------------------------------------
# Packed documents
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "lengths,chunk_size",
    [
        ([1, 20, 39, 5, 17, 85], 16),  # chunk sizes 1, 8, 16: three groups; two documents share a row at C=16
        ([1, 20, 39, 5, 17, 85], 64),  # chunk sizes 1, 8, 32, 64
        ([40, 17, 18, 64, 20], 16),  # one group, state re-seeded mid-row
    ],
)
@pytest.mark.parametrize("with_state", [True, False])
def test_chunk_packed_equals_separate(lengths, chunk_size, with_state, monkeypatch):
    torch.manual_seed(0)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    N, T = len(lengths), int(cu[-1])
    plans = []
    real_make_plan = kda_ops._make_plan

    def recording_make_plan(*args):
        plans.append(real_make_plan(*args))
        return plans[-1]

    monkeypatch.setattr(kda_ops, "_make_plan", recording_make_plan)
    inputs = make_inputs(1, T, 2, 16, 24, n_states=N, seed=chunk_size)
    if not with_state:
        inputs = inputs[:5]
    h0 = inputs[5] if with_state else None
    o, ht = chunk_kda_torch(
        *inputs[:5], initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=chunk_size
    )
    if chunk_size == 16:  # the mid-row state re-seeding path ran
        assert any(p.resets for p in plans)
    if 1 in lengths:  # documents were grouped by chunk size (a 1-token document runs with chunk 1)
        assert len(plans) >= 3 and min(p.chunk for p in plans) == 1
    assert ht.shape == (N, 2, 16, 24)
    # each document run alone, on slices of the same leaves
    pieces = [
        chunk_kda_torch(
            *(t[:, a:b] for t in inputs[:5]),
            initial_state=None if h0 is None else h0[n : n + 1],
            output_final_state=True,
            chunk_size=chunk_size,
        )
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist()))
    ]
    sep_o = torch.cat([p[0] for p in pieces], dim=1)
    sep_ht = torch.cat([p[1] for p in pieces], dim=0)
    assert rel_err(o, sep_o) < 1e-6 and rel_err(ht, sep_ht) < 1e-6
    w = [torch.randn_like(o), torch.randn_like(ht)]
    for a, b in zip(grads_of([o, ht], w, inputs), grads_of([sep_o, sep_ht], w, inputs)):
        assert rel_err(a, b) < 1e-6
    # and both equal the float64 recurrence with resets
    ref_inputs = as_f64_leaves(inputs)
    ref_o, ref_ht = naive_kda(*ref_inputs[:5], initial_state=ref_inputs[5] if with_state else None, cu_seqlens=cu)
    check_against_naive(o, ht, ref_o, ref_ht, inputs, ref_inputs, what=f"packed {lengths} C={chunk_size}")


def test_chunk_packed_isolation():
    """Changing one document's content changes no other document's output."""
    cu = torch.tensor([0, 30, 31, 70])
    inputs = [t.detach() for t in make_inputs(1, 70, 2, 16, 16, n_states=3, seed=11)]
    o1, _ = chunk_kda_torch(*inputs[:5], cu_seqlens=cu, chunk_size=16)
    v2 = inputs[2].clone()
    v2[:, 30] += 10.0
    o2, _ = chunk_kda_torch(inputs[0], inputs[1], v2, inputs[3], inputs[4], cu_seqlens=cu, chunk_size=16)
    assert torch.equal(o1[:, :30], o2[:, :30]) and torch.equal(o1[:, 31:], o2[:, 31:])
    assert not torch.equal(o1[:, 30], o2[:, 30])


# ---------------------------------------------------------------------------------------------------------------------
# Saturated / extreme gates
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("g_value", [-5.0, -50.0])
def test_saturated_gate_finite_and_exact(g_value):
    """g at the release lower bound (-5) for whole chunks, and a large unbounded decay (-50 per step).

    Forward and all grads are finite and equal to the float64 recurrence. (transformers' eager
    chunk_kimi_delta_attention is also finite here in 5.24: its masked -inf entries are only exponentiated,
    never subtracted; see test_hf_eager_minus_inf_gate for where it does break.)
    """
    B, T, H, K, V = 1, 150, 2, 16, 16
    inputs = make_inputs(B, T, H, K, V, n_states=1, seed=12)
    with torch.no_grad():
        inputs[3][:, :64] = g_value  # a whole chunk saturated
        inputs[3][:, 100:] = g_value  # and the tail, across a chunk boundary
    o, ht = chunk_kda_torch(*inputs[:5], initial_state=inputs[5], output_final_state=True, chunk_size=64)
    ref_inputs = as_f64_leaves(inputs)
    ref_o, ref_ht = naive_kda(*ref_inputs[:5], initial_state=ref_inputs[5])
    check_against_naive(o, ht, ref_o, ref_ht, inputs, ref_inputs, what=f"g={g_value}")


def test_minus_inf_gate_is_a_hard_reset():
    """g = -inf (exp(g) = 0, a hard state reset) stays finite and exact in ours (local sums, no inf - inf)."""
    inputs = make_inputs(1, 80, 2, 16, 16, n_states=1, seed=13)
    with torch.no_grad():
        inputs[3][:, 20:40] = float("-inf")
    o, ht = chunk_kda_torch(*inputs[:5], initial_state=inputs[5], output_final_state=True, chunk_size=32)
    ref_inputs = as_f64_leaves(inputs)
    ref_o, ref_ht = naive_kda(*ref_inputs[:5], initial_state=ref_inputs[5])
    check_against_naive(o, ht, ref_o, ref_ht, inputs, ref_inputs, what="g=-inf")


def test_hf_eager_minus_inf_gate():
    """Documents the one input where transformers' eager chunk path breaks: g = -inf gives NaN (ours: finite)."""
    inputs = make_inputs(1, 64, 2, 16, 16, n_states=1, seed=14)
    with torch.no_grad():
        inputs[3][:] = float("-inf")
    ref, _ = hf.chunk_kimi_delta_attention(*inputs[:5], use_qk_l2norm_in_kernel=True)
    assert not torch.isfinite(ref).all()
    o, _ = chunk_kda_torch(*inputs[:5])
    assert torch.isfinite(o).all()


# ----------------------------------------------------------------------------------------------------------------------
# The chunked core's two autograd Functions: float64 gradcheck, and the accuracy of the token-summed gate gradient
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cu", [None, [0, 3, 9, 20], [0, 2, 6, 9, 21]])
@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("final", [False, True])
def test_state_recurrence_gradcheck(cu, with_h0, final):
    """``kda_ops._StateRecurrence`` (chunk loop carrying only the state, hand-written reverse loop): float64
    ``gradcheck`` with re-seeded rows (packed documents), per-document final states and the zero-state first chunk."""
    C, H, K, V = 4, 2, 3, 2
    T = 12 if cu is None else cu[-1]
    plan = kda_ops._make_plan(1, T, H, C, cu, "cpu")
    if cu is not None:
        assert plan.resets and plan.num_rows > 1  # the packing re-seeds some row mid-way
    gen = torch.Generator().manual_seed(len(cu or []) + 2 * with_h0 + final)
    L, R, N = plan.num_chunks, plan.num_rows, plan.num_docs

    def leaf(*shape, positive=False):
        x = torch.rand(*shape, generator=gen, dtype=torch.float64) if positive else \
            torch.randn(*shape, generator=gen, dtype=torch.float64)
        return x.requires_grad_()

    args = (leaf(L, R, H, C, V), leaf(L, R, H, C, K), leaf(L, R, H, K, C), leaf(L, R, H, K, positive=True),
            leaf(N, H, K, V) if with_h0 else None)

    def fn(*a):
        states, u, fin = kda_ops._StateRecurrence.apply(*a, plan, final)
        return (states, u, fin) if final else (states, u)

    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("C", [1, 2, 4, 8])
def test_intra_chunk_products_gradcheck_and_values(C):
    """``kda_ops._intra_chunk_products`` (custom backward) against the direct ``exp(G_i - G_j)`` formula in float64,
    and float64 ``gradcheck``."""
    gen = torch.Generator().manual_seed(C)
    M, K = 3, 5
    q, k = (torch.randn(M, C, K, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    g = (-torch.rand(M, C, K, generator=gen, dtype=torch.float64)).requires_grad_()
    G = g.cumsum(1)
    E = torch.exp(G[:, :, None, :] - G[:, None, :, :])
    akk, aqk, d_in, d_out = kda_ops._intra_chunk_products(q, k, g)
    assert torch.allclose(akk, torch.einsum("mid,mjd,mijd->mij", k, k, E).tril(-1), atol=1e-13)
    assert torch.allclose(aqk, torch.einsum("mid,mjd,mijd->mij", q, k, E).tril(), atol=1e-13)
    assert torch.allclose(d_in, G.exp(), atol=1e-14) and torch.allclose(d_out, (G[:, -1:] - G).exp(), atol=1e-14)
    assert torch.autograd.gradcheck(kda_ops._intra_chunk_products, (q, k, g))


@pytest.mark.parametrize("gate_scale", [0.5, 5.0])
def test_token_summed_gate_gradient_accuracy(gate_scale):
    """The gate gradient summed over tokens (what ``A_log`` / ``dt_bias`` receive) stays at fp32 rounding of the
    float64 recurrence: the intra-chunk backward sums each level's gate gradient locally (docs/design.md, KDA)."""
    gen = torch.Generator().manual_seed(7)
    B, T, H, K, V = 1, 256, 2, 32, 32
    base = [torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen),
            torch.randn(B, T, H, V, generator=gen), -torch.rand(B, T, H, K, generator=gen) * gate_scale,
            torch.rand(B, T, H, generator=gen)]
    w = torch.randn(B, T, H, V, generator=gen)

    def gate_grad(fn, dtype):
        leaves = [t.to(dtype).clone().requires_grad_() for t in base]
        o, _ = fn(*leaves)
        (o.double() * w.double()).sum().backward()
        return leaves[3].grad.double()

    ref = gate_grad(naive_kda, torch.float64)
    got = gate_grad(chunk_kda_torch, torch.float32)
    assert rel_err(got, ref) < CORE_TOL
    assert rel_err(got.sum(1), ref.sum(1)) < 1e-6


def test_layer_gate_at_lower_bound_finite_grads():
    """Whole layer with the forget gate saturated at -5 (sigmoid == 1 in fp32): finite grads, equal to HF."""
    torch.manual_seed(15)
    cfg = tiny_config()
    ours = Glm53FlashLinearAttention(cfg, layer_idx=0)
    random_init_(ours)
    with torch.no_grad():
        ours.forget_gate.A_log.fill_(6.0)  # exp(6) * (f + dt_bias) >> 17 wherever f + dt_bias > 0.05
        ours.forget_gate.dt_bias.fill_(5.0)
    ref = hf.Glm5NextTextLinearAttention(cfg, layer_idx=0)
    ref.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 70, cfg.hidden_size)
    g = ours.forget_gate(x)
    assert (g == -5.0).float().mean() > 0.99
    _compare_layers(ours, ref, x, build_document_layout(2, 70, "cpu"), None)


# ---------------------------------------------------------------------------------------------------------------------
# Short convolution
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_matches_hf(activation):
    torch.manual_seed(20)
    x = torch.randn(2, 37, 12, requires_grad=True)
    w = torch.randn(12, 4, requires_grad=True)
    y, _ = causal_conv1d_torch(x, w, activation=activation)
    ref = hf.causal_conv1d_fn(x.transpose(1, 2), w, activation=activation).transpose(1, 2)
    # Claim: the same sums of W = 4 products, by another F.conv1d call (ours over a history-padded input, theirs
    # with padding=W-1): fp32 order only, fp32_sum_tol(4). Gradients: d(w) sums B * T = 74 products.
    assert rel_err(y, ref) <= fp32_sum_tol(4)
    dy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad((y * dy).sum(), (x, w)), torch.autograd.grad((ref * dy).sum(), (x, w))):
        assert rel_err(a, b) <= fp32_sum_tol(2 * 37)


def test_conv_bf16_input_computes_in_weight_dtype():
    torch.manual_seed(21)
    x = torch.randn(1, 20, 8).bfloat16()
    w = torch.randn(8, 4)
    y, _ = causal_conv1d_torch(x, w)
    ref = hf.causal_conv1d_fn(x.transpose(1, 2), w, activation="silu").transpose(1, 2)
    assert y.dtype == torch.bfloat16
    # Claim: fp32 maths, then one rounding to bf16. On x.float() ours runs the same F.conv1d on the same fp32 values:
    # bit-equal after the cast. transformers' conv is another F.conv1d call (fp32 order), whose result may round to
    # the neighbouring bf16 value: at most one bf16 ulp (2**-7 of the magnitude) apart.
    assert torch.equal(y, causal_conv1d_torch(x.float(), w)[0].to(torch.bfloat16))
    ulp = torch.finfo(torch.bfloat16).eps * torch.maximum(y.float().abs(), ref.float().abs())
    assert ((y.float() - ref.float()).abs() <= ulp).all()


@pytest.mark.parametrize("with_state", [False, True])
def test_conv_packed_equals_separate(with_state):
    torch.manual_seed(22)
    lengths = [1, 6, 2, 13]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    T, D, W = int(cu[-1]), 10, 4
    x = torch.randn(1, T, D, requires_grad=True)
    w = torch.randn(D, W, requires_grad=True)
    h0 = torch.randn(len(lengths), D, W, requires_grad=True) if with_state else None
    y, ht = causal_conv1d_torch(x, w, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    pieces = [
        causal_conv1d_torch(
            x[:, a:b], w, initial_state=None if h0 is None else h0[n : n + 1], output_final_state=True
        )
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist()))
    ]
    sep_y = torch.cat([p[0] for p in pieces], dim=1)
    sep_ht = torch.cat([p[1] for p in pieces], dim=0)
    # Claim: the same sums of W products; F.conv1d's CPU kernel sums in a length-dependent order, so fp32 order
    # only (not equality): fp32_sum_tol(W). Gradients below: d(w) sums the T products of a channel.
    assert rel_err(y, sep_y) <= fp32_sum_tol(W)
    torch.testing.assert_close(ht, sep_ht, rtol=0, atol=0)
    # isolation, exactly: changing one document's tokens leaves every other document's outputs bit-identical
    x2 = x.detach().clone()
    x2[0, 1:7] += 5.0  # document 1
    y2, _ = causal_conv1d_torch(x2, w, cu_seqlens=cu, initial_state=h0)
    assert torch.equal(y2[0, :1], y[0, :1]) and torch.equal(y2[0, 7:], y[0, 7:])
    assert not torch.equal(y2[0, 1:7], y[0, 1:7])
    leaves = [x, w] + ([h0] if with_state else [])
    dy, dh = torch.randn_like(y), torch.randn_like(ht)
    got = torch.autograd.grad((y * dy).sum() + (ht * dh).sum(), leaves)
    ref = torch.autograd.grad((sep_y * dy).sum() + (sep_ht * dh).sum(), leaves)
    for a, b in zip(got, ref):
        assert rel_err(a, b) <= fp32_sum_tol(T)
    # final state = last W inputs of each document, older slots from the initial state (or zeros)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        prev = h0[n] if with_state else torch.zeros(D, W)
        full = torch.cat([prev, x[0, a:b].t()], dim=1)
        torch.testing.assert_close(ht[n], full[:, -W:], rtol=0, atol=0)


def test_conv_state_continuation_matches_hf_update():
    """conv(prefix) -> state -> conv(rest, initial_state) == conv(whole); decode steps == HF causal_conv1d_update."""
    torch.manual_seed(23)
    x = torch.randn(2, 15, 6)
    w = torch.randn(6, 4)
    full, _ = causal_conv1d_torch(x, w)
    _, state = causal_conv1d_torch(x[:, :9], w, output_final_state=True)
    rest, _ = causal_conv1d_torch(x[:, 9:], w, initial_state=state)
    # Claim: the same sums of W = 4 products, by F.conv1d calls of other lengths (fp32 order only): fp32_sum_tol(4).
    assert rel_err(rest, full[:, 9:]) <= fp32_sum_tol(4)
    # short prefix (shorter than W): the state is zero-padded on the left
    _, state2 = causal_conv1d_torch(x[:, :2], w, output_final_state=True)
    hf_state = torch.zeros(2, 6, 4)
    for t in range(2, 15):
        ours_t, state2 = causal_conv1d_torch(x[:, t : t + 1], w, initial_state=state2, output_final_state=True)
        if t == 2:
            hf.causal_conv1d_update(x[:, :2].transpose(1, 2), hf_state, w)  # fill HF's cache with the prefix
        ref_t = hf.causal_conv1d_update(x[:, t : t + 1].transpose(1, 2), hf_state, w, activation="silu")
        # the states are copies of the inputs (exact); the outputs the same sums of 4 products by other conv calls
        assert rel_err(ours_t, ref_t.transpose(1, 2)) <= fp32_sum_tol(4)
        torch.testing.assert_close(state2, hf_state, rtol=0, atol=0)
        assert rel_err(ours_t, full[:, t : t + 1]) <= fp32_sum_tol(4)


# ---------------------------------------------------------------------------------------------------------------------
# Gate, gated norm, init
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_forget_gate_matches_hf(lower_bound):
    torch.manual_seed(30)
    cfg = tiny_config(linear_lower_bound=lower_bound)
    ours = Glm53FlashForgetGate(cfg)
    random_init_(ours)
    ref = hf.Glm5NextTextForgetGate(cfg)
    ref.load_state_dict(ours.state_dict(), strict=True)
    x = 3.0 * torch.randn(2, 9, cfg.hidden_size)
    g, gr = ours(x), ref(x)
    assert g.dtype == torch.float32 and g.shape == (2, 9, 2, 16)
    assert (g <= 0).all()
    torch.testing.assert_close(g, gr, rtol=1e-6, atol=1e-6)
    w = torch.randn_like(g)
    ga = torch.autograd.grad((g * w).sum(), list(ours.parameters()))
    gb = torch.autograd.grad((gr * w).sum(), list(ref.parameters()))
    for a, b in zip(ga, gb):
        assert rel_err(a, b) < 1e-5


def test_gated_norm_matches_hf():
    torch.manual_seed(31)
    ours = Glm53FlashRMSNormGated(16, eps=1e-5)
    ref = hf.Glm5NextTextRMSNormGated(16, eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_()
    ref.load_state_dict(ours.state_dict(), strict=True)
    for dtype in (torch.float32, torch.bfloat16):
        x, gate = torch.randn(3, 5, 16).to(dtype), torch.randn(3, 5, 16).to(dtype)
        out = ours(x, gate)
        assert out.dtype == dtype
        torch.testing.assert_close(out, ref(x, gate), rtol=0, atol=0)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_init_matches_hf(lower_bound):
    cfg = tiny_config(linear_lower_bound=lower_bound)
    ours, ref = Glm53FlashForgetGate(cfg), hf.Glm5NextTextForgetGate(cfg)
    norm, ref_norm = Glm53FlashRMSNormGated(16), hf.Glm5NextTextRMSNormGated(16)
    with torch.no_grad():
        for p in (norm.weight, ref_norm.weight, ours.A_log, ours.dt_bias):
            p.fill_(7.0)
    stub = hf.Glm5NextPreTrainedModel.__new__(hf.Glm5NextPreTrainedModel)
    object.__setattr__(stub, "config", cfg)
    torch.manual_seed(32)
    hf.Glm5NextPreTrainedModel._init_weights(stub, ref)
    hf.Glm5NextPreTrainedModel._init_weights(stub, ref_norm)
    torch.manual_seed(32)
    init_kda_weights(ours, cfg)
    init_kda_weights(norm, cfg)
    torch.testing.assert_close(ours.A_log, ref.A_log, rtol=0, atol=0)
    torch.testing.assert_close(ours.dt_bias, ref.dt_bias, rtol=0, atol=0)
    torch.testing.assert_close(norm.weight, ref_norm.weight, rtol=0, atol=0)
    dt = torch.nn.functional.softplus(ours.dt_bias)
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 1e-1 * (1 + 1e-5)
    if lower_bound is not None:
        assert (ours.A_log == 0).all()
    else:
        assert (ours.A_log >= 0).all() and (ours.A_log <= math.log(16.0)).all()


# ---------------------------------------------------------------------------------------------------------------------
# Layer parity with transformers
# ---------------------------------------------------------------------------------------------------------------------


def random_init_(module: torch.nn.Module, generator: torch.Generator | None = None) -> None:
    """Random weights of a size that makes every path matter (gate far from saturation, fp32 conv, A_log, dt_bias and
    o_norm not trivial); drawn from ``generator``, or the global generator."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.0, generator=generator))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))
            elif name.endswith("o_norm.weight"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=generator))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1]))


def _compare_layers(ours, ref, x, layout, attention_mask, tol=LAYER_TOL):
    """Outputs on valid positions and every parameter gradient, ours vs HF, relative to the reference's max."""
    x1 = x.clone().requires_grad_()
    x2 = x.clone().requires_grad_()
    out = ours(x1, layout)[0]
    ref_out = ref(x2, attention_mask=attention_mask)
    valid = layout.valid
    assert torch.isfinite(out).all()
    assert rel_err(out[valid], ref_out[valid]) < tol, f"output rel err {rel_err(out[valid], ref_out[valid]):.2e}"
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)) * valid[..., None]
    names = [n for n, _ in ours.named_parameters()]
    ref_params = dict(ref.named_parameters())
    ga = torch.autograd.grad((out * w).sum(), [x1] + [p for _, p in ours.named_parameters()])
    gb = torch.autograd.grad((ref_out * w).sum(), [x2] + [ref_params[n] for n in names])
    for name, a, b in zip(["hidden_states"] + names, ga, gb):
        assert torch.isfinite(a).all(), f"non-finite grad {name}"
        if name == "hidden_states":
            a, b = a[valid], b[valid]
        assert rel_err(a, b) < tol, f"grad {name} rel err {rel_err(a, b):.2e}"


def _layer_pair(seed=40, **cfg_overrides):
    torch.manual_seed(seed)
    cfg = tiny_config(**cfg_overrides)
    ours = Glm53FlashLinearAttention(cfg, layer_idx=0)
    random_init_(ours)
    ref = hf.Glm5NextTextLinearAttention(cfg, layer_idx=0)
    ref.load_state_dict(ours.state_dict(), strict=True)
    # and back: the names and shapes match both ways
    ours.load_state_dict(ref.state_dict(), strict=True)
    return cfg, ours, ref


def test_layer_state_dict_matches_hf():
    cfg, ours, ref = _layer_pair()
    a, b = ours.state_dict(), ref.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, key
    assert a["conv1d.weight"].dtype == torch.float32 and a["conv1d.weight"].shape == (3 * 32, 1, 4)
    assert a["forget_gate.A_log"].dtype == torch.float32 and a["forget_gate.dt_bias"].dtype == torch.float32


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_layer_matches_hf(lower_bound):
    cfg, ours, ref = _layer_pair(linear_lower_bound=lower_bound)
    x = torch.randn(2, 75, cfg.hidden_size)
    _compare_layers(ours, ref, x, build_document_layout(2, 75, "cpu"), None)


def test_layer_left_padding_matches_hf():
    cfg, ours, ref = _layer_pair(seed=41)
    B, S = 3, 70
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :13] = 0
    mask[1, :1] = 0
    x = torch.randn(B, S, cfg.hidden_size)
    layout = build_document_layout(B, S, "cpu", attention_mask=mask)
    assert not layout.trivial
    _compare_layers(ours, ref, x, layout, mask)


def test_layer_nonfinite_padding_does_not_leak():
    """Padding embeddings are replaced (not multiplied) by zero: NaN/inf there reaches no output or gradient."""
    cfg, ours, _ = _layer_pair(seed=43)
    B, S = 2, 40
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :7] = 0
    mask[1, 30:] = 0
    layout = build_document_layout(B, S, "cpu", attention_mask=mask)
    x = torch.randn(B, S, cfg.hidden_size)
    clean = ours(x, layout)[0]
    x_bad = x.clone()
    x_bad[0, :7] = float("nan")
    x_bad[1, 30:] = float("inf")
    x_bad.requires_grad_()
    out = ours(x_bad, layout)[0]
    valid = layout.valid
    assert torch.isfinite(out).all()
    assert torch.equal(out[valid], clean[valid])
    grads = torch.autograd.grad((out * valid[..., None]).sum(), [x_bad] + list(ours.parameters()))
    assert all(torch.isfinite(gr).all() for gr in grads)


def test_layer_packed_equals_separate():
    """position_ids restarting per document (DataCollatorWithFlattening): each document equals it run alone."""
    cfg, ours, _ = _layer_pair(seed=42)
    lengths = [1, 30, 64, 9]
    S = sum(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    x = torch.randn(1, S, cfg.hidden_size, requires_grad=True)
    layout = build_document_layout(1, S, "cpu", position_ids=pos)
    out = ours(x, layout)[0]
    pieces, start = [], 0
    for n in lengths:
        pieces.append(ours(x[:, start : start + n], build_document_layout(1, n, "cpu"))[0])
        start += n
    sep = torch.cat(pieces, dim=1)
    assert rel_err(out, sep) < 1e-5
    w = torch.randn_like(out)
    params = [x] + list(ours.parameters())
    for a, b in zip(torch.autograd.grad((out * w).sum(), params), torch.autograd.grad((sep * w).sum(), params)):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("grad", [False, True])
def test_layer_cached_equals_uncached(grad):
    """With a transformers cache: a left-padded prefill, a multi-token continuation, then one-token decode steps (the
    recurrent step from the cached states) give the uncached forward's outputs at the real tokens, with and without
    autograd; the cache holds transformers' layout (conv state [B, 3*H*K, W] in the projections' dtype, fp32
    recurrent state [B, H, K, V])."""
    cfg, ours, _ = _layer_pair(seed=45)
    B, S = 2, 14
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, :3] = 0
    x = torch.randn(B, S, cfg.hidden_size)
    cache = DynamicCache(config=cfg)
    with torch.set_grad_enabled(grad):
        full = ours(x, build_document_layout(B, S, "cpu", attention_mask=mask))[0]
        parts = []
        for a, b in ((0, 8), (8, 11), (11, 12), (12, 13), (13, 14)):
            layout = build_document_layout(B, b - a, "cpu", attention_mask=mask[:, a:b])
            parts.append(ours(x[:, a:b], layout, cache=cache)[0])
    got = torch.cat(parts, dim=1)
    assert got.requires_grad == grad
    valid = mask.bool()
    assert rel_err(got[valid], full[valid]) < 1e-5
    conv_state, state = cache.layers[0].conv_states[0], cache.layers[0].recurrent_states[0]
    assert conv_state.shape == (B, 3 * 32, 4) and conv_state.dtype == x.dtype
    assert state.shape == (B, 2, 16, 16) and state.dtype == torch.float32
    # the last W conv inputs, up to the projections' summation order (decode steps project one token at a time, a
    # GEMM of another shape): sums of hidden_size products, fp32_sum_tol(hidden_size)
    mixed = torch.cat([ours.q_proj(x[:, -4:]), ours.k_proj(x[:, -4:]), ours.v_proj(x[:, -4:])], dim=-1)
    assert rel_err(conv_state, mixed.transpose(1, 2)) <= fp32_sum_tol(cfg.hidden_size)


def test_layer_core_stays_fp32_under_autocast():
    """Inside torch.autocast(bf16) the projections run in bf16 but the conv and KDA core keep fp32 maths."""
    torch.manual_seed(44)
    q, k, v, g, beta, _ = (t.detach() for t in make_inputs(1, 50, 2, 16, 16, n_states=1))
    ref, _ = chunk_kda_torch(q, k, v, g, beta)
    ref_rec, _ = recurrent_kda_torch(q[:, :5], k[:, :5], v[:, :5], g[:, :5], beta[:, :5])
    x, w = torch.randn(1, 30, 12), torch.randn(12, 4)
    ref_conv, _ = causal_conv1d_torch(x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, _ = chunk_kda_torch(q, k, v, g, beta)
        o_rec, _ = recurrent_kda_torch(q[:, :5], k[:, :5], v[:, :5], g[:, :5], beta[:, :5])
        y, _ = causal_conv1d_torch(x, w)
    assert o.dtype == torch.float32 and y.dtype == torch.float32
    # autocast is switched off inside (graph_ops.autocast_off): the same fp32 ops on the same inputs, bit-equal
    assert torch.equal(o, ref) and torch.equal(o_rec, ref_rec) and torch.equal(y, ref_conv)


def test_layer_rejects_cache_and_fused_backend_falls_back():
    cfg, ours, _ = _layer_pair()
    x = torch.randn(1, 5, cfg.hidden_size)
    layout = build_document_layout(1, 5, "cpu")
    with pytest.raises(NotImplementedError):
        ours(x, layout, cache=object())
    with pytest.raises(ValueError, match="layout"):
        ours(x, build_document_layout(1, 6, "cpu"))
    import glm53flash_hf.dispatch as dispatch

    fused = Glm53FlashLinearAttention(tiny_config(kernels={"kda": "fused"}), layer_idx=0)
    fused.load_state_dict(ours.state_dict())
    dispatch._warned.clear()
    with pytest.warns(UserWarning, match="kernels\\['kda'\\]='fused'.*cannot run"):
        out, _, _ = fused(x, layout)
    assert torch.equal(out, ours(x, layout)[0])  # fell back to the torch path


# ---------------------------------------------------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------------------------------------------------


def test_bad_inputs_raise():
    q, k, v, g, beta, h0 = (t.detach() for t in make_inputs(1, 10, 2, 16, 16, n_states=1))
    with pytest.raises(ValueError, match="beta"):
        chunk_kda_torch(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="g must be"):
        chunk_kda_torch(q, k, v, g[..., :8], beta)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda_torch(q, k, v, g, beta, chunk_size=48)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda_torch(q, k, v, g, beta, initial_state=h0[:, :1])
    with pytest.raises(ValueError, match="strictly increasing"):
        chunk_kda_torch(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 4, 10]))
    with pytest.raises(ValueError, match="end at T"):
        chunk_kda_torch(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_kda_torch(*(torch.cat([t, t]) for t in (q, k, v, g, beta)), cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="initial_state"):  # N documents, not B rows
        chunk_kda_torch(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 10]), initial_state=h0)
    x = torch.randn(1, 10, 8)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_torch(x, torch.randn(7, 4))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_torch(x, torch.randn(8, 4), activation="gelu")
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d_torch(x, torch.randn(8, 4), initial_state=torch.randn(1, 8, 3))
