"""Checks of the models' public inputs: each error names the argument, its value and what was expected.

Shape and dtype checks always run; checks that read values run in eager calls only (:func:`.graph_ops.in_graph`).
"""

from __future__ import annotations

import torch

from .graph_ops import in_graph

__all__ = ["check_inputs_embeds", "check_input_ids", "check_integer_tensor", "check_labels", "check_loss_arguments",
           "check_not_meta", "check_vision_inputs"]


def check_integer_tensor(name: str, value) -> None:
    """``ValueError`` (``"<name> must be an integer tensor; got dtype ..."``) unless ``value`` is ``None`` or an integer
    tensor."""
    if value is None:
        return
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be an integer torch.Tensor; got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor; got dtype {value.dtype}")


def check_input_ids(input_ids: torch.Tensor, vocab_size: int, name: str = "input_ids") -> None:
    """``ValueError`` unless ``input_ids`` is an integer ``[batch, seq]`` tensor, ``batch, seq >= 1``, with ids in
    ``[0, vocab_size)`` (the message names the first bad position, the value and the range)."""
    check_integer_tensor(name, input_ids)
    if input_ids.dim() != 2:
        raise ValueError(f"{name} must be [batch, seq]; got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"{name} must hold at least one row and one token; got shape {tuple(input_ids.shape)}")
    if in_graph():
        return
    lo, hi = torch.aminmax(input_ids)
    if int(lo) < 0 or int(hi) >= vocab_size:
        bad = (input_ids < 0) | (input_ids >= vocab_size)
        where = torch.nonzero(bad)[0].tolist()
        raise ValueError(
            f"{name} holds ids outside [0, vocab_size={vocab_size}): {int(input_ids[tuple(where)])} at {where} "
            f"({int(bad.sum())} such ids; min {int(lo)}, max {int(hi)})"
        )


def check_inputs_embeds(inputs_embeds: torch.Tensor, hidden_size: int) -> None:
    """``ValueError`` unless ``inputs_embeds`` is a floating ``[batch, seq, hidden_size]`` tensor, batch, seq >= 1."""
    if not isinstance(inputs_embeds, torch.Tensor) or not inputs_embeds.dtype.is_floating_point:
        what = inputs_embeds.dtype if isinstance(inputs_embeds, torch.Tensor) else type(inputs_embeds).__name__
        raise ValueError(f"inputs_embeds must be a floating-point tensor; got {what}")
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size:
        raise ValueError(
            f"inputs_embeds must be [batch, seq, hidden_size={hidden_size}]; got shape {tuple(inputs_embeds.shape)}"
        )
    if inputs_embeds.shape[0] == 0 or inputs_embeds.shape[1] == 0:
        raise ValueError(
            f"inputs_embeds must hold at least one row and one token; got shape {tuple(inputs_embeds.shape)}"
        )


def check_labels(labels, input_shape: tuple[int, int], vocab_size: int, ignore_index: int = -100,
                 name: str = "labels") -> None:
    """``ValueError`` unless ``labels`` is ``None`` or an integer tensor of ``input_shape`` holding ``ignore_index`` or
    ids in ``[0, vocab_size)`` (the message names the first bad position and value)."""
    if labels is None:
        return
    check_integer_tensor(name, labels)
    if tuple(labels.shape) != tuple(input_shape):
        raise ValueError(
            f"{name} must have the shape of the inputs [batch, seq] = {list(input_shape)}; got {tuple(labels.shape)}"
        )
    if in_graph():
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        where = torch.nonzero(bad)[0].tolist()
        raise ValueError(
            f"{name} holds {int(labels[tuple(where)])} at {where}; entries must be ids in [0, vocab_size="
            f"{vocab_size}) or ignore_index={ignore_index} ({int(bad.sum())} bad entries)"
        )


def check_not_meta(tensors: dict, module) -> None:
    """``ValueError`` naming the argument, its shape and the model's device for an input on the ``meta`` device
    (``tensors``: ``{name: value}``) given to a ``module`` whose weights hold data."""
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            param = next(module.parameters(), None)
            device = param.device if param is not None else torch.device("cpu")
            if device.type == "meta":
                return
            raise ValueError(
                f"{name} is on the meta device (shape {tuple(value.shape)}, no data) but the model's weights are on "
                f"{device}; pass a tensor that holds data, on {device}"
            )


def check_loss_arguments(num_items_in_batch, logits_to_keep) -> None:
    """``ValueError`` unless ``num_items_in_batch`` is ``None`` or a positive number or one-element tensor (its value
    read on CPU in eager calls only) and ``logits_to_keep`` an ``int >= 0`` or a tensor of positions."""
    if num_items_in_batch is not None:
        value = num_items_in_batch
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"num_items_in_batch must be a number or a one-element tensor; got shape {tuple(value.shape)}"
                )
            value = value.item() if value.device.type == "cpu" and not in_graph() else None
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"num_items_in_batch must be a positive number; got {type(value).__name__} {value!r}")
        if value is not None and not value > 0:
            raise ValueError(
                f"num_items_in_batch must be positive (the number of supervised tokens the summed loss is divided "
                f"by); got {value}"
            )
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, (int, torch.Tensor)):
        raise ValueError(
            f"logits_to_keep must be an int >= 0 (0 keeps every position) or a tensor of positions; got "
            f"{type(logits_to_keep).__name__} {logits_to_keep!r}"
        )
    if isinstance(logits_to_keep, int) and logits_to_keep < 0:
        raise ValueError(
            f"logits_to_keep must be >= 0 (the number of last positions whose logits are computed, 0 for every "
            f"position); got {logits_to_keep}"
        )


def patch_width(vision_config) -> int:
    """Width of one ``pixel_values`` row: ``in_channels * temporal_patch_size * patch_size**2``."""
    patch = vision_config.patch_size
    temporal = vision_config.temporal_patch_size
    patch = patch[0] * patch[1] if isinstance(patch, (list, tuple)) else patch * patch
    temporal = temporal[0] if isinstance(temporal, (list, tuple)) else temporal
    return vision_config.in_channels * temporal * patch


def check_vision_inputs(pixel_values: torch.Tensor, grid_thw, vision_config, pixels_name: str,
                        grid_name: str) -> None:
    """Check one modality's vision inputs: ``pixel_values`` floating ``[patches, C * T * P * P]`` (the tower's
    ``in_channels``, ``temporal_patch_size``, ``patch_size``), ``grid_thw`` integer ``[n, 3]`` of positive
    ``(t, h, w)``, ``h`` and ``w`` multiples of ``spatial_merge_size``, ``sum(t * h * w) == patches``; else
    ``ValueError`` naming the argument, its shape or values and the expected ones."""
    if grid_thw is None:
        raise ValueError(f"{pixels_name} needs {grid_name} (one [t, h, w] row per image or video)")
    if not isinstance(pixel_values, torch.Tensor) or not pixel_values.dtype.is_floating_point:
        what = pixel_values.dtype if isinstance(pixel_values, torch.Tensor) else type(pixel_values).__name__
        raise ValueError(f"{pixels_name} must be a floating-point tensor; got {what}")
    check_integer_tensor(grid_name, grid_thw)
    width = patch_width(vision_config)
    if pixel_values.dim() != 2 or pixel_values.shape[1] != width:
        raise ValueError(
            f"{pixels_name} must be [patches, in_channels*temporal_patch_size*patch_size**2 = {width}]; got shape "
            f"{tuple(pixel_values.shape)}"
        )
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or grid_thw.shape[0] == 0:
        raise ValueError(f"{grid_name} must be [n >= 1, 3] rows of (t, h, w); got shape {tuple(grid_thw.shape)}")
    if in_graph():
        return
    merge = vision_config.spatial_merge_size
    rows = grid_thw.tolist()
    for i, (t, h, w) in enumerate(rows):
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ValueError(
                f"{grid_name}[{i}] = {[t, h, w]}: t, h, w must be positive and h, w multiples of "
                f"spatial_merge_size={merge}"
            )
    patches = sum(t * h * w for t, h, w in rows)
    if patches != pixel_values.shape[0]:
        raise ValueError(
            f"{grid_name} {rows} describes {patches} patches (sum of t*h*w) but {pixels_name} has "
            f"{pixel_values.shape[0]} rows"
        )
