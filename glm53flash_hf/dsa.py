"""NoPE DeepSeek-Sparse-Attention (DSA) MLA attention and its KPool indexer.

Sources: transformers ``models/glm5_next/modeling_glm5_next.py`` (``Glm5NextTextAttention``,
``Glm5NextTextIndexer``: the numerical reference and the parameter names), DeepSeek-V3.2 DSA (lightning indexer +
top-k sparse MLA), and the project notes ``shared/reference/model-spec.md`` §5-§6, §13 items 10-12 and
``shared/reference/kernels.md`` §4.

What differs from the transformers module (the maths is the same):

* **Documents.** Every token-mixing step keeps the documents of a packed row apart: KPool pools restart at each
  document's first token, a query only sees complete pools of its own document, and the tail is the incomplete
  pool of its own document. The boundaries come from a :class:`~.packing.DocumentLayout` built once per forward.
* **Sparse compute.** Attention is computed only over the selected token ids, by gathering the latent ``c`` at
  those ids (``O(S * W)`` memory), never through a dense ``[B, S, S]`` mask. It uses the absorbed MLA form
  (queries multiplied into the latent space by ``W_kc``, keys = values = latent, output lifted by ``W_vc``).
* **Bounded memory.** The indexer scores queries in chunks under an element budget, the attention core runs in
  query chunks each wrapped in activation checkpointing, so neither keeps ``[S, S]``-sized buffers.

The attention core is :func:`sparse_mla`, which dispatches per call on ``backend`` (``config.kernels["dsa"]``) and the
tensors' device: :func:`sparse_mla_torch` (CPU and the oracle) or, on CUDA, our Triton kernel
:func:`glm53flash_hf.triton_dsa.sparse_mla_triton` (forward and backward, checked against the torch path under the
Triton interpreter in ``tests/test_triton_dsa.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import initialization as init

from .dispatch import choose_backend, requested_backend
from .norm import Glm53FlashRMSNorm
from .packing import DocumentLayout, build_document_layout

__all__ = [
    "Glm53FlashAttention",
    "Glm53FlashIndexer",
    "init_dsa_weights",
    "sparse_mla",
    "sparse_mla_torch",
]

# Default working-set budgets, in tensor elements (fp32: 4 bytes each).
DEFAULT_INDEXER_SCORE_ELEMENTS = 1 << 26  # [B, chunk, index_n_heads, pools] score buffer of the indexer
DEFAULT_SPARSE_MLA_CHUNK_ELEMENTS = 1 << 26  # [B, chunk, W, kv_lora_rank] gathered latents + [B, chunk, H, W] scores



# --------------------------------------------------------------------------------------------------------------------
# Sparse MLA core
# --------------------------------------------------------------------------------------------------------------------


def _sparse_mla_chunk(
    q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query chunk of :func:`sparse_mla_torch`: ``q_abs [B,C,H,Dl]``, ``indices [B,C,W]`` -> out, lse."""
    batch, chunk, _, dim = q_abs.shape
    kv_len = latent.shape[1]
    width = indices.shape[-1]
    compute_dtype = torch.promote_types(torch.promote_types(q_abs.dtype, latent.dtype), torch.float32)

    idx = indices.long()
    valid = (idx >= 0) & (idx < kv_len)  # [B, C, W]
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    gathered = torch.gather(latent, 1, safe.reshape(batch, chunk * width, 1).expand(-1, -1, dim))
    gathered = gathered.view(batch, chunk, width, dim).to(compute_dtype)  # [B, C, W, Dl]

    scores = torch.matmul(q_abs.to(compute_dtype), gathered.transpose(-1, -2)) * scale  # [B, C, H, W]
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))  # empty rows: all -inf
    expo = torch.exp(scores - row_max)
    denom = expo.sum(dim=-1, keepdim=True)
    nonempty = denom > 0
    safe_denom = torch.where(nonempty, denom, torch.ones_like(denom))
    probs = expo / safe_denom
    out = torch.matmul(probs, gathered)  # [B, C, H, Dl]
    lse = torch.where(nonempty, row_max + torch.log(safe_denom), torch.full_like(denom, float("-inf"))).squeeze(-1)
    return out, lse


def sparse_mla_torch(
    q_abs: torch.Tensor,
    latent: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    *,
    query_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse multi-query attention in the absorbed MLA form, over per-query token ids (torch reference path).

    For every batch row ``b``, query ``t`` and head ``h``::

        s[w]         = scale * <q_abs[b, t, h], latent[b, indices[b, t, w]]>     for valid slots w
        lse[b, t, h] = log(sum_w exp(s[w]))                                    (natural log)
        out[b, t, h] = sum_w softmax(s)[w] * latent[b, indices[b, t, w]]

    Keys and values are both the latent ``c`` (one KV head shared by all heads, as in DeepSeek-V3.2 / FlashMLA's
    ``flash_mla_sparse_fwd`` with ``d_v = d_qk``). A slot is valid when ``0 <= index < S_kv``; ``-1`` (or any
    out-of-range value) is padding. Ids must be unique within a query's row: a repeated id is counted twice
    (the indexer never repeats ids). A query without any valid slot gets ``out = 0`` and ``lse = -inf``; its
    gradients are zero, never NaN.

    The computation runs in ``promote(input dtype, float32)`` (softmax in fp32 at least) over query chunks; each
    chunk is wrapped in ``torch.utils.checkpoint`` (non-reentrant) when gradients are needed, so memory is
    ``O(S * W)`` for the indices plus one chunk's ``[B, chunk, W, Dl]`` gathered latents, never ``[S, S_kv]``.

    Args:
        q_abs: ``[B, S, H, Dl]`` queries already multiplied by ``W_kc`` (``Dl = kv_lora_rank``), any float dtype.
        latent: ``[B, S_kv, Dl]`` latent keys/values (``kv_a_layernorm(kv_a_proj_with_mqa(x))``).
        indices: integer ``[B, S, W]`` row-local token ids into ``latent`` (int32 or int64), ``-1`` = invalid.
        scale: softmax scale (``qk_head_dim ** -0.5`` for GLM-5.3: ``qk_nope_head_dim ** -0.5``).
        query_chunk: queries per chunk; ``None`` picks one so that ``B * chunk * W * (Dl + H)`` stays under
            ``DEFAULT_SPARSE_MLA_CHUNK_ELEMENTS``.

    Returns:
        ``(out_lat, lse)``: ``out_lat`` ``[B, S, H, Dl]`` in ``q_abs.dtype``; ``lse`` ``[B, S, H]`` natural-log
        log-sum-exp of the scaled scores in the compute dtype (fp32 for fp32/bf16/fp16 inputs).

    Raises:
        ValueError: on mismatched shapes, a non-integer ``indices`` tensor or ``query_chunk < 1``.
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
    width = indices.shape[-1]
    heads = q_abs.shape[2]
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
    for start in range(0, seq_len, query_chunk):
        end = min(seq_len, start + query_chunk)
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


def sparse_mla(
    q_abs: torch.Tensor,
    latent: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    *,
    backend: str = "auto",
    query_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention core; picks the implementation named by ``backend``.

    Same contract as :func:`sparse_mla_torch` (shapes, dtypes, ``-1`` padding, natural-log LSE).

    Args:
        backend: ``"torch"`` (:func:`sparse_mla_torch`), ``"auto"`` (the fused Triton kernel
            :func:`glm53flash_hf.triton_dsa.sparse_mla_triton` when it can run on these tensors — CUDA, triton
            installed, fp32/bf16/fp16 — else torch) or ``"fused"`` (the Triton kernel; when it cannot run, a warning
            says why once and torch runs).
        query_chunk: queries per chunk of the torch path; the fused kernel needs no chunking (its memory is
            ``O(S * W)`` without it) and ignores it.

    Raises:
        ValueError: for an unknown ``backend`` (:func:`.dispatch.choose_backend`), and the errors of the chosen path.
    """
    if choose_backend("dsa", backend, q_abs, latent, indices) == "fused":
        from .triton_dsa import sparse_mla_triton

        return sparse_mla_triton(q_abs, latent, indices, scale)
    return sparse_mla_torch(q_abs, latent, indices, scale, query_chunk=query_chunk)


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

    Semantics per document (model-spec §6): pools are consecutive groups of ``kp = index_kpool`` tokens from the
    document's first token; the pool key (fp32) is ``sum_j softmax_j(gate[j] + ape[j]) * k[j]`` over its slots; the
    score of pool ``p`` for query ``t`` is ``sum_h w[t,h] * n_heads^-0.5 * relu(q[t,h] . pk[p] * head_dim^-0.5)``
    (``w = weights_proj(h)`` in fp32; the positive scales are folded into ``w``). Query ``t`` may select the
    complete pools of its document that end at or before ``t`` (the first ``(local_pos + 1) // kp`` pools); it takes
    the top ``min(index_topk // kp, #selectable)`` and expands them to token ids. With
    ``index_kpool_always_select_tail`` it also gets the ``(local_pos + 1) % kp`` tokens of its incomplete current
    pool. For one unpadded document (or a left-padded row) the id SET equals transformers' indexer output.

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
            :func:`stable_topk_indices`), then ``-1`` for unfilled pool slots, then the tail
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
        device = hidden_states.device
        kp = self.index_kpool
        n_heads, head_dim = self.n_heads, self.head_dim
        width = self.output_width

        valid = layout.valid.to(device)
        local_pos = layout.local_pos.to(device)
        positions = torch.arange(seq_len, device=device)
        out = torch.full((batch, seq_len, width), -1, dtype=torch.int32, device=device)

        # ---- pools: complete groups of kp tokens of one document, identified by their last token ----------------
        num_pools = seq_len // kp  # static upper bound on complete pools per row
        select_pools = min(self.index_topk // kp, num_pools)
        if select_pools > 0:
            is_end = valid & ((local_pos + 1) % kp == 0)  # last token of a complete pool
            ends_upto = torch.cumsum(is_end.long(), dim=1)  # [B, S] complete pools of the row ending at <= t
            # Row positions of the pool ends in order (pool id = rank among the row's ends); a sort keeps it
            # deterministic and sync-free. Absent pools (row has fewer than P) point at position 0, never selectable.
            order_key = torch.where(is_end, positions, positions + seq_len)
            pool_end = order_key.sort(dim=1).values[:, :num_pools]
            pool_end = torch.where(pool_end < seq_len, pool_end, torch.zeros_like(pool_end))  # [B, P]

            # Pool keys, once per forward (fp32): softmax over the kp slots of gate + ape, weighted sum of keys.
            keys = self.k_norm(self.wk(hidden_states))  # [B, S, Dk]
            gates = F.linear(hidden_states, self.index_kpool_compress_gate)  # [B, S, Dk]
            slots = (pool_end[:, :, None] - (kp - 1) + torch.arange(kp, device=device)).clamp_min(0)  # [B, P, kp]
            flat_slots = slots.reshape(batch, num_pools * kp, 1).expand(-1, -1, head_dim)
            slot_keys = torch.gather(keys, 1, flat_slots).view(batch, num_pools, kp, head_dim).float()
            slot_gates = torch.gather(gates, 1, flat_slots).view(batch, num_pools, kp, head_dim).float()
            probs = torch.softmax(slot_gates + self.index_kpool_compress_ape.float()[None, None], dim=2)
            pool_keys = (probs * slot_keys).sum(dim=2)  # [B, P, Dk] fp32
            pool_keys_t = pool_keys.transpose(1, 2).contiguous()  # [B, Dk, P]

            q = self.wq_b(q_resid).view(batch, seq_len, n_heads, head_dim)
            head_weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float()
            head_weights = head_weights * (n_heads**-0.5 * self.softmax_scale)  # [B, S, Hi]; relu is 1-homogeneous

            # Selectable pools of query t: ids [hi - (local_pos + 1) // kp, hi) with hi = ends_upto[t].
            hi = torch.where(valid, ends_upto, torch.zeros_like(ends_upto))
            lo = torch.where(valid, ends_upto - (local_pos + 1) // kp, torch.zeros_like(ends_upto))

            self._select_pools(out, q, head_weights, pool_keys_t, pool_end, lo, hi, select_pools)

        self._append_tail(out, positions, local_pos)
        out.masked_fill_(~valid[..., None], -1)
        return out

    def _select_pools(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        head_weights: torch.Tensor,
        pool_keys_t: torch.Tensor,
        pool_end: torch.Tensor,
        lo: torch.Tensor,
        hi: torch.Tensor,
        select_pools: int,
        offset: int = 0,
    ) -> None:
        """Score the pools and write the expanded top pools into ``out[..., :select_pools * kp]`` (in place).

        ``q`` ``[B, S, Hi, Dk]``, ``head_weights`` fp32 ``[B, S, Hi]`` (scales folded in), ``pool_keys_t`` fp32
        ``[B, Dk, P]`` (pool ``p`` of a row = the row's ``p``-th complete pool, ending at row position
        ``pool_end[b, p]``), ``lo`` / ``hi`` long ``[B, S]``: query ``t`` may select pools ``[lo, hi)``. ``offset``
        is the row position of query 0 (the cached length; 0 without a cache), so a query at row position ``r``
        sees at most ``(r + 1) // kp`` pools. Queries are scored in chunks under ``max_score_elements``.
        """
        batch, seq_len, n_heads, head_dim = q.shape
        num_pools = pool_keys_t.shape[-1]
        kp = self.index_kpool
        device = q.device
        chunk = max(1, int(self.max_score_elements) // max(1, batch * n_heads * num_pools))
        slot_offsets = torch.arange(kp, device=device) - (kp - 1)
        for start in range(0, seq_len, chunk):
            end = min(seq_len, start + chunk)
            size = end - start
            # A query at t <= end - 1 sees at most (t + 1) // kp <= end // kp pools of its row (they are disjoint).
            pools_here = min(num_pools, (offset + end) // kp)
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

    def _append_tail(self, out: torch.Tensor, positions: torch.Tensor, local_pos: torch.Tensor) -> None:
        """With ``index_kpool_always_select_tail``: write the ``(local_pos + 1) % kp`` tokens of each query's
        incomplete pool (row positions, ``-1`` for unused slots) into ``out[..., index_topk:]`` (in place)."""
        kp = self.index_kpool
        if self.index_kpool_always_select_tail and kp > 1:
            tail_count = (local_pos + 1) % kp  # [B, S]
            tail_offsets = torch.arange(kp - 1, device=out.device)
            tail_ids = (positions - tail_count + 1)[..., None] + tail_offsets  # [B, S, kp - 1]
            tail_ok = tail_offsets < tail_count[..., None]
            out[..., self.index_topk :] = tail_ids.masked_fill(~tail_ok, -1).to(torch.int32)

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
        kp, head_dim, n_heads = self.index_kpool, self.head_dim, self.n_heads
        past, total = ctx.past, ctx.past + seq_len
        first, valid, local_pos = ctx.first, ctx.valid, ctx.local_pos

        keys = self.k_norm(self.wk(hidden_states)).float()
        gates = F.linear(hidden_states, self.index_kpool_compress_gate).float()
        state = cache.update_indexer(torch.cat([keys, gates], dim=-1), self.layer_idx)  # [B, L, 2Dk]
        cap = state.shape[1]

        # ---- pools completed by this call: ids [n_before, n_after) of each row; build and store their keys -------
        n_before = (past - first).clamp_min(0) // kp  # [B]
        n_after = (total - first).clamp_min(0) // kp
        cand = -(-seq_len // kp)  # a call of S tokens completes at most ceil(S / kp) pools per row
        pool_j = n_before[:, None] + torch.arange(cand, device=device)  # [B, cand] (distinct, < total <= cap)
        new = pool_j < n_after[:, None]
        slots = (first[:, None, None] + kp * pool_j[..., None] + torch.arange(kp, device=device)).clamp(0, cap - 1)
        grouped = state.gather(1, slots.reshape(batch, cand * kp, 1).expand(-1, -1, 2 * head_dim))
        slot_keys, slot_gates = grouped.view(batch, cand, kp, 2 * head_dim).split(head_dim, dim=-1)
        probs = torch.softmax(slot_gates + self.index_kpool_compress_ape.float()[None, None], dim=2)
        pool_keys = (probs * slot_keys).sum(dim=2)  # [B, cand, Dk] fp32, same maths as forward()
        key_cols = state[..., :head_dim]
        where = pool_j.clamp(max=cap - 1)[..., None].expand(-1, -1, head_dim)
        key_cols.scatter_(1, where, torch.where(new[..., None], pool_keys, key_cols.gather(1, where)))

        out = torch.full((batch, seq_len, self.output_width), -1, dtype=torch.int32, device=device)
        num_pools = total // kp  # upper bound on complete pools of any row
        select_pools = min(self.index_topk // kp, num_pools)
        if select_pools > 0:
            pool_keys_t = key_cols[:, :num_pools].transpose(1, 2)  # [B, Dk, P] view of the cached pool keys
            pool_end = first[:, None] + kp * torch.arange(num_pools, device=device) + (kp - 1)  # [B, P]
            q = self.wq_b(q_resid).view(batch, seq_len, n_heads, head_dim)
            head_weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float()
            head_weights = head_weights * (n_heads**-0.5 * self.softmax_scale)
            hi = torch.where(valid, (local_pos + 1).clamp_min(0) // kp, torch.zeros_like(local_pos))
            self._select_pools(
                out, q, head_weights, pool_keys_t, pool_end, torch.zeros_like(hi), hi, select_pools, offset=past
            )
        self._append_tail(out, ctx.positions, local_pos)
        out.masked_fill_(~valid[..., None], -1)
        return out


# --------------------------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------------------------


class Glm53FlashAttention(nn.Module):
    """NoPE MLA attention of a GLM-5.3 DSA layer, sparse over the KPool indexer's selection.

    Parameters (names as transformers' ``Glm5NextTextAttention``): ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj`` and ``indexer`` (a
    :class:`Glm53FlashIndexer`, ``None`` for a "shared" layer).

    Maths (model-spec §5): ``q = q_b_proj(q_a_layernorm(q_a_proj(x)))`` ``[B,S,H,qk_nope]``; latent
    ``c = kv_a_layernorm(kv_a_proj_with_mqa(x))`` ``[B,S,kv_lora_rank]``; ``kv_b_proj.weight`` viewed
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
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.attention_dropout = config.attention_dropout
        if self.qk_rope_head_dim != 0:
            raise ValueError(f"qk_rope_head_dim must be 0 (NoPE DSA); got qk_rope_head_dim={self.qk_rope_head_dim}")
        if self.q_lora_rank is None:
            raise ValueError("q_lora_rank must be set for DSA attention (the indexer reads the query residual)")

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
        self.backend = requested_backend(config, "dsa")
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

    def kv_b_weight(self, like: torch.Tensor) -> torch.Tensor:
        """Effective ``kv_b_proj`` weight ``[H * (qk_nope + v_head_dim), kv_lora_rank]`` for the absorbed form.

        A plain ``nn.Linear`` gives its ``weight``. A wrapped module (e.g. a PEFT LoRA layer) is applied to the
        identity, ``W_eff = kv_b_proj(I)^T``, so its adapters take part in forward and backward exactly as if the
        module were called on the latents (``like`` gives the identity's device and dtype).
        """
        proj = self.kv_b_proj
        if type(proj) is nn.Linear:
            return proj.weight
        eye = torch.eye(self.kv_lora_rank, device=like.device, dtype=like.dtype)
        return proj(eye).transpose(0, 1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        layout: DocumentLayout,
        prev_topk_indices: torch.Tensor | None = None,
        cache=None,
        cache_context=None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sparse attention of ``hidden_states`` ``[B, S, hidden_size]``.

        Args:
            layout: document structure (``None``: every row one unpadded document).
            prev_topk_indices: int ``[B, S, W]`` ids of the previous "full" layer; required by "shared" layers,
                ignored by "full" ones.
            cache: optional transformers ``Cache`` (generation). Its layer ``layer_idx`` (``DynamicIndexedLayer`` /
                ``StaticIndexedLayer``) stores the latent ``c`` as ``keys`` ``[B, 1, L, kv_lora_rank]`` (``values``
                the empty rope part ``[B, 1, L, 0]``, as transformers) and the indexer state
                (:meth:`Glm53FlashIndexer.forward_cached`). The new queries attend over the selected cached latents
                only, in the absorbed form (``q_abs = q W_kc``; ``out = softmax(q_abs c_sel^T) c_sel``; ``W_vc^T``):
                the cache is never expanded through ``kv_b_proj``. Ids are row positions (= cache slots).
            cache_context: the forward's :class:`~.generation_cache.CacheContext`; required with ``cache``.
            kwargs: ignored (``position_ids``, ``position_embeddings``, ... of the decoder layer; NoPE).

        Returns:
            ``(attn_output [B, S, hidden_size], topk_indices)``; ``topk_indices`` is the int32 ``[B, S, W]`` selection
            when ``next_skip_topk`` (for the next, shared layer), else ``None``. Padding queries give zero attention
            (so ``o_proj``'s bias, if any).

        Raises:
            ValueError: bad shapes, or a "shared" layer called without ``prev_topk_indices``.
            NotImplementedError: attention dropout > 0 in training mode; ``cache`` that is not a transformers
                ``Cache`` (:class:`~.generation_cache.UnsupportedCacheError`, also a ``TypeError``).
        """
        if cache is not None:
            from .generation_cache import check_cache

            check_cache(cache, "Glm53FlashAttention")
            if cache_context is None:
                raise ValueError("Glm53FlashAttention: a cache needs cache_context (built by the text model)")
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
        if self.indexer is not None:
            if cache is not None:
                topk_indices = self.indexer.forward_cached(hidden_states, q_resid, cache, cache_context)
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

        out_lat, _ = sparse_mla(
            q_abs, latent, topk_indices, self.scaling, backend=self.backend, query_chunk=self.query_chunk
        )
        attn = torch.einsum("bshl,hvl->bshv", out_lat, w_vc.to(out_lat.dtype))
        attn = attn.reshape(batch, seq_len, self.num_heads * self.v_head_dim)
        attn = self.o_proj(attn)
        return attn, (topk_indices if self.next_skip_topk else None)


def init_dsa_weights(module: nn.Module, config) -> None:
    """Initialise the DSA parameters that the generic Linear/LayerNorm/RMSNorm init does not cover.

    Reproduces transformers' ``Glm5NextPreTrainedModel._init_weights`` for the indexer:
    ``index_kpool_compress_ape`` zeros, ``index_kpool_compress_gate`` ones (xtuner uses zeros for the gate;
    model-spec §6). Other modules are left alone. ``config`` is accepted for a uniform signature.
    """
    if isinstance(module, Glm53FlashIndexer):
        init.zeros_(module.index_kpool_compress_ape)
        init.ones_(module.index_kpool_compress_gate)
