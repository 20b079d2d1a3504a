"""Helpers shared by the scripts (and by the tests, which import this file): the benchmarks' wide tiny config, random
weights, loading either implementation, and the worker-process handling of the CPU benchmarks."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import torch

# The benchmarks' wide tiny config (bench_cpu.py, bench_decode.py, bench_sp.py, investigations/bf16_audit.py;
# tests/test_compile.py): hidden 256, 3 KDA + 1 DSA layers, 8 routed experts top-2, index_kpool 4, index_topk 256.
WIDE_TEXT = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    indexer_types=["full"] * 4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=0,
    v_head_dim=64,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=256,
    index_kpool=4,
    linear_num_heads=4,
    linear_head_dim=64,
    linear_conv_kernel_dim=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    hc_mult=4,
    pad_token_id=0,
    tie_word_embeddings=False,
)

TINY_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=256,
                   projection_intermediate_size=48)


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.08) -> None:
    """Give every parameter and float buffer non-trivial values (HF initialises the KPool gate to ones,
    ``ape`` and the router bias to zeros, which would make selection and routing degenerate).

    fp32 gate parameters (A_log, dt_bias) keep sensible ranges so the decay is neither 0 nor 1.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 1.0 - 0.5)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith(".scale"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("index_kpool_compress_gate") or name.endswith("index_kpool_compress_ape"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)


def make_weights(folder: str, **text_overrides) -> None:
    """Random weights of the wide tiny config (``WIDE_TEXT`` updated by ``text_overrides``), saved by transformers'
    ``Glm5NextForConditionalGeneration`` into ``folder``."""
    import torch
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    torch.manual_seed(0)
    model = Glm5NextForConditionalGeneration(
        Glm5NextConfig(text_config={**WIDE_TEXT, **text_overrides}, vision_config=TINY_VISION)
    )
    randomize_(model, seed=0, std=0.04)
    model.save_pretrained(folder)


def load(impl: str, folder: str):
    import torch

    if impl.startswith("hf"):
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

        return Glm5NextForConditionalGeneration.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager"
        )
    from glm53flash_hf import Glm53FlashForCausalLM

    return Glm53FlashForCausalLM.from_pretrained(folder, dtype=torch.float32)


def cap_address_space(mem_gib: float) -> None:
    """Cap this process's address space at ``mem_gib`` GiB (``RLIMIT_AS``; 0 or less: no cap), so that a run that
    needs more fails with an allocation error instead of swapping."""
    if mem_gib > 0:
        limit = int(mem_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


OOM_MESSAGES = ("can't allocate memory", "MemoryError", "out of memory", "Cannot allocate memory")


def run_child(cmd: list[str], timeout: float, label: dict) -> dict:
    """Run one worker process ``cmd`` whose last stdout line is a JSON object and return that object.

    A failed run comes back as ``{**label, "failed": "OOM" | "timeout" | "error"}``: ``timeout`` when it ran past
    ``timeout`` seconds, ``OOM`` when it was killed (signal 9) or its stderr names an allocation failure."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**label, "failed": "timeout"}
    if proc.returncode != 0:
        err = proc.stderr[-3000:]
        oom = proc.returncode == -9 or any(m in err for m in OOM_MESSAGES)
        where = " ".join(f"{k} {v}" for k, v in label.items())
        print(f"  {where} failed (rc {proc.returncode}):\n{err[-1200:]}", file=sys.stderr)
        return {**label, "failed": "OOM" if oom else "error"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


