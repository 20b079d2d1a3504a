#!/usr/bin/env python
"""CPU decode benchmark: glm53flash-hf vs transformers' built-in glm5_next, same weights, cached greedy decoding.

Config: ``bench_cpu.py``'s wide tiny model (hidden 256, 3 KDA + 1 DSA layers, 8 routed experts, ``index_kpool`` 4,
``index_topk`` 256, fp32). transformers' ``Glm5NextForConditionalGeneration`` (eager attention) writes the weights;
both implementations load that folder. Each implementation runs in its own process:

1. prefill: one forward over a random prompt (default 2048 tokens) into a fresh ``DynamicCache(config=...)``;
2. decode: ``--new`` greedy steps (default 64), one token per forward, the cache carried over (the loop
   ``generate`` runs, without its logits processors).

Reported: prefill seconds, decode tokens/s, cache bytes per generated token (growth of every tensor the cache
holds, divided by the new tokens), peak resident memory growth during decode (``ru_maxrss``, so only a lower
bound when the prefill peak is higher), and whether the two implementations pick the same tokens.

Each implementation runs ``--repeats`` times (default 3), interleaved (transformers, ours, transformers, ours, ...),
each time in a fresh process; the table shows the median run of each (by decode tokens/s), the best run of each,
and the line under it every run, because a shared 2-core machine's speed drifts by tens of percent within a minute
(the best run is the least disturbed one).

Usage::

    python scripts/bench_decode.py                   # prompt 2048, 64 new tokens
    python scripts/bench_decode.py --prompt 512 --new 16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from bench_cpu import WIDE_TEXT, make_weights  # noqa: E402  (same weights as the training benchmark)


def cache_bytes(cache) -> int:
    """Bytes of every tensor held by a transformers cache (keys, values, indexer state, conv and recurrent states)."""
    import torch

    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "indexer_keys"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
        for name in ("conv_states", "recurrent_states"):
            for t in (getattr(layer, name, None) or {}).values():
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total


def worker(impl: str, folder: str, prompt_len: int, new_tokens: int) -> dict:
    import torch
    from transformers import DynamicCache

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    if impl == "hf":
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

        model = Glm5NextForConditionalGeneration.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager"
        )
    else:
        from glm53flash_hf import Glm53FlashForCausalLM

        model = Glm53FlashForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, WIDE_TEXT["vocab_size"], (1, prompt_len), generator=gen)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        prefill_s = time.perf_counter() - t0
        bytes_prefill = cache_bytes(cache)
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tokens = []
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            tok = logits.argmax(-1, keepdim=True)
            tokens.append(int(tok))
            logits = model(input_ids=tok, cache=cache, use_cache=True).logits[:, -1]
        decode_s = time.perf_counter() - t0
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "impl": impl,
        "prompt": prompt_len,
        "new": new_tokens,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "tok_per_s": new_tokens / decode_s,
        "cache_bytes_per_token": (cache_bytes(cache) - bytes_prefill) / new_tokens,
        "cache_bytes_prompt": bytes_prefill,
        "decode_peak_growth_mib": (rss_after - rss_before) / 1024,
        "tokens": tokens,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--new", type=int, default=64, help="generated tokens")
    parser.add_argument("--impls", nargs="+", default=["hf", "ours"], choices=["hf", "ours"])
    parser.add_argument("--repeats", type=int, default=3, help="runs per implementation (median reported)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--worker", nargs=2, metavar=("IMPL", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        impl, folder = args.worker
        print(json.dumps(worker(impl, folder, args.prompt, args.new)))
        return 0

    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1; got {args.repeats}")
    runs: dict[str, list[dict]] = {impl: [] for impl in args.impls}
    with tempfile.TemporaryDirectory() as folder:
        make_weights(folder)
        for _ in range(args.repeats):
            for impl in args.impls:
                cmd = [sys.executable, __file__, "--prompt", str(args.prompt), "--new", str(args.new), "--worker",
                       impl, folder]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"{impl} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                    continue
                res = json.loads(proc.stdout.strip().splitlines()[-1])
                runs[impl].append(res)
                print(
                    f"  {impl:4s}: prefill {res['prefill_s']:.2f} s, decode {res['tok_per_s']:.1f} tok/s, cache "
                    f"+{res['cache_bytes_per_token']:.0f} B/token, "
                    f"decode peak +{res['decode_peak_growth_mib']:.0f} MiB",
                    flush=True,
                )

    # the median run of each implementation (by decode speed)
    results = {impl: sorted(rs, key=lambda r: r["tok_per_s"])[(len(rs) - 1) // 2] for impl, rs in runs.items() if rs}
    hf, ours = results.get("hf"), results.get("ours")
    if hf and ours:
        same = sum(a == b for a, b in zip(hf["tokens"], ours["tokens"]))
        print(f"\nprompt {args.prompt}, {args.new} new tokens, fp32, {os.environ.get('BENCH_THREADS', '2')} threads, "
              f"median of {len(runs['hf'])} / {len(runs['ours'])} runs")
        print("| | transformers | ours | ratio |")
        print("|---|---|---|---|")
        print(f"| prefill (s) | {hf['prefill_s']:.2f} | {ours['prefill_s']:.2f} | "
              f"{hf['prefill_s'] / ours['prefill_s']:.1f}x |")
        print(f"| decode (tokens/s) | {hf['tok_per_s']:.1f} | {ours['tok_per_s']:.1f} | "
              f"{ours['tok_per_s'] / hf['tok_per_s']:.1f}x |")
        best_hf = max(r["tok_per_s"] for r in runs["hf"])
        best_ours = max(r["tok_per_s"] for r in runs["ours"])
        print(f"| decode, best run (tokens/s) | {best_hf:.1f} | {best_ours:.1f} | {best_ours / best_hf:.1f}x |")
        print(f"| cache per generated token (bytes) | {hf['cache_bytes_per_token']:.0f} | "
              f"{ours['cache_bytes_per_token']:.0f} | "
              f"{ours['cache_bytes_per_token'] / hf['cache_bytes_per_token']:.2f} |")
        print(f"| cache after the prompt (MiB) | {hf['cache_bytes_prompt'] / 2**20:.2f} | "
              f"{ours['cache_bytes_prompt'] / 2**20:.2f} | "
              f"{ours['cache_bytes_prompt'] / hf['cache_bytes_prompt']:.2f} |")
        print(f"| decode peak RSS growth (MiB) | {hf['decode_peak_growth_mib']:.0f} | "
              f"{ours['decode_peak_growth_mib']:.0f} | |")
        print("\nall runs, decode tokens/s: transformers " + ", ".join(f"{r['tok_per_s']:.1f}" for r in runs["hf"])
              + "; ours " + ", ".join(f"{r['tok_per_s']:.1f}" for r in runs["ours"]))
        print(f"same greedy tokens: {same}/{args.new}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({impl: rs for impl, rs in runs.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
