"""Gradient checkpointing through the HF API (``gradient_checkpointing_enable``) on the tiny model
(``configuration/tiny.json``: KDA, full and shared DSA, dense and MoE MLP, mHC, the MTP layer): gradients of a
packed batch with labels equal those without checkpointing, reentrant and not, with and without the MTP loss; the
recompute reuses the DSA selection of the forward it replays."""

from __future__ import annotations

import pytest
import torch
from ckpt_fixtures import tiny_config
from tiny import randomize_, rel_err

from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM


def _grads(model, batch):
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("mtp", [True, False])
def test_gradient_checkpointing_grads_equal(use_reentrant, mtp):
    torch.manual_seed(0)
    model = Glm53FlashForCausalLM(tiny_config(mtp_depth=2)).float()
    randomize_(model, 0)
    model.train()
    gen = torch.Generator().manual_seed(1)
    lens = [6, 1, 9, 4]
    ids = torch.randint(1, 2000, (1, sum(lens)), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    labels = ids.clone()
    labels[0, torch.tensor([0, 6, 7, 16])] = -100
    batch = dict(input_ids=ids, position_ids=pos, labels=labels, mtp=mtp)
    ref_out, ref = _grads(model, batch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    out, got = _grads(model, batch)
    model.gradient_checkpointing_disable()
    assert (ref_out.mtp_loss is not None) == mtp
    assert rel_err(out.loss, ref_out.loss) < 1e-6
    assert got.keys() == ref.keys()
    if mtp:
        assert any(".layers.6." in n for n in got)
    for n in ref:
        err = rel_err(got[n], ref[n])
        assert err < 1e-6, (n, err)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_recompute_reuses_the_dsa_selection(use_reentrant, monkeypatch):
    """Under activation checkpointing the KPool indexer scores each full DSA layer once per step, as without
    checkpointing: a layer's recompute takes the ids of the forward it replays (``DocumentLayout.selections``) instead
    of scoring every pool again; the loss and gradients equal those without checkpointing, bit for bit."""
    from glm53flash_hf import dsa

    calls = []
    original = dsa.select_top_pools
    monkeypatch.setattr(dsa, "select_top_pools", lambda *a, **k: calls.append(1) or original(*a, **k))
    torch.manual_seed(0)
    model = Glm53FlashForCausalLM(tiny_config()).float()
    randomize_(model, 0)
    model.train()
    ids = torch.randint(1, 2000, (1, 20), generator=torch.Generator().manual_seed(2))
    batch = dict(input_ids=ids, labels=ids)
    ref_out, ref = _grads(model, batch)
    plain = len(calls)
    full = sum(isinstance(layer.self_attn, dsa.Glm53FlashAttention) and layer.self_attn.indexer is not None
               for layer in model.model.layers)  # the MTP layer's included
    assert plain == full > 0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    calls.clear()
    out, got = _grads(model, batch)
    assert len(calls) == plain, f"{len(calls)} indexer calls with checkpointing, {plain} without"
    assert torch.equal(out.loss, ref_out.loss) and got.keys() == ref.keys()
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
