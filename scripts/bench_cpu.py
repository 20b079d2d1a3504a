#!/usr/bin/env python
"""CPU benchmark: glm53flash-hf vs transformers' built-in glm5_next, same weights, forward+backward, eager and compiled.

Wide tiny config: hidden 256, 4 layers (3 KDA + 1 DSA), 8 routed experts, index_kpool 4, index_topk 256, fp32.
The reference (``Glm5NextForConditionalGeneration``, eager attention) writes the weights with ``save_pretrained``
and both models load that folder. Implementations: ``hf`` and ``ours`` (eager), ``hf-compiled`` and
``ours-compiled`` (``torch.compile(model, dynamic=False)``, inductor; ours with ``fullgraph=True``, the built-in
with graph breaks allowed). A compiled run's first step compiles and is reported apart (``compile_s``); the timed
steps follow it.

Each (implementation, sequence length) runs in its own process, so the peak resident memory (``ru_maxrss``) of one
run is not hidden by another; the reported memory is that peak minus the resident memory just before the first
forward (model, inputs and libraries excluded; a compiled run's peak includes compiling). A worker's address space
is capped (``--mem-gib``, default 20 on a 24 GiB machine), so a run that needs more fails with an allocation error
and is reported as OOM instead of swapping; a worker still running after ``--timeout`` seconds is reported as a
timeout, and an implementation that failed at one length is not run at the longer ones.

MFU-style figure: the model FLOPs of one step are the matrix-multiply FLOPs of one eager forward of ours
(``torch.utils.flop_counter.FlopCounterMode``, no activation recompute) times 3 (forward + backward); the script
divides them by the step time and by this machine's fp32 GEMM throughput, measured in the same run
(``torch.mm`` of two 2048x2048 fp32 matrices with the benchmark's thread count).

Long context (issue "long context"): ``--grad-ckpt`` turns on gradient checkpointing (transformers'
``gradient_checkpointing_enable``, non-reentrant) in both implementations; ``--docs N`` packs ``N`` equal documents
into the row (``position_ids`` restarting at each; the built-in takes the same input but does not separate them);
``--live`` runs one more step, untimed, under a ``TorchDispatchMode`` that records the high-water of the bytes of the
storages the ops return (``bench_sp._LiveTensors``: activations, saved tensors, gradients, temporaries), printed
beside the resident peak of the timed steps (both without the model and inputs) as resident / live.

Heap policy (``--malloc``): ``default`` leaves glibc's malloc as it is; ``reuse`` and ``bounded`` apply
:func:`glm53flash_hf.train.malloc.set_malloc_policy` in every worker before its model loads, for both implementations
alike (``reuse``: freed large blocks are kept for the next step; ``bounded``: every block of 2 MiB or more is its own
mapping, returned on free). Those two also give torch's large blocks transparent huge pages unless the environment
sets ``THP_MEM_ALLOC_ENABLE`` (``=0``: off; the workers inherit it), and the table says whether they were in use.
Page faults per step are the timed steps' minor faults.

Usage::

    python scripts/bench_cpu.py                      # S = 2048 8192 32768, all four implementations
    python scripts/bench_cpu.py --seqlens 512 --repeats 1 --impls hf ours
    python scripts/bench_cpu.py --seqlens 8192 --impls hf ours --malloc reuse
    python scripts/bench_cpu.py --seqlens 32768 131072 --impls ours --grad-ckpt --live --repeats 1
    python scripts/bench_cpu.py --seqlens 8192 32768 --impls ours --grad-ckpt --live --malloc bounded
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

# transformers' glm5_next binds fla-core's Triton kernels at import when fla is installed (the [gpu] or [test] extra),
# and those fail on CPU tensors ("0 active drivers"): hide fla so the reference runs its torch path.
if "fla" not in sys.modules:
    sys.modules["fla"] = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from _common import WIDE_TEXT, cap_address_space, load, make_weights, run_child  # noqa: E402


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


IMPLS = ("hf", "ours", "hf-compiled", "ours-compiled")


def gemm_flops_per_s(threads: int, n: int = 2048, repeats: int = 10) -> float:
    """fp32 ``torch.mm`` throughput of this machine (FLOP/s) for two ``[n, n]`` matrices, best of ``repeats``."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def worker(impl: str, folder: str, seq_len: int, repeats: int, mem_gib: float, malloc: str = "default",
           grad_ckpt: bool = False, docs: int = 1, live: bool = False) -> dict:
    cap_address_space(mem_gib)
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from glm53flash_hf.train.malloc import huge_pages_in_use, set_malloc_policy

    set_malloc_policy(malloc)
    huge_pages = huge_pages_in_use()

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model = load(impl, folder).train()
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, WIDE_TEXT["vocab_size"], (1, seq_len), generator=gen)
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    if docs > 1:
        inputs["position_ids"] = (torch.arange(seq_len) % -(-seq_len // docs))[None]
    call = model
    if impl.endswith("-compiled"):
        call = torch.compile(model, fullgraph=impl.startswith("ours"), dynamic=False)

    def step():
        model.zero_grad(set_to_none=True)
        out = call(**inputs)
        out.loss.backward()
        return out.loss.item()

    base = _rss_kib()  # before any forward: on the reuse heap, memory a forward frees stays resident
    flops = None
    if impl == "ours":
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            model(**inputs)
        flops = 3 * counter.get_total_flops()

    compile_s = None
    if impl.endswith("-compiled"):
        t0 = time.perf_counter()
        step()
        compile_s = time.perf_counter() - t0
    times = []
    loss = None
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    peak, faults = usage.ru_maxrss, (usage.ru_minflt - faults) / repeats
    live_mib = None
    if live:
        from bench_sp import _LiveTensors

        tracker = _LiveTensors()
        with tracker.mode:
            step()
        live_mib = tracker.peak / 2**20
    return {"impl": impl, "seq_len": seq_len, "time_s": statistics.median(times), "times": times,
            "compile_s": compile_s, "peak_mib": (peak - base) / 1024, "loss": loss, "model_flops": flops,
            "malloc": malloc, "grad_ckpt": grad_ckpt, "docs": docs, "live_mib": live_mib,
            "faults_per_step": faults, "huge_pages": huge_pages}


def run_worker(impl: str, folder: str, seq_len: int, args) -> dict:
    """One worker process; a failed run comes back as ``{"failed": "OOM" | "timeout" | "error"}``."""
    cmd = [sys.executable, __file__, "--repeats", str(args.repeats), "--mem-gib", str(args.mem_gib), "--malloc",
           args.malloc, "--docs", str(args.docs), "--worker", impl, folder, str(seq_len)]
    cmd += ["--grad-ckpt"] * args.grad_ckpt + ["--live"] * args.live
    return run_child(cmd, args.timeout, {"impl": impl, "seq_len": seq_len})


def _cell(res, key, fmt):
    if res is None:
        return "-"
    if "failed" in res:
        return res["failed"]
    return fmt.format(res[key]) if res.get(key) is not None else "-"


def _ratio(a, b):
    """``a / b`` of two runs' times as ``N.Nx``, or ``-`` when either is missing or failed."""
    if not a or not b or "failed" in a or "failed" in b:
        return "-"
    return f"{a['time_s'] / b['time_s']:.1f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192, 32768], help="sequence lengths")
    parser.add_argument("--repeats", type=int, default=2, help="timed forward+backward steps per run (median)")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--mem-gib", type=float, default=20.0, help="address-space cap per worker (GiB; 0: none)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker before it is stopped")
    parser.add_argument("--malloc", choices=("default", "reuse", "bounded"), default="default",
                        help="heap policy of every worker, both implementations (default: %(default)s)")
    parser.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing in both implementations")
    parser.add_argument("--docs", type=int, default=1, help="equal packed documents per row (default: %(default)s)")
    parser.add_argument("--live", action="store_true", help="one more step recording the peak of live tensors")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--worker", nargs=3, metavar=("IMPL", "FOLDER", "SEQ_LEN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        impl, folder, seq_len = args.worker
        print(json.dumps(worker(impl, folder, int(seq_len), args.repeats, args.mem_gib, args.malloc, args.grad_ckpt,
                                args.docs, args.live)))
        return 0

    threads = int(os.environ.get("BENCH_THREADS", "2"))
    peak_flops = gemm_flops_per_s(threads)
    print(f"fp32 GEMM throughput (2048^2 torch.mm, {threads} threads): {peak_flops / 1e9:.1f} GFLOP/s; "
          f"heap policy of the workers: {args.malloc}; gradient checkpointing: {args.grad_ckpt}; documents per row: "
          f"{args.docs}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        make_weights(folder)
        for seq_len in args.seqlens:
            for impl in args.impls:
                shorter = [r for (i, s), r in results.items() if i == impl and s < seq_len and "failed" in r]
                if shorter:  # a run that failed at a shorter length (OOM, timeout) is not retried at a longer one
                    res = {"impl": impl, "seq_len": seq_len, "failed": f"{shorter[-1]['failed']} (at a shorter S)"}
                else:
                    res = run_worker(impl, folder, seq_len, args)
                results[(impl, seq_len)] = res
                if "failed" in res:
                    print(f"  {impl:13s} S={seq_len:5d}: {res['failed']}", flush=True)
                    continue
                extra = f"  compile {res['compile_s']:.1f} s" if res.get("compile_s") is not None else ""
                if res.get("live_mib") is not None:
                    ratio = res["peak_mib"] / res["live_mib"]
                    extra += f"  live {res['live_mib']:.0f} MiB (resident / live {ratio:.2f})"
                print(f"  {impl:13s} S={seq_len:5d}: {res['time_s']:.3f} s  peak +{res['peak_mib']:.0f} MiB  "
                      f"loss {res['loss']:.5f}{extra}", flush=True)

    print("\n| S | transformers eager (s) | transformers compiled (s) | ours eager (s) | ours compiled (s) "
          "| ours eager vs transformers eager | ours compiled vs ours eager | ours compiled vs transformers compiled "
          "| transformers peak (MiB) | ours peak (MiB) | ours compiled peak (MiB) | ours MFU eager / compiled |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for seq_len in args.seqlens:
        hf, hfc = results.get(("hf", seq_len)), results.get(("hf-compiled", seq_len))
        ours, oursc = results.get(("ours", seq_len)), results.get(("ours-compiled", seq_len))
        mfu = "-"
        if ours and "failed" not in ours and ours.get("model_flops"):
            eager = ours["model_flops"] / ours["time_s"] / peak_flops
            comp = "-"
            if oursc and "failed" not in oursc:
                comp = f"{ours['model_flops'] / oursc['time_s'] / peak_flops:.1%}"
            mfu = f"{eager:.1%} / {comp}"
        print(f"| {seq_len} | {_cell(hf, 'time_s', '{:.3f}')} | {_cell(hfc, 'time_s', '{:.3f}')} | "
              f"{_cell(ours, 'time_s', '{:.3f}')} | {_cell(oursc, 'time_s', '{:.3f}')} | {_ratio(hf, ours)} | "
              f"{_ratio(ours, oursc)} | {_ratio(hfc, oursc)} | {_cell(hf, 'peak_mib', '{:.0f}')} | "
              f"{_cell(ours, 'peak_mib', '{:.0f}')} | {_cell(oursc, 'peak_mib', '{:.0f}')} | {mfu} |")
    print("\nmodel FLOPs per step (ours, 3x one forward's matmul FLOPs): "
          + ", ".join(f"S={s}: {r['model_flops'] / 1e9:.1f} GFLOP" for (i, s), r in results.items()
                      if i == "ours" and r and r.get("model_flops")))
    print("\n| impl | S | ms / token | resident peak (MiB) | live peak (MiB) | resident / live | page faults / step "
          "| huge pages |")
    print("|---|---|---|---|---|---|---|---|")
    for (impl, seq_len), r in results.items():
        if r and "failed" not in r:
            live_mib = r.get("live_mib")
            ratio = f"{r['peak_mib'] / live_mib:.2f}" if live_mib else "-"
            print(f"| {impl} | {seq_len} | {1e3 * r['time_s'] / seq_len:.3f} | {r['peak_mib']:.0f} | "
                  f"{'-' if live_mib is None else f'{live_mib:.0f}'} | {ratio} | {r['faults_per_step']:.0f} | "
                  f"{ {True: 'on', False: 'off', None: '-'}[r['huge_pages']]} |")
    print("compile time of the first step (s): "
          + ", ".join(f"{i} S={s}: {r['compile_s']:.0f}" for (i, s), r in results.items()
                      if r and r.get("compile_s") is not None))
    print("losses: " + ", ".join(f"{i} S={s}: {r['loss']:.5f}" for (i, s), r in results.items()
                                 if r and r.get("loss") is not None))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gemm_flops_per_s": peak_flops, "malloc": args.malloc, "runs": list(results.values())}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
