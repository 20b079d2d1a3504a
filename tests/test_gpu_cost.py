"""scripts/gpu_cost.py: the roofline counts on tiny shapes against hand-computed values and the tensors' own sizes,
the valid-id count against our indexer's output, and the step prediction's arithmetic and argument checks."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cost():
    spec = importlib.util.spec_from_file_location("gpu_cost_under_test", os.path.join(ROOT, "scripts", "gpu_cost.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def test_gemm_counts(cost):
    k = cost.gemm("x", 3, 5, 7)
    assert k.flops == 2 * 3 * 5 * 7 == 210
    assert k.bytes == 2 * (3 * 7 + 7 * 5 + 3 * 5) == 142
    lin = cost.linear_fwd_bwd("p", 3, 7, 5, train_weight=True)
    assert [x.flops for x in lin] == [210, 210, 210]
    assert len(cost.linear_fwd_bwd("p", 3, 7, 5, train_weight=False)) == 2  # LoRA: no dW of the frozen base


def test_hc_post_forward_reads_each_tensor_once(cost):
    """D <= BD: one feature block per token, so every tensor is read (or written) exactly once: the kernel's bytes
    equal the sizes of y, residual, post (fp32), comb (fp32) and out; FLOPs by hand: T N D (2N + 2)."""
    t, n, d = 3, 4, 16
    y, res = torch.empty(t, d, dtype=torch.bfloat16), torch.empty(t, n, d, dtype=torch.bfloat16)
    post, comb, out = torch.empty(t, n), torch.empty(t, n, n), torch.empty(t, n, d, dtype=torch.bfloat16)
    fwd, bwd = cost.hc_post(t, n, d)
    assert fwd.bytes == nbytes(y, res, post, comb, out) == 1104
    assert fwd.flops == 3 * 4 * 16 * 10
    # backward reads grad, y, residual, post, comb and writes dy, dres, dpost, dcomb (fp32), one D block here
    g, dy, dres, dpost, dcomb = torch.empty_like(out), torch.empty_like(y), torch.empty_like(res), post, comb
    assert bwd.bytes == nbytes(g, y, res, post, comb, dy, dres, dpost, dcomb)
    assert fwd.bound() == bwd.bound() == "memory"


def test_sparse_mla_forward_bytes_and_flops(cost):
    """One head block (H <= BH), W = one id block: bytes = q, out, lse, the ids and the valid latent rows once each;
    FLOPs = the two padded tile dots per program: T * 2 * 2 BH BW BD."""
    t, h, dl, w = 8, 16, 64, 16
    q, out = torch.empty(t, h, dl, dtype=torch.bfloat16), torch.empty(t, h, dl, dtype=torch.bfloat16)
    lse, ids = torch.empty(t, h), torch.empty(t, w, dtype=torch.int32)
    valid = 40
    fwd = cost.sparse_mla(t, h, dl, w, valid, backward=False)[0]
    assert fwd.bytes == nbytes(q, out, lse, ids) + valid * dl * 2
    bh, bw, bd = 16, 64, 64  # _blocks(16, 64, None, None, 16384): min(p2(16), 64, 16384 // 64), min(64, 256), 64
    assert fwd.flops == t * 1 * 1 * 2 * 2 * bh * bw * bd
    assert fwd.floor_bytes == nbytes(q, out, lse, ids) + t * dl * 2  # the latent read once


def test_valid_ids_match_our_indexer(cost):
    """The number of valid (>= 0) ids our KPool indexer selects for one document equals valid_ids' count."""
    from gpu_modules import TINY_TEXT, randomize_

    from glm53flash_hf import dsa
    from glm53flash_hf.configuration_glm53flash import Glm53FlashTextConfig
    from glm53flash_hf.packing import build_document_layout

    cfg = Glm53FlashTextConfig(**dict(TINY_TEXT, index_topk=8), kernels="torch")
    attn = dsa.Glm53FlashAttention(cfg, 3)
    randomize_(attn, 0)
    seq = 37
    x = torch.randn(1, seq, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ids = attn.indexer(x, attn.q_a_layernorm(attn.q_a_proj(x)), build_document_layout(1, seq, x.device))
    expected = cost.valid_ids(seq, cfg.index_topk, cfg.index_kpool, cfg.index_kpool_always_select_tail)
    assert int((ids >= 0).sum()) == expected
    assert cost.valid_ids(10, 4, 2, True) == 37  # by hand: pooled 0,2,2,4,4,4,4,4,4,4 + tails 1,0,1,0,1,0,1,0,1,0


def test_moe_family_flops(cost):
    """The grouped GEMMs of the raw MoE variant: forward 2 S H 2I + 2 S I H, backward dx and dW the same again."""
    c = cost.release_config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2)
    ks = cost.family_cost("moe", c, 10)
    s = 10 * 2
    gemms = sum(k.flops for k in ks if "grouped gemm" in k.name)
    assert gemms == 3 * (2 * s * 64 * 64 + 2 * s * 32 * 64)
    with pytest.raises(ValueError, match="family must be one of kda, dsa, mhc, moe; got 'mla'"):
        cost.family_cost("mla", c, 10)


def test_kernel_time_is_the_larger_roofline_term(cost):
    k = cost.Kernel("k", flops=989e9, bytes=4.8e9, peak="bf16")  # 1 ms of compute, 1 ms of memory on the H200
    assert k.seconds() == pytest.approx(1e-3) and k.bound() == "compute"
    k = cost.Kernel("k", flops=0.0, bytes=9.6e9)
    assert k.seconds() == pytest.approx(2e-3) and k.bound() == "memory"
    g = cost.gemm("g", 1000, 1000, 1000)
    assert g.seconds() == pytest.approx(2e9 / (989e12 * cost.GEMM_EFFICIENCY))


def test_predict_step(cost):
    c = cost.release_config()
    lora = cost.predict_step(c, gpus=8, ep=8, sp=1, seq=4096, full=False, layers=5)
    full = cost.predict_step(c, gpus=8, ep=8, sp=1, seq=4096, full=True, layers=5)
    assert full["step_ms"] > lora["step_ms"] > 0
    assert lora["step_ms"] == pytest.approx(sum(lora["parts"].values()))
    assert lora["tokens_s_gpu"] == pytest.approx(4096 / (lora["step_ms"] / 1e3))
    assert lora["parts"]["comm_sp"] == 0.0 and lora["parts"]["comm_ep"] > 0
    ep1 = cost.predict_step(c, gpus=8, ep=1, sp=1, seq=4096, full=False, layers=5)
    assert ep1["parts"]["comm_ep"] == 0.0
    sp2 = cost.predict_step(c, gpus=8, ep=8, sp=2, seq=8192, full=False, layers=5)  # same 4096 tokens per GPU
    assert sp2["tokens_per_gpu"] == 4096 and sp2["parts"]["comm_sp"] > 0
    assert sp2["parts"]["kda"] > lora["parts"]["kda"]  # the shard's state map, forward and backward
    with pytest.raises(ValueError, match="sp=3 must be >= 1 and divide 4096"):
        cost.predict_step(c, gpus=3, ep=1, sp=3, seq=4096, full=False)
    with pytest.raises(ValueError, match="layers=99 must be in 1..45"):
        cost.predict_step(c, gpus=8, ep=8, sp=1, seq=4096, full=False, layers=99)


def test_hc_pre_reduce_reads_each_tensor_once(cost):
    """T <= BT: one program, so x and fn are read once and proj, sumsq written once; the fp32 dot runs on the padded
    MP = 32 mix columns: 2 T K MP + 2 T K (sum of squares)."""
    t, n, d = 16, 4, 16
    x, fn = torch.empty(t, n * d, dtype=torch.bfloat16), torch.empty(n * (n + 2), n * d, dtype=torch.bfloat16)
    proj, sumsq = torch.empty(t, n * (n + 2)), torch.empty(t)
    reduce = cost.hc_pre(t, n, d, sinkhorn_iters=20, backward=False)[0]
    assert reduce.name == "hc_pre reduce"
    assert reduce.bytes == nbytes(x, fn, proj, sumsq)
    assert reduce.flops == 2 * t * n * d * 32 + 2 * t * n * d
    assert reduce.peak == "fp32"  # ieee fp32 tl.dot: CUDA cores, not bf16 tensor cores


def test_device_choice():
    """``--device h100``: the same compute peaks, H100's lower HBM bandwidth, so every memory-bound kernel is slower;
    ``device_for`` maps CUDA device names."""
    import gpu_cost as cost

    assert cost.device_for("NVIDIA H100 80GB HBM3") is cost.H100 and cost.device_for("NVIDIA H200") is cost.H200
    k = cost.Kernel("k", flops=1e9, bytes=4.8e9, peak="bf16")  # memory-bound on both
    assert k.bound(cost.H100) == "memory" and k.seconds(cost.H100) > k.seconds(cost.H200)
    assert abs(k.seconds(cost.H100) / k.seconds(cost.H200) - 4.8 / 3.35) < 1e-9
