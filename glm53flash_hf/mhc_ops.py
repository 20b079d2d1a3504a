"""Torch maths of GLM-5.3-Flash's manifold-constrained hyper-connections (mHC): the oracle of the fused kernels and
the path of CPU tensors and decoding.

mHC (DeepSeek, "mHC: Manifold-Constrained Hyper-Connections") carries ``N = hc_mult`` residual streams per token.
At each sub-block (attention or FFN), ``hc_pre`` computes per-token mixing weights from the streams and collapses the
streams into the sub-block input; ``hc_post`` expands the sub-block output back to ``N`` streams and adds the
streams mixed by ``comb``, a matrix made (approximately) doubly stochastic by Sinkhorn-Knopp normalisation. The maths
equals transformers' ``transformers/models/glm5_next/modeling_glm5_next.py``: ``Glm5NextTextHyperConnection`` (with
``Glm5NextTextUnweightedRMSNorm``), ``Glm5NextTextHyperHead`` and the ``hc_post`` lines of
``Glm5NextTextDecoderLayer.forward``.

Evaluation order (the reference's maths, fewer passes over the ``N*D`` streams):

* the unweighted RMS norm is folded past the projection, ``linear(x * r, fn) == r * linear(x, fn)`` with
  ``r = rsqrt(mean(x^2) + eps)`` per token, so no normalised fp32 copy of the streams is materialised;
  ``mean(x^2)`` comes from ``torch.linalg.vector_norm`` (one read, no squared temporary);
* the collapse ``sum_n pre_n * X_n`` is one batched ``[1, N] @ [N, D]`` product per token on the fp32 streams that
  the projection reads anyway;
* ``hc_post`` adds into the mixing product in place, with the reference's rounding (``post`` and ``comb`` are cast to
  the residual dtype first);
* the Sinkhorn rounds are the reference's op sequence (``torch.softmax``, then column and (row, column)
  normalisations, each with ``+ hc_eps``), vectorised over tokens, always ``hc_sinkhorn_iters`` of them.

:func:`mix_weights` (normalised projections -> ``pre``, ``post``, ``comb``) is shared with the fused ``hc_pre`` of
:mod:`glm53flash_hf.mhc_fused`, which differentiates it with torch autograd: both paths run one op sequence there.
This module imports only torch; :mod:`glm53flash_hf.mhc` (modules, per-call dispatch) and
:mod:`glm53flash_hf.mhc_fused` (Triton kernels) import from it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "check_hc_post_args",
    "check_hc_pre_args",
    "hc_expand",
    "hc_head",
    "hc_post_torch",
    "hc_pre_torch",
    "mix_weights",
    "sinkhorn_normalize",
]


def check_hc_pre_args(hidden_streams, fn, base, scale, sinkhorn_iters: int) -> None:
    """Validate the arguments of ``hc_pre`` (both paths).

    Raises:
        ValueError: ``hidden_streams`` not ``[B, S, N, D]``, ``fn`` not ``[(2+N)*N, N*D]``, ``base`` not
            ``[(2+N)*N]``, ``scale`` not ``[3]``, or ``sinkhorn_iters < 1``.
    """
    if hidden_streams.dim() != 4:
        raise ValueError(f"hidden_streams must be [B, S, N, D]; got shape {tuple(hidden_streams.shape)}")
    _, _, n, dim = hidden_streams.shape
    mix = (2 + n) * n
    if tuple(fn.shape) != (mix, n * dim):
        raise ValueError(f"fn must be [(2+N)*N, N*D] = [{mix}, {n * dim}] for N={n}, D={dim}; got {tuple(fn.shape)}")
    if tuple(base.shape) != (mix,) or tuple(scale.shape) != (3,):
        raise ValueError(f"base must be [{mix}] and scale [3]; got {tuple(base.shape)} and {tuple(scale.shape)}")
    if sinkhorn_iters < 1:
        raise ValueError(f"hc_sinkhorn_iters must be >= 1; got {sinkhorn_iters}")


def check_hc_post_args(y, residual, post, comb) -> None:
    """Validate the arguments of ``hc_post`` (both paths).

    Raises:
        ValueError: ``residual`` not ``[B, S, N, D]``, or ``y``, ``post``, ``comb`` not ``[B, S, D]``, ``[B, S, N]``,
            ``[B, S, N, N]``.
    """
    if residual.dim() != 4:
        raise ValueError(f"residual must be [B, S, N, D]; got shape {tuple(residual.shape)}")
    b, s, n, d = residual.shape
    if tuple(y.shape) != (b, s, d) or tuple(post.shape) != (b, s, n) or tuple(comb.shape) != (b, s, n, n):
        raise ValueError(
            f"hc_post shapes do not fit residual [B,S,N,D]={tuple(residual.shape)}: y {tuple(y.shape)} (want "
            f"[B,S,D]), post {tuple(post.shape)} (want [B,S,N]), comb {tuple(comb.shape)} (want [B,S,N,N])"
        )


def sinkhorn_normalize(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Make positive ``[..., N, N]`` matrices (approximately) doubly stochastic, as the reference does.

    Sinkhorn-Knopp with the reference's schedule: one column normalisation ``c / (colsum + eps)``, then ``iters - 1``
    rounds of (row, column) normalisation, each with ``+ eps`` in the denominator; no early exit. Source:
    ``Glm5NextTextHyperConnection.forward``.

    Args:
        comb: ``[..., N, N]`` fp32 (or fp64), already ``softmax(...) + eps``.
        iters: ``config.hc_sinkhorn_iters`` (20 in the release), ``>= 1``.
        eps: ``config.hc_eps``.

    Returns:
        Same shape and dtype; differentiable.
    """
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):  # a fixed count, each step vectorised over all tokens
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mix_weights(
    proj: torch.Tensor,
    mean_sq: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    n: int,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token part of ``hc_pre``: projections and RMS statistics to ``pre``, ``post`` and ``comb``.

    ``m = proj * rsqrt(mean_sq + norm_eps)``; ``pre = sigmoid(m[:N] * scale[0] + base[:N]) + hc_eps``;
    ``post = 2 * sigmoid(m[N:2N] * scale[1] + base[N:2N])``;
    ``comb = sinkhorn(softmax(m[2N:].view(N, N) * scale[2] + base[2N:].view(N, N), dim=-1) + hc_eps)``.

    Args:
        proj: ``[..., (2+N)*N]`` un-normalised projections ``x @ fn^T`` (fp32, or fp64 for fp64 streams).
        mean_sq: ``[..., 1]`` ``mean(x^2)`` over the token's ``N*D`` stream values, same dtype.
        base: ``[(2+N)*N]`` fp32. scale: ``[3]`` fp32.
        n: ``N``. sinkhorn_iters: ``>= 1``. hc_eps: ``config.hc_eps``. norm_eps: ``config.rms_norm_eps``.

    Returns:
        ``(pre [..., N], post [..., N], comb [..., N, N])`` in the promoted dtype of the inputs; differentiable in
        every input.
    """
    mixes = proj * torch.rsqrt(mean_sq + norm_eps)
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb_logits = comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n)
    comb = sinkhorn_normalize(torch.softmax(comb_logits, dim=-1) + hc_eps, sinkhorn_iters, hc_eps)
    return pre, post, comb


def hc_pre_torch(
    hidden_streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mixing weights of one mHC site and the collapsed sub-block input, in torch.

    Per token, with the streams ``X [N, D]`` flattened to ``x [N*D]`` in fp32:
    ``m = rsqrt(mean(x^2) + norm_eps) * (fn_fp32 @ x)`` (``(2+N)*N`` values), then :func:`mix_weights`, and
    ``collapsed = sum_n pre_n * X_n`` computed in fp32 and cast to ``X.dtype``. Source:
    ``Glm5NextTextHyperConnection.forward``.

    Args:
        hidden_streams: ``X [B, S, N, D]`` (any float dtype, any strides).
        fn: ``[(2+N)*N, N*D]`` projection (model dtype; used in fp32).
        base: ``[(2+N)*N]`` fp32. scale: ``[3]`` fp32.
        sinkhorn_iters: ``config.hc_sinkhorn_iters`` (>= 1). hc_eps: ``config.hc_eps``.
        norm_eps: ``config.rms_norm_eps`` (the unweighted RMS norm's epsilon).

    Returns:
        ``(post fp32 [B, S, N], comb fp32 [B, S, N, N], collapsed [B, S, D] in X.dtype)``; ``comb[i, j]`` weighs
        input stream ``i`` into output stream ``j`` (see :func:`hc_post_torch`). Float64 streams are computed and
        returned in float64.

    Raises:
        ValueError: wrong ranks or shapes, ``sinkhorn_iters < 1`` (:func:`check_hc_pre_args`).
    """
    check_hc_pre_args(hidden_streams, fn, base, scale, sinkhorn_iters)
    batch, seq, n, dim = hidden_streams.shape
    compute = torch.promote_types(hidden_streams.dtype, torch.float32)  # fp32 (fp64 for float64 streams)
    x = hidden_streams.reshape(batch, seq, n * dim).to(compute)  # no copy for contiguous fp32 streams
    mean_sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / (n * dim)
    pre, post, comb = mix_weights(
        F.linear(x, fn.to(compute)), mean_sq, base, scale,
        n=n, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, norm_eps=norm_eps,
    )
    collapsed = torch.matmul(pre.unsqueeze(-2), x.view(batch, seq, n, dim)).squeeze(-2)
    return post, comb, collapsed.to(hidden_streams.dtype)


def hc_post_torch(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand a sub-block output back to N streams and add the mixed residual streams, in torch.

    ``out[..., h, :] = post[..., h] * y + sum_i comb[..., i, h] * residual[..., i, :]``, i.e.
    ``post[..., None] * y[..., None, :] + comb^T @ residual`` (note the transpose). Rounding as the reference
    (``Glm5NextTextDecoderLayer.forward``): ``post`` and ``comb`` are first cast to ``residual.dtype``, the two
    terms are computed in that dtype and added (bit-equal to the reference in bf16 and fp32).

    Args:
        y: ``[B, S, D]`` sub-block output. residual: ``[B, S, N, D]`` streams that entered ``hc_pre``.
        post: ``[B, S, N]`` (fp32). comb: ``[B, S, N, N]`` (fp32).

    Returns:
        ``[B, S, N, D]`` in ``promote(residual.dtype, y.dtype)`` (``residual.dtype`` when they agree).

    Raises:
        ValueError: shapes that do not fit (:func:`check_hc_post_args`).
    """
    check_hc_post_args(y, residual, post, comb)
    dtype = residual.dtype
    out = torch.matmul(comb.to(dtype).transpose(-1, -2), residual)
    expanded = post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2)
    if expanded.dtype == out.dtype:
        return out.add_(expanded)  # the matmul output is not saved for backward; a + b == b + a bitwise
    return out + expanded


def hc_head(hidden_streams: torch.Tensor) -> torch.Tensor:
    """Final stream collapse of GLM-5.3-Flash: the unweighted mean over the N streams.

    ``[B, S, N, D] -> [B, S, D]``, same dtype. Source: ``Glm5NextTextHyperHead``.

    Raises:
        ValueError: input not 4-D.
    """
    if hidden_streams.dim() != 4:
        raise ValueError(f"hidden_streams must be [B, S, N, D]; got shape {tuple(hidden_streams.shape)}")
    return hidden_streams.mean(dim=2)


def hc_expand(embeds: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """Copy the token embeddings into ``hc_mult`` identical streams: ``[B, S, D] -> [B, S, N, D]``, contiguous.

    Contiguous, so that later per-stream updates never alias one buffer. Source: ``Glm5NextTextModel.forward``.

    Raises:
        ValueError: ``embeds`` not 3-D or ``hc_mult < 1``.
    """
    if embeds.dim() != 3:
        raise ValueError(f"embeds must be [B, S, D]; got shape {tuple(embeds.shape)}")
    if hc_mult < 1:
        raise ValueError(f"hc_mult must be >= 1; got hc_mult={hc_mult}")
    return embeds.unsqueeze(2).expand(-1, -1, hc_mult, -1).contiguous()
