"""Packing collator for supervised fine-tuning: several samples per row, documents kept apart.

Conventions of transformers' :class:`~transformers.DataCollatorWithFlattening` (``data/data_collator.py``), which
it subclasses and calls once per row: ``labels`` ``[-100] + labels[1:]`` per sample, ``position_ids`` restarting
at 0, ``cu_seq_lens_q`` / ``cu_seq_lens_k`` over the row-major flattened tokens, no ``attention_mask``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DataCollatorWithFlattening

from .sft import IGNORE_INDEX

_VISUAL = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))


def _as_list(value, name: str, index: int) -> list[int]:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dim() == 2 and value.shape[0] == 1:
            value = value[0]
        if value.dim() != 1:
            raise ValueError(
                f"sample {index}: {name} must be 1-D (one sample, unpadded); got shape {tuple(value.shape)}"
            )
        return value.tolist()
    if hasattr(value, "tolist"):  # numpy
        value = value.tolist()
    value = list(value)
    if value and isinstance(value[0], (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"sample {index}: {name} must be 1-D (one sample, unpadded); got {len(value)} rows")
        value = list(value[0])
    return [int(v) for v in value]


@dataclass
class _Sample:
    index: int
    input_ids: list[int]
    labels: list[int]
    mm_token_type_ids: list[int]
    visual: dict[str, torch.Tensor]


class Glm53FlashPackingCollator(DataCollatorWithFlattening):
    """Pack SFT samples (:func:`glm53flash_hf.train.sft.build_sft_example`) into rows of at most ``max_length`` tokens.

    ``max_length=None``: one row, no padding. Padding (``pad_token_id``, labels -100) is a segment of its own; rows are
    padded to ``pad_to_multiple_of`` (capped at ``max_length``) or, with ``pad_to_max_length``, to ``max_length``.
    ``separator_id`` labels the first token of every sample; ``return_seq_idx`` adds the segment index ``seq_idx``.

    Call ``collator(features)``: 1-D ``input_ids``, optional ``labels`` / ``mm_token_type_ids`` of the same length, an
    all-ones ``attention_mask``, optional ``pixel_values`` + ``image_grid_thw`` / ``pixel_values_videos`` +
    ``video_grid_thw``; empty samples are dropped.

    Returns:
        dict of long ``[R, L]`` ``input_ids``, ``labels``, ``position_ids``, ``mm_token_type_ids``; int32
        ``cu_seq_lens_q`` / ``cu_seq_lens_k`` ``[N + 1]``; int ``max_length_q`` / ``max_length_k``; optional
        ``seq_idx``; the visual tensors in the order of their placeholders.

    Warns:
        UserWarning: naming the samples without a trained label.

    Raises:
        ValueError: a sample longer than ``max_length``; lengths or pixels/grids that do not match; an
            ``attention_mask`` with zeros; every sample empty; ``return_tensors`` other than ``"pt"``.
    """

    def __init__(
        self,
        max_length: int | None = None,
        pad_token_id: int = 0,
        pad_to_multiple_of: int | None = None,
        pad_to_max_length: bool = False,
        return_seq_idx: bool = False,
        separator_id: int = IGNORE_INDEX,
        **kwargs,
    ):
        super().__init__(
            return_position_ids=True, separator_id=separator_id, return_flash_attn_kwargs=True, return_seq_idx=False,
            position_ids_start=0, return_tensors="pt", **kwargs,
        )  # fmt: skip
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be a positive int or None; got {max_length}")
        if pad_to_max_length and max_length is None:
            raise ValueError("pad_to_max_length=True needs max_length")
        self.max_length = max_length
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_to_max_length = pad_to_max_length
        self.return_seq_idx_packed = return_seq_idx

    def plan(self, lengths: list[int]) -> list[list[int]]:
        """Rows as lists of sample indices (first fit in sample order; zero lengths skipped).

        Raises:
            ValueError: a length over ``max_length`` (index and lengths named).
        """
        if self.max_length is None:
            return [[i for i, n in enumerate(lengths) if n > 0]]
        rows: list[list[int]] = []
        room: list[int] = []
        for i, n in enumerate(lengths):
            if n == 0:
                continue
            if n > self.max_length:
                raise ValueError(
                    f"sample {i} has {n} tokens, more than the collator's max_length={self.max_length}; "
                    "truncate it in the processor (build_sft_example(max_length=...)) or raise max_length"
                )
            for r, free in enumerate(room):
                if n <= free:
                    rows[r].append(i)
                    room[r] -= n
                    break
            else:
                rows.append([i])
                room.append(self.max_length - n)
        return rows

    @staticmethod
    def _parse(feature: Any, index: int) -> _Sample:
        ids = _as_list(feature["input_ids"], "input_ids", index)
        labels = _as_list(feature["labels"], "labels", index) if feature.get("labels") is not None else list(ids)
        types = feature.get("mm_token_type_ids")
        types = _as_list(types, "mm_token_type_ids", index) if types is not None else [0] * len(ids)
        for name, seq in (("labels", labels), ("mm_token_type_ids", types)):
            if len(seq) != len(ids):
                raise ValueError(f"sample {index}: {name} has {len(seq)} entries but input_ids has {len(ids)}")
        mask = feature.get("attention_mask")
        if mask is not None and not all(_as_list(mask, "attention_mask", index)):
            raise ValueError(f"sample {index}: attention_mask has zeros; the packing collator takes unpadded samples")
        visual = {}
        for pixels_key, grid_key in _VISUAL:
            pixels, grid = feature.get(pixels_key), feature.get(grid_key)
            if (pixels is None) != (grid is None):
                raise ValueError(f"sample {index}: {pixels_key} and {grid_key} must be given together")
            if pixels is None:
                continue
            pixels = torch.as_tensor(pixels)
            grid = torch.as_tensor(grid, dtype=torch.long).reshape(-1, 3)
            rows = int(grid.prod(-1).sum())
            if pixels.dim() != 2 or pixels.shape[0] != rows:
                raise ValueError(
                    f"sample {index}: {pixels_key} has shape {tuple(pixels.shape)} but {grid_key} "
                    f"{grid.tolist()} needs {rows} rows"
                )
            visual[pixels_key], visual[grid_key] = pixels, grid
        return _Sample(index, ids, labels, types, visual)

    def __call__(self, features, return_tensors=None, separator_id=None):
        if return_tensors not in (None, "pt"):
            raise ValueError(
                f"Glm53FlashPackingCollator returns torch tensors only; got return_tensors={return_tensors!r}"
            )
        samples = [self._parse(f, i) for i, f in enumerate(features)]
        untrained = [s.index for s in samples if s.input_ids and all(x == IGNORE_INDEX for x in s.labels[1:])]
        if untrained:
            names = [features[i].get("name", i) if hasattr(features[i], "get") else i for i in untrained]
            warnings.warn(
                f"Glm53FlashPackingCollator: {len(untrained)} of {len(samples)} samples have no trained label "
                f"(every label after the first is {IGNORE_INDEX}): {names[:10]}", UserWarning, stacklevel=2,
            )  # fmt: skip
        rows = self.plan([len(s.input_ids) for s in samples])
        if not rows or not rows[0]:
            raise ValueError("Glm53FlashPackingCollator received a batch where every example is empty.")

        # One call of DataCollatorWithFlattening per row: separator labels, restarting positions, cu_seq_lens.
        flat_rows = []
        for row in rows:
            row_features = [{"input_ids": samples[i].input_ids, "labels": samples[i].labels} for i in row]
            flat = super().__call__(row_features, return_tensors="pt", separator_id=separator_id)
            types = [t for i in row for t in samples[i].mm_token_type_ids]
            flat["mm_token_type_ids"] = torch.tensor([types], dtype=torch.long)
            flat_rows.append(flat)

        width = max(int(f["input_ids"].shape[1]) for f in flat_rows)
        if self.pad_to_max_length:
            width = self.max_length
        elif self.pad_to_multiple_of:
            width = math.ceil(width / self.pad_to_multiple_of) * self.pad_to_multiple_of
            width = min(width, self.max_length or width)  # the longest row has at most max_length tokens

        out = {k: [] for k in ("input_ids", "labels", "position_ids", "mm_token_type_ids")}
        cu, max_seg, seg_idx_rows, seg = [0], 0, [], 0
        for flat in flat_rows:
            pad = width - int(flat["input_ids"].shape[1])
            fills = {"input_ids": self.pad_token_id, "labels": IGNORE_INDEX, "mm_token_type_ids": 0}
            for key, fill in fills.items():
                out[key].append(torch.cat([flat[key][0], torch.full((pad,), fill, dtype=torch.long)]))
            out["position_ids"].append(torch.cat([flat["position_ids"][0], torch.arange(pad, dtype=torch.long)]))
            lengths = flat["cu_seq_lens_q"].diff().tolist() + ([pad] if pad else [])
            ids = []
            for length in lengths:
                cu.append(cu[-1] + length)
                max_seg = max(max_seg, length)
                ids += [seg] * length
                seg += 1
            seg_idx_rows.append(ids)
        batch = {k: torch.stack(v) for k, v in out.items()}
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor(cu, dtype=torch.int32)
        batch["max_length_q"] = batch["max_length_k"] = max_seg
        if self.return_seq_idx_packed:
            batch["seq_idx"] = torch.tensor(seg_idx_rows, dtype=torch.int32)

        order = [samples[i] for row in rows for i in row]
        for pixels_key, grid_key in _VISUAL:
            present = [s.visual for s in order if pixels_key in s.visual]
            if present:
                batch[pixels_key] = torch.cat([v[pixels_key] for v in present])
                batch[grid_key] = torch.cat([v[grid_key] for v in present])
        return batch


__all__ = ["Glm53FlashPackingCollator"]
