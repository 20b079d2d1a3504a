#!/usr/bin/env python
"""GPU benchmark per operator family: forward+backward time and peak memory of transformers' built-in glm5_next
module, of ours with ``kernels={family: "fused"}``, of our kernel entry point and of the raw kernel alone, at 8k and
32k tokens.

Families and what each variant runs (bf16, batch 1, release sizes from ``gpu_modules.py``, the same weights everywhere):

* kda -- hf: ``Glm5NextTextLinearAttention`` (its torch reference: fla is hidden while transformers binds it);
  ours: ``Glm53FlashLinearAttention``; entry: ``kda_fused.chunk_kda_fused`` (CPU: ``kda_ops.chunk_kda_torch``); raw:
  fla's ``chunk_kda``.
* dsa -- hf: ``Glm5NextTextAttention`` (SDPA over the dense top-k mask); ours: ``Glm53FlashAttention``;
  entry: ``dispatch.op_for(dsa_ops.sparse_mla_torch, "fused", ...)``; raw: ``dsa_fused.sparse_mla_fused``; the
  selection is our indexer's on the same input.
* mhc -- hf: ``Glm5NextTextHyperConnection`` + the decoder layer's hc_post expression; ours:
  ``Glm53FlashHyperConnection`` + ``hc_post``; entry: ``op_for`` of ``hc_pre_torch``/``hc_post_torch``, "fused";
  raw: ``mhc_fused.hc_pre_fused`` + ``hc_post_fused``.
* moe -- hf: ``Glm5NextTextMoE`` with experts implementation "grouped_mm" (transformers' default inside a model);
  ours: ``Glm53FlashMoE``; entry: ``op_for(moe_ops.experts_forward_torch, "fused")``; raw: grouped_mm + our SwiGLU and
  combine kernels, routing metadata prepared outside the timing.

``ours_torch`` (our module with ``kernels="torch"``) runs up to ``--torch-max-seq`` tokens. One call of a variant =
forward + backward from a random output gradient; gradients are dropped (set to ``None``) between calls, outside the
timed region. Time: CUDA events, ``--warmup`` untimed calls (Triton compilation and fla's autotuning happen there),
the median of ``--repeats`` timed calls. Memory: the peak of ``torch.cuda.max_memory_allocated`` during a call minus
the memory allocated just before it (weights, inputs excluded). An out-of-memory error is reported as ``OOM`` (the
built-in's dense DSA keeps ``[S, S]`` masks and ``[S, 32, S/4]`` fp32 indexer scores); any other error is reported
with its type and the run goes on. "fused" requests that fall back to torch are reported in the notes.

Each (family, S) also carries ``predicted_ms``: :func:`gpu_cost.family_cost`'s roofline (the datasheet of the device
in use: H100 or, for any other name, H200) of the kernels the
``raw`` variant launches (forward + backward, ``scripts/gpu_cost.py``); the report shows it and ``raw / predicted``,
and the progress lines of ``raw`` and ``entry`` print ``measured/predicted``, so a GPU run checks the model too.

Targets checked in the report: KDA module >= 10x and mHC >= 4x faster than the built-in; DSA at 32k >= 5x
faster with peak memory linear in S (peak ratio between the longest and the shortest run <= their length ratio *
1.25; 32k/8k: <= 5); our entry point's overhead over the raw kernel <= 15%.

Usage::

    python scripts/bench_gpu.py --report gpu-report/bench.md --json gpu-report/bench.json
    python scripts/bench_gpu.py --smoke --report /tmp/smoke.md   # CPU, tiny shapes, torch paths, one repeat
    python scripts/bench_gpu.py --families kda dsa --seqs 8192 --budget-s 120

``--smoke`` runs every variant that can run on CPU (hf, ours, ours_torch, entry, with "fused" falling back to torch)
at tiny shapes so that the script is exercised by ``tests/test_bench_gpu.py``; the raw kernels need CUDA there.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

# transformers' glm5_next binds fla's chunk_kda at import when fla is importable. We want its torch reference (the
# built-in as it runs without fla, and the only one that runs on CPU), so fla is hidden while it is imported, then
# made importable again for our fused KDA path.
_FLA_HIDDEN = "fla" not in sys.modules
if _FLA_HIDDEN:
    sys.modules["fla"] = None
import gpu_cost  # noqa: E402
from gpu_modules import RELEASE_TEXT, TINY_TEXT, randomize_, to_model_dtypes_  # noqa: E402
from transformers.models.glm5_next import modeling_glm5_next as hf  # noqa: E402

from glm53flash_hf import dispatch, dsa, dsa_ops, kda, mhc, mhc_ops, modeling_glm53flash, moe_ops  # noqa: E402
from glm53flash_hf.configuration_glm53flash import Glm53FlashTextConfig  # noqa: E402
from glm53flash_hf.packing import build_document_layout  # noqa: E402

if _FLA_HIDDEN:
    del sys.modules["fla"]

FAMILIES = ("kda", "mhc", "dsa", "moe")
VARIANTS = ("hf", "ours", "ours_torch", "entry", "raw")

# ------------------------------------------------------------------------------------------------------- set-up
def make_config(sizes: dict, kernels: str | dict, attn: str | None = None, experts: str | None = None):
    config = Glm53FlashTextConfig(**sizes, kernels=kernels)
    if attn is not None:
        config._attn_implementation = attn
    if experts is not None:
        config._experts_implementation = experts
    return config


def build_pair(ours_cls, hf_cls, sizes, family, device, dtype, seed, *, hf_config_kw=None, ctor_args=()):
    """(ours fused, ours torch, hf) modules with one set of weights."""
    with torch.device(device):
        ours = ours_cls(make_config(sizes, {family: "fused"}), *ctor_args)
        randomize_(ours, seed)
        to_model_dtypes_(ours, dtype)
        ours_torch = to_model_dtypes_(ours_cls(make_config(sizes, "torch"), *ctor_args), dtype)
        hf_mod = to_model_dtypes_(hf_cls(make_config(sizes, "torch", **(hf_config_kw or {})), *ctor_args), dtype)
    ours_torch.load_state_dict(ours.state_dict(), strict=True)
    hf_mod.load_state_dict(ours.state_dict(), strict=True)
    return ours, ours_torch, hf_mod


def rand(shape, device, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


class Case:
    """One (family, S): ``run[variant]`` are zero-argument callables doing forward + backward; ``leaves`` lists the
    tensors (inputs and parameters) whose ``.grad`` is dropped between calls."""

    def __init__(self):
        self.run: dict = {}
        self.leaves: list = []
        self.skip: dict = {}


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.is_floating_point())


def case_kda(sizes, seq, device, dtype, with_torch):
    c = Case()
    ours, ours_t, hf_mod = build_pair(kda.Glm53FlashLinearAttention, hf.Glm5NextTextLinearAttention, sizes, "kda",
                                      device, dtype, seed=1, ctor_args=(0,))
    gen = torch.Generator(device=device).manual_seed(21)
    hidden, heads, dim = sizes["hidden_size"], sizes["linear_num_heads"], sizes["linear_head_dim"]
    x, go = leaf(rand((1, seq, hidden), device, dtype, gen)), rand((1, seq, hidden), device, dtype, gen)
    layout = build_document_layout(1, seq, device)
    c.run["hf"] = lambda: hf_mod(hidden_states=x).backward(go)
    c.run["ours"] = lambda: ours(x, layout)[0].backward(go)
    if with_torch:
        c.run["ours_torch"] = lambda: ours_t(x, layout)[0].backward(go)
    q, k, v = (leaf(rand((1, seq, heads, dim), device, dtype, gen)) for _ in range(3))
    g = leaf(-5.0 * torch.sigmoid(rand((1, seq, heads, dim), device, torch.float32, gen)))
    beta = leaf(torch.sigmoid(rand((1, seq, heads), device, torch.float32, gen)))
    go_core = rand((1, seq, heads, dim), device, dtype, gen)
    if device.type == "cuda":
        from glm53flash_hf.kda_fused import chunk_kda_fused as entry
    else:
        from glm53flash_hf.kda_ops import chunk_kda_torch as entry
    c.run["entry"] = lambda: entry(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0].backward(go_core)
    if device.type == "cuda":
        from fla.ops.kda import chunk_kda

        c.run["raw"] = lambda: chunk_kda(q=q, k=k, v=v, g=g, beta=beta,
                                         use_qk_l2norm_in_kernel=True)[0].backward(go_core)
    else:
        c.skip["raw"] = "n/a: fla's kernels need CUDA"
    c.leaves = [x, q, k, v, g, beta, *ours.parameters(), *ours_t.parameters(), *hf_mod.parameters()]
    return c


def case_dsa(sizes, seq, device, dtype, with_torch):
    c = Case()
    ours, ours_t, hf_mod = build_pair(dsa.Glm53FlashAttention, hf.Glm5NextTextAttention, sizes, "dsa", device, dtype,
                                      seed=2, hf_config_kw=dict(attn="sdpa"), ctor_args=(3,))
    gen = torch.Generator(device=device).manual_seed(22)
    hidden, heads, rank = sizes["hidden_size"], sizes["num_attention_heads"], sizes["kv_lora_rank"]
    x, go = leaf(rand((1, seq, hidden), device, dtype, gen)), rand((1, seq, hidden), device, dtype, gen)
    layout = build_document_layout(1, seq, device)
    mask = torch.ones(1, seq, dtype=torch.bool, device=device)
    c.run["hf"] = lambda: hf_mod(hidden_states=x, attention_mask=mask)[0].backward(go)
    c.run["ours"] = lambda: ours(x, layout)[0].backward(go)
    if with_torch:
        c.run["ours_torch"] = lambda: ours_t(x, layout)[0].backward(go)
    with torch.no_grad():  # a realistic selection: our indexer on these weights and inputs
        indices = ours.indexer(x, ours.q_a_layernorm(ours.q_a_proj(x)), layout)
    q_abs = leaf(rand((1, seq, heads, rank), device, dtype, gen))
    latent = leaf(rand((1, seq, rank), device, dtype, gen))
    go_core = rand((1, seq, heads, rank), device, dtype, gen)
    scale = sizes["qk_nope_head_dim"] ** -0.5
    c.run["entry"] = lambda: dispatch.op_for(dsa_ops.sparse_mla_torch, "fused", q_abs, latent, indices)(
        q_abs, latent, indices, scale)[0].backward(go_core)
    if device.type == "cuda":
        from glm53flash_hf.dsa_fused import sparse_mla_fused

        c.run["raw"] = lambda: sparse_mla_fused(q_abs=q_abs, latent=latent, indices=indices,
                                                scale=scale)[0].backward(go_core)
    else:
        c.skip["raw"] = "n/a: the Triton kernel needs CUDA"
    c.leaves = [x, q_abs, latent, *ours.parameters(), *ours_t.parameters(), *hf_mod.parameters()]
    return c


def case_mhc(sizes, seq, device, dtype, with_torch):
    c = Case()
    ours, ours_t, hf_mod = build_pair(mhc.Glm53FlashHyperConnection, hf.Glm5NextTextHyperConnection, sizes, "mhc",
                                      device, dtype, seed=3)
    gen = torch.Generator(device=device).manual_seed(23)
    n, hidden = sizes["hc_mult"], sizes["hidden_size"]
    streams = leaf(rand((1, seq, n, hidden), device, dtype, gen))
    go = rand((1, seq, n, hidden), device, dtype, gen)
    kw = dict(sinkhorn_iters=sizes["hc_sinkhorn_iters"], hc_eps=sizes["hc_eps"], norm_eps=sizes["rms_norm_eps"])

    def hf_site():
        post, comb, col = hf_mod(streams)
        dt = streams.dtype  # Glm5NextTextDecoderLayer.forward's hc_post expression
        out = post.to(dt).unsqueeze(-1) * col.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), streams)
        out.backward(go)

    def ours_site(module, backend):
        post, comb, col = module(streams)
        dispatch.op_for(mhc_ops.hc_post_torch, backend, col, streams, post, comb)(col, streams, post, comb).backward(go)

    def entry_site():
        args = (streams, ours.fn, ours.base, ours.scale)
        post, comb, col = dispatch.op_for(mhc_ops.hc_pre_torch, "fused", *args)(*args, **kw)
        dispatch.op_for(mhc_ops.hc_post_torch, "fused", col, streams, post, comb)(col, streams, post, comb).backward(go)

    c.run["hf"] = hf_site
    c.run["ours"] = lambda: ours_site(ours, dispatch.requested_backend(ours.config, "mhc"))
    if with_torch:
        c.run["ours_torch"] = lambda: ours_site(ours_t, "torch")
    c.run["entry"] = entry_site
    if device.type == "cuda":
        from glm53flash_hf.mhc_fused import hc_post_fused, hc_pre_fused

        def raw_site():
            post, comb, col = hc_pre_fused(streams, ours.fn, ours.base, ours.scale, **kw)
            hc_post_fused(col, streams, post, comb).backward(go)

        c.run["raw"] = raw_site
    else:
        c.skip["raw"] = "n/a: the Triton kernels need CUDA"
    c.leaves = [streams, *ours.parameters(), *ours_t.parameters(), *hf_mod.parameters()]
    return c


def case_moe(sizes, seq, device, dtype, with_torch):
    c = Case()
    ours, ours_t, hf_mod = build_pair(modeling_glm53flash.Glm53FlashMoE, hf.Glm5NextTextMoE, sizes, "moe", device,
                                      dtype, seed=4, hf_config_kw=dict(experts="grouped_mm"))
    gen = torch.Generator(device=device).manual_seed(24)
    hidden = sizes["hidden_size"]
    x, go = leaf(rand((1, seq, hidden), device, dtype, gen)), rand((1, seq, hidden), device, dtype, gen)
    c.run["hf"] = lambda: hf_mod(x).backward(go)
    c.run["ours"] = lambda: ours(x).backward(go)
    if with_torch:
        c.run["ours_torch"] = lambda: ours_t(x).backward(go)
    with torch.no_grad():
        _, weights, ids = ours.gate(x)
    weights = leaf(weights)
    tokens = leaf(x.detach().reshape(seq, hidden))
    experts = ours.experts
    limit = sizes["swiglu_limit"]
    go_tok = go.reshape(seq, hidden)
    expert_weights = (experts.gate_up_proj, experts.down_proj)
    c.run["entry"] = lambda: dispatch.op_for(moe_ops.experts_forward_torch, "fused", tokens, *expert_weights, weights)(
        tokens, ids, weights, *expert_weights, limit).backward(go_tok)
    if device.type == "cuda":
        from glm53flash_hf import moe_fused

        _, token_of_row, offsets, row_w = moe_ops.routing_metadata(ids, weights.detach(), sizes["n_routed_experts"])
        token_rows = moe_fused.rows_by_token(token_of_row, ids.shape[1])
        rows = leaf(tokens.detach().index_select(0, token_of_row))
        row_w = leaf(row_w)

        def raw_site():
            gate_up = moe_ops.grouped_mm(rows, experts.gate_up_proj.transpose(-2, -1), offsets)
            act = moe_fused.clamped_swiglu_fused(gate_up, limit)
            out_rows = moe_ops.grouped_mm(act, experts.down_proj.transpose(-2, -1), offsets)
            moe_fused.weighted_combine_fused(out_rows, row_w, token_rows, token_of_row,
                                             out_dtype=dtype).backward(go_tok)

        c.run["raw"] = raw_site
        c.leaves += [rows, row_w]
    else:
        c.skip["raw"] = "n/a: the Triton kernels need CUDA"
    c.leaves += [x, tokens, weights, *ours.parameters(), *ours_t.parameters(), *hf_mod.parameters()]
    return c


CASES = {"kda": case_kda, "dsa": case_dsa, "mhc": case_mhc, "moe": case_moe}


# ------------------------------------------------------------------------------------------------------- timing
def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def measure(fn, leaves, device, warmup: int, repeats: int) -> dict:
    """Median time (ms) and peak extra memory (GiB) of ``fn``; see the module docstring."""
    cuda = device.type == "cuda"

    def clear():
        for t in leaves:
            t.grad = None

    times, peaks = [], []
    for i in range(warmup + repeats):
        clear()
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        else:
            t0 = time.perf_counter()
            fn()
            elapsed = (time.perf_counter() - t0) * 1e3
            peak = None
        if i >= warmup:
            times.append(elapsed)
            peaks.append(peak)
    clear()
    return dict(ms=statistics.median(times), peak_gib=None if peaks[0] is None else max(peaks))


def run_variant(name, fn, leaves, device, warmup, repeats) -> dict:
    dispatch._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = measure(fn, leaves, device, warmup, repeats)
        except Exception as exc:  # reported, the benchmark goes on
            if is_oom(exc):
                result = dict(status="OOM")
            else:
                traceback.print_exc()
                result = dict(status=f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    fallbacks = sorted({str(w.message) for w in caught if "cannot run" in str(w.message)})
    if fallbacks:
        result["fallback"] = fallbacks
    result.setdefault("status", "ok")
    return result


def free_memory(device, collect: bool = False):
    """Return cached GPU blocks; ``collect`` also runs the (slow: ~0.5 s with transformers loaded) cycle collector,
    needed after an exception, whose traceback keeps the failed call's tensors alive."""
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------------- report
def fmt_ms(r):
    """Milliseconds, ``OOM``, ``error: ...``; ``n/a`` for a variant that cannot run here, ``-`` for one not run."""
    if not r:
        return "-"
    if r.get("status") == "ok":
        return f"{r['ms']:.1f}"
    if "status" in r:
        return r["status"]
    return "n/a" if r.get("skip", "").startswith("n/a") else "-"


def fmt_gib(r):
    if r is None or r.get("status") != "ok" or r.get("peak_gib") is None:
        return "-"
    return f"{r['peak_gib']:.2f}"


def ratio(a, b):
    if a and b and a.get("status") == "ok" and b.get("status") == "ok" and b["ms"] > 0:
        return a["ms"] / b["ms"]
    return None


def fmt_pred(ms):
    """A predicted time: two decimals, or two significant digits below 0.01 ms (the smoke run's tiny shapes)."""
    return "-" if ms is None else (f"{ms:.2f}" if ms >= 0.01 else f"{ms:.2g}")


def measured_over_predicted(res, predicted_ms):
    """Measured ms of a variant over the roofline prediction, or None when either is missing."""
    if res and res.get("status") == "ok" and predicted_ms:
        return res["ms"] / predicted_ms
    return None


def roofline_device() -> dict:
    """``gpu_cost``'s datasheet entry for the CUDA device in use (H200 without one)."""
    return gpu_cost.device_for(torch.cuda.get_device_name() if torch.cuda.is_available() else "H200")


def predicted_ms(family: str, sizes: dict, seq: int) -> float:
    """``scripts/gpu_cost.py``'s prediction (ms) of the ``raw`` variant of ``family`` at ``seq`` tokens on the device
    in use (:func:`roofline_device`)."""
    config = Glm53FlashTextConfig(**sizes)
    return gpu_cost.total_ms(gpu_cost.family_cost(family, config, seq), roofline_device())


def targets(results: list[dict]) -> list[str]:
    by = {(r["family"], r["seq"]): r["variants"] for r in results}
    lines = []

    def speed(family, goal, seqs=None):
        for (fam, seq), v in sorted(by.items()):
            if fam != family or (seqs and seq not in seqs):
                continue
            x = ratio(v.get("hf"), v.get("ours"))
            state = "n/a" if x is None else ("met" if x >= goal else "NOT met")
            if x is None and v.get("hf", {}).get("status") == "OOM" and v.get("ours", {}).get("status") == "ok":
                state = "met (built-in OOM)"
            lines.append(f"- {family} S={seq}: ours vs built-in {'-' if x is None else f'{x:.1f}x'} "
                         f"(target >= {goal}x): {state}")

    speed("kda", 10)
    speed("mhc", 4)
    dsa_seqs = sorted(seq for fam, seq in by if fam == "dsa")
    if dsa_seqs:
        speed("dsa", 5, seqs={dsa_seqs[-1]})  # the target is at 32k, the longest run
    if len(dsa_seqs) >= 2:
        lo, hi = dsa_seqs[0], dsa_seqs[-1]
        a, b = by[("dsa", lo)].get("ours"), by[("dsa", hi)].get("ours")
        if a and b and a.get("status") == b.get("status") == "ok" and a.get("peak_gib") is not None:
            growth, allowed = b["peak_gib"] / max(a["peak_gib"], 1e-9), hi / lo * 1.25
            lines.append(f"- dsa peak memory S={hi} / S={lo}: {growth:.2f} (linear in S: <= {allowed:.1f}): "
                         f"{'met' if growth <= allowed else 'NOT met'}")
    for (fam, seq), v in sorted(by.items()):
        x = ratio(v.get("entry"), v.get("raw"))
        if x is not None:
            lines.append(f"- {fam} S={seq}: entry point overhead over the raw kernel {100 * (x - 1):+.1f}% "
                         f"(target <= 15%): {'met' if x <= 1.15 else 'NOT met'}")
    return lines


def write_report(path, results, header: dict):
    rows = ["| family | S | built-in ms | built-in GiB | ours ms | ours GiB | speed-up | ours torch ms | entry ms | "
            "raw ms | overhead | predicted ms | raw / predicted | notes |", "|" + "---|" * 14]
    for r in results:
        v = r["variants"]
        sp = ratio(v.get("hf"), v.get("ours"))
        ov = ratio(v.get("entry"), v.get("raw"))
        pred = r.get("predicted_ms")
        mp = measured_over_predicted(v.get("raw"), pred)
        notes = []
        for name in VARIANTS:
            res = v.get(name) or {}
            if res.get("fallback"):
                notes.append(f"{name}: fell back to torch ({'; '.join(res['fallback'])[:200]})")
            if res.get("skip") and name != "ours_torch":
                notes.append(f"{name}: {res['skip']}")
        if r.get("skipped"):
            notes.append(r["skipped"])
        rows.append("| " + " | ".join([
            r["family"], str(r["seq"]), fmt_ms(v.get("hf")), fmt_gib(v.get("hf")), fmt_ms(v.get("ours")),
            fmt_gib(v.get("ours")), "-" if sp is None else f"{sp:.1f}x", fmt_ms(v.get("ours_torch")),
            fmt_ms(v.get("entry")), fmt_ms(v.get("raw")), "-" if ov is None else f"{100 * (ov - 1):+.1f}%",
            fmt_pred(pred), "-" if mp is None else f"{mp:.2f}",
            "; ".join(notes).replace("|", "/"),
        ]) + " |")
    text = ["# GPU benchmark: glm53flash-hf vs transformers' glm5_next", ""]
    text += [f"- {k}: {v}" for k, v in header.items()]
    text += ["", "Forward + backward, batch 1, bf16; median of the timed calls; peak = extra memory during a call.",
             "speed-up = built-in / ours; overhead = entry / raw - 1 (see scripts/bench_gpu.py).",
             f"predicted ms: scripts/gpu_cost.py's {roofline_device()['name']} roofline of the raw variant's kernels "
             "(forward + backward; a prediction, not a measurement); raw / predicted: measured raw time over it.", ""]
    text += rows + ["", "## Targets", ""] + (targets(results) or ["- no comparable runs"]) + [""]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(text))


def versions() -> dict:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("triton", "fla"):
        try:
            out[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            out[name] = f"not importable ({type(exc).__name__})"
    return out


# --------------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, torch paths, one repeat")
    p.add_argument("--report", default="gpu-report/bench.md", help="markdown report path")
    p.add_argument("--json", default=None, help="optional JSON results path")
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--seqs", nargs="+", type=int, default=None, help="token counts (default 8192 32768; smoke 32 64)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per variant (default 1; smoke 0)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per variant (default 3; smoke 1)")
    p.add_argument("--torch-max-seq", type=int, default=8192, help="run ours_torch up to this S")
    p.add_argument("--budget-s", type=float, default=None, help="start no new case after this many seconds")
    args = p.parse_args(argv)
    if args.seqs is None:
        args.seqs = [32, 64] if args.smoke else [8192, 32768]
    if args.warmup is None:
        args.warmup = 0 if args.smoke else 1
    if args.repeats is None:
        args.repeats = 1 if args.smoke else 3
    if args.warmup < 0 or args.repeats < 1 or any(s < 1 for s in args.seqs):
        p.error(f"need --warmup >= 0, --repeats >= 1, --seqs >= 1; got {args.warmup}, {args.repeats}, {args.seqs}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        device, sizes = torch.device("cpu"), TINY_TEXT
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --smoke for the CPU check", file=sys.stderr)
            return 2
        device, sizes = torch.device("cuda"), RELEASE_TEXT
    dtype = torch.bfloat16
    started = time.perf_counter()
    header = dict(versions(), device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (smoke)",
                  date=time.strftime("%Y-%m-%d %H:%M:%S"), warmup=args.warmup, repeats=args.repeats,
                  sizes="release (gpu_modules.RELEASE_TEXT), MoE 288 experts" if not args.smoke else "tiny (smoke)")
    results = []
    order = [(seq, family) for seq in args.seqs
             # the longest S runs DSA first: its 32k target matters most if the time budget runs out
             for family in (sorted(args.families, key=lambda f: f != "dsa") if seq == max(args.seqs) > min(args.seqs)
                            else args.families)]
    for seq, family in order:
        entry = dict(family=family, seq=seq, variants={}, predicted_ms=predicted_ms(family, sizes, seq))
        results.append(entry)
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            entry["skipped"] = f"skipped: time budget of {args.budget_s:.0f} s spent"
            print(f"[bench] {family} S={seq}: skipped (budget)", flush=True)
            continue
        print(f"[bench] {family} S={seq}: building", flush=True)
        case = None
        try:
            case = CASES[family](sizes, seq, device, dtype, with_torch=seq <= args.torch_max_seq)
        except Exception as exc:  # noqa: BLE001 - reported per case
            status = "OOM" if is_oom(exc) else f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            if not is_oom(exc):
                traceback.print_exc()
            entry["skipped"] = f"set-up failed: {status}"
        if case is not None:
            for name in VARIANTS:
                if name in case.skip:
                    entry["variants"][name] = dict(skip=case.skip[name])
                    continue
                if name not in case.run:
                    entry["variants"][name] = dict(skip=f"not run (S > --torch-max-seq {args.torch_max_seq})")
                    continue
                res = run_variant(name, case.run[name], case.leaves, device, args.warmup, args.repeats)
                entry["variants"][name] = res
                mp = measured_over_predicted(res, entry["predicted_ms"]) if name in ("raw", "entry") else None
                print(f"[bench] {family} S={seq} {name}: {fmt_ms(res)} ms, peak {fmt_gib(res)} GiB"
                      f"{' (fallback)' if res.get('fallback') else ''}"
                      + ("" if mp is None else f", predicted {fmt_pred(entry['predicted_ms'])} ms "
                                               f"({roofline_device()['name']} roofline), measured/predicted {mp:.2f}"),
                      flush=True)
                free_memory(device, collect=res["status"] != "ok")
        del case
        free_memory(device, collect=device.type == "cuda")
        write_report(args.report, results, header)  # after every case: a killed run still leaves a report
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(header=header, results=results), f, indent=1)
    header["wall_s"] = round(time.perf_counter() - started, 1)
    write_report(args.report, results, header)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header=header, results=results), f, indent=1)
    print(f"[bench] report: {args.report} ({header['wall_s']} s)", flush=True)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
