"""Checkpoint layout: conversions between the published GLM-5.3-Flash keys and our modules, strict loading, saving.

Published keys (under ``model.language_model.``, ``language_model.``, ``model.`` or no prefix): per-expert
``mlp.experts.{i}.{gate,up,down}_proj.weight``, ``self_attn.{q,k,v}_conv1d.weight``,
``self_attn.{f_a_proj,f_b_proj,A_log,dt_bias}``, ``hc_{attn,ffn}_{fn,base,scale}``; in memory, as transformers'
``glm5_next``: fused experts, one ``conv1d``, ``forget_gate``, ``attn_hc`` / ``ffn_hc``. Saving writes the
``model.language_model.`` layout. FP8 (block-scaled e4m3, ``<name>_scale_inv``) loads kept in FP8
(:mod:`.fp8_kept`) or, with ``dequantize_fp8=True``, dequantized.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
import os
import re
import threading
from dataclasses import dataclass, field

import torch
from transformers import conversion_mapping as _conversion_registry
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    get_model_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from transformers.core_model_loading import (
    Concatenate,
    ConversionOps,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    build_glob_alternation,
)
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Checkpoint keys of the vision tower, skipped by the text-only classes.
VISION_KEY_PATTERNS = (r"^model\.visual\.", r"^visual\.", r"^vision_tower\.", r"^model\.vision_tower\.")
# Text-key prefixes seen in released and community checkpoints, canonical first.
TEXT_PREFIXES = ("model.language_model.", "language_model.", "model.", "")
# The text model (AutoModel) has no LM head: a full checkpoint's head is skipped (and reported) too.
LM_HEAD_KEY_PATTERNS = (r"^lm_head\.weight$",)

SCALE_SUFFIX = "_scale_inv"
# safetensors dtypes that never hold a weight of this model (every parameter and buffer is floating point).
NON_FLOAT_DTYPES = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_SAFETENSORS_SINGLE = "model.safetensors"


class _Passthrough(ConversionOps):
    """Identity op (the reverse of :class:`CastToParamDtype`)."""

    def convert(self, input_dict, source_patterns=None, target_patterns=None, **kwargs):
        return input_dict

    @property
    def reverse_op(self) -> ConversionOps:
        return _Passthrough()


class CastToParamDtype(ConversionOps):
    """Cast a converter's output to the dtype of the parameter it loads into (save: identity)."""

    def convert(
        self, input_dict, source_patterns=None, target_patterns=None, full_layer_name=None, model=None, **kwargs
    ):
        if model is None or full_layer_name is None:
            return input_dict
        try:
            module_path, _, name = full_layer_name.rpartition(".")
            ref = getattr(model.get_submodule(module_path) if module_path else model, name)
        except AttributeError:
            return input_dict
        dtype = getattr(ref, "dtype", None)
        if dtype is None or not dtype.is_floating_point:
            return input_dict

        def cast(t):
            if isinstance(t, list):
                return [cast(x) for x in t]
            return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype else t

        return {k: cast(v) for k, v in input_dict.items()}

    @property
    def reverse_op(self) -> ConversionOps:
        return _Passthrough()


class _InertRenaming(WeightRenaming):
    """A renaming that never matches (the save-time reverse of :class:`LoadOnlyRenaming`)."""

    __slots__ = ()

    def rename_source_key(self, source_key: str) -> tuple[str, str | None]:
        return source_key, None

    def reverse_transform(self) -> WeightRenaming:
        return self


class LoadOnlyRenaming(WeightRenaming):
    """A ``WeightRenaming`` applied when loading only; ``save_pretrained`` keeps the model's own names."""

    __slots__ = ()

    def reverse_transform(self) -> WeightRenaming:
        return _InertRenaming(source_patterns=r"^\b$", target_patterns="")


def model_conversions() -> dict[str, list]:
    """``{class name: transforms}`` of this module copy: the text model drops the ``model.language_model.`` /
    ``language_model.`` prefix (load only) and maps the per-layer published keys to its parameters; the causal LM maps
    that prefix to ``model.``."""
    prefixes = [r"^model\.language_model\.", r"^language_model\."]
    renames = [
        (r"self_attn\.f_a_proj\.", "self_attn.forget_gate.f_a_proj."),
        (r"self_attn\.f_b_proj\.", "self_attn.forget_gate.f_b_proj."),
        (r"self_attn\.dt_bias", "self_attn.forget_gate.dt_bias"),
        (r"self_attn\.A_log", "self_attn.forget_gate.A_log"),
    ] + [(f"hc_{site}_{p}", f"{site}_hc.{p}") for site in ("attn", "ffn") for p in ("fn", "base", "scale")]
    layers: list = [WeightRenaming(source_patterns=s, target_patterns=t) for s, t in renames]
    layers += [
        WeightConverter(
            source_patterns=["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
            target_patterns="mlp.experts.gate_up_proj",
            operations=[MergeModulelist(dim=0), Concatenate(dim=1), CastToParamDtype()],
        ),
        WeightConverter(
            source_patterns="mlp.experts.*.down_proj.weight",
            target_patterns="mlp.experts.down_proj",
            operations=[MergeModulelist(dim=0), CastToParamDtype()],
        ),
        WeightConverter(
            source_patterns=["self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight"],
            target_patterns="self_attn.conv1d.weight",
            operations=[Concatenate(dim=0), CastToParamDtype()],
        ),
    ]
    return {
        "Glm53FlashTextModel": [LoadOnlyRenaming(source_patterns=prefixes, target_patterns="")] + layers,
        "Glm53FlashForCausalLM": [WeightRenaming(source_patterns=prefixes, target_patterns=r"^model\.")],
    }


def register_conversions() -> None:
    """Register this module copy's :func:`model_conversions` with transformers (``overwrite=True``)."""
    for name, mapping in model_conversions().items():
        register_checkpoint_conversion_mapping(name, mapping, overwrite=True)


@contextlib.contextmanager
def own_conversions():
    """Context manager: transformers' registry holds this module copy's conversions while the block runs
    (re-entrant, serialised across threads and module copies)."""
    lock = _conversion_registry.__dict__.setdefault("_glm53flash_registry_lock", threading.RLock())
    with lock:
        previous = {name: get_checkpoint_conversion_mapping(name) for name in model_conversions()}
        register_conversions()
        try:
            yield
        finally:
            for name, mapping in previous.items():
                if mapping is not None:
                    register_checkpoint_conversion_mapping(name, mapping, overwrite=True)



def _local_folder(path, subfolder: str = "") -> str | None:
    if not isinstance(path, (str, os.PathLike)):
        return None
    folder = os.path.join(os.fspath(path), subfolder) if subfolder else os.fspath(path)
    return folder if os.path.isdir(folder) else None


def checkpoint_keys(path: str) -> list[str] | None:
    """All tensor names of a local checkpoint folder, or None when ``path`` is not a local folder with safetensors."""
    folder = _local_folder(path)
    if folder is None:
        return None
    weight_map = read_weight_map(folder)
    return None if weight_map is None else list(weight_map)


def read_json(path: str, *, unique_keys: bool = False):
    """The parsed JSON file ``path``; ``ValueError`` naming the file when it is unreadable, invalid, or (with
    ``unique_keys``) gives a name twice in one object."""

    def unique(pairs):
        out = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"{path}: {key!r} is listed twice ({out[key]!r} and {value!r})")
            out[key] = value
        return out

    try:
        with open(path) as f:
            return json.load(f, object_pairs_hook=unique if unique_keys else None)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({type(e).__name__}: {e})") from e


def write_json(data, path: str, sort_keys: bool = False) -> None:
    """Write ``data`` to ``path`` as JSON indented by 2, with a final newline."""
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=sort_keys)
        f.write("\n")


def read_weight_map(folder: str) -> dict[str, str] | None:
    """``{tensor name: shard file name}`` of a local folder (index or single ``model.safetensors``), or None;
    ``ValueError`` naming the file for both present, an invalid index (or a tensor listed twice), a corrupt file."""
    index = os.path.join(folder, _SAFETENSORS_INDEX)
    single = os.path.join(folder, _SAFETENSORS_SINGLE)
    if os.path.isfile(index) and os.path.isfile(single):
        raise ValueError(
            f"{folder} holds both {_SAFETENSORS_SINGLE} and {_SAFETENSORS_INDEX}: transformers would load "
            f"{single} and ignore the index and its shards; one of them is stale. Remove the one that is not meant"
        )
    if os.path.isfile(index):
        content = read_json(index, unique_keys=True)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(
                f"{index}: 'weight_map' must be an object {{tensor name: shard file name}}; got "
                f"{type(weight_map).__name__}"
            )
        bad = [k for k, v in weight_map.items() if not isinstance(v, str)]
        if bad:
            raise ValueError(f"{index}: weight_map[{bad[0]!r}] must be a file name; got {weight_map[bad[0]]!r}")
        return dict(weight_map)
    if os.path.isfile(single):
        with open_shard(single) as f:
            return dict.fromkeys(f.keys(), _SAFETENSORS_SINGLE)
    return None


@contextlib.contextmanager
def open_shard(path: str):
    """``safetensors.safe_open(path, framework="pt")`` raising ``ValueError`` naming a missing or damaged file."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise ValueError(f"{path}: checkpoint shard not found")
    try:
        handle = safe_open(path, framework="pt")
    except Exception as e:  # safetensors raises SafetensorError (an Exception subclass) or OSError
        raise ValueError(
            f"{path}: corrupt or truncated safetensors file ({type(e).__name__}: {e}); "
            "re-download or re-write this shard"
        ) from e
    with handle as f:
        yield f


def read_config_json(folder: str) -> dict | None:
    """The parsed ``folder/config.json`` or None; ``ValueError`` naming it when it is not a JSON object."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    config = read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object; got {type(config).__name__}")
    return config


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


def is_fp8_dtype(dtype: str) -> bool:
    """True for safetensors FP8 dtype strings (``F8_E4M3``, ``F8_E5M2``, …)."""
    return dtype.startswith("F8")


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
            f"{key!r} is stored twice: in {named} (the shard {_SAFETENSORS_INDEX} names) and in "
            f"{os.path.join(folder, fname)}; transformers would read both and keep the copy of the shard it reads "
            f"last, not necessarily the one the index names ({len(stray)} such tensors in this shard: "
            f"{_listing(stray)}). Delete the extra copies, or correct the index"
        )
    unlisted = sorted(k for k in present if k not in weight_map)
    if unlisted:
        raise ValueError(
            f"{os.path.join(folder, fname)} holds {len(unlisted)} tensors that {_SAFETENSORS_INDEX} does not list: "
            f"{_listing(unlisted)}; transformers would load them without the checks the index is read for. List "
            "them in the index, or delete them from the shard"
        )


def inspect_checkpoint(path, subfolder: str = "", *, for_transformers: bool = True) -> CheckpointInfo | None:
    """Read and check the safetensors headers of a local checkpoint folder (None for a Hub id or no safetensors):
    config and index valid, every shard holds its indexed tensors and no other, FP8 tensors and scales paired and
    tiling; ``ValueError`` naming the file or key."""
    folder = _local_folder(path, subfolder)
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
    fp8 = {k for k, d in info.dtypes.items() if is_fp8_dtype(d)}
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
        shown = ", ".join(f"{k} ({ckpt.dtypes[k]})" for k in loaded[:10])
        raise ValueError(
            f"{ckpt.folder}: {len(loaded)} tensors are integer or bool where the model's weights are floating "
            f"point; loading casts them silently: {shown}{' ...' if len(loaded) > 10 else ''}"
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
    import dataclasses

    from transformers import PreTrainedConfig

    from .configuration_glm53flash import Glm53FlashTextConfig

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
    for expr in exprs:
        size, named = 1, []
        for part in expr.split("*"):
            if part.isdigit():
                size *= int(part)
                named.append(part)
            elif part in fields:
                size *= fields[part]
                named.append(f"{part}={fields[part]}")
            else:
                return None
        out.append((size, named[0] if len(named) == 1 else f"{' * '.join(named)} = {size}"))
    return out


def check_config_matches_checkpoint(
    ckpt: CheckpointInfo,
    fields: dict[str, int],
    *,
    allow_missing: bool = False,
    allow_unexpected: bool = False,
    allow_mismatched: bool = False,
) -> None:
    """Check the text config's sizes (:func:`text_size_fields`) against ``ckpt``'s headers before the model is built:
    layer count, experts per layer, shapes; the ``allow_*`` flags warn instead, as in :func:`strict_load_report`.
    ``ValueError`` naming the config field, its value and what the checkpoint holds (the key and its file)."""
    stems = {}
    for key in ckpt.shapes:
        m = _TEXT_KEY.match(key)
        if m:
            stems[m.group(1)] = key
        elif key == "lm_head.weight":
            stems[key] = key
    if not stems:
        return

    def report(message: str, allowed: bool, option: str) -> None:
        if not allowed:
            raise ValueError(message)
        logger.warning(f"{message} ({option}=True: loading anyway)")

    layers = {int(s.split(".")[1]) for s in stems if s.startswith("layers.")}
    n_main, n_mtp = fields.get("num_hidden_layers"), fields.get("num_nextn_predict_layers", 0)
    if layers and n_main is not None:
        held, expected = max(layers) + 1, n_main + n_mtp
        if held != expected and not (n_mtp and held == n_main):
            report(
                f"The config does not match the checkpoint {ckpt.folder}: num_hidden_layers={n_main} and "
                f"num_nextn_predict_layers={n_mtp} mean layers 0..{expected - 1}, the checkpoint holds layers "
                f"0..{held - 1} ({held} layers)",
                allow_missing if held < expected else allow_unexpected,
                "allow_missing_keys" if held < expected else "allow_unexpected_keys",
            )
    n_experts = fields.get("n_routed_experts")
    experts: dict[int, dict[str, set[int]]] = {}
    for stem in stems:
        m = _EXPERT_KEY.match(stem)
        if m:
            experts.setdefault(int(m.group(1)), {}).setdefault(m.group(3), set()).add(int(m.group(2)))
    for layer, by_proj in sorted(experts.items()) if n_experts is not None else ():
        held = set().union(*by_proj.values())
        if max(held) >= n_experts:
            report(
                f"The config does not match the checkpoint {ckpt.folder}: n_routed_experts={n_experts}, the "
                f"checkpoint holds experts 0..{max(held)} in layer {layer}",
                allow_unexpected,
                "allow_unexpected_keys",
            )
        for proj in ("gate", "up", "down"):
            absent = sorted(set(range(n_experts)) - by_proj.get(proj, set()))
            if not absent:
                continue
            example = stems[next(s for s in stems if _EXPERT_KEY.match(s) and s.startswith(f"layers.{layer}."))]
            prefix = example[: example.index(f"layers.{layer}.")]
            files = sorted({ckpt.weight_map[stems[s]] for s in stems if s.startswith(f"layers.{layer}.mlp.experts.")})
            names = [f"{prefix}layers.{layer}.mlp.experts.{i}.{proj}_proj.weight" for i in absent]
            report(
                f"{len(names)} per-expert tensors missing from the checkpoint {ckpt.folder}: {_listing(names)}; the "
                f"checkpoint holds {n_experts - len(absent)} per-expert tensors for this layer, the config says "
                f"{n_experts} experts (n_routed_experts={n_experts}); the layer's other expert tensors are in "
                f"{', '.join(files)}",
                allow_missing,
                "allow_missing_keys",
            )
    for pattern, exprs in _SHAPE_RULES:
        expected = _expected_dims(exprs, fields)
        if expected is None:
            continue
        rule = re.compile(f"(?:{pattern})$")
        for stem in sorted(s for s in stems if rule.match(s)):
            key = stems[stem]
            shape = ckpt.shapes[key]
            wrong = [
                f"dim {d}: {named}"
                for d, (size, named) in enumerate(expected)
                if d >= len(shape) or shape[d] != size
            ]
            if wrong or len(shape) != len(expected):
                report(
                    f"The config does not match the checkpoint: {key} ({ckpt.weight_map[key]} in {ckpt.folder}) "
                    f"has shape {shape}, the config implies {[size for size, _ in expected]} ({'; '.join(wrong)})",
                    allow_mismatched,
                    "ignore_mismatched_sizes",
                )



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
        if allow_mismatched:
            logger.warning(message + " (ignore_mismatched_sizes=True: those parameters keep their initial values)")
        else:
            raise ValueError(message)
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
        if allowed:
            logger.warning(message + " (allowed by the caller; those parameters keep their initial values)")
        else:
            raise ValueError(message)


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


def _listing_bad(bad: list[str], limit: int = 10) -> str:
    return f"{'; '.join(bad[:limit])}{' ...' if len(bad) > limit else ''}"


def check_finite_weights(model, source, *, allow: bool = False) -> None:
    """``ValueError`` naming ``source`` and the first 10 parameters or buffers of ``model`` holding NaN or Inf
    (``allow``: a warning)."""
    bad = nonfinite_tensors(itertools.chain(model.named_parameters(), model.named_buffers()))
    if bad:
        message = f"{source}: {len(bad)} loaded weights hold NaN or Inf values: {_listing_bad(bad)}"
        if not allow:
            raise ValueError(message + " (pass allow_nonfinite_weights=True to load them anyway)")
        logger.warning(message + " (allow_nonfinite_weights=True: loaded as they are)")


def count_matching(keys: list[str] | None, patterns) -> int:
    """Number of ``keys`` matching any regex in ``patterns`` (0 when keys is None)."""
    if not keys:
        return 0
    compiled = [re.compile(p) for p in patterns]
    return sum(1 for k in keys if any(c.search(k) for c in compiled))


# kwargs that ``PreTrainedModel.from_pretrained`` consumes itself (its signature and the names it pops); the rest
# goes to the config class, as transformers does when it loads the config.
_MODEL_LOADING_KWARGS = {
    "config", "cache_dir", "ignore_mismatched_sizes", "force_download", "local_files_only", "token", "revision",
    "use_safetensors", "weights_only", "fusion_config", "disable_mmap", "state_dict", "proxies", "tqdm_class",
    "output_loading_info", "_from_pipeline", "_from_auto", "dtype", "torch_dtype", "device_map", "max_memory",
    "offload_folder", "offload_buffers", "quantization_config", "subfolder", "_commit_hash", "variant",
    "adapter_kwargs", "adapter_name", "generation_config", "gguf_file", "distributed_config", "device_mesh",
    "tp_plan", "tp_size", "trust_remote_code", "allow_all_kernels", "use_kernels", "kernel_config", "key_mapping",
    "mirror", "_fast_init", "low_cpu_mem_usage", "from_tf", "from_flax", "offload_state_dict",
}  # fmt: skip


def fp8_module_names(ckpt: CheckpointInfo) -> set[str]:
    """Names, relative to the text model, of the modules whose weights ``ckpt`` stores in FP8."""
    return fp8_module_names_of_keys(ckpt.fp8_weights)


def fp8_module_names_of_keys(keys) -> set[str]:
    """Text-model-relative names of the modules holding the published FP8 weight ``keys`` (per-expert keys name the
    merged ``mlp.experts`` module)."""
    out = set()
    for key in keys:
        name = key.removesuffix(".weight")
        for prefix in TEXT_PREFIXES[:-1]:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        out.add(re.sub(r"\.experts\.\d+\.(gate|up|down)_proj$", ".experts", name))
    return out


def _request_fp8_dequantization(cls, path, ckpt: CheckpointInfo, kwargs: dict, dequantize: bool = True) -> None:
    """Make transformers load FP8 ``ckpt`` dequantized or kept in FP8 (``FineGrainedFP8Config`` + the file's config)."""
    from transformers import FineGrainedFP8Config, PreTrainedConfig

    qc = dict(ckpt.quantization_config)
    kwargs["quantization_config"] = FineGrainedFP8Config(
        weight_block_size=fp8_block_size(qc), dequantize=dequantize,
        modules_to_not_convert=qc.get("modules_to_not_convert"),
    )  # fmt: skip

    def has_qc(config) -> bool:
        return any(getattr(c, "quantization_config", None) is not None
                   for c in (config, config.get_text_config(decoder=True)))

    config = kwargs.get("config")
    if isinstance(config, PreTrainedConfig):
        if not has_qc(config):
            config = kwargs["config"] = copy.deepcopy(config)
            config.quantization_config = qc
        return
    where = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
    location = {k: kwargs[k] for k in where if k in kwargs}
    if has_qc(cls.config_class.from_pretrained(config or path, **location)):
        return
    overrides = {k: kwargs.pop(k) for k in list(kwargs) if k not in _MODEL_LOADING_KWARGS}
    config, unused = cls.config_class.from_pretrained(
        config or path, return_unused_kwargs=True, **location, **overrides
    )
    config.quantization_config = qc
    kwargs.update(unused)
    kwargs["config"] = config


def cast_to_dtype_plan(model) -> list[str]:
    """Cast, in place, every floating parameter of ``model`` to the dtype its loader allocated: ``model.config.dtype``,
    or fp32 where ``model._get_dtype_plan`` (``_keep_in_fp32_modules_strict``) names it. Returns the names cast.

    transformers 5.23 and 5.24 leave the tensors of an FP8 checkpoint loaded with ``dequantize=True`` in the file's
    dtype (the loader casts only where no quantizer is active; 5.25 casts every source), so a model asked for in fp32
    would hold bf16 embeddings and a bf16 model would lose the fp32 router bias and mHC parameters. FP8 parameters
    (the FP8-kept load) are left as they are."""
    main = getattr(model.config, "dtype", None)
    if not isinstance(main, torch.dtype) or not main.is_floating_point:
        return []
    plan = model._get_dtype_plan(main)
    alternation, group_names, _ = build_glob_alternation(list(plan)) if plan else (None, None, None)
    cast = []
    for name, param in model.named_parameters():
        if not param.is_floating_point() or param.element_size() == 1:
            continue
        match = alternation.search(name) if alternation is not None else None
        want = plan[group_names[match.lastgroup]] if match is not None else main
        if param.dtype != want:
            param.data = param.data.to(want)
            cast.append(name)
    return cast


def load_pretrained(cls, parent_from_pretrained, pretrained_model_name_or_path, *args, **kwargs):
    """Body of ``Glm53FlashPreTrainedModel.from_pretrained``: transformers' loader inside our checks.

    Header and config checks before; after, dtypes, strict keys (``allow_missing_keys`` / ``allow_unexpected_keys`` /
    ``ignore_mismatched_sizes`` warn instead, implied by ``output_loading_info=True`` and by ``state_dict=`` without a
    checkpoint) and finiteness (``allow_nonfinite_weights``). FP8 stays FP8 unless ``dequantize_fp8=True``. Returns
    the model, or ``(model, loading_info)`` with ``output_loading_info=True``. ``ValueError`` naming the file, key or
    config field, or for a ``dequantize_fp8`` that is not a bool."""
    recover_interrupted_save(pretrained_model_name_or_path, kwargs.get("subfolder", ""))
    want_info = kwargs.pop("output_loading_info", False)
    # a caller who asks for the loading info gets the key report there (and a warning), as transformers reports it
    allow_missing = kwargs.pop("allow_missing_keys", False) or want_info
    # from_pretrained(None, config=..., state_dict=...): no checkpoint, the caller's own tensors; as transformers,
    # the parameters they lack are initialised (_init_weights) and reported in a warning, not an error
    allow_missing = allow_missing or (pretrained_model_name_or_path is None and kwargs.get("state_dict") is not None)
    allow_unexpected = kwargs.pop("allow_unexpected_keys", False) or want_info
    allow_mismatched = kwargs.pop("ignore_mismatched_sizes", False) or want_info
    allow_nonfinite = kwargs.pop("allow_nonfinite_weights", False)
    ckpt = inspect_checkpoint(pretrained_model_name_or_path, kwargs.get("subfolder", ""))
    config = kwargs.get("config")
    if ckpt is not None and (not isinstance(config, (str, os.PathLike)) or _local_folder(config) is not None):
        fields = text_size_fields(config, _local_folder(config) or ckpt.folder)
        check_config_matches_checkpoint(
            ckpt, fields, allow_missing=allow_missing, allow_unexpected=allow_unexpected,
            allow_mismatched=allow_mismatched,
        )  # fmt: skip
    dequantize_fp8 = kwargs.pop("dequantize_fp8", False)
    if not isinstance(dequantize_fp8, bool):
        raise ValueError(f"dequantize_fp8 must be a bool; got {dequantize_fp8!r}")
    keep_fp8 = contextlib.nullcontext()
    if ckpt is not None and ckpt.fp8_weights:
        if kwargs.get("quantization_config") is None:
            _request_fp8_dequantization(cls, pretrained_model_name_or_path, ckpt, kwargs, dequantize=dequantize_fp8)
        if not getattr(kwargs.get("quantization_config"), "dequantize", False):
            from .fp8_kept import fp8_quantizer_for_load

            keep_fp8 = fp8_quantizer_for_load(fp8_module_names(ckpt))
    with keep_fp8:
        model, info = parent_from_pretrained(
            pretrained_model_name_or_path, *args, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
        )
    if ckpt is not None:
        check_loaded_dtypes(ckpt, info.get("unexpected_keys"))
    if getattr(kwargs.get("quantization_config"), "dequantize", False):
        cast_to_dtype_plan(model)
    strict_load_report(
        model, info, allow_missing=allow_missing, allow_unexpected=allow_unexpected, allow_mismatched=allow_mismatched
    )
    source = ckpt.folder if ckpt is not None else pretrained_model_name_or_path or "state_dict"
    check_finite_weights(model, source, allow=allow_nonfinite)
    model._weight_conversions = get_model_conversion_mapping(model, add_legacy=False)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not getattr(quantizer.quantization_config, "dequantize", True):
        # FP8 kept: the expert converters also split the merged *_scale_inv back into per-expert scales on save
        scale_copies = [
            c for c in quantizer.update_weight_conversions(model._weight_conversions, model)
            if isinstance(c, WeightConverter) and all(t.endswith("_scale_inv") for t in c.target_patterns)
            and any("experts" in t for t in c.target_patterns)
        ]  # fmt: skip
        model._weight_conversions = model._weight_conversions + scale_copies
    if getattr(cls, "_skips_vision_tower", False):
        keys = list(ckpt.weight_map) if ckpt is not None else checkpoint_keys(pretrained_model_name_or_path)
        vision = count_matching(keys, VISION_KEY_PATTERNS)
        head = count_matching(keys, LM_HEAD_KEY_PATTERNS) if not hasattr(model, "lm_head") else 0
        if vision or head:
            parts = [f"{vision} vision-tower tensors"] + ([f"{head} lm_head tensors"] if head else [])
            logger.info(f"{cls.__name__}: skipped {' and '.join(parts)} of the checkpoint (text-only class)")
    return (model, info) if want_info else model


# Files a checkpoint save replaces as a whole: weights and their indexes in any layout or variant, the model config
# and the generation config. A save never carries these over from the folder it replaces.
_REPLACED_NAMES = re.compile(
    r"^(?:(?:model|pytorch_model)(?:[.-].*)?\.(?:safetensors|bin)|.+\.(?:safetensors|bin)\.index\.json"
    r"|config\.json|generation_config\.json)$"
)


def replaced_by_save(name: str) -> bool:
    """Whether a save replaces the folder entry ``name`` as a whole (weights, indexes, config, generation config)."""
    return bool(_REPLACED_NAMES.match(name))


# Names of what a save leaves while it runs: siblings ``.{name}.tmp-*`` (the new folder being written; after the
# swap, the old content awaiting deletion) and ``.{name}.old-*`` (the old folder moved aside by the two-rename
# fallback); inside the folder, journal folders ``.glm53flash-save.tmp-*`` (staged, uncommitted) and
# ``.glm53flash-save.commit-*`` (committed, holding the new entries not yet moved into place).
_JOURNAL_TMP = ".glm53flash-save.tmp-"
_JOURNAL_COMMIT = ".glm53flash-save.commit-"
_JOURNAL_MANIFEST = ".glm53flash-save.manifest.json"
_JOURNAL_PREFIXES = (_JOURNAL_TMP, _JOURNAL_COMMIT)
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange_paths(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False when unavailable,
    ``OSError`` naming both paths on any other failure (``EBUSY`` / ``EXDEV``)."""
    import ctypes
    import errno
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), a, None, b)


class _FolderLock:
    """An exclusive ``flock`` on a folder held by a running save; without ``fcntl`` nothing is locked."""

    def __init__(self, path: str):
        self.path = path
        self.fd = None

    def acquire(self, wait: bool = True) -> bool:
        try:
            import fcntl
        except ImportError:
            return True
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return True  # gone already
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            self.release()
            return False
        except OSError:
            pass  # no locks on this file system
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _remove(path: str) -> None:
    """Delete a file, link or folder tree (a link is removed, never followed)."""
    import shutil

    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _link_copy(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` as hard links (a real copy without hard links), folders recursively, links as links."""
    import shutil

    def link(a, b):
        try:
            os.link(a, b, follow_symlinks=False)
        except OSError:
            shutil.copy2(a, b, follow_symlinks=False)

    if os.path.isdir(src) and not os.path.islink(src):
        shutil.copytree(src, dst, symlinks=True, copy_function=link)
    else:
        link(src, dst)


def link_or_copy_entries(src: str, dst: str) -> list[str]:
    """Put every entry of the folder ``src`` into the existing folder ``dst`` as hard links, copied where a link
    fails (``dst`` on another file system, ``EXDEV``, or no hard links there); folders recursively, symbolic links as
    links. ``src`` is left as it was, so a failure part-way loses nothing of it. Returns the entry names.

    Raises:
        OSError: an entry could be neither linked nor copied (e.g. ``dst`` full); ``dst`` may hold part of ``src``.
    """
    names = sorted(os.listdir(src))
    for name in names:
        _link_copy(os.path.join(src, name), os.path.join(dst, name))
    return names


def _roll_forward(target: str, journal: str) -> None:
    """Finish the committed journal ``journal`` inside ``target`` (idempotent)."""
    manifest = os.path.join(journal, _JOURNAL_MANIFEST)
    if os.path.isfile(manifest):
        with open(manifest) as f:
            written = json.load(f)
        for entry in sorted(os.listdir(target)):
            if replaced_by_save(entry) and entry not in written:
                _remove(os.path.join(target, entry))
        for entry in written:
            src, dst = os.path.join(journal, entry), os.path.join(target, entry)
            if not os.path.lexists(src):
                continue  # moved by an earlier run
            if os.path.lexists(dst) and (os.path.isdir(src) or (os.path.isdir(dst) and not os.path.islink(dst))):
                trash = os.path.join(journal, ".trash-" + entry)
                _remove(trash)
                os.rename(dst, trash)
            os.replace(src, dst)
        os.unlink(manifest)
    _remove(journal)


def recover_interrupted_save(save_directory, subfolder: str = "") -> None:
    """Undo or finish what a killed :func:`atomic_save` of ``save_directory`` (``/ subfolder``) left; non-paths are
    ignored. Raises ``OSError`` when a rename needed to restore or finish the folder fails."""
    if not isinstance(save_directory, (str, os.PathLike)):
        return
    target = os.path.realpath(os.path.abspath(os.path.join(os.fspath(save_directory), subfolder or "")))
    parent, name = os.path.split(target)
    if os.path.isdir(target):
        for entry in sorted(os.listdir(target)):
            if entry.startswith(_JOURNAL_PREFIXES):
                path = os.path.join(target, entry)
                lock = _FolderLock(path)
                if not lock.acquire(wait=False):
                    continue
                try:
                    _roll_forward(target, path) if entry.startswith(_JOURNAL_COMMIT) else _remove(path)
                finally:
                    lock.release()
    try:
        siblings = sorted(s for s in os.listdir(parent) if s.startswith((f".{name}.tmp-", f".{name}.old-")))
    except OSError:
        return
    locks = [_FolderLock(os.path.join(parent, s)) for s in siblings]
    try:
        if not all(lock.acquire(wait=False) for lock in locks):
            return  # a save of this folder is running
        if not os.path.lexists(target):
            olds = [os.path.join(parent, s) for s in siblings if s.startswith(f".{name}.old-")]
            olds = [p for p in olds if os.path.isdir(p) and os.listdir(p)]
            if olds:
                os.rename(max(olds, key=lambda p: os.stat(p).st_ctime), target)
        for s in siblings:
            _remove(os.path.join(parent, s))
    finally:
        for lock in locks:
            lock.release()


def _journal_save(target: str, write=None, staged: str | None = None) -> None:
    """Save into ``target`` in place through a journal (for a ``target`` that cannot be renamed, e.g. a mount point)."""
    import tempfile

    journal = tempfile.mkdtemp(prefix=_JOURNAL_TMP, dir=target)
    lock = _FolderLock(journal)
    lock.acquire()
    try:
        if staged is None:
            write(journal)
        else:
            import shutil

            for entry in os.listdir(staged):
                shutil.move(os.path.join(staged, entry), os.path.join(journal, entry))
        written = sorted(os.listdir(journal))
        with open(os.path.join(journal, _JOURNAL_MANIFEST), "w") as f:
            json.dump(written, f)
        committed = os.path.join(target, _JOURNAL_COMMIT + os.path.basename(journal)[len(_JOURNAL_TMP):])
        os.rename(journal, committed)
    except BaseException:
        _remove(journal)
        raise
    finally:
        lock.release()
    _roll_forward(target, committed)


def atomic_save(save_directory, write) -> str:
    """Fill an empty folder with ``write(tmp)`` and swap it in at ``save_directory`` once ``write`` returned.

    ``save_directory`` (parent created when missing) always holds the complete old or new folder, also across
    ``kill -9`` (not power loss); the old folder's non-checkpoint entries and a link to the folder are kept. Returns
    the absolute path written. ``ValueError`` when ``save_directory`` is an existing file; whatever ``write`` raises
    propagates (the old folder is kept)."""
    import errno
    import tempfile

    target = os.path.realpath(os.path.abspath(os.fspath(save_directory)))
    if os.path.exists(target) and not os.path.isdir(target):
        raise ValueError(f"save_directory={os.fspath(save_directory)!r} is a file; expected a folder")
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    recover_interrupted_save(target)
    if os.path.isdir(target) and os.path.ismount(target):
        _journal_save(target, write)
        return target
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    lock = _FolderLock(tmp)
    lock.acquire()
    mode = os.stat(target).st_mode if os.path.isdir(target) else None
    carried: list[str] = []
    backup = None
    try:
        write(tmp)
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)
        else:
            os.chmod(tmp, mode & 0o7777)
        if not os.path.isdir(target):
            os.rename(tmp, target)
            return target
        written = set(os.listdir(tmp))
        for entry in sorted(os.listdir(target)):
            if entry not in written and not replaced_by_save(entry) and not entry.startswith(_JOURNAL_PREFIXES):
                _link_copy(os.path.join(target, entry), os.path.join(tmp, entry))
                carried.append(entry)
        try:
            if not exchange_paths(tmp, target):
                backup = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
                os.rename(target, backup)  # replaces the empty backup folder
                try:
                    os.rename(tmp, target)
                except BaseException:
                    os.rename(backup, target)
                    raise
                tmp, backup = backup, None
        except OSError as e:
            if e.errno not in (errno.EBUSY, errno.EXDEV):
                raise
            for entry in carried:  # the folder cannot be renamed (a mount point): save into it through a journal
                _remove(os.path.join(tmp, entry))
            _journal_save(target, staged=tmp)
    finally:
        lock.release()
        _remove(tmp)  # the unfinished new folder, or the old content after the swap
        if backup is not None and os.path.isdir(backup) and not os.listdir(backup):
            os.rmdir(backup)
    return target


def check_finite_for_save(state_dict, owner: str) -> None:
    """``ValueError`` naming ``owner`` and the first 10 tensors of ``state_dict`` holding NaN or Inf."""
    bad = nonfinite_tensors(state_dict.items())
    if bad:
        raise ValueError(
            f"{owner}: {len(bad)} weight tensors hold NaN or Inf values: {_listing_bad(bad)}; refusing to save them "
            "(pass allow_nonfinite_weights=True to save anyway)"
        )


def check_state_dict_dtypes(model, state_dict) -> None:
    """``ValueError`` naming the integer or bool tensors of ``state_dict`` (first 10, dtypes, count) that would load
    into floating-point tensors of ``model``."""
    own = model.state_dict()
    bad = []
    for key, value in state_dict.items():
        target = own.get(key)
        if isinstance(value, torch.Tensor) and target is not None and target.is_floating_point() and not (
            value.is_floating_point() or value.is_complex()
        ):
            bad.append(f"{key} ({value.dtype}, the model holds {target.dtype})")
    if bad:
        raise ValueError(
            f"state_dict holds {len(bad)} integer or bool tensors for floating-point weights of "
            f"{type(model).__name__}: {', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''}"
        )
