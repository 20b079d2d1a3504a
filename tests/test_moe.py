"""Tests of glm53flash_hf/moe.py and moe_ops.py (torch path): clamped SwiGLU, dense MLP, router, grouped experts,
MoE block, PEFT on 3-D experts.

Oracles: transformers' ``glm5_next`` modules with the same weights (``Glm5NextTextMLP``, ``Glm5NextTextTopkRouter``,
``Glm5NextTextExperts`` with the eager loop, ``Glm5NextTextMoE``) and a float64 loop-over-experts reference
written here. Parity target in fp32: 1e-5 relative (max abs error / max abs value) for outputs and gradients.
"""

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import (
    Glm5NextTextExperts,
    Glm5NextTextMLP,
    Glm5NextTextMoE,
    Glm5NextTextTopkRouter,
)

import glm53flash_hf.modeling_glm53flash as modeling_module
from glm53flash_hf.configuration_glm53flash import Glm53FlashTextConfig
from glm53flash_hf.dispatch import op_for
from glm53flash_hf.modeling_glm53flash import Glm53FlashExperts, Glm53FlashMoE, init_moe_weights
from glm53flash_hf.moe import Glm53FlashMLP, Glm53FlashTopkRouter
from glm53flash_hf.moe_ops import clamped_swiglu, experts_forward_torch

H, I, E, K = 32, 16, 8, 3  # noqa: E741  hidden, expert width (2I != H so a layout mix-up cannot pass), experts, top-k


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny shapes: one intra-op thread, as in tests/test_mhc.py."""
    threads, _ = torch.get_num_threads(), torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_config(impl="eager", **overrides):
    fields = dict(
        hidden_size=H,
        intermediate_size=48,
        moe_intermediate_size=I,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        swiglu_limit=1.0,
        num_hidden_layers=2,
    )
    fields.update(overrides)
    config = Glm5NextTextConfig(**fields)
    config._experts_implementation = impl
    return config


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def random_routing(num_tokens, num_experts, k, generator=None):
    """Distinct expert ids per token (as top-k gives) and positive weights."""
    idx = torch.stack([torch.randperm(num_experts, generator=generator)[:k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, k, generator=generator) + 0.1
    return idx, weights


def reference_experts_f64(x, idx, weights, gate_up, down, limit):
    """Float64 loop over experts: y_t = sum_j w_tj * down_e (act(gate_up_e x_t)), e = idx_tj."""
    x, weights, gate_up, down = (t.double() for t in (x, weights, gate_up, down))
    out = torch.zeros_like(x)
    inter = down.shape[-1]
    for e in range(gate_up.shape[0]):
        tok, slot = torch.where(idx == e)
        if tok.numel() == 0:
            continue
        h = x[tok] @ gate_up[e].T
        gate, up = h[:, :inter], h[:, inter:]
        if limit is not None:
            gate = gate.clamp(max=limit)
            up = up.clamp(-limit, limit)
        y = (F.silu(gate) * up) @ down[e].T
        out = out.index_add(0, tok, y * weights[tok, slot, None])
    return out


def init_all(module, config, seed=0):
    torch.manual_seed(seed)
    for sub in module.modules():
        init_moe_weights(sub, config)
        if isinstance(sub, nn.Linear):
            nn.init.normal_(sub.weight, std=0.2)


# --------------------------------------------------------------------------------------------------- SwiGLU / MLP


def test_clamped_swiglu_formula():
    torch.manual_seed(0)
    gate, up = torch.randn(2, 50) * 5, torch.randn(2, 50) * 5
    got = clamped_swiglu(gate, up, 2.0)
    want = F.silu(torch.minimum(gate, torch.tensor(2.0))) * up.clamp(-2.0, 2.0)
    assert torch.equal(got, want)
    assert not torch.allclose(got, F.silu(gate) * up)  # the clamp is active on these inputs
    assert torch.equal(clamped_swiglu(gate, up, None), F.silu(gate) * up)


@pytest.mark.parametrize("intermediate", [None, 24])
def test_mlp_matches_hf(intermediate):
    config = make_config(swiglu_limit=0.5)
    ours, ref = Glm53FlashMLP(config, intermediate), Glm5NextTextMLP(config, intermediate)
    init_all(ours, config)
    ref.load_state_dict(ours.state_dict(), strict=True)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, 5, H, requires_grad=True)
    y = ours(x)
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y), retain_graph=True)
    y.sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    y_ref = ref(x_ref)
    y_ref.sum().backward()
    assert torch.equal(y, y_ref)
    assert torch.equal(gx, x_ref.grad)
    for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    # the clamp mattered
    plain = ours.down_proj(F.silu(ours.gate_proj(x)) * ours.up_proj(x))
    assert rel_err(plain, y) > 1e-2


def test_mlp_rejects_other_activation():
    with pytest.raises(ValueError, match="hidden_act"):
        Glm53FlashMLP(make_config(hidden_act="gelu"))


# ------------------------------------------------------------------------------------------------------------ router


@pytest.mark.parametrize(
    "n_group,topk_group,k,num_experts,norm",
    [(1, 1, 3, 8, True), (4, 2, 4, 16, True), (4, 3, 5, 16, False), (2, 1, 2, 8, True)],
)
def test_router_matches_hf_exactly(n_group, topk_group, k, num_experts, norm):
    config = make_config(
        n_group=n_group, topk_group=topk_group, num_experts_per_tok=k, n_routed_experts=num_experts, norm_topk_prob=norm
    )
    ours, ref = Glm53FlashTopkRouter(config), Glm5NextTextTopkRouter(config)
    torch.manual_seed(1)
    with torch.no_grad():
        ours.weight.normal_(std=0.3)
        ours.e_score_correction_bias.normal_(std=0.2)
    assert "e_score_correction_bias" in ours.state_dict()
    ref.load_state_dict(ours.state_dict(), strict=True)
    assert ours.weight.dtype == torch.float32 and ours.e_score_correction_bias.dtype == torch.float32
    x = torch.randn(3, 21, H, dtype=torch.bfloat16)
    logits, weights, idx = ours(x)
    logits_ref, weights_ref, idx_ref = ref(x)
    assert logits.dtype == weights.dtype == torch.float32 and idx.dtype == torch.long
    assert logits.shape == (63, num_experts) and idx.shape == weights.shape == (63, k)
    assert torch.equal(logits, logits_ref)
    assert torch.equal(idx, idx_ref)
    assert torch.equal(weights, weights_ref)
    # the same result from a [T, H] input
    assert torch.equal(ours(x.view(-1, H))[2], idx)
    # the bias steered the choice, the weights come from the un-biased scores
    scores = torch.sigmoid(logits)
    assert not torch.equal(torch.sort(scores.topk(k)[1])[0], torch.sort(idx)[0])
    expected = scores.gather(1, idx)
    if norm:
        expected = expected / (expected.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(weights, expected * 2.5, rtol=1e-6, atol=0)
    if n_group > 1:
        # every chosen expert lies in one of topk_group groups, and the group limit changed some choices
        groups = idx // (num_experts // n_group)
        assert all(len(set(row.tolist())) <= topk_group for row in groups)
        unrestricted = torch.topk(scores + ours.e_score_correction_bias, k)[1]
        assert not torch.equal(torch.sort(unrestricted)[0], torch.sort(idx)[0])


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(n_routed_experts=8, n_group=3), "n_group"),
        (dict(n_routed_experts=8, n_group=8, topk_group=2), "fewer than 2"),
        (dict(n_routed_experts=8, n_group=2, topk_group=3), "topk_group"),
        (dict(n_routed_experts=8, n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok"),
    ],
)
def test_router_rejects_bad_config(fields, match):
    with pytest.raises(ValueError, match=match):
        Glm53FlashTopkRouter(make_config(**fields))


# ----------------------------------------------------------------------------------------------------------- experts


def _experts_pair(impl="eager", limit=1.0, seed=0):
    ours = Glm53FlashExperts(make_config(impl, swiglu_limit=limit))
    ref = Glm5NextTextExperts(make_config("eager", swiglu_limit=limit))
    torch.manual_seed(seed)
    with torch.no_grad():
        ours.gate_up_proj.normal_(std=0.3)
        ours.down_proj.normal_(std=0.3)
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref


def _experts_grads(module, x, idx, w, grad_out):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    y = module(x, idx, w)
    grads = torch.autograd.grad(y, (x, w, module.gate_up_proj, module.down_proj), grad_out)
    return y, grads


@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
def test_experts_match_hf_eager_and_float64(impl):
    ours, ref = _experts_pair(impl)
    torch.manual_seed(2)
    num_tokens = 40
    x = torch.randn(num_tokens, H)
    idx, w = random_routing(num_tokens, E, K)
    idx[:5] = torch.tensor([0, 1, 2])  # expert 7 may stay empty, experts 0..2 get more rows
    grad_out = torch.randn(num_tokens, H)
    y, grads = _experts_grads(ours, x, idx, w, grad_out)
    y_ref, grads_ref = _experts_grads(ref, x, idx, w, grad_out)

    # float64 reference and its gradients
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    gu64 = ours.gate_up_proj.detach().double().requires_grad_()
    dn64 = ours.down_proj.detach().double().requires_grad_()
    y64 = reference_experts_f64(x64, idx, w64, gu64, dn64, 1.0)
    grads64 = torch.autograd.grad(y64, (x64, w64, gu64, dn64), grad_out.double())

    assert y.dtype == torch.float32 and y.shape == (num_tokens, H)
    assert rel_err(y, y64) < 1e-5 and rel_err(y, y_ref) < 1e-5
    for name, g, g_ref, g64 in zip(("x", "weights", "gate_up_proj", "down_proj"), grads, grads_ref, grads64):
        assert rel_err(g, g64) < 1e-5, name
        assert rel_err(g, g_ref) < 1e-5, name
    # the clamp mattered (limit 1.0 against projections of std ~1.7)
    y_noclamp = reference_experts_f64(x, idx, w, ours.gate_up_proj.detach(), ours.down_proj.detach(), None)
    assert rel_err(y_noclamp, y64) > 0.05


def test_experts_float64_runs_the_fallback():
    """float64 experts (no native grouped GEMM for Double) equal the float64 loop-over-experts reference."""
    ours, _ = _experts_pair("eager")
    ours = ours.double()
    torch.manual_seed(3)
    x = torch.randn(24, H, dtype=torch.float64)
    idx, w = random_routing(24, E, K)
    y = ours(x, idx, w.double())
    y64 = reference_experts_f64(x, idx, w.double(), ours.gate_up_proj.detach(), ours.down_proj.detach(), 1.0)
    assert y.dtype == torch.float64
    assert rel_err(y, y64) < 1e-12


def test_experts_implementations_agree():
    """transformers' grouped_mm and batched_mm (dispatched by the decorator) and our own forward agree."""
    results = {}
    torch.manual_seed(3)
    x = torch.randn(33, H)
    idx, w = random_routing(33, E, K)
    for impl in ("eager", "grouped_mm", "batched_mm"):
        ours, _ = _experts_pair(impl, seed=5)
        results[impl] = _experts_grads(ours, x, idx, w, torch.ones(33, H))
    for impl in ("grouped_mm", "batched_mm"):
        assert rel_err(results[impl][0], results["eager"][0]) < 1e-6
        for g, g_ref in zip(results[impl][1], results["eager"][1]):
            assert rel_err(g, g_ref) < 1e-5


def test_experts_decorator_is_literal():
    # transformers enables grouped_mm dispatch by grepping the model classes' module for the literal decorator
    assert "@use_experts_implementation" in inspect.getsource(modeling_module)
    ours = Glm53FlashExperts(make_config())
    assert ours.has_gate and not ours.is_transposed and not ours._is_expert_parallel
    assert tuple(ours.gate_up_proj.shape) == (E, 2 * I, H) and tuple(ours.down_proj.shape) == (E, H, I)


def test_experts_odd_sizes_and_sentinels():
    """Sizes that are not 16-byte multiples take the fallback op; ids >= E are dropped when asked (EP sentinels)."""
    torch.manual_seed(4)
    gate_up = torch.randn(4, 12, 10) * 0.3
    down = torch.randn(4, 10, 6) * 0.3
    x = torch.randn(7, 10)
    idx = torch.tensor([[0, 4], [4, 1], [2, 3], [4, 4], [1, 2], [3, 0], [0, 1]])
    w = torch.rand(7, 2)
    y = experts_forward_torch(x, idx, w, gate_up, down, 0.7, drop_out_of_range=True)
    keep = idx < 4
    y64 = reference_experts_f64(x, idx.masked_fill(~keep, 99), w * keep, gate_up, down, 0.7)
    assert rel_err(y, y64) < 1e-5
    assert torch.equal(y[3], torch.zeros(10))
    # empty batch
    empty = experts_forward_torch(torch.zeros(0, 10), idx[:0], w[:0], gate_up, down, 0.7)
    assert empty.shape == (0, 10)


@pytest.mark.parametrize("tokens,drop", [(1, False), (2, False), (2, True)])
def test_experts_decode_sized(tokens, drop):
    """A few tokens (a decoding step) take the same grouped path; with an expert-parallel sentinel too."""
    gen = torch.Generator().manual_seed(tokens * 10 + drop)
    ours, _ = _experts_pair(seed=tokens)
    x = torch.randn(tokens, H, generator=gen)
    idx, w = random_routing(tokens, E, K, generator=gen)
    if drop:
        idx[0, 0] = E  # contributes nothing
    with torch.no_grad():
        y = experts_forward_torch(x, idx, w, ours.gate_up_proj, ours.down_proj, 1.0, drop_out_of_range=drop)
    keep = idx < E
    y64 = reference_experts_f64(x, idx.masked_fill(~keep, 99), w * keep, ours.gate_up_proj, ours.down_proj, 1.0)
    assert y.shape == (tokens, H) and rel_err(y, y64) < 1e-5


def test_experts_input_errors():
    ours, _ = _experts_pair()
    x = torch.randn(4, H)
    idx, w = random_routing(4, E, K)
    with pytest.raises(ValueError, match="backend"):
        op_for(experts_forward_torch, "triton", x, ours.gate_up_proj, ours.down_proj, w)
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        ours(x[None], idx, w)
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        ours(x, idx, w[:, :1])


@pytest.mark.parametrize("kernels,ok", [("torch", True), ({"moe": "auto"}, True), ({"moe": "fused"}, False)])
def test_backend_from_package_config(kernels, ok):
    """Our config class (with ``kernels``) drives the same modules; on CPU tensors "fused" cannot run (the fused MoE
    is CUDA-only): it warns and falls back to the torch path."""
    fields = dict(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
                  swiglu_limit=1.0, num_hidden_layers=2, kernels=kernels)
    ours = Glm53FlashMoE(Glm53FlashTextConfig(**fields))
    baseline, _ = _moe_pair()  # our module on transformers' config
    ours.load_state_dict(baseline.state_dict(), strict=True)
    x = torch.randn(2, 3, H)
    import glm53flash_hf.dispatch as dispatch

    dispatch._warned.clear()
    if ok:
        assert torch.equal(ours(x), baseline(x))
    else:  # CPU tensors: the fused kernel cannot run; warns once, runs the torch path
        with pytest.warns(UserWarning, match="cannot run"):
            assert torch.equal(ours(x), baseline(x))


# --------------------------------------------------------------------------------------------------------- MoE block


def _moe_pair(dtype=torch.float32):
    config = make_config()
    ours, ref = Glm53FlashMoE(config), Glm5NextTextMoE(config)
    init_all(ours, config)
    with torch.no_grad():
        ours.gate.weight.normal_(std=0.3)
        ours.experts.gate_up_proj.normal_(std=0.3)
        ours.experts.down_proj.normal_(std=0.3)
        ours.gate.e_score_correction_bias.normal_(std=0.1)
    ref.load_state_dict(ours.state_dict(), strict=True)
    ours.load_state_dict(ref.state_dict(), strict=True)
    assert sorted(ours.state_dict()) == sorted(ref.state_dict())
    return ours, ref


def test_moe_matches_hf():
    ours, ref = _moe_pair()
    torch.manual_seed(6)
    x = torch.randn(2, 11, H)
    outs, grads = [], []
    for module in (ours, ref):
        xi = x.clone().requires_grad_()
        y = module(xi)
        y.backward(torch.ones_like(y) + torch.linspace(0, 1, H))
        outs.append(y)
        grads.append({"x": xi.grad, **{n: p.grad for n, p in module.named_parameters()}})
    assert outs[0].shape == x.shape
    assert rel_err(outs[0], outs[1]) < 1e-5
    assert set(grads[0]) == set(grads[1])
    for name in grads[0]:
        assert grads[0][name] is not None, name
        assert rel_err(grads[0][name], grads[1][name]) < 1e-5, name
    # router logits on request; nothing stored on the module
    out, logits = ours(x, return_router_logits=True)
    assert torch.equal(out, ours(x))
    assert logits.shape == (22, E) and logits.dtype == torch.float32
    assert torch.equal(logits, ref.gate(x)[0])


def test_moe_bf16_close_to_fp32():
    ours, ref = _moe_pair()
    torch.manual_seed(7)
    x = torch.randn(2, 16, H)
    y32 = ours(x)
    for module in (ours, ref):  # model in bf16, router kept fp32 as _keep_in_fp32_modules_strict does
        module.experts.to(torch.bfloat16)
        module.shared_experts.to(torch.bfloat16)
    xb = x.to(torch.bfloat16).requires_grad_()
    yb = ours(xb)
    yb.float().square().sum().backward()
    assert yb.dtype == torch.bfloat16 and torch.isfinite(yb).all() and torch.isfinite(xb.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)
    # bf16 keeps ~3 significant digits; inputs, weights, GEMM outputs and the clamp are rounded
    assert rel_err(yb, y32) < 2e-2
    # HF's eager loop rounds every expert contribution to bf16 before adding; ours adds the k contributions in fp32
    # and rounds once (as transformers' grouped_mm does): 1-2 bf16 ulps from eager, bit-equal to grouped_mm
    assert rel_err(yb, ref(x.to(torch.bfloat16))) < 2e-2
    ref.experts.config._experts_implementation = "grouped_mm"
    assert torch.equal(yb, ref(x.to(torch.bfloat16)))


# -------------------------------------------------------------------------------------------------------------- PEFT


class _Wrapper(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.mlp = Glm53FlashMoE(config)

    def forward(self, x):
        return self.mlp(x)


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_peft_lora_on_3d_experts(impl):
    peft = pytest.importorskip("peft")
    config = make_config(impl)
    model = _Wrapper(config)
    init_all(model, config)
    with torch.no_grad():
        model.mlp.gate.weight.normal_(std=0.3)
    torch.manual_seed(8)
    x = torch.randn(2, 9, H)
    base = model(x).detach()
    lora = peft.LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], r=2,
                           target_modules=[])
    pm = peft.get_peft_model(model, lora)
    assert torch.equal(pm(x), base)  # identity at init (lora_B = 0)
    lora_params = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    # gate_up_proj [E, 2I, H]: A maps H -> r*E, B maps r*E -> 2I; down_proj [E, H, I]: A maps I -> r*E, B -> H
    shapes = sorted(tuple(p.shape) for p in lora_params.values())
    assert shapes == sorted([(2 * E, H), (2 * I, 2 * E), (2 * E, I), (H, 2 * E)])
    with torch.no_grad():
        for name, p in lora_params.items():
            if "lora_B" in name:
                p.normal_(std=0.5)
    y = pm(x)
    assert rel_err(y, base) > 1e-3
    y.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_params.values())
    assert all(p.grad is None for n, p in pm.named_parameters() if not p.requires_grad)
    # merging the adapters into the 3-D weights reproduces the adapted forward (layout [E, out, in] respected)
    merged = pm.merge_and_unload()
    assert isinstance(merged.mlp.experts, Glm53FlashExperts)
    assert rel_err(merged(x), y.detach()) < 1e-5


# -------------------------------------------------------------------------------------------------------------- init


def test_init_moe_weights():
    config = make_config(initializer_range=0.05, n_routed_experts=16)
    module = Glm53FlashMoE(config)
    with torch.no_grad():
        module.gate.e_score_correction_bias.fill_(1.0)
    for sub in module.modules():
        init_moe_weights(sub, config)
    for tensor in (module.experts.gate_up_proj, module.experts.down_proj, module.gate.weight):
        assert abs(tensor.mean().item()) < 0.01
        assert abs(tensor.std().item() - 0.05) < 0.005
    assert torch.equal(module.gate.e_score_correction_bias, torch.zeros(16))
    assert module.gate.weight.dtype == torch.float32



def test_model_experts_implementation_default_is_ours_and_switches():
    """A model with nothing requested runs our experts forward ("eager", not transformers' grouped_mm default);
    set_experts_implementation / experts_implementation= pick transformers' implementations, which agree."""
    from unittest.mock import Mock, patch

    from ckpt_fixtures import tiny_config
    from transformers.integrations.moe import batched_mm_experts_forward, grouped_mm_experts_forward

    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM

    config = tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"],
                         mlp_layer_types=["dense", "sparse"], indexer_types=["full", "full"]).get_text_config()
    torch.manual_seed(0)
    model = Glm53FlashForCausalLM(config).eval()
    assert model.config._experts_implementation == "eager"
    assert Glm53FlashForCausalLM._can_set_experts_implementation()
    ids = torch.randint(0, 2000, (2, 12))
    mocks = {name: Mock(wraps=fn) for name, fn in (("grouped_mm", grouped_mm_experts_forward),
                                                   ("batched_mm", batched_mm_experts_forward))}
    with torch.no_grad(), patch.dict("transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS._global_mapping", mocks):
        ours = model(ids).logits
        assert not any(m.called for m in mocks.values())
        for impl in ("grouped_mm", "batched_mm"):
            model.set_experts_implementation(impl)
            assert model(ids) is not None and mocks[impl].called
    with torch.no_grad():
        for impl in ("grouped_mm", "batched_mm", "eager"):
            model.set_experts_implementation(impl)
            assert model.config._experts_implementation == impl
            assert rel_err(model(ids).logits, ours) < 1e-5, impl
