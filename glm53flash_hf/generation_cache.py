"""Generation-cache plumbing around transformers' cache classes: per KDA layer a conv state ``[B, 3*H*K, W]`` and
an fp32 recurrent state ``[B, H, K, V]``, per DSA layer the MLA latent ``[B, 1, S, kv_lora_rank]`` and the fp32 KPool
indexer state ``[B, S, 2 * Dk]``. Cached rows must be ``[left padding][one document]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicCache,
    DynamicIndexedLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

__all__ = ["CacheContext", "Glm53FlashIndexedCacheLayer", "Glm53FlashKDACacheLayer", "MtpDraftCache",
           "UnsupportedCacheError", "build_cache_context", "cache_seq_length", "check_cache",
           "check_cache_continuation", "check_cache_layers", "check_croppable", "check_left_padding",
           "make_croppable"]

_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "seq_idx")


class UnsupportedCacheError(TypeError, NotImplementedError):
    """A ``cache`` argument that is not a transformers :class:`~transformers.cache_utils.Cache`."""


def check_cache(cache, who: str) -> None:
    """Raise :class:`UnsupportedCacheError` unless ``cache`` is a transformers ``Cache``."""
    if not isinstance(cache, Cache):
        raise UnsupportedCacheError(
            f"{who}: cache must be a transformers Cache (DynamicCache(config=...) or StaticCache); "
            f"got {type(cache).__name__}"
        )


def check_cache_layers(cache: Cache, config, who: str) -> None:
    """Raise ``ValueError`` naming the layer count or the first layer of ``cache`` whose kind does not fit
    ``config.layer_types``."""
    kinds = list(config.layer_types[: config.num_hidden_layers])
    fix = "build the cache for this model: DynamicCache(config=model.config) or StaticCache(config=model.config, ...)"
    if len(cache.layers) != len(kinds):
        raise ValueError(
            f"{who}: the cache ({type(cache).__name__}) has {len(cache.layers)} layers but the model has "
            f"num_hidden_layers={len(kinds)}; {fix}"
        )
    for i, (layer, kind) in enumerate(zip(cache.layers, kinds)):
        linear = isinstance(layer, LinearAttentionCacheLayerMixin)
        fits = linear if kind == "linear_attention" else not linear and hasattr(layer, "update_indexer")
        if not fits:
            raise ValueError(
                f"{who}: cache layer {i} is a {type(layer).__name__} but model layer {i} is {kind!r}; {fix}"
            )


def check_left_padding(valid: torch.Tensor, name: str = "attention_mask") -> None:
    """Raise ``ValueError`` naming the first row of the bool ``[B, L]`` ``valid`` that is not ``[padding][one or more
    real tokens]``."""
    empty = ~valid.any(dim=1)
    if bool(empty.any()):
        row = int(empty.nonzero()[0, 0])
        raise ValueError(
            f"{name} row {row} is all zeros: the row has no real token to generate from; give every row at least "
            "one real token (1 in the mask) or leave the row out"
        )
    after = valid[:, :-1] & ~valid[:, 1:]
    if bool(after.any()):
        row, col = (int(x) for x in after.nonzero()[0])
        raise ValueError(
            f"{name} row {row} has padding (0) after a real token (position {col + 1}): a generation cache and "
            "generate support left padding only (each row: padding, then one document); a 0 inside a row is not "
            "skipped as a masked key. Left-pad the batch (tokenizer padding_side='left'); for a forward over such "
            "a batch without generation, call the model with use_cache=False"
        )


def check_cache_continuation(cache, input_len: int, mask_len: int | None) -> None:
    """Raise ``ValueError`` unless the mask (``mask_len``, or without one ``input_len``) is longer than the tokens a
    filled ``cache`` holds."""
    past = cache_seq_length(cache)
    width = input_len if mask_len is None else mask_len
    if past > 0 and width <= past:
        raise ValueError(
            f"the cache passed to generate already holds {past} tokens but the inputs cover {width} "
            f"(input length {input_len}, attention_mask width {mask_len}); to continue from the cache pass the "
            "whole sequence (the cached tokens, then the new ones) as input_ids, as transformers' generate "
            "expects; for a new prompt pass a fresh cache or none"
        )


@dataclass
class CacheContext:
    """What the cached layers of one forward share: ``past`` tokens (an int, or a long 0-d tensor when traced without
    a mask), ``seq_len`` ``S``, ``valid`` bool ``[B, S]``, ``first`` long ``[B]`` (each row's first real token, ``past +
    S`` if none), ``positions`` long ``[S]`` (the cache slots) and ``local_pos = positions - first`` ``[B, S]``."""

    past: int | torch.Tensor
    seq_len: int
    valid: torch.Tensor
    first: torch.Tensor
    positions: torch.Tensor
    local_pos: torch.Tensor


def _first_attention_layer(cache: Cache) -> CacheLayerMixin | None:
    """The layer whose length is the past length of ``cache``: an :class:`MtpDraftCache`'s own layer, else the first
    attention (``CacheLayerMixin``) layer, or ``None``. Not ``cache.get_seq_length()``: that reads layer 0, a KDA layer,
    in transformers >= 5.25 (earlier versions skip to the first attention layer)."""
    if isinstance(cache, MtpDraftCache):
        return cache.layers[cache.mtp_layer_idx]
    return next((layer for layer in cache.layers if isinstance(layer, CacheLayerMixin)), None)


def cache_seq_length(cache: Cache) -> int:
    """Tokens already stored in ``cache`` (first attention layer; 0 without one)."""
    layer = _first_attention_layer(cache)
    return 0 if layer is None else int(layer.get_seq_length())


def build_cache_context(
    cache: Cache,
    batch_size: int,
    seq_len: int,
    device: torch.device,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> CacheContext:
    """The :class:`CacheContext` of a cached forward over ``[B, S]`` new tokens (``cache`` is read, not written).

    ``attention_mask``: optional 2-D ``[B, past + S]``; ``position_ids``: optional ``[B, S]`` or ``[B, past + S]``.

    Raises:
        ValueError: packing kwargs or a position restart; a static cache shorter than ``past + S``; a mask not 2-D or
            not covering ``past + S``; padding after a real token or a row without one (eager multi-token or first
            calls only).
    """
    for key in _PACKING_KWARGS:
        if kwargs.get(key) is not None:
            raise ValueError(
                f"a generation cache cannot be used with packed documents ({key} given): call the model with "
                "use_cache=False for packed batches, or generate one document per row (left padding)"
            )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be a 2-D [batch, past + seq] padding mask with a cache; got shape "
            f"{tuple(attention_mask.shape)}"
        )
    if not torch.compiler.is_compiling():
        past = cache_seq_length(cache)
    elif attention_mask is not None:  # a traced graph reads no tensor value: past from the mask's width
        past = attention_mask.shape[1] - seq_len
    else:  # or, without padding, the cache's own length tensor (a long 0-d tensor)
        layer = _first_attention_layer(cache)
        past = layer.get_seq_length() if layer is not None else 0
        past = past.clone() if isinstance(past, torch.Tensor) else torch.tensor(past, device=device)
        past = past.to(device=device, dtype=torch.long)
        positions = torch.arange(seq_len, device=device) + past
        valid = torch.ones(batch_size, seq_len, dtype=torch.bool, device=device)
        first = torch.zeros(batch_size, dtype=torch.long, device=device)
        return CacheContext(past, seq_len, valid, first, positions, positions.unsqueeze(0).expand(batch_size, seq_len))
    if attention_mask is not None:
        if past == 0 and _first_attention_layer(cache) is None:
            past = attention_mask.shape[1] - seq_len  # all-KDA model: the mask tells the past length
        if attention_mask.shape != (batch_size, past + seq_len):
            raise ValueError(
                f"attention_mask must cover the cached and the new tokens, [B={batch_size}, past + S = "
                f"{past} + {seq_len}]; got shape {tuple(attention_mask.shape)}"
            )
        valid_full = attention_mask.to(device).bool()
    else:
        valid_full = torch.ones(batch_size, past + seq_len, dtype=torch.bool, device=device)
    total = past + seq_len
    capacity = cache.get_max_length()  # -1: grows (DynamicCache)
    if not torch.compiler.is_compiling() and 0 < capacity < total:
        raise ValueError(
            f"the {type(cache).__name__} holds {capacity} tokens (max_cache_len) but this call needs {total} "
            f"({past} cached + {seq_len} new); make the cache with max_cache_len >= {total}"
        )
    if (seq_len > 1 or past == 0) and not torch.compiler.is_compiling():  # checks that read the data: eager only
        check_left_padding(valid_full)
        if position_ids is not None:
            pos = position_ids.to(device)
            pos = pos.unsqueeze(0) if pos.dim() == 1 else pos
            pos = pos[..., -seq_len:].expand(batch_size, seq_len)
            cur = valid_full[:, past:]
            restart = (pos[:, 1:] != pos[:, :-1] + 1) & cur[:, 1:] & cur[:, :-1]
            if bool(restart.any()):
                raise ValueError(
                    "position_ids restart inside the call (packed documents); a generation cache supports one "
                    "document per row. Use use_cache=False for packed batches."
                )
    first = torch.where(
        valid_full.any(dim=1),
        valid_full.to(torch.int8).argmax(dim=1),
        torch.full((batch_size,), total, dtype=torch.long, device=device),
    ).long()
    positions = torch.arange(past, total, device=device)
    return CacheContext(past, seq_len, valid_full[:, past:], first, positions, positions.unsqueeze(0) - first[:, None])


class Glm53FlashKDACacheLayer(LinearAttentionLayer):
    """transformers' ``LinearAttentionLayer`` that ``crop(-n)`` rolls back exactly while past recording is on: each
    recorded call adds a ``history`` entry (per-token states, or a replay of a first call), and ``crop(-n)`` restores
    the state ``n`` tokens back among those recorded since the last crop (docs/design.md, "Generation cache and
    MTP")."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.history: dict[int, list] = {i: [] for i in range(self.number_of_states)}
        self.history_start: dict[int, torch.Tensor | None] = dict.fromkeys(range(self.number_of_states))

    @property
    def is_croppable(self) -> bool:
        return self.record_past and any(self.is_conv_states_initialized.values())

    @property
    def is_compileable(self) -> bool:
        return not self.record_past

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """The base class's update (``conv_states``: the call's conv inputs ``[B, D, S]``); a first call while
        recording keeps ``W`` zeros before its inputs, so that a crop into it still leaves a ``W``-wide window."""
        first = not self.has_previous_state[state_idx]
        out = super().update_conv_state(conv_states, state_idx, **kwargs)
        if first and self.record_past:
            self.conv_states[state_idx] = F.pad(self.conv_states[state_idx], (self.conv_kernel_size[state_idx], 0))
        return out

    def update_recurrent_state(
        self,
        recurrent_states: torch.Tensor,
        state_idx: int = 0,
        per_token_states: torch.Tensor | None = None,
        replay: tuple | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Store the fp32 ``[B, H, K, V]`` final state and, while recording, the call's history: ``per_token_states``
        ``[S, B, H, K, V]``, or ``replay = (S, fn)`` for a call from the zero state, ``fn(j)`` the state after its
        first ``j`` tokens."""
        if self.record_past:
            if not self.history[state_idx]:  # the first call since the last crop: keep the state it starts from
                initialized = self.is_recurrent_states_initialized[state_idx]
                self.history_start[state_idx] = self.recurrent_states[state_idx].clone() if initialized else None
            if per_token_states is not None:
                entry = (per_token_states.shape[0], per_token_states, None, per_token_states[-1])
            elif replay is not None:
                entry = (replay[0], None, replay[1], recurrent_states.clone())
            else:
                entry = (None, None, None, recurrent_states.clone())
            self.history[state_idx].append(entry)
        if not self.is_recurrent_states_initialized[state_idx]:
            self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
        self.recurrent_states[state_idx].copy_(recurrent_states)  # in place: the static address stays
        return self.recurrent_states[state_idx]

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` recorded tokens (``crop(0)``: shrink the conv window to ``W``).
        ``RuntimeError`` when not recording, for a positive argument, or beyond what was recorded since the last crop
        (the layer then unchanged).
        """
        if not self.record_past:
            raise RuntimeError(
                f"Glm53FlashKDACacheLayer.crop({tokens_to_remove}): the layer does not record its past; call "
                "activate_past_recording() before the calls to crop"
            )
        if tokens_to_remove > 0:
            raise RuntimeError(
                f"Glm53FlashKDACacheLayer.crop({tokens_to_remove}): linear attention layers are cropped by a negative "
                "count of tokens to remove"
            )
        n = abs(tokens_to_remove)
        restored = {i: self._restored_state(i, n, tokens_to_remove) for i in range(self.number_of_states)}
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                width = self.conv_kernel_size[i]
                conv = self.conv_states[i]
                self.conv_states[i] = conv[..., -width:] if n == 0 else conv[..., -n - width : conv.shape[-1] - n]
            self.history[i], self.history_start[i] = [], None
            if n and self.is_recurrent_states_initialized[i]:
                if restored[i] is None:
                    self.recurrent_states[i].zero_()
                else:
                    self.recurrent_states[i].copy_(restored[i])
        count = getattr(self, "cumulative_length_linear", None)  # the tokens seen (transformers >= 5.25)
        if count is not None:
            count.sub_(n)

    def _restored_state(self, i: int, n: int, tokens_to_remove: int) -> torch.Tensor | None:
        """The recurrent state ``n`` tokens back (``None``: the zero state, or nothing to restore)."""
        if n == 0 or not self.is_recurrent_states_initialized[i]:
            return None
        history, start = self.history[i], self.history_start[i]
        # the restorable tail: the calls after the last one recorded without per-token states or replay
        first = max((k + 1 for k, entry in enumerate(history) if entry[0] is None), default=0)
        before = history[first - 1][3] if first else start
        tail = history[first:]
        restorable = sum(entry[0] for entry in tail)
        if n > restorable:
            raise RuntimeError(
                f"Glm53FlashKDACacheLayer.crop({tokens_to_remove}): the calls recorded since the last crop hold "
                f"{restorable} restorable tokens; can remove at most {restorable} tokens"
            )
        keep, offset = restorable - n, 0
        for length, states, replay, final in tail:
            if keep < offset + length:
                j = keep - offset
                return before if j == 0 else states[j - 1] if states is not None else replay(j)
            offset, before = offset + length, final
        return None  # unreachable: keep < restorable

    def reset(self) -> None:
        super().reset()
        self.history = {i: [] for i in range(self.number_of_states)}
        self.history_start = dict.fromkeys(range(self.number_of_states))


class Glm53FlashIndexedCacheLayer(DynamicIndexedLayer):
    """transformers' ``DynamicIndexedLayer`` whose ``crop`` also restores the KPool pool keys of pools it makes
    incomplete again."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.record_past = False
        self.pool_key_undo: list[tuple] = []

    def activate_past_recording(self, **kwargs) -> None:
        self.record_past = True

    def record_pool_keys(
        self, slots: torch.Tensor, old_keys: torch.Tensor, pool_last: torch.Tensor, written: torch.Tensor
    ) -> None:
        """Remember one call's pool-key writes until the next crop: ``slots``, ``pool_last`` (each pool's last token)
        long ``[B, c]``, the replaced ``old_keys`` ``[B, c, Dk]``, ``written`` bool ``[B, c]``."""
        if self.record_past:
            self.pool_key_undo.append((slots, old_keys, pool_last, written))

    def crop(self, tokens_to_remove: int) -> None:
        undo, self.pool_key_undo = self.pool_key_undo, []
        super().crop(tokens_to_remove)
        if tokens_to_remove == 0 or not self.is_indexer_initialized:
            return
        length = self.indexer_keys.shape[1]
        for slots, old_keys, pool_last, written in reversed(undo):
            restore = written & (pool_last >= length) & (slots < length)
            if bool(restore.any()):
                head_dim = old_keys.shape[-1]
                self.indexer_keys = self.indexer_keys.clone()
                cols = self.indexer_keys[..., :head_dim]
                where = slots.clamp(max=length - 1)[..., None].expand(-1, -1, head_dim)
                cols.scatter_(1, where, torch.where(restore[..., None], old_keys, cols.gather(1, where)))

    def reset(self) -> None:
        super().reset()
        self.pool_key_undo = []


def make_croppable(cache: Cache) -> Cache:
    """Swap, in place, a ``DynamicCache``'s empty KDA / DSA layers for the croppable ones above; returns ``cache``
    (other caches and filled layers unchanged)."""
    if not isinstance(cache, DynamicCache):
        return cache
    for i, layer in enumerate(cache.layers):
        if type(layer) is LinearAttentionLayer and not any(layer.is_conv_states_initialized.values()):
            new = Glm53FlashKDACacheLayer(number_of_states=layer.number_of_states)
        elif type(layer) is DynamicIndexedLayer and not layer.is_initialized:
            new = Glm53FlashIndexedCacheLayer()
        else:
            continue
        new.record_past = getattr(layer, "record_past", False)  # an assistant's cache records from its creation
        cache.layers[i] = new
    return cache


def check_croppable(cache: Cache) -> None:
    """Raise ``ValueError`` unless every KDA layer of ``cache`` is a :class:`Glm53FlashKDACacheLayer` (after
    :func:`make_croppable`): assisted decoding crops into verification calls, which only those layers roll back."""
    plain = [i for i, layer in enumerate(cache.layers)
             if isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, Glm53FlashKDACacheLayer)]
    if plain:
        raise ValueError(
            "assisted decoding (assistant_model, prompt_lookup_num_tokens, use_mtp) needs a cache whose KDA layers "
            f"can be cropped; the {type(cache).__name__} given has {len(plain)} plain linear-attention layers (the "
            f"first: layer {plain[0]}); pass an empty DynamicCache(config=model.config) or no cache"
        )


class MtpDraftCache(Cache):
    """Cache of the MTP layer's DSA attention while drafting: one :class:`Glm53FlashIndexedCacheLayer` at
    ``layer_idx`` (lower indices unused); it receives verified positions only and is never cropped."""

    def __init__(self, layer_idx: int):
        super().__init__(layers=[DynamicIndexedLayer() for _ in range(layer_idx)] + [Glm53FlashIndexedCacheLayer()])
        self.mtp_layer_idx = layer_idx

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        return self.layers[self.mtp_layer_idx].get_seq_length()
