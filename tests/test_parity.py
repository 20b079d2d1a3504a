"""Whole-model parity with transformers' built-in ``glm5_next`` on the same weights, file to file.

The oracle is ``Glm5NextForConditionalGeneration`` (fp32, eager attention) from the installed transformers;
it writes the published layout with ``save_pretrained`` and our ``Glm53FlashForCausalLM.from_pretrained``
reads it back through the registered conversions. Logits and every parameter gradient must agree within
1e-4 relative (max abs error over the tensor / max abs value of the reference).
"""

from __future__ import annotations

import logging

import pytest
import torch
from tiny import hf_reference, ours_from_hf_folder, rel_err

TOL = 1e-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_reference(seed=0)
    folder = tmp_path_factory.mktemp("hf_glm5_next")
    hf.save_pretrained(folder)
    ours = ours_from_hf_folder(folder)
    return hf, ours, folder


def _hf_name(our_name: str) -> str:
    return our_name.replace("model.", "model.language_model.", 1) if our_name.startswith("model.") else our_name


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def _compare(hf, ours, input_ids, attention_mask=None):
    labels = input_ids.clone()
    if attention_mask is not None:
        # A label counts only when the position predicting it is a real token too.
        labels[attention_mask == 0] = -100
        labels[:, 1:][attention_mask[:, :-1] == 0] = -100
    hf.zero_grad()
    ours.zero_grad()
    hf_logits = hf(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    our_logits = ours(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    assert rel_err(our_logits[valid], hf_logits[valid]) < TOL
    _loss(hf_logits, labels).backward()
    _loss(our_logits, labels).backward()
    hf_params = dict(hf.named_parameters())
    checked = 0
    for name, p in ours.named_parameters():
        ref = hf_params[_hf_name(name)]
        if ref.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), name
        err = rel_err(p.grad, ref.grad)
        assert err < TOL, f"{name}: gradient relative error {err:.2e}"
        checked += 1
    assert checked > 50
    return hf_logits, our_logits


def test_weights_loaded_file_to_file(pair):
    hf, ours, _ = pair
    ref = {_hf_name(k): v for k, v in ours.state_dict().items()}
    hf_sd = hf.state_dict()
    for k, v in ref.items():
        assert torch.equal(v, hf_sd[k]), k
    assert not any(k.startswith("model.visual") for k in ours.state_dict())


def test_vision_tensors_skipped_in_one_line(pair, caplog):
    _, _, folder = pair
    from transformers.utils import logging as hf_logging

    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM

    hf_logging.set_verbosity_info()
    try:
        with caplog.at_level(logging.INFO):
            Glm53FlashForCausalLM.from_pretrained(folder)
    finally:
        hf_logging.set_verbosity_warning()
    lines = [r.getMessage() for r in caplog.records if "vision-tower tensors" in r.getMessage()]
    assert len(lines) == 1 and "skipped" in lines[0]


def test_logits_and_grads_unpadded(pair):
    hf, ours, _ = pair
    torch.manual_seed(1)
    input_ids = torch.randint(1, 211, (2, 37))
    _compare(hf, ours, input_ids)


def test_logits_and_grads_padded_same_length(pair):
    hf, ours, _ = pair
    torch.manual_seed(2)
    input_ids = torch.randint(1, 211, (2, 33))
    mask = torch.ones_like(input_ids)
    mask[:, :5] = 0
    input_ids[mask == 0] = 0
    _compare(hf, ours, input_ids, mask)


def test_batch_invariance_left_padding(pair):
    """A left-padded row beside a longer row equals the row alone (transformers' built-in fails this)."""
    _, ours, _ = pair
    torch.manual_seed(3)
    long_row = torch.randint(1, 211, (41,))
    short_row = torch.randint(1, 211, (29,))
    batch = torch.zeros(2, 41, dtype=torch.long)
    mask = torch.zeros(2, 41, dtype=torch.long)
    batch[0], mask[0] = long_row, 1
    batch[1, 12:], mask[1, 12:] = short_row, 1
    with torch.no_grad():
        together = ours(input_ids=batch, attention_mask=mask).logits
        alone_short = ours(input_ids=short_row[None]).logits
        alone_long = ours(input_ids=long_row[None]).logits
    assert rel_err(together[1, 12:], alone_short[0]) < 1e-5
    assert rel_err(together[0], alone_long[0]) < 1e-5


def test_no_nan_in_backward(pair):
    _, ours, _ = pair
    torch.manual_seed(4)
    input_ids = torch.randint(1, 211, (1, 70))
    ours.zero_grad()
    out = ours(input_ids=input_ids, labels=input_ids)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for name, p in ours.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), name


def test_attention_weights_equal_builtin(pair):
    """``output_attentions=True``: one ``[B, H, S, S]`` tensor per DSA layer, equal to the built-in's eager weights;
    the logits equal the sparse path's."""
    hf, ours, _ = pair
    torch.manual_seed(5)
    input_ids = torch.randint(1, 211, (2, 37))
    with torch.no_grad():
        ref = hf(input_ids=input_ids, use_cache=False, output_attentions=True)
        got = ours(input_ids=input_ids, use_cache=False, output_attentions=True)
        plain = ours(input_ids=input_ids, use_cache=False).logits
    ref_weights = [w for w in ref.attentions if w is not None]
    text = ours.config.get_text_config()
    dsa_layers = sum(t == "indexed_attention" for t in text.layer_types)
    assert len(got.attentions) == dsa_layers == len(ref_weights) > 0
    for w, w_ref in zip(got.attentions, ref_weights):
        assert w.shape == w_ref.shape == (2, text.num_attention_heads, 37, 37)
        assert rel_err(w, w_ref) < TOL
    assert rel_err(got.logits, plain) < 1e-5
