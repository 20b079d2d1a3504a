"""Packed sequences: each document of a packed row computes exactly what it computes alone.

Documents are delimited by ``position_ids`` restarting at 0 (``DataCollatorWithFlattening``) and/or
``cu_seq_lens_q``; the lengths are unequal and include a 1-token document. Oracle: the same model run on
each document separately. A NaN in one document stays in it (from its position on); an additive (-inf) attention mask
is refused naming the value.
"""

from __future__ import annotations

import pytest
import shared_fixtures
import torch
from shared_fixtures import IDS
from shared_fixtures import logits_of as _logits
from tiny import hf_reference, ours_from_hf_folder, rel_err

from glm53flash_hf.packing import build_document_layout, build_layout

random_lm = shared_fixtures.random_lm  # fixture

LENGTHS = [23, 1, 37, 9]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf = hf_reference(seed=5)
    folder = tmp_path_factory.mktemp("hf_glm5_next_packing")
    hf.save_pretrained(folder)
    return hf, ours_from_hf_folder(folder)


def _docs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 211, (n,), generator=gen) for n in LENGTHS]


def _packed_inputs(docs):
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor([len(d) for d in docs]), 0)), dtype=torch.int32)
    return ids, pos, cu


@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens_q", "both"])
def test_packed_equals_separate(models, how):
    _, ours = models
    docs = _docs()
    ids, pos, cu = _packed_inputs(docs)
    kwargs = {}
    if how in ("position_ids", "both"):
        kwargs["position_ids"] = pos
    if how in ("cu_seq_lens_q", "both"):
        kwargs["cu_seq_lens_q"] = cu
    with torch.no_grad():
        packed = ours(input_ids=ids, **kwargs).logits[0]
        start = 0
        for d in docs:
            alone = ours(input_ids=d[None]).logits[0]
            assert rel_err(packed[start : start + len(d)], alone) < 1e-5, f"document of length {len(d)}"
            start += len(d)


def test_packed_gradients_equal_separate(models):
    _, ours = models
    docs = _docs(1)
    ids, pos, _ = _packed_inputs(docs)
    ours.zero_grad()
    logits = ours(input_ids=ids, position_ids=pos).logits[0]
    torch.stack([logits[i].square().mean() for i in range(len(ids[0]))]).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}
    ours.zero_grad()
    for d in docs:
        ours(input_ids=d[None]).logits[0].square().mean(-1).sum().backward()
    for n, p in ours.named_parameters():
        if p.grad is not None:
            assert rel_err(packed_grads[n], p.grad) < 1e-5, n


def test_document_isolation(models):
    """Changing an earlier document's content at fixed length leaves later documents unchanged."""
    _, ours = models
    docs = _docs(2)
    ids, pos, _ = _packed_inputs(docs)
    other = [torch.randint(1, 211, (len(docs[0]),))] + docs[1:]
    ids2, _, _ = _packed_inputs(other)
    with torch.no_grad():
        a = ours(input_ids=ids, position_ids=pos).logits[0, len(docs[0]) :]
        b = ours(input_ids=ids2, position_ids=pos).logits[0, len(docs[0]) :]
    assert rel_err(a, b) < 1e-6  # grouped GEMM shapes change with the other document, so not bit-exact


def test_hf_reference_leaks_across_documents(models):
    """Records the known defect we fix: transformers' built-in mixes packed documents."""
    hf, _ = models
    docs = _docs(3)
    ids, pos, _ = _packed_inputs(docs)
    with torch.no_grad():
        packed = hf(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        second = hf(input_ids=docs[2][None], use_cache=False).logits[0]
    start = len(docs[0]) + len(docs[1])
    assert rel_err(packed[start : start + len(docs[2])], second) > 1e-3


def test_layout_from_collator_kwargs():
    layout = build_layout(1, 6, "cpu", cu_seq_lens_q=torch.tensor([0, 2, 3, 6], dtype=torch.int32))
    assert layout.cu_seqlens.tolist() == [0, 2, 3, 6]
    assert layout.local_pos.tolist() == [[0, 1, 0, 0, 1, 2]]
    assert layout.doc_start.tolist() == [[0, 0, 2, 3, 3, 3]]
    assert not layout.trivial


def test_layout_left_padding_and_positions():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos = torch.tensor([[1, 1, 0, 1, 2], [0, 1, 2, 0, 1]])
    layout = build_document_layout(2, 5, "cpu", attention_mask=mask, position_ids=pos)
    assert layout.cu_seqlens.tolist() == [0, 2, 5, 8, 10]
    assert layout.segment_valid.tolist() == [False, True, True, True]
    assert layout.local_pos.tolist() == [[0, 1, 0, 1, 2], [0, 1, 2, 0, 1]]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cu_seqlens=torch.tensor([0, 3, 3, 6])), "empty"),
        (dict(cu_seqlens=torch.tensor([0, 3, 5])), "end at"),
        (dict(attention_mask=torch.ones(1, 1, 6, 6)), "2-D"),
        (dict(position_ids=torch.zeros(3, 6, dtype=torch.long)), "position_ids"),
    ],
)
def test_layout_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_document_layout(1, 6, "cpu", **kwargs)


def test_packed_equals_separate_default_init_tiny_config():
    """The embedded tiny config at its default initialisation (indexer scores full of exact ties)."""
    from glm53flash_hf import Glm53FlashConfig, Glm53FlashForCausalLM

    torch.manual_seed(0)
    model = Glm53FlashForCausalLM(Glm53FlashConfig.from_json_file("configuration/tiny.json")).eval()
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 256, (n,), generator=gen) for n in (96, 1, 80, 33)]
    ids, pos, _ = _packed_inputs(docs)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos).logits[0]
        start = 0
        for d in docs:
            assert rel_err(packed[start : start + len(d)], model(input_ids=d[None]).logits[0]) < 1e-5, len(d)
            start += len(d)


# ------------------------------------------------------------------------------------------------ padding masks and NaN


def test_additive_attention_mask_is_refused(random_lm):
    mask = torch.zeros(1, 12)
    mask[0, :3] = float("-inf")
    with pytest.raises(ValueError, match=r"attention_mask must be a 0/1 \(or bool\) padding mask.*got the value -inf"):
        random_lm(input_ids=IDS, attention_mask=mask)


@pytest.mark.parametrize("nan_doc", [0, 1])
def test_nan_in_one_packed_document_stays_there(random_lm, nan_doc):
    """A NaN in one token's embedding: the other packed documents give their logits alone (finite), and the tokens
    of its own document before it stay finite (causal), while the NaN reaches the token itself and later ones."""
    lengths = [80, 70, 20]  # docs longer than a 64-token KDA chunk and than index_topk (sparse selection)
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 2000, (n,), generator=gen) for n in lengths]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    start = sum(lengths[:nan_doc])
    nan_at = start + 30

    def poison(_module, _inputs, output):
        output = output.clone()
        output[0, nan_at, 3] = float("nan")
        return output

    hook = random_lm.model.embed_tokens.register_forward_hook(poison)
    try:
        with torch.no_grad():
            packed = random_lm(input_ids=ids, position_ids=pos).logits[0]
    finally:
        hook.remove()
    assert torch.isnan(packed[nan_at]).any()
    assert torch.isfinite(packed[start:nan_at]).all()
    offset = 0
    for i, doc in enumerate(docs):
        if i != nan_doc:
            alone = _logits(random_lm, doc[None])[0]
            assert torch.isfinite(packed[offset : offset + len(doc)]).all(), f"document {i}"
            assert rel_err(packed[offset : offset + len(doc)], alone) < 1e-5, f"document {i}"
        offset += len(doc)

