"""Sequence parallelism (SP), applied to a built model by :func:`apply_sequence_parallel`: rank ``r`` of ``W`` holds
tokens ``[r * L, (r + 1) * L)`` of every global row, packed documents with any boundaries; the ranks' losses (each
divided by the global target count) and gradients sum to the single-device ones. The collectives are autograd-aware;
every rank joins each one.

The model carries no SP code: each text model's ``layout_builder`` makes the shard's layout, whose ``shard`` (a
:class:`SequenceParallelContext`) the layers call (:attr:`glm53flash_hf.packing.DocumentLayout.shard`): the KDA
state passing, the DSA latent and indexer gather, the MTP roll and the loss's label shift and counts.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .. import fla_compat

__all__ = ["SequenceParallelContext", "apply_sequence_parallel", "build_shard_layout", "chunk_kda_context_parallel",
           "fla_cp_context", "fla_cp_refusal", "kda_boundary_transition", "shard_sequence", "sp_chunk_kda",
           "sp_conv_initial_state", "sp_loss_kwargs"]

TEXT_MODEL_CLASS_NAME = "Glm53FlashTextModel"


class _AllGather(torch.autograd.Function):
    """All-gather whose backward sums every rank's gradient of a copy onto its owner (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tuple(_gather_plain(tensor, group))

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


def _gather_plain(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    tensor = tensor.contiguous()
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor, group=group)
    return out


def _gather(tensor: torch.Tensor, group, grad: bool):
    """Every rank's ``tensor``; with ``grad`` through :class:`_AllGather` (gradients summed onto the owner)."""
    return _AllGather.apply(tensor, group) if grad else _gather_plain(tensor, group)


def _anchor(value: torch.Tensor, gathered) -> torch.Tensor:
    """``value + 0 * sum(gathered)``, so the gather's backward collective runs on every rank."""
    tie = sum(t.sum() for t in gathered if t.requires_grad)
    if isinstance(tie, torch.Tensor):
        return value + 0.0 * tie.to(value.dtype)
    return value


@dataclass
class SequenceParallelContext:
    """Where this rank's shard sits in the global rows (``global_layout``, ``offset = r * L``), and its collectives.

    Per row (``[B]``): ``continues`` (the shard's first token continues the previous rank's document), ``single`` (one
    local segment), ``first_seg`` / ``last_seg`` (local segment ids). ``first_tokens`` / ``first_cu``: flattened local
    positions and boundaries of the rows' first segments; ``rest_tokens`` / ``rest_cu`` those of the others,
    ``last_rest`` each row's last segment among them (``-1`` if none). ``memo``: per-forward values of the layers."""

    group: object
    rank: int
    world: int
    local_len: int
    global_len: int
    offset: int
    global_layout: object  # the packing.DocumentLayout of the whole rows
    continues: torch.Tensor
    single: torch.Tensor
    first_seg: torch.Tensor
    last_seg: torch.Tensor
    first_tokens: torch.Tensor
    first_cu: torch.Tensor
    rest_tokens: torch.Tensor
    rest_cu: torch.Tensor
    last_rest: torch.Tensor
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def gather_sequence(self, x: torch.Tensor, grad: bool = True) -> torch.Tensor:
        """All-gather ``x`` ``[B, L, ...]`` along the sequence into ``[B, S, ...]``; with ``grad`` (and ``x`` requiring
        grad) the backward sums every rank's gradient onto its owner."""
        return torch.cat(list(_gather(x, self.group, grad and x.requires_grad)), dim=1)

    def _next_rank_head(self, x: torch.Tensor, count: int, fill) -> torch.Tensor:
        if count > self.local_len:
            raise ValueError(f"shift={count} exceeds the per-rank shard length local_len={self.local_len}")
        head = x[:, :count]
        parts = _gather(head, self.group, x.requires_grad)
        nxt = parts[self.rank + 1] if self.rank + 1 < self.world else torch.full_like(head, fill)
        return _anchor(nxt, parts) if x.requires_grad else nxt

    def doc_roll(self, x: torch.Tensor, shift: int, fill=0) -> torch.Tensor:
        """:func:`.mtp.doc_roll` across shards: ``out[b, t] = x_global[b, offset + t + shift]`` inside the same global
        segment, else ``fill``, for ``x`` ``[B, L, ...]``; ``ValueError`` unless ``0 <= shift <= L``."""
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
        """The causal-LM shift of the global rows for ``labels`` ``[B, L]`` (``ignore_index`` at the row end)."""
        nxt = self._next_rank_head(labels, 1, ignore_index)
        return torch.cat([labels[:, 1:], nxt], dim=1)

    def previous_rank_tail(self, x: torch.Tensor, count: int, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The previous rank's last ``count`` positions of ``x [B, L, ...]``, zeros on rank 0 and where ``keep``
        (bool ``[B, count]``) is False; ``ValueError`` if ``L < count``."""
        L = x.shape[1]
        if L < count:
            raise ValueError(f"previous_rank_tail needs local_len >= count = {count}; got {L}")
        tail = x[:, L - count :]
        parts = _gather(tail, self.group, x.requires_grad)
        prev = parts[self.rank - 1] if self.rank > 0 else torch.zeros_like(parts[0])
        if keep is not None:
            prev = torch.where(keep.view(keep.shape + (1,) * (prev.dim() - 2)), prev, torch.zeros_like(prev))
        return _anchor(prev, parts) if x.requires_grad else prev

    def affine_prefix(self, a_local: torch.Tensor, b_local: torch.Tensor,
                      keep: torch.Tensor | None = None) -> torch.Tensor:
        """The state entering this rank when rank ``r`` maps ``S -> A_r S + B_r`` (``a_local`` ``[B, ..., K, K]``,
        ``b_local`` ``[B, ..., K, V]``): ``S_in(0) = 0``, ``S_in(r) = A_{r-1} S_in(r-1) + B_{r-1}``, zero where
        ``keep`` (bool ``[B]``) is False."""
        grads = a_local.requires_grad or b_local.requires_grad
        a_all, b_all = _gather(a_local, self.group, grads), _gather(b_local, self.group, grads)
        state = torch.zeros_like(b_local)
        for r in range(self.rank):
            state = torch.matmul(a_all[r], state) + b_all[r]
        if keep is not None:
            state = torch.where(keep.view((-1,) + (1,) * (state.dim() - 1)), state, torch.zeros_like(state))
        return _anchor(state, tuple(a_all) + tuple(b_all)) if grads else state

    def global_count(self, count: torch.Tensor) -> torch.Tensor:
        """The group's sum of an integer count (an all-reduce of a copy)."""
        total = count.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total

    def conv_initial_state(self, mixed: torch.Tensor, kernel: int, num_segments: int) -> torch.Tensor:
        """:func:`sp_conv_initial_state` of this shard."""
        return sp_conv_initial_state(self, mixed, kernel, num_segments)

    def chunk_kda(self, core, q, k, v, g, beta, *, cu_seqlens: torch.Tensor, gate: dict | None = None):
        """:func:`sp_chunk_kda` of this shard (``gate``: fla's context-parallel op's gate parameters, or None)."""
        return sp_chunk_kda(self, core, q, k, v, g, beta, cu_seqlens=cu_seqlens, fla_cp=gate)

    def loss_kwargs(self, labels: torch.Tensor, loss_kwargs: dict) -> dict:
        """:func:`sp_loss_kwargs` of this shard."""
        return sp_loss_kwargs(self, labels, loss_kwargs)


def sp_loss_kwargs(sp: SequenceParallelContext, labels: torch.Tensor, loss_kwargs: dict) -> dict:
    """Loss kwargs of a shard, ``labels`` ``[B, L]``: ``shift_labels`` and ``num_items_in_batch`` (the group's
    supervised count, at least 1) filled in when not given, so the ranks' losses sum to the single-device loss."""
    ignore = loss_kwargs.get("ignore_index", -100)
    out = dict(loss_kwargs)
    if out.get("shift_labels") is None:
        out["shift_labels"] = sp.shift_labels(labels, ignore)
    if out.get("num_items_in_batch") is None:
        # at least 1: labels all ignore_index give loss 0.0 (the single-device convention), not 0 / 0
        out["num_items_in_batch"] = sp.global_count((out["shift_labels"] != ignore).sum()).clamp_min(1)
    return out


def shard_sequence(batch: dict, rank: int, world: int, seq_dim: int = 1) -> dict:
    """This rank's shard of a global batch: every ``[B, S, ...]`` tensor sliced to ``[r * L, (r + 1) * L)``;
    ``cu_seq_lens_*`` / ``cu_seqlens`` and non-tensors kept. ``ValueError`` if the tensors disagree on ``S`` or ``S`` is
    not a multiple of ``world``."""
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
            raise ValueError(f"shard_sequence: sequence length {n} of {key} is not a multiple of the SP world size "
                             f"{world} (uneven shards are refused; pad the rows to a multiple of {world})")
        length = n // world
        out[key] = value.narrow(seq_dim, rank * length, length)
    return out


def build_shard_layout(packing, group, batch_size: int, local_len: int, device,
                       attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None, cache=None,
                       **kwargs):
    """The local ``packing.DocumentLayout`` of this rank's ``[B, L]`` shard (the global segments cut at the shard
    start), its :class:`SequenceParallelContext` as ``layout.shard``; ``packing``: the model's own
    :mod:`glm53flash_hf.packing` module (a remote-code copy for a model loaded with ``trust_remote_code``).
    ``attention_mask``, ``position_ids``, ``seq_idx`` are local slices; ``cu_seq_lens_q`` / ``cu_seqlens`` give the
    global rows. Collective over ``group``.

    Raises:
        ValueError: a ``cache`` (SP runs uncached forwards only); the ranks' shard shapes differ; bad layout
            arguments (``packing.build_document_layout``).
    """
    if cache is not None:
        raise ValueError("sequence parallelism runs uncached forwards only; got a cache (call "
                         "apply_sequence_parallel(model, None) before generating)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    lengths = _gather_plain(torch.tensor([batch_size, local_len], device=device), group)
    lengths = [tuple(int(v) for v in t.tolist()) for t in lengths]
    if len(set(lengths)) != 1:
        raise ValueError("sequence parallelism needs the same [batch, local_len] on every rank of the group (shard "
                         f"rows into equal contiguous parts, e.g. with shard_sequence); got per-rank shapes {lengths}")
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
    glob = packing.build_layout(batch_size, global_len, device, attention_mask=gather(attention_mask),
                                position_ids=gather(position_ids), **extra)
    glob.segment_tensors()
    offset = rank * local_len
    sl = slice(offset, offset + local_len)
    starts = glob.starts[:, sl].clone()
    continues = ~starts[:, 0]
    starts[:, 0] = True
    local = packing.layout_from_starts(starts, glob.valid[:, sl])
    local.segment_tensors()
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
    local.shard = SequenceParallelContext(
        group=group, rank=rank, world=world, local_len=local_len, global_len=global_len, offset=offset,
        global_layout=glob, continues=continues, single=first_len == local_len, first_seg=row_first,
        last_seg=row_last, first_tokens=first_tokens, first_cu=first_cu, rest_tokens=rest_tokens, rest_cu=rest_cu,
        last_rest=last_rest,
    )
    return local


_CP_WARNED: set[str] = set()


def sp_conv_initial_state(sp, mixed: torch.Tensor, kernel: int, num_segments: int) -> torch.Tensor:
    """Conv ``initial_state`` ``[num_segments, D, kernel]`` of a shard from its conv inputs ``mixed`` ``[B, L, D]``:
    the previous rank's last inputs of a continuing document, else zeros; ``ValueError`` if ``L < kernel - 1``."""
    B, L, D = mixed.shape
    hist = kernel - 1
    if L < hist:
        raise ValueError(f"sequence parallelism needs local_len >= linear_conv_kernel_dim - 1 = {hist}; got {L}")
    pos = sp.offset - hist + torch.arange(hist, device=mixed.device)  # global positions of the history
    doc_first = sp.global_layout.doc_start[:, sp.offset]  # [B] first token of the continuing document
    keep = sp.continues[:, None] & (pos[None] >= doc_first[:, None])  # [B, hist]
    prev = sp.previous_rank_tail(mixed, hist, keep)  # [B, hist, D]
    first = torch.cat([prev.new_zeros(B, D, 1), prev.transpose(1, 2)], dim=-1)  # [B, D, kernel]
    return mixed.new_zeros(num_segments, D, kernel).index_copy(0, sp.first_seg, first)


def fla_cp_refusal(sp, device) -> str | None:
    """Why fla's context-parallel KDA cannot run the shard of ``sp`` (it needs one global row, fla's CP modules and a
    device they accept), or ``None``."""
    if sp.global_layout.batch_size != 1:
        return (f"it chains one token row and this batch has {sp.global_layout.batch_size} rows; pack the "
                "documents into one row per step to use it")
    try:
        error = fla_compat.cp_device_error(device)
    except ImportError as exc:
        return str(exc)
    return None if error is None else f"fla refuses the device {device}: {error}"


def fla_cp_context(sp, cu_seqlens: torch.Tensor):
    """fla's ``FLACPContext`` of this rank for the forward's ``sp`` (built once, kept in ``sp.memo``).

    Raises:
        RuntimeError: fla's local boundaries differ from this rank's ``cu_seqlens``.
    """
    if "fla_cp" not in sp.memo:
        glob = sp.global_layout.cu_seqlens
        ctx = fla_compat.load_cp().build_cp_context(cu_seqlens=glob, group=sp.group, cu_seqlens_cpu=glob.cpu())
        mine = cu_seqlens.tolist()
        if ctx.cu_seqlens_cpu.tolist() != mine:
            raise RuntimeError(f"fla's context-parallel split of the row differs from this rank's layout: fla "
                               f"{ctx.cu_seqlens_cpu.tolist()}, layout {mine} (rank {sp.rank} of {sp.world})")
        sp.memo["fla_cp"] = ctx
    return sp.memo["fla_cp"]


def chunk_kda_context_parallel(q, k, v, g_raw, beta_logits, A_log, dt_bias, lower_bound: float | None, *, cp_context,
                               scale: float | None = None, chunk_size: int = 64) -> torch.Tensor:
    """One rank's shard of a context-parallel :func:`glm53flash_hf.kda_fused.chunk_kda_fused` with the gate in the
    kernel: fla's ``chunk_kda`` with ``cp_context``.

    Arguments as ``chunk_kda_fused`` over the rank's ``[1, T, ...]`` tokens, documents from ``cp_context.cu_seqlens``
    (:func:`fla_cp_context`), no initial or final state. fla wraps it in ``torch.compiler.disable`` (a graph break).
    Returns ``o`` ``[1, T, H, V]`` in q's dtype.

    Raises:
        ValueError: as ``chunk_kda_fused``, or ``q.shape[0] != 1``.
    """
    from ..kda_fused import chunk_arguments

    args = chunk_arguments(q, k, v, g_raw, beta_logits, scale, None, False, None, chunk_size,
                           (A_log, dt_bias, lower_bound))
    if q.shape[0] != 1:
        raise ValueError(f"context-parallel KDA takes one flattened token row; got q of shape {tuple(q.shape)}")
    del args["cu_seqlens"]  # the documents come from cp_context
    return fla_compat.chunk_context_parallel(cp_context, **args).type_as(q)


def sp_chunk_kda(sp, core, q, k, v, g, beta, *, cu_seqlens: torch.Tensor, fla_cp: dict | None = None) -> torch.Tensor:
    """The chunked KDA of a shard, the recurrent state passed between ranks (docs/design.md, sequence parallelism).

    ``core``: a chunk op with the contract of :func:`glm53flash_hf.kda_ops.chunk_kda_torch` (the gate parameters
    bound); ``q, k, v, g, beta``: the flattened local rows ``[1, B*L, ...]`` with ``cu_seqlens``; ``fla_cp``: the
    gate parameters (``A_log``, ``dt_bias``, ``lower_bound``) for fla's context-parallel op
    (:func:`chunk_kda_context_parallel`), used when :func:`fla_cp_refusal` allows it (else a warning, once per
    reason). Returns ``o`` ``[1, B*L, H, V]``.
    """
    from torch.utils.checkpoint import checkpoint

    if fla_cp is not None:
        refusal = fla_cp_refusal(sp, q.device)
        if refusal is None:
            return chunk_kda_context_parallel(q, k, v, g, beta, **fla_cp, cp_context=fla_cp_context(sp, cu_seqlens))
        if refusal not in _CP_WARNED:
            _CP_WARNED.add(refusal)
            warnings.warn(f"sequence parallelism: fla's context-parallel KDA is not used ({refusal}); the shards pass "
                          "the KDA state with this package's scheme (same result, fla's chunk kernels)", stacklevel=3)

    ft, first_cu = sp.first_tokens, sp.first_cu
    q1, k1, v1, g1, beta1 = (t.index_select(1, ft) for t in (q, k, v, g, beta))

    def boundary(q1, k1, v1, g1, beta1):
        a = kda_boundary_transition(core, k1, g1, beta1, cu_seqlens=first_cu, like_q=q1)
        _, b = core(q1, k1, v1, g1, beta1, cu_seqlens=first_cu, output_final_state=True)
        return a, b

    if torch.is_grad_enabled() and any(t.requires_grad for t in (q1, k1, v1, g1, beta1)):
        a_local, b_first = checkpoint(boundary, q1, k1, v1, g1, beta1, use_reentrant=False)
    else:
        a_local, b_first = boundary(q1, k1, v1, g1, beta1)
    a_local = a_local * (sp.single & sp.continues).to(a_local.dtype)[:, None, None, None]
    o_rest = None
    b_local = b_first
    if sp.rest_tokens.numel():
        rest = [t.index_select(1, sp.rest_tokens) for t in (q, k, v, g, beta)]
        o_rest, finals = core(*rest, cu_seqlens=sp.rest_cu, output_final_state=True)
        b_rest = finals.index_select(0, sp.last_rest.clamp_min(0))
        b_local = torch.where(sp.single[:, None, None, None], b_first, b_rest)
    state = sp.affine_prefix(a_local, b_local, keep=sp.continues)
    o1, _ = core(q1, k1, v1, g1, beta1, initial_state=state, cu_seqlens=first_cu)
    o = o1.new_zeros(v.shape).index_copy(1, ft, o1)
    if o_rest is not None:
        o = o.index_copy(1, sp.rest_tokens, o_rest.to(o.dtype))
    return o


def kda_boundary_transition(core, k, g, beta, *, cu_seqlens: torch.Tensor | None = None, like_q=None) -> torch.Tensor:
    """fp32 ``A`` ``[N, H, K, K]`` of each segment, ``S_end = A S_start + B``: ``core`` run with ``v = 0`` from
    ``S_start = I`` over ``k, g`` ``[1, T, H, K]``, ``beta`` ``[1, T, H]`` (``like_q``'s values do not matter)."""
    T, H, K = k.shape[1], k.shape[2], k.shape[3]
    n = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    eye = torch.eye(K, device=k.device, dtype=torch.float32).expand(n, H, K, K)
    q = like_q if like_q is not None else k
    zeros = k.new_zeros(k.shape[0], T, H, K)
    kwargs = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    _, a = core(q, k, zeros, g, beta, initial_state=eye, output_final_state=True, **kwargs)
    return a


def apply_sequence_parallel(model: nn.Module, group=None) -> None:
    """Sequence parallelism over ``group`` (a ``torch.distributed`` process group) or off (``None``) for every
    ``Glm53FlashTextModel`` inside ``model`` (built directly or loaded through the Auto classes with remote code):
    sets its ``layout_builder`` to :func:`build_shard_layout` with the model's own ``packing`` module. Each rank's
    uncached forward then takes its contiguous shard ``[B, L]`` of the global rows (:func:`shard_sequence`), with
    ``labels``, ``position_ids``, ``attention_mask`` and ``seq_idx`` sliced alike (``cu_seq_lens_q`` / ``cu_seqlens``
    global); with the global ``num_items_in_batch`` or none, the group's losses and gradients summed equal one
    device's.

    Raises:
        ValueError: ``model`` holds no ``Glm53FlashTextModel``.
    """
    text_models = [m for m in model.modules() if type(m).__name__ == TEXT_MODEL_CLASS_NAME]
    if not text_models:
        raise ValueError(f"model={type(model).__name__} holds no {TEXT_MODEL_CLASS_NAME} to apply SP to")
    for module in text_models:
        if group is None:
            module.layout_builder = None
            continue
        package = type(module).__module__.rpartition(".")[0]
        packing = importlib.import_module(".packing", package) if package else importlib.import_module("packing")
        module.layout_builder = functools.partial(build_shard_layout, packing, group)
