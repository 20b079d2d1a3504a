"""MTP forward and loss (``glm53flash_hf/mtp.py``).

Model: ``configuration/tiny.json`` (KDA, full and shared DSA, MoE, mHC, one MTP layer), randomised, fp32.
Packed rows follow ``DataCollatorWithFlattening``: ``position_ids`` restart at 0 per document, the first label
of each document is -100. Target convention: depth k at position t predicts ``labels[t + 1 + k]`` of the same
document.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_fixtures import tiny_config
from tiny import randomize_, rel_err

from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM
from glm53flash_hf.mtp import doc_roll, mtp_targets
from glm53flash_hf.packing import build_document_layout

DOC_LENS = [5, 1, 7, 4]  # includes a 1-token document



def _last_layer_streams(text_model, **inputs):
    """The mHC streams ``[B, S, N, D]`` the last main layer returns (a forward hook; ``output_hidden_states`` ends
    with the final norm's output instead, as transformers' glm5_next)."""
    got = []
    last = text_model.layers[text_model.config.num_hidden_layers - 1]
    handle = last.register_forward_hook(lambda _m, _i, out: got.append(out[0]))
    try:
        text_model(**inputs)
    finally:
        handle.remove()
    return got[-1]

def _model(seed=0, **overrides) -> Glm53FlashForCausalLM:
    torch.manual_seed(seed)
    model = Glm53FlashForCausalLM(tiny_config(**overrides)).float()
    randomize_(model, seed)
    return model.train()


def _docs(seed=1, lens=DOC_LENS):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 2000, (n,), generator=gen) for n in lens]


def _labels(doc):
    lab = doc.clone()
    lab[0] = -100
    return lab


def _packed(docs):
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    labels = torch.cat([_labels(d) for d in docs])[None]
    return ids, pos, labels


def test_doc_roll_and_targets():
    layout = build_document_layout(1, 7, "cpu", position_ids=torch.tensor([[0, 1, 2, 0, 0, 1, 2]]))
    x = torch.arange(10, 17)[None]
    assert doc_roll(x, layout, 1, fill=-1).tolist() == [[11, 12, -1, -1, 15, 16, -1]]
    assert doc_roll(x, layout, 2, fill=-1).tolist() == [[12, -1, -1, -1, 16, -1, -1]]
    # depth 1 at t predicts labels[t + 2] inside the document
    assert mtp_targets(x, layout, 1).tolist() == [[12, -100, -100, -100, 16, -100, -100]]
    emb = torch.randn(1, 7, 3)
    rolled = doc_roll(emb, layout, 1, fill=0.0)
    assert torch.equal(rolled[0, 0], emb[0, 1]) and torch.equal(rolled[0, 2], torch.zeros(3))
    with pytest.raises(ValueError, match="shift"):
        doc_roll(x, layout, -1)


@pytest.mark.parametrize("depth", [1, 3])
def test_mtp_packed_equals_separate(depth):
    """Packed row's summed MTP loss and its gradients equal the sum over separate runs.

    fp32 (the MoE grouped matmul has no float64). Tolerance 1e-5 per tensor, except tensors of fewer than 8
    elements (KDA ``A_log`` / ``dt_bias``, mHC ``scale``): each entry is an fp32 sum over every token of
    cancelling terms, summed in another order packed vs separate (KDA's decay gradients also go through chunk
    cumulative-sum differences); bound 5e-5 for those."""
    model = _model(mtp_depth=depth)
    docs = _docs()
    ids, pos, labels = _packed(docs)
    one = torch.tensor(1.0)
    out = model(input_ids=ids, position_ids=pos, labels=labels, num_items_in_batch=one)
    out.mtp_loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total = 0.0
    for d in docs:
        o = model(input_ids=d[None], labels=_labels(d)[None], num_items_in_batch=one)
        o.mtp_loss.backward()
        total = total + o.mtp_loss.detach()
    assert out.mtp_loss.item() > 0
    assert rel_err(out.mtp_loss, total) < 1e-6, (out.mtp_loss.item(), total.item())
    mtp_params = [n for n in packed_grads if ".layers.6." in n]
    assert mtp_params and all(packed_grads[n].abs().max() > 0 for n in mtp_params if "eh_proj" in n)
    for n, p in model.named_parameters():
        ref = p.grad if p.grad is not None else torch.zeros_like(p)
        tol = 5e-5 if p.numel() < 8 else 1e-5
        assert rel_err(packed_grads.get(n, torch.zeros_like(p)), ref) < tol, n


def test_mtp_logits_match_naive_reference():
    """Per-document loop with an explicit roll (token 0 tails) and the shared layer called by hand."""
    depth = 2
    model = _model(mtp_depth=depth).eval()
    docs = _docs()
    ids, pos, labels = _packed(docs)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos, labels=labels)
        tm, layer = model.model, model.model.layers[6]
        off = 0
        for d in docs:
            n = len(d)
            streams = _last_layer_streams(tm, input_ids=d[None])
            h = streams.mean(dim=2)  # h_pre: mean over streams, before the final norm
            layout = build_document_layout(1, n, "cpu")
            for k in range(1, depth + 1):
                future = torch.cat([d[k:], torch.zeros(min(k, n), dtype=d.dtype)])[None]
                x = layer.eh_proj(torch.cat([layer.enorm(tm.embed_tokens(future)), layer.hnorm(h)], -1))
                attn, _, _ = layer.self_attn(layer.input_layernorm(x), layout=layout)
                x = x + attn
                h = x + layer.mlp(layer.post_attention_layernorm(x))
                ref = model.lm_head(layer.shared_head.norm(h))
                err = rel_err(out.mtp_logits[k - 1][:, off : off + n], ref)
                assert err < 1e-5, (k, n, err)
            off += n


def test_mtp_loss_value_depth1_and_total():
    """loss = main + 0.1 * mtp_loss, mtp_loss = mean CE of labels[t + 2] inside each document."""
    model = _model().eval()
    docs = _docs()
    ids, pos, labels = _packed(docs)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos, labels=labels)
        main = model(input_ids=ids, position_ids=pos, labels=labels, mtp=False)
    assert main.mtp_loss is None
    assert rel_err(out.loss, main.loss + 0.1 * out.mtp_loss) < 1e-6
    logp = out.mtp_logits[0][0].float().log_softmax(-1)
    lab, terms, off = labels[0], [], 0
    for d in docs:
        for t in range(off, off + len(d) - 2):
            terms.append(-logp[t, lab[t + 2]])
        off += len(d)
    assert rel_err(out.mtp_loss, torch.stack(terms).mean()) < 1e-6
    with torch.no_grad():
        summed = model(input_ids=ids, position_ids=pos, labels=labels, num_items_in_batch=torch.tensor(3.0))
    assert rel_err(summed.mtp_loss, torch.stack(terms).sum() / 3) < 1e-6


def test_mtp_no_labels_and_no_mtp_layer():
    model = _model().eval()
    ids = _docs()[0][None]
    with torch.no_grad():
        out = model(input_ids=ids)
        assert out.logits.shape == (1, ids.shape[1], 2048) and out.loss is None and out.mtp_loss is None
        off = _model(num_nextn_predict_layers=0).eval()
        o = off(input_ids=ids, labels=ids)
        assert o.loss is not None and o.mtp_loss is None
        assert not any(".layers.6." in n for n, _ in off.named_parameters())
        with pytest.raises(ValueError, match="mtp_depth"):
            off.model(input_ids=ids, mtp_depth=1)
    weightless = _model(mtp_loss_weight=0.0).eval()
    with torch.no_grad():
        assert weightless(input_ids=ids, labels=ids).mtp_loss is None
        assert weightless(input_ids=ids, labels=ids, mtp=True).mtp_loss is not None


def test_mtp_inputs_embeds_are_rolled_not_reembedded():
    """With inputs_embeds (the VL path) the embeddings are rolled (zero tails) and used as given."""
    model = _model().eval()
    d = _docs()[2]
    with torch.no_grad():
        emb = model.model.embed_tokens(d[None]) * 1.7  # not an embedding of any token
        out = model(inputs_embeds=emb, labels=d[None])
        tm, layer = model.model, model.model.layers[6]
        h = _last_layer_streams(tm, inputs_embeds=emb).mean(dim=2)
        future = torch.cat([emb[:, 1:], torch.zeros_like(emb[:, :1])], 1)
        ref, _ = layer(future, h, build_document_layout(1, len(d), "cpu"))
        assert rel_err(out.mtp_logits[0], model.lm_head(ref)) < 1e-6
