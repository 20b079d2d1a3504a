"""Document boundaries for packed and padded batches: one :class:`DocumentLayout` per forward, read by every layer.

A *segment* is a maximal run of one row's tokens of one document (padding runs are invalid segments of their
own); ``cu_seqlens`` indexes the row-major flattened ``B * S`` tokens, as in fla's varlen kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .generation_cache import build_cache_context
from .input_checks import check_integer_tensor


@dataclass
class DocumentLayout:
    """Segment structure of a ``[B, S]`` batch; per token (``[B, S]``): bool ``valid`` and ``starts`` (a segment's
    first token), long ``doc_start`` (its segment's first position), ``local_pos`` and ``seq_idx`` (global segment
    index). ``trivial``: every row is one valid segment (under ``torch.compile``, only when no layout argument was
    given). ``cu_seqlens`` long ``[N + 1]`` and ``segment_valid`` bool ``[N]`` are computed on first use."""

    batch_size: int
    seq_len: int
    valid: torch.Tensor
    starts: torch.Tensor
    doc_start: torch.Tensor
    local_pos: torch.Tensor
    seq_idx: torch.Tensor
    trivial: bool

    _segments: tuple | None = field(default=None, repr=False, compare=False)  # (cu_seqlens, segment_valid), lazily
    #: None, or the shard context of a layout that is one contiguous part of longer rows split over processes
    #: (made by a text model's ``layout_builder``, set from outside the model, e.g. by the package's ``train``).
    #: The layers read ``shard.global_layout`` (the whole rows' layout), ``shard.offset`` (this part's first position)
    #: and call ``gather_sequence(x [B, L, ...], grad) -> [B, S, ...]``, ``doc_roll(x, shift, fill)``,
    #: ``conv_initial_state(mixed [B, L, D], kernel, num_segments)``, ``chunk_kda(core, q, k, v, g, beta, *,
    #: cu_seqlens, gate)``, ``loss_kwargs(labels, loss_kwargs)`` and ``global_count(count)``.
    shard: object | None = field(default=None, repr=False, compare=False)
    #: the :class:`.generation_cache.CacheContext` of a cached forward, else None
    cache_context: object | None = field(default=None, repr=False, compare=False)
    #: None, or ``{layer_idx: ids}``: the DSA selections of a training forward with activation checkpointing, kept so
    #: that the recompute of a layer (called with this same layout) reuses its ids instead of scoring again
    selections: dict | None = field(default=None, repr=False, compare=False)

    def segment_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cu_seqlens, segment_valid)``, computed on the first call and kept."""
        if self._segments is None:
            start_positions = torch.nonzero(self.starts.reshape(-1)).flatten()
            end = torch.tensor([self.batch_size * self.seq_len], device=self.starts.device, dtype=torch.long)
            self._segments = (torch.cat([start_positions, end]), self.valid.reshape(-1)[start_positions])
        return self._segments

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.segment_tensors()[0]

    @property
    def segment_valid(self) -> torch.Tensor:
        return self.segment_tensors()[1]

    @property
    def num_segments(self) -> int:
        return int(self.cu_seqlens.numel() - 1)

    def segment_lengths(self) -> torch.Tensor:
        """Long ``[N]``: the length of each segment."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]


def _as_2d(name: str, value: torch.Tensor, batch_size: int, seq_len: int) -> torch.Tensor:
    if value.dim() == 1:
        value = value.unsqueeze(0)
    if value.dim() != 2 or value.shape[-1] != seq_len or value.shape[0] not in (1, batch_size):
        raise ValueError(
            f"{name} must have shape [{batch_size}, {seq_len}] (or [1, {seq_len}]); got {tuple(value.shape)}"
        )
    return value.expand(batch_size, seq_len)


def _check_cu_seqlens_values(cu: torch.Tensor, total: int) -> None:
    """Raise ``ValueError`` unless ``cu`` goes from 0 to ``total`` with positive lengths (eager only)."""
    if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at batch*seq = {total}; got {cu.tolist()[:8]}"
            f"{'...' if cu.numel() > 8 else ''} (last {int(cu[-1]) if cu.numel() else 'none'})"
        )
    lengths = cu[1:] - cu[:-1]
    if bool((lengths <= 0).any()):
        bad = int(torch.nonzero(lengths <= 0)[0, 0])
        raise ValueError(
            f"cu_seqlens describes an empty or negative-length document at index {bad} "
            f"(cu_seqlens[{bad}]={int(cu[bad])}, cu_seqlens[{bad + 1}]={int(cu[bad + 1])})"
        )


def build_document_layout(
    batch_size: int,
    seq_len: int,
    device: torch.device | str,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
) -> DocumentLayout:
    """The :class:`DocumentLayout` of a ``[B, S]`` batch on ``device``: a segment starts at each row's first token,
    where padding (0 in the bool or 0/1 ``attention_mask``) begins or ends, where ``position_ids`` do not continue by
    +1, at every ``cu_seqlens`` boundary (``[N + 1]`` over ``B * S``) and where ``seq_idx`` changes.

    Raises:
        ValueError: a shape other than ``[B, S]`` / ``[1, S]``, non-integer ids or boundaries, a non-2-D or non-0/1
            ``attention_mask``, ``cu_seqlens`` not from 0 to ``B * S`` or with an empty document.
    """
    for name, value in (("position_ids", position_ids), ("cu_seqlens", cu_seqlens), ("seq_idx", seq_idx)):
        check_integer_tensor(name, value)
    total = batch_size * seq_len
    statically_trivial = all(x is None for x in (attention_mask, position_ids, cu_seqlens, seq_idx))
    starts = torch.zeros(batch_size, seq_len, dtype=torch.bool, device=device)
    starts[:, 0] = True

    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attention_mask must be a 2-D [batch, seq] padding mask; got shape {tuple(attention_mask.shape)}"
            )
        mask = _as_2d("attention_mask", attention_mask.to(device), batch_size, seq_len)
        if not torch.compiler.is_compiling() and not bool(((mask == 0) | (mask == 1)).all()):
            bad = mask[(mask != 0) & (mask != 1)][0].item()
            raise ValueError(
                f"attention_mask must be a 0/1 (or bool) padding mask, 1 on real tokens; got the value {bad} "
                "(an additive mask of 0 / -inf is not accepted)"
            )
        valid = mask.bool()
        starts[:, 1:] |= valid[:, 1:] != valid[:, :-1]
    else:
        valid = torch.ones(batch_size, seq_len, dtype=torch.bool, device=device)

    if position_ids is not None:
        pos = _as_2d("position_ids", position_ids.to(device), batch_size, seq_len)
        # Positions of padding tokens are arbitrary (generate fills them with 1): only valid tokens split.
        starts[:, 1:] |= (pos[:, 1:] != pos[:, :-1] + 1) & valid[:, 1:]

    if seq_idx is not None:
        sidx = _as_2d("seq_idx", seq_idx.to(device), batch_size, seq_len)
        starts[:, 1:] |= sidx[:, 1:] != sidx[:, :-1]

    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=device, dtype=torch.long).flatten()
        if cu.numel() < 2 or not torch.compiler.is_compiling():
            _check_cu_seqlens_values(cu, total)
        starts.view(-1)[cu[:-1]] = True

    layout = layout_from_starts(starts, valid, trivial=statically_trivial)
    if not statically_trivial and not torch.compiler.is_compiling():
        # eager: read the data (a trivial batch given with an all-ones mask takes the batched paths)
        layout.trivial = bool(layout.num_segments == batch_size and bool(valid.all()))
    return layout


def layout_from_starts(starts: torch.Tensor, valid: torch.Tensor, trivial: bool = False) -> DocumentLayout:
    """The :class:`DocumentLayout` whose segments begin where the bool ``[B, S]`` ``starts`` is True (column 0
    must be); ``valid`` bool ``[B, S]``; ``trivial`` is taken as given."""
    batch_size, seq_len = starts.shape
    arange = torch.arange(seq_len, device=starts.device)
    seg_idx = (torch.cumsum(starts.reshape(-1).long(), 0) - 1).view(batch_size, seq_len)
    doc_start = torch.cummax(torch.where(starts, arange.expand(batch_size, -1), torch.zeros_like(arange)), dim=1).values
    local_pos = arange.unsqueeze(0) - doc_start
    return DocumentLayout(batch_size, seq_len, valid, starts, doc_start, local_pos, seg_idx, trivial)


def build_layout(
    batch_size: int,
    seq_len: int,
    device: torch.device | str,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache=None,
    **kwargs,
) -> DocumentLayout:
    """The :class:`DocumentLayout` of a forward over ``[B, S]`` tokens, in the mode its arguments select.

    * uncached: :func:`build_document_layout` from the forward's kwargs (``cu_seq_lens_q`` or ``cu_seqlens``,
      ``seq_idx``), the segment tensors computed;
    * ``cache`` (a transformers ``Cache``, read, not written): ``layout.cache_context`` is the call's
      :class:`~.generation_cache.CacheContext` (:func:`~.generation_cache.build_cache_context`; ``attention_mask``
      ``[B, past + S]``), the layout that of its ``valid`` tokens.

    Raises:
        ValueError: ``cu_seq_lens_q`` and ``cu_seqlens`` both given and different; and the errors of the mode's
            builder.
    """
    if cache is not None:
        context = build_cache_context(cache, batch_size, seq_len, device, attention_mask, position_ids, **kwargs)
        layout = build_document_layout(batch_size, seq_len, device, attention_mask=context.valid)
        layout.cache_context = context
        return layout
    cu, cu2 = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seqlens")
    check_integer_tensor("cu_seq_lens_q", cu)
    if cu is not None and cu2 is not None and not torch.compiler.is_compiling():
        if not torch.equal(cu.long().cpu(), cu2.long().cpu()):
            raise ValueError("cu_seq_lens_q and cu_seqlens were both given and differ")
    layout = build_document_layout(
        batch_size, seq_len, device, attention_mask=attention_mask, position_ids=position_ids,
        cu_seqlens=cu if cu is not None else cu2, seq_idx=kwargs.get("seq_idx"),
    )  # fmt: skip
    if not layout.trivial:
        # the packed layers read the segment boundaries: build them here, not first inside a (checkpointed) layer,
        # where the lazy build would be a side effect on an outside object
        layout.segment_tensors()
    return layout

