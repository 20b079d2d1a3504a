"""Glm53FlashRMSNorm vs transformers' Glm5NextTextRMSNorm, and its fp32 inference path (torch's fused rms_norm) vs
the composite path used with autograd: bit-equal (same formula; measured bit-equal for hidden 64..4096)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextRMSNorm

from glm53flash_hf.norm import Glm53FlashRMSNorm


@pytest.mark.parametrize("dim", [64, 256, 4096])
def test_inference_path_bit_equal_and_matches_transformers(dim):
    ours, ref = Glm53FlashRMSNorm(dim, 1e-5), Glm5NextTextRMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_(generator=torch.Generator().manual_seed(dim))
        ref.weight.copy_(ours.weight)
    x = torch.randn(3, 19, dim, generator=torch.Generator().manual_seed(1)) * 3
    with_grad = ours(x)  # composite path (grad mode on)
    assert with_grad.grad_fn is not None
    with torch.no_grad():
        fast = ours(x)
        expected = ref(x)
    assert torch.equal(fast, with_grad)
    assert torch.equal(fast, expected)
    xb = x.bfloat16()  # bf16 input, fp32 weight: composite path (the reference's rounding), fp32 output
    with torch.no_grad():
        assert torch.equal(ours(xb), ref(xb)) and ours(xb).dtype == torch.float32
