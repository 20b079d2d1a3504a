"""Generation off the happy path (:mod:`glm53flash_hf.generation_cache`): padding masks ``generate`` cannot serve,
caches of another model, already filled or too short (a ``StaticCache``), and transformers' candidate generators
(prompt lookup, an assistant model made by ``glm53flash-crop``).

Model: ``configuration/tiny.json`` (KDA, full and shared DSA, MoE, mHC, one MTP layer), randomised
(``tests/tiny.py``), fp32; the "drafty" variant (:func:`tiny.drafty_`) makes a cropped copy predict mostly as the
whole model, so an assistant's drafts are both accepted and rejected.

Oracles: plain greedy ``generate`` (token for token), the assistant's own plain greedy from each round's input
(its drafts), and caches that never saw the removed tokens. The ``StaticCache`` checks use the plain randomised tiny
model (:func:`shared_fixtures.random_lm`).
"""

from __future__ import annotations

import warnings

import pytest
import shared_fixtures
import torch
from ckpt_fixtures import tiny_config
from shared_fixtures import IDS
from tiny import drafty_, randomize_, rel_err
from transformers import DynamicCache, StaticCache

from glm53flash_hf.generation_cache import Glm53FlashKDACacheLayer, make_croppable
from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM
from glm53flash_hf.tools import crop

random_lm = shared_fixtures.random_lm  # fixture

PAD = 2000
STATE_TOL = 1e-5  # fp32 rounding of the same maths over calls of other lengths; a wrong rollback moves states by O(1)
SHORT = dict(num_hidden_layers=3, layer_types=["linear_attention", "linear_attention", "indexed_attention"],
             mlp_layer_types=["dense", "sparse", "sparse"])


def _ready(model):
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.generation_config.pad_token_id = PAD
    return model.float().eval()


def _model(drafty=False):
    torch.manual_seed(0)
    model = Glm53FlashForCausalLM(tiny_config())
    randomize_(model, seed=5)
    return _ready(drafty_(model, 0.05) if drafty else model)


@pytest.fixture(scope="module")
def lm():
    """The randomised tiny model of this file (seed 5, fp32, never stopping early); not shared_fixtures.random_lm."""
    return _model()


def _prompt(n, seed, batch=1):
    return torch.randint(1, 1990, (batch, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, n, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# attention masks
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_cache", [True, False])
def test_all_zero_mask_row_raises_naming_the_row(lm, use_cache):
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    with pytest.raises(ValueError, match=r"attention_mask row 1 is all zeros: the row has no real token"):
        _greedy(lm, _prompt(5, 0, batch=2), 2, attention_mask=mask, use_cache=use_cache)


@pytest.mark.parametrize("mask", [[1, 1, 0, 1, 1], [0, 1, 1, 0, 1], [1, 1, 1, 0, 0]], ids=["hole", "hole2", "right"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_padding_after_a_real_token_raises_naming_the_row(lm, mask, use_cache):
    masks = torch.tensor([[1, 1, 1, 1, 1], mask])
    col = next(i for i in range(1, 5) if mask[i - 1] == 1 and mask[i] == 0)
    with pytest.raises(ValueError, match=rf"attention_mask row 1 has padding \(0\) after a real token \(position "
                                         rf"{col}\).*left padding only"):
        _greedy(lm, _prompt(5, 0, batch=2), 2, attention_mask=masks, use_cache=use_cache)


def test_cached_forward_with_a_hole_or_an_empty_row_raises(lm):
    ids = _prompt(5, 1, batch=2)
    with torch.no_grad(), pytest.raises(ValueError, match=r"attention_mask row 0 has padding \(0\) after a real"):
        lm(input_ids=ids, use_cache=True, attention_mask=torch.tensor([[1, 0, 1, 1, 1], [1] * 5]))
    with torch.no_grad(), pytest.raises(ValueError, match=r"attention_mask row 1 is all zeros"):
        lm(input_ids=ids, use_cache=True, attention_mask=torch.tensor([[1] * 5, [0] * 5]))


def test_left_padding_still_equals_the_unpadded_row(lm):
    """The checks refuse holes, not left padding: a left-padded row generates the tokens of the row alone."""
    ids = _prompt(6, 2, batch=2)
    ids[1, :2] = PAD
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    batch = _greedy(lm, ids, 4, attention_mask=mask)
    alone = _greedy(lm, ids[1:, 2:], 4)
    assert torch.equal(batch[1, 6:], alone[0, 4:])


# ---------------------------------------------------------------------------------------------------------------------
# caches of another model, caches already filled
# ---------------------------------------------------------------------------------------------------------------------


def test_cache_of_another_layer_count_or_kind_raises(lm):
    ids = _prompt(5, 3)
    short = DynamicCache(config=tiny_config(**SHORT).get_text_config())
    with pytest.raises(ValueError, match=r"the cache \(DynamicCache\) has 3 layers but the model has "
                                         r"num_hidden_layers=6; build the cache for this model"):
        _greedy(lm, ids, 2, cache=short)
    with pytest.raises(ValueError, match=r"has 0 layers but the model has num_hidden_layers=6"):
        _greedy(lm, ids, 2, cache=DynamicCache())
    kinds = list(reversed(lm.config.get_text_config().layer_types))
    swapped = DynamicCache(config=tiny_config(layer_types=kinds).get_text_config())
    with torch.no_grad(), pytest.raises(ValueError, match=r"cache layer 0 is a DynamicIndexedLayer but model layer 0 "
                                                          r"is 'linear_attention'"):
        lm(input_ids=ids, cache=swapped, use_cache=True)


def test_generate_again_with_a_filled_cache(lm):
    """transformers' convention: a filled cache is continued. The whole sequence as input (or the new tokens with a
    mask over the whole sequence) continues it as a fresh generate on that sequence would; the old prompt again is
    refused (it silently generated other tokens)."""
    prompt = _prompt(5, 4)
    cache = DynamicCache(config=lm.config.get_text_config())
    first = _greedy(lm, prompt, 4, cache=cache)
    assert cache.get_seq_length() == 8
    with pytest.raises(ValueError, match=r"already holds 8 tokens but the inputs cover 5 \(input length 5"):
        _greedy(lm, prompt, 4, cache=cache)
    assert cache.get_seq_length() == 8  # refused before any forward
    fresh = _greedy(lm, first, 3)
    again = _greedy(lm, first, 3, cache=cache)
    assert torch.equal(again, fresh)
    cache = DynamicCache(config=lm.config.get_text_config())
    _greedy(lm, prompt, 4, cache=cache)
    new_only = _greedy(lm, first[:, 8:], 3, cache=cache, attention_mask=torch.ones(1, 9, dtype=torch.long))
    assert torch.equal(new_only[0, -3:], fresh[0, -3:])


# ---------------------------------------------------------------------------------------------------------------------
# crops across calls and into the prefill
# ---------------------------------------------------------------------------------------------------------------------


def _states(cache):
    out = []
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            out += [layer.conv_states[0], layer.recurrent_states[0]]
        else:
            out.append(layer.keys)
            if layer.indexer_keys is not None and layer.indexer_keys.numel():
                out.append(layer.indexer_keys)
    return out


def _assert_same_states(got, want):
    pairs = list(zip(_states(got), _states(want), strict=True))
    assert all(a.shape == b.shape for a, b in pairs)
    errs = [rel_err(a, b) for a, b in pairs]
    assert max(errs) < STATE_TOL, errs


@pytest.mark.parametrize("plen", [2, 7])
@torch.no_grad()
def test_crop_across_calls_and_into_the_prefill_restores_every_state(lm, plen):
    """Prompt lookup's first verification is the prefill itself (prompt + 3 candidates): ``crop(-2)`` inside it.
    An assistant's cache is cropped once per round after several decode steps: 3 one-token calls and a 2-token
    call, then ``crop(-4)`` reaches back into the first of them. Every layer state (conv window, recurrent state,
    MLA latents, indexer keys; with ``plen=2`` a removed token completed KPool pool 0) equals a cache that saw the
    kept tokens only, and the next logits agree."""
    ids = _prompt(plen + 7, seed=plen)
    cache = make_croppable(DynamicCache(config=lm.config.get_text_config()))
    cache.activate_past_recording()
    lm(ids[:, : plen + 3], cache=cache, use_cache=True)
    cache.crop(-2)
    ref = DynamicCache(config=lm.config.get_text_config())
    lm(ids[:, : plen + 1], cache=ref, use_cache=True)
    _assert_same_states(cache, ref)
    for t in range(plen + 1, plen + 4):
        lm(ids[:, t : t + 1], cache=cache, use_cache=True)
    lm(ids[:, plen + 4 : plen + 6], cache=cache, use_cache=True)
    cache.crop(-4)
    lm(ids[:, plen + 1 : plen + 2], cache=ref, use_cache=True)
    _assert_same_states(cache, ref)
    nxt = ids[:, plen + 2 : plen + 3]
    assert rel_err(lm(nxt, cache=cache, use_cache=True).logits, lm(nxt, cache=ref, use_cache=True).logits) < STATE_TOL
    lm(ids[:, plen + 3 : plen + 5], cache=cache, use_cache=True)
    with pytest.raises(RuntimeError, match=r"crop\(-4\): the calls recorded since the last crop hold 3 restorable "
                                           r"tokens; can remove at most 3 tokens"):
        cache.layers[0].crop(-4)


def test_recorded_call_without_history_cannot_be_cropped_into():
    layer = Glm53FlashKDACacheLayer()
    layer.activate_past_recording()
    layer.update_conv_state(torch.zeros(1, 6, 4), conv_kernel_size=4)
    layer.update_recurrent_state(torch.zeros(1, 2, 3, 3))
    layer.update_conv_state(torch.zeros(1, 6, 1), conv_kernel_size=4)
    layer.update_recurrent_state(torch.ones(1, 2, 3, 3), per_token_states=torch.ones(1, 1, 2, 3, 3))
    with pytest.raises(RuntimeError, match=r"hold 1 restorable tokens; can remove at most 1 tokens"):
        layer.crop(-2)


# ---------------------------------------------------------------------------------------------------------------------
# transformers' candidate generators
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def main_and_assistant(tmp_path_factory):
    """The drafty model and its crop to 3 main layers by ``glm53flash-crop`` (fp32), drafting 4 tokens a round."""
    root = tmp_path_factory.mktemp("assist")
    main = _model(drafty=True)
    main.save_pretrained(root / "full")
    assert crop.main([str(root / "full"), str(root / "crop"), "--layers", "3", "--dtype", "fp32", "--no-progress"]) == 0
    assistant = _ready(Glm53FlashForCausalLM.from_pretrained(root / "crop", dtype=torch.float32))
    assert assistant.config.get_text_config().num_hidden_layers == 3
    cfg = assistant.generation_config
    cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule, cfg.assistant_confidence_threshold = 4, "constant", 0
    return main, assistant


def test_assistant_model_greedy_equals_plain_greedy_and_drafts_are_exact(main_and_assistant):
    """Greedy with ``assistant_model=`` equals plain greedy; each round's drafts equal the assistant's own plain
    greedy from that round's input, so its cache (cropped after several decode steps each round) was rolled back
    exactly; drafts were both accepted and rejected."""
    main, assistant = main_and_assistant
    prompt = _prompt(6, 1)
    rounds = []
    generate = assistant.generate

    def recording(*args, **kwargs):
        out = generate(*args, **kwargs)
        rounds.append((kwargs["input_ids"].clone(), out.sequences.clone()))
        return out

    plain = _greedy(main, prompt, 10)
    assistant.generate = recording
    try:
        assisted = _greedy(main, prompt, 10, assistant_model=assistant)
    finally:
        del assistant.generate
    assert torch.equal(assisted, plain), (plain[0, 6:].tolist(), assisted[0, 6:].tolist())
    accepted = rejected = 0
    for inp, seq in rounds:
        k = seq.shape[1] - inp.shape[1]
        assert torch.equal(seq, _greedy(assistant, inp, k))
        drafts, final = seq[0, inp.shape[1]:], plain[0, inp.shape[1]: seq.shape[1]]
        hits = int((drafts[: final.numel()] == final).long().cumprod(0).sum())
        accepted, rejected = accepted + hits, rejected + (k - hits)
    assert accepted > 0 and rejected >= 2, (accepted, rejected)


def test_prompt_lookup_greedy_equals_plain_greedy_and_accepts_candidates(main_and_assistant):
    """``prompt_lookup_num_tokens=3`` (``crop(-3)`` raised before): the prompt is a stretch of the model's own greedy
    output whose last two tokens occurred before with the same next token, so candidates from the prompt are
    verified inside the prefill and in later calls and accepted (fewer main forwards than new tokens)."""
    main, _ = main_and_assistant
    seq = _greedy(main, _prompt(3, 6), 24)[0].tolist()
    end = next(t for t in range(4, len(seq)) if any(
        seq[j - 2 : j + 1] == seq[t - 2 : t + 1] for j in range(2, t - 1)))
    prompt = torch.tensor([seq[:end]])
    plain = _greedy(main, prompt, 8)
    calls = []
    handle = main.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        lookup = _greedy(main, prompt, 8, prompt_lookup_num_tokens=3)
    finally:
        handle.remove()
    assert torch.equal(lookup, plain), (plain[0, end:].tolist(), lookup[0, end:].tolist())
    assert len(calls) < 8, len(calls)


# ---------------------------------------------------------------------------------------------------------------------
# static caches
# ---------------------------------------------------------------------------------------------------------------------


def test_static_cache_shorter_than_prompt_plus_new_tokens(random_lm):
    for name in ("cache", "past_key_values"):
        cache = StaticCache(config=random_lm.config, max_cache_len=16)
        with pytest.raises(ValueError, match=r"StaticCache of max_cache_len=16 but generate needs 20 positions "
                                             r"\(prompt 12 \+ max_new_tokens 8\)"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # past_key_values: the older spelling
            random_lm.generate(IDS, max_new_tokens=8, do_sample=False, **{name: cache})
    cache = StaticCache(config=random_lm.config, max_cache_len=8)
    match = r"holds 8 tokens \(max_cache_len\) but this call needs 12 \(0 cached \+ 12 new\)"
    with pytest.raises(ValueError, match=match):
        random_lm(input_ids=IDS, past_key_values=cache, use_cache=True)


def test_static_cache_that_fits_generates(random_lm):
    cache = StaticCache(config=random_lm.config, max_cache_len=20)
    out = random_lm.generate(IDS, cache=cache, max_new_tokens=8, do_sample=False)
    ref = random_lm.generate(IDS, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref)


def test_static_cache_with_assisted_generation_raises(random_lm):
    """A StaticCache's KDA layers cannot roll back into a verification call (transformers 5.25 calls them croppable
    and failed inside crop)."""
    cache = StaticCache(config=random_lm.config, max_cache_len=32)
    match = r"needs a cache whose KDA layers can be cropped; the StaticCache given has \d+ plain linear-attention"
    with pytest.raises(ValueError, match=match + r" layers \(the first: layer 0\)"):
        random_lm.generate(IDS, cache=cache, max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=3)

