#!/usr/bin/env python
"""CPU decode benchmark: glm53flash-hf vs transformers' built-in glm5_next, same weights, greedy ``generate``.

Config: the wide tiny model of ``_common.py`` (hidden 256, 3 KDA + 1 DSA layers, 8 routed experts, ``index_kpool`` 4,
``index_topk`` 256, fp32). transformers' ``Glm5NextForConditionalGeneration`` (eager attention) writes the weights;
both implementations load that folder. Four implementations, each run in its own process:

- ``hf`` / ``ours``: ``generate(do_sample=False)`` with transformers' default ``DynamicCache``, eager;
- ``hf-compiled`` / ``ours-compiled``: ``generate(cache_implementation="static", compile_config=...)``, i.e.
  transformers' own automatic compilation of the decoding step (the prefill runs eagerly; ``CompileConfig`` with
  ``mode="default"``, ``dynamic=False``, ``fullgraph=True`` for ours and ``False`` for the built-in;
  ``_compile_all_devices`` set, since transformers compiles by itself only on accelerators). A first ``generate``
  of the same shapes compiles and is not timed.

A ``generate`` streamer records the time of every generated token; the per-token decode time is the mean gap
between consecutive tokens after the first (the first token comes out of the prefill). The series runs over the
prompt lengths of ``--prompts`` (default 1024 4096 16384) with ``--new`` new tokens (default 32).

Each implementation runs ``--repeats`` times per prompt length (default 1), interleaved, each time in a fresh
process; the table shows the median run, and the line under it every run, because a shared 2-core machine's speed
drifts by tens of percent within a minute. A worker's address space is capped (``--mem-gib``), and one still running
after ``--timeout`` seconds is stopped; both are reported in the table.

MTP speculative decoding (``--mtp``, a separate report; the table above is not run): ours with plain greedy
``generate(do_sample=False)`` vs ``generate(use_mtp=True, do_sample=False)`` (transformers' assisted decoding with
our MTP layer drafting one token per step), each in its own process after an untimed identical warm-up run, eager,
``DynamicCache``. It reports the
acceptance rate (accepted / drafted), decode tokens/s (tokens after the first over the time after the first;
MTP steps emit 1 or 2 tokens at once, so no per-token gaps) and whether the tokens equal plain greedy's. The model
is the wide tiny config plus one MTP layer with random weights (``--prompts`` random prompts; a random MTP layer
drafts badly, so this shows the overhead), or the folder ``--model PATH`` (e.g. the output folder of
``glm53flash-finetune``; the prompt is a chat question through the folder's tokenizer).

Usage::

    python scripts/bench_decode.py                              # prompts 1024 4096 16384, 32 new tokens
    python scripts/bench_decode.py --prompts 512 --new 16 --impls hf ours
    python scripts/bench_decode.py --mtp --prompts 256 --new 32         # random model with an MTP layer
    python scripts/bench_decode.py --mtp --model OUT --new 48           # a fine-tuned folder
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

# same weights, loading and worker handling as the training benchmark
from _common import WIDE_TEXT, cap_address_space, load, make_weights, randomize_, run_child  # noqa: E402

IMPLS = ("hf", "ours", "hf-compiled", "ours-compiled")


class TokenTimes:
    """A ``generate`` streamer that records ``time.perf_counter()`` at every call after the prompt's."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def worker(impl: str, folder: str, prompt_len: int, new_tokens: int, mem_gib: float) -> dict:
    cap_address_space(mem_gib)
    import torch
    from transformers import CompileConfig

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model = load(impl, folder).eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, WIDE_TEXT["vocab_size"], (1, prompt_len), generator=gen)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=0)
    compile_s = None
    if impl.endswith("-compiled"):
        config = CompileConfig(fullgraph=impl.startswith("ours"), dynamic=False, mode="default")
        config._compile_all_devices = True
        kwargs.update(cache_implementation="static", compile_config=config)
        with torch.no_grad():
            t0 = time.perf_counter()
            model.generate(ids, **kwargs)
            compile_s = time.perf_counter() - t0
    streamer = TokenTimes()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, streamer=streamer, **kwargs)
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gaps = [b - a for a, b in zip(streamer.times, streamer.times[1:])]
    return {
        "impl": impl,
        "prompt": prompt_len,
        "new": new_tokens,
        "prefill_s": streamer.times[0] - t0,
        "ms_per_token": 1e3 * sum(gaps) / len(gaps),
        "tok_per_s": len(gaps) / sum(gaps),
        "compile_s": compile_s,
        "peak_growth_mib": (rss_after - rss_before) / 1024,
        "tokens": out[0, prompt_len:].tolist(),
    }


MTP_IMPLS = ("ours", "ours-mtp")
MTP_QUESTION = 'Explain the "pass" statement.'


def make_mtp_weights(folder: str) -> None:
    """Random weights of the wide tiny config with one MTP layer, written by our class (transformers' glm5_next
    has no MTP layer)."""
    import torch

    from glm53flash_hf import Glm53FlashForCausalLM
    from glm53flash_hf.configuration_glm53flash import Glm53FlashTextConfig

    torch.manual_seed(0)
    model = Glm53FlashForCausalLM(Glm53FlashTextConfig(**WIDE_TEXT, num_nextn_predict_layers=1))
    randomize_(model, seed=0, std=0.04)
    model.save_pretrained(folder)


def mtp_worker(impl: str, folder: str, prompt_len: int, new_tokens: int, mem_gib: float) -> dict:
    """One ``generate`` of ``impl`` (``ours`` / ``ours-mtp``) on ``folder``; ``prompt_len`` 0 = the chat question
    through the folder's tokenizer, else random ids."""
    cap_address_space(mem_gib)
    import torch

    from glm53flash_hf import Glm53FlashForCausalLM

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model = Glm53FlashForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # same number of tokens for both runs
    if prompt_len:
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(1, model.config.get_text_config().vocab_size, (1, prompt_len), generator=gen)
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
        if tok.chat_template:
            ids = tok.apply_chat_template([{"role": "user", "content": MTP_QUESTION}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
        else:
            ids = tok(MTP_QUESTION, return_tensors="pt")["input_ids"]
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=0, use_mtp=impl == "ours-mtp")
    with torch.no_grad():  # warm-up, not timed: CPU kernels pay a first call per shape (a growing cache)
        model.generate(ids, **kwargs)
    streamer = TokenTimes()
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, streamer=streamer, **kwargs)
        t1 = time.perf_counter()
    stats = model.mtp_stats if impl == "ours-mtp" else None
    return {
        "impl": impl,
        "prompt": int(ids.shape[1]),
        "new": new_tokens,
        "prefill_s": streamer.times[0] - t0,
        "tok_per_s": (new_tokens - 1) / (t1 - streamer.times[0]),
        "acceptance": stats,
        "tokens": out[0, ids.shape[1]:].tolist(),
    }


def run_mtp(args) -> int:
    """The ``--mtp`` report (see the module docstring)."""
    def one(impl, folder, prompt_len):
        cmd = [sys.executable, __file__, "--new", str(args.new), "--mem-gib", str(args.mem_gib), "--mtp-worker",
               impl, folder, str(prompt_len)]
        return run_child(cmd, args.timeout, {"impl": impl})

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            cases = [(args.model, 0, os.path.basename(os.path.normpath(args.model)))]
        else:
            # in a child process: torch's threads in this one would compete with the first timed worker
            subprocess.run([sys.executable, __file__, "--make-mtp-weights", tmp], check=True, capture_output=True)
            cases = [(tmp, p, "random") for p in args.prompts]
        for folder, prompt_len, name in cases:
            runs = {impl: [] for impl in MTP_IMPLS}
            for _ in range(args.repeats):  # interleaved; the median run of each is reported
                for impl in MTP_IMPLS:
                    runs[impl].append(one(impl, folder, prompt_len))
            picked = []
            for impl in MTP_IMPLS:
                ok = sorted((r for r in runs[impl] if "failed" not in r), key=lambda r: r["tok_per_s"])
                picked.append(ok[(len(ok) - 1) // 2] if ok else runs[impl][0])
                print(f"  {name} {impl}: tokens/s " + " ".join(
                    r.get("failed") or f"{r['tok_per_s']:.1f}" for r in runs[impl]), flush=True)
            rows.append((name, *picked))
    print(f"\nMTP speculative decoding (ours, eager, DynamicCache, fp32, batch 1, {args.new} new tokens, "
          f"{os.environ.get('BENCH_THREADS', '2')} threads, median of {args.repeats} interleaved run(s))")
    print("| model | prompt | plain tokens/s | use_mtp tokens/s | speed-up | acceptance (accepted/drafted) "
          "| same tokens as plain |")
    print("|---|---|---|---|---|---|---|")
    for name, plain, mtp in rows:
        if "failed" in plain or "failed" in mtp:
            print(f"| {name} | - | {plain.get('failed', '')} | {mtp.get('failed', '')} | - | - | - |")
            continue
        acc = mtp["acceptance"]
        print(f"| {name} | {plain['prompt']} | {plain['tok_per_s']:.1f} | {mtp['tok_per_s']:.1f} | "
              f"{mtp['tok_per_s'] / plain['tok_per_s']:.2f}x | {acc['acceptance_rate']:.2f} "
              f"({acc['accepted']}/{acc['drafted']}) | {'yes' if plain['tokens'] == mtp['tokens'] else 'NO'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r for row in rows for r in row[1:]], f, indent=1)
    return 0


def run_worker(impl: str, folder: str, prompt_len: int, args) -> dict:
    """One worker process; a failed run comes back as ``{"failed": "OOM" | "timeout" | "error"}``."""
    cmd = [sys.executable, __file__, "--new", str(args.new), "--mem-gib", str(args.mem_gib), "--worker", impl, folder,
           str(prompt_len)]
    return run_child(cmd, args.timeout, {"impl": impl, "prompt": prompt_len})


def _ms(res) -> str:
    if res is None:
        return "-"
    return res["failed"] if "failed" in res else f"{res['ms_per_token']:.2f}"


def _ratio(slow, fast) -> str:
    """Per-token time of ``slow`` over ``fast`` as ``N.Nx``, or ``-`` when either is missing or failed."""
    if not slow or not fast or "failed" in slow or "failed" in fast:
        return "-"
    return f"{slow['ms_per_token'] / fast['ms_per_token']:.1f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096, 16384], help="prompt lengths")
    parser.add_argument("--new", type=int, default=32, help="generated tokens (at least 2)")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--repeats", type=int, default=1, help="runs per implementation and prompt (median)")
    parser.add_argument("--mem-gib", type=float, default=20.0, help="address-space cap per worker (GiB; 0: none)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker before it is stopped")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--mtp", action="store_true",
                        help="report MTP speculative decoding (use_mtp=True) against plain greedy instead of the table")
    parser.add_argument("--model", help="with --mtp: a model folder (e.g. glm53flash-finetune's output) instead of "
                                        "the random model")
    parser.add_argument("--worker", nargs=3, metavar=("IMPL", "FOLDER", "PROMPT"), help=argparse.SUPPRESS)
    parser.add_argument("--mtp-worker", nargs=3, metavar=("IMPL", "FOLDER", "PROMPT"), help=argparse.SUPPRESS)
    parser.add_argument("--make-mtp-weights", metavar="FOLDER", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_mtp_weights:
        make_mtp_weights(args.make_mtp_weights)
        return 0
    if args.new < 2:
        parser.error(f"--new must be >= 2 (the per-token time is measured between generated tokens); got {args.new}")
    if args.model and not args.mtp:
        parser.error("--model is only used with --mtp")
    if args.model and not os.path.isfile(os.path.join(args.model, "config.json")):
        parser.error(f"--model must be a folder with a config.json; got {args.model!r}")
    if args.worker:
        impl, folder, prompt_len = args.worker
        print(json.dumps(worker(impl, folder, int(prompt_len), args.new, args.mem_gib)))
        return 0
    if args.mtp_worker:
        impl, folder, prompt_len = args.mtp_worker
        print(json.dumps(mtp_worker(impl, folder, int(prompt_len), args.new, args.mem_gib)))
        return 0
    if args.mtp:
        return run_mtp(args)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1; got {args.repeats}")

    runs: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory() as folder:
        make_weights(folder)
        for prompt_len in args.prompts:
            for _ in range(args.repeats):
                for impl in args.impls:
                    res = run_worker(impl, folder, prompt_len, args)
                    runs.setdefault((impl, prompt_len), []).append(res)
                    if "failed" in res:
                        print(f"  {impl:13s} prompt {prompt_len:5d}: {res['failed']}", flush=True)
                        continue
                    extra = f", compile run {res['compile_s']:.0f} s" if res["compile_s"] is not None else ""
                    print(f"  {impl:13s} prompt {prompt_len:5d}: prefill {res['prefill_s']:.2f} s, decode "
                          f"{res['ms_per_token']:.2f} ms/token ({res['tok_per_s']:.1f} tokens/s){extra}", flush=True)

    def median(key):
        rs = [r for r in runs.get(key, []) if "failed" not in r]
        if not rs:
            return runs[key][0] if runs.get(key) else None
        return sorted(rs, key=lambda r: r["ms_per_token"])[(len(rs) - 1) // 2]

    results = {key: median(key) for key in runs}
    print(f"\n{args.new} new tokens, fp32, {os.environ.get('BENCH_THREADS', '2')} threads, batch 1, median of "
          f"{args.repeats} run(s); decode time per token (ms)")
    print("| prompt | transformers eager | transformers compiled | ours eager | ours compiled "
          "| ours eager vs transformers eager | ours compiled vs transformers compiled | ours compiled vs ours eager "
          "| prefill transformers / ours (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in args.prompts:
        hf, hfc, ours, oursc = (results.get((i, p)) for i in ("hf", "hf-compiled", "ours", "ours-compiled"))
        pre = "-"
        if hf and ours and "failed" not in hf and "failed" not in ours:
            pre = f"{hf['prefill_s']:.2f} / {ours['prefill_s']:.2f}"
        print(f"| {p} | {_ms(hf)} | {_ms(hfc)} | {_ms(ours)} | {_ms(oursc)} | {_ratio(hf, ours)} | "
              f"{_ratio(hfc, oursc)} | {_ratio(ours, oursc)} | {pre} |")
    first, last = args.prompts[0], args.prompts[-1]
    for impl in IMPLS:
        a, b = results.get((impl, first)), results.get((impl, last))
        if a and b and "failed" not in a and "failed" not in b:
            print(f"{impl}: per-token time at prompt {last} / at {first}: {b['ms_per_token'] / a['ms_per_token']:.2f}")
    for p in args.prompts:
        done = {i: results.get((i, p)) for i in IMPLS}
        done = {i: r for i, r in done.items() if r and "failed" not in r}
        if len(done) > 1:
            ref_impl, ref = next(iter(done.items()))
            same = ", ".join(f"{i} {sum(x == y for x, y in zip(r['tokens'], ref['tokens']))}/{args.new}"
                             for i, r in done.items() if i != ref_impl)
            print(f"prompt {p}: same greedy tokens as {ref_impl}: {same}")
    print("all runs, ms/token: " + "; ".join(
        f"{i} {p}: " + " ".join(_ms(r) for r in rs) for (i, p), rs in runs.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r for rs in runs.values() for r in rs], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
