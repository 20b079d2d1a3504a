"""mHC of GLM-5.3-Flash: the site module and its init; ``hc_pre`` and ``hc_post`` are the torch ops of
:mod:`.mhc_ops` or the fused ones of :mod:`.mhc_fused`, chosen per call by :func:`.dispatch.op_for`. Parameter names,
shapes and dtypes are transformers' ``Glm5NextTextHyperConnection``'s."""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init

from .dispatch import op_for, register_fused, requested_backend
from .mhc_ops import hc_expand, hc_head, hc_post_torch, hc_pre_torch, sinkhorn_normalize


def _fused_ops():
    from .mhc_fused import hc_post_fused, hc_pre_fused

    return hc_pre_fused, hc_post_fused


register_fused("mhc", hc_pre_torch, lambda: _fused_ops()[0])
register_fused("mhc", hc_post_torch, lambda: _fused_ops()[1])


class Glm53FlashHyperConnection(nn.Module):
    """One mHC site (attention or FFN): ``fn [(2+N)*N, N*D]`` (model dtype), ``base [(2+N)*N]`` fp32, ``scale [3]``
    fp32 (``N = config.hc_mult``), created as 0, 0, 1; forward is :func:`.mhc_ops.hc_pre_torch` or its fused
    alternative, chosen per call by :func:`.dispatch.op_for` for ``config.kernels['mhc']``.
    ``ValueError`` for ``hc_mult < 1`` or ``hc_sinkhorn_iters < 1`` and for streams not ``[B, S, N, D]``.
    Source: ``Glm5NextTextHyperConnection``."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hc_mult = config.hc_mult
        self.hc_sinkhorn_iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        if self.hc_mult < 1:
            raise ValueError(f"hc_mult must be >= 1; got hc_mult={self.hc_mult}")
        if self.hc_sinkhorn_iters < 1:
            raise ValueError(f"hc_sinkhorn_iters must be >= 1; got hc_sinkhorn_iters={self.hc_sinkhorn_iters}")
        mix = (2 + self.hc_mult) * self.hc_mult
        self.fn = nn.Parameter(torch.zeros(mix, self.hc_mult * config.hidden_size))
        self.base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, hidden_streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if hidden_streams.dim() != 4 or hidden_streams.shape[2] != self.hc_mult:
            raise ValueError(f"hidden_streams must be [B, S, hc_mult={self.hc_mult}, D]; got shape "
                             f"{tuple(hidden_streams.shape)}")
        hc_pre = op_for(hc_pre_torch, requested_backend(self.config, "mhc"), hidden_streams, self.fn, self.base,
                        self.scale)
        return hc_pre(hidden_streams, self.fn, self.base, self.scale, sinkhorn_iters=self.hc_sinkhorn_iters,
                      hc_eps=self.hc_eps, norm_eps=self.norm_eps)

    def extra_repr(self) -> str:
        return f"hc_mult={self.hc_mult}, sinkhorn_iters={self.hc_sinkhorn_iters}, hc_eps={self.hc_eps}"


def init_mhc_weights(module: nn.Module, config) -> None:
    """``Glm5NextPreTrainedModel._init_weights`` for a :class:`Glm53FlashHyperConnection`: ``fn ~ N(0, 0.02)`` (a
    fixed 0.02), ``base = 0``, ``scale = 1``; other modules untouched, loaded tensors skipped."""
    if isinstance(module, Glm53FlashHyperConnection):
        init.normal_(module.fn, mean=0.0, std=0.02)
        init.zeros_(module.base)
        init.ones_(module.scale)


__all__ = ["Glm53FlashHyperConnection", "hc_expand", "hc_head", "hc_post_torch", "hc_pre_torch", "init_mhc_weights",
           "sinkhorn_normalize"]
