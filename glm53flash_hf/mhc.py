"""Manifold-constrained hyper-connections (mHC) of GLM-5.3-Flash: ``hc_pre`` (mixing weights + collapse),
``hc_post`` (expand + mix), the mean head and the stream expansion.

Source: ``shared/reference/model-spec.md`` §3, §7, §13 item 9; ``shared/reference/kernels.md`` §3; reference
implementation transformers ``models/glm5_next/modeling_glm5_next.py`` (``Glm5NextTextHyperConnection``,
``Glm5NextTextUnweightedRMSNorm``, ``Glm5NextTextHyperHead`` and the ``hc_post`` lines of
``Glm5NextTextDecoderLayer.forward``), which equals DeepSeek-V4's hyper-connection with a mean head. Parameter
names, shapes and dtypes equal the reference: ``fn [(2+N)*N, N*D]`` (model dtype), ``base [(2+N)*N]`` fp32,
``scale [3]`` fp32.

Efficient torch path (equal maths, fewer passes over the ``N*D`` streams than the reference):

* the unweighted RMS norm is folded past the projection, ``linear(x * r, fn) == r * linear(x, fn)`` with
  ``r = rsqrt(mean(x^2) + eps)`` per token, so the normalised fp32 copy of the streams is never materialised;
  ``mean(x^2)`` comes from ``torch.linalg.vector_norm`` (one read, no squared temporary);
* the collapse ``sum_n pre_n * X_n`` is one batched ``[1, N] @ [N, D]`` product per token on the fp32 streams
  already needed for the projection (the reference materialises an fp32 ``[B, S, N, D]`` product);
* ``hc_post`` adds into the mixing product in place (one ``[B, S, N, D]`` temporary less) with the reference's
  rounding: ``post`` and ``comb`` are cast to the residual dtype first.

Measured against the reference (tests/test_mhc.py, hidden 64, 4 streams, init-scale ``fn``): fp32 post/comb within
2.4e-7 absolute, the collapsed input within 1.3e-7 relative, gradients of X/fn/base/scale within 5.4e-7 relative;
bf16 streams: the collapsed input bit-equal except 1 of 8192 values off by one bf16 ulp (a value on a rounding
boundary). With large projections (``fn`` std 0.5) both implementations are a few 1e-6 from a float64 evaluation, ours
on average as close as the reference (mean-error ratio 0.85-1.27 over 20 seeds): the fold only reorders fp32
rounding. Speed (2-core CPU, T=2048, D=1024, N=4): forward 3.6x (fp32) / 2.9x (bf16) faster than the reference,
forward+backward 1.6x / 7x. The Sinkhorn iterations use exactly the reference's op sequence
(``torch.softmax``, then column and (row, column) normalisations each with ``+hc_eps``), vectorised over tokens.

``hc_pre`` and ``hc_post`` take ``backend``; ``"fused"``/``"auto"`` on CUDA tensors run the Triton kernels of
:mod:`glm53flash_hf.triton_mhc` (same maths; chosen per call by :func:`glm53flash_hf.dispatch.choose_backend`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from .dispatch import choose_backend, requested_backend

try:  # optional: only the small-input Sinkhorn fast path uses it
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None

# Decode-sized inputs (a few tokens): the 3 * (2 * iters - 1) tiny ops are dominated by torch's per-op dispatch cost
# (~2.5 us each, ~0.3 ms per mHC site on CPU); numpy runs the same IEEE op sequence (same dtype, same summation order
# over N <= 4 entries -- numpy switches to 8-way pairwise sums at 8 -- correctly rounded division) at ~1/3 of the overhead. Bit-equal to the torch loop
# (tests/test_mhc.py::test_sinkhorn_small_numpy_path_bit_equal). Only without autograd, on CPU, outside compile.
_SMALL_SINKHORN_NUMEL = 1024


def _numpy_sinkhorn_ok(comb: torch.Tensor) -> bool:
    return (
        comb.device.type == "cpu"
        and comb.dtype in (torch.float32, torch.float64)
        and not (comb.requires_grad and torch.is_grad_enabled())
        and not torch.compiler.is_compiling()
        and _np is not None
    )


def _sinkhorn_numpy(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    return torch.from_numpy(_sinkhorn_numpy_array(comb.detach().numpy(), iters, eps))


def _sinkhorn_numpy_array(c, iters: int, eps: float):
    e = c.dtype.type(eps)
    add = _np.add.reduce
    c = c / (add(c, axis=-2, keepdims=True) + e)
    for _ in range(iters - 1):
        c = c / (add(c, axis=-1, keepdims=True) + e)
        c = c / (add(c, axis=-2, keepdims=True) + e)
    return c


# Decode-sized hc_pre (at most this many tokens, fp32 streams and fp32 parameters, CPU, no autograd): the whole site
# -- projection GEMV, RMS factor, sigmoids, softmax, Sinkhorn, collapse -- runs in numpy on the tokens' few floats
# (~40 numpy calls instead of ~60 torch ops plus the Sinkhorn), ~2-3x less per-call overhead. Same formula and op
# order as the torch path; only the fp32 summation order of the dot products differs (numpy/BLAS vs torch), so values
# agree to fp32 rounding (tests/test_mhc.py::test_hc_pre_small_numpy_path).
_SMALL_HC_PRE_TOKENS = 8


def _hc_pre_numpy_ok(hidden_streams, fn, base, scale) -> bool:
    return (
        _np is not None
        and hidden_streams.device.type == "cpu"
        and hidden_streams.shape[0] * hidden_streams.shape[1] <= _SMALL_HC_PRE_TOKENS
        and hidden_streams.dtype == fn.dtype == base.dtype == scale.dtype == torch.float32
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (hidden_streams, fn, base, scale)))
        and not torch.compiler.is_compiling()
    )


def _hc_post_numpy_ok(y, residual, post, comb) -> bool:
    """Decode-sized fp32 ``hc_post`` without autograd on CPU runs in numpy (3 calls instead of ~8 torch ops)."""
    return (
        _np is not None
        and residual.device.type == "cpu"
        and residual.shape[0] * residual.shape[1] <= _SMALL_HC_PRE_TOKENS
        and y.dtype == residual.dtype == post.dtype == comb.dtype == torch.float32
        and residual.is_contiguous()
        and y.is_contiguous()
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (y, residual, post, comb)))
        and not torch.compiler.is_compiling()
    )


def _hc_pre_numpy(hidden_streams, fn, base, scale, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """:func:`hc_pre` for a few fp32 tokens without autograd, in numpy (see ``_SMALL_HC_PRE_TOKENS``)."""
    batch, seq, n, dim = hidden_streams.shape
    f32 = _np.float32
    x = hidden_streams.detach().reshape(batch * seq, n * dim).contiguous().numpy()  # [T, N*D], no copy if contiguous
    b = base.detach().numpy()
    s = scale.detach().numpy()
    mean_sq = _np.einsum("td,td->t", x, x) / f32(n * dim)
    mixes = (x @ fn.detach().numpy().T) * (f32(1.0) / _np.sqrt(mean_sq + f32(norm_eps)))[:, None]  # [T, (2+N)N]
    one, eps = f32(1.0), f32(hc_eps)
    pre = one / (one + _np.exp(-(mixes[:, :n] * s[0] + b[:n]))) + eps
    post = f32(2.0) * (one / (one + _np.exp(-(mixes[:, n : 2 * n] * s[1] + b[n : 2 * n]))))
    logits = mixes[:, 2 * n :].reshape(-1, n, n) * s[2] + b[2 * n :].reshape(n, n)
    e = _np.exp(logits - logits.max(axis=-1, keepdims=True))
    comb = _sinkhorn_numpy_array(e / _np.add.reduce(e, axis=-1, keepdims=True) + eps, sinkhorn_iters, hc_eps)
    collapsed = _np.matmul(pre[:, None, :], x.reshape(-1, n, dim))[:, 0]  # [T, D]
    return (
        torch.from_numpy(post).view(batch, seq, n),
        torch.from_numpy(comb).view(batch, seq, n, n),
        torch.from_numpy(collapsed).view(batch, seq, dim),
    )


def check_hc_pre_args(hidden_streams, fn, base, scale, sinkhorn_iters: int) -> None:
    """Validate the arguments of :func:`hc_pre` (shared with the fused path in ``triton_mhc``).

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


def sinkhorn_normalize(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Make positive ``[..., N, N]`` matrices (approximately) doubly stochastic, as the reference does.

    One column normalisation ``c / (colsum + eps)``, then ``iters - 1`` rounds of (row, column) normalisation, each
    with ``+eps`` in the denominator. Source: ``Glm5NextTextHyperConnection.forward`` (Sinkhorn-Knopp).

    Args:
        comb: ``[..., N, N]`` fp32, already ``softmax(...) + eps``.
        iters: ``config.hc_sinkhorn_iters`` (20 in the release), ``>= 1``.
        eps: ``config.hc_eps``.

    Returns:
        Same shape and dtype.
    """
    if comb.numel() <= _SMALL_SINKHORN_NUMEL and comb.shape[-1] <= 4 and _numpy_sinkhorn_ok(comb):
        return _sinkhorn_numpy(comb, iters, eps)
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):  # fixed small count (19), each step vectorised over all tokens
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _mix_weights(
    mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, n: int, sinkhorn_iters: int, hc_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The small part of ``hc_pre``: normalised projections ``mixes [..., (2+N)*N]`` -> ``(pre [..., N],
    post [..., N], comb [..., N, N])`` (sigmoids, ``torch.softmax``, Sinkhorn). Shared by the torch path and the fused
    path (:mod:`glm53flash_hf.triton_mhc`, which differentiates it with torch autograd), so both run one op sequence.
    """
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb_logits = comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n)
    comb = sinkhorn_normalize(torch.softmax(comb_logits, dim=-1) + hc_eps, sinkhorn_iters, hc_eps)
    return pre, post, comb


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

    Maths (model-spec §7 "hc_pre"; ``Glm5NextTextHyperConnection.forward``), per token with streams
    ``X [N, D]`` flattened to ``x [N*D]`` in fp32:
    ``m = rsqrt(mean(x^2) + norm_eps) * (fn_fp32 @ x)`` (24 values for N = 4);
    ``pre = sigmoid(m[:N] * scale[0] + base[:N]) + hc_eps``;
    ``post = 2 * sigmoid(m[N:2N] * scale[1] + base[N:2N])``;
    ``comb = sinkhorn(softmax(m[2N:].view(N, N) * scale[2] + base[2N:].view(N, N), dim=-1) + hc_eps)``;
    ``collapsed = sum_n pre_n * X_n`` computed in fp32 and cast to ``X.dtype``.

    Args:
        hidden_streams: ``X [B, S, N, D]`` (any float dtype, any strides).
        fn: ``[(2+N)*N, N*D]`` projection (model dtype; used in fp32).
        base: ``[(2+N)*N]`` fp32. scale: ``[3]`` fp32.
        sinkhorn_iters: ``config.hc_sinkhorn_iters`` (>= 1). hc_eps: ``config.hc_eps``.
        norm_eps: ``config.rms_norm_eps`` (the unweighted RMS norm's epsilon, 1e-5 in the release).
        backend: ``"torch"``, ``"auto"`` or ``"fused"`` (:func:`glm53flash_hf.dispatch.choose_backend`; the fused
            path is :func:`glm53flash_hf.triton_mhc.hc_pre_fused`, CUDA only).

    Returns:
        ``(post fp32 [B, S, N], comb fp32 [B, S, N, N], collapsed [B, S, D] in X.dtype)``; ``comb[i, j]`` weighs
        input stream ``i`` into output stream ``j`` (see :func:`hc_post`). Float64 streams are computed and returned
        in float64 (the reference would drop to fp32).

    Raises:
        ValueError: wrong ranks or shapes, ``sinkhorn_iters < 1``, unknown backend.
    """
    check_hc_pre_args(hidden_streams, fn, base, scale, sinkhorn_iters)
    batch, seq, n, dim = hidden_streams.shape
    if choose_backend("mhc", backend, hidden_streams, fn, base, scale) == "fused":
        from .triton_mhc import hc_pre_fused

        return hc_pre_fused(
            hidden_streams, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, norm_eps=norm_eps
        )

    if _hc_pre_numpy_ok(hidden_streams, fn, base, scale):
        return _hc_pre_numpy(
            hidden_streams, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, norm_eps=norm_eps
        )
    compute = torch.promote_types(hidden_streams.dtype, torch.float32)  # fp32 (fp64 for float64 streams)
    x = hidden_streams.reshape(batch, seq, n * dim).to(compute)  # no copy for contiguous fp32 streams
    mean_sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / (n * dim)
    mixes = F.linear(x, fn.to(compute)) * torch.rsqrt(mean_sq + norm_eps)  # [B, S, (2+N)N]

    pre, post, comb = _mix_weights(mixes, base, scale, n=n, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps)

    collapsed = torch.matmul(pre.unsqueeze(-2), x.view(batch, seq, n, dim)).squeeze(-2)
    return post, comb, collapsed.to(hidden_streams.dtype)


def hc_post(
    y: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    backend: str = "torch",
) -> torch.Tensor:
    """Expand a sub-block output back to N streams and add the mixed residual streams.

    ``out[..., h, :] = post[..., h] * y + sum_i comb[..., i, h] * residual[..., i, :]``, i.e.
    ``post[..., None] * y[..., None, :] + comb^T @ residual`` (note the transpose). Rounding as the reference
    (``Glm5NextTextDecoderLayer.forward``): ``post`` and ``comb`` are first cast to ``residual.dtype``, the two
    terms are computed in that dtype and added (bit-equal to the reference in bf16 and fp32).

    Args:
        y: ``[B, S, D]`` sub-block output. residual: ``[B, S, N, D]`` streams that entered :func:`hc_pre`.
        post: ``[B, S, N]`` (fp32). comb: ``[B, S, N, N]`` (fp32). backend: ``"torch"``,
            ``"auto"`` or ``"fused"`` (fused path: :func:`glm53flash_hf.triton_mhc.hc_post_fused`, CUDA only).

    Returns:
        ``[B, S, N, D]`` in ``promote(residual.dtype, y.dtype)`` (``residual.dtype`` when they agree).

    Raises:
        ValueError: shapes that do not fit, unknown backend.
    """
    if residual.dim() != 4:
        raise ValueError(f"residual must be [B, S, N, D]; got shape {tuple(residual.shape)}")
    b, s, n, d = residual.shape
    if tuple(y.shape) != (b, s, d) or tuple(post.shape) != (b, s, n) or tuple(comb.shape) != (b, s, n, n):
        raise ValueError(
            f"hc_post shapes do not fit residual [B,S,N,D]={tuple(residual.shape)}: y {tuple(y.shape)} (want "
            f"[B,S,D]), post {tuple(post.shape)} (want [B,S,N]), comb {tuple(comb.shape)} (want [B,S,N,N])"
        )
    if choose_backend("mhc", backend, y, residual, post, comb) == "fused":
        from .triton_mhc import hc_post_fused

        return hc_post_fused(y, residual, post, comb)
    if _hc_post_numpy_ok(y, residual, post, comb):
        r = residual.detach().numpy()
        out = _np.matmul(comb.detach().numpy().swapaxes(-1, -2), r)
        out += post.detach().numpy()[..., None] * y.detach().numpy()[..., None, :]
        return torch.from_numpy(out)
    dtype = residual.dtype
    out = torch.matmul(comb.to(dtype).transpose(-1, -2), residual)
    expanded = post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2)
    if expanded.dtype == out.dtype:
        return out.add_(expanded)  # the matmul output is not saved for backward; a + b == b + a bitwise
    return out + expanded


def hc_head(hidden_streams: torch.Tensor) -> torch.Tensor:
    """Final stream collapse of GLM-5.3-Flash: unweighted mean over the N streams (not DeepSeek-V4's weighted head).

    ``[B, S, N, D] -> [B, S, D]``, same dtype. Source: ``Glm5NextTextHyperHead``; model-spec §3.

    Raises:
        ValueError: input not 4-D.
    """
    if hidden_streams.dim() != 4:
        raise ValueError(f"hidden_streams must be [B, S, N, D]; got shape {tuple(hidden_streams.shape)}")
    return hidden_streams.mean(dim=2)


def hc_expand(embeds: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """Copy the token embeddings into ``hc_mult`` identical streams: ``[B, S, D] -> [B, S, N, D]``, contiguous.

    Contiguity matters (model-spec §13 item 9): later per-stream updates must not alias one buffer.
    Source: ``Glm5NextTextModel.forward``.

    Raises:
        ValueError: ``embeds`` not 3-D or ``hc_mult < 1``.
    """
    if embeds.dim() != 3:
        raise ValueError(f"embeds must be [B, S, D]; got shape {tuple(embeds.shape)}")
    if hc_mult < 1:
        raise ValueError(f"hc_mult must be >= 1; got hc_mult={hc_mult}")
    return embeds.unsqueeze(2).expand(-1, -1, hc_mult, -1).contiguous()


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
        return hc_pre(
            hidden_streams,
            self.fn,
            self.base,
            self.scale,
            sinkhorn_iters=self.hc_sinkhorn_iters,
            hc_eps=self.hc_eps,
            norm_eps=self.norm_eps,
            backend=requested_backend(self.config, "mhc"),
        )

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
