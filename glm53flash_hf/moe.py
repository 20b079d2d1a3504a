"""Feed-forward modules of GLM-5.3-Flash: dense MLP, sigmoid top-k router and the routed experts' forward (the
experts module and the MoE block are in :mod:`.modeling_glm53flash`, where transformers looks for the experts
decorator).

Source: transformers ``models/glm5_next/modeling_glm5_next.py`` (``Glm5NextTextMLP``, ``Glm5NextTextTopkRouter``);
parameter names, shapes and dtypes as there, so state dicts are interchangeable. The maths is in :mod:`.moe_ops`,
the fused kernels in :mod:`.moe_fused`."""

from __future__ import annotations

import torch
from torch import nn

from .dispatch import register_fused
from .moe_ops import clamped_swiglu, experts_forward_torch, topk_routing


class Glm53FlashMLP(nn.Module):
    """Dense SwiGLU MLP with clamping, ``down_proj(clamped_swiglu(gate_proj(x), up_proj(x)))`` (``Glm5NextTextMLP``):
    ``[..., hidden_size]`` -> same, in the weights' dtype. ``intermediate_size`` overrides the config's (the shared
    expert's width). Raises ``ValueError`` for a ``hidden_act`` other than ``"silu"`` or a width ``<= 0``."""

    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu' (clamped SwiGLU); got hidden_act={config.hidden_act!r}")
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        if self.intermediate_size <= 0:
            raise ValueError(f"intermediate_size must be positive; got intermediate_size={self.intermediate_size}")
        self.swiglu_limit = config.swiglu_limit
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))


class Glm53FlashTopkRouter(nn.Module):
    """Sigmoid top-k router, :func:`.moe_ops.topk_routing` with the config's fields (``Glm5NextTextTopkRouter``).

    Parameters: ``weight`` fp32 ``[E, hidden]``, buffer ``e_score_correction_bias`` fp32 ``[E]``. Raises
    ``ValueError`` when ``n_group`` does not divide ``E`` or leaves fewer than 2 experts per group, ``topk_group``
    is outside ``[1, n_group]`` or ``num_experts_per_tok`` exceeds the eligible ``topk_group * E // n_group``.
    """

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.hidden_dim = config.hidden_size
        self.routed_scaling_factor = config.routed_scaling_factor
        self.num_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        if self.num_group < 1 or self.num_experts % self.num_group != 0:
            raise ValueError(f"n_routed_experts ({self.num_experts}) must be divisible by n_group; got "
                             f"n_group={self.num_group}")
        if self.num_group > 1 and self.num_experts // self.num_group < 2:
            raise ValueError(f"n_group={self.num_group} leaves fewer than 2 experts per group (E={self.num_experts})")
        if not 1 <= self.topk_group <= self.num_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.num_group}]; got topk_group={self.topk_group}")
        eligible = self.topk_group * (self.num_experts // self.num_group)
        if not 1 <= self.top_k <= eligible:
            raise ValueError("num_experts_per_tok must be in [1, topk_group * n_routed_experts / n_group = "
                             f"{eligible}]; got num_experts_per_tok={self.top_k}")
        self.weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32),
                             persistent=True)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden_states`` ``[T, hidden]`` or ``[B, S, hidden]`` (routed in fp32) -> ``(router_logits fp32 [T, E],
        topk_weights fp32 [T, k], topk_indices int64 [T, k])``; ``ValueError`` for another hidden size."""
        if hidden_states.shape[-1] != self.hidden_dim:
            raise ValueError(f"router input last dim must be hidden_size={self.hidden_dim}; got shape "
                             f"{tuple(hidden_states.shape)}")
        return topk_routing(hidden_states, self.weight, self.e_score_correction_bias, top_k=self.top_k,
                            n_group=self.num_group, topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
                            routed_scaling_factor=self.routed_scaling_factor)


def _experts_forward_fused():
    from .moe_fused import experts_forward_fused

    return experts_forward_fused


register_fused("moe", experts_forward_torch, _experts_forward_fused)


__all__ = ["Glm53FlashMLP", "Glm53FlashTopkRouter", "clamped_swiglu", "experts_forward_torch"]
