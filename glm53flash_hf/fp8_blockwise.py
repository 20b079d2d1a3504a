"""Block-scaled FP8 as stored by the GLM-5.3-Flash FP8 release (DeepSeek-V3's block scaling).

A weight ``W [out, in]`` is stored as ``float8_e4m3fn`` next to ``<name>_scale_inv`` fp32
``[ceil(out/128), ceil(in/128)]`` (last blocks may be partial); ``W ≈ W_fp8.float() * scale_inv`` per block.
"""

from __future__ import annotations

import math
import re

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = (128, 128)

# Published-key suffixes quantized in the FP8 release.
FP8_KEY_PATTERNS = (
    r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$",
    r"\.mlp\.shared_experts\.(gate|up|down)_proj\.weight$",
    r"\.mlp\.(gate|up|down)_proj\.weight$",
    r"\.self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)\.weight$",
)

# `quantization_config.modules_to_not_convert` written with FP8 checkpoints (module-name fragments; transformers
# matches each as a prefix or a suffix of a module name, so KDA's `b_proj` is named with its parent to leave the
# FP8 `q_b_proj` converted).
MODULES_TO_NOT_CONVERT = [
    "lm_head", "embed_tokens", "model.visual", "kv_b_proj", "indexer", "eh_proj", "mlp.gate", "q_proj", "k_proj",
    "v_proj", "self_attn.b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj",
]  # fmt: skip


def fp8_keys_of(keys) -> set[str]:
    """The subset of published ``keys`` that the FP8 release quantizes (never the vision tower)."""
    keys = [k for k in keys if not re.match(r"^(model\.)?(visual|vision_tower)\.", k)]  # vision stays unquantized
    dsa_prefixes = {k[: -len("q_a_proj.weight")] for k in keys if k.endswith("self_attn.q_a_proj.weight")}
    out = set()
    for k in keys:
        if k.endswith("self_attn.o_proj.weight"):
            if k[: -len("o_proj.weight")] in dsa_prefixes:
                out.add(k)
        elif any(re.search(p, k) for p in FP8_KEY_PATTERNS):
            out.add(k)
    return out


def quantize_fp8_blockwise(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float ``weight`` ``[out, in]`` to block-scaled e4m3 with ``block = (rows, cols)``.

    Returns ``(weight_fp8 [out, in] float8_e4m3fn, scale_inv [ceil(out/rows), ceil(in/cols)] float32)``,
    ``scale_inv = amax(|block|) / 448`` (1 for an all-zero block). Raises ``ValueError`` for a non-2-D weight.
    """
    if weight.dim() != 2:
        raise ValueError(f"FP8 block quantization needs a 2-D weight; got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    br, bc = block
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    w = weight.float()
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w
    blocks = padded.view(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nr * br, nc * bc)[:rows, :cols]
    return q.to(FP8_DTYPE).contiguous(), scale.contiguous()


def dequantize_fp8_blockwise(
    weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16, block: tuple[int, int] = BLOCK
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_blockwise`: ``weight.float() * scale_inv`` (repeated per block, cropped).

    ``block`` is used when the scale grid matches it, else the block is inferred as ``out / scale_rows``;
    ``ValueError`` when ``scale_inv`` cannot tile ``weight``."""
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(
            f"expected a 2-D FP8 weight and 2-D scale_inv; got {tuple(weight.shape)} and {tuple(scale_inv.shape)}"
        )
    rows, cols = weight.shape
    nr, nc = scale_inv.shape
    br = block[0] if math.ceil(rows / block[0]) == nr else rows // nr
    bc = block[1] if math.ceil(cols / block[1]) == nc else cols // nc
    if br * nr < rows or bc * nc < cols or br == 0 or bc == 0:
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} does not tile weight {tuple(weight.shape)}")
    scale = scale_inv.float().repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
    return (weight.float() * scale).to(dtype)


#: e4m3fn round-to-nearest error, relative, of a normal value (3 mantissa bits: half a spacing of 2**(e-3)).
E4M3_NORMAL_RTOL = 2.0**-4
#: e4m3fn round-to-nearest error, absolute in units of the block scale, below the normal range (|x / scale| <
#: 2**-6: subnormal spacing 2**-9).
E4M3_SUBNORMAL_ATOL = 2.0**-10
#: fp32 rounding of ``x / scale`` and ``q * scale`` (and the clamp at 448 it can trigger), relative to ``|x|``.
FP32_SLACK_RTOL = 2.0**-22


def roundtrip_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 elementwise bound ``max(2**-4 |x|, 2**-10 scale) + 2**-22 |x|`` on ``|dequantize(quantize(x)) - x|``,
    ``scale`` (broadcastable to ``x``) each element's block ``amax / 448``; derivation in docs/design.md, FP8."""
    ax = x.float().abs()
    return torch.maximum(E4M3_NORMAL_RTOL * ax, E4M3_SUBNORMAL_ATOL * scale.float()) + FP32_SLACK_RTOL * ax


def fp8_quantization_config() -> dict:
    """The ``quantization_config`` of an FP8 checkpoint's ``config.json`` (transformers' ``FineGrainedFP8Config``)."""
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(BLOCK),
        "modules_to_not_convert": list(MODULES_TO_NOT_CONVERT),
    }
