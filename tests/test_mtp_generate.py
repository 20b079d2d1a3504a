"""MTP self-speculative decoding through transformers' assisted decoding: ``generate(use_mtp=True)``.

Model: ``configuration/tiny.json`` (KDA, full and shared DSA, MoE, mHC, one MTP layer, vision tower), randomised
(``tests/tiny.py``), fp32. A random MTP layer drafts badly (acceptance ~0), so the "drafty" variant
(:func:`tiny.drafty_`) scales every layer's output projections by ``eps`` and makes the MTP layer read the next
token's embedding through an identity ``eh_proj`` block: the main model then mostly predicts from the current
token and the MTP layer mostly predicts the same thing one step later, so drafts are both accepted and rejected,
with all KDA / DSA / MoE / mHC paths active.

Oracles: plain greedy ``generate`` (token for token), the MTP layer's uncached forward (depth 1 of
``mtp_forward``), and caches that never saw the rejected tokens.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_fixtures import tiny_config
from tiny import drafty_, randomize_, rel_err
from transformers import DynamicCache

from glm53flash_hf.generation_cache import Glm53FlashIndexedCacheLayer, Glm53FlashKDACacheLayer, make_croppable
from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM, Glm53FlashForConditionalGeneration
from glm53flash_hf.packing import build_document_layout

PAD, IMG, BOI, EOI = 2000, 2016, 2010, 2011
PATCH_DIM = 3 * 2 * 14 * 14
# fp32 rounding of the same maths over a different number of rows (a 3-token call vs a 1-token one); a missed
# rollback moves the states by O(1) (checked below)
STATE_TOL = 1e-5


def _ready(model):
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.generation_config.pad_token_id = PAD
    return model.float().eval()


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    model = Glm53FlashForCausalLM(tiny_config())
    randomize_(model, seed=5)
    return _ready(model)


@pytest.fixture(scope="module")
def drafty():
    torch.manual_seed(0)
    model = Glm53FlashForCausalLM(tiny_config())
    randomize_(model, seed=5)
    return _ready(drafty_(model, 0.05))


def _prompt(n, seed):
    return torch.randint(1, 1990, (1, n), generator=torch.Generator().manual_seed(seed))


def _pair(model, prompt, n, **kwargs):
    """(plain greedy, MTP greedy) sequences, and the MTP stats."""
    with torch.no_grad():
        plain = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)
        mtp = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_mtp=True, **kwargs)
    return plain, mtp, dict(model.mtp_stats)


def _count_mtp_calls(model):
    text = getattr(model.model, "language_model", model.model)
    calls = []
    handle = text.layers[text.config.num_hidden_layers].register_forward_hook(
        lambda _m, args, _out: calls.append(args)
    )
    return calls, handle


# ---------------------------------------------------------------------------------------------------------------------
# greedy equality
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("plen", [2, 23])
def test_random_model_greedy_equals_plain_greedy(lm, plen):
    """A random MTP layer: nearly every draft is rejected, so every step rolls the caches back."""
    prompt = _prompt(plen, seed=plen)
    calls, handle = _count_mtp_calls(lm)
    try:
        plain, mtp, stats = _pair(lm, prompt, 12)
    finally:
        handle.remove()
    assert torch.equal(plain, mtp), (plain[0, plen:].tolist(), mtp[0, plen:].tolist())
    assert stats["drafted"] >= 6 and stats["mtp_calls"] == len(calls) == stats["drafted"]


@pytest.mark.parametrize("plen", [2, 9])
def test_drafty_model_accepts_drafts_and_greedy_equals_plain(drafty, plen):
    """Drafts accepted and rejected in one run (prompt of 2 tokens: pool 0 of the KPool indexer completes on a
    draft); output identical to plain greedy; fewer main forwards than tokens."""
    prompt = _prompt(plen, seed=plen)
    plain, mtp, stats = _pair(drafty, prompt, 16)
    assert torch.equal(plain, mtp), (plain[0, plen:].tolist(), mtp[0, plen:].tolist())
    assert 0 < stats["accepted"] < stats["drafted"], stats
    assert stats["acceptance_rate"] > 0.2, stats


def test_image_prompt_greedy_equals_plain_and_mtp_sees_image_features():
    torch.manual_seed(0)
    vl = Glm53FlashForConditionalGeneration(tiny_config())
    randomize_(vl, seed=5)
    vl = _ready(drafty_(vl, 0.05))
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 1990, (9,), generator=gen).tolist() + [BOI] + [IMG] * 4 + [EOI]
    ids += torch.randint(1, 1990, (6,), generator=gen).tolist()
    prompt = torch.tensor([ids])
    kwargs = dict(pixel_values=torch.randn(16, PATCH_DIM, generator=gen), image_grid_thw=torch.tensor([[1, 4, 4]]))
    calls, handle = _count_mtp_calls(vl)
    try:
        plain, mtp, stats = _pair(vl, prompt, 10, **kwargs)
    finally:
        handle.remove()
    assert torch.equal(plain, mtp), (plain[0, prompt.shape[1]:].tolist(), mtp[0, prompt.shape[1]:].tolist())
    assert stats["accepted"] > 0 and stats["mtp_calls"] == len(calls)
    # the MTP prefill reads the embedding of token t + 1: the vision features at the placeholders, not embed(IMG)
    embeds = calls[0][0][0]  # [S, D]
    with torch.no_grad():
        features = torch.cat(vl.model.get_image_features(**kwargs).pooler_output)
    img = [t - 1 for t in range(1, prompt.shape[1]) if ids[t] == IMG]
    assert torch.equal(embeds[img], features.to(embeds.dtype))


# ---------------------------------------------------------------------------------------------------------------------
# sampling, errors
# ---------------------------------------------------------------------------------------------------------------------


def test_sampling_runs_speculative_sampling_with_a_fixed_seed(drafty):
    prompt = _prompt(9, seed=4)
    out = []
    with torch.no_grad():
        for _ in range(2):
            torch.manual_seed(0)
            out.append(drafty.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=True, top_k=20,
                                       temperature=0.9, use_mtp=True))
    assert torch.equal(out[0], out[1]) and out[0].shape == (1, 19)
    assert torch.equal(out[0][:, :9], prompt)
    assert bool(((out[0] >= 0) & (out[0] < drafty.config.get_text_config().vocab_size)).all())
    assert drafty.mtp_stats["drafted"] > 0


def test_use_mtp_without_mtp_layer_raises():
    model = _ready(Glm53FlashForCausalLM(tiny_config(num_nextn_predict_layers=0)))
    with pytest.raises(ValueError, match=r"use_mtp=True.*num_nextn_predict_layers=0, expected >= 1"):
        model.generate(_prompt(5, 0), max_new_tokens=3, use_mtp=True)


# ---------------------------------------------------------------------------------------------------------------------
# rollback and the MTP layer's own cache
# ---------------------------------------------------------------------------------------------------------------------


def _cache(model, record: bool):
    cache = make_croppable(DynamicCache(config=model.config.get_text_config(decoder=True)))
    if record:
        cache.activate_past_recording()
    return cache


@pytest.mark.parametrize("plen", [2, 7])
def test_crop_restores_kda_and_indexer_states(lm, plen):
    """Prefill, a 3-token verification call, ``crop(-2)``: every layer state equals a cache that prefilled and
    decoded the first of the 3 tokens only; decoding on gives the same logits. With ``plen=2`` the rejected token
    completes KPool pool 0, whose key overwrites token 0's slot: without the undo the indexer state is wrong."""
    ids = _prompt(plen + 3, seed=plen)
    with torch.no_grad():
        ref = _cache(lm, record=False)
        lm(ids[:, :plen], cache=ref, use_cache=True)
        lm(ids[:, plen : plen + 1], cache=ref, use_cache=True)
        for undo in (True, False):
            cache = _cache(lm, record=True)
            assert isinstance(cache.layers[0], Glm53FlashKDACacheLayer)
            assert isinstance(cache.layers[2], Glm53FlashIndexedCacheLayer)
            lm(ids[:, :plen], cache=cache, use_cache=True)
            cache.crop(0)
            assert cache.is_croppable
            if not undo:
                for layer in cache.layers:
                    if isinstance(layer, Glm53FlashIndexedCacheLayer):
                        layer.record_past = False
            lm(ids[:, plen : plen + 3], cache=cache, use_cache=True)
            cache.crop(-2)
            errs = []
            for got, want in zip(cache.layers, ref.layers):
                if isinstance(got, Glm53FlashKDACacheLayer):
                    assert got.conv_states[0].shape == want.conv_states[0].shape
                    errs += [rel_err(got.conv_states[0], want.conv_states[0]),
                             rel_err(got.recurrent_states[0], want.recurrent_states[0])]
                else:
                    assert got.keys.shape == want.keys.shape
                    errs.append(rel_err(got.keys, want.keys))
                    if want.indexer_keys is not None and want.indexer_keys.numel():
                        errs.append(rel_err(got.indexer_keys, want.indexer_keys))
            if undo:
                assert max(errs) < STATE_TOL, errs
            elif plen == 2:
                assert max(errs) > 0.01, errs  # the undo is what makes plen=2 exact
        nxt = ids[:, plen + 1 : plen + 2]
        cache = _cache(lm, record=True)
        lm(ids[:, :plen], cache=cache, use_cache=True)
        cache.crop(0)
        lm(ids[:, plen : plen + 3], cache=cache, use_cache=True)
        cache.crop(-2)
        got = lm(nxt, cache=cache, use_cache=True).logits
        want = lm(nxt, cache=ref, use_cache=True).logits
    assert rel_err(got, want) < STATE_TOL


def test_crop_beyond_the_recorded_call_raises():
    layer = Glm53FlashKDACacheLayer()
    layer.activate_past_recording()
    layer.update_conv_state(torch.zeros(1, 6, 4), conv_kernel_size=4)
    layer.update_recurrent_state(torch.zeros(1, 2, 3, 3))
    with pytest.raises(RuntimeError, match="can remove at most 0 tokens"):
        layer.crop(-1)


def test_mtp_draft_layer_cache_equals_its_uncached_forward(drafty):
    """The MTP layer's outputs over all calls of one generate (cached, verified positions only) equal depth 1 of
    the uncached MTP forward over the final sequence."""
    prompt = _prompt(9, seed=2)
    outs = []
    text = drafty.model
    handle = text.layers[text.config.num_hidden_layers].register_forward_hook(
        lambda _m, _a, out: outs.append(out[0])
    )
    try:
        with torch.no_grad():
            seq = drafty.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, use_mtp=True)
    finally:
        handle.remove()
    got = torch.cat(outs, dim=1)[0]  # [positions 0 .. P-1 ... last verified, D]
    with torch.no_grad():
        full = text(seq, output_mtp_inputs=True)
        layout = build_document_layout(1, seq.shape[1], "cpu")
        ids = torch.cat([seq[:, 1:], seq.new_zeros(1, 1)], dim=1)
        want, _ = text.layers[text.config.num_hidden_layers](text.embed_tokens(ids), full.pre_norm_hidden_state, layout)
    assert got.shape[0] >= 12
    assert rel_err(got, want[0, : got.shape[0]]) < 1e-4
