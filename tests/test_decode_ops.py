"""Decode-step shortcuts (issue 5): each equals the general path it replaces.

Oracles: the module call / the general torch code path of the same function (forced with grad mode on, or with an
input the shortcut does not take), and float64 evaluations where the shortcut may round differently.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from glm53flash_hf import decode_ops
from glm53flash_hf.decode_ops import call_linear, numpy_ok, plain_module, small_rms_norm
from glm53flash_hf.dsa import sparse_mla_torch, stable_topk_indices
from glm53flash_hf.packing import build_document_layout


def test_call_linear_same_bits_and_respects_hooks_and_wrappers():
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(16, 8, bias=True)
    x = torch.randn(3, 16, generator=g)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            assert torch.equal(call_linear(lin, x), lin(x))
    assert plain_module(lin, nn.Linear)
    # a forward hook must run: the module is called
    seen = []
    handle = lin.register_forward_hook(lambda m, i, o: seen.append(1))
    assert not plain_module(lin, nn.Linear)
    call_linear(lin, x)
    assert seen == [1]
    handle.remove()
    # accelerate-style patched forward on the instance
    lin.forward = lambda t: torch.zeros(t.shape[0], 8)
    assert torch.equal(call_linear(lin, x), torch.zeros(3, 8))
    del lin.forward
    # a global hook
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(2))
    try:
        call_linear(lin, x)
        assert seen[-1] == 2
    finally:
        handle.remove()
    # a subclass (e.g. a PEFT LoRA layer) is always called as a module
    class Sub(nn.Linear):
        def forward(self, t):
            return super().forward(t) + 1

    sub = Sub(16, 8)
    assert torch.equal(call_linear(sub, x), sub(x))


def test_call_linear_lora_at_init_reproduces_base_bits():
    peft = pytest.importorskip("peft")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(16, 16, bias=False)
            self.o_proj = nn.Linear(16, 16, bias=False)

        def forward(self, x):
            return call_linear(self.o_proj, torch.tanh(call_linear(self.q_proj, x)))

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(2, 16)
    with torch.no_grad():
        base = net(x)
    wrapped = peft.get_peft_model(net, peft.LoraConfig(target_modules=["q_proj"], r=2))
    with torch.no_grad():
        assert torch.equal(wrapped(x), base)


def test_numpy_ok_conditions():
    x = torch.randn(1, 64)
    w = torch.randn(64)
    with torch.no_grad():
        assert numpy_ok(x, w)
        assert not numpy_ok(x.double(), w)
        assert not numpy_ok(x, w.bfloat16())
        assert not numpy_ok(torch.randn(decode_ops.SMALL_NUMEL + 1), w)
    assert not numpy_ok(x, w)  # grad mode on: always the torch path


@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 4, 48), (4, 128)])
def test_small_rms_norm_matches_torch_and_float64(shape):
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=g) * 3
    w = torch.rand(shape[-1], generator=g) + 0.5
    with torch.no_grad():
        fast = small_rms_norm(x, w, 1e-5)
        fast_nw = small_rms_norm(x, None, 1e-5)
    ref = F.rms_norm(x, (shape[-1],), w, 1e-5)
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert fast.dtype == torch.float32 and fast.shape == x.shape
    tol = 4 * torch.finfo(torch.float32).eps * float(exact.abs().max())
    assert float((fast - ref).abs().max()) <= tol
    assert float((fast.double() - exact).abs().max()) <= tol
    torch.testing.assert_close(fast_nw * w, fast, rtol=2e-7, atol=0)
    # grad mode: the torch function itself
    assert torch.equal(small_rms_norm(x, w, 1e-5), ref)


def _torch_topk(scores, k):
    with torch.enable_grad():  # numpy_ok is False with grad mode on: the torch path
        return stable_topk_indices(scores, k)


@pytest.mark.parametrize("trial", range(12))
def test_stable_topk_numpy_equals_torch_path(trial, monkeypatch):
    import glm53flash_hf.dsa as dsa_mod

    calls = []
    real = dsa_mod._stable_topk_numpy
    monkeypatch.setattr(dsa_mod, "_stable_topk_numpy", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(trial)
    rows, num = [(1, 1), (1, 3), (2, 1)][trial % 3], [7, 64, 513][trial % 3]
    scores = torch.randn(*rows, num, generator=g).relu()  # many exact ties at 0
    scores = torch.where(torch.rand(*rows, num, generator=g) < 0.3, torch.full_like(scores, float("-inf")), scores)
    if trial % 4 == 0:
        scores[..., : num // 2] = 0.5  # a long tie run
    k = [1, 3, num // 2, num][trial % 4]
    with torch.no_grad():
        fast = stable_topk_indices(scores, k)
    ref = _torch_topk(scores, k)
    assert calls == [1], "the numpy path was not taken"
    assert fast.dtype == ref.dtype == torch.long
    assert torch.equal(fast, ref), (trial, fast, ref)


def test_stable_topk_with_nan_takes_torch_path():
    scores = torch.tensor([[0.1, float("nan"), 0.3, 0.3]])
    with torch.no_grad():
        assert torch.equal(stable_topk_indices(scores, 2), _torch_topk(scores, 2))


@pytest.mark.parametrize("batch,seq", [(1, 1), (2, 1), (1, 3)])
def test_sparse_mla_numpy_matches_torch_and_float64(batch, seq, monkeypatch):
    import glm53flash_hf.dsa as dsa_mod

    calls = []
    real = dsa_mod._sparse_mla_numpy
    monkeypatch.setattr(dsa_mod, "_sparse_mla_numpy", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(batch * 10 + seq)
    heads, dim, kv_len, width = 4, 32, 40, 12
    q = torch.randn(batch, seq, heads, dim, generator=g)
    lat = torch.randn(batch, kv_len, dim, generator=g)
    idx = torch.randint(0, kv_len, (batch, seq, width), generator=g)
    idx[..., -3:] = -1  # padding
    idx[0, 0, 0] = kv_len + 5  # out of range: skipped like padding
    if seq > 1:
        idx[0, 1] = -1  # a query without any valid id
    with torch.no_grad():
        out, lse = sparse_mla_torch(q, lat, idx, 0.3)
    with torch.enable_grad():
        ref_out, ref_lse = sparse_mla_torch(q, lat, idx, 0.3)
        exact_out, exact_lse = sparse_mla_torch(q.double(), lat.double(), idx, 0.3)
    assert calls == [1], "the numpy path was taken once (no_grad) and only then"
    assert out.dtype == lse.dtype == torch.float32 and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out, ref_out, rtol=0, atol=2e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=2e-6)
    torch.testing.assert_close(out.double(), exact_out, rtol=0, atol=2e-6)
    if seq > 1:
        assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1])) and bool(torch.isneginf(lse[0, 1]).all())


@pytest.mark.parametrize("mask", [None, [[1], [0], [1]], [[1], [1], [1]]])
def test_single_token_layout_equals_general_builder(mask):
    mask = None if mask is None else torch.tensor(mask)
    fast = build_document_layout(3, 1, "cpu", attention_mask=mask)
    # position_ids of a single token never split anything, but send the builder down its general path
    general = build_document_layout(3, 1, "cpu", attention_mask=mask, position_ids=torch.zeros(3, 1, dtype=torch.long))
    for field in ("valid", "doc_start", "local_pos", "seq_idx", "cu_seqlens", "segment_valid"):
        a, b = getattr(fast, field), getattr(general, field)
        assert a.dtype == b.dtype and torch.equal(a, b), field
    assert (fast.max_seqlen, fast.trivial, fast.batch_size, fast.seq_len) == (
        general.max_seqlen, general.trivial, general.batch_size, general.seq_len
    )


def test_cache_context_without_mask_equals_all_ones_mask():
    from transformers import DynamicCache

    from glm53flash_hf import Glm53FlashConfig
    from glm53flash_hf.generation_cache import build_cache_context

    root = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))
    config = Glm53FlashConfig.from_pretrained(f"{root}/configuration/tiny.json").get_text_config()
    cache = DynamicCache(config=config)
    for seq in (1, 5):
        fast = build_cache_context(cache, 2, seq, torch.device("cpu"))
        general = build_cache_context(cache, 2, seq, torch.device("cpu"), attention_mask=torch.ones(2, seq))
        assert fast.past == general.past and fast.seq_len == general.seq_len
        for field in ("valid", "first", "positions", "local_pos"):
            a, b = getattr(fast, field), getattr(general, field)
            assert a.dtype == b.dtype and torch.equal(a, b), field
