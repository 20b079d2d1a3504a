#!/usr/bin/env python
"""Roofline model of the fused kernels at the release shapes, and a predicted training step per GPU (no GPU used).

Every number here is arithmetic on shapes: nothing is measured. ``scripts/bench_gpu.py`` prints its measured times
next to :func:`family_cost`'s predictions, so the first GPU run checks this model as well as the kernels.

Device (``--device``, default ``h200``; NVIDIA's datasheets): H200 SXM: 989 TFLOPS dense BF16 tensor-core (1979 with
2:4 sparsity, unused here), 67 TFLOPS FP32 (CUDA cores, used for the kernels whose ``tl.dot`` runs in ieee fp32 and
for elementwise work), 4.8 TB/s HBM3e, 141 GB; H100 SXM: the same compute peaks, 3.35 TB/s HBM3, 80 GB; NVLink 4
900 GB/s per GPU on both (used as the bandwidth of every collective).

Model of one kernel launch (:class:`Kernel`): ``flops`` counted from the launch grid and the kernel's loop structure
(each ``tl.dot`` of an ``[m, k] x [k, n]`` tile is ``2 m k n``, at the block sizes the launcher picks, padded tiles
included: they are computed), ``bytes`` from the kernel's loads and stores (a masked-off element moves nothing; a
tensor re-read by several programs is counted at every read: L2 hits are not modelled, so gather-heavy kernels are
predicted pessimistically); time ``max(flops / peak, bytes / HBM)``, bound = the larger term. torch GEMMs
(projections, grouped expert GEMMs, the indexer's fp32 ``bmm``) are ``2 M N K`` at the peak of their dtype times
:data:`GEMM_EFFICIENCY`.

Per family (``T`` tokens of one packed row, one document; ``c`` the text config):

* :func:`kda_core` -- fla's ``chunk_kda`` as :mod:`glm53flash_hf.kda_fused` calls it (chunk ``BT = 64``, in-kernel
  gate, l2norm, fp32 state), stage by stage: the tensors each stage reads and writes are those fla allocates
  (``chunk_intra.py``, ``wy_fast.py``, ``common/chunk_delta_h.py``, ``gla/chunk.py``, ``chunk_bwd.py``), the dots
  are the per-chunk matmuls of each stage; see the function.
* :func:`dsa_indexer` (torch ``bmm`` in fp32, :func:`glm53flash_hf.dsa_ops.select_top_pools`) and
  :func:`sparse_mla` (``dsa_fused`` forward / backward kernels).
* :func:`hc_pre`, :func:`hc_post` (``mhc_fused``'s kernels).
* :func:`moe_experts` (routing gather, two grouped GEMMs, ``moe_fused``'s SwiGLU and combine kernels).

Step model (:func:`predict_step`): the sum over the release layers of the fused ops' predicted times (forward +
backward) and of every GEMM at ``GEMM_EFFICIENCY`` of peak, plus the expert-parallel all-to-all and the
sequence-parallel exchange at NVLink bandwidth with no overlap; per-layer activation checkpointing adds one more
forward. Not modelled: optimizer step, FSDP parameter gathers and gradient reduce-scatter (assumed hidden behind
compute), the vision tower, kernel launch gaps, load imbalance between experts.

Usage::

    python scripts/gpu_cost.py                # kernel table, the KDA layer at 128k over SP 8, predicted steps
    python scripts/gpu_cost.py --device h100 --gpus 8 --ep 8 --sp 4 --seq 32768 --full
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench_sp import bytes_per_layer  # noqa: E402  (sequence-parallel bytes per layer, one implementation)

from glm53flash_hf.configuration_glm53flash import Glm53FlashTextConfig  # noqa: E402
from glm53flash_hf.dsa_ops import DEFAULT_INDEXER_SCORE_ELEMENTS  # noqa: E402

# ---------------------------------------------------------------------------------------- device (H200 datasheet)
H200 = dict(name="H200 SXM", bf16_flops=989e12, bf16_sparse_flops=1979e12, fp32_flops=67e12, hbm_bytes_s=4.8e12,
            hbm_gb=141, nvlink_bytes_s=900e9)
H100 = dict(H200, name="H100 SXM", hbm_bytes_s=3.35e12, hbm_gb=80)
DEVICES = {"h200": H200, "h100": H100}


def device_for(name: str) -> dict:
    """The datasheet entry for a CUDA device name (``torch.cuda.get_device_name()``): H100 for a name with "H100",
    else H200."""
    return H100 if "H100" in name.upper() else H200
GEMM_EFFICIENCY = 0.7  # fraction of peak assumed for cuBLAS / grouped GEMMs at these sizes
BF16, FP32, I32 = 2, 4, 4

# xtuner's published figures (8 x H200), printed next to the predictions
XTUNER = {"kda_layer_128k_sp8_ms": 44.35, "crop25b_tokens_s_gpu": 12.4e3}


def release_config(**overrides) -> Glm53FlashTextConfig:
    """The release text config: the class defaults (hidden 4096, 45 layers, KDA 64 x 128, MLA 64 heads, 288 experts)
    with the release values that differ from them (``index_kpool`` 4, one MTP layer)."""
    kw = dict(index_kpool=4, num_nextn_predict_layers=1)
    kw.update(overrides)
    return Glm53FlashTextConfig(**kw)


@dataclasses.dataclass
class Kernel:
    """One launch: ``flops`` on the ``peak`` unit ("bf16" tensor cores or "fp32"), ``bytes`` moved to/from HBM;
    ``gemm`` marks a torch GEMM (its time is divided by :data:`GEMM_EFFICIENCY`); ``floor_bytes``, for a kernel
    whose programs re-read rows of one tensor (the sparse MLA gathers), the bytes if every tensor crossed HBM once
    (re-reads served by L2): a lower bound of the time, shown next to the as-launched prediction."""

    name: str
    flops: float
    bytes: float
    peak: str = "fp32"
    gemm: bool = False
    floor_bytes: float | None = None

    def times(self, device=H200, floor: bool = False) -> tuple[float, float]:
        """(compute seconds, memory seconds); ``floor``: with ``floor_bytes`` where the kernel has them."""
        peak = device["bf16_flops"] if self.peak == "bf16" else device["fp32_flops"]
        eff = GEMM_EFFICIENCY if self.gemm else 1.0
        nbytes = self.floor_bytes if floor and self.floor_bytes is not None else self.bytes
        return self.flops / (peak * eff), nbytes / (device["hbm_bytes_s"] * eff)

    def seconds(self, device=H200, floor: bool = False) -> float:
        return max(self.times(device, floor))

    def bound(self, device=H200) -> str:
        c, m = self.times(device)
        return "compute" if c >= m else "memory"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def p2(x: int, lo: int = 1) -> int:
    """``triton_utils.next_power_of_2``."""
    return max(lo, 1 << max(0, int(x) - 1).bit_length())


def gemm(name: str, m: int, n: int, k: int, dtype_bytes: int = BF16, peak: str = "bf16") -> Kernel:
    """``[m, k] @ [k, n]``: ``2 m n k`` FLOPs; each operand read once and the output written once."""
    return Kernel(name, 2.0 * m * n * k, dtype_bytes * (m * k + k * n + m * n), peak, gemm=True)


def linear_fwd_bwd(name: str, tokens: int, n_in: int, n_out: int, train_weight: bool) -> list[Kernel]:
    """An ``nn.Linear`` forward and backward: ``y = x W^T``; ``dx = dy W``; ``dW = dy^T x`` (only when trained)."""
    out = [gemm(f"{name} fwd", tokens, n_out, n_in), gemm(f"{name} dx", tokens, n_in, n_out)]
    if train_weight:
        out.append(gemm(f"{name} dW", n_out, n_in, tokens))
    return out


# ------------------------------------------------------------------------------------------------------------- mHC
def hc_post(tokens: int, n: int, d: int, act: int = BF16, backward: bool = True) -> list[Kernel]:
    """``mhc_fused`` hc_post.

    Forward ``_hc_post_fwd_kernel``, grid ``(T, cdiv(D, BD))``, ``BD = min(p2(D), 1024)``: each program loads
    ``y[t, d-block]``, the ``N`` residual rows of its block, ``post[t]`` (N) and ``comb[t]`` (N x N, fp32), stores
    ``out[t, :, d-block]``. FLOPs per output element ``2 N`` (the comb mix) + 2 (post * y, add): ``T N D (2N + 2)``.
    Bytes ``act (T D + 2 T N D) + 4 T cdiv(D, BD) (N + N^2)``.

    Backward ``_hc_post_bwd_kernel``, grid ``(T,)``, loops over D in ``BD = min(p2(D), 512)``: per block it loads
    ``y`` (BD), the residual (N x BD), the ``N`` gradient rows and ``N`` comb columns (N each); stores ``dy``,
    ``dres``, then ``dpost`` (N) and ``dcomb`` (N x N) fp32. FLOPs per (t, d), for each of the ``N`` gradient rows:
    ``dres`` (2N), ``dy`` (2), ``dpost`` (2), ``dcomb`` (2N): ``N (4N + 4)``.
    Bytes ``act (T D + 2 T N D + T N D + T D) + 4 T (cdiv(D, BD) N^2 + N + N + N^2)``.
    """
    bd_f, bd_b = min(p2(d, 16), 1024), min(p2(d, 16), 512)
    out = [Kernel("hc_post fwd", tokens * n * d * (2 * n + 2),
                  act * (tokens * d + 2 * tokens * n * d) + FP32 * tokens * cdiv(d, bd_f) * (n + n * n))]
    if backward:
        out.append(Kernel("hc_post bwd", tokens * d * n * (4 * n + 4),
                          act * (2 * tokens * d + 3 * tokens * n * d)
                          + FP32 * tokens * (cdiv(d, bd_b) * n * n + 2 * n + n * n)))
    return out


def hc_pre(tokens: int, n: int, d: int, sinkhorn_iters: int, act: int = BF16, fn_bytes: int = BF16,
           backward: bool = True) -> list[Kernel]:
    """``mhc_fused`` hc_pre (``K = N D``, ``M = N (N + 2)`` mixes, ``MP = p2(M, 16)``, blocks of ``_pre_blocks``:
    ``BT = min(32, p2(T, 16))``, ``BK = min(128, p2(K, 16))``, ``BD = min(256, p2(D, 16))``).

    * ``_hc_pre_reduce_kernel``, grid ``(cdiv(T, BT),)``, loop over K: ieee fp32 ``tl.dot`` ``[BT, BK] x [BK, MP]``
      (``2 T K MP``, fp32 peak) + sum of squares (``2 T K``); loads ``x`` once and ``fn`` (``M K``) once per program;
      stores ``proj [T, M]`` and ``sumsq [T]`` fp32.
    * the small graph (torch, on ``[T, M]`` fp32): per Sinkhorn round a row and a column normalisation, each a sum
      and a division over ``[T, N, N]`` (read, read + write), ``2 iters`` of them: ``3 * 2 iters * 4 T N^2`` bytes.
    * ``_hc_collapse_kernel``, grid ``(T, cdiv(D, BD))``: loads ``pre[t]`` (N fp32) per program and ``x``; stores
      ``collapsed [T, D]``; ``2 T N D`` FLOPs.
    * backward: ``_hc_dpre_kernel`` grid ``(T,)`` (loads ``dcollapsed``, ``x``; ``2 T N D``); the small graph again
      (recomputed and differentiated: counted twice its forward bytes); ``_hc_pre_dx_kernel`` grid
      ``(cdiv(T, BT), N, cdiv(D, BD))``: per program loads ``dproj`` (BT x M fp32), ``fn`` (M x BD), ``x``,
      ``dsumsq``, ``pre``, ``dcollapsed`` blocks, stores ``dx``; ieee dot ``2 T MP N D`` + ``4 T N D``;
      ``_hc_pre_dfn_kernel`` grid ``(cdiv(K, BK),)``, loop over T: loads ``dproj`` (T x M fp32) per program and ``x``
      once, stores ``dfn [M, K]`` fp32; ``2 MP T K``.
    """
    k, m = n * d, n * (n + 2)
    mp = p2(m, 16)
    bt, bk, bd = min(32, p2(tokens, 16)), min(128, p2(k, 16)), min(256, p2(d, 16))
    small = 3 * 2 * sinkhorn_iters * FP32 * tokens * n * n
    out = [
        Kernel("hc_pre reduce", 2.0 * tokens * k * mp + 2.0 * tokens * k,
               act * tokens * k + fn_bytes * cdiv(tokens, bt) * m * k + FP32 * tokens * (m + 1)),
        Kernel("hc_pre sinkhorn (torch)", 2 * sinkhorn_iters * 2 * tokens * n * n, small),
        Kernel("hc_pre collapse", 2.0 * tokens * n * d,
               act * (tokens * k + tokens * d) + FP32 * tokens * cdiv(d, bd) * n),
    ]
    if backward:
        progs_dx = cdiv(tokens, bt) * n * cdiv(d, bd)
        out += [
            Kernel("hc_pre dpre", 2.0 * tokens * n * d, act * (tokens * d + tokens * k) + FP32 * tokens * n),
            Kernel("hc_pre sinkhorn bwd (torch)", 2 * 2 * sinkhorn_iters * 2 * tokens * n * n, 2 * small),
            Kernel("hc_pre dx", 2.0 * tokens * mp * n * d + 4.0 * tokens * n * d,
                   # dproj and (dsumsq, pre) per program; fn once per token block; x, dcollapsed (per stream), dx
                   FP32 * progs_dx * bt * (m + 2) + fn_bytes * cdiv(tokens, bt) * m * k + act * 3 * tokens * k),
            Kernel("hc_pre dfn", 2.0 * mp * tokens * k,
                   FP32 * cdiv(k, bk) * tokens * m + act * tokens * k + FP32 * m * k),
        ]
    return out


# ------------------------------------------------------------------------------------------------------------- DSA
def valid_ids(tokens: int, topk: int, kp: int, tail: bool) -> int:
    """Valid ids summed over the queries of one document of ``tokens`` tokens: query ``t`` (``q = t + 1`` tokens
    visible) gets ``kp * min(q // kp, topk // kp)`` pooled ids plus, with the tail, ``q % kp``."""
    pools = topk // kp
    return sum(kp * min(q // kp, pools) + (q % kp if tail else 0) for q in range(1, tokens + 1))


def sparse_mla(tokens: int, heads: int, dim: int, width: int, valid: int, act: int = BF16,
               backward: bool = True, kv_tokens: int | None = None) -> list[Kernel]:
    """``dsa_fused`` sparse MLA (``W`` ids per query, ``valid`` valid ids over all queries; blocks of ``_blocks``:
    ``BD = p2(Dl)``, ``BH = min(p2(H), 64, tile // BD)``, ``BW = min(64, tile // BD)`` with ``tile`` 16384 forward,
    8192 backward; grid ``(T, cdiv(H, BH))``).

    Forward: per program ``q`` (BH x Dl) once, then ``cdiv(W, BW)`` id blocks, each loading the ids and the valid
    latent rows and running two bf16 dots ``[BH, BD] x [BD, BW]`` and ``[BH, BW] x [BW, BD]``: FLOPs
    ``T cdiv(H, BH) cdiv(W, BW) * 2 * 2 BH BW BD``; bytes ``act (2 T H Dl) + 4 T H`` (q, out, lse) ``+ cdiv(H, BH) *
    (4 T W + act Dl valid)`` (ids and gathered rows, every program).
    Backward: same grid; loads ``q``, ``dO``, ``out``, ``lse``; per block the ids and rows, five dots (``s``, ``dp``,
    ``dq``, two for ``dc``) and an fp32 ``atomic_add`` of the ``[BW, Dl]`` ``dc`` rows (read + write, valid rows);
    stores ``dq``; plus the zeroed fp32 ``dlatent`` buffer and its cast (``4 + 4 + 2`` bytes per element).
    ``kv_tokens`` (default ``tokens``): rows of the latent (the gathered sequence under SP).
    """
    kv = tokens if kv_tokens is None else kv_tokens
    bd = p2(dim, 16)
    out = []
    for tag, tile, dots in (("fwd", 16384, 2), ("bwd", 8192, 5)):
        if tag == "bwd" and not backward:
            break
        bh, bw = max(16, min(p2(heads), 64, tile // bd)), max(16, min(64, tile // bd))
        hp = cdiv(heads, bh)
        flops = tokens * hp * cdiv(width, bw) * dots * 2.0 * bh * bw * bd
        gather = hp * (I32 * tokens * width + act * dim * valid)
        once = I32 * tokens * width + act * kv * dim  # ids and latent, each crossing HBM once
        if tag == "fwd":
            nbytes = act * 2 * tokens * heads * dim + FP32 * tokens * heads + gather
            floor = act * 2 * tokens * heads * dim + FP32 * tokens * heads + once
        else:
            nbytes = (act * 4 * tokens * heads * dim + FP32 * tokens * heads + gather + hp * 2 * FP32 * dim * valid
                      + (FP32 + FP32 + act) * kv * dim)
            floor = act * 4 * tokens * heads * dim + FP32 * tokens * heads + once + (FP32 + FP32 + act) * kv * dim
        out.append(Kernel(f"sparse_mla {tag}", flops, nbytes, "bf16", floor_bytes=floor))
    return out


def dsa_indexer(tokens: int, n_heads: int, head_dim: int, topk: int, kp: int,
                max_score_elements: int = DEFAULT_INDEXER_SCORE_ELEMENTS) -> list[Kernel]:
    """The KPool indexer's scoring (torch, fp32, no gradient: frozen), :func:`~glm53flash_hf.dsa_ops.select_top_pools`:
    queries in chunks of ``C = max_score_elements // (Hi P)`` (``P = T // kp`` pools); chunk ``[s, e)`` scores
    ``Pc = min(P, e // kp)`` pools: ``bmm`` ``[C Hi, Dk] x [Dk, Pc]`` (``2 C Hi Dk Pc``), ``relu_`` in place, ``bmm``
    with the head weights (``2 C Hi Pc``), a mask, and a top-``topk // kp``. Bytes per chunk: the fp32 copy of the
    queries (read bf16, write + read fp32), the pool keys (``4 Dk Pc``), the logits written, read + written by relu,
    read by the second bmm (``4 * 4 C Hi Pc``), the scores written, masked (read + write) and read by topk
    (``4 * 4 C Pc``). Pool keys, projections and the expansion to ids are linear in T and left out."""
    pools = tokens // kp
    chunk = max(1, max_score_elements // max(1, n_heads * pools))
    flops = nbytes = 0.0
    for s in range(0, tokens, chunk):
        e = min(tokens, s + chunk)
        c, pc = e - s, min(pools, e // kp)
        if pc == 0:
            continue
        flops += 2.0 * c * n_heads * head_dim * pc + 2.0 * c * n_heads * pc
        nbytes += (BF16 + 2 * FP32) * c * n_heads * head_dim + FP32 * head_dim * pc + 4 * FP32 * c * n_heads * pc \
            + 4 * FP32 * c * pc
    return [Kernel("indexer scores (torch fp32 bmm)", flops, nbytes, "fp32", gemm=True)]


# ------------------------------------------------------------------------------------------------------------- KDA
def kda_core(tokens: int, heads: int, dk: int, dv: int, chunk: int = 64, act: int = BF16,
             backward: bool = True, bv: int = 64) -> list[Kernel]:
    """fla's chunked KDA (``chunk_kda_fwd`` / ``chunk_kda_bwd``, ``BT = chunk``, ``NT = T / BT`` chunks; per head;
    ``Aqk``, ``Akk`` ``[T, H, BT]`` in the input dtype, ``h`` ``[NT, H, K, V]`` in the input dtype, the gate's cumsum
    fp32). Dots per chunk and head (causal intra-chunk blocks: fla computes the ``BC = 16`` sub-blocks on and below
    the diagonal, ``10/16`` of ``BT x BT``: factor ``tri``):

    forward
      gate + cumsum: read ``g_raw`` (act), write ``g`` fp32;   l2norm of q, k: read, write (act) + rstd;
      intra: ``Aqk = (q e^g)(k e^-g)^T``, ``Akk`` likewise (``2 * 2 BT^2 K tri``), the ``BT x BT`` triangular
        inverse (``BT^3 / 3 * 2``), ``w = A (beta k e^g)`` (``2 BT^2 K``), ``u = A (beta v)`` (``2 BT^2 V``); reads
        q, k, v, g, beta, writes ``Aqk``, ``Akk``, ``w``, ``u``, ``kg``;
      state ``fwd_h`` (grid ``cdiv(V, BV) * H``, sequential over chunks): ``v_new = u - w h`` and
        ``h <- h e^g + kg^T v_new`` (``2 * 2 BT K V``); every V-block program reads all of w and kg (``nvb =
        cdiv(V, BV)`` times), its part of u and of the chunk-end gates; writes ``h``, ``v_new``;
      output ``fwd_o`` (grid ``cdiv(V, BV) NT, H``): ``o = (q e^g) h + Aqk v_new`` (``2 BT K V + 2 BT^2 V tri``);
        reads q, g, Aqk (``nvb`` times), h, v_new; writes o.
    backward (``disable_recompute=False``: gate, ``w u kg`` and ``h v_new`` recomputed: the three first forward stages
    again without ``Aqk``), then
      ``dAv``: ``dAqk = dO v_new^T``, ``dv = Aqk^T dO`` (``2 * 2 BT^2 V tri``); writes ``dA`` fp32, ``dv``;
      ``bwd_dhu`` (grid ``cdiv(V, BV) * H``, sequential): ``dh <- dh e^g + (q e^g)^T dO - w^T dv2``,
        ``dv2 = dv + kg dh`` (``3 * 2 BT K V``); reads q, kg, w (``nvb`` times), dO, dv; writes ``dh``, ``dv2``;
    ``BV`` is autotuned (fla's candidates on Hopper: 32 and 64 for the state kernels, 64 and 128 for the output);
    the model takes ``bv`` (64) for all three.
      ``wy_dqkg_fused``: ``dq = dO h^T``, ``dk = v_new dh^T``, ``dw = dv2 h^T`` (``3 * 2 BT K V``), and through the
        WY form ``A^T dw``, ``A^T du``, ``dA`` (``2 BT^2 (2K + 2V)``); writes dq, dk, dg, dA fp32, dv;
      ``bwd_intra``: ``dq``, ``dk`` from ``dAqk``, ``dAkk`` (``4 * 2 BT^2 K tri``); reads and rewrites dq, dk, dg,
        db fp32; reverse cumsum of dg (fp32 read + write), gate and l2norm backward (read, write).
    """
    t, h = tokens, heads
    nt = cdiv(t, chunk)
    nvb = cdiv(dv, bv)
    tri = 10 / 16
    thk, thv, tha = t * h * dk, t * h * dv, t * h * chunk
    state = nt * h * dk * dv
    gate = Kernel("kda gate+cumsum", 10.0 * thk, act * thk + FP32 * thk)
    l2 = Kernel("kda l2norm q,k", 6.0 * thk, 2 * (2 * act * thk) + 2 * FP32 * t * h)
    intra = Kernel("kda intra (A, w, u)",
                   t * h * (2 * 2 * chunk * dk * tri + 2 * chunk * chunk / 3 + 2 * chunk * (dk + dv)),
                   act * (3 * thk) + FP32 * (thk + t * h) + act * (2 * tha + 2 * thk + thv) + FP32 * t * h * 16,
                   "bf16")
    fwd_h = Kernel("kda state fwd_h", 2 * 2.0 * t * h * dk * dv,
                   act * (nvb * 2 * thk + thv) + FP32 * nt * h * dk + act * (state + thv), "bf16")
    fwd_o = Kernel("kda output fwd_o", t * h * (2.0 * dk * dv + 2.0 * chunk * dv * tri),
                   act * (nvb * (thk + tha) + thv + state + thv) + FP32 * nvb * thk, "bf16")
    out = [gate, l2, intra, fwd_h, fwd_o]
    if backward:
        recompute_wu = Kernel("kda bwd: recompute w, u",
                              t * h * 2.0 * chunk * (dk + dv),
                              act * (thk + thv + tha + 2 * thk + thv) + FP32 * (thk + t * h), "bf16")
        out += [
            dataclasses.replace(gate, name="kda bwd: recompute gate"),
            recompute_wu,
            dataclasses.replace(fwd_h, name="kda bwd: recompute fwd_h"),
            Kernel("kda bwd dAv", t * h * 2 * 2.0 * chunk * dv * tri,
                   act * (2 * thv + tha + thv) + FP32 * tha, "bf16"),
            Kernel("kda bwd dhu", t * h * 3 * 2.0 * dk * dv,
                   act * (nvb * 3 * thk + 2 * thv + state + thv) + FP32 * nt * h * dk, "bf16"),
            Kernel("kda bwd wy_dqkg", t * h * (3 * 2.0 * dk * dv + 2.0 * chunk * (2 * dk + 2 * dv)),
                   act * (2 * thk + 3 * thv + tha + 2 * state + thv) + FP32 * (thk + t * h)
                   + FP32 * (3 * thk + tha + t * h), "bf16"),
            Kernel("kda bwd intra", t * h * 4 * 2.0 * chunk * dk * tri,
                   act * 2 * thk + FP32 * (thk + t * h + 2 * tha) + FP32 * 2 * (3 * thk + t * h), "bf16"),
            Kernel("kda bwd cumsum+gate+l2norm", 20.0 * thk, FP32 * 2 * thk + act * (thk + thk) + 3 * 2 * act * thk),
        ]
    return out


def kda_layer_extra(tokens: int, c, train_weights: bool, backward: bool = True) -> list[Kernel]:
    """The rest of a KDA layer: fla's causal conv1d over ``[q|k|v]`` (read ``3 H K`` channels + write, backward twice
    that), the gated RMSNorm (read o and gate, write), and the projections (``nn.Linear``)."""
    d, hk, r = c.hidden_size, c.linear_num_heads * c.linear_head_dim, c.linear_head_dim
    conv = 3 * hk * tokens
    out = [Kernel("kda conv1d fwd", 2.0 * c.linear_conv_kernel_dim * conv, 2 * BF16 * conv),
           Kernel("kda gated rmsnorm fwd", 8.0 * tokens * hk, 3 * BF16 * tokens * hk)]
    if backward:
        out += [Kernel("kda conv1d bwd", 4.0 * c.linear_conv_kernel_dim * conv, 4 * BF16 * conv),
                Kernel("kda gated rmsnorm bwd", 16.0 * tokens * hk, 6 * BF16 * tokens * hk)]
    projs = [("q_proj", d, hk), ("k_proj", d, hk), ("v_proj", d, hk), ("f_a_proj", d, r), ("f_b_proj", r, hk),
             ("b_proj", d, c.linear_num_heads), ("g_a_proj", d, r), ("g_b_proj", r, hk), ("o_proj", hk, d)]
    for name, n_in, n_out in projs:
        ks = linear_fwd_bwd(name, tokens, n_in, n_out, train_weights)
        out += ks if backward else ks[:1]
    return out


def kda_sp_extra(tokens: int, c, sp: int) -> list[Kernel]:
    """Sequence parallelism's extra KDA work per rank (``sp > 1``): the shard's affine state map ``(A_r, B_r)``
    (fla's CP pre-process, one more ``fwd_h``-like pass over the shard) in the forward and its reverse in the
    backward; nothing for ``sp == 1``."""
    if sp == 1:
        return []
    fwd_h = kda_core(tokens, c.linear_num_heads, c.linear_head_dim, c.linear_head_dim, backward=False)[3]
    return [dataclasses.replace(fwd_h, name="kda SP state map"),
            dataclasses.replace(fwd_h, name="kda SP state map bwd")]


def dsa_layer_extra(tokens: int, c, train_weights: bool, backward: bool = True) -> list[Kernel]:
    """The DSA layer's projections (MLA and the frozen indexer's, forward only for the indexer) and the absorbed
    ``q_h W_kc`` / ``o W_vc`` per-head products (batched GEMMs ``[T, 256] x [256, 512]`` per head)."""
    d, hq = c.hidden_size, c.num_attention_heads
    projs = [("q_a_proj", d, c.q_lora_rank), ("q_b_proj", c.q_lora_rank, hq * c.qk_nope_head_dim),
             ("kv_a_proj", d, c.kv_lora_rank), ("o_proj", hq * c.v_head_dim, d)]
    out = []
    for name, n_in, n_out in projs:
        ks = linear_fwd_bwd(name, tokens, n_in, n_out, train_weights)
        out += ks if backward else ks[:1]
    for name in ("absorb q W_kc", "absorb o W_vc"):
        g = gemm(name, tokens * hq, c.kv_lora_rank, c.qk_nope_head_dim)
        out += [g, dataclasses.replace(g, name=name + " bwd", flops=2 * g.flops)] if backward else [g]
    for name, n_in, n_out in (("indexer wq_b", c.q_lora_rank, c.index_n_heads * c.index_head_dim),
                              ("indexer wk", d, c.index_head_dim), ("indexer weights_proj", d, c.index_n_heads)):
        out.append(gemm(name, tokens, n_out, n_in))
    return out


# ------------------------------------------------------------------------------------------------------------- MoE
def moe_experts(tokens: int, hidden: int, inter: int, experts: int, top_k: int, train_weights: bool = True,
                backward: bool = True, act: int = BF16) -> list[Kernel]:
    """Routed experts on one rank (``S = T k`` rows, ``E`` local experts, balanced routing).

    * dispatch: ``index_select`` of the token rows into ``[S, H]`` (``S H`` read and written); backward the
      ``index_add`` into ``[T, H]`` (``S H`` read and written, ``T H`` written).
    * grouped GEMMs ``[S, H] x [E, H, 2I]`` and ``[S, I] x [E, I, H]``: ``2 S H 2I`` and ``2 S I H``; bytes: the rows,
      all ``E`` expert matrices, the outputs; backward: ``dx`` (same FLOPs) and ``dW`` (same FLOPs, when trained).
    * ``_swiglu_fwd_kernel`` (2-D grid over rows x ``I`` blocks): read ``[S, 2I]``, write ``[S, I]``, ~10 FLOPs per
      output; backward: read ``gate_up`` and ``dact``, write ``dgate_up`` ``[S, 2I]``.
    * ``_combine_fwd_kernel`` grid ``(T, cdiv(H, BH))``: per program ``k`` row ids and weights, ``k`` row blocks;
      writes ``out [T, H]``: bytes ``act (S H + T H)``, ``2 S H`` FLOPs. ``_combine_bwd_kernel`` grid ``(S,)``: per
      row the token's gradient row and the row (``2 act H``), writes ``drows`` and ``dw``: ``act 3 S H``.
    """
    s = tokens * top_k
    out = [Kernel("moe dispatch gather", 0.0, 2 * act * s * hidden)]
    g1, g2 = gemm("moe grouped gemm gate_up", s, 2 * inter, hidden), gemm("moe grouped gemm down", s, hidden, inter)
    g1.bytes = act * (s * hidden + experts * hidden * 2 * inter + s * 2 * inter)
    g2.bytes = act * (s * inter + experts * inter * hidden + s * hidden)
    out += [g1, Kernel("moe swiglu fwd", 10.0 * s * inter, act * 3 * s * inter), g2,
            Kernel("moe combine fwd", 2.0 * s * hidden, act * (s * hidden + tokens * hidden) + 8 * s)]
    if backward:
        out.append(Kernel("moe combine bwd", 2.0 * s * hidden, act * 3 * s * hidden + 8 * s))
        for g, bwd in ((g2, Kernel("moe swiglu bwd", 16.0 * s * inter, act * 5 * s * inter)), (g1, None)):
            out.append(dataclasses.replace(g, name=g.name + " dx"))
            if train_weights:
                out.append(dataclasses.replace(g, name=g.name + " dW"))
            if bwd is not None:
                out.append(bwd)
        out.append(Kernel("moe dispatch bwd (index_add)", s * hidden, act * (2 * s * hidden + tokens * hidden)))
    return out


# ------------------------------------------------------------------------------------------------------- families
def family_cost(family: str, c, tokens: int, backward: bool = True) -> list[Kernel]:
    """The kernels ``scripts/bench_gpu.py``'s ``raw`` variant of ``family`` runs at ``tokens`` (one call = forward +
    backward): kda: fla's ``chunk_kda`` core; dsa: the sparse MLA kernels (the indexer's selection is outside the
    timing); mhc: one hc_pre + one hc_post; moe: both grouped GEMMs, SwiGLU and combine (routing outside)."""
    if family == "kda":
        return kda_core(tokens, c.linear_num_heads, c.linear_head_dim, c.linear_head_dim, backward=backward)
    if family == "dsa":
        width = c.index_topk + (c.index_kpool - 1 if c.index_kpool_always_select_tail else 0)
        valid = valid_ids(tokens, c.index_topk, c.index_kpool, c.index_kpool_always_select_tail)
        return sparse_mla(tokens, c.num_attention_heads, c.kv_lora_rank, width, valid, backward=backward)
    if family == "mhc":
        return (hc_pre(tokens, c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters, backward=backward)
                + hc_post(tokens, c.hc_mult, c.hidden_size, backward=backward))
    if family == "moe":
        ks = moe_experts(tokens, c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok,
                         backward=backward)
        return [k for k in ks if not k.name.startswith("moe dispatch")]
    raise ValueError(f"family must be one of kda, dsa, mhc, moe; got {family!r}")


def total_ms(kernels: list[Kernel], device=H200, floor: bool = False) -> float:
    """Predicted milliseconds of ``kernels`` run one after the other."""
    return 1e3 * sum(k.seconds(device, floor) for k in kernels)


# ----------------------------------------------------------------------------------------------------------- step
def predict_step(c, gpus: int, ep: int, sp: int, seq: int, full: bool, layers: int | None = None,
                 recompute: bool = True, device=H200, floor: bool = False) -> dict:
    """Predicted time of one training step per GPU: one packed row of ``seq`` tokens per ``sp`` ranks (``T = seq /
    sp`` tokens per GPU), experts split over ``ep`` ranks (``T k`` rows per rank after the all-to-all, ``E / ep``
    experts each), ``layers`` main layers (default all; fewer = a prefix crop) plus the config's MTP layers (one
    depth each: DSA, MoE, ``eh_proj`` and the shared ``lm_head``; no mHC).

    ``full`` trains every weight (GEMM backward = ``dx`` + ``dW``); LoRA (``full=False``) trains only adapters,
    whose GEMMs are neglected (backward = ``dx`` only). ``recompute``: per-layer activation checkpointing, one more
    forward. Communication at ``nvlink_bytes_s``, not overlapped: the MoE all-to-all sends ``T k H`` bf16 per
    direction ((ep-1)/ep of it leaves the GPU) forward (dispatch, combine) and backward; the SP exchange is
    ``bench_sp.bytes_per_layer`` forward and the same backward. ``floor``: kernels at their ``floor_bytes`` (re-reads
    served by L2). Returns a dict of ms per part and tokens/s/GPU.

    Raises:
        ValueError: a degree that does not divide its count.
    """
    for name, value, whole in (("sp", sp, seq), ("ep", ep, c.n_routed_experts), ("ep", ep, gpus), ("sp", sp, gpus)):
        if value < 1 or whole % value:
            raise ValueError(f"{name}={value} must be >= 1 and divide {whole}")
    t = seq // sp
    n_main = c.num_hidden_layers if layers is None else layers
    if not 1 <= n_main <= c.num_hidden_layers:
        raise ValueError(f"layers={layers} must be in 1..{c.num_hidden_layers}")
    kinds = [(c.layer_types[i], c.mlp_layer_types[i], True) for i in range(n_main)]
    kinds += [("indexed_attention", "sparse", False)] * int(c.num_nextn_predict_layers or 0)  # MTP: no mHC
    parts = dict(kda=0.0, dsa=0.0, mhc=0.0, moe=0.0, dense_mlp=0.0, head=0.0, comm_ep=0.0, comm_sp=0.0)
    fwd_factor = 2.0 if recompute else 1.0

    def add(part, kernels):
        fwd = [k for k in kernels if not any(w in k.name for w in ("bwd", " dx", " dW", "dpre", "dfn", "recompute"))]
        parts[part] += 1e3 * (sum(k.seconds(device, floor) for k in kernels)
                              + (fwd_factor - 1.0) * sum(k.seconds(device, floor) for k in fwd))

    sp_bytes = bytes_per_layer(c, seq, sp)
    a2a = t * c.num_experts_per_tok * c.hidden_size * BF16 * (ep - 1) / ep
    for attn, mlp, has_hc in kinds:
        if attn == "linear_attention":
            add("kda", kda_core(t, c.linear_num_heads, c.linear_head_dim, c.linear_head_dim)
                + kda_layer_extra(t, c, full) + kda_sp_extra(t, c, sp))
            parts["comm_sp"] += 1e3 * 2 * sp_bytes["kda_total"] / device["nvlink_bytes_s"]
        else:
            width = c.index_topk + (c.index_kpool - 1 if c.index_kpool_always_select_tail else 0)
            # one document of seq tokens, queries split over the SP ranks: this rank's share of the valid ids
            valid = valid_ids(seq, c.index_topk, c.index_kpool, c.index_kpool_always_select_tail) // sp
            idx = dsa_indexer(seq, c.index_n_heads, c.index_head_dim, c.index_topk, c.index_kpool)[0]
            idx = dataclasses.replace(idx, flops=idx.flops / sp, bytes=idx.bytes / sp)
            add("dsa", sparse_mla(t, c.num_attention_heads, c.kv_lora_rank, width, valid, kv_tokens=seq) + [idx]
                + dsa_layer_extra(t, c, full))
            parts["comm_sp"] += 1e3 * 2 * sp_bytes["dsa_total"] / device["nvlink_bytes_s"]
        if has_hc:
            site = (hc_pre(t, c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters)
                    + hc_post(t, c.hc_mult, c.hidden_size))
            add("mhc", site + site)
        if mlp == "dense":
            ks = []
            for name, n_in, n_out in (("gate_proj", c.hidden_size, c.intermediate_size),
                                      ("up_proj", c.hidden_size, c.intermediate_size),
                                      ("down_proj", c.intermediate_size, c.hidden_size)):
                ks += linear_fwd_bwd(name, t, n_in, n_out, full)
            add("dense_mlp", ks)
        else:
            ks = moe_experts(t, c.hidden_size, c.moe_intermediate_size, c.n_routed_experts // ep,
                             c.num_experts_per_tok, train_weights=full)
            ks += linear_fwd_bwd("router", t, c.hidden_size, c.n_routed_experts, False)
            shared = c.moe_intermediate_size * c.n_shared_experts
            for name, n_in, n_out in (("shared gate_up", c.hidden_size, 2 * shared),
                                      ("shared down", shared, c.hidden_size)):
                ks += linear_fwd_bwd(name, t, n_in, n_out, full)
            add("moe", ks)
            parts["comm_ep"] += 1e3 * (2 + 2 + (2 if recompute else 0)) * a2a / device["nvlink_bytes_s"]
    add("head", linear_fwd_bwd("lm_head", t, c.hidden_size, c.vocab_size, full))
    for _ in range(int(c.num_nextn_predict_layers or 0)):  # each MTP depth: eh_proj and the shared head again
        add("head", linear_fwd_bwd("mtp eh_proj", t, 2 * c.hidden_size, c.hidden_size, full)
            + linear_fwd_bwd("mtp lm_head", t, c.hidden_size, c.vocab_size, full))
    step_ms = sum(parts.values())
    return dict(parts=parts, step_ms=step_ms, tokens_per_gpu=t, tokens_s_gpu=t / (step_ms / 1e3), gpus=gpus, ep=ep,
                sp=sp, seq=seq, full=full, layers=n_main, recompute=recompute)


# ------------------------------------------------------------------------------------------------------- printing
RELEASE_SHAPES = [("kda", 4096), ("kda", 32768), ("kda", 131072), ("dsa", 4096), ("dsa", 32768), ("dsa", 131072),
                  ("mhc", 8192), ("moe", 8192), ("moe", 8192, 8)]


def kernel_table(c, shapes=RELEASE_SHAPES, device=H200) -> list[str]:
    """Markdown rows: every kernel of every ``(family, T[, ep])`` with GFLOP, GB, predicted ms and its bound; one
    total row per entry; DSA rows add the indexer's scoring and MoE rows the dispatch gather (neither is in
    bench_gpu's raw timing); ``moe EP8``: 8k tokens per rank whose ``T k`` rows go to ``E / 8`` local experts."""
    rows = ["| op | T | kernel | GFLOP | GB | predicted ms | bound | ms, re-reads in L2 |", "|" + "---|" * 8]
    for family, t, *ep in shapes:
        ep = ep[0] if ep else 1
        ks = family_cost(family, c, t)
        if family == "dsa":
            ks = ks + dsa_indexer(t, c.index_n_heads, c.index_head_dim, c.index_topk, c.index_kpool)
        if family == "moe":  # with the routing gather (dispatch) and its backward; E / ep experts on this rank
            ks = moe_experts(t, c.hidden_size, c.moe_intermediate_size, c.n_routed_experts // ep,
                             c.num_experts_per_tok)
            family = "moe" if ep == 1 else f"moe EP{ep}"
        for k in ks:
            rows.append(f"| {family} | {t} | {k.name} | {k.flops / 1e9:.1f} | {k.bytes / 1e9:.3f} | "
                        f"{1e3 * k.seconds(device):.3f} | {k.bound(device)} | "
                        f"{'-' if k.floor_bytes is None else f'{1e3 * k.seconds(device, floor=True):.3f}'} |")
        rows.append(f"| **{family}** | {t} | **total fwd+bwd** | {sum(k.flops for k in ks) / 1e9:.1f} | "
                    f"{sum(k.bytes for k in ks) / 1e9:.3f} | **{total_ms(ks, device):.2f}** | | "
                    f"{total_ms(ks, device, floor=True):.2f} |")
    return rows


def step_rows(c, configs, device=H200) -> list[str]:
    rows = ["| GPUs | EP | SP | seq | train | layers | checkpointing | T/GPU | KDA ms | DSA ms | mHC ms | MoE ms | "
            "dense ms | head ms | EP comm ms | SP comm ms | step ms | tokens/s/GPU | step ms, re-reads in L2 | "
            "tokens/s/GPU, re-reads in L2 |",
            "|" + "---|" * 20]
    for kw in configs:
        r = predict_step(c, device=device, **kw)
        lo = predict_step(c, device=device, floor=True, **kw)
        p = r["parts"]
        rows.append(f"| {r['gpus']} | {r['ep']} | {r['sp']} | {r['seq']} | {'full' if r['full'] else 'LoRA'} | "
                    f"{r['layers']} | {'yes' if kw.get('recompute', True) else 'no'} | {r['tokens_per_gpu']} | "
                    f"{p['kda']:.1f} | {p['dsa']:.1f} | {p['mhc']:.1f} | "
                    f"{p['moe']:.1f} | {p['dense_mlp']:.1f} | {p['head']:.1f} | {p['comm_ep']:.1f} | "
                    f"{p['comm_sp']:.1f} | {r['step_ms']:.0f} | {r['tokens_s_gpu']:.0f} | {lo['step_ms']:.0f} | "
                    f"{lo['tokens_s_gpu']:.0f} |")
    return rows


def kda_layer_sp_ms(c, seq: int, sp: int, device=H200) -> float:
    """One KDA layer forward + backward per rank at ``seq`` tokens over ``sp`` ranks (core, conv, norm, trained
    projections; the SP exchange at NVLink bandwidth): the quantity of xtuner's 44.35 ms figure."""
    t = seq // sp
    ks = (kda_core(t, c.linear_num_heads, c.linear_head_dim, c.linear_head_dim) + kda_layer_extra(t, c, True)
          + kda_sp_extra(t, c, sp))
    return total_ms(ks, device) + 1e3 * 2 * bytes_per_layer(c, seq, sp)["kda_total"] / device["nvlink_bytes_s"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=sorted(DEVICES), default="h200", help="datasheet figures (default h200)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs of the first step row (default 8)")
    p.add_argument("--ep", type=int, default=8, help="expert-parallel size of the first step row (default 8)")
    p.add_argument("--sp", type=int, default=8, help="sequence-parallel size of the first step row (default 8)")
    p.add_argument("--seq", type=int, default=131072, help="tokens per sequence of the first step row (default 131072)")
    p.add_argument("--full", action="store_true", help="full fine-tuning (default LoRA)")
    p.add_argument("--layers", type=int, default=None, help="main layers (a prefix crop; default all)")
    p.add_argument("--no-recompute", action="store_true", help="no per-layer activation checkpointing")
    args = p.parse_args(argv)
    dev = DEVICES[args.device]
    c = release_config()
    print(f"# Roofline model ({dev['name']}: {dev['bf16_flops'] / 1e12:.0f} TFLOPS dense BF16, "
          f"{dev['fp32_flops'] / 1e12:.0f} TFLOPS FP32, {dev['hbm_bytes_s'] / 1e12:.2f} TB/s HBM, "
          f"{dev['hbm_gb']} GB; NVLink {dev['nvlink_bytes_s'] / 1e9:.0f} GB/s; GEMMs at {GEMM_EFFICIENCY:.0%} "
          f"of peak). Predictions, not measurements.\n")
    print("\n".join(kernel_table(c, device=dev)))
    print(f"\nKDA layer fwd+bwd per rank, 128k tokens over SP 8: predicted {kda_layer_sp_ms(c, 131072, 8, dev):.2f} ms "
          f"(xtuner, 8 x H200: {XTUNER['kda_layer_128k_sp8_ms']} ms)\n")
    configs = [dict(gpus=args.gpus, ep=args.ep, sp=args.sp, seq=args.seq, full=args.full, layers=args.layers,
                    recompute=not args.no_recompute)]
    # the comparison rows of docs/benchmarks.md: full fine-tuning at 128k / 32k / 8k, and the 5-layer crop at 8k
    # with and without activation checkpointing
    configs += [dict(gpus=8, ep=8, sp=8, seq=131072, full=True), dict(gpus=8, ep=8, sp=4, seq=32768, full=True),
                dict(gpus=8, ep=8, sp=1, seq=8192, full=True),
                dict(gpus=8, ep=8, sp=1, seq=8192, full=True, layers=5, recompute=True),
                dict(gpus=8, ep=8, sp=1, seq=8192, full=True, layers=5, recompute=False)]
    print("\n".join(step_rows(c, configs, device=dev)))
    print(f"\nxtuner's 25B crop (layers 0-4 + MTP, 8 x H200): about {XTUNER['crop25b_tokens_s_gpu']:.0f} tokens/s/GPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
