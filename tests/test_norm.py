"""Glm53FlashRMSNorm vs transformers' Glm5NextTextRMSNorm (bit-equal in fp32, with and without autograd) and vs a
float64 evaluation of the formula; in bf16 one rounding (the reference rounds the normalised value, then the
product), so never further from float64 than the reference."""

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
    xb = x.bfloat16()
    xn64 = xb.double() * torch.rsqrt(xb.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    with torch.no_grad():
        # bf16 input, fp32 weight: fp32 output (as the reference's dtype rule), no rounding of the normalised value
        got, theirs = ours(xb), ref(xb)
        assert got.dtype == theirs.dtype == torch.float32
        exact = ours.weight.double() * xn64
        assert (got.double() - exact).abs().max() <= 1e-6 * exact.abs().max()
        assert (got.double() - exact).norm() < (theirs.double() - exact).norm()
        # bf16 input and weight: the fp32 product rounded once to bf16
        ours.bfloat16(), ref.bfloat16()
        got, theirs = ours(xb), ref(xb)
        assert got.dtype == theirs.dtype == torch.bfloat16
        xn = xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        assert torch.equal(got, (ours.weight.float() * xn).bfloat16())
        exact = ours.weight.double() * xn64
        assert (got.double() - exact).norm() < (theirs.double() - exact).norm()
