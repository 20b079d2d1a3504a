"""Generation with the hybrid cache: ``generate`` equals the uncached forward, step by step.

Model: ``configuration/tiny.json`` (KDA, full and shared DSA, MoE, mHC, vision tower) with 8 indexer heads (2 heads
tie on relu zeros), randomised (``tests/tiny.py``: KPool gate/ape random, so the selection is non-degenerate),
written by transformers' own ``Glm5NextForConditionalGeneration`` and loaded by our classes. ``index_topk`` 16 and
``index_kpool`` 4: every prompt here is longer than the dense budget ``16 + 3`` tokens, so the DSA selection is
really sparse on every decode step (checked), and decoding crosses several pool completions.

Oracles: our uncached full forward over the generated sequence (itself checked against transformers in
``test_parity.py`` / ``test_vl.py``) and transformers' uncached glm5_next forward on the same weights.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from tiny import fp64_error_tol, randomize_, rel_err
from transformers import DynamicCache, GenerationConfig, StaticCache

from glm53flash_hf.modeling_glm53flash import CACHE_FIELD

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4
PAD = 2000
IMG, BOI, EOI, BOV, EOV = 2016, 2010, 2011, 2012, 2013  # tiny.json special tokens
PATCH_DIM = 3 * 2 * 14 * 14


def _tiny_raw():
    with open(os.path.join(ROOT, "configuration", "tiny.json")) as f:
        raw = json.load(f)
    raw["text_config"]["index_n_heads"] = 8
    raw["text_config"]["num_nextn_predict_layers"] = 0  # transformers' glm5_next has no MTP layer (unused here)
    return raw


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers reference VL model, our VL model, our text-only causal LM), same weights."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM, Glm53FlashForConditionalGeneration

    raw = _tiny_raw()
    raw.pop("architectures", None)
    config = Glm5NextConfig(**raw)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = Glm5NextForConditionalGeneration(config).float().eval()
    randomize_(hf, seed=5)
    folder = tmp_path_factory.mktemp("gen_tiny")
    hf.save_pretrained(folder)
    vl = Glm53FlashForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    lm = Glm53FlashForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for m in (vl, lm):
        m.generation_config.eos_token_id = None  # random weights: never stop early
        m.generation_config.pad_token_id = PAD
    return hf, vl, lm


def _text(gen, n):
    return torch.randint(1, 1990, (n,), generator=gen).tolist()


def _greedy(model, input_ids, n, **kwargs):
    cfg = GenerationConfig(
        max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True,
        pad_token_id=PAD,
    )
    with torch.no_grad():
        return model.generate(input_ids, generation_config=cfg, **kwargs)


def _check_against_full_forward(model, out, prompt_len, ref_model=None, **inputs):
    """Greedy tokens = argmax of the uncached forward over the generated sequence; each step's logits within TOL."""
    seq = out.sequences
    with torch.no_grad():
        full = model(input_ids=seq, use_cache=False, **inputs).logits
    steps = torch.stack(out.logits, dim=1)  # [B, n, V]
    n = steps.shape[1]
    ref = full[:, prompt_len - 1 : prompt_len - 1 + n]
    err = rel_err(steps, ref)
    assert err < TOL, err
    assert torch.equal(ref.argmax(-1), seq[:, prompt_len:])
    if ref_model is not None:
        with torch.no_grad():
            hf_full = ref_model(input_ids=seq, use_cache=False, **inputs).logits
        hf_err = rel_err(steps, hf_full[:, prompt_len - 1 : prompt_len - 1 + n])
        assert hf_err < TOL, hf_err
    return err


def _image_tokens(h, w):
    return [BOI] + [IMG] * (h * w // 4) + [EOI]


def _vl_prompt(kind, seed):
    gen = torch.Generator().manual_seed(seed)
    ids, kwargs = _text(gen, 9), {}
    if kind == "image":
        grid = torch.tensor([[1, 4, 4]])
        ids += _image_tokens(4, 4) + _text(gen, 6)
        kwargs = dict(pixel_values=torch.randn(16, PATCH_DIM, generator=gen), image_grid_thw=grid)
    else:
        grid = torch.tensor([[2, 4, 2]])
        ids += [BOV]
        for i in range(2):
            ids += _image_tokens(4, 2) + [150 + i, 151]
        ids += [EOV] + _text(gen, 5)
        kwargs = dict(pixel_values_videos=torch.randn(16, PATCH_DIM, generator=gen), video_grid_thw=grid)
    ids += _text(gen, 12)
    return torch.tensor([ids]), kwargs


# ---------------------------------------------------------------------------------------------------------------------
# generate == uncached forward
# ---------------------------------------------------------------------------------------------------------------------


def test_text_greedy_equals_uncached_forward_and_selection_is_sparse(models):
    hf, _, lm = models
    prompt = torch.tensor([_text(torch.Generator().manual_seed(1), 41)])
    out = _greedy(lm, prompt, 14)
    assert out.sequences.shape == (1, 55)
    _check_against_full_forward(lm, out, 41, ref_model=hf)
    # The DSA selection is really sparse: at the last query, fewer ids than the causal prefix.
    layer = lm.model.layers[2].self_attn
    from glm53flash_hf.packing import build_document_layout

    seq = out.sequences
    with torch.no_grad():
        x = lm.model.embed_tokens(seq)
        ids = layer.indexer(x, layer.q_a_layernorm(layer.q_a_proj(x)), build_document_layout(1, seq.shape[1], "cpu"))
    counts = (ids >= 0).sum(-1)[0]
    assert int(counts[-1]) <= 16 + 3 < seq.shape[1]


@pytest.mark.parametrize("kind", ["image", "video"])
def test_vl_greedy_equals_uncached_forward(models, kind):
    hf, vl, _ = models
    prompt, kwargs = _vl_prompt(kind, seed=3)
    out = _greedy(vl, prompt, 10, **kwargs)
    _check_against_full_forward(vl, out, prompt.shape[1], ref_model=hf, **kwargs)


def test_left_padded_batch_equals_each_prompt_alone(models):
    _, _, lm = models
    gen = torch.Generator().manual_seed(7)
    prompts = [_text(gen, n) for n in (41, 27, 22)]
    width = max(map(len, prompts))
    ids = torch.full((3, width), PAD)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    n = 11
    batch = _greedy(lm, ids, n, attention_mask=mask)
    static = _greedy(lm, ids, n, attention_mask=mask, cache_implementation="static")
    static_cache, batch_cache = getattr(static, CACHE_FIELD), getattr(batch, CACHE_FIELD)
    assert isinstance(static_cache, StaticCache) and isinstance(batch_cache, DynamicCache)
    assert [type(layer).__name__ for layer in static_cache.layers[:3]] == [
        "LinearAttentionLayer", "LinearAttentionLayer", "StaticIndexedLayer"
    ]
    assert torch.equal(static.sequences, batch.sequences)
    assert rel_err(torch.stack(static.logits, 1), torch.stack(batch.logits, 1)) < TOL
    for i, p in enumerate(prompts):
        alone = _greedy(lm, torch.tensor([p]), n)
        assert torch.equal(batch.sequences[i, width:], alone.sequences[0, len(p) :])
        err = rel_err(torch.stack([lg[i] for lg in batch.logits]), torch.stack([lg[0] for lg in alone.logits]))
        assert err < TOL, (i, err)


def test_static_cache_equals_uncached_forward(models):
    _, _, lm = models
    prompt = torch.tensor([_text(torch.Generator().manual_seed(2), 30)])
    out = _greedy(lm, prompt, 9, cache_implementation="static")
    _check_against_full_forward(lm, out, 30)


# ---------------------------------------------------------------------------------------------------------------------
# Cache mechanics
# ---------------------------------------------------------------------------------------------------------------------


def _decode(lm, cache, last_logits, steps, mask=None):
    """Greedy manual decode from a filled cache; returns the stacked step logits [B, steps, V]."""
    logits, outs = last_logits, []
    for _ in range(steps):
        tok = logits.argmax(-1, keepdim=True)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
        logits = lm(input_ids=tok, cache=cache, use_cache=True, attention_mask=mask).logits[:, -1]
        outs.append(logits)
    return torch.stack(outs, 1)


@torch.no_grad()
def test_chunked_prefill_equals_single_prefill(models):
    _, _, lm = models
    ids = torch.tensor([_text(torch.Generator().manual_seed(4), 38)] * 2)
    ids[1, :5] = torch.tensor(_text(torch.Generator().manual_seed(9), 5))  # two different rows
    one = DynamicCache(config=lm.config)
    ref = lm(input_ids=ids, cache=one, use_cache=True).logits
    many = DynamicCache(config=lm.config)
    parts = []
    for a, b in [(0, 7), (7, 8), (8, 21), (21, 38)]:  # chunk ends inside pools, a 1-token chunk, a pool-aligned end
        parts.append(lm(input_ids=ids[:, a:b], cache=many, use_cache=True).logits)
    assert rel_err(torch.cat(parts, 1), ref) < TOL
    for i, (l1, l2) in enumerate(zip(one.layers, many.layers)):
        if lm.config.get_text_config(decoder=True).layer_types[i] == "linear_attention":
            assert rel_err(l2.conv_states[0], l1.conv_states[0]) < TOL
            assert rel_err(l2.recurrent_states[0], l1.recurrent_states[0]) < TOL
        else:
            assert l2.keys.shape == l1.keys.shape and rel_err(l2.keys, l1.keys) < TOL
            if l1.is_indexer_initialized:
                assert rel_err(l2.indexer_keys, l1.indexer_keys) < TOL
    # ... and decoding continues identically, equal to the uncached forward.
    d1 = _decode(lm, one, ref[:, -1], 9)
    d2 = _decode(lm, many, ref[:, -1], 9)
    assert rel_err(d2, d1) < TOL


@torch.no_grad()
def test_indexer_state_holds_pool_keys_and_survives_steps(models):
    """The cached pool keys equal the pools of the uncached maths; cached ids equal the uncached ids, per step."""
    from glm53flash_hf.generation_cache import build_cache_context
    from glm53flash_hf.packing import build_document_layout

    _, _, lm = models
    attn = lm.model.layers[2].self_attn
    idx = attn.indexer
    gen = torch.Generator().manual_seed(11)
    B, S, D = 2, 45, lm.config.get_text_config().hidden_size
    x = torch.randn(B, S, D, generator=gen)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, :6] = 0  # row 1 left padded: its pools start at position 6
    qr = attn.q_a_layernorm(attn.q_a_proj(x))
    want = idx(x, qr, build_document_layout(B, S, "cpu", attention_mask=mask))
    cache = DynamicCache(config=lm.config)
    got, start = [], 0
    for end in [20, 21, 22, 23, 24, 25, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45]:
        ctx = build_cache_context(cache, B, end - start, "cpu", attention_mask=mask[:, :end])
        cache.update(torch.zeros(B, 1, end - start, 1), torch.zeros(B, 1, end - start, 0), 2)
        got.append(idx.forward_cached(x[:, start:end], qr[:, start:end], cache, ctx))
        start = end
    got = torch.cat(got, 1)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    # sparse: some queries see fewer ids than their causal prefix
    assert bool(((want >= 0).sum(-1) < torch.arange(1, S + 1)).any())
    # slots 0..P-1 of the state hold the complete pool keys (computed once, never re-pooled)
    state = cache.layers[2].indexer_keys
    idx64 = copy.deepcopy(idx).double()
    for b, first in [(0, 0), (1, 6)]:
        n = (S - first) // 4
        pools = {}
        for m in (idx, idx64):
            xm = x.to(m.wk.weight.dtype)
            k, g = m.k_norm(m.wk(xm)), torch.nn.functional.linear(xm, m.index_kpool_compress_gate)
            kk = k[b, first : first + 4 * n].view(n, 4, -1)
            gg = g[b, first : first + 4 * n].view(n, 4, -1) + m.index_kpool_compress_ape
            pools[xm.dtype] = (gg.softmax(1) * kk).sum(1)
        # Claim: the cached keys are these pools evaluated in fp32 by other kernels (GEMMs over each call's tokens, a
        # softmax over gathered slots), so not bit-equal. Bound: 4x the error of the fp32 recomputation against
        # float64, measured here (it includes the softmax's amplification: logits up to ~15 turn their rounding into
        # relative weight errors ~15 u).
        tol = fp64_error_tol(pools[torch.float32], pools[torch.float64])
        assert rel_err(state[b, :n, : idx.head_dim], pools[torch.float64]) <= tol, (b, tol)


@torch.no_grad()
def test_decode_is_a_single_step_update(models, monkeypatch):
    """After the prefill, a decode step runs neither the chunked KDA (only its recurrent step) nor the uncached indexer,
    and never calls kv_b_proj (the MLA cache stays compressed; absorbed attention over the selected latents)."""
    import glm53flash_hf.dsa as dsa
    import glm53flash_hf.kda as kda

    _, _, lm = models
    prompt = torch.tensor([_text(torch.Generator().manual_seed(12), 33)])
    cache = DynamicCache(config=lm.config)
    first = lm(input_ids=prompt, cache=cache, use_cache=True).logits[:, -1]

    def forbidden(*args, **kwargs):
        raise AssertionError("prefill maths in a decode step")

    monkeypatch.setattr(kda, "chunk_kda_torch", forbidden)
    monkeypatch.setattr(dsa.Glm53FlashIndexer, "forward", forbidden)
    calls = []
    hooks = [
        m.kv_b_proj.register_forward_hook(lambda *a: calls.append(1))
        for m in lm.modules()
        if isinstance(m, dsa.Glm53FlashAttention)
    ]
    try:
        steps = _decode(lm, cache, first, 6)
    finally:
        for h in hooks:
            h.remove()
    assert not calls
    seq = torch.cat([prompt, first.argmax(-1, keepdim=True), steps[:, :-1].argmax(-1)], dim=1)
    monkeypatch.undo()
    full = lm(input_ids=seq, use_cache=False).logits[:, 32:]
    assert rel_err(torch.cat([first[:, None], steps], 1), full) < TOL
    assert cache.layers[0].recurrent_states[0].dtype == torch.float32
    assert cache.layers[0].conv_states[0].shape == (1, 3 * 2 * 16, 4)
    assert cache.layers[2].keys.shape == (1, 1, 33 + 6, 32)


def test_sampling_and_stopping_work_as_any_hf_model(models):
    _, _, lm = models
    prompt = torch.tensor([_text(torch.Generator().manual_seed(13), 25)])
    with torch.no_grad():
        torch.manual_seed(0)
        a = lm.generate(prompt, max_new_tokens=6, do_sample=True, top_k=20, temperature=0.9)
        torch.manual_seed(0)
        b = lm.generate(prompt, max_new_tokens=6, do_sample=True, top_k=20, temperature=0.9, use_cache=False)
        assert torch.equal(a, b)
        greedy = _greedy(lm, prompt, 6).sequences
        stop = int(greedy[0, 25 + 2])
        stopped = lm.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=stop)
    assert stopped.shape[1] <= 25 + 3 and int(stopped[0, -1]) == stop


@torch.no_grad()
def test_cache_rejects_packed_documents_and_bad_masks(models):
    _, _, lm = models
    ids = torch.tensor([_text(torch.Generator().manual_seed(14), 12)])
    with pytest.raises(ValueError, match="packed"):
        lm(input_ids=ids, use_cache=True, cu_seq_lens_q=torch.tensor([0, 5, 12]))
    with pytest.raises(ValueError, match="packed"):
        lm(input_ids=ids, use_cache=True, position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]]))
    with pytest.raises(ValueError, match="left padding"):
        lm(input_ids=ids, use_cache=True, attention_mask=torch.tensor([[1] * 6 + [0] * 6]))
    with pytest.raises(NotImplementedError):
        lm(input_ids=ids, cache=object())
    # use_cache=False keeps the packed path
    out = lm(input_ids=ids, use_cache=False, cu_seq_lens_q=torch.tensor([0, 5, 12]))
    assert getattr(out, CACHE_FIELD) is None
