"""Checkpoint layout: conversions between the published GLM-5.3-Flash keys and our modules, strict loading.

The published layout (model-spec §11) stores per-expert weights ``mlp.experts.{i}.{gate,up,down}_proj.weight``,
three KDA convolutions ``self_attn.{q,k,v}_conv1d.weight``, the forget gate at ``self_attn.{f_a_proj,f_b_proj,
A_log,dt_bias}`` and the mHC parameters as ``hc_{attn,ffn}_{fn,base,scale}``, under ``model.language_model.``.
In memory (as in transformers' ``glm5_next``) experts are fused 3-D tensors, the convolutions one fused
``conv1d``, the forget gate a ``forget_gate`` submodule and mHC ``attn_hc`` / ``ffn_hc`` modules.

transformers skips its own ``glm5_next`` conversions for remote-code classes
(``conversion_mapping.get_model_conversion_mapping``), so :func:`register_conversions` registers ours, keyed by
our class names, at import of the modeling file. The same list is reverted by ``save_pretrained``.
"""

from __future__ import annotations

import json
import os
import re

from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Checkpoint keys of the vision tower, skipped by the text-only class.
VISION_KEY_PATTERNS = (r"^model\.visual\.", r"^visual\.", r"^vision_tower\.", r"^model\.vision_tower\.")


def layer_conversions() -> list:
    """The per-layer transforms (published key → in-memory parameter), independent of the key prefix.

    Order matters only for documentation; renamings apply before converters (transformers' loader).
    """
    renames = [
        (r"self_attn\.f_a_proj\.", "self_attn.forget_gate.f_a_proj."),
        (r"self_attn\.f_b_proj\.", "self_attn.forget_gate.f_b_proj."),
        (r"self_attn\.dt_bias", "self_attn.forget_gate.dt_bias"),
        (r"self_attn\.A_log", "self_attn.forget_gate.A_log"),
    ] + [(f"hc_{site}_{p}", f"{site}_hc.{p}") for site in ("attn", "ffn") for p in ("fn", "base", "scale")]
    out: list = [WeightRenaming(source_patterns=s, target_patterns=t) for s, t in renames]
    out += [
        WeightConverter(
            source_patterns=["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
            target_patterns="mlp.experts.gate_up_proj",
            operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
        WeightConverter(
            source_patterns="mlp.experts.*.down_proj.weight",
            target_patterns="mlp.experts.down_proj",
            operations=[MergeModulelist(dim=0)],
        ),
        WeightConverter(
            source_patterns=["self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight"],
            target_patterns="self_attn.conv1d.weight",
            operations=[Concatenate(dim=0)],
        ),
    ]
    return out


def register_conversions() -> None:
    """Register our conversions with transformers (idempotent; the module may be imported from several
    remote-code cache folders, hence ``overwrite=True``).

    * ``Glm53FlashForCausalLM``: ``model.language_model.`` → ``model.`` plus :func:`layer_conversions`.
    * ``Glm53FlashTextModel``: :func:`layer_conversions` (keys relative to the text model).
    """
    register_checkpoint_conversion_mapping(
        "Glm53FlashForCausalLM",
        [WeightRenaming(source_patterns=r"^model\.language_model\.", target_patterns="model.")] + layer_conversions(),
        overwrite=True,
    )
    register_checkpoint_conversion_mapping("Glm53FlashTextModel", layer_conversions(), overwrite=True)


def checkpoint_keys(path: str) -> list[str] | None:
    """All tensor names of a local checkpoint folder (from the safetensors index or file headers), or None
    when ``path`` is not a local folder with safetensors files."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        return None
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return list(json.load(f)["weight_map"])
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return list(f.keys())
    return None


def _listing(keys, limit: int = 20) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return f"{shown}{f', ... ({len(keys)} in all)' if len(keys) > limit else f' ({len(keys)})'}"


def strict_load_report(model, info: dict, *, allow_missing: bool = False, allow_unexpected: bool = False) -> None:
    """Raise on a load that would leave parameters at random init or drop checkpoint tensors.

    Args:
        model: the loaded model.
        info: ``from_pretrained(..., output_loading_info=True)``'s dict (``missing_keys``, ``unexpected_keys``,
            ``mismatched_keys``, ``error_msgs``).
        allow_missing / allow_unexpected: explicit opt-outs; they turn the error into a warning.

    Raises:
        ValueError: listing the first 20 keys and the count, for missing keys, unexpected keys, or shape
            mismatches (key, checkpoint shape, model shape).
    """
    mismatched = info.get("mismatched_keys") or set()
    if mismatched:
        rows = [f"{k}: checkpoint {tuple(a)} vs model {tuple(b)}" for k, a, b in sorted(mismatched)]
        raise ValueError(f"Shape mismatch for {len(rows)} checkpoint tensors: " + "; ".join(rows[:20]))
    missing = set(info.get("missing_keys") or ())
    unexpected = set(info.get("unexpected_keys") or ())
    for keys, allowed, what in ((missing, allow_missing, "missing from"), (unexpected, allow_unexpected, "unexpected in")):
        if not keys:
            continue
        message = f"{len(keys)} keys {what} the checkpoint for {type(model).__name__}: {_listing(keys)}"
        if allowed:
            logger.warning(message + " (allowed by the caller; those parameters keep their initial values)")
        else:
            raise ValueError(message)


def count_matching(keys: list[str] | None, patterns) -> int:
    """Number of ``keys`` matching any regex in ``patterns`` (0 when keys is None)."""
    if not keys:
        return 0
    compiled = [re.compile(p) for p in patterns]
    return sum(1 for k in keys if any(c.search(k) for c in compiled))
