"""NoPE DeepSeek-Sparse-Attention (DSA) MLA attention and its KPool indexer: the modules and the per-call dispatch of
the sparse MLA core.

Sources: transformers ``models/glm5_next/modeling_glm5_next.py`` (``Glm5NextTextAttention``,
``Glm5NextTextIndexer``: the numerical reference and the parameter names) and DeepSeek-V3.2's DeepSeek Sparse
Attention (lightning indexer + top-k sparse MLA).

What differs from the transformers module (the maths is the same):

* **Documents.** Every token-mixing step keeps the documents of a packed row apart: KPool pools restart at each
  document's first token, a query only sees complete pools of its own document, and the tail is the incomplete
  pool of its own document. The boundaries come from a :class:`~.packing.DocumentLayout` built once per forward.
* **Sparse compute.** Attention is computed only over the selected token ids, by gathering the latent ``c`` at
  those ids (``O(S * W)`` memory), never through a dense ``[B, S, S]`` mask. It uses the absorbed MLA form
  (queries multiplied into the latent space by ``W_kc``, keys = values = latent, output lifted by ``W_vc``), with
  and without a cache: a decoding step attends over the selected cached latents.
* **Bounded memory.** The indexer scores queries in chunks under an element budget, the attention core runs in
  query chunks each wrapped in activation checkpointing, so neither keeps ``[S, S]``-sized buffers.

The torch operators (sparse MLA, KPool pooling, pool scoring and top-k selection) are in :mod:`.dsa_ops`. The
attention core is :func:`.dsa_ops.sparse_mla_torch` or its fused alternative
:func:`glm53flash_hf.dsa_fused.sparse_mla_fused`, chosen per call by :func:`.dispatch.op_for` (``config.kernels["dsa"]``
and the tensors).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from .dispatch import op_for, register_fused, requested_backend
from .dsa_ops import (
    DEFAULT_INDEXER_SCORE_ELEMENTS,
    kpool_pool_keys,
    select_top_pools,
    sparse_mla_torch,
    sparse_mla_with_weights,
    tail_token_ids,
)
from .norm import Glm53FlashRMSNorm
from .offload import call_onloaded, is_offload_hooked
from .packing import DocumentLayout, build_document_layout

__all__ = [
    "Glm53FlashAttention",
    "Glm53FlashIndexer",
    "init_dsa_weights",
    "sparse_mla",
]


def _sparse_mla_fused():
    from .dsa_fused import sparse_mla_fused  # CUDA tensors only: CPU runs never import triton

    return sparse_mla_fused


register_fused("dsa", sparse_mla_torch, _sparse_mla_fused)


def sparse_mla(
    q_abs: torch.Tensor,
    latent: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    *,
    backend: str = "auto",
    query_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention core; picks the implementation named by ``backend`` for this call.

    Same contract as :func:`.dsa_ops.sparse_mla_torch`: ``q_abs`` ``[B, S, H, Dl]``, ``latent`` ``[B, S_kv, Dl]``,
    integer ``indices`` ``[B, S, W]`` (``-1`` padding) -> ``(out [B, S, H, Dl] in q_abs.dtype, lse [B, S, H])``,
    natural-log LSE (fp32 for fp32/bf16/fp16 inputs).

    Args:
        backend: ``"torch"`` (:func:`.dsa_ops.sparse_mla_torch`), ``"auto"`` (the Triton kernel
            :func:`glm53flash_hf.dsa_fused.sparse_mla_fused` when it can run on these tensors: CUDA, triton
            installed, fp32/bf16/fp16; else torch) or ``"fused"`` (the Triton kernel; when it cannot run, a warning
            says why once and torch runs).
        query_chunk: queries per chunk of the torch path; the fused kernel needs no chunking (its memory is
            ``O(S * W)`` without it) and ignores it.

    Raises:
        ValueError: for an unknown ``backend`` (:func:`.dispatch.choose_backend`), and the errors of the chosen path.
    """
    op = op_for(sparse_mla_torch, backend, q_abs, latent, indices)
    return op(q_abs, latent, indices, scale, query_chunk=query_chunk)


# --------------------------------------------------------------------------------------------------------------------
# KPool indexer
# --------------------------------------------------------------------------------------------------------------------


def _check_layout(layout: DocumentLayout, batch: int, seq_len: int, device: torch.device) -> DocumentLayout:
    if layout is None:
        return build_document_layout(batch, seq_len, device)
    if not isinstance(layout, DocumentLayout):
        raise ValueError(f"layout must be a DocumentLayout; got {type(layout).__name__}")
    if layout.batch_size != batch or layout.seq_len != seq_len:
        raise ValueError(
            f"layout describes a [{layout.batch_size}, {layout.seq_len}] batch but hidden_states is "
            f"[{batch}, {seq_len}]"
        )
    return layout


class Glm53FlashIndexer(nn.Module):
    """KPool lightning indexer of a GLM-5.3 DSA layer: picks, per query, the token ids its attention may read.

    Parameters (names, shapes and dtypes as transformers' ``Glm5NextTextIndexer``): ``wq_b``
    (``q_lora_rank -> index_n_heads * index_head_dim``), ``wk`` (``hidden -> index_head_dim``), ``k_norm``
    (``LayerNorm(index_head_dim, eps=1e-6)``), ``weights_proj`` (``hidden -> index_n_heads``),
    ``index_kpool_compress_ape`` ``[index_kpool, index_head_dim]``, ``index_kpool_compress_gate``
    ``[index_head_dim, hidden]``.

    Semantics per document (those of ``Glm5NextTextIndexer``, with pools restarting at each document): pools are
    consecutive groups of ``kp = index_kpool`` tokens from the document's first token; the pool key (fp32) is
    ``sum_j softmax_j(gate[j] + ape[j]) * k[j]`` over its slots (:func:`.dsa_ops.kpool_pool_keys`); the score of
    pool ``p`` for query ``t`` is ``sum_h w[t,h] * n_heads^-0.5 * relu(q[t,h] . pk[p] * head_dim^-0.5)``
    (``w = weights_proj(h)`` in fp32; the positive scales are folded into ``w``). Query ``t`` may select the
    complete pools of its document that end at or before ``t`` (the first ``(local_pos + 1) // kp`` pools); it takes
    the top ``min(index_topk // kp, #selectable)`` (:func:`.dsa_ops.select_top_pools`) and expands them to token
    ids. With ``index_kpool_always_select_tail`` it also gets the ``(local_pos + 1) % kp`` tokens of its incomplete
    current pool. For one unpadded document (or a left-padded row) the id SET equals transformers' indexer output.

    Attributes:
        max_score_elements: element budget of the ``[B, chunk, index_n_heads, pools]`` fp32 score buffer; the
            queries are processed in chunks that respect it (settable per instance).
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.index_topk = config.index_topk
        self.q_lora_rank = config.q_lora_rank
        self.index_kpool = config.index_kpool
        self.index_kpool_always_select_tail = bool(config.index_kpool_always_select_tail)
        if self.index_kpool < 1:
            raise ValueError(f"index_kpool must be >= 1; got index_kpool={self.index_kpool}")
        if self.index_topk < 1:
            raise ValueError(f"index_topk must be >= 1; got index_topk={self.index_topk}")
        if self.q_lora_rank is None:
            raise ValueError("q_lora_rank must be set: the indexer reads the MLA query residual")
        self.softmax_scale = self.head_dim**-0.5
        self.max_score_elements = DEFAULT_INDEXER_SCORE_ELEMENTS

        self.wq_b = nn.Linear(self.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(self.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(self.hidden_size, self.n_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.index_kpool, self.head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(self.head_dim, self.hidden_size))

    @property
    def output_width(self) -> int:
        """``W = index_topk + (index_kpool - 1 if index_kpool_always_select_tail else 0)``."""
        return self.index_topk + (self.index_kpool - 1 if self.index_kpool_always_select_tail else 0)

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, q_resid: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        """Select the token ids each query attends to.

        Args:
            hidden_states: ``[B, S, hidden_size]`` attention input.
            q_resid: ``[B, S, q_lora_rank]``, ``q_a_layernorm(q_a_proj(hidden_states))`` of the attention layer.
            layout: document structure of the batch (``None``: every row is one unpadded document).

        Returns:
            int32 ``[B, S, W]`` (``W = output_width``) row-local token ids, ``-1`` padding. Selected pools come
            first (``kp`` ids each, in increasing pool order; exact score ties go to the earlier pool, see
            :func:`.dsa_ops.stable_topk_indices`), then ``-1`` for unfilled pool slots, then the tail
            slots. Padding queries (``layout.valid`` False) are all ``-1``. Runs without gradient (frozen indexer).

        Raises:
            ValueError: on shapes that do not match the configuration or the layout.
        """
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be [B, S, hidden_size={self.hidden_size}]; got {tuple(hidden_states.shape)}"
            )
        batch, seq_len, _ = hidden_states.shape
        if q_resid.shape != (batch, seq_len, self.q_lora_rank):
            raise ValueError(
                f"q_resid must be [B={batch}, S={seq_len}, q_lora_rank={self.q_lora_rank}]; got {tuple(q_resid.shape)}"
            )
        layout = _check_layout(layout, batch, seq_len, hidden_states.device)
        sp = getattr(layout, "sequence_parallel", None)
        if sp is not None:
            # sequence parallel: the keys are the whole group's tokens (global row positions), the queries this
            # rank's shard at row offset sp.offset; gathered once per call (no gradient: the indexer is frozen)
            glob = sp.global_layout
            state = sp.gather_sequence(self._token_state(hidden_states), grad=False)
            return self._pool_select(
                hidden_states, q_resid, lambda: state, glob.valid.to(state.device), glob.local_pos.to(state.device),
                offset=sp.offset,
            )
        return self._pool_select(
            hidden_states, q_resid, lambda: self._token_state(hidden_states), layout.valid.to(hidden_states.device),
            layout.local_pos.to(hidden_states.device), offset=0,
        )

    def _pool_select(self, hidden_states, q_resid, token_state, valid_kv, local_pos_kv, offset: int) -> torch.Tensor:
        """Selection of the ``S`` queries of ``hidden_states`` sitting at row positions ``[offset, offset + S)`` of
        key rows of length ``S_kv`` (``S_kv = S``, ``offset = 0`` without sequence parallelism).

        ``token_state()`` gives the fp32 ``[B, S_kv, 2 * Dk]`` per-token state of the key rows (called only when a
        pool can be selected); ``valid_kv`` / ``local_pos_kv`` ``[B, S_kv]`` their layout. Returns int32
        ``[B, S, output_width]`` key-row positions (see :meth:`forward`)."""
        batch, seq_len, _ = hidden_states.shape
        device = hidden_states.device
        kp = self.index_kpool
        kv_len = valid_kv.shape[1]
        positions_kv = torch.arange(kv_len, device=device)
        queries = slice(offset, offset + seq_len)
        valid, local_pos, positions = valid_kv[:, queries], local_pos_kv[:, queries], positions_kv[queries]
        out = torch.full((batch, seq_len, self.output_width), -1, dtype=torch.int32, device=device)

        # ---- pools: complete groups of kp tokens of one document, identified by their last token ----------------
        num_pools = kv_len // kp  # static upper bound on complete pools per row
        select_pools = min(self.index_topk // kp, num_pools)
        if select_pools > 0:
            is_end = valid_kv & ((local_pos_kv + 1) % kp == 0)  # last token of a complete pool
            ends_upto = torch.cumsum(is_end.long(), dim=1)  # [B, S_kv] complete pools of the row ending at <= t
            # Row positions of the pool ends in order (pool id = rank among the row's ends); a sort keeps it
            # deterministic and sync-free. Absent pools (row has fewer than P) point at position 0, never selectable.
            order_key = torch.where(is_end, positions_kv, positions_kv + kv_len)
            pool_end = order_key.sort(dim=1).values[:, :num_pools]
            pool_end = torch.where(pool_end < kv_len, pool_end, torch.zeros_like(pool_end))  # [B, P]

            # Pool keys, once per forward (fp32).
            slots = (pool_end[:, :, None] - (kp - 1) + torch.arange(kp, device=device)).clamp_min(0)  # [B, P, kp]
            pool_keys = kpool_pool_keys(token_state(), slots, self.index_kpool_compress_ape)

            # Selectable pools of query t: ids [hi - (local_pos + 1) // kp, hi) with hi = ends_upto[t].
            ends_q = ends_upto[:, queries]
            hi = torch.where(valid, ends_q, torch.zeros_like(ends_q))
            lo = torch.where(valid, ends_q - (local_pos + 1) // kp, torch.zeros_like(ends_q))
            pool_keys_t = pool_keys.transpose(1, 2).contiguous()  # [B, Dk, P]
            out[..., : select_pools * kp] = self._select(
                hidden_states, q_resid, pool_keys_t, pool_end, lo, hi, select_pools, offset=offset
            )
        return self._finish(out, positions, local_pos, valid)

    def _token_state(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """fp32 ``[B, S, 2 * Dk]`` per-token ``[k | gate]``: ``k = k_norm(wk(x))``, ``gate = x @ compress_gate^T``."""
        keys = self.k_norm(self.wk(hidden_states))
        gates = F.linear(hidden_states, self.index_kpool_compress_gate)
        return torch.cat([keys.float(), gates.float()], dim=-1)

    def _select(self, hidden_states, q_resid, pool_keys_t, pool_end, lo, hi, select_pools: int, offset: int):
        """The indexer queries and head weights (scales folded in; ``relu`` is 1-homogeneous) of ``hidden_states``,
        then :func:`.dsa_ops.select_top_pools`: int32 ``[B, S, select_pools * kp]`` token ids."""
        batch, seq_len, _ = hidden_states.shape
        q = self.wq_b(q_resid).view(batch, seq_len, self.n_heads, self.head_dim)
        head_weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float()
        head_weights = head_weights * (self.n_heads**-0.5 * self.softmax_scale)  # [B, S, Hi]
        return select_top_pools(
            q, head_weights, pool_keys_t, pool_end, lo, hi, select_pools, self.index_kpool,
            offset=offset, max_score_elements=self.max_score_elements,
        )  # fmt: skip

    def _finish(self, out: torch.Tensor, positions, local_pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """With ``index_kpool_always_select_tail``, write each query's tail tokens (:func:`.dsa_ops.tail_token_ids`)
        into ``out[..., index_topk:]``; then ``-1`` for padding queries. In place; returns ``out``."""
        if self.index_kpool_always_select_tail and self.index_kpool > 1:
            out[..., self.index_topk :] = tail_token_ids(positions, local_pos, self.index_kpool)
        return out.masked_fill_(~valid[..., None], -1)

    @torch.no_grad()
    def forward_cached(self, hidden_states: torch.Tensor, q_resid: torch.Tensor, cache, ctx) -> torch.Tensor:
        """Select token ids for ``S`` new queries, continuing from (and updating) the layer's indexer state.

        State (fp32, in transformers' ``DynamicIndexedLayer`` / ``StaticIndexedLayer`` ``indexer_keys``, grown by
        ``cache.update_indexer`` like every token-indexed cache): ``[B, L, 2 * Dk]``. Row slot ``s`` first holds
        token ``s``'s ``[k | gate]`` (``k = k_norm(wk(x))``, ``gate = x @ index_kpool_compress_gate^T``). When the
        ``j``-th pool of a row completes (its last token arrives), its key
        ``sum_i softmax_i(gate_i + ape_i) * k_i`` is computed once, from its ``kp`` slots, and written into the
        first ``Dk`` columns of slot ``j``. Slot ``j`` is never read as a token again: every token of pool ``j'``
        sits at ``first + kp * j' + i >= j'``, and a pool is built before any pool key lands on its slots. So the
        complete pool keys of a row are the contiguous view ``state[b, :P, :Dk]`` — no re-pooling, no gather per
        step — and a decode step scores ``P`` cached pool keys, then adds the tail (the incomplete current pool).

        Rollback (assisted / MTP decoding): while the cache layer records its past
        (:class:`~.generation_cache.Glm53FlashIndexedCacheLayer`), the values each new pool key replaced are handed
        to ``record_pool_keys``, and a later ``crop`` that removes a pool's last token restores them; a pool
        completed again is rebuilt and rewritten by the next call (``n_before`` follows the cropped length).

        Pools start at the row's first real token (``ctx.first``, left padding), as the uncached layout; the
        output equals :meth:`forward` on the whole row (same pools, same scores, same tie rule), for the new
        queries.

        Args:
            hidden_states: ``[B, S, hidden_size]``; q_resid: ``[B, S, q_lora_rank]``.
            cache: transformers ``Cache``; ctx: the forward's :class:`~.generation_cache.CacheContext`.

        Returns:
            int32 ``[B, S, output_width]`` row positions (= cache slots), ``-1`` padding; padding queries all ``-1``.
        """
        batch, seq_len, _ = hidden_states.shape
        device = hidden_states.device
        kp, head_dim = self.index_kpool, self.head_dim
        past, total = ctx.past, ctx.past + seq_len
        first, valid, local_pos = ctx.first, ctx.valid, ctx.local_pos

        state = cache.update_indexer(self._token_state(hidden_states), self.layer_idx)  # [B, L, 2Dk]
        cap = state.shape[1]

        # ---- pools completed by this call: ids [n_before, n_after) of each row; build and store their keys -------
        n_before = (past - first).clamp_min(0) // kp  # [B]
        n_after = (total - first).clamp_min(0) // kp
        cand = -(-seq_len // kp)  # a call of S tokens completes at most ceil(S / kp) pools per row
        pool_j = n_before[:, None] + torch.arange(cand, device=device)  # [B, cand] (distinct, < total <= cap)
        new = pool_j < n_after[:, None]
        slots = (first[:, None, None] + kp * pool_j[..., None] + torch.arange(kp, device=device)).clamp(0, cap - 1)
        pool_keys = kpool_pool_keys(state, slots, self.index_kpool_compress_ape)  # [B, cand, Dk], as forward()
        key_cols = state[..., :head_dim]
        where = pool_j.clamp(max=cap - 1)[..., None].expand(-1, -1, head_dim)
        old_keys = key_cols.gather(1, where)
        key_cols.scatter_(1, where, torch.where(new[..., None], pool_keys, old_keys))
        layer = cache.layers[self.layer_idx] if self.layer_idx < len(cache.layers) else None
        if getattr(layer, "record_past", False) and hasattr(layer, "record_pool_keys"):
            # assisted decoding: a crop that removes a pool's last token puts the replaced values back
            # (generation_cache.Glm53FlashIndexedCacheLayer)
            layer.record_pool_keys(where[..., 0], old_keys, slots[..., -1], new)

        out = torch.full((batch, seq_len, self.output_width), -1, dtype=torch.int32, device=device)
        # upper bound on complete pools of any row; under torch.compile the cache capacity (static, while the past
        # length is a tensor value), the pools beyond a row's own count are never selectable (hi)
        num_pools = (cap if torch.compiler.is_compiling() else total) // kp
        select_pools = min(self.index_topk // kp, num_pools)
        if select_pools > 0:
            pool_keys_t = key_cols[:, :num_pools].transpose(1, 2)  # [B, Dk, P] view of the cached pool keys
            pool_end = first[:, None] + kp * torch.arange(num_pools, device=device) + (kp - 1)  # [B, P]
            hi = torch.where(valid, (local_pos + 1).clamp_min(0) // kp, torch.zeros_like(local_pos))
            out[..., : select_pools * kp] = self._select(
                hidden_states, q_resid, pool_keys_t, pool_end, torch.zeros_like(hi), hi, select_pools, offset=past
            )
        return self._finish(out, ctx.positions, local_pos, valid)


# --------------------------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------------------------


class Glm53FlashAttention(nn.Module):
    """NoPE MLA attention of a GLM-5.3 DSA layer, sparse over the KPool indexer's selection.

    Parameters (names as transformers' ``Glm5NextTextAttention``): ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj`` and ``indexer`` (a
    :class:`Glm53FlashIndexer`, ``None`` for a "shared" layer).

    Maths (those of ``Glm5NextTextAttention``): ``q = q_b_proj(q_a_layernorm(q_a_proj(x)))`` ``[B,S,H,qk_nope]``;
    latent ``c = kv_a_layernorm(kv_a_proj_with_mqa(x))`` ``[B,S,kv_lora_rank]``; ``kv_b_proj.weight`` viewed
    ``[H, qk_nope + v_head_dim, kv_lora_rank]`` gives ``W_kc`` (first ``qk_nope`` rows) and ``W_vc``; absorbed
    queries ``q_abs[h] = q[h] @ W_kc[h]``; ``out_lat = SparseMLA(q_abs, c, ids, scale = qk_head_dim^-0.5)``;
    ``o[h] = out_lat[h] @ W_vc[h]^T``; ``o_proj`` of the concatenated heads. No RoPE (``qk_rope_head_dim == 0``).

    Args:
        config: a ``Glm53FlashTextConfig`` (or transformers' ``Glm5NextTextConfig``).
        layer_idx: index of the layer; ``num_hidden_layers`` (and above) is the MTP layer.
        indexer_type: ``"full"`` (own indexer) or ``"shared"`` (reuse the previous layer's ids); ``None`` reads
            ``config.indexer_types[layer_idx]`` for main layers and ``"full"`` for MTP layers.

    Attributes:
        next_skip_topk: this layer is "full" and the next main layer is "shared": ``forward`` returns its ids.
        backend: the sparse-MLA implementation (``config.kernels["dsa"]``).
        query_chunk: queries per chunk of the attention core (``None``: automatic budget).

    Raises:
        ValueError: ``qk_rope_head_dim != 0``, an unknown ``indexer_type``, or ``q_lora_rank`` unset.
    """

    def __init__(self, config, layer_idx: int, indexer_type: str | None = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            raise ValueError("q_lora_rank must be set for DSA attention (the indexer reads the query residual)")
        self.num_heads = config.num_attention_heads
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        if self.qk_rope_head_dim != 0:
            raise ValueError(f"qk_rope_head_dim must be 0 (NoPE DSA); got qk_rope_head_dim={self.qk_rope_head_dim}")
        self.v_head_dim = config.v_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.attention_dropout = config.attention_dropout

        num_layers = config.num_hidden_layers
        if indexer_type is None:
            indexer_type = config.indexer_types[layer_idx] if layer_idx < num_layers else "full"
        if indexer_type not in ("full", "shared"):
            raise ValueError(f"indexer_type must be 'full' or 'shared'; got indexer_type={indexer_type!r}")
        self.indexer_type = indexer_type
        self.skip_topk = indexer_type == "shared"
        self.next_skip_topk = (
            not self.skip_topk and layer_idx + 1 < num_layers and config.indexer_types[layer_idx + 1] == "shared"
        )
        self.scaling = self.qk_head_dim**-0.5
        self.query_chunk: int | None = None

        bias = config.attention_bias
        self.q_a_proj = nn.Linear(self.hidden_size, self.q_lora_rank, bias=bias)
        self.q_a_layernorm = Glm53FlashRMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)
        self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(self.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = Glm53FlashRMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, self.hidden_size, bias=bias)
        self.indexer = None if self.skip_topk else Glm53FlashIndexer(config, layer_idx)

    @property
    def backend(self) -> str:
        """The sparse-MLA implementation requested for this call (``config.kernels["dsa"]``)."""
        return requested_backend(self.config, "dsa")

    def kv_b_weight(self, like: torch.Tensor) -> torch.Tensor:
        """Effective ``kv_b_proj`` weight ``[H * (qk_nope + v_head_dim), kv_lora_rank]`` for the absorbed form.

        A plain ``nn.Linear`` gives its ``weight``. A wrapped module (e.g. a PEFT LoRA layer) or one whose weight
        accelerate offloads (``device_map`` loading: the weight holds data only inside its forward) is applied to the
        identity, ``W_eff = kv_b_proj(I)^T``, so its adapters take part in forward and backward exactly as if the
        module were called on the latents (``like`` gives the identity's device and dtype).
        """
        proj = self.kv_b_proj
        if type(proj) is nn.Linear and not is_offload_hooked(proj):
            return proj.weight
        eye = torch.eye(self.kv_lora_rank, device=like.device, dtype=like.dtype)
        return proj(eye).transpose(0, 1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        layout: DocumentLayout,
        prev_topk_indices: torch.Tensor | None = None,
        cache=None,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Sparse attention of ``hidden_states`` ``[B, S, hidden_size]``.

        Args:
            layout: document structure (``None``: every row one unpadded document); with ``cache``, the one
                :func:`.packing.build_layout` made for it (``layout.cache_context`` set).
            prev_topk_indices: int ``[B, S, W]`` ids of the previous "full" layer; required by "shared" layers,
                ignored by "full" ones.
            cache: optional transformers ``Cache`` (generation). Its layer ``layer_idx`` (``DynamicIndexedLayer`` /
                ``StaticIndexedLayer``) stores the latent ``c`` as ``keys`` ``[B, 1, L, kv_lora_rank]`` (``values``
                the empty rope part ``[B, 1, L, 0]``, as transformers) and the indexer state
                (:meth:`Glm53FlashIndexer.forward_cached`). The new queries attend over the selected cached latents
                only, in the absorbed form (``q_abs = q W_kc``; ``out = softmax(q_abs c_sel^T) c_sel``; ``W_vc^T``):
                the cache is never expanded through ``kv_b_proj``. Ids are row positions (= cache slots).
            output_attentions: also return the attention weights ``[B, H, S, S_kv]`` (``S_kv``: the latents
                attended over, the cache length when cached), the softmax over the selected ids scattered into a
                dense tensor, zero elsewhere; the output is then computed from them
                (:func:`.dsa_ops.sparse_mla_with_weights`, torch, dense cost). Otherwise no dense tensor is formed.
            kwargs: ignored (``position_ids``, ``position_embeddings``, ... of the decoder layer; NoPE).

        Sequence parallelism: with ``layout.sequence_parallel`` set (:mod:`.sequence_parallel`) the latent and the
        indexer state are all-gathered over the group, the ids are global row positions and the local queries
        attend over the global latents (memory and bytes moved:
        :meth:`~.sequence_parallel.SequenceParallelContext.gather_sequence`).

        Returns:
            ``(attn_output [B, S, hidden_size], topk_indices, attn_weights)``; ``topk_indices`` is the int32
            ``[B, S, W]`` selection when ``next_skip_topk`` (for the next, shared layer), else ``None``;
            ``attn_weights`` the weights with ``output_attentions``, else ``None``. Padding queries give zero attention
            (so ``o_proj``'s bias, if any).

        Raises:
            ValueError: bad shapes, a "shared" layer called without ``prev_topk_indices``, or a ``cache`` with a
                ``layout`` without ``cache_context``.
            NotImplementedError: attention dropout > 0 in training mode; ``cache`` that is not a transformers
                ``Cache`` (:class:`~.generation_cache.UnsupportedCacheError`, also a ``TypeError``).
        """
        if cache is not None:
            from .generation_cache import check_cache

            check_cache(cache, "Glm53FlashAttention")
            cache_context = getattr(layout, "cache_context", None)
            if cache_context is None:
                raise ValueError(
                    "Glm53FlashAttention: a cache needs a layout with cache_context (packing.build_layout(..., "
                    f"cache=cache)); got layout={type(layout).__name__}"
                )
        if self.training and self.attention_dropout > 0:
            raise NotImplementedError(
                f"attention_dropout={self.attention_dropout} is not supported by sparse DSA attention; set it to 0"
            )
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be [B, S, hidden_size={self.hidden_size}]; got {tuple(hidden_states.shape)}"
            )
        batch, seq_len, _ = hidden_states.shape
        if cache is None:
            layout = _check_layout(layout, batch, seq_len, hidden_states.device)

        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        q_nope = self.q_b_proj(q_resid).view(batch, seq_len, self.num_heads, self.qk_nope_head_dim)
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(hidden_states))  # [B, S, Dl] (no rope part)

        kv_b = self.kv_b_weight(latent).view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_kc = kv_b[:, : self.qk_nope_head_dim]  # [H, Dn, Dl]
        w_vc = kv_b[:, self.qk_nope_head_dim :]  # [H, Dv, Dl]
        q_abs = torch.einsum("bshd,hdl->bshl", q_nope, w_kc.to(q_nope.dtype))

        if cache is not None:
            keys, _ = cache.update(latent.unsqueeze(1), latent.new_zeros(batch, 1, seq_len, 0), self.layer_idx)
            latent = keys[:, 0]  # [B, L, Dl]: cached + new latents (static cache: L = max_cache_len)
        sp = getattr(layout, "sequence_parallel", None) if cache is None else None
        if sp is not None:
            # sequence parallel: attend over the whole group's latents (global row positions); the all-gather's
            # backward sums the latent gradients back onto their owners (SequenceParallelContext.gather_sequence)
            latent = sp.gather_sequence(latent)
        if self.indexer is not None:
            if cache is not None:
                topk_indices = call_onloaded(
                    (self.indexer,), lambda: self.indexer.forward_cached(hidden_states, q_resid, cache, cache_context)
                )
            else:
                topk_indices = self.indexer(hidden_states, q_resid, layout)
        else:
            if prev_topk_indices is None:
                raise ValueError(
                    f"layer {self.layer_idx} has a 'shared' indexer and needs prev_topk_indices from the previous "
                    "'full' DSA layer; got None"
                )
            if prev_topk_indices.dim() != 3 or prev_topk_indices.shape[:2] != (batch, seq_len):
                raise ValueError(
                    f"prev_topk_indices must be [B={batch}, S={seq_len}, W]; got {tuple(prev_topk_indices.shape)}"
                )
            topk_indices = prev_topk_indices

        weights = None
        if output_attentions:
            out_lat, weights = sparse_mla_with_weights(q_abs, latent, topk_indices, self.scaling)
        else:
            op = op_for(sparse_mla_torch, self.backend, q_abs, latent, topk_indices)
            out_lat, _ = op(q_abs, latent, topk_indices, self.scaling, query_chunk=self.query_chunk)
        attn = torch.einsum("bshl,hvl->bshv", out_lat, w_vc.to(out_lat.dtype))
        attn = attn.reshape(batch, seq_len, self.num_heads * self.v_head_dim)
        attn = self.o_proj(attn)
        return attn, (topk_indices if self.next_skip_topk else None), weights


def init_dsa_weights(module: nn.Module, config) -> None:
    """Initialise the DSA parameters that the generic Linear/LayerNorm/RMSNorm init does not cover.

    Reproduces transformers' ``Glm5NextPreTrainedModel._init_weights`` for the indexer:
    ``index_kpool_compress_ape`` zeros, ``index_kpool_compress_gate`` ones. Other modules are left alone. ``config``
    is accepted for a uniform signature.
    """
    if isinstance(module, Glm53FlashIndexer):
        init.zeros_(module.index_kpool_compress_ape)
        init.ones_(module.index_kpool_compress_gate)
