"""Optional router load-balancing loss (``output_router_logits=True``) vs transformers' built-in ``glm5_next``.

Oracle: transformers' ``Glm5NextForConditionalGeneration`` on the same weights (file to file), which computes
``aux_loss`` with ``load_balancing_loss_func`` over its recorded router logits and adds ``router_aux_loss_coef *
aux_loss`` to the loss. Our router logits equal its to fp32 rounding (parity tests), so ``aux_loss`` must agree to
1e-5 relative; gradients of the router weights through the aux loss alone agree to 1e-4 relative (the tolerance of
the parity tests: same maths, different fp32 summation order upstream).
"""

from __future__ import annotations

import pytest
import torch
from tiny import hf_reference, ours_from_hf_folder, rel_err


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_reference(seed=3)
    folder = tmp_path_factory.mktemp("hf_aux")
    hf.save_pretrained(folder)
    return hf, ours_from_hf_folder(folder)


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (2, 29), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding in row 1: excluded from the counts by both
    return ids, mask


def test_aux_loss_matches_transformers(pair):
    hf, ours = pair
    ids, mask = _inputs()
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:][mask[:, :-1] == 0] = -100  # a label counts only when the position predicting it is real too
    ref = hf(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True, use_cache=False)
    out = ours(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True, use_cache=False, mtp=False)
    assert len(out.router_logits) == len(ref.router_logits) > 0
    real = mask.reshape(-1).bool()  # padding rows are garbage in both (and excluded from the loss)
    for a, b in zip(out.router_logits, ref.router_logits):
        assert a.shape == b.shape and rel_err(a[real], b[real]) < 1e-5
    assert ref.aux_loss > 0
    assert abs(float(out.aux_loss) - float(ref.aux_loss)) <= 1e-5 * float(ref.aux_loss)
    coef = ours.config.get_text_config(decoder=True).router_aux_loss_coef
    assert coef > 0
    plain = ours(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, mtp=False)
    assert plain.aux_loss is None and plain.router_logits is None
    # the same forward (router logits only collected) and the same two operations: bit-equal
    assert torch.equal(out.loss, plain.loss + coef * out.aux_loss)
    assert abs(float(out.loss) - float(ref.loss)) <= 1e-5 * float(ref.loss)


def test_aux_loss_gradients_reach_the_routers(pair):
    hf, ours = pair
    ids, mask = _inputs()
    hf.zero_grad()
    ours.zero_grad()
    hf(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False).aux_loss.backward()
    ours(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False).aux_loss.backward()
    hf_params = dict(hf.named_parameters())
    routers = [n for n, _ in ours.named_parameters() if n.endswith("mlp.gate.weight")]
    assert routers
    n_main = ours.config.get_text_config(decoder=True).num_hidden_layers
    for name in routers:
        p = dict(ours.named_parameters())[name]
        layer = int(name.split(".")[2])
        if layer >= n_main:  # the MTP layer's router is not part of the aux loss (transformers has no MTP layer)
            assert p.grad is None or not p.grad.any()
            continue
        ref = hf_params[name.replace("model.", "model.language_model.", 1)].grad
        assert ref is not None and ref.abs().max() > 0
        assert rel_err(p.grad, ref) < 1e-4, name


def test_packed_rows_exclude_padding_segments(pair):
    """Packed documents (restarting position_ids) plus trailing padding (attention_mask 0): padding tokens do not
    count; the value equals the aux loss over the documents' router logits computed separately and concatenated."""
    _, ours = pair
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, 200, (n,), generator=g) for n in (9, 5, 11)]
    real = torch.cat(docs)
    row = torch.cat([real, torch.zeros(7, dtype=torch.long)])[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs] + [torch.arange(7)])[None]
    mask = (torch.arange(row.shape[1]) < len(real)).long()[None]
    with torch.no_grad():
        packed = ours(input_ids=row, position_ids=pos, attention_mask=mask, output_router_logits=True, use_cache=False)
        logits = [ours(input_ids=d[None], output_router_logits=True, use_cache=False).router_logits for d in docs]
    from glm53flash_hf.modeling_glm53flash import router_load_balancing_loss
    from glm53flash_hf.packing import build_layout

    joined = tuple(torch.cat([lg[i] for lg in logits]) for i in range(len(logits[0])))
    expect = router_load_balancing_loss(
        ours.config.get_text_config(decoder=True), joined, build_layout(1, len(real), real.device)
    )
    assert abs(float(packed.aux_loss) - float(expect)) <= 1e-5 * float(expect)
