"""Multi-token prediction (MTP) objective: per-document rolls and the MTP loss.

Source: DeepSeek-V3 technical report §2.2 ("Multi-Token Prediction"): depth ``k`` at position ``t`` reads the
state at ``t`` and the embedding of token ``t + k`` and predicts token ``t + 1 + k``, i.e.
``target_k[t] = labels[t + 1 + k]`` when ``t + 1 + k`` lies in ``t``'s document, else ``-100``; tails are filled
with token 0 / zero embedding / -100.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .packing import DocumentLayout


def doc_roll(x: torch.Tensor, layout: DocumentLayout, shift: int, fill=0) -> torch.Tensor:
    """Roll ``x`` (``[B, S, ...]``) left by ``shift >= 0`` inside each segment of ``layout`` (across the parts of a
    sharded layout): ``out[b, t] = x[b, t + shift]`` within the segment, else ``fill``; ``ValueError`` when ``shift`` is
    negative or ``x`` is not ``[B, S, ...]`` of the layout."""
    if shift < 0:
        raise ValueError(f"doc_roll shift must be >= 0; got {shift}")
    if layout.shard is not None:  # a part of longer rows (DocumentLayout.shard): the roll reads the next part's head
        return layout.shard.doc_roll(x, shift, fill)
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
        ce = _token_nll(logits, target, ignore_index).sum()
        if num_items_in_batch is not None:
            denom = num_items_in_batch.to(ce.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        else:
            count = (target != ignore_index).sum()
            denom = (count_total(count) if count_total is not None else count).clamp_min(1)
        losses.append(ce / denom)
        all_logits.append(logits)
    return torch.stack(losses).mean(), tuple(all_logits)


def _token_nll(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """fp32 cross-entropy of each row of ``logits`` ``[..., V]`` against ``target`` ``[...]``, flat; 0 where ignored."""
    return nn.functional.cross_entropy(
        logits.float().flatten(0, -2), target.flatten(), ignore_index=ignore_index, reduction="none"
    )


def mtp_token_nll(lm_head: nn.Module, mtp_hidden_states, labels, layout, ignore_index: int = -100,
                  shifted: bool = False) -> torch.Tensor:
    """Sum over depths of each position's MTP cross-entropy ``[B, S]`` fp32 (the terms :func:`mtp_loss` sums per
    depth; 0 where a depth has no target), with logits only at the targeted positions."""
    total = None
    for k, hidden in enumerate(mtp_hidden_states, start=1):
        target = mtp_targets(labels, layout, k, ignore_index, shifted).to(hidden.device)
        keep = target != ignore_index
        nll = _token_nll(lm_head(hidden[keep]), target[keep], ignore_index)
        # masked_scatter keeps a depth without targets connected to the graph (a zero with zero gradients)
        per_token = torch.zeros(target.shape, dtype=torch.float32, device=hidden.device).masked_scatter(keep, nll)
        total = per_token if total is None else total + per_token
    return total


# ------------------------------------------------------------------- MTP under a trainer's fused LM head (TRL)
#
# TRL's trainers replace the model's forward by a fused LM head (trl.trainer.utils.add_fused_lm_head):
# model(..., labels=labels, fused_lm_head=True) runs the backbone without labels and returns per-token
# log-probabilities, from which the trainer computes its loss outside the model. The hooks below let the MTP layer's
# loss join that loss: the MTP layer runs inside the backbone call, and its per-token log-probabilities, weighted by
# mtp_loss_weight / mtp_depth, are added to the returned log_probs with value zero (x - x.detach()). The gradient
# the trainer's loss sends to log_probs then reaches the MTP terms with every factor the trainer applies
# (num_items_in_batch, gradient accumulation, the DDP world size, a loss scaler). For SFT's loss, -sum(log_probs) / N,
# that is exactly mtp_loss_weight * mtp_loss as our own forward adds it with num_items_in_batch=N. Other trainers'
# losses (DPO, GRPO, KTO, ...) are not the LM loss on labels; the MTP layer is then left out, with a warning.

_TRL_LM_LOSS = "sft"  # the TRL trainer tag whose fused-head loss is the LM loss on labels


def _mtp_on(model) -> bool:
    config = model.config.get_text_config(decoder=True)
    return config.num_nextn_predict_layers > 0 and config.mtp_loss_weight > 0


def note_trainer_tags(model, tags) -> None:
    """Record the TRL trainer that tags ``model`` (every TRL trainer calls ``model.add_model_tags(["trl", kind])``);
    a kind other than SFT, whose loss is not the LM loss on labels, warns that the MTP layer is not trained."""
    tags = [tags] if isinstance(tags, str) else list(tags)
    if "trl" not in tags:
        return
    kind = next((t for t in tags if t != "trl"), "trl")
    model._trl_trainer = kind
    if kind != _TRL_LM_LOSS and _mtp_on(model):
        config = model.config.get_text_config(decoder=True)
        warnings.warn(
            f"TRL's {kind!r} trainer computes its loss from the main head's log-probabilities, not the LM loss on "
            f"labels, so the MTP layer (layers.{config.num_hidden_layers}, the drafter of generate(use_mtp=True)) "
            "is not trained and keeps its weights. Train it with an SFT pass on the same data (TRL's SFTTrainer or "
            "glm53flash-finetune), or generate without use_mtp.",
            UserWarning,
            stacklevel=3,
        )


def _warn_once(model, message: str) -> None:
    warned = model.__dict__.setdefault("_mtp_warned", set())
    if message not in warned:
        warned.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


def _fused_head_start(model, args, kwargs):
    if not kwargs.get("fused_lm_head"):
        return None
    requested = kwargs.pop("mtp", None)  # our forward's switch; the fused forward would hand it to the backbone
    no_labels = kwargs.get("labels") is None and kwargs.get("shift_labels") is None
    if requested is False or not _mtp_on(model) or not model.training or no_labels:
        return args, kwargs
    if getattr(model, "_trl_trainer", None) != _TRL_LM_LOSS:
        if getattr(model, "_trl_trainer", None) is None:  # other TRL trainers were warned at their start
            _warn_once(model, "fused_lm_head=True outside TRL's SFTTrainer: the loss made of the returned log_probs "
                              "is not known to be the LM loss, so the MTP layer is not trained by it")
        return args, kwargs
    if not torch.is_grad_enabled():
        _warn_once(model, "SFTTrainer called the fused LM head without gradients while training (its loss came from "
                          "the full logits: compute_loss_func or label smoothing), so the MTP layer is not trained")
        return args, kwargs
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        return args, kwargs
    captured = {}  # the backbone's output in this call (TRL keeps only last_hidden_state)
    handle = model.base_model.register_forward_hook(lambda _m, _a, out: captured.setdefault("output", out))
    model._fused_head_call = handle, captured
    kwargs["mtp_depth"] = model.config.get_text_config(decoder=True).mtp_depth
    return args, kwargs


def _fused_head_end(model, args, kwargs, output):
    handle, captured = model.__dict__.pop("_fused_head_call", (None, {}))
    if handle is None:
        return None
    handle.remove()
    backbone = captured.get("output")
    hidden = getattr(backbone, "mtp_hidden_states", None)
    log_probs = getattr(output, "log_probs", None)
    if not hidden or log_probs is None:
        return None
    shifted = kwargs.get("shift_labels") is not None
    labels = kwargs["shift_labels"] if shifted else kwargs["labels"]
    nll = mtp_token_nll(model.get_output_embeddings(), hidden, labels, backbone.document_layout, shifted=shifted)
    config = model.config.get_text_config(decoder=True)
    weighted = -(config.mtp_loss_weight / len(hidden)) * nll  # [B, S]: position t's MTP log-likelihood terms
    weighted = weighted if shifted else weighted[:, :-1]  # log_probs[:, t] scores position t (t < S - 1)
    zero = (weighted - weighted.detach()).to(log_probs.dtype)  # value 0, gradient of the weighted MTP terms
    output.log_probs = log_probs + zero
    given = kwargs.get("num_items_in_batch")
    count = output.label_mask.sum().clamp(min=1) if given is None else given
    if getattr(output, "loss", None) is not None:  # the fused head's own loss, -sum(log_probs) / count
        output.loss = output.loss - zero.sum() / count
    output["mtp_loss"] = (nll.sum() / (len(hidden) * count)).detach()
    return output


def register_fused_head_mtp(model: nn.Module) -> None:
    """Make a trainer's fused LM head (TRL's ``fused_lm_head=True`` calls) train ``model``'s MTP layer with the LM
    loss: forward hooks on the causal LM (see the comment above). The returned ``log_probs`` and ``loss`` keep their
    values; the output gains ``mtp_loss`` (detached, per depth mean as :func:`mtp_loss` with the same count)."""
    model.register_forward_pre_hook(_fused_head_start, with_kwargs=True)
    model.register_forward_hook(_fused_head_end, with_kwargs=True, always_call=True)
