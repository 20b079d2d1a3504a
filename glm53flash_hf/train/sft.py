"""Supervised fine-tuning examples: a conversation rendered with the GLM-5.3 chat template, with its labels."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from transformers.feature_extraction_utils import BatchFeature
from transformers.utils.chat_template_utils import render_jinja_template

IGNORE_INDEX = -100

BEGIN_OF_IMAGE = "<|begin_of_image|>"
END_OF_IMAGE = "<|end_of_image|>"


def build_sft_example(
    processor,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    images: list | None = None,
    videos: list | None = None,
    video_metadata: list | None = None,
    enable_thinking: bool = True,
    reasoning_effort: str = "max",
    clear_thinking: bool = False,
    max_length: int | None = None,
    sample_id: Any = None,
    return_tensors: str | None = "pt",
    **processor_kwargs,
) -> BatchFeature:
    """One SFT example from a conversation: model inputs and ``labels`` (-100 outside the trained spans).

    Trained: the chat template's ``{% generation %}`` spans (reasoning and ``</think>``, content, tool calls, the final
    ``<|endoftext|>``, the ``<|user|>`` / ``<|observation|>`` after a trained turn), except assistant turns with
    ``"loss": False`` or whose reasoning the template clears.

    ``messages``: chat messages (``role``, ``content`` str or ``{"type": "text"|"image"|"video", ...}`` blocks;
    assistant ``reasoning_content``, ``tool_calls``, ``loss``); ``images`` / ``videos`` default to the content blocks'
    media; ``max_length`` truncates (media wholly after the cut are dropped); ``sample_id`` names the sample in
    messages; ``processor_kwargs`` go to the image/video processors.

    Returns:
        ``BatchFeature`` with 1-D ``input_ids``, ``attention_mask``, ``labels``, ``mm_token_type_ids`` and the kept
        media's ``pixel_values`` / ``image_grid_thw`` / ``pixel_values_videos`` / ``video_grid_thw``.

    Raises:
        ValueError: a message without a role; no assistant turn; ``max_length`` cutting a visual span; a visual
            placeholder in a trained span; marker/media count mismatches.

    Warns:
        UserWarning: no token is trained.
    """
    name = f"sample {sample_id!r}" if sample_id is not None else "sample"
    # transformers' normalisation (message objects to dicts, None values dropped: content=None is no content)
    conversations, _ = processor._normalize_conversations(messages) if messages else ([[]], False)
    roles = [m.get("role") for m in conversations[0]]
    for i, (message, role) in enumerate(zip(conversations[0], roles)):
        if role is None:
            raise ValueError(
                f"{name}: message {i} has no role (keys: {', '.join(message)}); expected role system, user, "
                "assistant or tool"
            )
    if "assistant" not in roles:
        raise ValueError(
            f"{name}: the conversation has no assistant turn (roles {roles}), so no token would be trained; an "
            "SFT example needs at least one assistant message"
        )
    if images is None and videos is None:
        batch_images, batch_videos, _, _ = processor._multimodal_inputs_from_conversations(conversations, {}, False)
        images, videos = batch_images[0], batch_videos[0]
    rendered, generation = render_jinja_template(
        conversations=conversations, tools=tools, chat_template=processor._resolve_chat_template(None),
        return_assistant_tokens_mask=True, add_generation_prompt=False, enable_thinking=enable_thinking,
        reasoning_effort=reasoning_effort, clear_thinking=clear_thinking, end_of_text_after_assistant=True,
        **processor.tokenizer.special_tokens_map,
    )  # fmt: skip
    if video_metadata is not None:
        processor_kwargs["video_metadata"] = video_metadata
    out = processor(
        text=[rendered[0]], images=_none_if_empty(images), videos=_none_if_empty(videos), add_special_tokens=False,
        return_offsets_mapping=True, return_text_replacement_offsets=True, **processor_kwargs,
    )  # fmt: skip
    out = processor._adjust_assistant_masks_indices(out, generation)
    input_ids = list(out["input_ids"][0])
    trained = list(out.pop("assistant_masks")[0])
    types = list(out["mm_token_type_ids"][0])
    bad = [i for i, (m, t) in enumerate(zip(trained, types)) if m and t]
    if bad:
        raise ValueError(
            f"{name}: {len(bad)} visual placeholder tokens (first at token {bad[0]}) lie inside a trained "
            "assistant span; images/videos in trained assistant turns are not supported"
        )
    labels = [tid if m else IGNORE_INDEX for tid, m in zip(input_ids, trained)]

    data = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    if max_length is not None and len(input_ids) > max_length:
        keep_images, keep_videos = _check_cut(processor, input_ids, max_length, name)
        input_ids, labels, types = input_ids[:max_length], labels[:max_length], types[:max_length]
        data = _keep_media(data, keep_images, keep_videos)
    if all(label == IGNORE_INDEX for label in labels):
        warnings.warn(
            f"{name}: no trained token (every label is {IGNORE_INDEX}: the assistant turns have loss=False, "
            f"their reasoning is cleared, or max_length={max_length} cuts them off)", UserWarning, stacklevel=2,
        )  # fmt: skip
    data.update(input_ids=input_ids, attention_mask=[1] * len(input_ids), labels=labels, mm_token_type_ids=types)
    return BatchFeature(data=data, tensor_type=return_tensors)


def visual_spans(processor, input_ids) -> list[tuple[str, int, int]]:
    """``(kind, first, last)`` inclusive positions of each image / video span in one id row (unclosed: to the end)."""
    ids = [int(i) for i in input_ids]
    opens = {processor.token_ids[BEGIN_OF_IMAGE]: "image", processor.video_start_id: "video"}
    closes = {"image": processor.token_ids[END_OF_IMAGE], "video": processor.video_end_id}
    spans, open_kind, start = [], None, 0
    for pos, tid in enumerate(ids):
        if open_kind is None and tid in opens:
            open_kind, start = opens[tid], pos
        elif open_kind is not None and tid == closes[open_kind]:
            spans.append((open_kind, start, pos))
            open_kind = None
    if open_kind is not None:
        spans.append((open_kind, start, len(ids) - 1))
    return spans


def _none_if_empty(media):
    """``None`` for ``None`` or an empty list/tuple, else ``media`` (arrays are never truth-tested)."""
    if media is None or (isinstance(media, (list, tuple)) and len(media) == 0):
        return None
    return media


def _check_cut(processor, input_ids, max_length: int, name: str) -> tuple[int, int]:
    """Number of images and videos wholly before a cut at ``max_length``; raises if the cut splits a span."""
    keep_images = keep_videos = 0
    for kind, first, last in visual_spans(processor, input_ids):
        if first < max_length <= last:
            raise ValueError(
                f"{name}: truncating {len(input_ids)} tokens to max_length={max_length} cuts through the {kind} "
                f"span at tokens {first}..{last}; the placeholder count would no longer match the {kind} "
                "features. Raise max_length or drop the sample."
            )
        if last < max_length:
            keep_images += kind == "image"
            keep_videos += kind == "video"
    return keep_images, keep_videos


def _keep_media(data: dict, keep_images: int, keep_videos: int) -> dict:
    """Keep the first ``keep_images`` images / ``keep_videos`` videos (grid rows and their pixel rows)."""
    data = dict(data)
    for pixels_key, grid_key, keep in (
        ("pixel_values", "image_grid_thw", keep_images),
        ("pixel_values_videos", "video_grid_thw", keep_videos),
    ):
        if grid_key not in data:
            continue
        if keep == 0:
            data.pop(grid_key)
            data.pop(pixels_key, None)
        else:
            rows = int(np.prod(np.asarray(data[grid_key])[:keep], axis=-1).sum())
            data[grid_key] = data[grid_key][:keep]
            data[pixels_key] = data[pixels_key][:rows]
    return data


__all__ = ["IGNORE_INDEX", "build_sft_example", "visual_spans"]
