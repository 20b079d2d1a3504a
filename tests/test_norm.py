"""Glm53FlashRMSNorm vs transformers' Glm5NextTextRMSNorm (bit-equal, with and without autograd) and vs a float64
evaluation of the formula."""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextRMSNorm

from glm53flash_hf.norm import Glm53FlashRMSNorm


@pytest.mark.parametrize("dim", [64, 256, 4096])
def test_rms_norm_matches_transformers_and_float64(dim):
    ours, ref = Glm53FlashRMSNorm(dim, 1e-5), Glm5NextTextRMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_(generator=torch.Generator().manual_seed(dim))
        ref.weight.copy_(ours.weight)
    x = torch.randn(3, 19, dim, generator=torch.Generator().manual_seed(1)) * 3
    with_grad = ours(x)
    assert with_grad.grad_fn is not None
    with torch.no_grad():
        assert torch.equal(ours(x), with_grad)
        assert torch.equal(ours(x), ref(x))
    x64 = x.double()
    expected = ours.weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(with_grad.double(), expected, rtol=2e-6, atol=2e-6)
    xb = x.bfloat16()  # bf16 input, fp32 weight: the reference's rounding, fp32 output
    with torch.no_grad():
        assert torch.equal(ours(xb), ref(xb)) and ours(xb).dtype == torch.float32
