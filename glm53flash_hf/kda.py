"""Kimi Delta Attention (KDA): the linear-attention layer of GLM-5.3-Flash, torch path.

Maths (``shared/reference/model-spec.md`` §4; Kimi Linear, arXiv:2510.26692 §3; reference implementation:
transformers ``models/glm5_next/modeling_glm5_next.py``, ``Glm5NextTextLinearAttention``,
``chunk_kimi_delta_attention``, ``recurrent_kimi_delta_attention``; fla ``fla/ops/kda``). Per head, with a
fp32 state ``S`` of shape ``[K, V]``, a per-channel log decay ``g_t`` (``[K]``, ``<= 0``) and a write strength
``beta_t`` in ``(0, 1)``::

    S <- diag(exp(g_t)) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t                      (q_t already l2-normalised and scaled by K^-0.5)

This file holds, from the bottom up:

* :func:`causal_conv1d_torch`: the depthwise causal short convolution (+SiLU) run on ``[q|k|v]``;
* :func:`chunk_kda_torch`: the chunked (WY) form of the recurrence, used for training and prefill;
* :func:`recurrent_kda_torch`: the token-by-token form (decode);
* :class:`Glm53FlashForgetGate`, :class:`Glm53FlashRMSNormGated`, :class:`Glm53FlashLinearAttention`: the layer,
  with parameter names and dtypes equal to transformers' ``Glm5NextTextLinearAttention`` so state dicts are
  interchangeable;
* :func:`init_kda_weights`: the from-scratch initialisation of transformers' ``_init_weights``.

Both token mixers (convolution and recurrence) restart at every document boundary given by ``cu_seqlens``
(fla's varlen convention: ``B == 1``, boundaries over the flattened tokens). The layer picks its
implementation per call (``config.kernels["kda"]`` and the tensors' device, :func:`glm53flash_hf.dispatch.choose_backend`):
the torch path here, or on CUDA fla-core's kernels through :mod:`glm53flash_hf.fla_kda` (``chunk_kda`` with the gate,
beta and l2-norm in the kernel, varlen ``causal_conv1d``, ``rms_norm_gated``; ``fused_recurrent_kda`` for no-grad
decode steps).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from transformers import initialization as init

from .dispatch import choose_backend, requested_backend
from .packing import DocumentLayout

__all__ = [
    "Glm53FlashForgetGate",
    "Glm53FlashRMSNormGated",
    "Glm53FlashLinearAttention",
    "causal_conv1d_torch",
    "chunk_kda_torch",
    "recurrent_kda_torch",
    "kda_conv",
    "kda_chunk",
    "init_kda_weights",
]

_L2NORM_EPS = 1e-6


# ----------------------------------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------------------------------


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim (fla ``l2norm`` and HF ``l2norm``, same eps placement)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + _L2NORM_EPS)


def _autocast_off(fn):
    """Run ``fn`` with autocast disabled on its first argument's device, so its fp32 maths stays fp32 inside
    ``torch.autocast`` regions (inputs keep their dtype; outputs are returned in the documented dtypes)."""

    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            with torch.autocast(device_type=device_type, enabled=False):
                return fn(x, *args, **kwargs)
        return fn(x, *args, **kwargs)

    return wrapper


def _check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, batch: int, name_batch: str) -> list[int]:
    """Validate fla-style ``cu_seqlens`` and return it as a host list (one device sync, like fla)."""
    if batch != 1:
        raise ValueError(f"cu_seqlens requires batch size 1 (packed layout [1, T, ...]); got {name_batch}={batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [N + 1] with N >= 1; got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor; got dtype {cu_seqlens.dtype}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={total}; got first={cu[0]}, last={cu[-1]}")
    for i in range(len(cu) - 1):
        if cu[i + 1] <= cu[i]:
            raise ValueError(
                f"cu_seqlens must be strictly increasing (no empty documents); got cu_seqlens[{i}]={cu[i]}, "
                f"cu_seqlens[{i + 1}]={cu[i + 1]}"
            )
    return cu


# ----------------------------------------------------------------------------------------------------------------------
# Short convolution
# ----------------------------------------------------------------------------------------------------------------------


@_autocast_off
def causal_conv1d_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal 1-D convolution (no bias) with optional SiLU, restarting at document boundaries.

    ``y[t, d] = act(sum_{w < W} weight[d, w] * x[t - (W - 1) + w, d])`` where inputs before the start of the
    token's document come from ``initial_state`` (its last ``W - 1`` columns) or are zero. Same contract as
    fla's ``causal_conv1d`` (``fla/modules/convolution.py``) without bias/residual; the maths equals transformers'
    ``causal_conv1d_fn`` (prefill) and ``causal_conv1d_update`` (continuation from a state).

    Args:
        x: ``[B, T, D]``, time-major, any float dtype.
        weight: ``[D, W]`` (HF's ``conv1d.weight[:, 0, :]``, fp32 in GLM). The convolution is computed in
            ``weight.dtype`` like HF (also inside ``torch.autocast``), the result cast back to ``x.dtype``.
        cu_seqlens: optional integer ``[N + 1]``, document boundaries over the ``T`` tokens (requires ``B == 1``).
            Without it each of the ``B`` rows is one document (``N = B``).
        activation: ``"silu"`` / ``"swish"`` (the same) or ``None``.
        initial_state: optional ``[N, D, W]``: per document, the last ``W`` inputs before its first token
            (oldest first, HF conv-cache / fla convention); only the last ``W - 1`` columns are read.
        output_final_state: also return the last ``W`` inputs of every document, ``[N, D, W]`` in ``x.dtype``
            (positions before the document filled from ``initial_state`` or zeros, as fla does).

    Returns:
        ``(y, final_state)``: ``y`` ``[B, T, D]`` in ``x.dtype`` (a channels-first view: call ``.contiguous()``
        if a contiguous tensor is needed), ``final_state`` or ``None``.

    Raises:
        ValueError: on shape/dtype mismatches, ``cu_seqlens`` with ``B != 1`` or not strictly increasing from 0
            to ``T``, or an unknown activation.

    Implementation: documents are laid out in a *history-padded* sequence, every document preceded by its
    ``W - 1`` history slots (initial state or zeros), so a single ``F.conv1d`` without padding computes every
    output from its own document only (no cross-document term to cancel; equal to running each document alone
    up to the conv kernel's summation order, ~1e-8) and saves only its input for backward. There is no loop over
    documents and no ``[T, D, W]`` temporary (the ``W`` shifted multiply-adds alternative would save ``W`` masked
    copies of ``x`` for the weight gradient).
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, D]; got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [D={x.shape[-1]}, W]; got shape {tuple(weight.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish'; got activation={activation!r}")
    B, T, D = x.shape
    W = weight.shape[1]
    cdtype = weight.dtype
    if cu_seqlens is not None:
        cu_host = _check_cu_seqlens(cu_seqlens, T, B, "x.shape[0]")
        N = len(cu_host) - 1
    else:
        N = B
    if initial_state is not None and tuple(initial_state.shape) != (N, D, W):
        raise ValueError(f"initial_state must be [N={N}, D={D}, W={W}]; got shape {tuple(initial_state.shape)}")
    w = weight.unsqueeze(1)  # [D, 1, W]

    if cu_seqlens is None:
        xt = x.transpose(1, 2).to(cdtype)  # [B, D, T]
        if initial_state is None:
            z = F.pad(xt, (W - 1, 0))
        else:
            z = torch.cat([initial_state[..., 1:].to(cdtype), xt], dim=-1)  # [B, D, W - 1 + T]
        y = F.conv1d(z, w, groups=D)  # [B, D, T]
        final = z[..., -W:] if output_final_state else None
    else:
        device = x.device
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        lengths = cu[1:] - cu[:-1]
        doc = torch.repeat_interleave(torch.arange(N, device=device), lengths, output_size=T)  # [T]
        hist = W - 1
        L = T + N * hist
        # Source rows: the T tokens, then N * (W - 1) history rows (or a single zero row).
        if initial_state is None:
            src = torch.cat([x[0].to(cdtype), x.new_zeros(1, D, dtype=cdtype)], dim=0)
            fill = torch.full((L,), T, device=device, dtype=torch.long)
        else:
            hrows = initial_state[..., 1:].to(cdtype).transpose(1, 2).reshape(N * hist, D)
            src = torch.cat([x[0].to(cdtype), hrows], dim=0)
            # history slot j of document n sits at cu[n] + n * hist + j and reads row T + n * hist + j
            slots = (cu[:-1] + torch.arange(N, device=device) * hist).unsqueeze(1) + torch.arange(hist, device=device)
            fill = torch.empty(L, device=device, dtype=torch.long)
            fill[slots.flatten()] = T + torch.arange(N * hist, device=device)
        token_slot = torch.arange(T, device=device) + (doc + 1) * hist  # z position of every token
        fill[token_slot] = torch.arange(T, device=device)
        z = src.t().index_select(1, fill).unsqueeze(0)  # [1, D, L], gathered straight into channels-first
        out = F.conv1d(z, w, groups=D)  # [1, D, L - hist]
        y = out.index_select(2, token_slot - hist)  # [1, D, T]
        final = None
        if output_final_state:
            last = (cu[1:] - 1 + (torch.arange(N, device=device) + 1) * hist).unsqueeze(1)  # [N, 1]
            idx = last - (W - 1) + torch.arange(W, device=device)  # [N, W]
            final = z[0].index_select(1, idx.flatten()).view(D, N, W).transpose(0, 1)  # [N, D, W]
    if activation is not None:
        y = F.silu(y)
    y = y.to(x.dtype).transpose(1, 2)
    if final is not None:
        final = final.to(x.dtype).contiguous()
    return y, final


# ----------------------------------------------------------------------------------------------------------------------
# Chunked KDA core
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class _ChunkPlan:
    """Where every token goes in the chunk-aligned ``[L, R, H, C, F]`` layout (``L`` chunks per row, ``R`` rows).

    ``resets[n]`` / ``ends[n]``: ``(rows, docs)`` long tensors of the documents that start (for ``n > 0``) /
    end at chunk ``n``; ``first_docs``: the document that starts each row at chunk 0. ``token_index`` is only
    set for varlen inputs (``[T * H]`` destinations in the flattened layout).
    """

    batch: int
    seq_len: int
    heads: int
    chunk: int
    num_chunks: int
    num_rows: int
    num_docs: int
    token_index: torch.Tensor | None = None
    first_docs: torch.Tensor | None = None
    resets: dict | None = None
    ends: dict | None = None

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, H, F]`` -> ``[L, R, H, C, F]`` (zeros in padding slots)."""
        Fdim = x.shape[-1]
        L, R, H, C = self.num_chunks, self.num_rows, self.heads, self.chunk
        if self.token_index is None:
            pad = L * C - self.seq_len
            x = F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x
            return x.view(self.batch, L, C, H, Fdim).permute(1, 0, 3, 2, 4).contiguous()
        out = x.new_zeros(L * R * H * C, Fdim)
        out = out.index_copy(0, self.token_index, x.reshape(-1, Fdim))
        return out.view(L, R, H, C, Fdim)

    def from_chunks(self, y: torch.Tensor) -> torch.Tensor:
        """``[L, R, H, C, F]`` -> ``[B, T, H, F]`` (padding slots dropped)."""
        Fdim = y.shape[-1]
        if self.token_index is None:
            L, B, H, C = y.shape[:4]
            y = y.permute(1, 0, 3, 2, 4).reshape(B, L * C, H, Fdim)
            return y[:, : self.seq_len]
        return y.reshape(-1, Fdim).index_select(0, self.token_index).view(1, self.seq_len, self.heads, Fdim)


def _make_plan(B: int, T: int, H: int, C: int, cu_host: list[int] | None, device) -> _ChunkPlan:
    if cu_host is None:
        L = max(1, -(-T // C))
        return _ChunkPlan(batch=B, seq_len=T, heads=H, chunk=C, num_chunks=L, num_rows=B, num_docs=B)
    lengths = [b - a for a, b in zip(cu_host[:-1], cu_host[1:])]
    nchunks = [-(-n // C) for n in lengths]
    L = max(nchunks)
    # Next-fit bin packing of whole documents into rows of L chunks: the state loop runs L iterations, all
    # rows in parallel; a document never straddles rows.
    row_of, off_of = [], []
    row, fill = 0, 0
    for c in nchunks:
        if fill + c > L:
            row, fill = row + 1, 0
        row_of.append(row)
        off_of.append(fill)
        fill += c
    R = row + 1
    N = len(lengths)
    first_docs = [0] * R
    resets: dict[int, tuple[list[int], list[int]]] = {}
    ends: dict[int, tuple[list[int], list[int]]] = {}
    for d in range(N):
        if off_of[d] == 0:
            first_docs[row_of[d]] = d
        else:
            resets.setdefault(off_of[d], ([], []))
            resets[off_of[d]][0].append(row_of[d])
            resets[off_of[d]][1].append(d)
        e = off_of[d] + nchunks[d] - 1
        ends.setdefault(e, ([], []))
        ends[e][0].append(row_of[d])
        ends[e][1].append(d)

    def _dev(groups):
        return {n: (torch.tensor(r, device=device), torch.tensor(d, device=device)) for n, (r, d) in groups.items()}

    cu = torch.tensor(cu_host, device=device, dtype=torch.long)
    lengths_t = cu[1:] - cu[:-1]
    doc = torch.repeat_interleave(torch.arange(N, device=device), lengths_t, output_size=T)
    local = torch.arange(T, device=device) - cu[doc]
    row_t = torch.tensor(row_of, device=device)[doc]
    chunk_t = torch.tensor(off_of, device=device)[doc] + local // C
    base = ((chunk_t * R + row_t) * H) * C + local % C  # head 0
    token_index = (base.unsqueeze(1) + torch.arange(H, device=device) * C).flatten()  # [T * H]
    return _ChunkPlan(
        batch=1,
        seq_len=T,
        heads=H,
        chunk=C,
        num_chunks=L,
        num_rows=R,
        num_docs=N,
        token_index=token_index,
        first_docs=torch.tensor(first_docs, device=device),
        resets=_dev(resets),
        ends=_dev(ends),
    )


def _assemble_blocks(diag: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """Merge pairs of ``[h, h]`` diagonal blocks and their ``[h, h]`` lower off-diagonal block into ``[2h, 2h]``.

    ``diag`` ``[M, 2 * nb, h, h]``, ``off`` ``[M, nb, h, h]`` -> ``[M, nb, 2h, 2h]`` (upper block zero).
    """
    M, nb, h, _ = off.shape
    d = diag.view(M, nb, 2, h, h)
    top = torch.cat([d[:, :, 0], torch.zeros_like(off)], dim=-1)
    bottom = torch.cat([off, d[:, :, 1]], dim=-1)
    return torch.cat([top, bottom], dim=-2)


def _intra_chunk_products(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay-weighted intra-chunk Gram matrices, with every exponential ``<= 1``.

    For one chunk with inclusive cumulative log decay ``G_i = sum_{s <= i} g_s``:
    ``Akk[i, j] = sum_d k_id k_jd exp(G_id - G_jd)`` for ``j < i`` (strictly lower, zero elsewhere) and
    ``Aqk[i, j] = sum_d q_id k_jd exp(G_id - G_jd)`` for ``j <= i``.

    Args: ``q``, ``k``, ``g`` fp32 ``[M, C, K]`` (``C`` a power of two). Returns ``(Akk, Aqk)`` ``[M, C, C]``.

    Hierarchical factorisation (no ``[C, C, K]`` and no ``[16, 16, K]`` tensor): at level ``h`` the chunk is cut
    into blocks of ``2h``; for the pairs (row in the second half, column in the first half) of every block, the
    reference point ``r`` is the last position of the first half, and
    ``exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j)`` with ``G_i - G_r`` the prefix sum of ``g`` inside the
    second half and ``G_r - G_j`` the exclusive suffix sum inside the first half. Both are sums of ``g <= 0``
    terms, so both factors are in ``[0, 1]``: no overflow whatever the gate (a factor that underflows to 0 means
    the exact product is below fp32's range too), and because the sums are *local* (not differences of chunk
    cumulative sums) there is no cancellation error when the gate is large. The off-diagonal block is then
    one batched matmul ``[h, K] @ [K, h]``. ``log2(C)`` levels cover every pair ``j < i``; the diagonal of ``Aqk``
    is ``q_i . k_i``. Temporaries are ``O(M * C * K)`` per level.
    """
    M, C, K = k.shape
    akk = k.new_zeros(M, C, 1, 1)
    aqk = (q * k).sum(-1).view(M, C, 1, 1)
    h = 1
    while h < C:
        nb = C // (2 * h)
        qv, kv, gv = (t.view(M, nb, 2, h, K) for t in (q, k, g))
        e_row = torch.exp(gv[:, :, 1].cumsum(-2))  # exp(G_i - G_r), i in the second half
        suffix = gv[:, :, 0].flip(-2).cumsum(-2).flip(-2)  # inclusive suffix sums of the first half
        e_col = torch.exp(F.pad(suffix[:, :, 1:], (0, 0, 0, 1)))  # exp(G_r - G_j), exclusive suffix
        col = (kv[:, :, 0] * e_col).transpose(-1, -2)  # [M, nb, K, h]
        akk = _assemble_blocks(akk, (kv[:, :, 1] * e_row) @ col)
        aqk = _assemble_blocks(aqk, (qv[:, :, 1] * e_row) @ col)
        h *= 2
    return akk.view(M, C, C), aqk.view(M, C, C)


def _check_core_inputs(q, k, v, g, beta):
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K]; got shape {tuple(q.shape)}")
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}; got {tuple(k.shape)}")
    if tuple(g.shape) != tuple(q.shape):
        raise ValueError(f"g must be [B, T, H, K] = {tuple(q.shape)} (per-channel log decay); got {tuple(g.shape)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != tuple(q.shape[:3]):
        raise ValueError(f"v must be [B, T, H, V] with B, T, H = {tuple(q.shape[:3])}; got {tuple(v.shape)}")
    if tuple(beta.shape) != tuple(q.shape[:3]):
        raise ValueError(f"beta must be [B, T, H] = {tuple(q.shape[:3])}; got {tuple(beta.shape)}")


def _check_state(initial_state, n, H, K, V):
    if initial_state is not None and tuple(initial_state.shape) != (n, H, K, V):
        raise ValueError(f"initial_state must be [N={n}, H={H}, K={K}, V={V}]; got {tuple(initial_state.shape)}")


@_autocast_off
def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    use_qk_l2norm_in_kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked Kimi Delta Attention in torch, with packed-document support. fp32 maths throughout (autocast off).

    Same contract as fla's ``chunk_kda`` (``fla/ops/kda/chunk.py``) called with an already activated gate and
    beta, and the same maths as transformers' ``chunk_kimi_delta_attention`` (WY representation, Kimi Linear
    arXiv:2510.26692 §3; DeltaNet chunking, Yang et al. arXiv:2406.06484).

    Args:
        q, k: ``[B, T, H, K]``, any float dtype.
        v: ``[B, T, H, V]``.
        g: ``[B, T, H, K]`` log-space per-channel decay (``<= 0``; the GLM gate gives ``(-5, 0)`` with the lower
            bound, ``(-inf, 0]`` without). Positive values are computed but may overflow.
        beta: ``[B, T, H]`` write strength, already passed through a sigmoid.
        scale: query scale, default ``K ** -0.5``.
        initial_state: optional ``[N, H, K, V]`` (``N`` documents with ``cu_seqlens``, else ``B``), K-first like HF;
            cast to fp32.
        output_final_state: also return the state after every document.
        cu_seqlens: optional integer ``[N + 1]`` document boundaries over ``T`` (requires ``B == 1``). The state
            restarts (from ``initial_state[n]`` or zero) at every boundary: each document's output and final state
            equal the document run alone.
        chunk_size: chunk length ``C``, a power of two (fla uses 64; 16/32/64 are tested). A document shorter
            than ``C`` uses the next power of two >= its length instead (same maths, less padding).
        use_qk_l2norm_in_kernel: l2-normalise ``q`` and ``k`` (``x / sqrt(sum x^2 + 1e-6)``) before scaling.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, V]`` in ``q.dtype``; ``final_state`` fp32 ``[N or B, H, K, V]`` or
        ``None``.

    Raises:
        ValueError: on shape mismatches, a bad ``chunk_size``, or bad ``cu_seqlens`` (see
            :func:`causal_conv1d_torch`).

    Algorithm and cost:

    * Layout: tokens are scattered into a chunk-aligned ``[L, R, H, C, *]`` layout. Without ``cu_seqlens``,
      ``R = B`` rows of ``L = ceil(T / C)`` chunks (tail zero-padded). With ``cu_seqlens``, every document is padded
      to a whole number of chunks and documents are packed whole, in order, into ``R`` rows of
      ``L = max_n ceil(len_n / C)`` chunks (next-fit); the state is re-seeded at the chunk where a document starts.
      One chunk loop of ``L`` steps then serves all documents in parallel (a pack of 40 documents of 100 tokens
      runs 2 steps instead of 64). Documents shorter than ``C`` use a smaller power-of-two chunk and are
      processed as their own group(s), so a pack of many tiny documents is not padded ``C``-fold. Padding slots have
      ``k = v = q = 0``, ``beta = 0`` and ``g = 0``: they neither write nor decay the state, so a document's final
      state is the state after its last chunk. A document's result depends only on its own tokens and ``C``.
    * Intra-chunk, for all chunks at once: the decay-weighted Gram matrices of :func:`_intra_chunk_products`
      (every exponential ``<= 1``, local sums, recomputed in backward rather than stored), then
      ``(I + diag(beta) Akk)^-1`` applied by one batched ``torch.linalg.solve_triangular`` to ``[beta v | beta k
      exp(G)]``.
    * Inter-chunk: a loop over the ``L`` chunk positions carrying ``S`` ``[R, H, K, V]``: ``U = W_v - W_k S``,
      ``o = (q exp(G)) S + Aqk U``, ``S <- exp(G_C) S + (k exp(G_C - G))^T U``; the decays to the chunk end are
      exclusive suffix sums (no cancellation).
    * Memory, forward and backward: ``O(T * H * (K + V + C))`` plus the per-chunk states ``O(T / C * H * K * V)``;
      nothing is ``O(T^2)`` and nothing holds ``[C, C, K]``.
    """
    _check_core_inputs(q, k, v, g, beta)
    if not isinstance(chunk_size, int) or chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a positive power of two; got chunk_size={chunk_size!r}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    out_dtype = q.dtype
    cu_host = _check_cu_seqlens(cu_seqlens, T, B, "q.shape[0]") if cu_seqlens is not None else None
    n_docs = len(cu_host) - 1 if cu_host is not None else B
    _check_state(initial_state, n_docs, H, K, V)
    if scale is None:
        scale = K**-0.5

    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    h0 = initial_state.float() if initial_state is not None else None

    if cu_host is None:
        plan = _make_plan(B, T, H, _doc_chunk(T, C), None, q.device)
        o, final = _chunk_kda_core(q, k, v, g, beta, h0, plan, output_final_state)
        return o.to(out_dtype), final

    lengths = [b - a for a, b in zip(cu_host[:-1], cu_host[1:])]
    doc_chunks = [_doc_chunk(n, C) for n in lengths]
    sizes = sorted(set(doc_chunks))
    if len(sizes) == 1:
        plan = _make_plan(1, T, H, sizes[0], cu_host, q.device)
        o, final = _chunk_kda_core(q, k, v, g, beta, h0, plan, output_final_state)
        return o.to(out_dtype), final

    # Documents of different chunk sizes: one plan per size, outputs scattered back to their tokens.
    device = q.device
    cu = torch.tensor(cu_host, device=device, dtype=torch.long)
    doc_of_token = torch.repeat_interleave(torch.arange(n_docs, device=device), cu[1:] - cu[:-1], output_size=T)
    size_of_doc = torch.tensor(doc_chunks, device=device)
    o = v.new_zeros(1, T, H, V)
    final = q.new_zeros(n_docs, H, K, V) if output_final_state else None
    for size in sizes:
        docs = [d for d, c in enumerate(doc_chunks) if c == size]
        tokens = torch.nonzero(size_of_doc[doc_of_token] == size).flatten()
        sub_cu = [0]
        for d in docs:
            sub_cu.append(sub_cu[-1] + lengths[d])
        docs_t = torch.tensor(docs, device=device)
        plan = _make_plan(1, len(tokens), H, size, sub_cu, device)
        sub = (t.index_select(1, tokens) for t in (q, k, v, g, beta))
        sub_h0 = h0.index_select(0, docs_t) if h0 is not None else None
        o_g, final_g = _chunk_kda_core(*sub, sub_h0, plan, output_final_state)
        o = o.index_copy(1, tokens, o_g)
        if final is not None:
            final = final.index_copy(0, docs_t, final_g)
    return o.to(out_dtype), final


def _doc_chunk(length: int, chunk_size: int) -> int:
    """Chunk size used for a document: ``chunk_size``, or the next power of two >= ``length`` if smaller."""
    return min(chunk_size, 1 << max(0, length - 1).bit_length())


def _chunk_kda_core(q, k, v, g, beta, h0, plan: _ChunkPlan, output_final_state: bool):
    """The chunked recurrence on preprocessed fp32 inputs (``q`` normalised and scaled) laid out by ``plan``.

    Returns fp32 ``(o [B, T, H, V], final [N, H, K, V] or None)``. See :func:`chunk_kda_torch`.
    """
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    C = plan.chunk
    L, R = plan.num_chunks, plan.num_rows
    qc, kc, vc, gc = (plan.to_chunks(t) for t in (q, k, v, g))  # [L, R, H, C, *]
    bc = plan.to_chunks(beta.unsqueeze(-1))  # [L, R, H, C, 1]

    # Decays relative to the chunk start (prefix sums) and to the chunk end (exclusive suffix sums).
    g_in = gc.cumsum(-2)
    g_out = F.pad(gc.flip(-2).cumsum(-2).flip(-2)[..., 1:, :], (0, 0, 0, 1))
    decay_in = torch.exp(g_in)
    decay_chunk = decay_in[..., -1, :]  # [L, R, H, K]

    M = L * R * H
    flat = (qc.view(M, C, K), kc.view(M, C, K), gc.view(M, C, K))
    if torch.is_grad_enabled() and any(t.requires_grad for t in flat):
        akk, aqk = checkpoint(_intra_chunk_products, *flat, use_reentrant=False)
    else:
        akk, aqk = _intra_chunk_products(*flat)
    a = akk * bc.view(M, C, 1)
    rhs = torch.cat([vc * bc, kc * bc * decay_in], dim=-1).view(M, C, V + K)
    w = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True).view(L, R, H, C, V + K)
    w_v, w_k = w[..., :V], w[..., V:]
    aqk = aqk.view(L, R, H, C, C)
    qg = qc * decay_in
    kg_t = (kc * torch.exp(g_out)).transpose(-1, -2)  # [L, R, H, K, C]

    # Sequential part: one step per chunk position, all rows (documents) in parallel.
    # state None stands for an all-zero state (no initial state): the first chunk then needs no state products,
    # and a single chunk without a requested final state never builds the [R, H, K, V] state at all.
    state = None
    if h0 is not None:
        state = h0 if plan.first_docs is None else h0.index_select(0, plan.first_docs)
    # unbind (not w_v[n]): its backward stacks the per-chunk grads once instead of scattering each into zeros.
    w_v, w_k, qg, aqk, kg_t, decay_chunk = (t.unbind(0) for t in (w_v, w_k, qg, aqk, kg_t, decay_chunk))
    outs, finals, final_docs = [], [], []
    for n in range(L):
        if plan.resets and n in plan.resets and (state is not None or h0 is not None):
            rows, docs = plan.resets[n]
            if state is None:
                state = q.new_zeros(R, H, K, V)
            seed = h0.index_select(0, docs) if h0 is not None else state.new_zeros(rows.numel(), H, K, V)
            state = state.index_put((rows,), seed)
        if state is None:
            u = w_v[n]
            outs.append(aqk[n] @ u)
        else:
            u = w_v[n] - w_k[n] @ state
            outs.append(qg[n] @ state + aqk[n] @ u)
        if n == L - 1 and not output_final_state:
            break
        update = kg_t[n] @ u
        state = update if state is None else decay_chunk[n].unsqueeze(-1) * state + update
        if output_final_state and plan.ends is not None and n in plan.ends:
            rows, docs = plan.ends[n]
            finals.append(state.index_select(0, rows))
            final_docs.append(docs)
    o = plan.from_chunks(torch.stack(outs, dim=0))

    final = None
    if output_final_state:
        if plan.ends is None:
            final = state
        else:
            stacked = torch.cat(finals)
            final = stacked.new_zeros(plan.num_docs, H, K, V).index_copy(0, torch.cat(final_docs), stacked)
    return o, final




@_autocast_off
def recurrent_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token Kimi Delta Attention (decode form), fp32 maths.

    Same maths as transformers' ``recurrent_kimi_delta_attention`` and fla's ``fused_recurrent_kda`` with an
    activated gate and beta; the update rule is the module docstring's. Intended for a few tokens per call
    (decode); it loops over ``T`` in Python and is differentiable.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log decay;
        beta: ``[B, T, H]`` (sigmoid applied).
        scale: default ``K ** -0.5``.
        initial_state: optional ``[B, H, K, V]`` (cast to fp32).
        output_final_state: also return the state after the last token.
        use_qk_l2norm_in_kernel: l2-normalise ``q`` and ``k`` first.

    Returns:
        ``(o [B, T, H, V] in q.dtype, final_state fp32 [B, H, K, V] or None)``.

    Raises:
        ValueError: on shape mismatches.
    """
    _check_core_inputs(q, k, v, g, beta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    _check_state(initial_state, B, H, K, V)
    if scale is None:
        scale = K**-0.5
    out_dtype = q.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    state = initial_state.float() if initial_state is not None else q.new_zeros(B, H, K, V)
    decay = torch.exp(g)
    outs = []
    for t in range(T):
        state = state * decay[:, t].unsqueeze(-1)
        kt = k[:, t].unsqueeze(-2)  # [B, H, 1, K]
        u = beta[:, t, :, None] * (v[:, t] - (kt @ state).squeeze(-2))  # [B, H, V]
        state = state + kt.transpose(-1, -2) @ u.unsqueeze(-2)
        outs.append((q[:, t].unsqueeze(-2) @ state).squeeze(-2))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o.to(out_dtype), (state if output_final_state else None)


def _kda_decode_step(q, k, v, g, beta, state):
    """One decode token of :func:`recurrent_kda_torch` (``T = 1``, l2-normalised q/k, default scale) with fewer ops.

    ``q, k [B, 1, H, K]``, ``v [B, 1, H, V]``, ``g [B, 1, H, K]`` (log decay, fp32), ``beta [B, 1, H]`` (fp32),
    ``state`` fp32 ``[B, H, K, V]`` (not modified) -> ``(o [B, 1, H, V] in q.dtype, new state fp32)``. Same maths and
    op order as the loop body of :func:`recurrent_kda_torch` (tests/test_kda.py compares them).
    """
    out_dtype = q.dtype
    qf, kf, vf = q[:, 0].float(), k[:, 0].float(), v[:, 0].float()
    qf = _l2norm(qf) * (qf.shape[-1] ** -0.5)
    kf = _l2norm(kf)
    state = state.float() * torch.exp(g[:, 0].float()).unsqueeze(-1)
    kt = kf.unsqueeze(-2)  # [B, H, 1, K]
    u = beta[:, 0, :, None].float() * (vf - (kt @ state).squeeze(-2))  # [B, H, V]
    state = state + kt.transpose(-1, -2) @ u.unsqueeze(-2)
    o = qf.unsqueeze(-2) @ state  # [B, H, 1, V]
    return o.transpose(1, 2).to(out_dtype), state


# ----------------------------------------------------------------------------------------------------------------------
# Backend dispatch
# ----------------------------------------------------------------------------------------------------------------------

# backend -> implementation. "fused" (fla-core, ``glm53flash_hf.fla_kda``) is None here and imported on first use by
# kda_chunk / kda_conv, so that importing this module, or a CPU run, never imports fla or triton.
_CHUNK_BACKENDS = {"torch": chunk_kda_torch, "fused": None}
_CONV_BACKENDS = {"torch": causal_conv1d_torch, "fused": None}


def _resolve(backend: str, table: dict, *tensors):
    return table[choose_backend("kda", backend, *tensors)]


def kda_chunk(q, k, v, g, beta, *, backend: str = "torch", **kwargs):
    """Chunked KDA through the chosen backend (``"auto"``, ``"torch"``, ``"fused"``), with an activated gate and beta.

    ``"fused"`` runs fla's ``chunk_kda`` (:func:`glm53flash_hf.fla_kda.chunk_kda_fused`: CUDA, head dims in
    ``[16, 256]``, ``chunk_size`` 32 or 64); otherwise :func:`chunk_kda_torch`. Same arguments and results either way.

    Raises:
        ValueError: unknown backend, or the chosen implementation's argument errors. ``"fused"`` without a usable
        kernel warns once and runs torch (:func:`.dispatch.choose_backend`).
    """
    fn = _resolve(backend, _CHUNK_BACKENDS, q, k, v, g, beta)
    if fn is None:  # fused: imported only now (CUDA tensors, or the interpreter tests)
        from .fla_kda import chunk_kda_fused as fn
    return fn(q, k, v, g, beta, **kwargs)


def kda_conv(x, weight, *, backend: str = "torch", **kwargs):
    """Short causal convolution through the chosen backend (``"auto"``, ``"torch"``, ``"fused"``).

    ``"fused"`` runs fla's Triton ``causal_conv1d`` (:func:`glm53flash_hf.fla_kda.causal_conv1d_fused`); otherwise
    :func:`causal_conv1d_torch`. Same arguments and results either way.

    Raises:
        ValueError: unknown backend, or the chosen implementation's argument errors. ``"fused"`` without a usable
        kernel warns once and runs torch (:func:`.dispatch.choose_backend`).
    """
    fn = _resolve(backend, _CONV_BACKENDS, x, weight)
    if fn is None:  # fused: imported only now (CUDA tensors, or the interpreter tests)
        from .fla_kda import causal_conv1d_fused as fn
    return fn(x, weight, **kwargs)


# ----------------------------------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------------------------------


class Glm53FlashForgetGate(nn.Module):
    """KDA forget gate: per-channel log decay ``g`` [B, S, H, K], fp32.

    ``f = f_b_proj(f_a_proj(x))`` (low rank ``hidden -> K -> H*K``, in ``x``'s dtype), then in fp32, per head ``h``:

    * with ``config.linear_lower_bound = lb`` (release: -5): ``g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))``,
      in ``(lb, 0)``;
    * with ``linear_lower_bound = None``: ``g = -exp(A_log[h]) * softplus(f + dt_bias)`` (softplus linear above 20).

    Same maths as transformers' ``Glm5NextTextForgetGate`` and fla's ``naive_kda_lowerbound_gate`` /
    ``naive_kda_gate``. The softplus uses ``torch.nn.functional.softplus`` (``log1p``), which differs from HF's
    ``log(1 + exp(x))`` by < 1e-7 absolute and keeps gradients finite where ``exp`` overflows.

    Parameters: ``f_a_proj.weight`` [K, hidden], ``f_b_proj.weight`` [H*K, K], ``dt_bias`` fp32 [H*K],
    ``A_log`` fp32 [H].
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.head_dim = config.linear_head_dim
        self.num_heads = config.linear_num_heads
        self.qkv_dim = self.head_dim * self.num_heads
        self.f_a_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, self.qkv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.qkv_dim, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.lower_bound = config.linear_lower_bound

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` [B, S, hidden] -> ``g`` fp32 [B, S, H, K]."""
        B, S = hidden_states.shape[:2]
        f = self.f_b_proj(self.f_a_proj(hidden_states)).float() + self.dt_bias.float()
        f = f.view(B, S, self.num_heads, self.head_dim)
        rate = torch.exp(self.A_log.float()).view(self.num_heads, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * f)
        return -rate * F.softplus(f, beta=1.0, threshold=20.0)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, lower_bound={self.lower_bound}"


class Glm53FlashRMSNormGated(nn.Module):
    """Gated RMSNorm of the KDA output: ``(RMSNorm_fp32(x) * weight * sigmoid(gate)).to(x.dtype)``.

    Args:
        hidden_size: last dim (the KDA head dim ``K``).
        eps: variance epsilon (``config.rms_norm_eps``).

    ``forward(x [..., hidden], gate [..., hidden])``; everything in fp32, cast back to ``x.dtype``. Same maths as
    transformers' ``Glm5NextTextRMSNormGated`` and fla's ``FusedRMSNormGated(activation="sigmoid")``.
    Parameter: ``weight`` [hidden].
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if gate.shape != hidden_states.shape:
            raise ValueError(f"gate must have the shape of x {tuple(hidden_states.shape)}; got {tuple(gate.shape)}")
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        x = self.weight.float() * x * torch.sigmoid(gate.float())
        return x.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class Glm53FlashLinearAttention(nn.Module):
    """The KDA token mixer of GLM-5.3-Flash (34 of the 45 layers in the release).

    Parameters (names, shapes and dtypes equal to transformers' ``Glm5NextTextLinearAttention``; ``D`` hidden,
    ``H`` ``linear_num_heads``, ``K`` ``linear_head_dim``, ``W`` ``linear_conv_kernel_dim``):
    ``q_proj``, ``k_proj``, ``v_proj`` [H*K, D]; ``conv1d.weight`` fp32 [3*H*K, 1, W] (depthwise, channels q|k|v);
    ``forget_gate`` (:class:`Glm53FlashForgetGate`); ``b_proj`` [H, D]; ``g_a_proj`` [K, D]; ``g_b_proj`` [H*K, K];
    ``o_norm.weight`` [K]; ``o_proj`` [D, H*K]. No biases.

    Forward: ``q, k, v = silu(causal_conv([q_proj x | k_proj x | v_proj x]))``, ``g = forget_gate(x)``,
    ``beta = sigmoid(b_proj x)`` (computed in fp32), ``o = KDA(q, k, v, g, beta)`` (l2-normalised q, k; scale
    ``K^-0.5``), ``out = o_proj(o_norm(o, g_b_proj(g_a_proj x)))``. Spec: ``model-spec.md`` §4.

    The implementation is chosen per call by ``config.kernels["kda"]`` (``"auto"`` / ``"torch"`` / ``"fused"``) and
    the tensors' device: see :meth:`forward` and :mod:`glm53flash_hf.fla_kda`.
    """

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.linear_num_heads
        self.head_dim = config.linear_head_dim
        self.qkv_dim = self.num_heads * self.head_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.layer_idx = layer_idx
        self.activation = config.hidden_act
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"hidden_act must be 'silu' for the KDA short convolution; got {self.activation!r}")
        self.backend = requested_backend(config, "kda")

        self.q_proj = nn.Linear(self.hidden_size, self.qkv_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.qkv_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.qkv_dim, bias=False)
        self.conv_dim = 3 * self.qkv_dim
        self.conv1d = nn.Conv1d(
            in_channels=self.conv_dim,
            out_channels=self.conv_dim,
            kernel_size=self.conv_kernel_size,
            groups=self.conv_dim,
            padding=self.conv_kernel_size - 1,
            bias=False,
            dtype=torch.float32,
        )
        self.forget_gate = Glm53FlashForgetGate(config)
        self.b_proj = nn.Linear(self.hidden_size, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(self.hidden_size, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, self.qkv_dim, bias=False)
        self.o_norm = Glm53FlashRMSNormGated(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(self.qkv_dim, self.hidden_size, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        layout: DocumentLayout,
        cache=None,
        cache_context=None,
        **kwargs,
    ) -> torch.Tensor:
        """Mix tokens within documents.

        Args:
            hidden_states: ``[B, S, D]``.
            layout: the batch's :class:`~glm53flash_hf.packing.DocumentLayout`. Padding tokens are zeroed (as HF
                does with a 2-D mask, but with ``masked_fill`` so non-finite padding cannot leak). With
                ``layout.trivial`` the rows run batched; otherwise the batch is flattened to ``[1, B*S]`` and the
                convolution and recurrence restart at every segment of ``layout.cu_seqlens`` (padding runs are
                their own segments; their outputs are finite and unused).
            cache: optional transformers ``Cache`` (generation): see :meth:`forward_cached`; ``layout`` then only
                gives the padding (``layout.valid``) of this call's tokens.
            cache_context: unused here (accepted for a uniform layer signature).

        Returns:
            ``[B, S, D]`` in ``hidden_states``' dtype.

        Implementation: ``choose_backend("kda", self.backend, ...)`` once per call, from the tensors only (device,
        dtype, and the head dim carried by ``o_norm.weight`` viewed ``[1, 1, 1, K]``), never from ``self.training`` or
        grad mode, so an activation-checkpoint recompute takes the path of the forward it replays. ``"fused"``:
        :func:`glm53flash_hf.fla_kda.kda_layer_forward_fused` (fla-core's conv, ``chunk_kda`` with the gate, beta
        sigmoid and l2-norm in the kernel, ``rms_norm_gated``; same maths); else the torch path below.

        Raises:
            NotImplementedError: ``cache`` that is not a transformers ``Cache``
                (:class:`~.generation_cache.UnsupportedCacheError`, also a ``TypeError``).
            ValueError: ``layout`` does not match ``[B, S]``; on the fused path, a sharded DTensor parameter (named).
        """
        B, S, _ = hidden_states.shape
        if layout.batch_size != B or layout.seq_len != S:
            raise ValueError(
                f"layout is for [{layout.batch_size}, {layout.seq_len}] but hidden_states is [{B}, {S}, ...]"
            )
        if cache is not None:
            return self.forward_cached(hidden_states, cache, valid=None if layout.trivial else layout.valid)
        if choose_backend("kda", self.backend, hidden_states, self.o_norm.weight.view(1, 1, 1, -1)) == "fused":
            from .fla_kda import kda_layer_forward_fused

            return kda_layer_forward_fused(self, hidden_states, layout)
        H, K = self.num_heads, self.head_dim
        if not layout.trivial:
            # masked_fill, not a multiply: garbage (even non-finite) padding embeddings cannot reach any gradient.
            hidden_states = hidden_states.masked_fill(~layout.valid[:, :, None], 0.0)

        mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1)
        g = self.forget_gate(hidden_states)
        beta = torch.sigmoid(self.b_proj(hidden_states).float())
        cu = None
        if not layout.trivial:
            mixed = mixed.reshape(1, B * S, self.conv_dim)
            g = g.reshape(1, B * S, H, K)
            beta = beta.reshape(1, B * S, H)
            cu = layout.cu_seqlens
        # The layer chose the torch path above: its conv and core follow that one choice (a conv probe alone could
        # accept what the layer's probe refused, e.g. a head dim fla does not support).
        mixed, _ = kda_conv(
            mixed, self.conv1d.weight[:, 0, :], backend="torch", cu_seqlens=cu, activation=self.activation
        )
        b, t = mixed.shape[:2]
        q, k, v = (x.reshape(b, t, H, K) for x in mixed.split(self.qkv_dim, dim=-1))
        o, _ = kda_chunk(q, k, v, g, beta, backend="torch", cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        o = o.reshape(B, S, H, K)
        gate = self.g_b_proj(self.g_a_proj(hidden_states)).view(B, S, H, K)
        return self.o_proj(self.o_norm(o, gate).reshape(B, S, self.qkv_dim))

    def forward_cached(self, hidden_states: torch.Tensor, cache, valid: torch.Tensor | None = None) -> torch.Tensor:
        """KDA over ``hidden_states`` ``[B, S, D]`` continuing from (and updating) this layer's cache states.

        The cache layer (transformers' ``LinearAttentionLayer``, ``cache.layers[layer_idx]``) holds the conv state
        ``[B, 3*H*K, W]`` (the row's last ``W`` conv inputs ``[q|k|v]``, oldest first, in the projections' dtype —
        the layout transformers' glm5_next writes) and the recurrent state fp32 ``[B, H, K, V]``.

        * Decode (``S == 1`` with a cached state): one step. The conv window is the cached ``W - 1`` inputs plus
          the new one (``cache.update_conv_state`` shifts it in), ``y = silu(sum_w window * weight)`` in fp32, and
          the delta rule advances the state by one token: :func:`_kda_decode_step` (the ``T = 1`` case of
          :func:`recurrent_kda_torch` with fewer ops), or, when the backend choice is ``"fused"`` (CUDA) and no
          input needs a gradient, fla's ``fused_recurrent_kda`` with the gate and beta in the kernel
          (:func:`glm53flash_hf.fla_kda.fused_recurrent_step`).
        * Prefill and prefill continuation (``S > 1``, or no state yet): :func:`causal_conv1d_torch` and
          :func:`chunk_kda_torch` with the cached states as ``initial_state`` (zeros when empty) and
          ``output_final_state``; the new states replace the cached ones. Two chunks equal one prefill.

        Rows run batched (no ``cu_seqlens``). Left padding (``valid`` False) is zeroed first; a zero input gives
        ``q = k = v = 0`` after the conv, so the state and the conv history stay zero until the row's first real
        token — the same numbers as the uncached forward, which restarts a segment there.

        Args:
            hidden_states: ``[B, S, D]``.
            cache: transformers ``Cache`` whose layer ``layer_idx`` is a linear-attention layer.
            valid: optional bool ``[B, S]`` (False = padding).

        Returns:
            ``[B, S, D]`` in ``hidden_states``' dtype.

        Raises:
            UnsupportedCacheError: ``cache`` is not a transformers ``Cache``.
            ValueError: the cache layer is not a linear-attention layer (transformers' message).
        """
        from .generation_cache import check_cache

        check_cache(cache, "Glm53FlashLinearAttention")
        B, S, _ = hidden_states.shape
        H, K, W = self.num_heads, self.head_dim, self.conv_kernel_size
        if valid is not None:
            hidden_states = hidden_states.masked_fill(~valid[:, :, None], 0.0)
        mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1)
        weight = self.conv1d.weight[:, 0, :]  # [C, W] fp32
        conv_state = cache.get_conv_state(self.layer_idx)
        recurrent_state = cache.get_recurrent_state(self.layer_idx)
        decode = S == 1 and conv_state is not None and recurrent_state is not None
        fused_step = (
            decode
            and not (
                torch.is_grad_enabled()
                and (hidden_states.requires_grad or any(p.requires_grad for p in self.parameters()))
            )
            and choose_backend("kda", self.backend, hidden_states, self.o_norm.weight.view(1, 1, 1, -1)) == "fused"
        )
        if fused_step:  # the kernel applies the gate and the beta sigmoid itself
            gate_f = self.forget_gate
            g = gate_f.f_b_proj(gate_f.f_a_proj(hidden_states)).view(B, S, H, K)
            beta = self.b_proj(hidden_states)
        else:
            g = self.forget_gate(hidden_states)
            beta = torch.sigmoid(self.b_proj(hidden_states).float())

        if decode:
            window = cache.update_conv_state(mixed.transpose(1, 2), self.layer_idx, conv_kernel_size=W)
            y = (window[..., -W:].to(weight.dtype) * weight).sum(-1)  # [B, C]
            mixed = F.silu(y).to(mixed.dtype).unsqueeze(1)
        else:
            mixed, final_conv = kda_conv(
                mixed,
                weight,
                backend=self.backend,
                activation=self.activation,
                initial_state=conv_state,
                output_final_state=True,
            )
            # ``final_conv`` holds exactly the last W inputs: stored as is, first call or continuation.
            cache.update_conv_state(final_conv, self.layer_idx, conv_kernel_size=W)
        q, k, v = (x.reshape(B, S, H, K) for x in mixed.split(self.qkv_dim, dim=-1))
        if fused_step:
            from .fla_kda import fused_recurrent_step

            o, state = fused_recurrent_step(
                q, k, v, g, beta, gate_f.A_log, gate_f.dt_bias, gate_f.lower_bound, recurrent_state
            )
        elif decode:
            o, state = _kda_decode_step(q, k, v, g, beta, recurrent_state)
        else:
            o, state = kda_chunk(
                q,
                k,
                v,
                g,
                beta,
                backend=self.backend,
                initial_state=recurrent_state,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
        cache.update_recurrent_state(state.float(), self.layer_idx)
        gate = self.g_b_proj(self.g_a_proj(hidden_states)).view(B, S, H, K)
        return self.o_proj(self.o_norm(o, gate).reshape(B, S, self.qkv_dim))


def init_kda_weights(module: nn.Module, config) -> None:
    """From-scratch initialisation of the KDA-specific parameters of ``module`` (one module, not recursive).

    Reproduces transformers ``Glm5NextPreTrainedModel._init_weights`` (same draws in the same order, guarded by
    ``_is_hf_initialized`` through ``transformers.initialization``):

    * :class:`Glm53FlashForgetGate`: ``A_log = 0`` when ``linear_lower_bound`` is set, else ``log(U(1, 16))``;
      ``dt_bias = softplus^-1(dt)`` with ``dt = max(exp(U(log 1e-3, log 1e-1)), 1e-4)`` (fla's recipe);
    * :class:`Glm53FlashRMSNormGated`: ``weight = 1``.

    Linear and conv weights are left to the generic ``_init_weights`` (normal, ``initializer_range``). Other
    modules are ignored. ``config`` is accepted for a uniform signature across families.
    """
    if isinstance(module, Glm53FlashForgetGate):
        if module.lower_bound is not None:
            init.zeros_(module.A_log)
        else:
            init.copy_(module.A_log, init.uniform_(module.A_log, a=1.0, b=16.0).log())
        init.uniform_(module.dt_bias, a=math.log(1e-3), b=math.log(1e-1))
        dt = module.dt_bias.exp().clamp_min(1e-4)
        init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))
    elif isinstance(module, Glm53FlashRMSNormGated):
        init.ones_(module.weight)
