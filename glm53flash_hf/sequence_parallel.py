"""Sequence parallelism (``model.set_sequence_parallel(group)``): rank ``r`` of ``W`` holds tokens ``[r * L, (r + 1)
* L)`` of every global row, packed documents with any boundaries; the ranks' losses (each divided by the global target
count) and gradients sum to the single-device ones. The collectives are autograd-aware; every rank joins each one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["SequenceParallelContext", "shard_sequence", "sp_loss_kwargs"]


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
    global_layout: DocumentLayout  # noqa: F821 (packing.DocumentLayout; packing imports this module)
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
        if x.requires_grad:
            prev = _anchor(prev, parts)
        return prev

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
        if grads:
            state = _anchor(state, tuple(a_all) + tuple(b_all))
        return state

    def global_count(self, count: torch.Tensor) -> torch.Tensor:
        """The group's sum of an integer count (an all-reduce of a copy)."""
        total = count.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total


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
            raise ValueError(
                f"shard_sequence: sequence length {n} of {key} is not a multiple of the SP world size {world} "
                f"(uneven shards are refused; pad the rows to a multiple of {world})"
            )
        length = n // world
        out[key] = value.narrow(seq_dim, rank * length, length)
    return out
