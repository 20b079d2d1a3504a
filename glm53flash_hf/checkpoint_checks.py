"""Checks of a checkpoint before, during and after loading and before saving: the safetensors headers
(:func:`inspect_checkpoint`: shards vs index, FP8 weight/scale pairs, dtypes), the config against the headers
(:func:`check_config_matches_checkpoint`, a table of per-field rules), the strict key report, finiteness and the dtypes
of a state dict. Each raises ``ValueError`` naming the file, key or config field; the ``allow_*`` options warn instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedConfig
from transformers.utils import logging

from .checkpoint_io import SAFETENSORS_INDEX, local_folder, open_shard, read_config_json, read_weight_map
from .configuration_glm53flash import Glm53FlashTextConfig

logger = logging.get_logger(__name__)

SCALE_SUFFIX = "_scale_inv"
# safetensors dtypes that never hold a weight of this model (every parameter and buffer is floating point).
NON_FLOAT_DTYPES = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")


def fp8_block_size(quantization_config: dict | None) -> tuple[int, int]:
    """``weight_block_size`` of an FP8 ``quantization_config`` (128x128 when absent)."""
    block = (quantization_config or {}).get("weight_block_size") or (128, 128)
    return int(block[0]), int(block[1])


@dataclass
class CheckpointInfo:
    """What :func:`inspect_checkpoint` read from a folder's headers: ``{name: shard}``, ``{name: safetensors dtype /
    shape}``, the ``quantization_config``, the FP8 tensor names and the sorted integer or bool tensor names."""

    folder: str
    weight_map: dict[str, str]
    dtypes: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, list[int]] = field(default_factory=dict)
    quantization_config: dict | None = None
    fp8_weights: set[str] = field(default_factory=set)
    non_float: list[str] = field(default_factory=list)


def check_fp8_pair(key: str, weight_shape, scale_shape, block: tuple[int, int], *, for_transformers: bool) -> None:
    """Check that ``<key>_scale_inv`` tiles ``<key>`` with ``block``-sized blocks (last blocks may be partial; with
    ``for_transformers`` not, where transformers' ``Fp8Dequantize`` would infer another block); ``ValueError`` naming
    the key, both shapes and the block size."""
    if len(weight_shape) != 2 or len(scale_shape) != 2:
        raise ValueError(
            f"{key}: FP8 weight {list(weight_shape)} with scale {key}{SCALE_SUFFIX} {list(scale_shape)}: "
            "block-scaled FP8 needs a 2-D weight and a 2-D scale grid"
        )
    expected = [math.ceil(weight_shape[0] / block[0]), math.ceil(weight_shape[1] / block[1])]
    if list(scale_shape) != expected:
        raise ValueError(
            f"{key}: scale {key}{SCALE_SUFFIX} has shape {list(scale_shape)}, expected {expected} for weight "
            f"{list(weight_shape)} with {block[0]}x{block[1]} blocks (quantization_config.weight_block_size)"
        )
    if for_transformers:
        for dim, (size, n, b) in enumerate(zip(weight_shape, scale_shape, block)):
            if n > 1 and size % b:
                raise ValueError(
                    f"{key}: weight {list(weight_shape)} has a partial {b}-block in dim {dim} and {n} blocks; "
                    "transformers' Fp8Dequantize infers the block as size // blocks and would dequantize it wrongly. "
                    "Dequantize the checkpoint first with `glm53flash-crop SRC OUT --layers <num_hidden_layers>` "
                    "(exact partial-block handling), then load OUT."
                )


def check_shard_holds_only_its_keys(folder: str, fname: str, present, weight_map: dict[str, str]) -> None:
    """``ValueError`` when shard ``fname`` of ``folder`` holds a tensor that ``model.safetensors.index.json`` does not
    assign to it: a copy of a tensor the index places in another shard (naming the key and both files), or a tensor
    the index does not list. transformers' loader reads every tensor of every shard the index names, so such a copy
    would be loaded (the last shard read wins) without being the tensor these checks read."""
    stray = sorted(k for k in present if weight_map.get(k, fname) != fname)
    if stray:
        key = stray[0]
        named = os.path.join(folder, weight_map[key])
        raise ValueError(
            f"{key!r} is stored twice: in {named} (the shard {SAFETENSORS_INDEX} names) and in "
            f"{os.path.join(folder, fname)}; transformers would read both and keep the copy of the shard it reads "
            f"last, not necessarily the one the index names ({len(stray)} such tensors in this shard: "
            f"{_listing(stray)}). Delete the extra copies, or correct the index"
        )
    unlisted = sorted(k for k in present if k not in weight_map)
    if unlisted:
        raise ValueError(
            f"{os.path.join(folder, fname)} holds {len(unlisted)} tensors that {SAFETENSORS_INDEX} does not list: "
            f"{_listing(unlisted)}; transformers would load them without the checks the index is read for. List "
            "them in the index, or delete them from the shard"
        )


def inspect_checkpoint(path, subfolder: str = "", *, for_transformers: bool = True) -> CheckpointInfo | None:
    """Read and check the safetensors headers of a local checkpoint folder (None for a Hub id or no safetensors):
    config and index valid, every shard holds its indexed tensors and no other, FP8 tensors and scales paired and
    tiling; ``ValueError`` naming the file or key."""
    folder = local_folder(path, subfolder)
    if folder is None:
        return None
    weight_map = read_weight_map(folder)
    if weight_map is None:
        return None
    config = read_config_json(folder) or {}
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    info = CheckpointInfo(folder=folder, weight_map=weight_map, quantization_config=qc)
    by_file: dict[str, list[str]] = {}
    for key, fname in weight_map.items():
        by_file.setdefault(fname, []).append(key)
    for fname in sorted(by_file):
        fpath = os.path.join(folder, fname)
        with open_shard(fpath) as f:
            present = set(f.keys())
            missing = [k for k in by_file[fname] if k not in present]
            if missing:
                raise ValueError(
                    f"{fpath}: the index assigns {len(missing)} tensors to this shard that it does not contain: "
                    f"{_listing(missing)}"
                )
            check_shard_holds_only_its_keys(folder, fname, present, weight_map)
            for key in by_file[fname]:
                sl = f.get_slice(key)
                info.dtypes[key] = sl.get_dtype()
                info.shapes[key] = list(sl.get_shape())
    fp8 = {k for k, d in info.dtypes.items() if d.startswith("F8")}  # F8_E4M3, F8_E5M2, ...
    scales = {k for k in weight_map if k.endswith(SCALE_SUFFIX)}
    orphans = sorted(s for s in scales if s[: -len(SCALE_SUFFIX)] not in weight_map)
    if orphans:
        raise ValueError(f"{len(orphans)} FP8 scale tensors have no weight in the checkpoint: {_listing(orphans)}")
    unscaled = sorted(k for k in fp8 if k + SCALE_SUFFIX not in weight_map)
    if unscaled:
        raise ValueError(
            f"{len(unscaled)} FP8 tensors have no {SCALE_SUFFIX} in any shard of {folder}: {_listing(unscaled)}"
        )
    scaled_not_fp8 = sorted(s[: -len(SCALE_SUFFIX)] for s in scales if s[: -len(SCALE_SUFFIX)] not in fp8)
    if scaled_not_fp8:
        raise ValueError(
            f"{len(scaled_not_fp8)} tensors have a {SCALE_SUFFIX} but are not FP8 "
            f"(dtype {info.dtypes[scaled_not_fp8[0]]}): {_listing(scaled_not_fp8)}"
        )
    if fp8:
        qc = info.quantization_config
        if not qc or qc.get("quant_method") != "fp8":
            raise ValueError(
                f"{folder} stores {len(fp8)} FP8 tensors (e.g. {min(fp8)}) but config.json has "
                f"quantization_config={qc!r}; block-scaled FP8 needs quant_method 'fp8'"
            )
        block = fp8_block_size(qc)
        for key in sorted(fp8):
            check_fp8_pair(
                key, info.shapes[key], info.shapes[key + SCALE_SUFFIX], block, for_transformers=for_transformers
            )
    info.fp8_weights = fp8
    info.non_float = sorted(k for k, d in info.dtypes.items() if d in NON_FLOAT_DTYPES)
    return info


def check_loaded_dtypes(ckpt: CheckpointInfo, unexpected_keys) -> None:
    """``ValueError`` naming the integer or bool tensors of ``ckpt`` loaded into the model (not ``unexpected_keys``)."""
    unexpected = set(unexpected_keys or ())
    loaded = [k for k in ckpt.non_float if k not in unexpected]
    if loaded:
        raise ValueError(
            f"{ckpt.folder}: {len(loaded)} tensors are integer or bool where the model's weights are floating "
            f"point; loading casts them silently: {_first_ten([f'{k} ({ckpt.dtypes[k]})' for k in loaded], ', ')}"
        )


# Text-checkpoint keys under any accepted prefix (TEXT_PREFIXES); group 1 is the key relative to the text model.
_TEXT_KEY = re.compile(
    r"^(?:model\.language_model\.|language_model\.|model\.)?((?:embed_tokens|norm)\.weight|layers\.\d+\..+)$"
)
_EXPERT_KEY = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
# The shape of each tensor sized by these text-config fields, as config expressions per dimension ("a*b": product;
# an integer literal: that size). Checked against the safetensors headers before the model is built.
_SHAPE_RULES = (
    (r"(?:embed_tokens|lm_head)\.weight", ("vocab_size", "hidden_size")),
    (r"norm\.weight|layers\.\d+\.(?:input_layernorm|post_attention_layernorm|enorm|hnorm|shared_head\.norm)\.weight",
     ("hidden_size",)),
    (r"layers\.\d+\.eh_proj\.weight", ("hidden_size", "2*hidden_size")),
    (r"layers\.\d+\.mlp\.(?:gate|up)_proj\.weight", ("intermediate_size", "hidden_size")),
    (r"layers\.\d+\.mlp\.down_proj\.weight", ("hidden_size", "intermediate_size")),
    (r"layers\.\d+\.mlp\.gate\.weight", ("n_routed_experts", "hidden_size")),
    (r"layers\.\d+\.mlp\.gate\.e_score_correction_bias", ("n_routed_experts",)),
    (r"layers\.\d+\.mlp\.experts\.\d+\.(?:gate|up)_proj\.weight", ("moe_intermediate_size", "hidden_size")),
    (r"layers\.\d+\.mlp\.experts\.\d+\.down_proj\.weight", ("hidden_size", "moe_intermediate_size")),
    (r"layers\.\d+\.mlp\.shared_experts\.(?:gate|up)_proj\.weight",
     ("moe_intermediate_size*n_shared_experts", "hidden_size")),
    (r"layers\.\d+\.mlp\.shared_experts\.down_proj\.weight", ("hidden_size", "moe_intermediate_size*n_shared_experts")),
)  # fmt: skip
_SIZE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
    "num_hidden_layers", "num_nextn_predict_layers",
)  # fmt: skip


def text_size_fields(config, folder: str) -> dict[str, int]:
    """The integer text-config size fields the model will be built with, from ``config`` or ``folder/config.json``
    (missing fields take :class:`Glm53FlashTextConfig`'s defaults)."""
    if isinstance(config, PreTrainedConfig):
        text = config.get_text_config(decoder=True)
        values = {name: getattr(text, name, None) for name in _SIZE_FIELDS}
    else:
        raw = read_config_json(folder) or {}
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
        defaults = {f.name: f.default for f in dataclasses.fields(Glm53FlashTextConfig)}
        values = {name: text.get(name, defaults.get(name)) for name in _SIZE_FIELDS}
    if values.get("num_nextn_predict_layers") is None:
        values["num_nextn_predict_layers"] = 0
    return {k: v for k, v in values.items() if isinstance(v, int) and not isinstance(v, bool)}


def _expected_dims(exprs, fields: dict[str, int]) -> list[tuple[int, str]] | None:
    """``[(size, "field=value")]`` per dimension; None when a field is unknown."""
    out = []
    for parts in (expr.split("*") for expr in exprs):
        if not all(p.isdigit() or p in fields for p in parts):
            return None
        size = math.prod(int(p) if p.isdigit() else fields[p] for p in parts)
        named = [p if p.isdigit() else f"{p}={fields[p]}" for p in parts]
        out.append((size, named[0] if len(named) == 1 else f"{' * '.join(named)} = {size}"))
    return out


# A finding of a config rule: the message and the loading option that turns its error into a warning.
_Finding = tuple[str, str]


def _layer_count_rule(ckpt: CheckpointInfo, stems: dict[str, str], fields: dict[str, int]) -> list[_Finding]:
    """``num_hidden_layers`` + ``num_nextn_predict_layers`` against the layers the checkpoint holds (a checkpoint
    without its MTP layers is accepted)."""
    layers = {int(s.split(".")[1]) for s in stems if s.startswith("layers.")}
    n_main, n_mtp = fields.get("num_hidden_layers"), fields.get("num_nextn_predict_layers", 0)
    if not layers or n_main is None:
        return []
    held, expected = max(layers) + 1, n_main + n_mtp
    if held == expected or (n_mtp and held == n_main):
        return []
    return [(
        f"The config does not match the checkpoint {ckpt.folder}: num_hidden_layers={n_main} and "
        f"num_nextn_predict_layers={n_mtp} mean layers 0..{expected - 1}, the checkpoint holds layers "
        f"0..{held - 1} ({held} layers)",
        "allow_missing_keys" if held < expected else "allow_unexpected_keys",
    )]  # fmt: skip


def _experts_rule(ckpt: CheckpointInfo, stems: dict[str, str], fields: dict[str, int]) -> list[_Finding]:
    """``n_routed_experts`` against the per-expert tensors of each MoE layer: none beyond it, all of them present."""
    n_experts = fields.get("n_routed_experts")
    experts: dict[int, dict[str, set[int]]] = {}
    for stem in stems:
        m = _EXPERT_KEY.match(stem)
        if m:
            experts.setdefault(int(m.group(1)), {}).setdefault(m.group(3), set()).add(int(m.group(2)))
    found: list[_Finding] = []
    for layer, by_proj in sorted(experts.items()) if n_experts is not None else ():
        held = set().union(*by_proj.values())
        if max(held) >= n_experts:
            found.append((f"The config does not match the checkpoint {ckpt.folder}: n_routed_experts={n_experts}, "
                          f"the checkpoint holds experts 0..{max(held)} in layer {layer}", "allow_unexpected_keys"))
        prefix = files = None  # read from the layer's keys only when one of them is missing
        for proj in ("gate", "up", "down"):
            absent = sorted(set(range(n_experts)) - by_proj.get(proj, set()))
            if absent:
                if prefix is None:
                    in_layer = sorted(s for s in stems if s.startswith(f"layers.{layer}.mlp.experts."))
                    prefix = stems[in_layer[0]][: stems[in_layer[0]].index(f"layers.{layer}.")]
                    files = ", ".join(sorted({ckpt.weight_map[stems[s]] for s in in_layer}))
                names = [f"{prefix}layers.{layer}.mlp.experts.{i}.{proj}_proj.weight" for i in absent]
                found.append((
                    f"{len(names)} per-expert tensors missing from the checkpoint {ckpt.folder}: {_listing(names)}; "
                    f"the checkpoint holds {n_experts - len(absent)} per-expert tensors for this layer, the config "
                    f"says {n_experts} experts (n_routed_experts={n_experts}); the layer's other expert tensors are "
                    f"in {files}",
                    "allow_missing_keys",
                ))  # fmt: skip
    return found


def _shape_rule(pattern: str, exprs: tuple[str, ...]):
    """The rule that every tensor matching ``pattern`` has the shape ``exprs`` (of :data:`_SHAPE_RULES`) implies."""
    rule = re.compile(f"(?:{pattern})$")

    def check(ckpt: CheckpointInfo, stems: dict[str, str], fields: dict[str, int]) -> list[_Finding]:
        expected = _expected_dims(exprs, fields)
        found: list[_Finding] = []
        for stem in sorted(s for s in stems if rule.match(s)) if expected is not None else ():
            key = stems[stem]
            shape = ckpt.shapes[key]
            wrong = [f"dim {d}: {named}" for d, (size, named) in enumerate(expected)
                     if d >= len(shape) or shape[d] != size]
            if wrong or len(shape) != len(expected):
                found.append((
                    f"The config does not match the checkpoint: {key} ({ckpt.weight_map[key]} in {ckpt.folder}) has "
                    f"shape {shape}, the config implies {[size for size, _ in expected]} ({'; '.join(wrong)})",
                    "ignore_mismatched_sizes",
                ))  # fmt: skip
        return found

    return check


# Config fields and the rule that checks them against a checkpoint's headers, in the order they are reported.
CONFIG_RULES = (
    (("num_hidden_layers", "num_nextn_predict_layers"), _layer_count_rule),
    (("n_routed_experts",), _experts_rule),
    *((tuple(sorted({p for e in exprs for p in e.split("*") if not p.isdigit()})), _shape_rule(pattern, exprs))
      for pattern, exprs in _SHAPE_RULES),
)


def check_config_matches_checkpoint(
    ckpt: CheckpointInfo,
    fields: dict[str, int],
    *,
    allow_missing: bool = False,
    allow_unexpected: bool = False,
    allow_mismatched: bool = False,
) -> None:
    """Check the text config's sizes (:func:`text_size_fields`) against ``ckpt``'s headers before the model is built,
    rule by rule (:data:`CONFIG_RULES`: layer count, experts per layer, shapes); the ``allow_*`` flags warn instead, as
    in :func:`strict_load_report`. ``ValueError`` naming the config field, its value and what the checkpoint holds
    (the key and its file) for the first finding not allowed."""
    stems = {}
    for key in ckpt.shapes:
        m = _TEXT_KEY.match(key)
        if m:
            stems[m.group(1)] = key
        elif key == "lm_head.weight":
            stems[key] = key
    allowed = {"allow_missing_keys": allow_missing, "allow_unexpected_keys": allow_unexpected,
               "ignore_mismatched_sizes": allow_mismatched}
    for _, rule in CONFIG_RULES if stems else ():
        for message, option in rule(ckpt, stems, fields):
            _raise_or_warn(message, allowed[option], f"{option}=True: loading anyway")


def _raise_or_warn(message: str, allowed: bool, note: str) -> None:
    """``ValueError(message)``, or where ``allowed`` a warning ``message (note)``."""
    if not allowed:
        raise ValueError(message)
    logger.warning(f"{message} ({note})")


def _listing(keys, limit: int = 20) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return f"{shown}{f', ... ({len(keys)} in all)' if len(keys) > limit else f' ({len(keys)})'}"


def strict_load_report(
    model,
    info: dict,
    *,
    allow_missing: bool = False,
    allow_unexpected: bool = False,
    allow_mismatched: bool = False,
) -> None:
    """Raise on a load (``info`` from ``output_loading_info=True``) that left parameters at their initial values or
    dropped checkpoint tensors; the ``allow_*`` flags warn instead. ``ValueError`` listing the first 20 keys and the
    count, for missing, unexpected or shape-mismatched keys."""
    mismatched = info.get("mismatched_keys") or set()
    if mismatched:
        rows = []
        for k, a, b in sorted(mismatched, key=str):
            row = f"{k}: checkpoint {tuple(a)} vs model {tuple(b)}"
            if re.search(r"\.experts\.(gate_up_proj|down_proj)$", k) and len(a) == 3 and a[0] != b[0]:
                row += (
                    f" (the checkpoint holds {a[0]} per-expert tensors for this layer, the config says {b[0]} experts:"
                    f" mlp.experts.{{i}}.{{gate,up,down}}_proj.weight tensors are missing from the files)"
                )
            rows.append(row)
        shown = "; ".join(rows[:20]) + (f"; ... ({len(rows)} in all)" if len(rows) > 20 else "")
        message = f"Shape mismatch for {len(rows)} checkpoint tensors of {type(model).__name__}: {shown}"
        _raise_or_warn(message, allow_mismatched,
                       "ignore_mismatched_sizes=True: those parameters keep their initial values")
    missing = set(info.get("missing_keys") or ())
    unexpected = set(info.get("unexpected_keys") or ())
    text = model.config.get_text_config(decoder=True)
    n_mtp = getattr(text, "num_nextn_predict_layers", 0) or 0
    if missing and n_mtp and not allow_missing:
        pattern = rf"layers\.({'|'.join(str(text.num_hidden_layers + i) for i in range(n_mtp))})\."
        mtp = {k for k in model.state_dict() if re.search(pattern, k)}
        if mtp and mtp == missing:  # every MTP tensor absent, nothing else: a checkpoint saved without MTP
            raise ValueError(
                f"The checkpoint has no weights for the MTP layer(s) (layers.{text.num_hidden_layers}...; {len(mtp)} "
                f"tensors missing) but its config says num_nextn_predict_layers={n_mtp}. transformers' built-in "
                "Glm5NextForConditionalGeneration drops the MTP layer when it saves. To run without MTP, set "
                "config.text_config.num_nextn_predict_layers = 0 and pass that config to from_pretrained(path, "
                "config=config) (glm53flash-export does this for such folders)."
            )
    cases = ((missing, allow_missing, "missing from"), (unexpected, allow_unexpected, "unexpected in"))
    for keys, allowed, what in cases:
        if not keys:
            continue
        message = f"{len(keys)} keys {what} the checkpoint for {type(model).__name__}: {_listing(keys)}"
        _raise_or_warn(message, allowed, "allowed by the caller; those parameters keep their initial values")


def nonfinite_tensors(named_tensors, chunk: int = 1 << 24) -> list[str]:
    """``["name (n NaN, m Inf; first at index (i, ...))", ...]`` for the ``(name, tensor)`` pairs holding NaN or Inf,
    read ``chunk`` elements at a time (DTensors: the local shard; meta, empty, non-float skipped)."""
    bad = []
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            continue
        local = tensor.detach()
        local = local.to_local() if hasattr(local, "to_local") else local  # a DTensor: this rank's shard
        if local.device.type == "meta" or not local.numel():
            continue
        flat = local.reshape(-1)
        n_nan = n_inf = 0
        first = None
        for start in range(0, flat.numel(), chunk):
            piece = flat[start : start + chunk]
            if piece.element_size() == 1:  # FP8 storage: isfinite/isnan are not defined for it on every device
                piece = piece.float()
            finite = torch.isfinite(piece)
            if bool(finite.all()):
                continue
            nan = torch.isnan(piece)
            n_nan += int(nan.sum())
            n_inf += int((~finite & ~nan).sum())
            if first is None:
                offset = start + int((~finite).nonzero()[0, 0])
                first = tuple(int(i) for i in torch.unravel_index(torch.tensor(offset), local.shape))
        if first is not None:
            bad.append(f"{name} ({n_nan} NaN, {n_inf} Inf; first at index {first})")
    return bad


def _first_ten(items: list[str], sep: str = "; ") -> str:
    return f"{sep.join(items[:10])}{' ...' if len(items) > 10 else ''}"


def check_finite_weights(model, source, *, allow: bool = False) -> None:
    """``ValueError`` naming ``source`` and the first 10 parameters or buffers of ``model`` holding NaN or Inf
    (``allow``: a warning)."""
    bad = nonfinite_tensors(itertools.chain(model.named_parameters(), model.named_buffers()))
    if bad:
        message = f"{source}: {len(bad)} loaded weights hold NaN or Inf values: {_first_ten(bad)}"
        if not allow:
            raise ValueError(message + " (pass allow_nonfinite_weights=True to load them anyway)")
        logger.warning(message + " (allow_nonfinite_weights=True: loaded as they are)")


def check_finite_for_save(state_dict, owner: str) -> None:
    """``ValueError`` naming ``owner`` and the first 10 tensors of ``state_dict`` holding NaN or Inf."""
    bad = nonfinite_tensors(state_dict.items())
    if bad:
        raise ValueError(
            f"{owner}: {len(bad)} weight tensors hold NaN or Inf values: {_first_ten(bad)}; refusing to save them "
            "(pass allow_nonfinite_weights=True to save anyway)"
        )


def check_state_dict_dtypes(model, state_dict) -> None:
    """``ValueError`` naming the integer or bool tensors of ``state_dict`` (first 10, dtypes, count) that would load
    into floating-point tensors of ``model``."""
    own = model.state_dict()
    bad = [f"{k} ({v.dtype}, the model holds {own[k].dtype})" for k, v in state_dict.items()
           if isinstance(v, torch.Tensor) and k in own and own[k].is_floating_point()
           and not (v.is_floating_point() or v.is_complex())]
    if bad:
        raise ValueError(
            f"state_dict holds {len(bad)} integer or bool tensors for floating-point weights of "
            f"{type(model).__name__}: {_first_ten(bad, ', ')}"
        )
