"""Torch path of the mHC family (manifold-constrained hyper-connections): ``hc_pre``, ``hc_post``, the Sinkhorn
normalisation and the stream expand/collapse. Oracle of :mod:`.mhc_fused`; path of CPU tensors and decoding.

Sources: DeepSeek, "mHC: Manifold-Constrained Hyper-Connections"; transformers ``Glm5NextTextHyperConnection``,
``Glm5NextTextHyperHead`` and the ``hc_post`` lines of ``Glm5NextTextDecoderLayer.forward`` (``models/glm5_next``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .graph_ops import autocast_off, no_autocast

__all__ = ["check_hc_post_args", "check_hc_pre_args", "hc_expand", "hc_head", "hc_post_torch", "hc_pre_torch",
           "mix_weights", "sinkhorn_normalize"]


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
        raise ValueError(f"hc_post shapes do not fit residual [B,S,N,D]={tuple(residual.shape)}: y {tuple(y.shape)} "
                         f"(want [B,S,D]), post {tuple(post.shape)} (want [B,S,N]), comb {tuple(comb.shape)} (want "
                         "[B,S,N,N])")


def sinkhorn_normalize(comb: torch.Tensor, iters: int, eps: float, steps: list | None = None) -> torch.Tensor:
    """Sinkhorn-Knopp on positive ``comb [..., N, N]`` (fp32/fp64) with the reference's schedule: one column
    normalisation ``c / (colsum + eps)``, then ``iters - 1`` (row, column) rounds, no early exit. Same shape and
    dtype; differentiable. Appends ``(output, denominator)`` of every step to ``steps`` when given."""
    for step in range(2 * iters - 1):  # column, then (row, column) rounds: a fixed count, vectorised over tokens
        denom = comb.sum(dim=-1 if step % 2 else -2, keepdim=True) + eps
        comb = comb / denom
        if steps is not None:
            steps.append((comb, denom))
    return comb


def mix_weights(proj: torch.Tensor, mean_sq: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, n: int,
                sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token part of ``hc_pre`` (shared with :mod:`.mhc_fused`), from ``proj [..., (2+N)*N] = x @ fn^T``
    and ``mean_sq [..., 1] = mean(x^2)`` (fp32, fp64 for fp64 streams)::

        m = proj * rsqrt(mean_sq + norm_eps);  pre = sigmoid(m[:N] * scale[0] + base[:N]) + hc_eps
        post = 2 * sigmoid(m[N:2N] * scale[1] + base[N:2N])
        comb = sinkhorn(softmax(m[2N:].view(N, N) * scale[2] + base[2N:].view(N, N), -1) + hc_eps)

    Returns ``(pre [..., N], post [..., N], comb [..., N, N])`` in the inputs' promoted dtype; differentiable."""
    return _mix_weights(proj, mean_sq, base, scale, n, sinkhorn_iters, hc_eps, norm_eps, keep=False)[:3]


def _mix_weights(proj, mean_sq, base, scale, n: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float, keep: bool):
    """:func:`mix_weights`' op sequence; with ``keep``, also the intermediates :func:`_mix_weights_backward` reads:
    ``(mixes, rsqrt factor, the two sigmoids, softmax, [(Sinkhorn output, denominator) per step])``."""
    rs = torch.rsqrt(mean_sq + norm_eps)
    mixes = proj * rs
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    sig_pre = torch.sigmoid(pre_w * pre_s + pre_b)
    pre = sig_pre + hc_eps
    sig_post = torch.sigmoid(post_w * post_s + post_b)
    post = 2 * sig_post
    comb_logits = comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n)
    probs = torch.softmax(comb_logits, dim=-1)
    steps = [] if keep else None
    comb = sinkhorn_normalize(probs + hc_eps, sinkhorn_iters, hc_eps, steps)
    return pre, post, comb, ((mixes, rs, sig_pre, sig_post, probs, steps) if keep else None)


def _mix_weights_backward(proj, scale, kept, d_pre, d_post, d_comb, n: int):
    """Gradients of :func:`mix_weights` w.r.t. ``(proj, mean_sq, base, scale)`` from the intermediates ``kept`` of
    :func:`_mix_weights` and the output gradients (``None``: zero), in the compute dtype (``base``/``scale``
    gradients summed over tokens, shapes ``[(2+N)*N]`` and ``[3]``).

    Sinkhorn step ``y = c / s`` (``s`` the row or column sum plus ``eps``): ``dc = (dy - sum(dy * y)) / s`` over the
    same axis; softmax: ``dl = p * (dp - sum(p * dp))``; sigmoid: ``sig * (1 - sig)``; RMS factor
    ``r = (mean_sq + eps)^-1/2``: ``d mean_sq = -r^3 / 2 * sum(dm * proj)``."""
    mixes, rs, sig_pre, sig_post, probs, steps = kept
    lead = mixes.shape[:-1]
    dc = mixes.new_zeros(*lead, n, n) if d_comb is None else d_comb.to(mixes.dtype)
    for i in range(len(steps) - 1, -1, -1):
        y, denom = steps[i]
        dim = -1 if i % 2 else -2
        dc = (dc - (dc * y).sum(dim=dim, keepdim=True)) / denom
    d_logits = (dc - (dc * probs).sum(dim=-1, keepdim=True)).mul_(probs).flatten(-2)
    parts = [d_logits.new_zeros(*lead, n) if d is None else d.to(mixes.dtype) * (s * (1 - s)) * f
             for d, s, f in ((d_pre, sig_pre, 1), (d_post, sig_post, 2))]
    d_act = torch.cat([parts[0], parts[1], d_logits], dim=-1)  # gradient of mixes * scale + base
    seg = mixes.new_tensor([0] * n + [1] * n + [2] * (n * n), dtype=torch.long)
    d_scale = torch.zeros(3, dtype=mixes.dtype, device=mixes.device).index_add_(
        0, seg, (d_act * mixes).reshape(-1, mixes.shape[-1]).sum(0))
    d_base = d_act.reshape(-1, mixes.shape[-1]).sum(0)
    d_mixes = d_act * scale.to(mixes.dtype).index_select(0, seg)
    d_mean_sq = (d_mixes * proj).sum(dim=-1, keepdim=True) * rs.pow(3) * -0.5
    return d_mixes * rs, d_mean_sq, d_base, d_scale


def _hc_pre_forward(hidden_streams, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                    keep: bool):
    """:func:`hc_pre_torch`'s op sequence: ``(post, comb, collapsed, kept)``; ``kept`` (with ``keep``) holds what
    :class:`_HcPre`'s backward reads."""
    batch, seq, n, dim = hidden_streams.shape
    compute = torch.promote_types(hidden_streams.dtype, torch.float32)  # fp32 (fp64 for float64 streams)
    x = hidden_streams.reshape(batch, seq, n * dim).to(compute)  # no copy for contiguous fp32 streams
    mean_sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / (n * dim)
    proj = F.linear(x, fn.to(compute))
    pre, post, comb, mix_kept = _mix_weights(proj, mean_sq, base, scale, n, sinkhorn_iters, hc_eps, norm_eps, keep)
    collapsed = torch.matmul(pre.unsqueeze(-2), x.view(batch, seq, n, dim)).squeeze(-2)
    return post, comb, collapsed.to(hidden_streams.dtype), ((proj, pre, mix_kept) if keep else None)


class _HcPre(torch.autograd.Function):
    """:func:`hc_pre_torch` with a hand-written backward: one ``[B, S, N*D]`` buffer for ``dX``
    (``dproj @ fn``, then the RMS term and the collapse term ``pre (x) dcollapsed`` added in place) and
    ``dfn = dproj^T x``; the per-token part by :func:`_mix_weights_backward`."""

    @staticmethod
    @no_autocast
    def forward(ctx, hidden_streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps):
        post, comb, collapsed, (proj, pre, kept) = _hc_pre_forward(
            hidden_streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, keep=True)
        mixes, rs, sig_pre, sig_post, probs, steps = kept
        ctx.save_for_backward(hidden_streams, fn, scale, proj, pre, mixes, rs, sig_pre, sig_post, probs,
                              *(t for step in steps for t in step))
        return post, comb, collapsed

    @staticmethod
    @no_autocast
    def backward(ctx, d_post, d_comb, d_collapsed):
        hidden_streams, fn, scale, proj, pre, *kept = ctx.saved_tensors
        steps = list(zip(kept[5::2], kept[6::2]))
        batch, seq, n, dim = hidden_streams.shape
        compute = proj.dtype
        x = hidden_streams.reshape(batch, seq, n * dim).to(compute)
        d_pre = None
        if d_collapsed is not None:
            d_collapsed = d_collapsed.to(compute)
            d_pre = torch.matmul(x.view(batch, seq, n, dim), d_collapsed.unsqueeze(-1)).squeeze(-1)
        d_proj, d_mean_sq, d_base, d_scale = _mix_weights_backward(
            proj, scale, (*kept[:5], steps), d_pre, d_post, d_comb, n)
        d_x = d_fn = None
        if ctx.needs_input_grad[0]:
            d_x = torch.matmul(d_proj, fn.to(compute))  # [B, S, N*D]
            d_x.addcmul_(x, d_mean_sq, value=2.0 / (n * dim))
            if d_collapsed is not None:
                d_x.view(batch * seq, n, dim).baddbmm_(pre.reshape(batch * seq, n, 1),
                                                       d_collapsed.reshape(batch * seq, 1, dim))
            d_x = d_x.view(batch, seq, n, dim).to(hidden_streams.dtype)
        if ctx.needs_input_grad[1]:
            d_fn = (d_proj.reshape(-1, d_proj.shape[-1]).t() @ x.reshape(-1, n * dim)).to(fn.dtype)
        return (d_x, d_fn, d_base.to(scale.dtype) if ctx.needs_input_grad[2] else None,
                d_scale.to(scale.dtype) if ctx.needs_input_grad[3] else None, None, None, None)


def hc_pre_torch(hidden_streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                 sinkhorn_iters: int, hc_eps: float, norm_eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mixing weights of one mHC site and the collapsed sub-block input: per token, the streams ``X [N, D]`` as
    ``x [N*D]`` in fp32, :func:`mix_weights` of ``x @ fn^T`` and ``mean(x^2)``, ``collapsed = sum_n pre_n * X_n``.

    Args:
        hidden_streams: ``X [B, S, N, D]`` (any float dtype, any strides).
        fn: ``[(2+N)*N, N*D]`` (model dtype; used in fp32). base: ``[(2+N)*N]`` fp32. scale: ``[3]`` fp32.
        sinkhorn_iters: ``config.hc_sinkhorn_iters`` (>= 1). hc_eps: ``config.hc_eps``.
        norm_eps: ``config.rms_norm_eps``.

    Returns:
        ``(post fp32 [B, S, N], comb fp32 [B, S, N, N], collapsed [B, S, D] in X.dtype)`` (fp64 for fp64 streams);
        ``comb[i, j]`` weighs input stream ``i`` into output stream ``j``. Differentiable in every tensor input.
        Under autocast the same: the projection, gates, softmax and Sinkhorn stay fp32 (autocast off, forward and
        backward), as the reference's ``.float()`` casts declare.

    Raises:
        ValueError: wrong ranks or shapes, ``sinkhorn_iters < 1``.
    """
    check_hc_pre_args(hidden_streams, fn, base, scale, sinkhorn_iters)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (hidden_streams, fn, base, scale)):
        return _HcPre.apply(hidden_streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    with autocast_off(hidden_streams):
        return _hc_pre_forward(hidden_streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, keep=False)[:3]


def hc_post_torch(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``out[..., h, :] = post[..., h] * y + sum_i comb[..., i, h] * residual[..., i, :]`` with the reference's
    rounding (``post``, ``comb`` cast to ``residual.dtype`` first).

    Args:
        y: ``[B, S, D]`` sub-block output. residual: ``[B, S, N, D]`` streams that entered ``hc_pre``.
        post: ``[B, S, N]`` fp32. comb: ``[B, S, N, N]`` fp32.

    Returns:
        ``[B, S, N, D]`` in ``promote(residual.dtype, y.dtype)``; under autocast the same (the mix runs with autocast
        off: fp32 streams are not rounded to the autocast dtype).

    Raises:
        ValueError: shapes that do not fit.
    """
    check_hc_post_args(y, residual, post, comb)
    dtype = residual.dtype
    with autocast_off(residual):  # the residual streams' mix in their dtype, also under autocast
        out = torch.matmul(comb.to(dtype).transpose(-1, -2), residual)
    expanded = post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2)
    if expanded.dtype == out.dtype:
        return out.add_(expanded)  # the matmul output is not saved for backward; a + b == b + a bitwise
    return out + expanded


def hc_head(hidden_streams: torch.Tensor) -> torch.Tensor:
    """Final stream collapse, the mean over the N streams: ``[B, S, N, D] -> [B, S, D]``, same dtype; ``ValueError``
    for an input that is not 4-D."""
    if hidden_streams.dim() != 4:
        raise ValueError(f"hidden_streams must be [B, S, N, D]; got shape {tuple(hidden_streams.shape)}")
    return hidden_streams.mean(dim=2)


def hc_expand(embeds: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """``hc_mult`` contiguous copies of the embeddings: ``[B, S, D] -> [B, S, N, D]``; ``ValueError`` for ``embeds``
    not 3-D or ``hc_mult < 1``."""
    if embeds.dim() != 3:
        raise ValueError(f"embeds must be [B, S, D]; got shape {tuple(embeds.shape)}")
    if hc_mult < 1:
        raise ValueError(f"hc_mult must be >= 1; got hc_mult={hc_mult}")
    return embeds.unsqueeze(2).expand(-1, -1, hc_mult, -1).contiguous()
