"""Tests of glm53flash_hf.dsa (KPool indexer, NoPE DSA attention, the dispatch of the sparse MLA core) and of the
torch operators in glm53flash_hf.dsa_ops (sparse MLA, stable top-k).

Oracles: transformers' ``Glm5NextTextIndexer`` / ``Glm5NextTextAttention`` (same weights), a float64 per-document
loop of the KPool indexer's maths (:func:`ref_indexer`), and a float64 dense-mask attention for
``sparse_mla_torch``. Top-k selection is compared as SETS of token ids per query (the order of the ids inside a
query's row is not part of the contract); the float64 reference also asserts that the test data has no near-ties at
the selection boundary, so a set mismatch is a real bug.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention, Glm5NextTextIndexer

from glm53flash_hf.configuration_glm53flash import Glm53FlashTextConfig
from glm53flash_hf.dispatch import op_for
from glm53flash_hf.dsa import Glm53FlashAttention, Glm53FlashIndexer, init_dsa_weights
from glm53flash_hf.dsa_ops import sparse_mla_torch, stable_topk_indices
from glm53flash_hf.packing import build_document_layout

HIDDEN = 64
KP = 4
TOPK = 16


def make_config(attn_impl="eager", **overrides):
    kwargs = dict(
        hidden_size=HIDDEN,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=32,
        kv_lora_rank=24,  # != qk_nope_head_dim so a kv_lora_rank**-0.5 scale is caught
        qk_nope_head_dim=16,
        qk_rope_head_dim=0,
        v_head_dim=12,  # != qk_nope_head_dim so a wrong W_kc / W_vc split is caught
        index_n_heads=8,  # enough heads that relu(.)=0 for every head (exact score ties at 0) is rare
        index_head_dim=16,
        index_topk=TOPK,
        index_kpool=KP,
        index_kpool_always_select_tail=True,
        num_hidden_layers=4,
        layer_types=["indexed_attention"] * 4,
        indexer_types=["full", "full", "shared", "full"],
        mlp_layer_types=["dense"] * 4,
        kernels="torch",
    )
    kwargs.update(overrides)
    config = Glm53FlashTextConfig(**kwargs)
    config._attn_implementation = attn_impl
    return config


def randomize_(module, seed, std=0.3):
    """Random parameters (HF zero-initialises ape/gate, which would make every pool key a plain mean)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param.dtype)
            if name.endswith("layernorm.weight") or name.endswith("k_norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(std * noise)
    return module


def row_sets(indices):
    """[B, S, W] ids -> nested list [B][S] of sorted tuples of the valid ids."""
    out = []
    for row in indices.tolist():
        out.append([tuple(sorted(i for i in ids if i >= 0)) for ids in row])
    return out


def ref_indexer(indexer, hidden, q_resid, docs, min_gap=1e-5):
    """Float64 per-document reference of the KPool indexer (``Glm5NextTextIndexer``'s maths per document), as id
    sets.

    ``docs[b]`` lists the (start, end) row ranges of the valid documents of row b. Asserts that the score gap
    at the top-k boundary exceeds ``min_gap`` (relative) so the data is tie-free.
    """
    cfg = indexer.config
    kp, heads, dim = cfg.index_kpool, cfg.index_n_heads, cfg.index_head_dim
    ksel = cfg.index_topk // kp
    B, S, _ = hidden.shape
    p = {n: t.detach().double() for n, t in indexer.named_parameters()}
    h = hidden.detach().double()
    q = F.linear(q_resid.detach().double(), p["wq_b.weight"]).view(B, S, heads, dim)
    k = F.layer_norm(F.linear(h, p["wk.weight"]), (dim,), p["k_norm.weight"], p["k_norm.bias"], 1e-6)
    g = F.linear(h, p["index_kpool_compress_gate"])
    w = F.linear(h, p["weights_proj.weight"]) * heads**-0.5
    sets = [[() for _ in range(S)] for _ in range(B)]
    worst_gap = math.inf
    for b in range(B):
        for start, end in docs[b]:
            n_pools = (end - start) // kp
            if n_pools:
                sl = slice(start, start + n_pools * kp)
                kk = k[b, sl].view(n_pools, kp, dim)
                pr = torch.softmax(g[b, sl].view(n_pools, kp, dim) + p["index_kpool_compress_ape"], dim=1)
                pk = (pr * kk).sum(1)  # [P, dim]
            for t in range(start, end):
                local = t - start
                visible = (local + 1) // kp
                ids = []
                if visible:
                    sc = (w[b, t][:, None] * F.relu(q[b, t] @ pk[:visible].T * dim**-0.5)).sum(0)
                    order = torch.argsort(sc, descending=True)
                    if visible > ksel:
                        srt = sc[order]
                        gap = (srt[ksel - 1] - srt[ksel]).item() / (srt.abs().max().item() + 1e-30)
                        worst_gap = min(worst_gap, gap)
                    for pool in order[:ksel].tolist():
                        ids.extend(range(start + pool * kp, start + pool * kp + kp))
                if cfg.index_kpool_always_select_tail:
                    tail = (local + 1) % kp
                    ids.extend(range(t - tail + 1, t + 1))
                sets[b][t] = tuple(sorted(ids))
    assert worst_gap > min_gap, f"test data has a near-tie at the top-k boundary (gap {worst_gap:.2e}): change the seed"
    return sets


def docs_of(layout):
    """Valid (start, end) document ranges per row, from a layout."""
    docs = [[] for _ in range(layout.batch_size)]
    cu = layout.cu_seqlens.tolist()
    for i in range(len(cu) - 1):
        if layout.segment_valid[i]:
            b, s = divmod(cu[i], layout.seq_len)
            docs[b].append((s, s + cu[i + 1] - cu[i]))
    return docs


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def packed_position_ids(rows, seq_len):
    """position_ids restarting per document; rows = list of doc-length lists (right padding if short)."""
    pos = torch.zeros(len(rows), seq_len, dtype=torch.long)
    mask = torch.zeros(len(rows), seq_len, dtype=torch.bool)
    for b, lengths in enumerate(rows):
        off = 0
        for n in lengths:
            pos[b, off : off + n] = torch.arange(n)
            mask[b, off : off + n] = True
            off += n
    return pos, mask


# ----------------------------------------------------------------------------------------------------------------
# Indexer
# ----------------------------------------------------------------------------------------------------------------


def make_indexers(seed=0, **cfg):
    config = make_config(**cfg)
    hf = randomize_(Glm5NextTextIndexer(config, 1), seed)
    ours = Glm53FlashIndexer(config, 1)
    ours.load_state_dict(hf.state_dict(), strict=True)
    hf.load_state_dict(ours.state_dict(), strict=True)
    return config, hf, ours


def indexer_inputs(B, S, seed, q_lora=32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, HIDDEN, generator=gen), torch.randn(B, S, q_lora, generator=gen)


def test_indexer_param_names_and_shapes_match_hf():
    _, hf, ours = make_indexers()
    assert {n: (p.shape, p.dtype) for n, p in ours.named_parameters()} == {
        n: (p.shape, p.dtype) for n, p in hf.named_parameters()
    }
    assert ours.output_width == TOPK + KP - 1


def test_indexer_matches_hf_unpadded():
    _, hf, ours = make_indexers(seed=1)
    B, S = 2, 61
    h, qr = indexer_inputs(B, S, seed=2)
    layout = build_document_layout(B, S, "cpu")
    got = ours(h, qr, layout)
    want = hf(hidden_states=h, q_resid=qr, attention_mask=torch.ones(B, S, dtype=torch.bool), cache=None)
    assert got.dtype == torch.int32 and got.shape == want.shape == (B, S, TOPK + KP - 1)
    ref = ref_indexer(ours, h, qr, docs_of(layout))
    assert row_sets(got) == row_sets(want)
    assert row_sets(got) == ref
    # selection really is sparse: late queries see far more pools than they keep
    assert len(ref[0][S - 1]) == TOPK + (S % KP) < S
    assert not got.requires_grad  # frozen indexer: no graph


def test_indexer_matches_hf_left_padded():
    _, hf, ours = make_indexers(seed=3)
    B, S = 3, 61
    h, qr = indexer_inputs(B, S, seed=4)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :5] = False
    mask[2, :22] = False
    layout = build_document_layout(B, S, "cpu", attention_mask=mask)
    got = ours(h, qr, layout)
    want = hf(hidden_states=h, q_resid=qr, attention_mask=mask, cache=None)
    assert row_sets(got) == row_sets(want)
    assert row_sets(got) == ref_indexer(ours, h, qr, docs_of(layout))
    assert bool((got[~mask] == -1).all())


def test_indexer_packed_equals_separate():
    config, _, ours = make_indexers(seed=5)
    S = 61
    rows = [[23, 1, 30, 7], [40, 15]]  # row 1 is right-padded by 6 tokens
    pos, mask = packed_position_ids(rows, S)
    h, qr = indexer_inputs(2, S, seed=6)
    layout = build_document_layout(2, S, "cpu", attention_mask=mask, position_ids=pos)
    got = ours(h, qr, layout)
    assert row_sets(got) == ref_indexer(ours, h, qr, docs_of(layout))
    assert bool((got[~mask] == -1).all())
    for b, lengths in enumerate(rows):
        off = 0
        for n in lengths:
            alone = ours(h[b : b + 1, off : off + n], qr[b : b + 1, off : off + n], build_document_layout(1, n, "cpu"))
            packed = got[b : b + 1, off : off + n]
            shifted = torch.where(packed >= 0, packed - off, packed)
            assert row_sets(shifted) == row_sets(alone), (b, off, n)
            # no id leaves its document
            valid_ids = packed[packed >= 0]
            assert bool(((valid_ids >= off) & (valid_ids < off + n)).all())
            off += n


def test_indexer_query_chunking_is_exact():
    _, _, ours = make_indexers(seed=7)
    B, S = 2, 61
    h, qr = indexer_inputs(B, S, seed=8)
    pos, mask = packed_position_ids([[20, 41], [9, 50]], S)
    layout = build_document_layout(B, S, "cpu", attention_mask=mask, position_ids=pos)
    full = ours(h, qr, layout)
    ours.max_score_elements = 1  # one query per chunk
    one = ours(h, qr, layout)
    ours.max_score_elements = 7 * 2 * (S // KP) * B  # chunks of 7 queries
    seven = ours(h, qr, layout)
    assert row_sets(full) == row_sets(one) == row_sets(seven)


def test_compiled_indexer_scores_queries_in_chunks():
    """Under ``torch.compile`` the indexer's query chunks run inside the op ``glm53flash::select_top_pools`` (score
    memory bounded by ``max_score_elements`` as in eager, no chunk loop unrolled): the traced graph calls the op and
    holds no score product, and the compiled ids equal eager's with a budget of chunks of 7 queries."""
    _, _, ours = make_indexers(seed=7)
    B, S = 2, 61
    h, qr = indexer_inputs(B, S, seed=8)
    pos, mask = packed_position_ids([[20, 41], [9, 50]], S)
    layout = build_document_layout(B, S, "cpu", attention_mask=mask, position_ids=pos)
    ours.max_score_elements = 7 * 2 * (S // KP) * B  # chunks of 7 queries
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda h, qr: ours(h, qr, layout), backend=record, fullgraph=True)
    got = compiled(h, qr)
    assert torch.equal(got, ours(h, qr, layout))
    targets = [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert torch.ops.glm53flash.select_top_pools.default in targets
    assert not any(t in (torch.bmm, torch.ops.aten.bmm.default) for t in targets)


def test_indexer_without_tail_and_short_sequences():
    config, hf, ours = make_indexers(seed=9, index_kpool_always_select_tail=False)
    assert ours.output_width == TOPK
    for S in (3, 4, 17, 40):  # fewer tokens than a pool, one pool, fewer pools than index_topk // kp, many
        h, qr = indexer_inputs(1, S, seed=10 + S)
        got = ours(h, qr, build_document_layout(1, S, "cpu"))
        want = hf(hidden_states=h, q_resid=qr, attention_mask=torch.ones(1, S, dtype=torch.bool), cache=None)
        assert got.shape == (1, S, TOPK)
        assert row_sets(got) == row_sets(want)


def test_indexer_rejects_bad_shapes():
    _, _, ours = make_indexers()
    h, qr = indexer_inputs(1, 8, seed=0)
    with pytest.raises(ValueError, match="q_resid"):
        ours(h, qr[:, :5], None)
    with pytest.raises(ValueError, match="layout"):
        ours(h, qr, build_document_layout(1, 9, "cpu"))


# ----------------------------------------------------------------------------------------------------------------
# sparse_mla_torch vs float64 dense mask
# ----------------------------------------------------------------------------------------------------------------


def dense_reference(q, lat, idx, scale):
    """Float64 dense attention with a [B, S, S_kv] mask materialised from the ids."""
    q, lat = q.double(), lat.double()
    B, S, H, _ = q.shape
    S_kv = lat.shape[1]
    mask = torch.zeros(B, S, S_kv, dtype=torch.bool)
    for b in range(B):
        for t in range(S):
            for i in idx[b, t].tolist():
                if 0 <= i < S_kv:
                    mask[b, t, i] = True
    scores = torch.einsum("bshd,bkd->bshk", q, lat) * scale
    empty = ~mask.any(-1)  # [B, S]
    m = mask[:, :, None, :] | empty[:, :, None, None]  # empty rows: unmasked dummy softmax, zeroed below
    scores = scores.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("bshk,bkd->bshd", torch.softmax(scores, -1), lat)
    out = out.masked_fill(empty[:, :, None, None], 0.0)
    lse = lse.masked_fill(empty[:, :, None], float("-inf"))
    return out, lse


def random_sparse_ids(B, S, W, gen, S_kv=None):
    """Unique causal ids per query with -1 holes; row 1 query 5 gets none; one out-of-range id."""
    S_kv = S_kv or S
    idx = torch.full((B, S, W), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(S):
            cand = torch.randperm(t + 1, generator=gen)[: W - 2]
            slots = torch.randperm(W, generator=gen)[: cand.numel()]
            idx[b, t, slots] = cand.to(torch.int32)
    idx[1, 5] = -1
    idx[0, 9, 0] = S_kv  # out of range = invalid
    return idx


@pytest.mark.parametrize("query_chunk", [None, 4])
def test_sparse_mla_torch_matches_dense_float64(query_chunk):
    gen = torch.Generator().manual_seed(11)
    B, S, H, D, W = 2, 13, 3, 8, 7
    scale = 0.37
    q = torch.randn(B, S, H, D, generator=gen, requires_grad=True)
    lat = torch.randn(B, S, D, generator=gen, requires_grad=True)
    idx = random_sparse_ids(B, S, W, gen)
    r_out = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64)
    r_lse = torch.randn(B, S, H, generator=gen, dtype=torch.float64)

    out, lse = sparse_mla_torch(q, lat, idx, scale, query_chunk=query_chunk)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and out.shape == q.shape
    q64 = q.detach().double().requires_grad_()
    lat64 = lat.detach().double().requires_grad_()
    ref_out, ref_lse = dense_reference(q64, lat64, idx, scale)

    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert not bool(finite[1, 5].any()) and bool((out[1, 5] == 0).all())
    assert rel_err(out, ref_out) < 1e-6
    assert rel_err(lse[finite], ref_lse[finite]) < 1e-6

    def loss(o, log_z):
        return (o.double() * r_out).sum() + (torch.where(finite, log_z.double(), 0.0) * r_lse).sum()

    loss(out, lse).backward()
    loss(ref_out, ref_lse).backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(lat.grad).all()
    assert bool((q.grad[1, 5] == 0).all())
    assert rel_err(q.grad, q64.grad) < 1e-5
    assert rel_err(lat.grad, lat64.grad) < 1e-5


def test_sparse_mla_torch_compile_op_equals_eager():
    """Under torch.compile the chunked torch core is the opaque op glm53flash::sparse_mla_torch (opcheck: schema,
    fake, autograd registration); compiled (fullgraph, several query chunks) equals eager in out, lse and both
    gradients, and a non-finite latent row that no valid slot reads reaches neither (invalid slots read the zero
    row appended to the latent)."""
    from glm53flash_hf import dsa_ops

    gen = torch.Generator().manual_seed(12)
    B, S, H, D, W = 2, 13, 3, 8, 7
    q = torch.randn(B, H, S, D, generator=gen).transpose(1, 2).requires_grad_()  # strided, as an einsum's output
    lat = torch.randn(B, S + 1, D, generator=gen)
    lat[:, S] = float("nan")  # never a valid id: the ids are < S
    lat.requires_grad_()
    idx = random_sparse_ids(B, S, W, gen)
    idx[idx == S] = S + 1  # still out of range (invalid) for the S + 1 latent rows
    g_out, g_lse = torch.randn(B, S, H, D, generator=gen), torch.randn(B, S, H, generator=gen)
    g_lse[1, 5] = 0.0  # the empty row's lse is -inf
    checks = torch.library.opcheck(dsa_ops._SPARSE_MLA_OP, (q, lat, idx, 0.37, 4))
    assert set(checks.values()) == {"SUCCESS"}, checks

    def attend(q, lat):
        return sparse_mla_torch(q, lat, idx, 0.37, query_chunk=4)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)
    results = []
    for fn in (attend, compiled):
        out, lse = fn(q, lat)
        grads = torch.autograd.grad((out, torch.where(torch.isfinite(lse), lse, 0.0)), (q, lat), (g_out, g_lse))
        results.append((out.detach(), lse.detach(), *grads))
    for name, a, b in zip(("out", "lse", "dq", "dlatent"), *results):
        assert torch.isfinite(a if name != "lse" else a[torch.isfinite(a)]).all(), name
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    assert bool((results[0][3][:, S] == 0).all())


def test_sparse_mla_dispatch_and_validation():
    q = torch.randn(1, 4, 2, 8)
    lat = torch.randn(1, 4, 8)
    idx = torch.zeros(1, 4, 3, dtype=torch.long)
    with torch.no_grad():
        a = op_for(sparse_mla_torch, "auto", q, lat, idx)(q, lat, idx, 0.5)[0]
        b = sparse_mla_torch(q, lat, idx, 0.5)[0]
    assert torch.equal(a, b)
    import glm53flash_hf.dispatch as dispatch

    dispatch._warned.clear()
    with pytest.warns(UserWarning, match="cannot run"):
        c = op_for(sparse_mla_torch, "fused", q, lat, idx)(q, lat, idx, 0.5)[0]
    assert torch.equal(c, b)
    with pytest.raises(ValueError, match="backend"):
        op_for(sparse_mla_torch, "triton", q, lat, idx)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_torch(q, lat, idx.float(), 0.5)
    with pytest.raises(ValueError, match="latent"):
        sparse_mla_torch(q, lat[..., :4], idx, 0.5)
    with pytest.raises(ValueError, match="query_chunk"):
        sparse_mla_torch(q, lat, idx, 0.5, query_chunk=0)


# ----------------------------------------------------------------------------------------------------------------
# Attention vs transformers
# ----------------------------------------------------------------------------------------------------------------


def make_attention_pair(layer_idx, seed, attn_impl="eager", **cfg):
    config = make_config(attn_impl=attn_impl, **cfg)
    hf = randomize_(Glm5NextTextAttention(config, layer_idx), seed)
    ours = Glm53FlashAttention(config, layer_idx)
    ours.load_state_dict(hf.state_dict(), strict=True)
    hf.load_state_dict(ours.state_dict(), strict=True)
    return hf, ours


def assert_grads_match(ours, hf, tol=1e-4):
    hf_params = dict(hf.named_parameters())
    worst = 0.0
    for name, p in ours.named_parameters():
        q = hf_params[name]
        if name.startswith("indexer."):
            assert p.grad is None and q.grad is None, name
            continue
        assert p.grad is not None and q.grad is not None, name
        err = rel_err(p.grad, q.grad)
        worst = max(worst, err)
        assert err < tol, (name, err)
    return worst


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("padded", [False, True])
def test_attention_matches_hf(attn_impl, padded):
    hf, ours = make_attention_pair(1, seed=12, attn_impl=attn_impl)
    B, S = 2, 61
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(B, S, HIDDEN, generator=gen)
    r = torch.randn(B, S, HIDDEN, generator=gen)
    mask = torch.ones(B, S, dtype=torch.bool)
    if padded:
        mask[1, :9] = False
    layout = build_document_layout(B, S, "cpu", attention_mask=mask)
    out, topk, _ = ours(x, layout)
    ref, _, ref_topk = hf(x, mask, cache=None)
    assert row_sets(topk) == row_sets(ref_topk)  # layer 1 is followed by a shared layer: ids are returned
    keep = mask[..., None].float()
    err = rel_err(out * keep, ref * keep)
    assert err < 1e-4, err
    if padded:
        assert bool((out[~mask] == 0).all())
    ((out * keep * r).sum()).backward()
    ((ref * keep * r).sum()).backward()
    assert_grads_match(ours, hf)


def test_shared_indexer_pair_matches_hf():
    config = make_config()
    hf1 = randomize_(Glm5NextTextAttention(config, 1), seed=14)
    hf2 = randomize_(Glm5NextTextAttention(config, 2), seed=15)
    ours1, ours2 = Glm53FlashAttention(config, 1), Glm53FlashAttention(config, 2)
    ours1.load_state_dict(hf1.state_dict(), strict=True)
    ours2.load_state_dict(hf2.state_dict(), strict=True)
    assert ours1.next_skip_topk and ours2.indexer is None and not ours2.next_skip_topk
    B, S = 2, 61
    gen = torch.Generator().manual_seed(16)
    x = torch.randn(B, S, HIDDEN, generator=gen)
    r = torch.randn(B, S, HIDDEN, generator=gen)
    mask = torch.ones(B, S, dtype=torch.bool)
    layout = build_document_layout(B, S, "cpu")

    o1, ids, _ = ours1(x, layout)
    o2, none, _ = ours2(x + o1, layout, prev_topk_indices=ids)
    h1, _, hids = hf1(x, mask, cache=None)
    h2, _, hnone = hf2(x + h1, mask, cache=None, prev_topk_indices=hids)
    assert none is None and hnone is None
    assert row_sets(ids) == row_sets(hids)
    assert rel_err(o2, h2) < 1e-4
    (o2 * r).sum().backward()
    (h2 * r).sum().backward()
    assert_grads_match(ours1, hf1)
    assert_grads_match(ours2, hf2)
    with pytest.raises(ValueError, match="prev_topk_indices"):
        ours2(x, layout)


def test_layer_roles_and_param_names():
    config = make_config()
    roles = {i: Glm53FlashAttention(config, i) for i in range(5)}  # 4 = MTP layer
    assert [roles[i].indexer is None for i in range(5)] == [False, False, True, False, False]
    assert [roles[i].next_skip_topk for i in range(5)] == [False, True, False, False, False]
    assert Glm53FlashAttention(config, 2, indexer_type="full").indexer is not None
    with pytest.raises(ValueError, match="indexer_type"):
        Glm53FlashAttention(config, 0, indexer_type="dense")
    hf = Glm5NextTextAttention(config, 1)
    assert {n: p.shape for n, p in roles[1].named_parameters()} == {n: p.shape for n, p in hf.named_parameters()}
    assert roles[1].scaling == 16**-0.5
    with pytest.raises(NotImplementedError):
        roles[1](torch.randn(1, 4, HIDDEN), None, cache=object())


def test_init_dsa_weights():
    config = make_config()
    attn = randomize_(Glm53FlashAttention(config, 1), seed=0)
    before = attn.q_a_proj.weight.clone()
    for module in attn.modules():
        init_dsa_weights(module, config)
    assert bool((attn.indexer.index_kpool_compress_ape == 0).all())
    assert bool((attn.indexer.index_kpool_compress_gate == 1).all())
    assert torch.equal(attn.q_a_proj.weight, before)


# ----------------------------------------------------------------------------------------------------------------
# Packed sequences
# ----------------------------------------------------------------------------------------------------------------


def test_packed_attention_equals_separate():
    config = make_config()
    ours = randomize_(Glm53FlashAttention(config, 3), seed=17)
    ours.query_chunk = 8  # several checkpointed chunks
    S = 61
    rows = [[23, 1, 30, 7], [40, 15]]
    pos, mask = packed_position_ids(rows, S)
    gen = torch.Generator().manual_seed(18)
    x = torch.randn(2, S, HIDDEN, generator=gen)
    r = torch.randn(2, S, HIDDEN, generator=gen)
    layout = build_document_layout(2, S, "cpu", attention_mask=mask, position_ids=pos)
    ref_indexer(ours.indexer, x, ours.q_a_layernorm(ours.q_a_proj(x)), docs_of(layout))  # tie-free data
    out, none, no_weights = ours(x, layout)
    assert none is None and no_weights is None
    assert bool((out[~mask] == 0).all())
    (out * r).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}
    ours.zero_grad(set_to_none=True)

    for b, lengths in enumerate(rows):
        off = 0
        for n in lengths:
            alone, _, _ = ours(x[b : b + 1, off : off + n], build_document_layout(1, n, "cpu"))
            assert rel_err(out[b : b + 1, off : off + n], alone) < 1e-5, (b, off, n)
            (alone * r[b : b + 1, off : off + n]).sum().backward()
            off += n
    for name, g in packed_grads.items():
        assert rel_err(g, dict(ours.named_parameters())[name].grad) < 1e-5, name


def test_document_isolation():
    config = make_config()
    ours = randomize_(Glm53FlashAttention(config, 1), seed=19)  # next layer shared: returns its ids
    S = 61
    pos, _ = packed_position_ids([[23, 1, 30, 7]], S)
    layout = build_document_layout(1, S, "cpu", position_ids=pos)
    gen = torch.Generator().manual_seed(20)
    x = torch.randn(1, S, HIDDEN, generator=gen)
    x2 = x.clone()
    x2[:, :23] = torch.randn(1, 23, HIDDEN, generator=gen)  # new content for document 0, same length
    with torch.no_grad():
        o, ids, _ = ours(x, layout)
        o2, ids2, _ = ours(x2, layout)
    assert not torch.equal(ids[:, :23], ids2[:, :23])  # document 0 itself did change
    assert torch.equal(ids[:, 23:], ids2[:, 23:])
    assert rel_err(o2[:, 23:], o[:, 23:]) < 1e-6


# ----------------------------------------------------------------------------------------------------------------
# Memory: nothing quadratic in S is ever allocated
# ----------------------------------------------------------------------------------------------------------------


class _LargestAllocation(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return result


def test_no_quadratic_buffers():
    config = make_config()
    ours = randomize_(Glm53FlashAttention(config, 3), seed=21)
    ours.indexer.max_score_elements = 4096
    ours.query_chunk = 64
    S = 1024
    x = torch.randn(1, S, HIDDEN)
    layout = build_document_layout(1, S, "cpu")
    with _LargestAllocation() as probe:
        out, _, _ = ours(x, layout)
        out.square().sum().backward()
    assert all(p.grad is not None for n, p in ours.named_parameters() if not n.startswith("indexer."))
    # HF's mask alone is S*S = 1,048,576 elements; the largest tensors here are [S, index_n_heads * index_head_dim]
    # indexer queries (131,072 elements).
    assert probe.largest <= S * S // 8, probe.largest


def test_bf16_runs_and_tracks_fp32():
    # index_topk covers every pool, so the selection cannot differ between precisions: bf16 rounding makes
    # near-tied pool scores exactly equal and may legitimately change a sparse selection.
    config = make_config(index_topk=32)
    ours = randomize_(Glm53FlashAttention(config, 3), seed=22)
    x = torch.randn(2, 29, HIDDEN)
    layout = build_document_layout(2, 29, "cpu")
    with torch.no_grad():
        ref, _, _ = ours(x, layout)
        low, _, _ = ours.to(torch.bfloat16)(x.bfloat16(), layout)
    assert low.dtype == torch.bfloat16
    assert rel_err(low.float(), ref) < 5e-2


def test_stable_topk_breaks_ties_toward_earlier_entries():
    scores = torch.tensor([[0.0, 2.0, 0.0, 0.0, 1.0, 0.0], [float("-inf"), 0.0, 0.0, float("-inf"), 0.0, 0.0]])
    assert stable_topk_indices(scores, 3).tolist() == [[0, 1, 4], [1, 2, 4]]
    assert stable_topk_indices(scores[1:], 5).tolist() == [[1, 2, 4, 5, 0]]
    gen = torch.Generator().manual_seed(0)
    distinct = torch.randn(4, 50, generator=gen)
    ours = stable_topk_indices(distinct, 7).sort(-1).values
    assert torch.equal(ours, distinct.topk(7).indices.sort(-1).values)


def _stable_topk_oracle(row: list[float], k: int) -> list[int]:
    """Python reference: the ``k`` largest, ties to the lower index; finite picks in index order, then ``-inf``."""
    picks = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
    finite = sorted(i for i in picks if row[i] != float("-inf"))
    return finite + sorted(i for i in picks if row[i] == float("-inf"))


@pytest.mark.parametrize("kind", ["distinct", "ties", "ties-across-the-k-th", "-inf"])
def test_stable_topk_equals_a_python_sort(kind):
    """Both ways through ``stable_topk_indices``: rows without a tie at the boundary (``torch.topk``'s picks,
    reordered) and rows with one or with ``-inf`` picks (the integer key over all entries)."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(40):
        num = int(torch.randint(2, 40, (1,), generator=gen))
        k = int(torch.randint(1, num + 1, (1,), generator=gen))
        scores = torch.randn(6, num, generator=gen)
        if kind == "ties":
            scores = (scores * 3).round()
        elif kind == "ties-across-the-k-th":
            scores[:, : num // 2 + 1] = 0.5  # the k-th value of most rows also sits outside their top k
        elif kind == "-inf":
            scores[torch.rand(scores.shape, generator=gen) < 0.6] = float("-inf")
        got = stable_topk_indices(scores, k).tolist()
        assert got == [_stable_topk_oracle(row, k) for row in scores.tolist()], (kind, trial, num, k)


def _tie_setup():
    config = make_config(index_n_heads=2)
    torch.manual_seed(0)
    ours = Glm53FlashIndexer(config, 1)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name == "index_kpool_compress_gate":
                p.fill_(1.0)
            elif name == "index_kpool_compress_ape":
                p.zero_()
            elif p.dim() == 2:
                p.normal_(0, 0.2)
    lengths = [37, 1, 52]
    S = sum(lengths)
    h, qr = indexer_inputs(1, S, seed=7)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return ours, lengths, h, qr, pos


def _packed_matches_alone(ours, lengths, h, qr, pos):
    S = sum(lengths)
    got = ours(h, qr, build_document_layout(1, S, "cpu", position_ids=pos))
    off = 0
    for n in lengths:
        alone = ours(h[:, off : off + n], qr[:, off : off + n], build_document_layout(1, n, "cpu"))
        packed = got[:, off : off + n]
        if not torch.equal(torch.where(packed >= 0, packed - off, packed), alone):
            return False
        off += n
    return True


def test_indexer_packed_equals_separate_with_score_ties():
    """Default initialisation (compress gate ones, ape zeros) and 2 heads: many pools score exactly 0.

    torch.topk breaks such ties by array position, which differs between a packed row and a document alone;
    the indexer's deterministic rule (earlier pool wins) keeps the selections identical, slot for slot.
    """
    assert _packed_matches_alone(*_tie_setup())


def test_plain_topk_would_break_packing_under_ties(monkeypatch):
    """The setting above really has ties that plain torch.topk resolves differently when packed."""
    import glm53flash_hf.dsa_ops as dsa_ops

    monkeypatch.setattr(dsa_ops, "stable_topk_indices", lambda scores, k: scores.topk(k, dim=-1).indices)
    assert not _packed_matches_alone(*_tie_setup())
