"""Torch path of the DSA family: the sparse MLA core and the KPool indexer's pooling, scoring and top-k selection.

Oracle of :mod:`.dsa_fused`; path of CPU tensors and cached decoding. Sources: transformers ``Glm5NextTextAttention``
/ ``Glm5NextTextIndexer`` (``models/glm5_next``); DeepSeek-V3.2's DeepSeek Sparse Attention; FlashMLA's
``flash_mla_sparse_fwd`` contract (one shared latent KV head, per-query ids with ``-1`` padding, natural-log LSE).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula

from .graph_ops import autocast_off, define_op

__all__ = ["DEFAULT_INDEXER_SCORE_ELEMENTS", "DEFAULT_SPARSE_MLA_CHUNK_ELEMENTS", "check_sparse_mla_args",
           "kpool_pool_keys", "select_top_pools", "sparse_mla_torch", "sparse_mla_with_weights", "stable_topk_indices",
           "tail_token_ids"]

# Working-set budgets in tensor elements (fp32: 4 bytes each).
DEFAULT_INDEXER_SCORE_ELEMENTS = 1 << 24  # [B, chunk, index_n_heads, pools] score buffer of the indexer
DEFAULT_SPARSE_MLA_CHUNK_ELEMENTS = 1 << 24  # [B, chunk, W, kv_lora_rank] gathered latents + [B, chunk, H, W] scores


def check_sparse_mla_args(q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor) -> None:
    """Shape and index-dtype checks of both sparse MLA paths: ``ValueError`` unless ``q_abs`` is ``[B, S, H, Dl]``,
    ``latent`` ``[B, S_kv, Dl]`` and ``indices`` an integer ``[B, S, W]``."""
    if q_abs.dim() != 4:
        raise ValueError(f"q_abs must be [B, S, H, Dl]; got shape {tuple(q_abs.shape)}")
    batch, seq_len, _, dim = q_abs.shape
    if latent.dim() != 3 or latent.shape[0] != batch or latent.shape[2] != dim:
        raise ValueError(f"latent must be [B={batch}, S_kv, Dl={dim}]; got shape {tuple(latent.shape)}")
    if indices.dim() != 3 or indices.shape[0] != batch or indices.shape[1] != seq_len:
        raise ValueError(f"indices must be [B={batch}, S={seq_len}, W]; got shape {tuple(indices.shape)}")
    if indices.dtype.is_floating_point or indices.dtype == torch.bool or indices.dtype.is_complex:
        raise ValueError(f"indices must be an integer tensor; got dtype {indices.dtype}")


def _padded_latent(latent: torch.Tensor, indices: torch.Tensor, compute_dtype: torch.dtype):
    """``(latent_pad [B * (S_kv + 1), Dl], flat_ids long [B, S, W], valid [B, S, W])``: the latent in the compute
    dtype with a zero row appended per batch row, which every invalid id reads."""
    batch, kv_len, dim = latent.shape
    idx = indices.long()
    valid = (idx >= 0) & (idx < kv_len)  # [B, S, W]
    rows = torch.arange(batch, device=idx.device).view(batch, 1, 1) * (kv_len + 1)
    flat_ids = torch.where(valid, idx, kv_len) + rows
    pad = latent.new_zeros(batch, 1, dim, dtype=compute_dtype)
    latent_pad = torch.cat([latent.to(compute_dtype), pad], dim=1).view(batch * (kv_len + 1), dim)
    return latent_pad, flat_ids, valid


def _sparse_mla_probs(q_abs: torch.Tensor, latent_pad: torch.Tensor, flat_ids: torch.Tensor, valid: torch.Tensor,
                      scale: float, gathered_out: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(probs [B, C, H, W], lse [B, C, H], gathered [B, C, W, Dl])`` of a chunk of queries; an invalid slot has
    probability 0 next to a valid one, a query without one gets ``out = 0`` and ``lse = -inf``."""
    batch, chunk, heads, dim = q_abs.shape
    width = flat_ids.shape[-1]
    dtype = latent_pad.dtype
    ids = flat_ids.reshape(-1)
    if gathered_out is None:
        gathered = latent_pad.index_select(0, ids)
    else:  # the caller's workspace, reused across query chunks
        gathered = torch.index_select(latent_pad, 0, ids, out=gathered_out[: ids.numel()])
    gathered = gathered.view(batch * chunk, width, dim)
    bias = torch.zeros(batch * chunk, 1, width, dtype=dtype, device=q_abs.device)
    bias.masked_fill_(~valid.reshape(batch * chunk, 1, width), torch.finfo(dtype).min)
    # the scale on the small query tensor (an alpha would scale the [B*C, Dl, W] gradient of the gathered latents)
    q = (q_abs.to(dtype) * scale).reshape(batch * chunk, heads, dim)
    scores = torch.baddbmm(bias, q, gathered.transpose(1, 2))  # [B*C, H, W]
    probs = torch.softmax(scores, dim=-1)
    lse = torch.logsumexp(scores, dim=-1).masked_fill(~valid.any(-1).reshape(batch * chunk, 1), float("-inf"))
    shape = (batch, chunk)
    return probs.view(*shape, heads, width), lse.view(*shape, heads), gathered.view(*shape, width, dim)


def _query_chunks(seq_len: int, chunk: int) -> list[tuple[int, int]]:
    """``(start, end)`` ranges of at most ``chunk`` queries covering ``[0, seq_len)``; one range while compiling."""
    if torch.compiler.is_compiling():
        return [(0, seq_len)]
    return [(start, min(seq_len, start + chunk)) for start in range(0, seq_len, chunk)]


def _compute_dtype(q_abs: torch.Tensor, latent: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(q_abs.dtype, latent.dtype), torch.float32)


def _chunked_setup(q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, query_chunk: int | None):
    """``(chunk, latent_pad, flat_ids, valid, gathered_ws)`` of both passes: the query chunk (``None``: automatic) and
    one ``[B * chunk * W, Dl]`` workspace for every chunk's gathered latents (not a fresh buffer per chunk)."""
    batch, seq_len, heads, dim = q_abs.shape
    chunk = query_chunk
    if chunk is None:
        chunk = max(1, DEFAULT_SPARSE_MLA_CHUNK_ELEMENTS // max(1, batch * indices.shape[-1] * (dim + heads)))
    if chunk < 1:
        raise ValueError(f"query_chunk must be >= 1; got query_chunk={chunk}")
    latent_pad, flat_ids, valid = _padded_latent(latent, indices, _compute_dtype(q_abs, latent))
    gathered_ws = latent_pad.new_empty(batch * min(chunk, seq_len) * indices.shape[-1], dim)
    return chunk, latent_pad, flat_ids, valid, gathered_ws


def _sparse_mla_forward(q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, scale: float,
                        query_chunk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq_len, heads, dim = q_abs.shape
    chunk, latent_pad, flat_ids, valid, gathered_ws = _chunked_setup(q_abs, latent, indices, query_chunk)
    out = q_abs.new_empty(batch, seq_len, heads, dim)
    lse = latent_pad.new_empty(batch, seq_len, heads)
    for start, end in _query_chunks(seq_len, chunk):
        probs, lse_c, gathered = _sparse_mla_probs(q_abs[:, start:end], latent_pad, flat_ids[:, start:end],
                                                   valid[:, start:end], scale, gathered_ws)
        out[:, start:end] = torch.matmul(probs, gathered)
        lse[:, start:end] = lse_c
    return out, lse


def _sparse_mla_backward(q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, grad_out: torch.Tensor,
                         grad_lse: torch.Tensor | None, scale: float, query_chunk: int | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients w.r.t. ``q_abs`` and ``latent``, chunk by chunk with the softmax recomputed::

        dP = dO G^T;   dS = P * (dP - rowsum(P * dP) + dlse);   dq_abs = scale * dS G;   dG = dS^T q_s + P^T dO
    """
    batch, seq_len, heads, dim = q_abs.shape
    chunk, latent_pad, flat_ids, valid, gathered_ws = _chunked_setup(q_abs, latent, indices, query_chunk)
    dtype = latent_pad.dtype
    grad_pad = torch.zeros_like(latent_pad)
    grad_q = q_abs.new_empty(batch, seq_len, heads, dim)
    # the gradient of the gathered latents: one [B * chunk, W, Dl] workspace too
    d_gathered_ws = latent_pad.new_empty(batch * min(chunk, seq_len), indices.shape[-1], dim)
    for start, end in _query_chunks(seq_len, chunk):
        rows = batch * (end - start)
        ids_c, valid_c = flat_ids[:, start:end], valid[:, start:end]
        probs, _, gathered = _sparse_mla_probs(q_abs[:, start:end], latent_pad, ids_c, valid_c, scale, gathered_ws)
        probs, gathered = probs.reshape(rows, heads, -1), gathered.reshape(rows, -1, dim)
        d_out = grad_out[:, start:end].to(dtype).reshape(rows, heads, dim)
        d_probs = torch.bmm(d_out, gathered.transpose(1, 2))  # [rows, H, W]
        d_probs -= (probs * d_probs).sum(-1, keepdim=True)
        if grad_lse is not None:
            d_lse = grad_lse[:, start:end].to(dtype).masked_fill(~valid_c.any(-1)[..., None], 0.0)
            d_probs += d_lse.reshape(rows, heads, 1)
        d_scores = d_probs.mul_(probs)
        grad_q[:, start:end] = (torch.bmm(d_scores, gathered) * scale).view(batch, end - start, heads, dim)
        q_s = (q_abs[:, start:end].to(dtype) * scale).reshape(rows, heads, dim)
        d_gathered = torch.bmm(d_scores.transpose(1, 2), q_s, out=d_gathered_ws[:rows])
        d_gathered.baddbmm_(probs.transpose(1, 2), d_out)
        grad_pad.index_add_(0, ids_c.reshape(-1), d_gathered.view(-1, dim))
    grad_latent = grad_pad.view(batch, -1, dim)[:, : latent.shape[1]]
    return grad_q, grad_latent.to(latent.dtype, memory_format=torch.contiguous_format, copy=True)


def _sparse_mla_op_fake(q_abs, latent, indices, scale, query_chunk):
    batch, seq_len, heads, _ = q_abs.shape
    return q_abs.new_empty(q_abs.shape), q_abs.new_empty(batch, seq_len, heads, dtype=_compute_dtype(q_abs, latent))


def _sparse_mla_bwd_fake(q_abs, latent, indices, grad_out, grad_lse, scale, query_chunk):
    return q_abs.new_empty(q_abs.shape), latent.new_empty(latent.shape)


def _sparse_mla_op_setup(ctx, inputs, output):
    q_abs, latent, indices, scale, query_chunk = inputs
    ctx.scale, ctx.query_chunk = scale, query_chunk
    ctx.save_for_backward(q_abs, latent, indices)


def _sparse_mla_op_backward(ctx, grad_out, grad_lse):
    q_abs, latent, indices = ctx.saved_tensors
    grad_q, grad_latent = _SPARSE_MLA_BWD(q_abs, latent, indices, grad_out, grad_lse, ctx.scale, ctx.query_chunk)
    need_q, need_latent = ctx.needs_input_grad[:2]
    return (grad_q if need_q else None), (grad_latent if need_latent else None), None, None, None


_SPARSE_MLA_BWD = define_op("sparse_mla_torch_bwd", _sparse_mla_backward, _sparse_mla_bwd_fake)
_SPARSE_MLA_OP = define_op("sparse_mla_torch", _sparse_mla_forward, _sparse_mla_op_fake,
                           backward=_sparse_mla_op_backward, setup_context=_sparse_mla_op_setup)


def _sparse_mla_flops(q_abs_shape, latent_shape, indices_shape, *args, out_shape=None, **kwargs) -> int:
    """Forward matmul FLOPs for ``FlopCounterMode`` (it does not see inside a custom op)."""
    batch, seq_len, heads, dim = q_abs_shape
    return 4 * batch * seq_len * heads * indices_shape[-1] * dim


if torch.ops.glm53flash.sparse_mla_torch not in flop_registry:  # a second copy of this module shares the first's
    register_flop_formula(torch.ops.glm53flash.sparse_mla_torch)(_sparse_mla_flops)


def sparse_mla_torch(q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, scale: float, *,
                     query_chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse multi-query attention in the absorbed MLA form over per-query token ids (torch path).

    For batch row ``b``, query ``t``, head ``h`` and the valid slots ``w`` (``0 <= indices[b, t, w] < S_kv``; ``-1``
    or any other value is padding), with ``c_w = latent[b, indices[b, t, w]]`` as key and value::

        s[w] = scale * <q_abs[b, t, h], c_w>;   lse = ln(sum_w exp(s[w]));   out = sum_w softmax(s)[w] * c_w

    A repeated id counts twice; a query without a valid slot gets ``out = 0``, ``lse = -inf``, zero gradients.
    Runs in ``promote(dtype, float32)`` over query chunks as the custom op ``glm53flash::sparse_mla_torch``, whose
    backward recomputes each chunk: memory ``O(S * W)`` plus one chunk's ``[B, chunk, W, Dl]``, eager or compiled.

    Args:
        q_abs: ``[B, S, H, Dl]`` queries times ``W_kc`` (``Dl = kv_lora_rank``), any float dtype.
        latent: ``[B, S_kv, Dl]``; indices: integer ``[B, S, W]`` row-local ids; scale: ``qk_head_dim ** -0.5``.
        query_chunk: queries per chunk (``None``: ``B * chunk * W * (Dl + H) <= DEFAULT_SPARSE_MLA_CHUNK_ELEMENTS``).

    Returns:
        ``(out [B, S, H, Dl] in q_abs.dtype, lse [B, S, H])``, ``lse`` in the compute dtype (fp32 for 32/16-bit).

    Raises:
        ValueError: mismatched shapes, non-integer ``indices``, ``query_chunk < 1``.
    """
    check_sparse_mla_args(q_abs, latent, indices)
    batch, seq_len, heads, _ = q_abs.shape
    if query_chunk is not None and query_chunk < 1:
        raise ValueError(f"query_chunk must be >= 1; got query_chunk={query_chunk}")
    if indices.shape[-1] == 0 or seq_len == 0:
        compute_dtype = torch.promote_types(q_abs.dtype, torch.float32)
        return torch.zeros_like(q_abs), q_abs.new_full((batch, seq_len, heads), float("-inf"), dtype=compute_dtype)
    return _SPARSE_MLA_OP(q_abs, latent, indices, scale, query_chunk)


def sparse_mla_with_weights(q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sparse_mla_torch` (unchunked, same softmax, same errors) returning ``(out [B, S, H, Dl], weights
    [B, H, S, S_kv])`` in ``q_abs.dtype``: the probabilities added into a dense tensor, zero off the selected ids
    (transformers' eager weights), and ``out = weights @ latent`` (weights on the autograd path; dense cost)."""
    check_sparse_mla_args(q_abs, latent, indices)
    batch, seq_len, heads, _ = q_abs.shape
    kv_len = latent.shape[1]
    latent_pad, flat_ids, valid = _padded_latent(latent, indices, _compute_dtype(q_abs, latent))
    probs, _, _ = _sparse_mla_probs(q_abs, latent_pad, flat_ids, valid, scale)  # [B, S, H, W]
    # row-local ids into [0, S_kv]: the weights of invalid slots (all of an empty row's) land in column S_kv, dropped
    local = flat_ids - torch.arange(batch, device=flat_ids.device).view(batch, 1, 1) * (kv_len + 1)
    weights = probs.new_zeros(batch, heads, seq_len, kv_len + 1)
    weights = weights.scatter_add(-1, local[:, None].expand(-1, heads, -1, -1), probs.transpose(1, 2))
    weights = weights[..., :kv_len].contiguous().to(q_abs.dtype)
    out = torch.einsum("bhsk,bkl->bshl", weights.to(probs.dtype), latent.to(probs.dtype))
    return out.to(q_abs.dtype), weights


def stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``long [..., k]`` of the ``k`` largest of ``scores [..., P]`` (``1 <= k <= P``, may hold ``-inf``),
    exact ties to the lower index: the finite picks in increasing index order, then the ``-inf`` ones.

    A row whose picks are all finite and whose ``k``-th value does not also occur outside its top ``k`` (no tie
    crosses the boundary) takes the top ``k`` of ``torch.topk`` in index order (eager only; one ``[..., P]``
    comparison); the other rows are ranked by an integer key over all ``P`` entries.
    """
    top, top_ids = scores.topk(k, dim=-1)
    kth = top[..., -1:]
    if torch.compiler.is_compiling():
        return _ranked_topk(scores, k, top, kth)
    crossing = (scores == kth).sum(-1, dtype=torch.int32) > (top == kth).sum(-1)
    crossing |= ~top.isfinite().all(-1)
    if bool(crossing.all()):  # every row ranked: no sort of torch.topk's picks
        return _ranked_topk(scores, k, top, kth)
    out = top_ids.sort(dim=-1).values
    if bool(crossing.any()):
        out[crossing] = _ranked_topk(scores[crossing], k, top[crossing], kth[crossing])
    return out


def _ranked_topk(scores: torch.Tensor, k: int, top: torch.Tensor, kth: torch.Tensor) -> torch.Tensor:
    """:func:`stable_topk_indices` of every row, ranked by an integer key over all entries (``top`` / ``kth``: the
    rows' ``k`` largest values and the ``k``-th, ``[..., k]`` / ``[..., 1]``)."""
    # every entry greater than the k-th value is among the top k: count them there ([..., k], not [..., P])
    need = k - (top > kth).sum(-1, keepdim=True, dtype=torch.int32)
    tied = scores == kth
    # one int32 [..., P] buffer (2 * P < 2**31): first the running count of ties, then the sort keys
    key = tied.to(torch.int32).cumsum_(-1)
    chosen = key <= need
    chosen &= tied
    chosen |= scores > kth
    num = scores.shape[-1]
    # Keys: earlier entries get larger ones; finite picks first (so -inf fillers, e.g. pools of other documents,
    # come last), each group in index order; unchosen entries 0.
    finite = scores > float("-inf")
    finite &= scores < float("inf")
    key.copy_(finite).mul_(num)
    key += torch.arange(num, 0, -1, device=scores.device, dtype=torch.int32)
    key *= chosen
    return key.topk(k, dim=-1).indices


def kpool_pool_keys(token_state: torch.Tensor, slots: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """KPool keys fp32 ``[B, P, Dk]``, ``sum_j softmax_j(gate_j + ape_j) * k_j`` over each pool's slots (per
    feature), as ``Glm5NextTextIndexer``: ``token_state`` fp32 ``[B, L, 2 * Dk]`` per-token ``[k | gate]``, ``slots``
    long ``[B, P, kp]`` row positions ``< L`` of each pool's tokens, ``ape`` ``[kp, Dk]`` (used in fp32)."""
    batch, pools, kp = slots.shape
    width = token_state.shape[-1]
    grouped = token_state.gather(1, slots.reshape(batch, pools * kp, 1).expand(-1, -1, width))
    slot_keys, slot_gates = grouped.view(batch, pools, kp, width).split(width // 2, dim=-1)
    probs = torch.softmax(slot_gates + ape.float()[None, None], dim=2)
    return (probs * slot_keys).sum(dim=2)


def select_top_pools(q: torch.Tensor, head_weights: torch.Tensor, pool_keys_t: torch.Tensor, pool_end: torch.Tensor,
                     lo: torch.Tensor, hi: torch.Tensor, select_pools: int, kp: int, *, offset: int = 0,
                     max_score_elements: int = DEFAULT_INDEXER_SCORE_ELEMENTS) -> torch.Tensor:
    """Top ``select_pools`` selectable pools per query, expanded to token ids.

    Score of pool ``p`` for query ``t``: ``sum_h head_weights[t, h] * relu(q[t, h] . pool_keys_t[:, p])``; pools
    outside ``[lo[t], hi[t])`` score ``-inf``; ties to the earlier pool. ``q`` ``[B, S, Hi, Dk]`` (scored in fp32),
    ``head_weights`` fp32 ``[B, S, Hi]``, ``pool_keys_t`` fp32 ``[B, Dk, P]`` (a row's complete pools in order),
    ``pool_end`` long ``[B, P]`` their last tokens, ``lo`` / ``hi`` long ``[B, S]``, ``kp`` tokens per pool,
    ``offset`` the row position of query 0 (the cached length). Queries are scored in chunks of at most
    ``max_score_elements``, also when compiled (the op ``glm53flash::select_top_pools``; one chunk for a traced
    ``offset``). Returns int32 ``[B, S, select_pools * kp]``: ``kp`` ids per selected pool in increasing pool order,
    ``-1`` for picks that are not selectable. Under autocast the same: the scores stay fp32 (autocast off), as the
    reference's ``.float()`` casts declare (autocast would round them to bf16 and make ties of the top-k).
    """
    with autocast_off(q):
        if torch.compiler.is_compiling() and isinstance(offset, int):
            # the query chunks run eagerly inside the op: bounded score memory, no chunk loop unrolled in the graph
            return _SELECT_TOP_POOLS_OP(q, head_weights, pool_keys_t, pool_end, lo, hi, select_pools, kp,
                                        offset=offset, max_score_elements=int(max_score_elements))
        batch, seq_len, n_heads, head_dim = q.shape
        num_pools = pool_keys_t.shape[-1]
        device = q.device
        out = torch.full((batch, seq_len, select_pools * kp), -1, dtype=torch.int32, device=device)
        chunk = max(1, int(max_score_elements) // max(1, batch * n_heads * num_pools))
        slot_offsets = torch.arange(kp, device=device) - (kp - 1)
        chunks = _query_chunks(seq_len, chunk)
        # one fp32 workspace for every chunk's [B, C*Hi, Pc] logits (none for a single chunk)
        logits_ws = q.new_empty(batch * chunk * n_heads * num_pools, dtype=torch.float32) if len(chunks) > 1 else None
        for start, end in chunks:
            size = end - start
            # A query at t <= end - 1 sees at most (t + 1) // kp <= end // kp pools of its row (they are disjoint).
            pools_here = num_pools if torch.compiler.is_compiling() else min(num_pools, (offset + end) // kp)
            if pools_here == 0:
                continue
            qc = q[:, start:end].float().reshape(batch, size * n_heads, head_dim)
            keys = pool_keys_t[:, :, :pools_here]
            if logits_ws is None:
                logits = torch.bmm(qc, keys)
            else:
                out_ws = logits_ws[: batch * size * n_heads * pools_here].view(batch, size * n_heads, pools_here)
                logits = torch.bmm(qc, keys, out=out_ws)
            logits = logits.relu_().view(batch * size, n_heads, pools_here)  # [B*C, Hi, Pc]
            wc = head_weights[:, start:end].reshape(batch * size, 1, n_heads)
            scores = torch.bmm(wc, logits).view(batch, size, pools_here)  # [B, C, Pc]
            pool_ids = torch.arange(pools_here, device=device)
            selectable = (pool_ids >= lo[:, start:end, None]) & (pool_ids < hi[:, start:end, None])
            scores.masked_fill_(~selectable, float("-inf"))
            take = min(select_pools, pools_here)
            top = stable_topk_indices(scores, take)  # [B, C, take]
            top_ok = selectable.gather(-1, top)
            top_end = pool_end.gather(1, top.reshape(batch, size * take)).view(batch, size, take)
            token_ids = (top_end[..., None] + slot_offsets).masked_fill(~top_ok[..., None], -1)  # [B, C, take, kp]
            out[:, start:end, : take * kp] = token_ids.flatten(-2).to(torch.int32)
        return out


def _select_top_pools_fake(q, head_weights, pool_keys_t, pool_end, lo, hi, select_pools, kp, *, offset=0,
                           max_score_elements=DEFAULT_INDEXER_SCORE_ELEMENTS):
    return q.new_empty(q.shape[0], q.shape[1], select_pools * kp, dtype=torch.int32)


_SELECT_TOP_POOLS_OP = define_op("select_top_pools", select_top_pools, _select_top_pools_fake)


def tail_token_ids(positions: torch.Tensor, local_pos: torch.Tensor, kp: int) -> torch.Tensor:
    """Ids int32 ``[B, S, kp - 1]`` of each query's incomplete current pool: the ``(local_pos + 1) % kp`` row
    positions ending at the query (``positions`` long ``[S]`` or ``[B, S]``, ``local_pos`` long ``[B, S]``), then
    ``-1``."""
    tail_count = (local_pos + 1) % kp  # [B, S]
    tail_offsets = torch.arange(kp - 1, device=local_pos.device)
    tail_ids = (positions - tail_count + 1)[..., None] + tail_offsets  # [B, S, kp - 1]
    return tail_ids.masked_fill(~(tail_offsets < tail_count[..., None]), -1).to(torch.int32)
