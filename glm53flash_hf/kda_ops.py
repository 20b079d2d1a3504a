"""Torch path of the KDA family (the oracle of :mod:`.kda_fused`): short causal convolution, forget gate, chunked and
recurrent delta rule, gated output norm, and the argument checks shared with the fused path. Each op has the contract
of its fused alternative, registered in :mod:`.kda` (:func:`.dispatch.register_fused`).

Kimi Linear, arXiv:2510.26692 §3; transformers ``modeling_glm5_next.py``. Per head, with a fp32 state ``S`` ``[K, V]``,
a per-channel log decay ``g_t`` ``[K]`` (``<= 0``) and a write strength ``beta_t`` in ``(0, 1)``, given activated or,
with the forget gate's ``A_log`` and ``dt_bias`` (:func:`kda_gate`), as the gate's input and beta's logits::

    S <- diag(exp(g_t)) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t                      (q_t l2-normalised and scaled by K^-0.5)

``cu_seqlens`` (integer ``[N + 1]``, fla's varlen convention) requires ``B == 1``; both token mixers then restart at
every document boundary, each document's result equal to the document run alone. Under ``torch.compile`` the
convolution and the chunked core run as custom ops (:func:`.graph_ops.recompute_op`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .graph_ops import autocast_off, in_graph, no_autocast, recompute_op

__all__ = ["check_conv_inputs", "check_core_inputs", "check_cu_seqlens", "check_gate_params", "check_norm_inputs",
           "check_state", "causal_conv1d_torch", "chunk_kda_torch", "kda_gate", "recurrent_kda_torch",
           "rms_norm_gated_torch"]

_L2NORM_EPS = 1e-6


def _l2norm(x: Tensor) -> Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim (fla's and transformers' ``l2norm``)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + _L2NORM_EPS)


def check_cu_seqlens(cu_seqlens: Tensor, total: int, batch: int, name_batch: str) -> list[int]:
    """``cu_seqlens`` as a host list (one sync); raises ``ValueError`` unless ``batch`` (named ``name_batch``) is 1
    and ``cu_seqlens`` is a 1-D integer tensor of ``>= 2`` entries strictly increasing from 0 to ``total``."""
    if batch != 1:
        raise ValueError(f"cu_seqlens requires batch size 1 (packed layout [1, T, ...]); got {name_batch}={batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [N + 1] with N >= 1; got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor; got dtype {cu_seqlens.dtype}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={total}; got first={cu[0]}, last={cu[-1]}")
    i = next((i for i in range(len(cu) - 1) if cu[i + 1] <= cu[i]), None)
    if i is not None:
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty documents); got cu_seqlens[{i}]={cu[i]}, "
                         f"cu_seqlens[{i + 1}]={cu[i + 1]}")
    return cu


def check_conv_inputs(x: Tensor, weight: Tensor, activation: str | None, initial_state: Tensor | None,
                      cu_seqlens: Tensor | None) -> list[int] | None:
    """Checks of :func:`causal_conv1d_torch`'s arguments, ``ValueError`` on a bad shape, activation or ``cu_seqlens``;
    returns ``cu_seqlens`` as a host list or ``None``."""
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


def check_core_inputs(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> None:
    """Raise ``ValueError`` naming the first of ``q, k, g`` ``[B, T, H, K]``, ``v`` ``[B, T, H, V]``, ``beta``
    ``[B, T, H]`` whose shape does not match."""
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


def check_state(initial_state: Tensor | None, n: int, H: int, K: int, V: int) -> None:
    """Raise ``ValueError`` unless ``initial_state`` is ``None`` or ``[n, H, K, V]`` (the transformers cache layout)."""
    if initial_state is not None and tuple(initial_state.shape) != (n, H, K, V):
        raise ValueError(f"initial_state must be [N={n}, H={H}, K={K}, V={V}]; got {tuple(initial_state.shape)}")


def check_gate_params(A_log: Tensor | None, dt_bias: Tensor | None, lower_bound: float | None, H: int, K: int) -> bool:
    """Whether the gate is computed in the op (``A_log`` given); ``ValueError`` unless ``A_log`` ``[H]`` and
    ``dt_bias`` ``[H*K]`` are both given or both None, and ``lower_bound`` is negative or None (and None without
    ``A_log``)."""
    if A_log is None:
        if dt_bias is not None or lower_bound is not None:
            raise ValueError("dt_bias and lower_bound need A_log (the forget gate in the op); got A_log=None")
        return False
    if tuple(A_log.shape) != (H,):
        raise ValueError(f"A_log must be [H={H}]; got shape {tuple(A_log.shape)}")
    if dt_bias is None or tuple(dt_bias.shape) != (H * K,):
        raise ValueError(f"dt_bias must be [H*K={H * K}]; got {None if dt_bias is None else tuple(dt_bias.shape)}")
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"lower_bound must be negative or None; got lower_bound={lower_bound}")
    return True


def kda_gate(g_raw: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None) -> Tensor:
    """KDA's forget gate (transformers' ``Glm5NextTextForgetGate``): fp32 per-channel log decay ``[..., H, K]``.

    With ``f = g_raw + dt_bias`` (``g_raw`` ``[..., H, K]`` any float dtype, ``dt_bias`` ``[H*K]``, ``A_log`` ``[H]``):
    ``lower_bound * sigmoid(exp(A_log[h]) * f)`` (in ``(lower_bound, 0)``), or ``-exp(A_log[h]) * softplus(f)`` when
    ``lower_bound`` is None."""
    H, K = g_raw.shape[-2:]
    f = g_raw.float() + dt_bias.float().view(H, K)
    rate = torch.exp(A_log.float()).view(H, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * f)
    return -rate * F.softplus(f, beta=1.0, threshold=20.0)


def check_norm_inputs(x: Tensor, gate: Tensor, weight: Tensor) -> None:
    """Raise ``ValueError`` unless ``gate`` has the shape of ``x`` ``[..., K]`` and ``weight`` is ``[K]``."""
    if gate.shape != x.shape:
        raise ValueError(f"gate must have the shape of x {tuple(x.shape)}; got {tuple(gate.shape)}")
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}]; got shape {tuple(weight.shape)}")


def rms_norm_gated_torch(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``(RMSNorm_fp32(x) * weight * sigmoid(gate)).to(x.dtype)`` over the last dim for ``x, gate`` ``[..., K]``,
    ``weight`` ``[K]`` (transformers' ``Glm5NextTextRMSNormGated``); ``ValueError`` on a shape mismatch."""
    check_norm_inputs(x, gate, weight)
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * y * torch.sigmoid(gate.float())).to(x.dtype)


def _prepare_core(q, k, v, g, beta, scale: float | None, use_qk_l2norm: bool, A_log, dt_bias, lower_bound):
    """fp32 core inputs: the gate and beta activated when ``A_log`` is given (:func:`kda_gate`, sigmoid), ``q`` and
    ``k`` l2-normalised when asked, ``q`` scaled (default ``K ** -0.5``)."""
    if check_gate_params(A_log, dt_bias, lower_bound, q.shape[2], q.shape[3]):
        g, beta = kda_gate(g, A_log, dt_bias, lower_bound), torch.sigmoid(beta.float())
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k, v, g, beta


def causal_conv1d_torch(x: Tensor, weight: Tensor, *, cu_seqlens: Tensor | None = None, activation: str | None = "silu",
                        initial_state: Tensor | None = None, output_final_state: bool = False
                        ) -> tuple[Tensor, Tensor | None]:
    """Depthwise causal 1-D convolution (no bias) with optional SiLU, restarting at document boundaries.

    ``y[t, d] = act(sum_{w < W} weight[d, w] * x[t - (W - 1) + w, d])``, inputs before the document from
    ``initial_state`` or zero (fla's ``causal_conv1d``; transformers' ``causal_conv1d_fn`` / ``causal_conv1d_update``).

    Args:
        x: ``[B, T, D]``, any float dtype.
        weight: ``[D, W]``; computed in ``weight.dtype`` (also under autocast), the result cast to ``x.dtype``.
        cu_seqlens: optional document boundaries (module docstring); without it ``N = B``.
        activation: ``"silu"`` / ``"swish"`` (the same) or ``None``.
        initial_state: optional ``[N, D, W]``, the last ``W`` inputs before each document, oldest first.
        output_final_state: also return the last ``W`` inputs of every document, ``[N, D, W]`` in ``x.dtype``.

    Returns:
        ``(y [B, T, D] in x.dtype (a non-contiguous view), final_state or None)``.

    Raises:
        ValueError: a bad shape, ``cu_seqlens`` or activation (:func:`check_conv_inputs`).
    """
    with autocast_off(x):
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
                starts = cu[:-1] + torch.arange(N, device=device) * hist
                slots = starts.unsqueeze(1) + torch.arange(hist, device=device)
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


@dataclass
class _ChunkPlan:
    """Token placement in the chunk-aligned ``[L, R, H, C, F]`` layout (``resets`` / ``ends``: chunk -> rows, docs)."""

    batch: int
    seq_len: int
    heads: int
    chunk: int
    num_chunks: int
    num_rows: int
    num_docs: int
    token_index: Tensor | None = None
    first_docs: Tensor | None = None
    resets: dict | None = None
    ends: dict | None = None

    def to_chunks(self, x: Tensor) -> Tensor:
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

    def from_chunks(self, y: Tensor) -> Tensor:
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
    # Next-fit packing of whole documents into rows of L chunks (a document never straddles rows).
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
    resets: dict[int, list[tuple[int, int]]] = {}  # chunk -> (row, doc) pairs
    ends: dict[int, list[tuple[int, int]]] = {}
    for d in range(N):
        if off_of[d] == 0:
            first_docs[row_of[d]] = d
        else:
            resets.setdefault(off_of[d], []).append((row_of[d], d))
        ends.setdefault(off_of[d] + nchunks[d] - 1, []).append((row_of[d], d))

    def _dev(groups):
        return {n: tuple(torch.tensor(x, device=device) for x in zip(*pairs)) for n, pairs in groups.items()}

    cu = torch.tensor(cu_host, device=device, dtype=torch.long)
    lengths_t = cu[1:] - cu[:-1]
    doc = torch.repeat_interleave(torch.arange(N, device=device), lengths_t, output_size=T)
    local = torch.arange(T, device=device) - cu[doc]
    row_t = torch.tensor(row_of, device=device)[doc]
    chunk_t = torch.tensor(off_of, device=device)[doc] + local // C
    base = ((chunk_t * R + row_t) * H) * C + local % C  # head 0
    token_index = (base.unsqueeze(1) + torch.arange(H, device=device) * C).flatten()  # [T * H]
    return _ChunkPlan(batch=1, seq_len=T, heads=H, chunk=C, num_chunks=L, num_rows=R, num_docs=N,
                      token_index=token_index, first_docs=torch.tensor(first_docs, device=device),
                      resets=_dev(resets), ends=_dev(ends))


def _lower_blocks(a: Tensor, h: int) -> Tensor:
    """View ``[M, C / 2h, h, h]`` of the lower-left ``[h, h]`` block of every diagonal ``[2h, 2h]`` block of ``a``."""
    M, C, _ = a.shape
    return a.as_strided((M, C // (2 * h), h, h), (C * C, 2 * h * (C + 1), C, 1), a.storage_offset() + h * C)


class _DecayLevels:
    """Level factors ``(h, e_row, e_col)`` of :func:`_intra_chunk_products`; then the chunk's prefix / suffix sums."""

    def __init__(self, g: Tensor):
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


def _reverse_cumsum(x: Tensor) -> Tensor:
    return x.flip(-2).cumsum(-2).flip(-2)


class _IntraChunkProducts(torch.autograd.Function):
    """:func:`_intra_chunk_products`; the backward recomputes the level factors."""

    @staticmethod
    @no_autocast
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
    @no_autocast
    def backward(ctx, d_akk, d_aqk, d_in, d_out):
        q, k, g, decay_in, decay_out = ctx.saved_tensors
        M, C, K = k.shape
        d_akk, d_aqk = d_akk.contiguous(), d_aqk.contiguous()
        d_diag = d_aqk.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)  # [M, C, 1]
        dq, dk = d_diag * k, d_diag * q
        # The gate gradient from local sums, per level over the pairs that straddle each position (docs/design.md).
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


def _intra_chunk_products(q: Tensor, k: Tensor, g: Tensor) -> tuple[Tensor, ...]:
    """``(Akk, Aqk [M, C, C], exp(G), exp(G_{C-1} - G) [M, C, K])`` for fp32 ``[M, C, K]`` inputs, ``G = cumsum(g)``.

    ``Akk[i, j] = sum_d k_id k_jd exp(G_id - G_jd)`` for ``j < i`` (zero elsewhere); ``Aqk`` the same with ``q_i``,
    ``j <= i``.
    """
    return _IntraChunkProducts.apply(q.contiguous(), k.contiguous(), g.contiguous())


def chunk_kda_torch(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, A_log: Tensor | None = None,
                    dt_bias: Tensor | None = None, lower_bound: float | None = None, scale: float | None = None,
                    initial_state: Tensor | None = None, output_final_state: bool = False,
                    cu_seqlens: Tensor | None = None, chunk_size: int = 64,
                    use_qk_l2norm_in_kernel: bool = True) -> tuple[Tensor, Tensor | None]:
    """Chunked Kimi Delta Attention in torch, fp32 maths (autocast off); memory ``O(T)``, never ``O(T^2)``.

    fla's ``chunk_kda``; transformers' ``chunk_kimi_delta_attention`` (WY form; DeltaNet chunking, arXiv:2406.06484).

    Args:
        q, k: ``[B, T, H, K]``, any float dtype; v: ``[B, T, H, V]``; beta: ``[B, T, H]``, after the sigmoid, or its
            logits with ``A_log``.
        g: ``[B, T, H, K]`` per-channel log decay, ``<= 0`` (positive values may overflow), or with ``A_log`` the
            forget gate's input ``f_b_proj(f_a_proj(x))`` (without ``dt_bias``).
        A_log, dt_bias, lower_bound: the forget gate's ``A_log`` fp32 ``[H]``, ``dt_bias`` fp32 ``[H*K]`` and lower
            bound: ``g`` and ``beta`` are activated in the op (:func:`kda_gate`, sigmoid) and get their gradients.
        scale: query scale, default ``K ** -0.5``.
        initial_state: optional ``[N, H, K, V]`` (``N`` documents with ``cu_seqlens``, else ``B``), cast to fp32.
        output_final_state: also return the state after every document.
        cu_seqlens: optional document boundaries (module docstring); the state restarts from ``initial_state[n]``.
        chunk_size: chunk length ``C``, a power of two; a shorter document uses the next power of two >= its length.
        use_qk_l2norm_in_kernel: l2-normalise ``q`` and ``k`` (``x / sqrt(sum x^2 + 1e-6)``) before scaling.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, V]`` in ``q.dtype``; ``final_state`` fp32 ``[N, H, K, V]`` or ``None``.

    Raises:
        ValueError: on shape mismatches, a bad ``chunk_size``, bad ``cu_seqlens`` (see :func:`check_cu_seqlens`) or
            gate parameters (:func:`check_gate_params`).
    """
    with autocast_off(q):
        check_core_inputs(q, k, v, g, beta)
        if not isinstance(chunk_size, int) or chunk_size < 1 or chunk_size & (chunk_size - 1):
            raise ValueError(f"chunk_size must be a positive power of two; got chunk_size={chunk_size!r}")
        B, T, H, K = q.shape
        V = v.shape[-1]
        out_dtype = q.dtype
        if in_graph():
            o, final = _CHUNK_OP(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, lower_bound=lower_bound,
                                 scale=scale, output_final_state=output_final_state, chunk_size=chunk_size,
                                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            return o, final if output_final_state else None
        cu_host = check_cu_seqlens(cu_seqlens, T, B, "q.shape[0]") if cu_seqlens is not None else None
        n_docs = len(cu_host) - 1 if cu_host is not None else B
        check_state(initial_state, n_docs, H, K, V)
        q, k, v, g, beta = _prepare_core(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, A_log, dt_bias,
                                         lower_bound)
        h0 = initial_state.float() if initial_state is not None else None

        lengths = [T] if cu_host is None else [b - a for a, b in zip(cu_host[:-1], cu_host[1:])]
        doc_chunks = [_doc_chunk(n, chunk_size) for n in lengths]
        sizes = sorted(set(doc_chunks))
        if len(sizes) == 1:  # B == 1 with cu_seqlens
            plan = _make_plan(B, T, H, sizes[0], cu_host, q.device)
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
            sub_cu = [0, *itertools.accumulate(lengths[d] for d in docs)]
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
    return min(chunk_size, 1 << max(0, length - 1).bit_length())


def _causal_matmul(a: Tensor, u: Tensor) -> Tensor:
    """``a @ u`` for a lower-triangular ``a`` ``[..., C, C]`` whose NaN/inf in ``u[j]`` reach only rows ``i >= j``."""
    bad = ~torch.isfinite(u)
    out = a @ torch.where(bad, torch.zeros((), dtype=u.dtype, device=u.device), u)
    poisoned = bad.cumsum(-2, dtype=torch.int32) > 0
    return torch.where(poisoned, torch.full((), float("nan"), dtype=out.dtype, device=out.device), out)


def _chunk_kda_core(q, k, v, g, beta, h0, plan: _ChunkPlan, output_final_state: bool):
    """The chunked recurrence on :func:`_prepare_core`'s inputs laid out by ``plan``; fp32 ``(o, final or None)``."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    C, L, R = plan.chunk, plan.num_chunks, plan.num_rows
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
    # With W and h0 finite the plain product is causal; otherwise the select-based one.
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
    """Per chunk ``U_n = W_v,n - W_k,n S_n``, ``S_{n+1} = diag(d_n) S_n + KG_n U_n`` (re-seeded at document starts).

    Returns ``(states [L, R, H, K, V], u [L, R, H, C, V], final [N, H, K, V] or empty)``; hand-written backward.
    """

    @staticmethod
    @no_autocast
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
        ctx.plan, ctx.output_final_state, ctx.h0_shape = plan, output_final_state, None if h0 is None else h0.shape
        ctx.save_for_backward(wk3, kg3, dec3, states, u)
        return states.view(L, R, H, K, V), u.view(L, R, H, C, V), final

    @staticmethod
    @no_autocast
    def backward(ctx, d_states, d_u, d_final):
        wk3, kg3, dec3, states, u = ctx.saved_tensors
        plan, output_final_state, has_h0 = ctx.plan, ctx.output_final_state, ctx.h0_shape is not None
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


def recurrent_kda_torch(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, A_log: Tensor | None = None,
                        dt_bias: Tensor | None = None, lower_bound: float | None = None, scale: float | None = None,
                        initial_state: Tensor | None = None, output_final_state: bool = False,
                        use_qk_l2norm_in_kernel: bool = True) -> tuple[Tensor, Tensor | None]:
    """Token-by-token Kimi Delta Attention (a differentiable loop over ``T``; transformers'
    ``recurrent_kimi_delta_attention``), fp32 maths. Arguments as in :func:`chunk_kda_torch` without ``cu_seqlens``;
    ``initial_state`` ``[B, H, K, V]`` is not modified. Returns ``(o [B, T, H, V] in q.dtype, final fp32 or None)``.

    Raises:
        ValueError: on shape mismatches or bad gate parameters.
    """
    with autocast_off(q):
        check_core_inputs(q, k, v, g, beta)
        B, T, H, K = q.shape
        V = v.shape[-1]
        check_state(initial_state, B, H, K, V)
        out_dtype = q.dtype
        q, k, v, g, beta = _prepare_core(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, A_log, dt_bias,
                                         lower_bound)
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


def _conv_fake(x, weight, initial_state, cu_seqlens, *, activation, output_final_state):
    n = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = x.new_empty(n, x.shape[2], weight.shape[1]) if output_final_state else x.new_empty(0)
    return x.new_empty(x.shape), final


def _chunk_fake(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, *, lower_bound, scale,
                output_final_state, chunk_size, use_qk_l2norm_in_kernel):
    B, T, H, K = q.shape
    n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = q.new_empty(n, H, K, v.shape[-1], dtype=torch.float32) if output_final_state else q.new_empty(0)
    return q.new_empty(B, T, H, v.shape[-1]), final


_CONV_OP = recompute_op(
    "kda_causal_conv1d",
    lambda x, weight, initial_state, cu_seqlens, **kw: causal_conv1d_torch(x, weight, initial_state=initial_state,
                                                                           cu_seqlens=cu_seqlens, **kw),
    tensor_args=[("x", False), ("weight", False), ("initial_state", True), ("cu_seqlens", True)],
    static_args=[("activation", "str?"), ("output_final_state", "bool")],
    num_outputs=2,
    fake=_conv_fake,
)

_CHUNK_OP = recompute_op(
    "kda_chunk",
    lambda q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, **kw: chunk_kda_torch(
        q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias, **kw
    ),
    tensor_args=[("q", False), ("k", False), ("v", False), ("g", False), ("beta", False), ("initial_state", True),
                 ("cu_seqlens", True), ("A_log", True), ("dt_bias", True)],
    static_args=[("lower_bound", "float?"), ("scale", "float?"), ("output_final_state", "bool"), ("chunk_size", "int"),
                 ("use_qk_l2norm_in_kernel", "bool")],
    num_outputs=2,
    fake=_chunk_fake,
)
