"""Multi-token prediction (MTP) objective: per-document rolls and the MTP loss.

Source: DeepSeek-V3 technical report §2.2 ("Multi-Token Prediction"): depth ``k`` at position ``t`` reads the
state at ``t`` and the embedding of token ``t + k`` and predicts token ``t + 1 + k``, i.e.
``target_k[t] = labels[t + 1 + k]`` when ``t + 1 + k`` lies in ``t``'s document, else ``-100``; tails are filled
with token 0 / zero embedding / -100.
"""

from __future__ import annotations

import torch
from torch import nn

from .packing import DocumentLayout


def doc_roll(x: torch.Tensor, layout: DocumentLayout, shift: int, fill=0) -> torch.Tensor:
    """Roll ``x`` (``[B, S, ...]``) left by ``shift >= 0`` inside each segment of ``layout`` (across sequence-parallel
    shards): ``out[b, t] = x[b, t + shift]`` within the segment, else ``fill``; ``ValueError`` when ``shift`` is
    negative or ``x`` is not ``[B, S, ...]`` of the layout."""
    if shift < 0:
        raise ValueError(f"doc_roll shift must be >= 0; got {shift}")
    sp = getattr(layout, "sequence_parallel", None)
    if sp is not None:  # a sequence-parallel shard: the roll reads the next rank's first tokens
        return sp.doc_roll(x, shift, fill)
    if tuple(x.shape[:2]) != (layout.batch_size, layout.seq_len):
        raise ValueError(
            f"doc_roll expects x of shape [{layout.batch_size}, {layout.seq_len}, ...]; got {tuple(x.shape)}"
        )
    if shift == 0:
        return x
    seg_len = layout.segment_lengths()[layout.seq_idx]  # [B, S]
    keep = layout.local_pos + shift < seg_len  # [B, S]
    src = (torch.arange(layout.seq_len, device=x.device) + shift).clamp_max(layout.seq_len - 1)
    rolled = x[:, src]
    keep = keep.view(keep.shape + (1,) * (x.dim() - 2))
    return torch.where(keep, rolled, torch.as_tensor(fill, dtype=x.dtype, device=x.device))


def mtp_targets(labels: torch.Tensor, layout: DocumentLayout, depth: int, ignore_index: int = -100,
                shifted: bool = False) -> torch.Tensor:
    """Targets ``[B, S]`` of MTP depth ``depth`` (1-based): ``labels[t + 1 + depth]`` inside the document, else
    ``ignore_index``. ``shifted=True``: ``labels`` are already shifted by one (``shift_labels``).
    """
    if not shifted:
        return doc_roll(labels, layout, depth + 1, fill=ignore_index)
    inside = doc_roll(torch.ones_like(labels), layout, 1, fill=0) != 0  # t + 1 lies in t's document
    labels = torch.where(inside, labels, torch.full_like(labels, ignore_index))
    return doc_roll(labels, layout, depth, fill=ignore_index)


def mtp_loss(
    lm_head: nn.Module,
    mtp_hidden_states: tuple[torch.Tensor, ...],
    labels: torch.Tensor,
    layout: DocumentLayout,
    num_items_in_batch=None,
    ignore_index: int = -100,
    shifted: bool = False,
    count_total=None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Unweighted MTP loss: mean over depths ``k`` of the fp32 cross-entropy of ``lm_head(mtp_hidden_states[k-1])``
    against :func:`mtp_targets`, reduced per depth as transformers' ``ForCausalLMLoss`` (``num_items_in_batch``, else
    the mean; 0 without targets; ``count_total`` maps a depth's count first). Returns ``(loss, [B, S, V] per depth)``.
    """
    losses, all_logits = [], []
    for k, hidden in enumerate(mtp_hidden_states, start=1):
        logits = lm_head(hidden)
        target = mtp_targets(labels, layout, k, ignore_index, shifted).to(logits.device)
        ce = nn.functional.cross_entropy(
            logits.float().flatten(0, 1), target.flatten(), ignore_index=ignore_index, reduction="sum"
        )
        if num_items_in_batch is not None:
            denom = num_items_in_batch.to(ce.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        else:
            count = (target != ignore_index).sum()
            denom = (count_total(count) if count_total is not None else count).clamp_min(1)
        losses.append(ce / denom)
        all_logits.append(logits)
    return torch.stack(losses).mean(), tuple(all_logits)
