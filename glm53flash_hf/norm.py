"""Normalisation layers shared by the GLM-5.3-Flash modules.

Source: transformers ``models/glm5_next/modeling_glm5_next.py`` (``Glm5NextTextRMSNorm``); the maths is the
T5/Llama RMSNorm: normalise in fp32, cast back to the input dtype, then multiply by the weight.
"""

import torch
from torch import nn


class Glm53FlashRMSNorm(nn.Module):
    """RMSNorm ``weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype)``.

    Args:
        hidden_size: size of the last dimension.
        eps: variance epsilon (``config.rms_norm_eps``, 1e-5 in the release).

    Shapes: ``x`` ``[..., hidden_size]`` of any float dtype; returns the same shape, in
    ``promote(weight.dtype, x.dtype)`` exactly like the reference (fp32 weight x bf16 input gives fp32).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
