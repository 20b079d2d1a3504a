"""Tests of glm53flash_hf/mhc.py and mhc_ops.py (torch path): hc_pre (HyperConnection), Sinkhorn, hc_post, head,
expansion, init.

Oracles: transformers' ``Glm5NextTextHyperConnection`` / ``Glm5NextTextHyperHead`` with the same weights, the
``hc_post`` formula of ``Glm5NextTextDecoderLayer.forward`` (written out below), and a float64 reference of the
whole ``hc_pre`` written here from the maths.
"""

import pytest
import torch
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection, Glm5NextTextHyperHead

from glm53flash_hf.configuration_glm53flash import Glm53FlashTextConfig
from glm53flash_hf.dispatch import op_for
from glm53flash_hf.mhc import Glm53FlashHyperConnection, init_mhc_weights
from glm53flash_hf.mhc_ops import hc_expand, hc_head, hc_post_torch, hc_pre_torch, sinkhorn_normalize

D, N = 64, 4


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny shapes: one intra-op thread (more only add OpenMP barrier waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_config(**overrides):
    fields = dict(hidden_size=D, hc_mult=N, hc_eps=1e-6, hc_sinkhorn_iters=20, rms_norm_eps=1e-5, num_hidden_layers=2)
    fields.update(overrides)
    return Glm5NextTextConfig(**fields)


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def make_pair(fn_std=0.02, dtype=torch.float32, seed=0, **overrides):
    """Our site and transformers' with the same weights: fn ~ N(0, fn_std), base ~ N(0, 1), scale ~ U(0.5, 2)."""
    config = make_config(**overrides)
    ours = Glm53FlashHyperConnection(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        ours.fn.normal_(std=fn_std)
        ours.base.normal_()
        ours.scale.uniform_(0.5, 2.0)
    ref = Glm5NextTextHyperConnection(config)
    ref.load_state_dict(ours.state_dict(), strict=True)
    ours.fn.data = ours.fn.data.to(dtype)
    ref.fn.data = ref.fn.data.to(dtype)
    return ours, ref


def reference_hc_pre_f64(x, fn, base, scale, iters, hc_eps, norm_eps):
    """hc_pre from the formulas, in float64, with a hand-written softmax and explicit Sinkhorn rounds."""
    x, fn, base, scale = (t.double() for t in (x, fn, base, scale))
    b, s, n, d = x.shape
    flat = x.reshape(b, s, n * d)
    normed = flat / torch.sqrt((flat * flat).mean(dim=-1, keepdim=True) + norm_eps)
    mixes = normed @ fn.T
    pre = 1.0 / (1.0 + torch.exp(-(mixes[..., :n] * scale[0] + base[:n]))) + hc_eps
    post = 2.0 / (1.0 + torch.exp(-(mixes[..., n : 2 * n] * scale[1] + base[n : 2 * n])))
    logits = (mixes[..., 2 * n :] * scale[2] + base[2 * n :]).reshape(b, s, n, n)
    e = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
    comb = e / e.sum(dim=-1, keepdim=True) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre[..., None] * x).sum(dim=2)
    return post, comb, collapsed


def hf_hc_post(y, residual, post, comb):
    """The two hc_post lines of Glm5NextTextDecoderLayer.forward (dtype = the residual stream dtype)."""
    dtype = residual.dtype
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), residual)


# ------------------------------------------------------------------------------------------------------------ hc_pre


@pytest.mark.parametrize("batch,seq", [(2, 37), (1, 1)])  # (1, 1): a decoding step, same torch path
def test_hc_pre_matches_hf_fp32(batch, seq):
    ours, ref = make_pair()
    torch.manual_seed(1)
    x = torch.randn(batch, seq, N, D) * 3
    with torch.set_grad_enabled(seq > 1):
        got, want = ours(x), ref(x)
    assert [t.dtype for t in got] == [torch.float32, torch.float32, torch.float32]
    assert [tuple(t.shape) for t in got] == [(batch, seq, N), (batch, seq, N, N), (batch, seq, D)]
    for name, a, b in zip(("post", "comb", "collapsed"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # measured: post 2.4e-7, comb 1.2e-7 absolute; collapsed 1.9e-6 absolute at values up to 15 (1.3e-7 relative)


@pytest.mark.parametrize("fn_std", [0.1, 0.5])
def test_hc_pre_as_accurate_as_hf_with_large_mixes(fn_std):
    """With large projections (|mixes| ~ 8) both implementations carry fp32 rounding of a few 1e-6; ours (rsqrt folded
    after the GEMM) must be as close to the float64 truth as transformers' is."""
    ours, ref = make_pair(fn_std=fn_std, seed=2)
    torch.manual_seed(3)
    x = torch.randn(2, 37, N, D)
    truth = reference_hc_pre_f64(x, ours.fn, ours.base, ours.scale, 20, 1e-6, 1e-5)
    for a, b, t in zip(ours(x), ref(x), truth):
        # mean error (stable statistic; over 20 seeds the ratio ours/HF was 0.85-1.27) and max error (0.6-2.1)
        mean_ours, mean_hf = (a.double() - t).abs().mean().item(), (b.double() - t).abs().mean().item()
        max_ours, max_hf = (a.double() - t).abs().max().item(), (b.double() - t).abs().max().item()
        assert mean_ours <= 1.5 * mean_hf, (mean_ours, mean_hf)
        assert max_ours <= 3 * max_hf, (max_ours, max_hf)


def test_hc_pre_matches_float64_reference():
    ours, _ = make_pair(fn_std=0.3, seed=4)
    ours = ours.double()
    torch.manual_seed(5)
    x = torch.randn(2, 9, N, D, dtype=torch.float64)
    got = ours(x)
    want = reference_hc_pre_f64(x, ours.fn, ours.base, ours.scale, 20, 1e-6, 1e-5)
    for name, a, b in zip(("post", "comb", "collapsed"), got, want):
        assert a.dtype == torch.float64, name
        assert (a - b).abs().max().item() < 1e-10, name


def test_hc_pre_bf16_matches_hf():
    """bf16 streams and bf16 fn (model dtype bf16): transformers projects in fp32 on exactly converted values, so only
    fp32 rounding separates the two (post/comb within 1e-6); the collapsed input is rounded to bf16 once, from fp32
    values within ~5e-7 relative of each other, so it agrees bit for bit except where a value sits on a bf16
    rounding boundary (then 1 ulp)."""
    ours, ref = make_pair(dtype=torch.bfloat16, seed=6)
    assert ours.fn.dtype == torch.bfloat16 and ours.base.dtype == ours.scale.dtype == torch.float32
    torch.manual_seed(7)
    x = (torch.randn(2, 64, N, D) * 2).to(torch.bfloat16)
    (post, comb, coll), (post_r, comb_r, coll_r) = ours(x), ref(x)
    assert post.dtype == comb.dtype == torch.float32 and coll.dtype == torch.bfloat16
    torch.testing.assert_close(post, post_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, comb_r, rtol=1e-5, atol=1e-6)
    ulp = torch.finfo(torch.bfloat16).eps * coll_r.float().abs().clamp_min(1e-30)
    assert ((coll.float() - coll_r.float()).abs() <= ulp).all()
    assert (coll != coll_r).float().mean().item() < 1e-3  # measured: 1 of 8192 differs (by 1 ulp)


def test_hc_pre_grads_match_hf():
    ours, ref = make_pair(fn_std=0.1, seed=8)
    torch.manual_seed(9)
    x = torch.randn(2, 13, N, D)
    g_post, g_comb, g_coll = torch.randn(2, 13, N), torch.randn(2, 13, N, N), torch.randn(2, 13, D)
    grads = []
    for module in (ours, ref):
        xi = x.clone().requires_grad_()
        post, comb, coll = module(xi)
        loss = (post * g_post).sum() + (comb * g_comb).sum() + (coll * g_coll).sum()
        grads.append(torch.autograd.grad(loss, (xi, module.fn, module.base, module.scale)))
    for name, a, b in zip(("X", "fn", "base", "scale"), *grads):
        assert rel_err(a, b) < 1e-4, (name, rel_err(a, b))  # measured <= 5.4e-7


def test_sinkhorn_doubly_stochastic():
    ours, _ = make_pair(fn_std=0.02, seed=10)  # init-scale projection; base ~ N(0, 1), scale up to 2
    x = torch.randn(3, 17, N, D)
    _, comb, _ = ours(x)
    assert (comb > 0).all()
    # the last step normalises columns (sums 1 - O(hc_eps)); rows converge over the 19 rounds (measured 1.2e-6).
    # With near one-hot softmax rows (|logits| >> 1, e.g. fn std 0.5) 19 rounds leave row sums off by ~6e-2, in
    # transformers' implementation as in ours: that is the algorithm, not a tolerance issue.
    assert (comb.sum(-2) - 1).abs().max() < 1e-5
    assert (comb.sum(-1) - 1).abs().max() < 1e-5
    # not symmetric in general (hc_post must use the transpose)
    assert (comb - comb.transpose(-1, -2)).abs().max() > 1e-3
    # the function on its own: one iteration is one column normalisation
    raw = torch.rand(5, N, N) + 0.1
    torch.testing.assert_close(sinkhorn_normalize(raw, 1, 0.0), raw / raw.sum(-2, keepdim=True))


def test_hc_pre_identity_weights():
    """With fn = 0, base = 0, scale = [1, 0, 0]: comb = 1/N, post = 1, pre = 0.5 + eps."""
    config = make_config()
    site = Glm53FlashHyperConnection(config)
    with torch.no_grad():
        site.scale.copy_(torch.tensor([1.0, 0.0, 0.0]))
    x = torch.randn(1, 3, N, D)
    post, comb, coll = site(x)
    torch.testing.assert_close(post, torch.ones(1, 3, N))
    torch.testing.assert_close(comb, torch.full((1, 3, N, N), 1.0 / N), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(coll, (0.5 + 1e-6) * x.sum(2))


def test_hc_pre_non_contiguous_streams():
    ours, _ = make_pair(seed=11)
    x = torch.randn(2, 5, D).unsqueeze(2).expand(-1, -1, N, -1)  # what hc_expand would give without .contiguous()
    for a, b in zip(ours(x), ours(x.contiguous())):
        assert torch.equal(a, b)


def test_hc_pre_errors():
    ours, _ = make_pair()
    with pytest.raises(ValueError, match="hc_mult"):
        ours(torch.randn(2, 3, N + 1, D))
    with pytest.raises(ValueError, match=r"\[B, S, N, D\]"):
        hc_pre_torch(torch.randn(3, N, D), ours.fn, ours.base, ours.scale, sinkhorn_iters=20, hc_eps=1e-6,
                     norm_eps=1e-5)
    with pytest.raises(ValueError, match="fn must be"):
        hc_pre_torch(torch.randn(1, 2, N, D + 1), ours.fn, ours.base, ours.scale, sinkhorn_iters=20, hc_eps=1e-6,
                     norm_eps=1e-5)
    with pytest.raises(ValueError, match="backend"):
        op_for(hc_pre_torch, "triton", torch.randn(1, 2, N, D), ours.fn, ours.base, ours.scale)
    with pytest.raises(ValueError, match="hc_sinkhorn_iters"):
        Glm53FlashHyperConnection(make_config(hc_sinkhorn_iters=0))


@pytest.mark.parametrize("kernels,ok", [("torch", True), ({"mhc": "auto"}, True), ({"mhc": "fused"}, False)])
def test_backend_from_package_config(kernels, ok):
    """Our config class (with ``kernels``) drives the same site; on CPU tensors "fused" cannot run (the fused mHC is
    CUDA-only): it warns and falls back to the torch path."""
    config = Glm53FlashTextConfig(hidden_size=D, hc_mult=N, num_hidden_layers=2, kernels=kernels)
    site = Glm53FlashHyperConnection(config)
    baseline, _ = make_pair()  # our site on transformers' config
    site.load_state_dict(baseline.state_dict(), strict=True)
    x = torch.randn(1, 3, N, D)
    import glm53flash_hf.dispatch as dispatch

    dispatch._warned.clear()
    if ok:
        assert all(torch.equal(a, b) for a, b in zip(site(x), baseline(x)))
    else:  # CPU tensors: the fused kernels cannot run; warns once, runs the torch path
        with pytest.warns(UserWarning, match="cannot run"):
            assert all(torch.equal(a, b) for a, b in zip(site(x), baseline(x)))


# ----------------------------------------------------------------------------------------------------------- hc_post


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_bit_equal_to_hf(dtype):
    ours, _ = make_pair(fn_std=0.3, seed=12)
    torch.manual_seed(13)
    residual = torch.randn(2, 11, N, D).to(dtype)
    post, comb, _ = ours(residual)
    post, comb = post.detach(), comb.detach()
    y = torch.randn(2, 11, D).to(dtype)
    inputs = [t.clone().requires_grad_() for t in (y, residual, post, comb)]
    inputs_ref = [t.clone().requires_grad_() for t in (y, residual, post, comb)]
    out = hc_post_torch(*inputs)
    out_ref = hf_hc_post(*inputs_ref)
    assert out.dtype == dtype and out.shape == (2, 11, N, D)
    assert torch.equal(out, out_ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    out_ref.backward(grad)
    for a, b in zip(inputs, inputs_ref):
        assert torch.equal(a.grad, b.grad)
    # the transpose matters: comb[i, j] feeds input stream i into output stream j
    wrong = post.to(dtype)[..., None] * y[..., None, :] + torch.matmul(comb.to(dtype), residual)
    assert not torch.allclose(out.float(), wrong.float(), atol=1e-2)


def test_hc_post_mixed_dtypes_follow_hf_promotion():
    torch.manual_seed(14)
    residual = torch.randn(1, 3, N, D, dtype=torch.bfloat16)
    y = torch.randn(1, 3, D)  # fp32 sub-block output
    post, comb = torch.rand(1, 3, N), torch.rand(1, 3, N, N)
    out = hc_post_torch(y, residual, post, comb)
    assert out.dtype == torch.float32
    assert torch.equal(out, hf_hc_post(y, residual, post, comb))


def test_hc_post_errors():
    with pytest.raises(ValueError, match="hc_post shapes"):
        hc_post_torch(torch.randn(1, 2, D), torch.randn(1, 2, N, D), torch.randn(1, 2, N), torch.randn(1, 2, N, N + 1))
    with pytest.raises(ValueError, match="backend"):
        op_for(hc_post_torch, "triton", torch.randn(1, 2, D), torch.randn(1, 2, N, D))


# ------------------------------------------------------------------------------------------------ head, expand, init


def test_hc_head_and_expand():
    torch.manual_seed(15)
    x = torch.randn(2, 5, N, D)
    assert torch.equal(hc_head(x), Glm5NextTextHyperHead()(x))
    emb = torch.randn(2, 5, D, dtype=torch.bfloat16)
    streams = hc_expand(emb, N)
    assert streams.shape == (2, 5, N, D) and streams.is_contiguous() and streams.dtype == torch.bfloat16
    assert all(torch.equal(streams[:, :, i], emb) for i in range(N))
    streams[:, :, 0] += 1  # streams do not alias each other
    assert torch.equal(streams[:, :, 1], emb)
    with pytest.raises(ValueError):
        hc_expand(emb, 0)
    with pytest.raises(ValueError):
        hc_head(emb)


def test_init_mhc_weights_and_dtypes():
    config = make_config(initializer_range=0.5)  # fn uses a fixed 0.02, not initializer_range
    site = Glm53FlashHyperConnection(config)
    assert site.fn.shape == ((2 + N) * N, N * D) and site.base.shape == ((2 + N) * N,) and site.scale.shape == (3,)
    assert site.base.dtype == site.scale.dtype == torch.float32
    with torch.no_grad():
        site.base.fill_(3.0)
        site.scale.fill_(3.0)
    init_mhc_weights(site, config)
    assert abs(site.fn.std().item() - 0.02) < 0.002 and abs(site.fn.mean().item()) < 0.002
    assert torch.equal(site.base, torch.zeros_like(site.base))
    assert torch.equal(site.scale, torch.ones(3))
    assert set(site.state_dict()) == set(Glm5NextTextHyperConnection(config).state_dict()) == {"fn", "base", "scale"}

