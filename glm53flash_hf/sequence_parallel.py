"""Sequence parallelism (SP): each rank of a process group holds one contiguous shard of every token row.

Rank ``r`` of an SP group of ``W`` ranks holds tokens ``[r * L, (r + 1) * L)`` of each global row of length
``S = W * L`` (ranks in order, no round-robin / head-tail split: the KDA recurrence runs left to right). Packed
documents may have any boundaries: a document may start inside a shard, exactly at a shard boundary, span several
shards, or be one token long. Every rank computes the logits and the loss of its own tokens; the sum of the ranks'
losses (each divided by the *global* number of supervised tokens) and the sum of their gradients equal the
single-device ones.

What crosses the shard boundaries (everything else, mHC and MoE, is per token and runs unchanged):

* **Document layout** (:func:`build_sp_layout`): the per-token layout tensors (``position_ids``, ``attention_mask``,
  ``seq_idx``) are all-gathered (``cu_seq_lens_q`` / ``cu_seqlens`` must already describe the global rows), so every
  rank knows the global :class:`~.packing.DocumentLayout`; its local layout cuts a segment at the shard start and the
  context records, per row, whether that first segment continues a document of the previous rank.
* **KDA short convolution** (:meth:`SequenceParallelContext.kda_conv_initial_state`): the last ``W_conv - 1``
  pre-convolution inputs (the ``q|k|v`` projections) of the previous rank, zeroed where they belong to another
  document, are the ``initial_state`` of the first local segment.
* **KDA recurrence** (:meth:`SequenceParallelContext.kda_core`): the delta rule is affine in its state,
  ``S_end = A_r S_start + B_r``; each rank computes ``(A_r, B_r)`` of its shard, they are all-gathered, every rank
  folds the prefix over the previous ranks to get its incoming state, and re-runs its first segment from it
  (the scheme of fla's ``fla.ops.cp``; maths: Kimi Linear, arXiv:2510.26692 §3; sources: ``docs/design.md``,
  section "Sequence parallelism"). On the fused path, when the global batch is one row and fla's CP kernels accept
  the device (CUDA, compute capability >= 8.0), the shard runs in fla's own context-parallel ``chunk_kda`` instead
  (:meth:`SequenceParallelContext.fla_cp_refusal`).
* **DSA** (:meth:`SequenceParallelContext.gather_sequence`): the MLA latent and the indexer's per-token state are
  all-gathered; the local queries (at row offset ``r * L``) select and attend over the global keys, causal within
  documents. See :meth:`SequenceParallelContext.gather_sequence` for memory and bytes moved.
* **MTP** (:meth:`SequenceParallelContext.doc_roll`) and the **loss** (:meth:`SequenceParallelContext.shift_labels`):
  the first token(s) / label(s) of the next rank are exchanged.

The collectives are autograd-aware (:class:`_AllGather`, whose backward sums the gradients of every rank's copy
back onto its owner, a reduce-scatter), so the backward's reverse pass (reverse state passing, the
reduce-scatter of the latent gradient) comes from autograd. Every rank must take part in every collective of the
forward and of the backward: outputs a rank does not read are tied into its graph with a zero-weighted term
(:func:`_anchor`), so each rank's backward reaches every gathered node.

Enable with ``model.set_sequence_parallel(group)`` (see ``Glm53FlashPreTrainedModel.set_sequence_parallel``); the
text model's uncached forward then builds the layout with :func:`build_sp_layout` and the layers read the context
from ``layout.sequence_parallel``. With no group set (the default) nothing here runs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .packing import DocumentLayout, layout_from_kwargs

__all__ = [
    "SequenceParallelContext",
    "build_sp_layout",
    "shard_sequence",
    "kda_boundary_transition",
    "sp_loss_kwargs",
]


class _AllGather(torch.autograd.Function):
    """All-gather with the summed-gradient backward (a reduce-scatter).

    ``torch.distributed.nn.functional.all_gather`` does the same but, off NCCL, its backward emulates the
    reduce-scatter with ``scatter`` calls that pass group ranks where global ranks are expected (torch 2.13), which
    fails on any sub-group (an ``sp`` dimension of a device mesh). Here: ``reduce_scatter_tensor`` on NCCL/XCCL; on
    other backends (gloo) an ``all_reduce`` of the stacked gradients, of which each rank keeps its own slice (same
    sums, ``W`` times the bytes of a reduce-scatter; gloo is the CPU test path)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, tensor, group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        group = ctx.group
        rank = dist.get_rank(group)
        stacked = torch.stack([g.contiguous() for g in grads])
        if dist.get_backend(group) in (dist.Backend.NCCL, getattr(dist.Backend, "XCCL", "xccl")):
            mine = torch.empty_like(stacked[rank])
            dist.reduce_scatter_tensor(mine, stacked, group=group)
            return mine, None
        dist.all_reduce(stacked, group=group)
        return stacked[rank].clone(), None


def _gather_autograd(tensor: torch.Tensor, group) -> tuple[torch.Tensor, ...]:
    """All-gather with autograd (backward: each rank gets the sum of every rank's gradient of its copy)."""
    return _AllGather.apply(tensor, group)


def _gather_plain(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    tensor = tensor.contiguous()
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor, group=group)
    return out


def _anchor(value: torch.Tensor, gathered) -> torch.Tensor:
    """``value + 0 * sum(gathered)``: keeps every gathered tensor in this rank's graph (same numbers), so the
    gather's backward collective runs on every rank even where this rank reads none of the outputs."""
    tie = sum(t.sum() for t in gathered if t.requires_grad)
    if isinstance(tie, torch.Tensor):
        return value + 0.0 * tie.to(value.dtype)
    return value


@dataclass
class SequenceParallelContext:
    """Where this rank's shard sits in the global rows, and the collectives the layers use.

    Attributes:
        group: the SP process group (e.g. ``mesh["sp"].get_group()``).
        rank, world: this rank's index in ``group`` and the group size ``W``.
        local_len: ``L``, tokens per row on every rank; ``global_len`` ``S = W * L``; ``offset`` ``r * L``.
        global_layout: the :class:`~.packing.DocumentLayout` of the global ``[B, S]`` rows (same on every rank).
        continues: bool ``[B]``: the shard's first token continues a document of the previous rank (False on rank 0).
        single: bool ``[B]``: the row's shard is one segment (its first segment reaches the shard's end).
        first_seg, last_seg: long ``[B]``: index (in the local layout's ``cu_seqlens``) of each row's first / last
            local segment.
        first_tokens: long ``[T1]``: flattened local positions (over ``B * L``) of the tokens of the rows' first
            segments, row by row; ``first_cu``: long ``[B + 1]`` their boundaries.
        rest_tokens, rest_cu: the same for all the other local segments (``[T - T1]``, ``[N - B + 1]``);
            last_rest: long ``[B]``, index of each row's last segment among them (``-1`` for a single-segment row).
    """

    group: object
    rank: int
    world: int
    local_len: int
    global_len: int
    offset: int
    global_layout: DocumentLayout
    continues: torch.Tensor
    single: torch.Tensor
    first_seg: torch.Tensor
    last_seg: torch.Tensor
    first_tokens: torch.Tensor
    first_cu: torch.Tensor
    rest_tokens: torch.Tensor
    rest_cu: torch.Tensor
    last_rest: torch.Tensor
    _fla_cp: object = field(default=None, repr=False, compare=False)  # fla's FLACPContext, built on first use

    # ------------------------------------------------------------------------------------------------ generic
    def gather_sequence(self, x: torch.Tensor, grad: bool = True) -> torch.Tensor:
        """All-gather ``x`` ``[B, L, ...]`` along the sequence: ``[B, S, ...]`` (rank order = row order).

        Used by DSA for the MLA latent ``c = kv_a_layernorm(kv_a_proj_with_mqa(x))`` (``grad=True``: the backward
        sums every rank's latent gradient back onto its owner, a reduce-scatter) and the indexer's fp32 per-token
        state ``[k | gate]`` (``grad=False``; the indexer is frozen).

        Memory per rank and DSA layer: the gathered latent and indexer state, ``S * (kv_lora_rank + 2 *
        index_head_dim)`` floats per row (release config, bf16 latent 512 + fp32 state 2 * 128: 2 KiB per global
        token, 256 MiB at 128k), plus the local activations of ``L`` tokens (queries, selected ids ``[L, W_sel]``,
        the query-chunked gathered latents of the attention core) and the pool keys ``S / kpool * index_head_dim``.
        Why all-gather and not a ring: each rank needs the whole key set (any query may select any earlier pool of
        its document); an all-gather moves ``(W - 1) / W`` of the global latent into each rank in one collective; a
        ring moves the same bytes in ``W - 1`` dependent steps and only saves memory if the attention over each
        received block is computed and discarded, which the top-k selection over the global pools (it must see
        every pool first) does not allow.
        """
        parts = _gather_autograd(x, self.group) if grad and x.requires_grad else _gather_plain(x, self.group)
        return torch.cat(list(parts), dim=1)

    def _next_rank_head(self, x: torch.Tensor, count: int, fill) -> torch.Tensor:
        """The first ``count`` positions ``[B, count, ...]`` of the next rank's shard (``fill`` on the last rank)."""
        if count > self.local_len:
            raise ValueError(f"shift={count} exceeds the per-rank shard length local_len={self.local_len}")
        head = x[:, :count]
        if x.requires_grad:
            parts = _gather_autograd(head, self.group)
        else:
            parts = _gather_plain(head, self.group)
        if self.rank + 1 < self.world:
            nxt = parts[self.rank + 1]
        else:
            nxt = torch.full_like(head, fill)
        return _anchor(nxt, parts) if x.requires_grad else nxt

    def doc_roll(self, x: torch.Tensor, shift: int, fill=0) -> torch.Tensor:
        """:func:`.mtp.doc_roll` across the shard boundaries: ``out[b, t] = x_global[b, offset + t + shift]`` when
        that position is in the same global segment as ``offset + t``, else ``fill``.

        Args:
            x: ``[B, L, ...]`` local ids, labels or embeddings (embeddings keep their gradient).
            shift: ``0 <= shift <= L``.

        Raises:
            ValueError: ``shift`` negative or larger than ``L``, or ``x`` not ``[B, L, ...]``.
        """
        if shift < 0:
            raise ValueError(f"doc_roll shift must be >= 0; got {shift}")
        glob = self.global_layout
        if tuple(x.shape[:2]) != (glob.batch_size, self.local_len):
            raise ValueError(f"doc_roll expects x of shape [{glob.batch_size}, {self.local_len}, ...]; got "
                             f"{tuple(x.shape)}")
        if shift == 0:
            return x
        ext = torch.cat([x, self._next_rank_head(x, shift, fill)], dim=1)
        rolled = ext[:, shift : shift + self.local_len]
        pos = torch.arange(self.local_len, device=x.device) + self.offset
        target = pos + shift
        keep = (target < self.global_len)[None] & (
            glob.seq_idx[:, target.clamp_max(self.global_len - 1)] == glob.seq_idx[:, pos]
        )
        keep = keep.view(keep.shape + (1,) * (x.dim() - 2))
        return torch.where(keep, rolled, torch.as_tensor(fill, dtype=x.dtype, device=x.device))

    def shift_labels(self, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """The causal-LM shift done on the global rows (transformers' ``shift_labels``): ``out[b, t] =
        labels_global[b, offset + t + 1]``, ``ignore_index`` at the global row end. ``labels``: long ``[B, L]``."""
        nxt = self._next_rank_head(labels, 1, ignore_index)
        return torch.cat([labels[:, 1:], nxt], dim=1)

    # ------------------------------------------------------------------------------------------------ KDA
    def kda_conv_initial_state(self, mixed: torch.Tensor, kernel: int, num_segments: int) -> torch.Tensor:
        """Conv ``initial_state`` ``[N, D, kernel]`` of the local segments: zeros, except the first segment of each
        row, whose last ``kernel - 1`` columns are the previous rank's last ``kernel - 1`` conv inputs where they
        belong to the document continuing into this shard (zeros for other documents, and when the shard's first
        token starts a document).

        Args:
            mixed: ``[B, L, D]`` pre-convolution inputs (``q_proj | k_proj | v_proj``), any float dtype.
            kernel: the conv width ``W_conv``; num_segments: ``N``, segments of the local layout.

        Raises:
            ValueError: ``L < kernel - 1`` (the history would span two ranks).
        """
        B, L, D = mixed.shape
        hist = kernel - 1
        if L < hist:
            raise ValueError(f"sequence parallelism needs local_len >= linear_conv_kernel_dim - 1 = {hist}; got {L}")
        parts = _gather_autograd(mixed[:, L - hist :], self.group) if mixed.requires_grad else _gather_plain(
            mixed[:, L - hist :], self.group
        )
        prev = parts[self.rank - 1] if self.rank > 0 else torch.zeros_like(parts[0])  # [B, hist, D]
        pos = self.offset - hist + torch.arange(hist, device=mixed.device)  # global positions of the history
        doc_first = self.global_layout.doc_start[:, self.offset]  # [B] first token of the continuing document
        keep = self.continues[:, None] & (pos[None] >= doc_first[:, None])  # [B, hist]
        prev = torch.where(keep[..., None], prev, torch.zeros_like(prev))
        if mixed.requires_grad:
            prev = _anchor(prev, parts)
        first = torch.cat([prev.new_zeros(B, D, 1), prev.transpose(1, 2)], dim=-1)  # [B, D, kernel]
        return mixed.new_zeros(num_segments, D, kernel).index_copy(0, self.first_seg, first)

    def kda_core(self, core, q, k, v, g, beta, *, cu_seqlens: torch.Tensor, cp_core=None) -> torch.Tensor:
        """The chunked KDA of the local shard with the recurrent state passed between ranks.

        With ``cp_core`` (the fused path's :func:`~.kda_fused.chunk_kda_context_parallel`) and when fla's
        context-parallel kernels apply (:meth:`fla_cp_refusal` is None: one row per rank, a device fla's CP accepts),
        the shard runs in fla's ``chunk_kda`` with ``cp_context`` (:meth:`fla_cp_context`), the same scheme in fla's
        kernels. Otherwise (a warning names the reason once when ``cp_core`` was given) the scheme below runs with
        ``core``:

        Per row: ``B_r`` = the final state of the shard's last segment from a zero state, ``A_r``
        (:func:`kda_boundary_transition`) = the transition of the first segment, kept only when that segment is
        the whole shard and continues a document (else 0: the state restarts inside the shard). After an
        all-gather of ``(A, B)`` every rank folds ``S_in(0) = 0``, ``S_in(r) = A_{r-1} S_in(r-1) + B_{r-1}`` and
        runs its first segments from ``S_in`` (zero where the shard starts a document); the other segments run
        from a zero state, as without sequence parallelism.

        Cost: the shard's tokens go through the chunk op once for the outputs; the first segments go through it
        twice more (``A`` with ``v = 0`` and ``V = K``; ``B`` when the first segment is the row's last), both inside
        ``torch.utils.checkpoint`` (their activations are recomputed in the backward, not kept), so the memory held
        for the backward is that of one pass.

        Args:
            core: the chunk op (``chunk_kda_torch`` or the fused one: same contract).
            q, k, g: ``[1, B*L, H, K]``; v: ``[1, B*L, H, V]``; beta: ``[1, B*L, H]`` (the flattened local rows).
            cu_seqlens: the local layout's segment boundaries.
            cp_core: optional ``cp_core(q, k, v, g, beta, *, cp_context) -> o`` (see above).

        Returns:
            ``o`` ``[1, B*L, H, V]``.
        """
        from torch.utils.checkpoint import checkpoint

        if cp_core is not None:
            refusal = self.fla_cp_refusal(q.device)
            if refusal is None:
                return cp_core(q, k, v, g, beta, cp_context=self.fla_cp_context(cu_seqlens))
            if refusal not in _CP_WARNED:
                _CP_WARNED.add(refusal)
                warnings.warn(
                    f"sequence parallelism: fla's context-parallel KDA is not used ({refusal}); the shards pass the "
                    "KDA state with this package's scheme (same result, fla's chunk kernels)",
                    stacklevel=3,
                )

        ft, first_cu = self.first_tokens, self.first_cu
        q1, k1, v1, g1, beta1 = (t.index_select(1, ft) for t in (q, k, v, g, beta))

        def boundary(q1, k1, v1, g1, beta1):
            a = kda_boundary_transition(core, k1, g1, beta1, cu_seqlens=first_cu, like_q=q1)
            _, b = core(q1, k1, v1, g1, beta1, cu_seqlens=first_cu, output_final_state=True)
            return a, b

        if torch.is_grad_enabled() and any(t.requires_grad for t in (q1, k1, v1, g1, beta1)):
            a_local, b_first = checkpoint(boundary, q1, k1, v1, g1, beta1, use_reentrant=False)
        else:
            a_local, b_first = boundary(q1, k1, v1, g1, beta1)
        a_local = a_local * (self.single & self.continues).to(a_local.dtype)[:, None, None, None]
        o_rest = None
        b_local = b_first
        if self.rest_tokens.numel():
            rest = [t.index_select(1, self.rest_tokens) for t in (q, k, v, g, beta)]
            o_rest, finals = core(*rest, cu_seqlens=self.rest_cu, output_final_state=True)
            b_rest = finals.index_select(0, self.last_rest.clamp_min(0))
            b_local = torch.where(self.single[:, None, None, None], b_first, b_rest)
        grads = a_local.requires_grad or b_local.requires_grad
        gather = _gather_autograd if grads else _gather_plain
        a_all, b_all = gather(a_local, self.group), gather(b_local, self.group)
        state = torch.zeros_like(b_local)
        for r in range(self.rank):
            state = torch.matmul(a_all[r], state) + b_all[r]  # [B, H, K, K] @ [B, H, K, V]
        state = torch.where(self.continues[:, None, None, None], state, torch.zeros_like(state))
        if grads:
            state = _anchor(state, tuple(a_all) + tuple(b_all))
        o1, _ = core(q1, k1, v1, g1, beta1, initial_state=state, cu_seqlens=first_cu)
        o = o1.new_zeros(v.shape).index_copy(1, ft, o1)
        if o_rest is not None:
            o = o.index_copy(1, self.rest_tokens, o_rest.to(o.dtype))
        return o

    def global_count(self, count: torch.Tensor) -> torch.Tensor:
        """The group's sum of an integer count (e.g. supervised targets on this shard): an all-reduce of a copy."""
        total = count.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total

    def fla_cp_refusal(self, device) -> str | None:
        """Why fla's context-parallel KDA cannot run this shard (``None`` when it can): fla chains the documents of
        one flattened token row, so the global batch must be one row; and fla's CP kernels must accept ``device``
        (:func:`~.kda_fused.fla_cp_available`: NVIDIA compute capability >= 8.0, or Ascend)."""
        if self.global_layout.batch_size != 1:
            return (f"it chains one token row and this batch has {self.global_layout.batch_size} rows; pack the "
                    "documents into one row per step to use it")
        from .kda_fused import fla_cp_available

        ok, reason = fla_cp_available(device)
        return None if ok else reason

    def fla_cp_context(self, cu_seqlens: torch.Tensor):
        """fla's ``FLACPContext`` of this rank (built once per forward, shared by the KDA layers): fla's
        ``build_cp_context`` from the global row's boundaries and the SP group.

        Raises:
            RuntimeError: fla's local boundaries differ from ``cu_seqlens`` (this rank's layout), i.e. fla and this
                package would split the row differently.
        """
        if self._fla_cp is None:
            from .fla_compat import load_cp

            glob = self.global_layout.cu_seqlens
            ctx = load_cp().build_cp_context(cu_seqlens=glob, group=self.group, cu_seqlens_cpu=glob.cpu())
            mine = cu_seqlens.tolist()
            if ctx.cu_seqlens_cpu.tolist() != mine:
                raise RuntimeError(
                    f"fla's context-parallel split of the row differs from this rank's layout: fla "
                    f"{ctx.cu_seqlens_cpu.tolist()}, layout {mine} (rank {self.rank} of {self.world})"
                )
            self._fla_cp = ctx
        return self._fla_cp


_CP_WARNED: set[str] = set()


def kda_boundary_transition(core, k, g, beta, *, cu_seqlens: torch.Tensor | None = None, like_q=None) -> torch.Tensor:
    """The state transition ``A`` of each segment: ``S_end = A S_start + B`` for the KDA delta rule.

    Per token ``S <- (I - beta k k^T) diag(exp(g)) S + beta k v^T`` is affine in ``S``; its linear part does not
    depend on ``v``, so running the same chunk op with ``v = 0`` (width ``K``) from ``S_start = I`` gives ``A``
    itself (one implementation of the maths: the op's own normalisation of ``k`` and chunking apply).

    Args:
        core: the chunk op (``chunk_kda_torch`` contract, with ``use_qk_l2norm_in_kernel`` default True).
        k, g: ``[1, T, H, K]``; beta: ``[1, T, H]``; cu_seqlens: ``[N + 1]`` segment boundaries (``None``: one).
        like_q: the queries ``[1, T, H, K]`` (their values do not affect ``A``; defaults to ``k``).

    Returns:
        fp32 ``[N, H, K, K]``.
    """
    T, H, K = k.shape[1], k.shape[2], k.shape[3]
    n = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    eye = torch.eye(K, device=k.device, dtype=torch.float32).expand(n, H, K, K)
    q = like_q if like_q is not None else k
    zeros = k.new_zeros(k.shape[0], T, H, K)
    kwargs = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    _, a = core(q, k, zeros, g, beta, initial_state=eye, output_final_state=True, **kwargs)
    return a


def sp_loss_kwargs(sp: SequenceParallelContext, labels: torch.Tensor, loss_kwargs: dict) -> dict:
    """Loss kwargs of a sequence-parallel shard: ``shift_labels`` (when not given) from the global causal shift
    (:meth:`SequenceParallelContext.shift_labels`), and ``num_items_in_batch`` (when not given) the group's total of
    supervised shifted labels (an all-reduce; at least 1), so the ranks' main losses sum to the single-device loss
    (0.0 when every label is ignored). (The MTP
    loss without a given count is normalised per depth by that depth's group total: :func:`.mtp.mtp_loss`'s
    ``count_total``.)

    Args:
        labels: long ``[B, L]`` this rank's slice of the global labels; loss_kwargs: ``num_items_in_batch``,
            ``ignore_index``, ``shift_labels`` as the head received them.
    """
    ignore = loss_kwargs.get("ignore_index", -100)
    out = dict(loss_kwargs)
    if out.get("shift_labels") is None:
        out["shift_labels"] = sp.shift_labels(labels, ignore)
    if out.get("num_items_in_batch") is None:
        # at least 1: labels all ignore_index give loss 0.0 (the single-device convention), not 0 / 0
        out["num_items_in_batch"] = sp.global_count((out["shift_labels"] != ignore).sum()).clamp_min(1)
    return out


def _segments_from_starts(starts: torch.Tensor, valid: torch.Tensor) -> DocumentLayout:
    batch, seq_len = starts.shape
    arange = torch.arange(seq_len, device=starts.device)
    seg_idx = (torch.cumsum(starts.reshape(-1).long(), 0) - 1).view(batch, seq_len)
    doc_start = torch.cummax(torch.where(starts, arange.expand(batch, -1), torch.zeros_like(arange)), dim=1).values
    layout = DocumentLayout(
        batch_size=batch, seq_len=seq_len, valid=valid, starts=starts, doc_start=doc_start,
        local_pos=arange.unsqueeze(0) - doc_start, seq_idx=seg_idx, trivial=False,
    )
    layout.segment_tensors()
    return layout


def build_sp_layout(
    group,
    batch_size: int,
    local_len: int,
    device,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> DocumentLayout:
    """The local :class:`~.packing.DocumentLayout` of this rank's shard, carrying its
    :class:`SequenceParallelContext` as ``layout.sequence_parallel``.

    Args:
        group: the SP process group; batch_size, local_len: ``B`` and ``L`` of this rank's inputs.
        attention_mask, position_ids, ``seq_idx`` (kwarg): this rank's ``[B, L]`` slices; all-gathered.
        ``cu_seq_lens_q`` / ``cu_seqlens`` (kwargs): boundaries of the *global* rows (``[N + 1]``, ending at
            ``B * S``), as :func:`shard_sequence` leaves them.

    Returns:
        The local layout: segments of the global layout cut at the shard start (never trivial; segment tensors
        built).

    Raises:
        ValueError: the ranks' shard lengths differ (names them), or the layout arguments are bad
            (:func:`.packing.build_document_layout`).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    lengths = _gather_plain(torch.tensor([batch_size, local_len], device=device), group)
    lengths = [tuple(int(v) for v in t.tolist()) for t in lengths]
    if len(set(lengths)) != 1:
        raise ValueError(
            "sequence parallelism needs the same [batch, local_len] on every rank of the group (shard rows into equal"
            f" contiguous parts, e.g. with shard_sequence); got per-rank shapes {lengths}"
        )
    global_len = world * local_len

    def gather(t):
        if t is None:
            return None
        t = t.to(device)
        if t.dim() == 1:
            t = t.unsqueeze(0)
        if t.dim() != 2 or t.shape[-1] != local_len or t.shape[0] not in (1, batch_size):
            raise ValueError(f"per-token layout tensors must be [{batch_size}, {local_len}]; got {tuple(t.shape)}")
        return torch.cat(_gather_plain(t.expand(batch_size, local_len), group), dim=1)

    extra = {k: kwargs[k] for k in ("cu_seq_lens_q", "cu_seqlens") if kwargs.get(k) is not None}
    if kwargs.get("seq_idx") is not None:
        extra["seq_idx"] = gather(kwargs["seq_idx"])
    glob = layout_from_kwargs(
        batch_size, global_len, device, attention_mask=gather(attention_mask), position_ids=gather(position_ids),
        **extra,
    )
    glob.segment_tensors()
    offset = rank * local_len
    sl = slice(offset, offset + local_len)
    starts = glob.starts[:, sl].clone()
    continues = ~starts[:, 0]
    starts[:, 0] = True
    local = _segments_from_starts(starts, glob.valid[:, sl])
    cu = local.cu_seqlens
    row_first = local.seq_idx[:, 0]  # [B]
    row_last = local.seq_idx[:, -1]
    first_len = cu[row_first + 1] - cu[row_first]
    first_cu = torch.cat([first_len.new_zeros(1), torch.cumsum(first_len, 0)])
    first_tokens = torch.cat([torch.arange(int(n), device=device) + b * local_len for b, n in
                              enumerate(first_len.tolist())])
    is_first = torch.zeros(cu.numel() - 1, dtype=torch.bool, device=device)
    is_first[row_first] = True
    rest_ids = torch.nonzero(~is_first).flatten()  # local segment ids of the other segments, in order
    rest_len = (cu[1:] - cu[:-1])[rest_ids]
    rest_cu = torch.cat([rest_len.new_zeros(1), torch.cumsum(rest_len, 0)])
    token_first = torch.zeros(batch_size * local_len, dtype=torch.bool, device=device)
    token_first[first_tokens] = True
    rest_tokens = torch.nonzero(~token_first).flatten()
    rank_in_rest = torch.cumsum((~is_first).long(), 0) - 1  # position of each segment among the rest
    last_rest = torch.where(is_first[row_last], torch.full_like(row_last, -1), rank_in_rest[row_last])
    local.sequence_parallel = SequenceParallelContext(
        group=group, rank=rank, world=world, local_len=local_len, global_len=global_len, offset=offset,
        global_layout=glob, continues=continues, single=first_len == local_len, first_seg=row_first,
        last_seg=row_last, first_tokens=first_tokens, first_cu=first_cu, rest_tokens=rest_tokens, rest_cu=rest_cu,
        last_rest=last_rest,
    )
    return local


def shard_sequence(batch: dict, rank: int, world: int, seq_dim: int = 1) -> dict:
    """This rank's contiguous shard of a global batch: every ``[B, S, ...]`` tensor (``input_ids``,
    ``position_ids``, ``labels``, ``attention_mask``, ``seq_idx``, ...) is sliced to ``[r * L, (r + 1) * L)`` with
    ``L = S / world``; ``cu_seq_lens_*`` / ``cu_seqlens`` (global boundaries) and non-tensors are kept as they are.

    Raises:
        ValueError: ``S`` is not a multiple of ``world`` (names ``S`` and ``world``), or the row tensors disagree on
            ``S``.
    """
    keep = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "max_length_q", "max_length_k", "num_items_in_batch")
    out, seq = {}, None
    for key, value in batch.items():
        if key in keep or not isinstance(value, torch.Tensor) or value.dim() <= seq_dim:
            out[key] = value
            continue
        n = value.shape[seq_dim]
        if seq is None:
            seq = n
        elif n != seq:
            raise ValueError(f"shard_sequence: {key} has sequence length {n}, other tensors {seq}")
        if n % world:
            raise ValueError(
                f"shard_sequence: sequence length {n} of {key} is not a multiple of the SP world size {world} "
                f"(uneven shards are refused; pad the rows to a multiple of {world})"
            )
        length = n // world
        out[key] = value.narrow(seq_dim, rank * length, length)
    return out
