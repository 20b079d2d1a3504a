"""Torch operators of the DSA layers: the sparse MLA attention core and the KPool indexer's pooling, scoring and
top-k selection, with the argument checks of the sparse MLA core.

This is the torch path of the DSA family: the oracle of the fused kernels (:mod:`glm53flash_hf.dsa_fused`), the
path of CPU tensors, and the path of cached decoding (a query attends over the selected cached latents in the
absorbed MLA form; the indexer scores the cached pool keys). The modules that call these functions are in
:mod:`glm53flash_hf.dsa`. Leaf module: it imports torch only.

Sources: transformers ``models/glm5_next/modeling_glm5_next.py`` (``Glm5NextTextAttention``, ``Glm5NextTextIndexer``)
for the maths, DeepSeek-V3.2's DeepSeek Sparse Attention (lightning indexer + top-k sparse MLA) and the contract of
DeepSeek's FlashMLA sparse kernel (``flash_mla_sparse_fwd``: one shared latent KV head, per-query token ids with
``-1`` padding, natural-log LSE).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

__all__ = [
    "DEFAULT_INDEXER_SCORE_ELEMENTS",
    "DEFAULT_SPARSE_MLA_CHUNK_ELEMENTS",
    "check_sparse_mla_args",
    "kpool_pool_keys",
    "select_top_pools",
    "sparse_mla_torch",
    "sparse_mla_with_weights",
    "stable_topk_indices",
    "tail_token_ids",
]

# Default working-set budgets, in tensor elements (fp32: 4 bytes each).
DEFAULT_INDEXER_SCORE_ELEMENTS = 1 << 26  # [B, chunk, index_n_heads, pools] score buffer of the indexer
DEFAULT_SPARSE_MLA_CHUNK_ELEMENTS = 1 << 26  # [B, chunk, W, kv_lora_rank] gathered latents + [B, chunk, H, W] scores


# --------------------------------------------------------------------------------------------------------------------
# Sparse MLA core
# --------------------------------------------------------------------------------------------------------------------


def check_sparse_mla_args(q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor) -> None:
    """Shape and index-dtype checks of the sparse MLA core, shared by :func:`sparse_mla_torch` and
    :func:`glm53flash_hf.dsa_fused.sparse_mla_fused`.

    Args:
        q_abs: expected ``[B, S, H, Dl]``.
        latent: expected ``[B, S_kv, Dl]``.
        indices: expected integer ``[B, S, W]``.

    Raises:
        ValueError: ``q_abs`` not ``[B, S, H, Dl]``, ``latent`` not ``[B, S_kv, Dl]``, ``indices`` not ``[B, S, W]``
            or not an integer tensor.
    """
    if q_abs.dim() != 4:
        raise ValueError(f"q_abs must be [B, S, H, Dl]; got shape {tuple(q_abs.shape)}")
    batch, seq_len, _, dim = q_abs.shape
    if latent.dim() != 3 or latent.shape[0] != batch or latent.shape[2] != dim:
        raise ValueError(f"latent must be [B={batch}, S_kv, Dl={dim}]; got shape {tuple(latent.shape)}")
    if indices.dim() != 3 or indices.shape[0] != batch or indices.shape[1] != seq_len:
        raise ValueError(f"indices must be [B={batch}, S={seq_len}, W]; got shape {tuple(indices.shape)}")
    if indices.dtype.is_floating_point or indices.dtype == torch.bool or indices.dtype.is_complex:
        raise ValueError(f"indices must be an integer tensor; got dtype {indices.dtype}")


def _sparse_mla_probs(
    q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The softmax of the sparse MLA core over each query's slots: ``q_abs [B,C,H,Dl]``, ``indices [B,C,W]`` ->
    ``(probs [B,C,H,W], lse [B,C,H], gathered [B,C,W,Dl], safe [B,C,W])`` in the compute dtype (``safe``: long
    ids, 0 at invalid slots, whose probability and gathered latent are 0)."""
    batch, chunk, _, dim = q_abs.shape
    kv_len = latent.shape[1]
    width = indices.shape[-1]
    compute_dtype = torch.promote_types(torch.promote_types(q_abs.dtype, latent.dtype), torch.float32)

    idx = indices.long()
    valid = (idx >= 0) & (idx < kv_len)  # [B, C, W]
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    gathered = torch.gather(latent, 1, safe.reshape(batch, chunk * width, 1).expand(-1, -1, dim))
    gathered = gathered.view(batch, chunk, width, dim).to(compute_dtype)  # [B, C, W, Dl]
    # Padding slots read row 0, which may belong to another document: select zeros there (a zero probability
    # times a non-finite latent would still give NaN in the matmul below).
    gathered = torch.where(valid[..., None], gathered, torch.zeros((), dtype=compute_dtype, device=gathered.device))

    scores = torch.matmul(q_abs.to(compute_dtype), gathered.transpose(-1, -2)) * scale  # [B, C, H, W]
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))  # empty rows: all -inf
    expo = torch.exp(scores - row_max)
    denom = expo.sum(dim=-1, keepdim=True)
    nonempty = denom > 0
    safe_denom = torch.where(nonempty, denom, torch.ones_like(denom))
    probs = expo / safe_denom
    lse = torch.where(nonempty, row_max + torch.log(safe_denom), torch.full_like(denom, float("-inf"))).squeeze(-1)
    return probs, lse, gathered, safe


def _sparse_mla_chunk(
    q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query chunk of :func:`sparse_mla_torch`: ``q_abs [B,C,H,Dl]``, ``indices [B,C,W]`` -> out, lse."""
    probs, lse, gathered, _ = _sparse_mla_probs(q_abs, latent, indices, scale)
    return torch.matmul(probs, gathered), lse  # [B, C, H, Dl]


def _query_chunks(seq_len: int, chunk: int) -> list[tuple[int, int]]:
    """``(start, end)`` query ranges of at most ``chunk`` queries covering ``[0, seq_len)``; under ``torch.compile``
    one range (a chunk count that depends on the sequence length would specialise the graph to that length)."""
    if torch.compiler.is_compiling():
        return [(0, seq_len)]
    return [(start, min(seq_len, start + chunk)) for start in range(0, seq_len, chunk)]


def sparse_mla_torch(
    q_abs: torch.Tensor,
    latent: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    *,
    query_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse multi-query attention in the absorbed MLA form, over per-query token ids (the torch path).

    For every batch row ``b``, query ``t`` and head ``h``::

        s[w]         = scale * <q_abs[b, t, h], latent[b, indices[b, t, w]]>     for valid slots w
        lse[b, t, h] = log(sum_w exp(s[w]))                                    (natural log)
        out[b, t, h] = sum_w softmax(s)[w] * latent[b, indices[b, t, w]]

    Keys and values are both the latent ``c`` (one KV head shared by all heads, as in DeepSeek-V3.2 / FlashMLA's
    ``flash_mla_sparse_fwd`` with ``d_v = d_qk``). A slot is valid when ``0 <= index < S_kv``; ``-1`` (or any
    out-of-range value) is padding. Ids must be unique within a query's row: a repeated id is counted twice
    (the indexer never repeats ids). A query without any valid slot gets ``out = 0`` and ``lse = -inf``; its
    gradients are zero, never NaN. ``S`` may be 1 and ``S_kv`` a cache length (a decoding step).

    The computation runs in ``promote(input dtype, float32)`` (softmax in fp32 at least) over query chunks; each
    chunk is wrapped in ``torch.utils.checkpoint`` (non-reentrant) when gradients are needed, so memory is
    ``O(S * W)`` for the indices plus one chunk's ``[B, chunk, W, Dl]`` gathered latents, never ``[S, S_kv]``.

    Args:
        q_abs: ``[B, S, H, Dl]`` queries already multiplied by ``W_kc`` (``Dl = kv_lora_rank``), any float dtype.
        latent: ``[B, S_kv, Dl]`` latent keys/values (``kv_a_layernorm(kv_a_proj_with_mqa(x))``).
        indices: integer ``[B, S, W]`` row-local token ids into ``latent`` (int32 or int64), ``-1`` = invalid.
        scale: softmax scale (``qk_head_dim ** -0.5``; GLM-5.3 has no rope part, so ``qk_nope_head_dim ** -0.5``).
        query_chunk: queries per chunk; ``None`` picks one so that ``B * chunk * W * (Dl + H)`` stays under
            ``DEFAULT_SPARSE_MLA_CHUNK_ELEMENTS``. Under ``torch.compile`` all queries are one chunk.

    Returns:
        ``(out_lat, lse)``: ``out_lat`` ``[B, S, H, Dl]`` in ``q_abs.dtype``; ``lse`` ``[B, S, H]`` natural-log
        log-sum-exp of the scaled scores in the compute dtype (fp32 for fp32/bf16/fp16 inputs).

    Raises:
        ValueError: on mismatched shapes, a non-integer ``indices`` tensor (:func:`check_sparse_mla_args`) or
            ``query_chunk < 1``.
    """
    check_sparse_mla_args(q_abs, latent, indices)
    batch, seq_len, heads, dim = q_abs.shape
    width = indices.shape[-1]
    if query_chunk is None:
        query_chunk = max(1, DEFAULT_SPARSE_MLA_CHUNK_ELEMENTS // max(1, batch * width * (dim + heads)))
    if query_chunk < 1:
        raise ValueError(f"query_chunk must be >= 1; got query_chunk={query_chunk}")

    if width == 0 or seq_len == 0:
        compute_dtype = torch.promote_types(q_abs.dtype, torch.float32)
        out = torch.zeros_like(q_abs)
        lse = torch.full((batch, seq_len, heads), float("-inf"), dtype=compute_dtype, device=q_abs.device)
        return out, lse

    use_checkpoint = torch.is_grad_enabled() and (q_abs.requires_grad or latent.requires_grad)
    outs, lses = [], []
    for start, end in _query_chunks(seq_len, query_chunk):
        args = (q_abs[:, start:end], latent, indices[:, start:end], scale)
        if use_checkpoint:
            out, lse = checkpoint(_sparse_mla_chunk, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            out, lse = _sparse_mla_chunk(*args)
        outs.append(out)
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=1)
    return out.to(q_abs.dtype), lse


def sparse_mla_with_weights(
    q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The maths of :func:`sparse_mla_torch`, returning the attention weights too (``output_attentions=True``).

    The softmax over each query's valid slots is :func:`sparse_mla_torch`'s own (the same function, fp32 at least,
    over the whole sequence at once); its probabilities are scattered (added, as :func:`sparse_mla_torch` counts a
    repeated id twice) into a dense ``[B, H, S, S_kv]`` tensor that is zero
    at the ids not selected, and the output is computed from that tensor: ``out = weights @ latent``. The weights
    are therefore on the autograd path of the output (transformers' convention for ``attentions``), and equal
    transformers' eager ``Glm5NextTextAttention`` weights (dense softmax with the top-k mask). Memory and compute
    are dense, ``O(B * H * S * S_kv)``: only for callers that ask for the weights.

    Args:
        q_abs: ``[B, S, H, Dl]``; latent: ``[B, S_kv, Dl]``; indices: integer ``[B, S, W]``, ``-1`` (or any
            out-of-range value) = invalid slot; scale: softmax scale.

    Returns:
        ``(out_lat [B, S, H, Dl] in q_abs.dtype, weights [B, H, S, S_kv] in q_abs.dtype)``. A query without a
        valid slot gets a zero row of weights and ``out = 0``.

    Raises:
        ValueError: as :func:`sparse_mla_torch` (:func:`check_sparse_mla_args`).
    """
    check_sparse_mla_args(q_abs, latent, indices)
    batch, seq_len, heads, _ = q_abs.shape
    kv_len = latent.shape[1]
    probs, _, _, safe = _sparse_mla_probs(q_abs, latent, indices, scale)  # [B, S, H, W]; invalid slots 0
    weights = probs.new_zeros(batch, heads, seq_len, kv_len)
    weights = weights.scatter_add(-1, safe[:, None].expand(-1, heads, -1, -1), probs.transpose(1, 2))
    weights = weights.to(q_abs.dtype)
    out = torch.einsum("bhsk,bkl->bshl", weights.to(probs.dtype), latent.to(probs.dtype))
    return out.to(q_abs.dtype), weights


# --------------------------------------------------------------------------------------------------------------------
# KPool indexer
# --------------------------------------------------------------------------------------------------------------------


def stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries along the last axis, ties broken toward the lower index.

    ``torch.topk`` breaks exact ties arbitrarily (the choice depends on the array's length and on where the entries
    sit), so a document's selection could change when other documents are packed beside it. Exact ties are common
    in the KPool indexer (``relu`` makes every head's score 0 for many pools), hence this deterministic rule: among
    equal scores the earlier pool wins, whatever else is in the row.

    Args:
        scores: float ``[..., P]`` (may hold ``-inf``), ``1 <= k <= P``.

    Returns:
        long ``[..., k]`` indices: the finite picks in increasing index order, then the ``-inf`` ones (when fewer
        than ``k`` entries are finite), also in increasing index order (not score order).
    """
    kth = scores.topk(k, dim=-1).values[..., -1:]
    greater = scores > kth
    tied = scores == kth
    need = k - greater.sum(-1, keepdim=True)
    chosen = greater | (tied & (torch.cumsum(tied, dim=-1) <= need))
    num = scores.shape[-1]
    rank = torch.arange(num, 0, -1, device=scores.device)  # earlier entries get larger keys
    # Finite picks first (so -inf fillers, e.g. pools of other documents, come last), each group in index order.
    key = torch.where(chosen, rank + num * torch.isfinite(scores), torch.zeros_like(rank))
    return key.topk(k, dim=-1).indices


def kpool_pool_keys(token_state: torch.Tensor, slots: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """KPool compression: the key of each pool, ``sum_j softmax_j(gate_j + ape_j) * k_j`` over its ``kp`` tokens
    (softmax per feature, over the pool's slots), as transformers' ``Glm5NextTextIndexer``.

    Args:
        token_state: fp32 ``[B, L, 2 * Dk]`` per-token ``[k | gate]`` (``k = k_norm(wk(x))``,
            ``gate = x @ index_kpool_compress_gate^T``).
        slots: long ``[B, P, kp]`` row positions (``< L``) of the tokens of each pool, in slot order.
        ape: ``[kp, Dk]`` ``index_kpool_compress_ape`` (any float dtype; used in fp32).

    Returns:
        fp32 ``[B, P, Dk]`` pool keys.
    """
    batch, pools, kp = slots.shape
    width = token_state.shape[-1]
    grouped = token_state.gather(1, slots.reshape(batch, pools * kp, 1).expand(-1, -1, width))
    slot_keys, slot_gates = grouped.view(batch, pools, kp, width).split(width // 2, dim=-1)
    probs = torch.softmax(slot_gates + ape.float()[None, None], dim=2)
    return (probs * slot_keys).sum(dim=2)


def select_top_pools(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    pool_keys_t: torch.Tensor,
    pool_end: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    select_pools: int,
    kp: int,
    *,
    offset: int = 0,
    max_score_elements: int = DEFAULT_INDEXER_SCORE_ELEMENTS,
) -> torch.Tensor:
    """Score the pools for every query, keep the top ``select_pools`` selectable ones and expand them to token ids.

    The score of pool ``p`` for query ``t`` is ``sum_h head_weights[t, h] * relu(q[t, h] . pool_keys_t[:, p])``
    (the lightning indexer's scoring with the positive scales folded into ``head_weights``); pools outside
    ``[lo, hi)`` score ``-inf``; the top pools are chosen by :func:`stable_topk_indices` (exact ties go to the earlier
    pool). Queries are scored in chunks so that the ``[B, chunk, Hi, P]`` buffer stays under ``max_score_elements``.

    Args:
        q: ``[B, S, Hi, Dk]`` indexer queries (any float dtype; scored in fp32).
        head_weights: fp32 ``[B, S, Hi]`` per-head weights, scales folded in.
        pool_keys_t: fp32 ``[B, Dk, P]``; pool ``p`` of a row is its ``p``-th complete pool.
        pool_end: long ``[B, P]`` row position of the last token of each pool.
        lo, hi: long ``[B, S]``: query ``t`` may select pools ``lo[t] <= p < hi[t]``.
        select_pools: pools kept per query (``>= 1``).
        kp: tokens per pool.
        offset: row position of query 0 (the cached length; 0 without a cache). A query at row position ``r``
            sees at most ``(r + 1) // kp`` pools, so each chunk scores only the pools it can see (eagerly; under
            ``torch.compile``, where ``offset`` may be a tensor value, all queries are one chunk scoring all ``P``
            pools, so the score buffer is ``[B, S, Hi, P]``).
        max_score_elements: element budget of the score buffer.

    Returns:
        int32 ``[B, S, select_pools * kp]`` token ids: ``kp`` consecutive ids per selected pool, in increasing pool
        order, ``-1`` for slots of unselectable picks (fewer than ``select_pools`` selectable pools).
    """
    batch, seq_len, n_heads, head_dim = q.shape
    num_pools = pool_keys_t.shape[-1]
    device = q.device
    out = torch.full((batch, seq_len, select_pools * kp), -1, dtype=torch.int32, device=device)
    chunk = max(1, int(max_score_elements) // max(1, batch * n_heads * num_pools))
    slot_offsets = torch.arange(kp, device=device) - (kp - 1)
    for start, end in _query_chunks(seq_len, chunk):
        size = end - start
        # A query at t <= end - 1 sees at most (t + 1) // kp <= end // kp pools of its row (they are disjoint).
        pools_here = num_pools if torch.compiler.is_compiling() else min(num_pools, (offset + end) // kp)
        if pools_here == 0:
            continue
        qc = q[:, start:end].float().reshape(batch, size * n_heads, head_dim)
        logits = torch.bmm(qc, pool_keys_t[:, :, :pools_here]).relu_()  # [B, C*Hi, Pc]
        logits = logits.view(batch * size, n_heads, pools_here)
        wc = head_weights[:, start:end].reshape(batch * size, 1, n_heads)
        scores = torch.bmm(wc, logits).view(batch, size, pools_here)  # [B, C, Pc]
        pool_ids = torch.arange(pools_here, device=device)
        selectable = (pool_ids >= lo[:, start:end, None]) & (pool_ids < hi[:, start:end, None])
        scores = scores.masked_fill_(~selectable, float("-inf"))
        take = min(select_pools, pools_here)
        top = stable_topk_indices(scores, take)  # [B, C, take]
        top_ok = selectable.gather(-1, top)
        top_end = pool_end.gather(1, top.reshape(batch, size * take)).view(batch, size, take)
        token_ids = top_end[..., None] + slot_offsets  # [B, C, take, kp]
        token_ids = token_ids.masked_fill(~top_ok[..., None], -1).flatten(-2)
        out[:, start:end, : take * kp] = token_ids.to(torch.int32)
    return out


def tail_token_ids(positions: torch.Tensor, local_pos: torch.Tensor, kp: int) -> torch.Tensor:
    """The tokens of each query's incomplete current pool (the "always select tail" part of the selection).

    Args:
        positions: long ``[S]`` or ``[B, S]`` row positions of the queries.
        local_pos: long ``[B, S]`` position of each query in its document.
        kp: tokens per pool (``>= 1``).

    Returns:
        int32 ``[B, S, kp - 1]``: the ``(local_pos + 1) % kp`` row positions ending at the query (the query
        included), then ``-1``.
    """
    tail_count = (local_pos + 1) % kp  # [B, S]
    tail_offsets = torch.arange(kp - 1, device=local_pos.device)
    tail_ids = (positions - tail_count + 1)[..., None] + tail_offsets  # [B, S, kp - 1]
    return tail_ids.masked_fill(~(tail_offsets < tail_count[..., None]), -1).to(torch.int32)
