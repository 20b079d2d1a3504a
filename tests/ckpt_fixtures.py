"""Checkpoint fixtures for the loading and crop tests: tiny checkpoints in every key-prefix variant, bf16 and FP8.

A canonical checkpoint is written by our own ``save_pretrained`` (published layout, several shards); variants are
derived from it by rewriting the keys of each shard with safetensors, quantizing the keys of
:func:`glm53flash_hf.fp8_blockwise.fp8_keys_of` (``<name>_scale_inv`` placed in *another* shard than the weight, which
the release can do) and adding a few fake vision tensors under the variant's vision prefix.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tiny import randomize_

from glm53flash_hf.configuration_glm53flash import Glm53FlashConfig
from glm53flash_hf.fp8_blockwise import fp8_keys_of, fp8_quantization_config, quantize_fp8_blockwise
from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_JSON = os.path.join(ROOT, "configuration", "tiny.json")
INDEX = "model.safetensors.index.json"
CANONICAL_TEXT = "model.language_model."

# (text prefix, vision prefix) pairs; together they cover every accepted prefix.
VARIANTS = [
    ("model.language_model.", "model.visual."),
    ("language_model.", "visual."),
    ("model.", "vision_tower."),
    ("", "model.visual."),
]


def tiny_config(**text_overrides) -> Glm53FlashConfig:
    """``configuration/tiny.json`` with optional ``text_config`` overrides."""
    with open(TINY_JSON) as f:
        raw = json.load(f)
    raw["text_config"].update(text_overrides)
    return Glm53FlashConfig(**raw)


# Tensors the release stores in fp32; the rest, including the KDA convolutions and the router
# weight that the model keeps in fp32 in memory, are bf16 on disk.
FP32_ON_DISK = ("A_log", "dt_bias", "hc.base", "hc.scale", "e_score_correction_bias")


def bf16_model(config: Glm53FlashConfig | None = None, seed: int = 0) -> Glm53FlashForCausalLM:
    """Randomised causal LM with the release's on-disk dtypes: bf16 except :data:`FP32_ON_DISK`."""
    torch.manual_seed(seed)
    model = Glm53FlashForCausalLM(config or tiny_config())
    randomize_(model, seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if p.is_floating_point() and not name.endswith(FP32_ON_DISK):
                p.data = p.data.to(torch.bfloat16)
    return model.eval()


def save_canonical(model, folder, max_shard_size="120KB") -> str:
    """``model.save_pretrained`` into ``folder`` (several shards); returns the folder."""
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return str(folder)


def read_index(folder) -> dict:
    with open(os.path.join(folder, INDEX)) as f:
        return json.load(f)


def shard_names(folder) -> list[str]:
    """The safetensors files of a folder (from the index, or the single ``model.safetensors``)."""
    if not os.path.isfile(os.path.join(folder, INDEX)):
        return ["model.safetensors"]
    return sorted(set(read_index(folder)["weight_map"].values()))


def read_all(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded folder."""
    out = {}
    for name in shard_names(folder):
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def fake_vision(prefix: str) -> dict[str, torch.Tensor]:
    """A few vision-tower-like tensors under ``prefix`` (the text-only classes must skip them)."""
    gen = torch.Generator().manual_seed(7)
    return {
        f"{prefix}patch_embed.proj.weight": torch.randn(32, 3, 2, 14, 14, generator=gen).to(torch.bfloat16),
        f"{prefix}blocks.0.attn.qkv.weight": torch.randn(96, 32, generator=gen).to(torch.bfloat16),
        f"{prefix}blocks.0.attn.qkv.bias": torch.randn(96, generator=gen).to(torch.bfloat16),
        f"{prefix}merger.proj.weight": torch.randn(64, 64, generator=gen).to(torch.bfloat16),
    }


def rename_text_key(key: str, text_prefix: str) -> str:
    """A canonical key with its ``model.language_model.`` prefix replaced by ``text_prefix``."""
    return text_prefix + key[len(CANONICAL_TEXT) :] if key.startswith(CANONICAL_TEXT) else key


def write_variant(
    canonical: str,
    out: str,
    text_prefix: str = CANONICAL_TEXT,
    vision_prefix: str | None = "model.visual.",
    fp8: bool = False,
    scales_elsewhere: bool = True,
) -> str:
    """Copy ``canonical`` to ``out`` with rewritten keys, optionally FP8, plus fake vision tensors.

    FP8: every key of ``fp8_keys_of`` becomes ``float8_e4m3fn`` with ``<key>_scale_inv``; with
    ``scales_elsewhere`` the scale goes into the next shard (cyclically), not the weight's. ``config.json`` gets
    ``fp8_quantization_config()``.
    """
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(canonical):
        if not name.endswith(".safetensors") and name != INDEX:
            shutil.copy2(os.path.join(canonical, name), os.path.join(out, name))
    index = read_index(canonical)
    shards = shard_names(canonical)
    quantize = fp8_keys_of(index["weight_map"]) if fp8 else set()
    contents: dict[str, dict[str, torch.Tensor]] = {s: {} for s in shards}
    for i, shard in enumerate(shards):
        with safe_open(os.path.join(canonical, shard), framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                new_key = rename_text_key(key, text_prefix)
                if key in quantize:
                    w, s = quantize_fp8_blockwise(tensor)
                    contents[shard][new_key] = w
                    target = shards[(i + 1) % len(shards)] if scales_elsewhere else shard
                    contents[target][new_key + "_scale_inv"] = s
                else:
                    contents[shard][new_key] = tensor
    if vision_prefix is not None:
        contents[shards[-1]].update(fake_vision(vision_prefix))
    weight_map, total = {}, 0
    for shard, tensors in contents.items():
        save_file(tensors, os.path.join(out, shard), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = shard
            total += t.numel() * t.element_size()
    with open(os.path.join(out, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    if fp8:
        path = os.path.join(out, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["quantization_config"] = fp8_quantization_config()
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
    return out


def edit_shard(folder: str, key: str, new: torch.Tensor | None = None, add: dict | None = None) -> None:
    """Replace (or with ``new=None`` delete) ``key`` in its shard, and/or add ``add`` tensors to that shard;
    the index follows."""
    index = read_index(folder)
    shard = index["weight_map"][key]
    path = os.path.join(folder, shard)
    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if new is None:
        del tensors[key]
        del index["weight_map"][key]
    else:
        tensors[key] = new
    for k, t in (add or {}).items():
        tensors[k] = t
        index["weight_map"][k] = shard
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump(index, f, indent=2)


def fp8_error_bound(source: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """Per-element bound on ``|dequant(quant(x)) - x|`` for block-scaled e4m3 (round to nearest).

    With ``s`` the element's block scale, ``x / s`` is rounded to e4m3 (3 mantissa bits, smallest normal 2^-6,
    subnormal spacing 2^-9). In a normal binade ``[2^e, 2^(e+1))`` the spacing is ``2^(e-3)``, so the rounding error
    is at most half of it, ``2^(e-4) <= 2^-4 |x/s|``; below 2^-6 the spacing is 2^-9, error ``<= 2^-10``. Scaling
    back: ``|err| <= max(2^-4 |x|, 2^-10 s)``. The scale division and the dequantizing product are fp32
    operations (relative error 2^-24 each), covered by an extra ``2^-22 |x|``.
    """
    rows, cols = source.shape
    s = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    x = source.float().abs()
    return torch.maximum(x * 2.0**-4, s * 2.0**-10) + x * 2.0**-22


def expected_in_memory(file_tensors: dict[str, torch.Tensor], layer_prefix: str) -> dict[str, torch.Tensor]:
    """The in-memory parameters of one layer (``layer_prefix`` = ``"...layers.N."``) built from its published
    file tensors: per-expert weights stacked (gate then up concatenated on dim 1), q/k/v convolutions concatenated,
    ``f_a/f_b/A_log/dt_bias`` under ``forget_gate``, ``hc_*`` as ``{attn,ffn}_hc.*``."""
    sub = {k[len(layer_prefix) :]: v for k, v in file_tensors.items() if k.startswith(layer_prefix)}
    out: dict[str, torch.Tensor] = {}
    n_experts = 1 + max((int(k.split(".")[2]) for k in sub if k.startswith("mlp.experts.")), default=-1)
    if n_experts:
        gate = torch.stack([sub.pop(f"mlp.experts.{i}.gate_proj.weight") for i in range(n_experts)])
        up = torch.stack([sub.pop(f"mlp.experts.{i}.up_proj.weight") for i in range(n_experts)])
        out["mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        down = [sub.pop(f"mlp.experts.{i}.down_proj.weight") for i in range(n_experts)]
        out["mlp.experts.down_proj"] = torch.stack(down)
    if "self_attn.q_conv1d.weight" in sub:
        out["self_attn.conv1d.weight"] = torch.cat([sub.pop(f"self_attn.{c}_conv1d.weight") for c in "qkv"], dim=0)
    for k, v in sub.items():
        for name in ("f_a_proj.", "f_b_proj.", "A_log", "dt_bias"):
            if k.startswith("self_attn." + name):
                k = k.replace("self_attn.", "self_attn.forget_gate.", 1)
        if k.startswith("hc_"):
            site, p = k[3:].split("_", 1)
            k = f"{site}_hc.{p}"
        out[k] = v
    return out


def n_blocks(shape, block=(128, 128)) -> list[int]:
    return [math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])]
