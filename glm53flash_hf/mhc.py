"""Manifold-constrained hyper-connections (mHC) of GLM-5.3-Flash: the site module, its init, and the per-call entry
points of the two operators ``hc_pre`` and ``hc_post``.

Each entry point calls, per call, the torch op of :mod:`glm53flash_hf.mhc_ops` or its fused alternative in
:mod:`glm53flash_hf.mhc_fused` (:func:`glm53flash_hf.dispatch.op_for`, family ``"mhc"``). Parameter names, shapes and
dtypes equal transformers' ``Glm5NextTextHyperConnection`` (``transformers/models/glm5_next/modeling_glm5_next.py``):
``fn [(2+N)*N, N*D]`` (model dtype), ``base [(2+N)*N]`` fp32, ``scale [3]`` fp32.

``hc_expand``, ``hc_head`` and ``sinkhorn_normalize`` are re-exported from :mod:`glm53flash_hf.mhc_ops`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init

from .dispatch import op_for, register_fused, requested_backend
from .mhc_ops import hc_expand, hc_head, hc_post_torch, hc_pre_torch, sinkhorn_normalize


def _hc_pre_fused():
    from .mhc_fused import hc_pre_fused

    return hc_pre_fused


def _hc_post_fused():
    from .mhc_fused import hc_post_fused

    return hc_post_fused


register_fused("mhc", hc_pre_torch, _hc_pre_fused)
register_fused("mhc", hc_post_torch, _hc_post_fused)


def hc_pre(
    hidden_streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mixing weights of one mHC site and the collapsed sub-block input.

    The maths is :func:`glm53flash_hf.mhc_ops.hc_pre_torch`'s; ``backend`` (``"torch"``, ``"auto"`` or
    ``"fused"``) picks the torch path or :func:`glm53flash_hf.mhc_fused.hc_pre_fused` for this call.

    Args:
        hidden_streams: ``X [B, S, N, D]`` (any float dtype; the fused path takes fp32/bf16/fp16).
        fn: ``[(2+N)*N, N*D]`` (model dtype; used in fp32). base: ``[(2+N)*N]`` fp32. scale: ``[3]`` fp32.
        sinkhorn_iters: ``config.hc_sinkhorn_iters`` (>= 1). hc_eps: ``config.hc_eps``.
        norm_eps: ``config.rms_norm_eps``.
        backend: see :func:`glm53flash_hf.dispatch.choose_backend`.

    Returns:
        ``(post fp32 [B, S, N], comb fp32 [B, S, N, N], collapsed [B, S, D] in X.dtype)``.

    Raises:
        ValueError: wrong ranks or shapes, ``sinkhorn_iters < 1``, unknown backend.
    """
    op = op_for(hc_pre_torch, backend, hidden_streams, fn, base, scale)
    return op(hidden_streams, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, norm_eps=norm_eps)


def hc_post(
    y: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    backend: str = "torch",
) -> torch.Tensor:
    """Expand a sub-block output back to N streams and add the mixed residual streams.

    ``out[..., h, :] = post[..., h] * y + sum_i comb[..., i, h] * residual[..., i, :]`` with the reference's
    rounding (:func:`glm53flash_hf.mhc_ops.hc_post_torch`); ``backend`` (``"torch"``, ``"auto"`` or ``"fused"``)
    picks the torch path or :func:`glm53flash_hf.mhc_fused.hc_post_fused` for this call.

    Args:
        y: ``[B, S, D]`` sub-block output. residual: ``[B, S, N, D]`` streams that entered :func:`hc_pre`.
        post: ``[B, S, N]`` (fp32). comb: ``[B, S, N, N]`` (fp32).
        backend: see :func:`glm53flash_hf.dispatch.choose_backend`.

    Returns:
        ``[B, S, N, D]`` in ``promote(residual.dtype, y.dtype)`` (``residual.dtype`` when they agree).

    Raises:
        ValueError: shapes that do not fit, unknown backend.
    """
    return op_for(hc_post_torch, backend, y, residual, post, comb)(y, residual, post, comb)


class Glm53FlashHyperConnection(nn.Module):
    """One mHC site (attention or FFN) of a decoder layer: parameters and :func:`hc_pre`.

    Parameters (reference names/dtypes): ``fn [(2+N)*N, N*D]`` in the default (model) dtype, ``base [(2+N)*N]``
    fp32, ``scale [3]`` fp32, with ``N = config.hc_mult``, ``D = config.hidden_size``. Created as ``fn = 0``,
    ``base = 0``, ``scale = 1`` (never uninitialised memory); :func:`init_mhc_weights` gives the trained-from-scratch
    init.

    Forward: ``X [B, S, N, D] -> (post fp32 [B, S, N], comb fp32 [B, S, N, N], collapsed [B, S, D] in X.dtype)``
    with the backend of ``config.kernels['mhc']``. Source: ``Glm5NextTextHyperConnection``.

    Raises:
        ValueError: ``hc_mult < 1`` or ``hc_sinkhorn_iters < 1`` in the config; bad input shapes (see
            :func:`hc_pre`).
    """

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
            raise ValueError(
                f"hidden_streams must be [B, S, hc_mult={self.hc_mult}, D]; got shape {tuple(hidden_streams.shape)}"
            )
        op = op_for(hc_pre_torch, requested_backend(self.config, "mhc"), hidden_streams, self.fn, self.base,
                    self.scale)
        return op(hidden_streams, self.fn, self.base, self.scale, sinkhorn_iters=self.hc_sinkhorn_iters,
                  hc_eps=self.hc_eps, norm_eps=self.norm_eps)

    def extra_repr(self) -> str:
        return f"hc_mult={self.hc_mult}, sinkhorn_iters={self.hc_sinkhorn_iters}, hc_eps={self.hc_eps}"


def init_mhc_weights(module: nn.Module, config) -> None:
    """Initialise mHC parameters as transformers' ``Glm5NextPreTrainedModel._init_weights`` does.

    ``Glm53FlashHyperConnection``: ``fn ~ N(0, 0.02)`` (a fixed 0.02, not ``initializer_range``), ``base = 0``,
    ``scale = 1``. Other modules are left alone. Uses ``transformers.initialization`` so loaded tensors are skipped.
    """
    if isinstance(module, Glm53FlashHyperConnection):
        init.normal_(module.fn, mean=0.0, std=0.02)
        init.zeros_(module.base)
        init.ones_(module.scale)


__all__ = [
    "Glm53FlashHyperConnection",
    "hc_expand",
    "hc_head",
    "hc_post",
    "hc_pre",
    "init_mhc_weights",
    "sinkhorn_normalize",
]
