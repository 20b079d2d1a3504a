"""Normalisation layers (source: transformers ``models/glm5_next/modeling_glm5_next.py``, ``Glm5NextTextRMSNorm``)."""

import torch
from torch import nn


class Glm53FlashRMSNorm(nn.Module):
    """RMSNorm ``weight * x / sqrt(mean(x^2) + eps)`` in fp32 over the last dimension (``hidden_size``; ``eps``:
    ``config.rms_norm_eps``); ``x`` ``[..., hidden_size]`` of any float dtype, output in
    ``promote(weight.dtype, x.dtype)``.
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
        out_dtype = torch.promote_types(self.weight.dtype, input_dtype)
        return (self.weight.float() * hidden_states).to(out_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
