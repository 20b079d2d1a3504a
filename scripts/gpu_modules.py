"""Shapes and module set-up shared by the GPU benchmark (scripts/bench_gpu.py) and the GPU tests (tests/test_gpu.py;
pytest puts this folder on ``sys.path``, ``pythonpath`` in pyproject.toml): the release's text sizes, tiny sizes for
CPU runs of the same code, realistic random weights and transformers' fp32-kept parameters."""

from __future__ import annotations

import torch

RELEASE_TEXT = dict(
    vocab_size=1024,
    hidden_size=4096,
    intermediate_size=12288,
    moe_intermediate_size=2048,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    indexer_types=["full"] * 4,
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=256,
    qk_rope_head_dim=0,
    v_head_dim=256,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
    index_kpool=4,
    index_kpool_always_select_tail=True,
    linear_num_heads=64,
    linear_head_dim=128,
    linear_conv_kernel_dim=4,
    linear_lower_bound=-5.0,
    n_routed_experts=288,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    swiglu_limit=10.0,
    hc_mult=4,
    hc_eps=1e-6,
    hc_sinkhorn_iters=20,
    rms_norm_eps=1e-5,
    attention_bias=False,
    attention_dropout=0.0,
    pad_token_id=0,
)

TINY_TEXT = dict(
    RELEASE_TEXT,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    v_head_dim=16,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=16,
    linear_num_heads=2,
    linear_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
)

# transformers' Glm5NextPreTrainedModel._keep_in_fp32_modules_strict, plus the standalone mHC module's names.
KEEP_FP32 = ("e_score_correction_bias", "gate.weight", "conv1d", "dt_bias", "A_log", "base", "scale")


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Non-degenerate weights at realistic scales: fan-in scaled normals for matrices (``gate_up_proj`` twice as
    wide, so the SwiGLU clamp at 10 is reached by a few activations), norms near 1, fp32 gate parameters in ranges
    where the KDA decay is neither 0 nor 1, random mHC base/scale and k-pool gate, a small router bias."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen, device=gen.device) * std + mean

    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.rand(p.shape, generator=gen, device=gen.device) - 0.5)
            elif leaf == "dt_bias":
                p.copy_(normal(p.shape, 0.5))
            elif leaf == "scale":
                p.copy_(normal(p.shape, 0.2, 1.0))
            elif leaf in ("base", "index_kpool_compress_ape"):
                p.copy_(normal(p.shape, 0.5))
            elif "norm" in name:
                p.copy_(normal(p.shape, 0.1, 1.0 if leaf == "weight" else 0.0))
            elif p.dim() >= 2:
                fan_in = p[0].numel() if p.dim() == 2 else p.shape[-1] * (p.shape[1] if "conv" in name else 1)
                p.copy_(normal(p.shape, (2.0 if leaf == "gate_up_proj" else 1.0) / fan_in**0.5))
            else:
                p.copy_(normal(p.shape, 0.1))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(normal(b.shape, 0.05))


def to_model_dtypes_(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module.to(dtype)`` except the tensors transformers keeps in fp32 (:data:`KEEP_FP32`)."""
    module.to(dtype)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if any(key in name for key in KEEP_FP32):
                t.data = t.data.float()
    return module
