"""Merging LoRA adapters into a base kept in block-scaled FP8 (:mod:`glm53flash_hf.fp8_kept`): ``dequantize(W) +
delta`` in fp32, re-quantized or kept dense (PEFT's ``merge_and_unload`` would add the delta to the e4m3 values
without their scales). LoRA layers on non-FP8 modules are merged by PEFT as usual.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from ..fp8_blockwise import quantize_fp8_blockwise, roundtrip_error_bound
from ..fp8_kept import FP8_DTYPE, Glm53FlashFP8Experts, Glm53FlashFP8Linear, _row_groups, _tiles


def dequantize_rows(weight: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """fp32 ``[out, in]`` of one FP8 weight (plain grid or separately blocked halves), tile by tile."""
    out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    for r0, r1, w, s in _tiles(weight, scale_inv, tuple(block)):
        out[r0:r1] = _dequantize_fp8_weight(w, s, list(block), torch.float32)
    return out


def _merge_one(weight, scale, delta, block, fp8: bool, errors: list, bound_ratios: list):
    dense = dequantize_rows(weight, scale, block) + delta.float()
    if not fp8:
        return dense, None
    # re-quantized on the scale grid of ``scale`` (fp8_kept._row_groups: plain grid or separately blocked halves)
    groups = _row_groups(dense.shape[0], scale.shape[0], block[0])
    parts = [quantize_fp8_blockwise(dense[r0:r1], tuple(block)) for r0, r1, _ in groups]
    q, s = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    back = dequantize_rows(q, s, block)
    err = (back - dense).abs()
    errors.append((err.max() / dense.abs().max().clamp_min(1e-30)).item())
    block_scale = dequantize_rows(torch.ones_like(q), s, block)  # each element's block scale
    bound_ratios.append((err / roundtrip_error_bound(dense, block_scale)).max().item())
    return q, s


@torch.no_grad()
def merge_lora_fp8(peft_model, fp8: bool = True, dtype: torch.dtype = torch.bfloat16):
    """Merge the active LoRA adapter of ``peft_model`` into its base and return ``(model, report)``.

    ``peft_model``: a ``peft.PeftModel`` over FP8-kept modules (LoRA through ``target_modules`` /
    ``target_parameters``). With ``x = dequantize(W) + delta`` in fp32 per FP8 weight: ``fp8=False`` stores ``x`` in
    ``dtype`` (plain modules, no quantizer); ``fp8=True`` stores ``quantize(x)`` with fresh ``amax / 448`` block scales,
    each element within :func:`.fp8_blockwise.roundtrip_error_bound` of ``x``.

    Returns:
        the merged base model and ``{"fp8", "merged_fp8_weights", "max_rel_roundtrip_error",
        "max_roundtrip_bound_ratio"}``: the largest ``max |rt(x) - x| / max |x|`` and ``|rt(x) - x| / bound`` over
        the re-quantized weights (the latter at most 1; both 0 with ``fp8=False``).

    Raises:
        ValueError: when ``peft_model`` has more than one active adapter.
    """
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    adapters = peft_model.active_adapters
    if len(adapters) != 1:
        raise ValueError(f"merge_lora_fp8 merges one active adapter; got active_adapters={adapters!r}")
    adapter = adapters[0]
    errors, ratios, merged = [], [], 0
    for _, layer in list(peft_model.named_modules()):
        if not isinstance(layer, LoraLayer) or adapter not in layer.lora_A:
            continue
        base = layer.get_base_layer()
        if isinstance(layer, ParamWrapper) and isinstance(base, Glm53FlashFP8Experts):
            name = layer.parameter_name
            weight, scale = getattr(base, name), getattr(base, name + "_scale_inv")
            delta = layer.get_delta_weight(adapter)
            pairs = [
                _merge_one(weight[e], scale[e], delta[e], base.block_size, fp8, errors, ratios)
                for e in range(len(weight))
            ]
            q, s = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]) if fp8 else None
        elif isinstance(base, Glm53FlashFP8Linear) and base.weight.dtype == FP8_DTYPE:
            name, weight, scale = "weight", base.weight, base.weight_scale_inv
            q, s = _merge_one(weight, scale, layer.get_delta_weight(adapter), base.block_size, fp8, errors, ratios)
        else:
            continue
        if fp8:
            weight.data.copy_(q)
            scale.data.copy_(s)
        else:
            base._dense = {**getattr(base, "_dense", {}), name: q.to(dtype)}
        merged += 1
        layer.lora_A.pop(adapter)
        layer.lora_B.pop(adapter)
    model = peft_model.merge_and_unload()
    if not fp8:
        _densify(model, dtype)
    report = {
        "fp8": fp8, "merged_fp8_weights": merged, "max_rel_roundtrip_error": max(errors, default=0.0),
        "max_roundtrip_bound_ratio": max(ratios, default=0.0),
    }  # fmt: skip
    return model, report


def _densify(model, dtype) -> None:
    """Replace every FP8 module of ``model`` by its dense counterpart in ``dtype`` (merged weights where
    :func:`merge_lora_fp8` left them, else the dequantized FP8 weights) and drop the model's FP8 quantizer."""
    from ..modeling_glm53flash import Glm53FlashExperts

    for name, module in list(model.named_modules()):
        dense = getattr(module, "_dense", {})
        if isinstance(module, Glm53FlashFP8Linear):
            w = dense.get("weight")
            if w is None:
                w = dequantize_rows(module.weight, module.weight_scale_inv, module.block_size).to(dtype)
            new = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, dtype=dtype)
            new.weight = nn.Parameter(w, requires_grad=False)
            if module.bias is not None:
                new.bias = nn.Parameter(module.bias.detach().to(dtype), requires_grad=False)
        elif isinstance(module, Glm53FlashFP8Experts):
            new = Glm53FlashExperts(module.config).to(dtype)
            for p in ("gate_up_proj", "down_proj"):
                w = dense.get(p)
                if w is None:
                    fp8, scale = getattr(module, p), getattr(module, p + "_scale_inv")
                    w = torch.stack([
                        dequantize_rows(fp8[e], scale[e], module.block_size) for e in range(len(fp8))
                    ]).to(dtype)  # fmt: skip
                setattr(new, p, nn.Parameter(w, requires_grad=False))
        else:
            continue
        model.set_submodule(name, new)
    for config in (model.config, model.config.get_text_config(decoder=True)):
        if hasattr(config, "quantization_config"):
            del config.quantization_config
    model.hf_quantizer = None
