"""DSA layers of GLM-5.3-Flash: NoPE MLA attention, sparse over the ids of its KPool lightning indexer.

Sources: transformers ``Glm5NextTextAttention`` / ``Glm5NextTextIndexer`` (``models/glm5_next``: maths, parameter
names); DeepSeek-V3.2, DeepSeek Sparse Attention.
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

__all__ = ["Glm53FlashAttention", "Glm53FlashIndexer", "init_dsa_weights", "sparse_mla_torch"]


def _sparse_mla_fused():
    from .dsa_fused import sparse_mla_fused  # CUDA tensors only: CPU runs never import triton

    return sparse_mla_fused


register_fused("dsa", sparse_mla_torch, _sparse_mla_fused)


def _check_hidden(hidden_states: torch.Tensor, hidden_size: int) -> None:
    if hidden_states.dim() != 3 or hidden_states.shape[-1] != hidden_size:
        raise ValueError(f"hidden_states must be [B, S, hidden_size={hidden_size}]; got {tuple(hidden_states.shape)}")


def _check_layout(layout: DocumentLayout, batch: int, seq_len: int, device: torch.device) -> DocumentLayout:
    if layout is None:
        return build_document_layout(batch, seq_len, device)
    if not isinstance(layout, DocumentLayout):
        raise ValueError(f"layout must be a DocumentLayout; got {type(layout).__name__}")
    if layout.batch_size != batch or layout.seq_len != seq_len:
        raise ValueError(f"layout describes a [{layout.batch_size}, {layout.seq_len}] batch but hidden_states is "
                         f"[{batch}, {seq_len}]")
    return layout


class Glm53FlashIndexer(nn.Module):
    """KPool lightning indexer of a DSA layer (parameters as ``Glm5NextTextIndexer``): the ids each query may read.

    Per document, pools of ``kp = index_kpool`` tokens start at its first token; query ``t`` keeps the top
    ``index_topk // kp`` complete pools of its document ending at or before ``t`` (:func:`.dsa_ops.select_top_pools`)
    and, with ``index_kpool_always_select_tail``, its incomplete current pool. ``max_score_elements``: element
    budget of the fp32 ``[B, chunk, index_n_heads, pools]`` score buffer.
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
        for name in ("index_kpool", "index_topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {name}={getattr(self, name)}")
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
        """Ids each query attends to (no gradient: the indexer is frozen): ``hidden_states`` ``[B, S, hidden_size]``,
        ``q_resid`` ``[B, S, q_lora_rank]`` (``q_a_layernorm(q_a_proj(x))``), ``layout`` a
        :class:`~.packing.DocumentLayout` (``None``: one unpadded document per row) -> int32 ``[B, S, output_width]``
        row-local ids: the selected pools (``kp`` ids each, increasing pool order, ties to the earlier pool), ``-1``
        for unfilled pool slots, then the tail; padding queries all ``-1``. Raises ``ValueError`` for shapes that do
        not match the configuration or the layout."""
        _check_hidden(hidden_states, self.hidden_size)
        batch, seq_len, _ = hidden_states.shape
        if q_resid.shape != (batch, seq_len, self.q_lora_rank):
            raise ValueError(f"q_resid must be [B={batch}, S={seq_len}, q_lora_rank={self.q_lora_rank}]; got "
                             f"{tuple(q_resid.shape)}")
        layout = _check_layout(layout, batch, seq_len, hidden_states.device)
        device = hidden_states.device
        shard = layout.shard
        if shard is not None:
            # a part of longer rows (DocumentLayout.shard): keys from the whole rows (their positions), queries local
            glob, offset = shard.global_layout, shard.offset
            state = shard.gather_sequence(self._token_state(hidden_states), grad=False)  # every part, collectively
            valid_kv, local_pos_kv = glob.valid.to(device), glob.local_pos.to(device)
        else:
            state, offset = None, 0  # computed below only when a pool can be selected
            valid_kv, local_pos_kv = layout.valid.to(device), layout.local_pos.to(device)
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
            # pool ends in row order (pool id = rank among the row's ends); absent pools point at 0, never selectable
            order_key = torch.where(is_end, positions_kv, positions_kv + kv_len)
            pool_end = order_key.sort(dim=1).values[:, :num_pools]
            pool_end = torch.where(pool_end < kv_len, pool_end, torch.zeros_like(pool_end))  # [B, P]

            # Pool keys, once per forward (fp32).
            slots = (pool_end[:, :, None] - (kp - 1) + torch.arange(kp, device=device)).clamp_min(0)  # [B, P, kp]
            state = self._token_state(hidden_states) if state is None else state
            pool_keys = kpool_pool_keys(state, slots, self.index_kpool_compress_ape)

            # Selectable pools of query t: ids [hi - (local_pos + 1) // kp, hi) with hi = ends_upto[t].
            ends_q = ends_upto[:, queries]
            hi = torch.where(valid, ends_q, torch.zeros_like(ends_q))
            lo = torch.where(valid, ends_q - (local_pos + 1) // kp, torch.zeros_like(ends_q))
            pool_keys_t = pool_keys.transpose(1, 2).contiguous()  # [B, Dk, P]
            out[..., : select_pools * kp] = self._select(hidden_states, q_resid, pool_keys_t, pool_end, lo, hi,
                                                         select_pools, offset=offset)
        return self._finish(out, positions, local_pos, valid)

    def _token_state(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """fp32 ``[B, S, 2 * Dk]`` per-token ``[k | gate]``: ``k = k_norm(wk(x))``, ``gate = x @ compress_gate^T``."""
        keys = self.k_norm(self.wk(hidden_states))
        gates = F.linear(hidden_states, self.index_kpool_compress_gate)
        return torch.cat([keys.float(), gates.float()], dim=-1)

    def _select(self, hidden_states, q_resid, pool_keys_t, pool_end, lo, hi, select_pools: int, offset: int):
        """Indexer queries and head weights (scales folded in), then :func:`.dsa_ops.select_top_pools`."""
        batch, seq_len, _ = hidden_states.shape
        q = self.wq_b(q_resid).view(batch, seq_len, self.n_heads, self.head_dim)
        head_weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float()
        head_weights = head_weights * (self.n_heads**-0.5 * self.softmax_scale)  # [B, S, Hi]
        return select_top_pools(q, head_weights, pool_keys_t, pool_end, lo, hi, select_pools, self.index_kpool,
                                offset=offset, max_score_elements=self.max_score_elements)

    def _finish(self, out: torch.Tensor, positions, local_pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Tail ids into ``out[..., index_topk:]``, ``-1`` for padding queries (in place)."""
        if self.index_kpool_always_select_tail and self.index_kpool > 1:
            out[..., self.index_topk :] = tail_token_ids(positions, local_pos, self.index_kpool)
        return out.masked_fill_(~valid[..., None], -1)

    @torch.no_grad()
    def forward_cached(self, hidden_states: torch.Tensor, q_resid: torch.Tensor, cache, ctx) -> torch.Tensor:
        """:meth:`forward` for ``S`` new queries of cached rows (``ctx``: the forward's
        :class:`~.generation_cache.CacheContext`), equal to it on the whole row; updates the layer's fp32 indexer
        state ``[B, L, 2 * Dk]`` in ``cache``. Ids are row positions (= cache slots)."""
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
            layer.record_pool_keys(where[..., 0], old_keys, slots[..., -1], new)

        out = torch.full((batch, seq_len, self.output_width), -1, dtype=torch.int32, device=device)
        # upper bound on any row's complete pools (compiled: the static cache capacity); extra pools fail `hi`
        num_pools = (cap if torch.compiler.is_compiling() else total) // kp
        select_pools = min(self.index_topk // kp, num_pools)
        if select_pools > 0:
            pool_keys_t = key_cols[:, :num_pools].transpose(1, 2)  # [B, Dk, P] view of the cached pool keys
            pool_end = first[:, None] + kp * torch.arange(num_pools, device=device) + (kp - 1)  # [B, P]
            hi = torch.where(valid, (local_pos + 1).clamp_min(0) // kp, torch.zeros_like(local_pos))
            out[..., : select_pools * kp] = self._select(hidden_states, q_resid, pool_keys_t, pool_end,
                                                         torch.zeros_like(hi), hi, select_pools, offset=past)
        return self._finish(out, ctx.positions, local_pos, valid)


class Glm53FlashAttention(nn.Module):
    """NoPE MLA attention of a DSA layer in the absorbed form, sparse over the indexer's ids.

    Parameters as ``Glm5NextTextAttention``; ``kv_b_proj.weight`` viewed ``[H, qk_nope + v_head_dim, kv_lora_rank]``
    is ``[W_kc; W_vc]``: ``o = o_proj(sparse_mla(q W_kc, c, ids) W_vc^T)``, latent ``c`` from ``kv_a_proj_with_mqa``.
    ``indexer_type``: ``"full"``, ``"shared"`` (no ``indexer``: the previous layer's ids) or ``None``
    (``config.indexer_types``; ``"full"`` for MTP layers, ``layer_idx >= num_hidden_layers``). ``next_skip_topk``:
    the next main layer is "shared", so ``forward`` returns this layer's ids. ``query_chunk``: queries per chunk of
    the torch core (``None``: automatic). Raises ``ValueError`` for ``qk_rope_head_dim != 0``, an unknown
    ``indexer_type`` or an unset ``q_lora_rank``.
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
        self.next_skip_topk = (not self.skip_topk and layer_idx + 1 < num_layers
                               and config.indexer_types[layer_idx + 1] == "shared")
        self.scaling = self.qk_head_dim**-0.5
        self.query_chunk: int | None = None

        bias = config.attention_bias
        self.q_a_proj = nn.Linear(self.hidden_size, self.q_lora_rank, bias=bias)
        self.q_a_layernorm = Glm53FlashRMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)
        self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(self.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = Glm53FlashRMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, self.hidden_size, bias=bias)
        self.indexer = None if self.skip_topk else Glm53FlashIndexer(config, layer_idx)

    @property
    def backend(self) -> str:
        """The sparse-MLA implementation requested for this call (``config.kernels["dsa"]``)."""
        return requested_backend(self.config, "dsa")

    def kv_b_weight(self, like: torch.Tensor) -> torch.Tensor:
        """Effective ``kv_b_proj`` weight ``[H * (qk_nope + v_head_dim), kv_lora_rank]``: ``weight`` of a plain
        ``nn.Linear``, else ``kv_b_proj(I)^T`` (PEFT adapters, offload hooks; ``I`` on ``like``'s device and dtype)."""
        proj = self.kv_b_proj
        if type(proj) is nn.Linear and not is_offload_hooked(proj):
            return proj.weight
        eye = torch.eye(self.kv_lora_rank, device=like.device, dtype=like.dtype)
        return proj(eye).transpose(0, 1)

    def forward(self, hidden_states: torch.Tensor, layout: DocumentLayout,
                prev_topk_indices: torch.Tensor | None = None, cache=None, output_attentions: bool = False, **kwargs
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Sparse attention of ``hidden_states`` ``[B, S, hidden_size]``.

        Args:
            layout: the :class:`~.packing.DocumentLayout` (``None``: one unpadded document per row); with ``cache``,
                the one :func:`.packing.build_layout` made for it (``layout.cache_context`` set).
            prev_topk_indices: int ``[B, S, W]`` ids of the previous "full" layer; required by "shared" layers.
            cache: a transformers ``Cache`` (latents as ``keys`` ``[B, 1, L, kv_lora_rank]``, the indexer state).
            output_attentions: also return the weights ``[B, H, S, S_kv]`` (zero off the selected ids), from which
                the output is then computed (dense cost).

        Returns:
            ``(out [B, S, hidden_size], ids, weights)``: ``ids`` the int32 ``[B, S, W]`` selection when
            ``next_skip_topk`` else ``None``; ``weights`` with ``output_attentions``, else ``None``.

        Raises:
            ValueError: bad shapes; a "shared" layer without ``prev_topk_indices``; a cache with a layout without
                ``cache_context``.
            NotImplementedError: attention dropout in training; a ``cache`` that is not a transformers ``Cache``.
        """
        if cache is not None:
            from .generation_cache import check_cache

            check_cache(cache, "Glm53FlashAttention")
            cache_context = getattr(layout, "cache_context", None)
            if cache_context is None:
                raise ValueError("Glm53FlashAttention: a cache needs a layout with cache_context (packing.build_layout("
                                 f"..., cache=cache)); got layout={type(layout).__name__}")
        if self.training and self.attention_dropout > 0:
            raise NotImplementedError(f"attention_dropout={self.attention_dropout} is not supported by sparse DSA "
                                      "attention; set it to 0")
        _check_hidden(hidden_states, self.hidden_size)
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
        shard = layout.shard if cache is None else None
        if shard is not None:
            # a part of longer rows (DocumentLayout.shard): attend over the whole rows' latents, whose gather's
            # backward sums the latent gradients back onto their owners
            latent = shard.gather_sequence(latent)
        if self.indexer is not None:
            if cache is not None:
                topk_indices = call_onloaded((self.indexer,), lambda: self.indexer.forward_cached(
                    hidden_states, q_resid, cache, cache_context))
            elif layout.selections is None or torch.compiler.is_compiling():
                topk_indices = self.indexer(hidden_states, q_resid, layout)
            else:  # activation checkpointing: the recompute of this layer reuses the forward's ids (exact)
                topk_indices = layout.selections.get(self.layer_idx)
                if topk_indices is None:
                    topk_indices = layout.selections[self.layer_idx] = self.indexer(hidden_states, q_resid, layout)
        else:
            if prev_topk_indices is None:
                raise ValueError(f"layer {self.layer_idx} has a 'shared' indexer and needs prev_topk_indices from the "
                                 "previous 'full' DSA layer; got None")
            if prev_topk_indices.dim() != 3 or prev_topk_indices.shape[:2] != (batch, seq_len):
                raise ValueError(f"prev_topk_indices must be [B={batch}, S={seq_len}, W]; got "
                                 f"{tuple(prev_topk_indices.shape)}")
            topk_indices = prev_topk_indices

        weights = None
        if output_attentions:
            out_lat, weights = sparse_mla_with_weights(q_abs, latent, topk_indices, self.scaling)
        else:
            sparse_mla = op_for(sparse_mla_torch, self.backend, q_abs, latent, topk_indices)
            out_lat, _ = sparse_mla(q_abs, latent, topk_indices, self.scaling, query_chunk=self.query_chunk)
        attn = torch.einsum("bshl,hvl->bshv", out_lat, w_vc.to(out_lat.dtype))
        attn = self.o_proj(attn.reshape(batch, seq_len, self.num_heads * self.v_head_dim))
        return attn, (topk_indices if self.next_skip_topk else None), weights


def init_dsa_weights(module: nn.Module, config) -> None:
    """Indexer init as ``Glm5NextPreTrainedModel._init_weights``: ``compress_ape`` zeros, ``compress_gate`` ones."""
    if isinstance(module, Glm53FlashIndexer):
        init.zeros_(module.index_kpool_compress_ape)
        init.ones_(module.index_kpool_compress_gate)
