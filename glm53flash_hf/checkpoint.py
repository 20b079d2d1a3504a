"""Checkpoint layout: conversions between the published GLM-5.3-Flash keys and our modules, and loading inside the
checks of :mod:`.checkpoint_checks` (files on disk and the atomic save: :mod:`.checkpoint_io`).

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
import os
import re
import threading

import torch
from transformers import FineGrainedFP8Config, PreTrainedConfig
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

from .checkpoint_checks import (
    CheckpointInfo,
    check_config_matches_checkpoint,
    check_finite_weights,
    check_loaded_dtypes,
    fp8_block_size,
    inspect_checkpoint,
    strict_load_report,
    text_size_fields,
)
from .checkpoint_io import checkpoint_keys, local_folder, recover_interrupted_save

logger = logging.get_logger(__name__)

# Checkpoint keys of the vision tower, skipped by the text-only classes.
VISION_KEY_PATTERNS = (r"^model\.visual\.", r"^visual\.", r"^vision_tower\.", r"^model\.vision_tower\.")
# Text-key prefixes seen in released and community checkpoints, canonical first.
TEXT_PREFIXES = ("model.language_model.", "language_model.", "model.", "")
# The text model (AutoModel) has no LM head: a full checkpoint's head is skipped (and reported) too.
LM_HEAD_KEY_PATTERNS = (r"^lm_head\.weight$",)


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


def count_matching(keys: list[str] | None, patterns) -> int:
    """Number of ``keys`` matching any regex in ``patterns`` (0 when keys is None)."""
    return sum(1 for k in keys or () if any(re.search(p, k) for p in patterns))


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
    prefix = re.compile("^(?:" + "|".join(re.escape(p) for p in TEXT_PREFIXES[:-1]) + ")")
    return {re.sub(r"\.experts\.\d+\.(gate|up|down)_proj$", ".experts", prefix.sub("", key.removesuffix(".weight")))
            for key in keys}


def _request_fp8_dequantization(cls, path, ckpt: CheckpointInfo, kwargs: dict, dequantize: bool = True) -> None:
    """Make transformers load FP8 ``ckpt`` dequantized or kept in FP8 (``FineGrainedFP8Config`` + the file's config)."""
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
    or fp32 where ``model._get_dtype_plan`` (``_keep_in_fp32_modules_strict``) names it; FP8 parameters are left as
    they are. Returns the names cast. (transformers < 5.25 leaves an FP8 checkpoint loaded with ``dequantize=True``
    in the file's dtype.)"""
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
    if ckpt is not None and (not isinstance(config, (str, os.PathLike)) or local_folder(config) is not None):
        fields = text_size_fields(config, local_folder(config) or ckpt.folder)
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

