"""Torch operators of the KDA (Kimi Delta Attention) family: the short causal convolution, the chunked and the
recurrent delta rule, and the argument checks shared with the fused path.

This is the torch path of the KDA family: the oracle of the fused kernels (:mod:`glm53flash_hf.kda_fused`), the
path of CPU tensors and of every call whose backend choice is ``"torch"`` (training, prefill, and cached decoding,
where a step is :func:`causal_conv1d_torch` and :func:`recurrent_kda_torch` on one token with the cached states).
The modules that call these functions are in :mod:`glm53flash_hf.kda`. Leaf module: it imports torch and
:mod:`.graph_ops` only. Under ``torch.compile`` the convolution and the chunked core run as the custom ops
``glm53flash::kda_causal_conv1d`` and ``glm53flash::kda_chunk`` (:func:`.graph_ops.recompute_op`): their packed
layouts are planned from the document boundaries on the host.

Maths (Kimi Linear, arXiv:2510.26692 §3; transformers ``models/glm5_next/modeling_glm5_next.py``:
``causal_conv1d_fn``, ``causal_conv1d_update``, ``chunk_kimi_delta_attention``, ``recurrent_kimi_delta_attention``;
fla ``fla.ops.kda.chunk_kda``, ``fla.ops.kda.fused_recurrent_kda``, ``fla.modules.causal_conv1d``). Per head, with a
fp32 state ``S`` of shape ``[K, V]``, a per-channel log decay ``g_t`` (``[K]``, ``<= 0``) and a write strength
``beta_t`` in ``(0, 1)``::

    S <- diag(exp(g_t)) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t                      (q_t already l2-normalised and scaled by K^-0.5)

Both token mixers (convolution and recurrence) restart at every document boundary given by ``cu_seqlens`` (fla's
varlen convention: ``B == 1``, boundaries over the flattened tokens).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .graph_ops import in_graph, recompute_op

__all__ = [
    "check_conv_inputs",
    "check_core_inputs",
    "check_cu_seqlens",
    "check_state",
    "causal_conv1d_torch",
    "chunk_kda_torch",
    "recurrent_kda_torch",
]

_L2NORM_EPS = 1e-6


# ----------------------------------------------------------------------------------------------------------------------
# Small helpers and argument checks
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


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, batch: int, name_batch: str) -> list[int]:
    """Validate fla-style ``cu_seqlens`` and return it as a host list (one device sync, like fla).

    Args:
        cu_seqlens: integer ``[N + 1]`` document boundaries over ``total`` tokens.
        total: the token count ``T`` the boundaries must end at.
        batch: the batch size of the tensors the boundaries go with (must be 1).
        name_batch: how to name ``batch`` in messages (``"q.shape[0]"``, ...).

    Returns:
        ``cu_seqlens`` as a list of ``N + 1`` Python ints.

    Raises:
        ValueError: ``batch != 1``; ``cu_seqlens`` not 1-D with at least 2 entries, not an integer tensor, not
            starting at 0 and ending at ``total``, or not strictly increasing (an empty document).
    """
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


def check_conv_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    activation: str | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> list[int] | None:
    """Argument checks of the short convolution, shared by :func:`causal_conv1d_torch` and
    :func:`glm53flash_hf.kda_fused.causal_conv1d_fused`.

    Args:
        x: expected ``[B, T, D]``.
        weight: expected ``[D, W]``.
        activation: expected ``None``, ``"silu"`` or ``"swish"``.
        initial_state: ``None`` or expected ``[N, D, W]`` (``N`` documents with ``cu_seqlens``, else ``B``).
        cu_seqlens: ``None`` or document boundaries (see :func:`check_cu_seqlens`).

    Returns:
        ``cu_seqlens`` as a host list, or ``None`` without it.

    Raises:
        ValueError: a shape above does not hold, an unknown activation, or bad ``cu_seqlens``.
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, D]; got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [D={x.shape[-1]}, W]; got shape {tuple(weight.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish'; got activation={activation!r}")
    B, T, D = x.shape
    W = weight.shape[1]
    cu_host = check_cu_seqlens(cu_seqlens, T, B, "x.shape[0]") if cu_seqlens is not None else None
    N = B if cu_host is None else len(cu_host) - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, D, W):
        raise ValueError(f"initial_state must be [N={N}, D={D}, W={W}]; got shape {tuple(initial_state.shape)}")
    return cu_host


def check_core_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
    """Shape checks of the delta-rule core, shared by the torch and the fused functions.

    Args:
        q, k, g: expected ``[B, T, H, K]`` (``g`` the per-channel log decay, or the gate pre-activation for the
            in-kernel gate); v: expected ``[B, T, H, V]``; beta: expected ``[B, T, H]``.

    Raises:
        ValueError: naming the first tensor whose shape does not match.
    """
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


def check_state(initial_state: torch.Tensor | None, n: int, H: int, K: int, V: int) -> None:
    """Check a recurrent state: ``None`` or ``[n, H, K, V]`` (K-first, the transformers cache layout).

    Raises:
        ValueError: another shape.
    """
    if initial_state is not None and tuple(initial_state.shape) != (n, H, K, V):
        raise ValueError(f"initial_state must be [N={n}, H={H}, K={K}, V={V}]; got {tuple(initial_state.shape)}")


def _prepare_core(q, k, v, g, beta, scale: float | None, use_qk_l2norm: bool):
    """fp32 copies of the core inputs with ``q`` and ``k`` l2-normalised (when asked) and ``q`` scaled (default
    ``K ** -0.5``)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k, v, g, beta


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
    if in_graph():
        y, final = _CONV_OP(x, weight, initial_state, cu_seqlens, activation=activation,
                            output_final_state=output_final_state)
        return y, final if output_final_state else None
    cu_host = check_conv_inputs(x, weight, activation, initial_state, cu_seqlens)
    B, T, D = x.shape
    W = weight.shape[1]
    N = B if cu_host is None else len(cu_host) - 1
    cdtype = weight.dtype
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


def _lower_blocks(a: torch.Tensor, h: int) -> torch.Tensor:
    """The ``[h, h]`` blocks (rows ``2hb + h ..``, columns ``2hb ..``) below the diagonal ``[h, h]`` blocks of every
    ``[2h, 2h]`` diagonal block of a contiguous ``a`` ``[M, C, C]``, as a strided view ``[M, C / 2h, h, h]``."""
    M, C, _ = a.shape
    return a.as_strided((M, C // (2 * h), h, h), (C * C, 2 * h * (C + 1), C, 1), a.storage_offset() + h * C)


class _DecayLevels:
    """Iterate, for ``h = 1, 2, 4, .. < C``, over ``(h, e_row, e_col)`` of :func:`_intra_chunk_products` for ``g``
    ``[M, C, K]``: ``e_row`` ``[M, C / 2h, h, K]`` the exponentials of the inclusive prefix sums of ``g`` inside the
    second half of every ``2h`` block, ``e_col`` those of the exclusive suffix sums inside the first half. The sums
    are built level by level by adding the previous level's block totals (sums of terms of one sign: no
    cancellation); after the iteration ``prefix`` / ``suffix`` hold the inclusive prefix and exclusive suffix sums
    over the whole chunk."""

    def __init__(self, g: torch.Tensor):
        self.prefix = g.clone()  # inclusive prefix sums inside blocks of h
        self.suffix = torch.zeros_like(g)  # exclusive suffix sums inside blocks of h

    def __iter__(self):
        M, C, K = self.prefix.shape
        h = 1
        while h < C:
            nb = C // (2 * h)
            pv, sv = self.prefix.view(M, nb, 2, h, K), self.suffix.view(M, nb, 2, h, K)
            yield h, torch.exp(pv[:, :, 1]), torch.exp(sv[:, :, 0])
            sv[:, :, 0] += pv[:, :, 1, -1:]
            pv[:, :, 1] += pv[:, :, 0, -1:]
            h *= 2


def _reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative sum from the end along dim -2."""
    return x.flip(-2).cumsum(-2).flip(-2)


class _IntraChunkProducts(torch.autograd.Function):
    """:func:`_intra_chunk_products` with a hand-written backward that recomputes only the level decay factors."""

    @staticmethod
    def forward(ctx, q, k, g):
        M, C, K = k.shape
        akk, aqk = k.new_zeros(M, C, C), k.new_zeros(M, C, C)
        aqk.diagonal(dim1=-2, dim2=-1).copy_((q * k).sum(-1))
        levels = _DecayLevels(g)
        for h, e_row, e_col in levels:
            qv, kv = (t.view(M, C // (2 * h), 2, h, K) for t in (q, k))
            col = (kv[:, :, 0] * e_col).transpose(-1, -2)  # [M, nb, K, h]
            _lower_blocks(akk, h).copy_((kv[:, :, 1] * e_row) @ col)
            _lower_blocks(aqk, h).copy_((qv[:, :, 1] * e_row) @ col)
        decay_in, decay_out = levels.prefix.exp_(), levels.suffix.exp_()
        ctx.save_for_backward(q, k, g, decay_in, decay_out)
        return akk, aqk, decay_in, decay_out

    @staticmethod
    def backward(ctx, d_akk, d_aqk, d_in, d_out):
        q, k, g, decay_in, decay_out = ctx.saved_tensors
        M, C, K = k.shape
        d_akk, d_aqk = d_akk.contiguous(), d_aqk.contiguous()
        d_diag = d_aqk.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)  # [M, C, 1]
        dq, dk = d_diag * k, d_diag * q
        # The gate gradient from local sums, as the forward builds its factors: a level's row factor is the exponential
        # of a prefix sum inside the second half (g_s for s <= i), its column factor that of an exclusive suffix sum
        # inside the first half (s > j). Summing, per position, only the pairs that straddle it keeps the rounding
        # error at the size of the true gradient (a reverse cumulative sum over the chunk of row-minus-column terms
        # would cancel large terms). decay_in = exp(sum_{s <= i} g_s), decay_out = exp(sum_{s > i} g_s).
        dg = _reverse_cumsum(d_in * decay_in)
        dg[:, 1:] += (d_out * decay_out)[:, :-1].cumsum(-2)
        for h, e_row, e_col in _DecayLevels(g):
            nb = C // (2 * h)
            qv, kv, dqv, dkv, dgv = (t.view(M, nb, 2, h, K) for t in (q, k, dq, dk, dg))
            x, y, z = kv[:, :, 1] * e_row, qv[:, :, 1] * e_row, kv[:, :, 0] * e_col  # [M, nb, h, K]
            b_kk, b_qk = _lower_blocks(d_akk, h), _lower_blocks(d_aqk, h)  # [M, nb, h, h]
            dx, dy = b_kk @ z, b_qk @ z
            dz = (b_kk.transpose(-1, -2) @ x).add_(b_qk.transpose(-1, -2) @ y)
            dkv[:, :, 1].addcmul_(dx, e_row)
            dqv[:, :, 1].addcmul_(dy, e_row)
            dkv[:, :, 0].addcmul_(dz, e_col)
            d_row = (dx * x).addcmul_(dy, y)
            d_col = dz.mul_(z)
            dgv[:, :, 1] += _reverse_cumsum(d_row) if h > 1 else d_row
            if h > 1:
                dgv[:, :, 0, 1:] += d_col[:, :, :-1].cumsum(-2)
        return dq, dk, dg


def _intra_chunk_products(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Decay-weighted intra-chunk Gram matrices and the decays to the chunk start and end, every exponential ``<= 1``.

    For one chunk with inclusive cumulative log decay ``G_i = sum_{s <= i} g_s``:
    ``Akk[i, j] = sum_d k_id k_jd exp(G_id - G_jd)`` for ``j < i`` (strictly lower, zero elsewhere) and
    ``Aqk[i, j] = sum_d q_id k_jd exp(G_id - G_jd)`` for ``j <= i``.

    Args: ``q``, ``k``, ``g`` fp32 ``[M, C, K]`` (``C`` a power of two). Returns ``(Akk, Aqk, decay_in,
    decay_out)``: ``Akk``, ``Aqk`` ``[M, C, C]``; ``decay_in[i] = exp(G_i)`` and ``decay_out[i] = exp(G_{C-1} - G_i)``
    ``[M, C, K]``, the latter from exclusive suffix sums (no cancellation). Differentiable (a custom backward that
    recomputes the level factors, :class:`_IntraChunkProducts`).

    Hierarchical factorisation (no ``[C, C, K]`` and no ``[16, 16, K]`` tensor): at level ``h`` the chunk is cut
    into blocks of ``2h``; for the pairs (row in the second half, column in the first half) of every block, the
    reference point ``r`` is the last position of the first half, and
    ``exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j)`` with ``G_i - G_r`` the prefix sum of ``g`` inside the
    second half and ``G_r - G_j`` the exclusive suffix sum inside the first half. Both are sums of ``g <= 0``
    terms, so both factors are in ``[0, 1]``: no overflow whatever the gate (a factor that underflows to 0 means
    the exact product is below fp32's range too), and because the sums are *local* (not differences of chunk
    cumulative sums) there is no cancellation error when the gate is large. The off-diagonal block is then
    one batched matmul ``[h, K] @ [K, h]``, written in place into the result. ``log2(C)`` levels cover every pair
    ``j < i``; the diagonal of ``Aqk`` is ``q_i . k_i``. Temporaries are ``O(M * C * K)`` per level.
    """
    return _IntraChunkProducts.apply(q.contiguous(), k.contiguous(), g.contiguous())


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
        ValueError: on shape mismatches, a bad ``chunk_size``, or bad ``cu_seqlens`` (see :func:`check_cu_seqlens`).

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
      (every exponential ``<= 1``, local sums; a custom backward recomputes their level factors, none is stored), then
      ``(I + diag(beta) Akk)^-1`` applied by one batched ``torch.linalg.solve_triangular`` to ``[beta v | beta k
      exp(G)]``.
    * Inter-chunk: a loop over the ``L`` chunk positions carrying only ``S`` ``[R, H, K, V]``:
      ``U = W_v - W_k S``, ``S <- exp(G_C) S + (k exp(G_C - G))^T U`` (:class:`_StateRecurrence`, whose backward is
      one reverse loop carrying ``dS``); then ``o = (q exp(G)) S_n + Aqk U_n`` for all chunks in two batched
      products over the stacked states. The decays to the chunk end are exclusive suffix sums (no cancellation).
    * Memory, forward and backward: ``O(T * H * (K + V + C))`` plus the per-chunk states ``O(T / C * H * K * V)``;
      nothing is ``O(T^2)`` and nothing holds ``[C, C, K]``.
    """
    check_core_inputs(q, k, v, g, beta)
    if not isinstance(chunk_size, int) or chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a positive power of two; got chunk_size={chunk_size!r}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    out_dtype = q.dtype
    if in_graph():
        o, final = _CHUNK_OP(q, k, v, g, beta, initial_state, cu_seqlens, scale=scale,
                             output_final_state=output_final_state, chunk_size=chunk_size,
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return o, final if output_final_state else None
    cu_host = check_cu_seqlens(cu_seqlens, T, B, "q.shape[0]") if cu_seqlens is not None else None
    n_docs = len(cu_host) - 1 if cu_host is not None else B
    check_state(initial_state, n_docs, H, K, V)
    q, k, v, g, beta = _prepare_core(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
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


def _causal_matmul(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``a @ u`` for a lower-triangular ``a`` ``[..., C, C]`` and ``u`` ``[..., C, V]``, causal also for non-finite
    entries of ``u``.

    A plain matmul multiplies the zeros above ``a``'s diagonal with every row of ``u``, so a NaN or inf in row ``j``
    would reach the rows ``i < j`` (``0 * nan = nan``). Here non-finite entries of ``u`` are replaced by zeros
    (``torch.where``, a select) before the product, and the output entries ``[i, v]`` with a non-finite ``u[j, v]``
    at some ``j <= i`` are set to NaN afterwards. For finite ``u`` the result is the plain product, bit for bit.
    """
    bad = ~torch.isfinite(u)
    out = a @ torch.where(bad, torch.zeros((), dtype=u.dtype, device=u.device), u)
    poisoned = bad.cumsum(-2, dtype=torch.int32) > 0
    return torch.where(poisoned, torch.full((), float("nan"), dtype=out.dtype, device=out.device), out)


def _chunk_kda_core(q, k, v, g, beta, h0, plan: _ChunkPlan, output_final_state: bool):
    """The chunked recurrence on preprocessed fp32 inputs (``q`` normalised and scaled) laid out by ``plan``.

    Returns fp32 ``(o [B, T, H, V], final [N, H, K, V] or None)``. See :func:`chunk_kda_torch`.
    """
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    C = plan.chunk
    L, R = plan.num_chunks, plan.num_rows
    qc, kc, vc, gc = (plan.to_chunks(t) for t in (q, k, v, g))  # [L, R, H, C, *]
    bc = plan.to_chunks(beta.unsqueeze(-1))  # [L, R, H, C, 1]

    # Gram matrices and the decays relative to the chunk start (prefix sums) and to its end (exclusive suffix sums).
    M = L * R * H
    akk, aqk, decay_in, decay_out = _intra_chunk_products(qc.view(M, C, K), kc.view(M, C, K), gc.view(M, C, K))
    decay_in, decay_out = decay_in.view(L, R, H, C, K), decay_out.view(L, R, H, C, K)
    decay_chunk = decay_in[..., -1, :]  # [L, R, H, K]
    a = akk * bc.view(M, C, 1)
    rhs = torch.cat([vc * bc, kc * bc * decay_in], dim=-1).view(M, C, V + K)
    w = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True).view(L, R, H, C, V + K)
    w_v, w_k = w[..., :V], w[..., V:]
    # Non-finite values reach U only through W (this chunk's inputs) or the state (seeded from h0): with both finite
    # the plain product is causal; otherwise the select-based one keeps a NaN/inf from reaching earlier tokens.
    finite = bool(torch.isfinite(w).all()) and (h0 is None or bool(torch.isfinite(h0).all()))
    intra = torch.matmul if finite else _causal_matmul
    aqk = aqk.view(L, R, H, C, C)
    qg = qc * decay_in
    kg_t = (kc * decay_out).transpose(-1, -2)  # [L, R, H, K, C]

    # Sequential part (the state recurrence only), then every chunk's output in two batched products.
    states, u, final = _StateRecurrence.apply(w_v, w_k, kg_t, decay_chunk, h0, plan, output_final_state)
    o = plan.from_chunks(qg @ states + intra(aqk, u))
    return o, (final if output_final_state else None)


class _StateRecurrence(torch.autograd.Function):
    """The inter-chunk state recurrence of the chunked delta rule, with a hand-written backward.

    Per chunk position ``n`` (all rows and heads at once), from the state ``S_n`` ``[K, V]`` entering chunk ``n``::

        U_n = W_v,n - W_k,n S_n               # [C, V]
        S_{n+1} = diag(d_n) S_n + KG_n U_n    # KG_n [K, C], d_n [K]

    ``S_0`` is ``h0`` (rows seeded from ``plan.first_docs``) or zero, and a row is re-seeded (``h0[doc]`` or zero)
    at the chunk where a document starts (``plan.resets``). Only the two state products run in the loop; the
    outputs that read the states are batched products over the returned stack.

    Inputs: ``w_v`` ``[L, R, H, C, V]``, ``w_k`` ``[L, R, H, C, K]``, ``kg_t`` ``[L, R, H, K, C]``, ``decay``
    ``[L, R, H, K]`` (any float dtype, all the same), ``h0`` ``[N, H, K, V]`` or ``None``, ``plan`` (a
    :class:`_ChunkPlan`), ``output_final_state``.

    Returns ``(states [L, R, H, K, V], u [L, R, H, C, V], final)``: ``states[n] = S_n`` (after any re-seeding),
    ``u[n] = U_n``, ``final`` the state after every document's last chunk (``[N, H, K, V]``; an empty tensor when
    ``output_final_state`` is false). Backward: one reverse loop carrying ``dS`` (two products per step), then the
    gradients of ``w_k``, ``kg_t`` and ``decay`` as batched products over the stacked states; it saves only the
    inputs it needs and the two outputs.
    """

    @staticmethod
    def forward(ctx, w_v, w_k, kg_t, decay, h0, plan, output_final_state):
        L, R, H, C, V = w_v.shape
        K = w_k.shape[-1]
        M = R * H
        wv3, wk3, kg3 = (t.contiguous().view(L, M, *t.shape[-2:]) for t in (w_v, w_k, kg_t))
        dec3 = decay.contiguous().view(L, M, K, 1)
        states = w_v.new_empty(L, M, K, V)
        u = w_v.new_empty(L, M, C, V)
        if h0 is None:
            states[0].zero_()
        else:
            states[0].copy_((h0 if plan.first_docs is None else h0.index_select(0, plan.first_docs)).view(M, K, V))
        finals, final_docs = [], []
        last = None
        for n in range(L):
            s = states[n]
            if n > 0 and plan.resets and n in plan.resets:
                rows, docs = plan.resets[n]
                seed = h0.index_select(0, docs) if h0 is not None else s.new_zeros(rows.numel(), H, K, V)
                s.view(R, H, K, V).index_copy_(0, rows, seed.to(s.dtype))
            if n == 0 and h0 is None:
                u[0].copy_(wv3[0])  # zero state: no product
            else:
                torch.baddbmm(wv3[n], wk3[n], s, alpha=-1, out=u[n])
            if n == L - 1 and not output_final_state:
                break
            nxt = states[n + 1] if n + 1 < L else torch.empty_like(s)
            torch.mul(s, dec3[n], out=nxt)
            nxt.baddbmm_(kg3[n], u[n])
            last = nxt
            if output_final_state and plan.ends is not None and n in plan.ends:
                rows, docs = plan.ends[n]
                finals.append(nxt.view(R, H, K, V).index_select(0, rows))
                final_docs.append(docs)
        if not output_final_state:
            final = w_v.new_empty(0)
        elif plan.ends is None:
            final = last.view(R, H, K, V).clone()
        else:
            stacked = torch.cat(finals)
            final = stacked.new_zeros(plan.num_docs, H, K, V).index_copy(0, torch.cat(final_docs), stacked)
        ctx.plan, ctx.output_final_state, ctx.has_h0 = plan, output_final_state, h0 is not None
        ctx.h0_shape = None if h0 is None else h0.shape
        ctx.save_for_backward(wk3, kg3, dec3, states, u)
        return states.view(L, R, H, K, V), u.view(L, R, H, C, V), final

    @staticmethod
    def backward(ctx, d_states, d_u, d_final):
        wk3, kg3, dec3, states, u = ctx.saved_tensors
        plan, output_final_state, has_h0 = ctx.plan, ctx.output_final_state, ctx.has_h0
        L, M, K, V = states.shape
        C = u.shape[-2]
        R = plan.num_rows
        H = M // R
        ds3 = d_states.contiguous().view(L, M, K, V)
        du3 = d_u.contiguous().view(L, M, C, V)
        # grad_next[n]: the gradient of the state leaving chunk n (before any re-seeding at chunk n + 1).
        grad_next = states.new_zeros(L, M, K, V)
        if output_final_state:
            if plan.ends is None:
                grad_next[L - 1].copy_(d_final.reshape(M, K, V))
            elif L - 1 in plan.ends:
                rows, docs = plan.ends[L - 1]
                grad_next[L - 1].view(R, H, K, V).index_add_(0, rows, d_final.index_select(0, docs))
        du_tot = torch.empty_like(du3)
        d_h0 = states.new_zeros(ctx.h0_shape) if has_h0 else None
        for n in range(L - 1, -1, -1):
            gn = grad_next[n]
            torch.baddbmm(du3[n], kg3[n].transpose(-1, -2), gn, out=du_tot[n])
            if n == 0 and not has_h0:
                break
            target = grad_next[n - 1] if n > 0 else torch.empty_like(gn)
            torch.addcmul(ds3[n], dec3[n], gn, out=target)
            target.baddbmm_(wk3[n].transpose(-1, -2), du_tot[n], alpha=-1)
            t4 = target.view(R, H, K, V)
            if n > 0:
                if plan.resets and n in plan.resets:
                    rows, docs = plan.resets[n]
                    if has_h0:
                        d_h0.index_add_(0, docs, t4.index_select(0, rows))
                    t4.index_fill_(0, rows, 0.0)
                if output_final_state and plan.ends is not None and n - 1 in plan.ends:
                    rows, docs = plan.ends[n - 1]
                    t4.index_add_(0, rows, d_final.index_select(0, docs))
            elif plan.first_docs is None:
                d_h0.copy_(t4)
            else:
                d_h0.index_add_(0, plan.first_docs, t4)
        d_wk = -(du_tot @ states.transpose(-1, -2))
        d_kg = grad_next @ u.transpose(-1, -2)
        d_decay = (grad_next * states).sum(-1)
        shape = (L, R, H)
        return (du_tot.view(*shape, C, V), d_wk.view(*shape, C, K), d_kg.view(*shape, K, C),
                d_decay.view(*shape, K), d_h0, None, None)


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
    activated gate and beta; the update rule is the module docstring's. The KDA layer's cached decode step
    (one token per row, the cached state as ``initial_state``); it loops over ``T`` in Python and is differentiable.
    ``initial_state`` is not modified.

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
    check_core_inputs(q, k, v, g, beta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    check_state(initial_state, B, H, K, V)
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare_core(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
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


# ----------------------------------------------------------------------------------------------------------------------
# The packed regions as custom ops (torch.compile)
# ----------------------------------------------------------------------------------------------------------------------


def _conv_fake(x, weight, initial_state, cu_seqlens, *, activation, output_final_state):
    n = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = x.new_empty(n, x.shape[2], weight.shape[1]) if output_final_state else x.new_empty(0)
    return x.new_empty(x.shape), final


def _chunk_fake(q, k, v, g, beta, initial_state, cu_seqlens, *, scale, output_final_state, chunk_size,
                use_qk_l2norm_in_kernel):
    B, T, H, K = q.shape
    n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = q.new_empty(n, H, K, v.shape[-1], dtype=torch.float32) if output_final_state else q.new_empty(0)
    return q.new_empty(B, T, H, v.shape[-1]), final


_CONV_OP = recompute_op(
    "kda_causal_conv1d",
    lambda x, weight, initial_state, cu_seqlens, **kw: causal_conv1d_torch(
        x, weight, initial_state=initial_state, cu_seqlens=cu_seqlens, **kw
    ),
    tensor_args=[("x", False), ("weight", False), ("initial_state", True), ("cu_seqlens", True)],
    static_args=[("activation", "str?"), ("output_final_state", "bool")],
    num_outputs=2,
    fake=_conv_fake,
)

_CHUNK_OP = recompute_op(
    "kda_chunk",
    lambda q, k, v, g, beta, initial_state, cu_seqlens, **kw: chunk_kda_torch(
        q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, **kw
    ),
    tensor_args=[("q", False), ("k", False), ("v", False), ("g", False), ("beta", False), ("initial_state", True),
                 ("cu_seqlens", True)],
    static_args=[("scale", "float?"), ("output_final_state", "bool"), ("chunk_size", "int"),
                 ("use_qk_l2norm_in_kernel", "bool")],
    num_outputs=2,
    fake=_chunk_fake,
)
