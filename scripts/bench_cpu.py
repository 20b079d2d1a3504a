#!/usr/bin/env python
"""CPU benchmark: glm53flash-hf vs transformers' built-in glm5_next, same weights, forward+backward.

Wide tiny config: hidden 256, 4 layers (3 KDA + 1 DSA), 8 routed experts, index_kpool 4, index_topk 256, fp32.
The reference (``Glm5NextForConditionalGeneration``, eager attention) writes the weights with ``save_pretrained``
and both models load that folder. Each (implementation, sequence length) runs in its own process so the peak
resident memory (``ru_maxrss``) of one run is not hidden by another; the reported memory is that peak minus the
resident memory just before the first forward (model, inputs and libraries excluded).

Usage::

    python scripts/bench_cpu.py                      # S = 512 2048 8192, prints a table with ratios
    python scripts/bench_cpu.py --seqlens 512 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

# transformers' glm5_next binds fla-core's Triton kernels at import when fla is installed (the [gpu] or [test] extra),
# and those fail on CPU tensors ("0 active drivers"): hide fla so the reference runs its torch path.
if "fla" not in sys.modules:
    sys.modules["fla"] = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

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


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def make_weights(folder: str) -> None:
    import torch
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from tiny import randomize_

    torch.manual_seed(0)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=WIDE_TEXT, vision_config=TINY_VISION))
    randomize_(model, seed=0, std=0.04)
    model.save_pretrained(folder)


def worker(impl: str, folder: str, seq_len: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    if impl == "hf":
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

        model = Glm5NextForConditionalGeneration.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager"
        )
    else:
        from glm53flash_hf import Glm53FlashForCausalLM

        model = Glm53FlashForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, WIDE_TEXT["vocab_size"], (1, seq_len), generator=gen)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        return out.loss.item()

    base = _rss_kib()
    times = []
    loss = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"impl": impl, "seq_len": seq_len, "time_s": statistics.median(times), "times": times,
            "peak_mib": (peak - base) / 1024, "loss": loss}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 2048, 8192], help="sequence lengths")
    parser.add_argument("--repeats", type=int, default=2, help="timed forward+backward steps per run (median)")
    parser.add_argument("--impls", nargs="+", default=["hf", "ours"], choices=["hf", "ours"])
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--worker", nargs=3, metavar=("IMPL", "FOLDER", "SEQ_LEN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        impl, folder, seq_len = args.worker
        print(json.dumps(worker(impl, folder, int(seq_len), args.repeats)))
        return 0

    results = {}
    with tempfile.TemporaryDirectory() as folder:
        make_weights(folder)
        for seq_len in args.seqlens:
            for impl in args.impls:
                cmd = [sys.executable, __file__, "--repeats", str(args.repeats), "--worker", impl, folder, str(seq_len)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"{impl} S={seq_len} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                    results[(impl, seq_len)] = None
                    continue
                res = json.loads(proc.stdout.strip().splitlines()[-1])
                results[(impl, seq_len)] = res
                print(f"  {impl:4s} S={seq_len:5d}: {res['time_s']:.3f} s  peak +{res['peak_mib']:.0f} MiB  "
                      f"loss {res['loss']:.5f}", flush=True)

    print("\n| S | transformers fwd+bwd (s) | ours (s) | speed-up | transformers peak (MiB) | ours peak (MiB) "
          "| memory ratio |")
    print("|---|---|---|---|---|---|---|")
    for seq_len in args.seqlens:
        hf, ours = results.get(("hf", seq_len)), results.get(("ours", seq_len))
        if not hf or not ours:
            continue
        print(f"| {seq_len} | {hf['time_s']:.3f} | {ours['time_s']:.3f} | {hf['time_s'] / ours['time_s']:.1f}x | "
              f"{hf['peak_mib']:.0f} | {ours['peak_mib']:.0f} | {ours['peak_mib'] / max(hf['peak_mib'], 1e-9):.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([v for v in results.values() if v], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
