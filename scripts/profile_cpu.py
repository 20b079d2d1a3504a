#!/usr/bin/env python
"""CPU profile of one training step (forward + backward), or of one cached decode step, of the benchmarks' wide tiny
config, per model family.

The model is ``Glm53FlashForCausalLM`` on ``_common.WIDE_TEXT`` (hidden 256, 3 KDA + 1 DSA layers, 8 routed experts,
fp32), random weights (``_common.randomize_``), ``labels = input_ids``. One untimed step warms up, one step is timed
without the profiler (printed beside), one under ``torch.profiler`` without input shapes, FLOPs and family hooks (the
op-kind table below), then one under it with all three (the family table).

Families, attributed from the outside (nothing of this script is in ``glm53flash_hf``):

* ``KDA``: ``Glm53FlashLinearAttention`` (projections, gate, convolution, delta rule, gated norm, output proj).
* ``DSA indexer``: ``Glm53FlashIndexer`` (``forward`` and, when decoding, ``forward_cached``).
* ``sparse MLA``: ``Glm53FlashAttention`` less its indexer.
* ``mHC``: ``Glm53FlashHyperConnection`` (``hc_pre``) and ``hc_post_torch`` (wrapped where the decoder layer calls
  it).
* ``MoE``: ``Glm53FlashMoE`` and the dense ``Glm53FlashMLP``.  ``loss``: ``lm_head`` and the loss function (from
  ``lm_head``'s input to the end of the model's forward).  ``other``: everything else (embedding, RMSNorms, glue).

Forward: a forward pre-hook opens a ``torch.profiler.record_function`` range ``fam::<family>`` and a forward hook
closes it. Backward: the hooks also pass the region's floating inputs and outputs through identity
``autograd.Function`` markers, one for the outputs and one for the inputs of a call; the output marker's backward
opens the range, the input marker's backward (autograd calls it once, when all of the inputs' gradients are in)
closes it (the loss range opens when backward starts). Time: the step's wall time on the profiler's clock is cut at
every range boundary and each piece goes to the innermost open range (the one opened last; none open: ``other``),
so a family's time includes its Python overhead and the shares add up to 100 %. Op calls, FLOPs and bytes: every
``aten::`` op not called from another ``aten::`` op is counted in the family whose range is innermost at its start.
FLOPs are the profiler's ``with_flops`` formulas (matrix products, convolutions, elementwise add/mul; e.g. the
triangular solve counts 0). Bytes are an estimate: the sizes of the op's tensor inputs (recorded shapes) plus one
output the size of its largest input, at 4 bytes per element (fp32; index tensors are counted at 4 bytes too).

Op kinds (a second table per step, from the step profiled without shapes, FLOPs and hooks, which inflate small ops
most; a decode step's from its one profile): the wall time of every outermost ``aten::`` op, children included, in
``products`` (``mm``, ``bmm``, ``baddbmm``, ``addmm``, ``linalg_solve_triangular``, convolutions), ``gather /
select`` (``index_select``, ``gather``, ``scatter_add``, ``index_add``, ``index_copy``, ``topk``, ``sort``, embedding)
and ``other aten`` (elementwise, copies, reductions, softmax, cumsum); ``outside aten`` is the rest of the phase
(Python, the autograd engine, and under ``--compiled`` inductor's generated kernels). ``torch.compile`` calls the
same product and gather kernels as eager, so the step divided by its products and gathers bounds what compiling can
gain; the script prints that bound (an upper one: fused kernels still take time).

``--compiled``: the model under ``torch.compile(fullgraph=True, dynamic=False)`` (inductor), the first step compiles
(untimed); no family hooks (a traced graph has no module calls to hook), so only the op-kind table is printed.

Decode (``--decode C [C ...]``): per context length ``C``, the model in eval mode prefills ``C`` tokens with a cache
(unprofiled), decodes one token (warm-up) and five more timed without the profiler (their median is printed beside
the profiled time: the profiler's own cost per op is large against a decode step's small ops), then one more token
under the profiler (phase ``decode``; no backward).

Usage::

    python scripts/profile_cpu.py                          # S = 2048 8192 32768
    python scripts/profile_cpu.py --seqlens 2048 8192 --threads 2 --json prof.json
    python scripts/profile_cpu.py --decode 4096 16384      # one decode step after 4k and 16k tokens of context
    python scripts/profile_cpu.py --seqlens 8192 --compiled  # op kinds of the compiled step
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import WIDE_TEXT, randomize_  # noqa: E402

FAMILIES = ("KDA", "DSA indexer", "sparse MLA", "mHC", "MoE", "loss", "other")
PHASES = ("forward", "backward", "decode")
_PREFIX = "fam::"
KINDS = ("products", "gather / select", "other aten", "outside aten")
_PRODUCTS = {"mm", "bmm", "baddbmm", "baddbmm_", "addmm", "addbmm", "matmul", "linear", "linalg_solve_triangular",
             "convolution", "convolution_backward", "mkldnn_convolution", "_convolution", "conv1d"}
_GATHERS = {"index_select", "gather", "scatter_add", "scatter_add_", "index_add", "index_add_", "index_copy",
            "index_copy_", "index", "index_put_", "_index_put_impl_", "topk", "sort", "embedding",
            "embedding_dense_backward", "masked_select", "nonzero"}


def op_kind(name: str) -> str:
    """The kind (:data:`KINDS`) of the ``aten::`` op ``name``."""
    op = name[len("aten::"):]
    return "products" if op in _PRODUCTS else "gather / select" if op in _GATHERS else "other aten"


class _Range:
    """One profiler range opened and closed from different call sites (forward hooks, backward markers)."""

    def __init__(self, family: str):
        self.family = family
        self.handle = None

    def open(self):
        if self.handle is None:
            self.handle = torch.autograd.profiler.record_function(_PREFIX + self.family)
            self.handle.__enter__()

    def close(self):
        if self.handle is not None:
            self.handle.__exit__(None, None, None)
            self.handle = None


class _Marker(torch.autograd.Function):
    """Identity on ``xs``; its backward (one call for all of ``xs``, once their gradients are in) calls ``action()``."""

    @staticmethod
    def forward(ctx, action, *xs):
        ctx.action = action
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.action()
        return (None, *grads)


def _mark(values, action):
    """Pass the floating tensors that require grad among ``values`` (a tuple, may nest one level of tuple/list)
    through one :class:`_Marker`; return ``values`` with them replaced (unchanged when there are none)."""
    flat = []

    def visit(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.requires_grad and torch.is_grad_enabled():
            flat.append(v)
        elif isinstance(v, (tuple, list)):
            for x in v:
                visit(x)

    visit(values)
    if not flat:
        return values
    marked = iter(_Marker.apply(action, *flat))
    ids = {id(x) for x in flat}

    def rebuild(v):
        if isinstance(v, torch.Tensor) and id(v) in ids:
            return next(marked)
        if isinstance(v, (tuple, list)):
            return type(v)(rebuild(x) for x in v)
        return v

    return rebuild(values)


class _Region:
    """Enter/exit a family region around one call: forward range plus backward markers."""

    def __init__(self, family: str):
        self.family = family
        self.calls = []

    def enter(self, args):
        fwd = _Range(self.family)
        bwd = _Range(self.family)
        self.calls.append((fwd, bwd))
        fwd.open()
        return _mark(args, bwd.close)

    def exit(self, out):
        fwd, bwd = self.calls.pop()
        fwd.close()
        return _mark(out, bwd.open)


def instrument(model) -> tuple[list, _Range]:
    """Install the family hooks on ``model``; return the hook handles (and patches to undo) and the loss range."""
    from glm53flash_hf import modeling_glm53flash as modeling
    from glm53flash_hf.dsa import Glm53FlashAttention, Glm53FlashIndexer
    from glm53flash_hf.kda import Glm53FlashLinearAttention
    from glm53flash_hf.mhc import Glm53FlashHyperConnection
    from glm53flash_hf.modeling_glm53flash import Glm53FlashMoE
    from glm53flash_hf.moe import Glm53FlashMLP

    classes = {Glm53FlashLinearAttention: "KDA", Glm53FlashIndexer: "DSA indexer", Glm53FlashAttention: "sparse MLA",
               Glm53FlashHyperConnection: "mHC", Glm53FlashMoE: "MoE", Glm53FlashMLP: "MoE"}
    undo = []
    for module in model.modules():
        family = next((f for c, f in classes.items() if type(module) is c), None)
        if family is None:
            continue
        region = _Region(family)

        def pre(mod, args, kwargs, region=region):
            return region.enter(args), kwargs

        def post(mod, args, kwargs, out, region=region):
            return region.exit(out)

        undo.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        undo.append(module.register_forward_hook(post, with_kwargs=True))
        if hasattr(module, "forward_cached"):  # the indexer's cached entry, called instead of forward when decoding

            def cached(*args, region=region, original=module.forward_cached, **kwargs):
                return region.exit(original(*region.enter(args), **kwargs))

            module.forward_cached = cached
            undo.append(type("Undo", (), {"remove": staticmethod(lambda m=module: delattr(m, "forward_cached"))})())

    hc_region = _Region("mHC")
    original_hc_post = modeling.hc_post_torch

    @functools.wraps(original_hc_post)  # op_for finds the op by this name
    def hc_post(*args, **kwargs):
        return hc_region.exit(original_hc_post(*hc_region.enter(args), **kwargs))

    modeling.hc_post_torch = hc_post
    undo.append(type("Undo", (), {"remove": staticmethod(lambda: setattr(modeling, "hc_post_torch",
                                                                         original_hc_post))})())

    loss_fwd, loss_bwd = _Range("loss"), _Range("loss")

    def head_pre(mod, args):
        loss_fwd.open()
        return _mark(args, loss_bwd.close)

    def model_post(mod, args, out):
        loss_fwd.close()

    undo.append(model.lm_head.register_forward_pre_hook(head_pre))
    undo.append(model.register_forward_hook(model_post))
    return undo, loss_bwd


def build_model(seed: int = 0):
    from glm53flash_hf.configuration_glm53flash import Glm53FlashTextConfig
    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM

    torch.manual_seed(seed)
    model = Glm53FlashForCausalLM(Glm53FlashTextConfig(**WIDE_TEXT)).float()
    randomize_(model, seed, std=0.04)
    return model.train()


def _innermost_partition(intervals, t0, t1):
    """Cut ``[t0, t1]`` at every interval boundary; return ``{family: time}`` giving each piece to the innermost
    (latest-opened) interval covering it, ``other`` where none does. ``intervals``: ``(start, end, family)``."""
    points = sorted({t0, t1, *(max(t0, min(t1, x)) for s, e, _ in intervals for x in (s, e))})
    out = dict.fromkeys(FAMILIES, 0.0)
    ordered = sorted(intervals)
    for a, b in zip(points[:-1], points[1:]):
        if b <= a:
            continue
        mid = (a + b) / 2
        family = "other"
        for s, e, f in ordered:  # latest start wins
            if s > mid:
                break
            if e > mid:
                family = f
        out[family] += b - a
    return out


def _innermost_at(intervals_sorted, starts, t):
    """The family innermost at time ``t`` (``intervals_sorted`` by start; ``starts`` their start times)."""
    import bisect

    i = bisect.bisect_right(starts, t)
    for _s, e, f in reversed(intervals_sorted[:i]):
        if e > t:
            return f
    return "other"


def _bytes_estimate(shapes) -> int:
    sizes = [math.prod(s) for s in shapes if isinstance(s, (list, tuple)) and len(s) > 0]
    return 4 * (sum(sizes) + max(sizes)) if sizes else 0


def summarise(events) -> tuple[dict, dict]:
    """Per phase and family: time (s), op calls, FLOPs, estimated bytes; and per phase the time (s) of each op kind
    (:data:`KINDS`); from the profiler's events. Returns ``(families, kinds)``."""
    phases = {}
    for ev in events:
        if ev.name.startswith("phase::"):
            phases[ev.name[len("phase::"):]] = (ev.time_range.start, ev.time_range.end)
    fams = sorted((ev.time_range.start, ev.time_range.end, ev.name[len(_PREFIX):]) for ev in events
                  if ev.name.startswith(_PREFIX))
    starts = [s for s, _, _ in fams]
    result, kinds_out = {}, {}
    for phase, (t0, t1) in phases.items():
        inside = [(max(s, t0), min(e, t1), f) for s, e, f in fams if s < t1 and e > t0]
        times = _innermost_partition(inside, t0, t1)
        rows = {f: {"time_s": times[f] / 1e6, "calls": 0, "flops": 0, "bytes": 0} for f in FAMILIES}
        result[phase] = rows
        kinds = kinds_out[phase] = dict.fromkeys(KINDS, 0.0)
        for ev in events:
            if not ev.name.startswith("aten::") or not t0 <= ev.time_range.start < t1:
                continue
            parent = ev.cpu_parent
            if parent is not None and parent.name.startswith("aten::"):
                continue
            kinds[op_kind(ev.name)] += (min(ev.time_range.end, t1) - ev.time_range.start) / 1e6
            row = rows[_innermost_at(fams, starts, ev.time_range.start)]
            row["calls"] += 1
            row["flops"] += int(ev.flops or 0)
            row["bytes"] += _bytes_estimate(ev.input_shapes or [])
        # FLOPs of nested aten ops (e.g. addmm under linear) are counted at the outermost op only when it has a
        # formula; add the nested ones that carry FLOPs their outermost op does not.
        for ev in events:
            if not ev.name.startswith("aten::") or not t0 <= ev.time_range.start < t1 or not ev.flops:
                continue
            parent = ev.cpu_parent
            if parent is None or not parent.name.startswith("aten::"):
                continue
            top = parent
            while top.cpu_parent is not None and top.cpu_parent.name.startswith("aten::"):
                top = top.cpu_parent
            if not top.flops:
                rows[_innermost_at(fams, starts, ev.time_range.start)]["flops"] += int(ev.flops)
        kinds["outside aten"] = max(0.0, (t1 - t0) / 1e6 - sum(kinds.values()))
    return result, kinds_out


def _profiled_step(call, ids, detailed: bool, loss_bwd: _Range | None = None):
    """One forward + backward of ``call`` under ``torch.profiler`` with phase ranges; ``detailed`` records input
    shapes and FLOPs (both cost time per op); ``loss_bwd``, the loss family's backward range, if any. Returns
    ``(events, wall seconds, loss)``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], record_shapes=detailed, with_flops=detailed) as prof:
        t0 = time.perf_counter()
        with record_function("phase::forward"):
            loss = call(input_ids=ids, labels=ids, use_cache=False).loss
        with record_function("phase::backward"):
            if loss_bwd is not None:
                loss_bwd.open()
            loss.backward()
            if loss_bwd is not None:
                loss_bwd.close()
        wall = time.perf_counter() - t0
    return prof.events(), wall, loss.item()


def profile_step(model, seq_len: int, seed: int = 1, compiled: bool = False) -> dict:
    """Warm-up step, one step timed without the profiler, one profiled without shapes, FLOPs and hooks (the op-kind
    table, less inflated) and one profiled with them (the family table) at ``seq_len``; returns :func:`summarise`'s
    ``families`` and ``kinds``, the wall times (``step_s`` of the detailed profile, ``kinds_step_s`` of the plain one,
    ``unprofiled_step_s``) and the loss. ``compiled``: the step of ``torch.compile(model)``, no family hooks and no
    detailed profile."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, WIDE_TEXT["vocab_size"], (1, seq_len), generator=gen)
    call = torch.compile(model, fullgraph=True, dynamic=False) if compiled else model
    for _ in range(2):  # warm-up (compiles), then one step timed without the profiler
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        call(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        plain = time.perf_counter() - t0
    # the plain profile first: a process's later profiles run slower than its first
    model.zero_grad(set_to_none=True)
    events, kinds_wall, loss = _profiled_step(call, ids, detailed=False)
    kinds = summarise(events)[1]
    families = None
    if not compiled:
        undo, loss_bwd = instrument(model)
        try:
            model.zero_grad(set_to_none=True)
            events, wall, loss = _profiled_step(call, ids, detailed=True, loss_bwd=loss_bwd)
        finally:
            for h in undo:
                h.remove()
        families = summarise(events)[0]
    return {"seq_len": seq_len, "step_s": kinds_wall if compiled else wall, "kinds_step_s": kinds_wall,
            "unprofiled_step_s": plain, "loss": loss, "compiled": compiled, "families": families, "kinds": kinds}


def profile_decode(model, context: int, seed: int = 1) -> dict:
    """Prefill ``context`` tokens with a cache and decode one token (both untimed), decode five tokens timed without the
    profiler, then one more under it; returns :func:`summarise`'s dict (phase ``decode``), the profiled step's wall
    time (``step_s``) and the unprofiled steps' median (``unprofiled_step_s``)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, WIDE_TEXT["vocab_size"], (1, context + 7), generator=gen)
    model.eval()
    undo, _ = instrument(model)
    try:
        with torch.no_grad():
            cache = model(input_ids=ids[:, :context], use_cache=True).past_key_values
            step = ids[:, context : context + 1]
            cache = model(input_ids=step, past_key_values=cache, use_cache=True).past_key_values
            times = []
            for i in range(context + 1, context + 6):
                t0 = time.perf_counter()
                cache = model(input_ids=ids[:, i : i + 1], past_key_values=cache, use_cache=True).past_key_values
                times.append(time.perf_counter() - t0)
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
                t0 = time.perf_counter()
                with record_function("phase::decode"):
                    model(input_ids=ids[:, context + 6 :], past_key_values=cache, use_cache=True)
                wall = time.perf_counter() - t0
    finally:
        for h in undo:
            h.remove()
        model.train()
    families, kinds = summarise(prof.events())
    return {"seq_len": context, "step_s": wall, "kinds_step_s": wall, "unprofiled_step_s": sorted(times)[2],
            "decode": True, "families": families, "kinds": kinds}


def kinds_table(kinds: dict) -> str:
    """The op-kind table of one step (rows: :data:`KINDS`, columns: phases and their sum) and the bound on what
    compiling can gain (the step over its products and gathers)."""
    phases = [p for p in PHASES if p in kinds]
    total = {k: sum(kinds[p][k] for p in phases) for k in KINDS}
    step = sum(total.values())
    lines = ["| op kind | " + " | ".join(f"{p} (s)" for p in phases) + " | step (s) | share |",
             "|---|" + "---|" * (len(phases) + 2)]
    for k in KINDS:
        lines.append(f"| {k} | " + " | ".join(f"{kinds[p][k]:.4f}" for p in phases)
                     + f" | {total[k]:.4f} | {100 * total[k] / step:.1f} % |")
    fixed = total["products"] + total["gather / select"]
    if fixed > 0:
        lines += ["", f"step / (products + gather / select) = {step / fixed:.2f}x: the most compiling could gain if "
                      "it removed all other time"]
    return "\n".join(lines)


def table(res: dict) -> str:
    fam = res["families"] or {}
    total = sum(r["time_s"] for p in fam.values() for r in p.values())
    what = f"decode step after {res['seq_len']} tokens" if res.get("decode") else f"S={res['seq_len']}: step"
    what = f"{what} (compiled)" if res.get("compiled") else what
    plain = f", {res['unprofiled_step_s'] * 1e3:.1f} ms without it" + (" (median of 5)" if res.get("decode") else "")
    head = f"{what}: {res['step_s'] * 1e3:.1f} ms under the profiler{plain}"
    kinds = (f"Op kinds (a profile without shapes, FLOPs and hooks: {res['kinds_step_s'] * 1e3:.1f} ms):\n\n"
             + kinds_table(res["kinds"]))
    if res.get("compiled"):
        return "\n".join([head, "", kinds])
    lines = [f"{head} (attributed {total * 1e3:.1f} ms)", "",
             "| family | phase | time (s) | share | op calls | GFLOP | GB moved (est.) | GFLOP/s |",
             "|---|---|---|---|---|---|---|---|"]
    for f in FAMILIES:
        for p in PHASES:
            r = fam.get(p, {}).get(f)
            if r is None:
                continue
            rate = r["flops"] / r["time_s"] / 1e9 if r["time_s"] > 0 else 0.0
            lines.append(f"| {f} | {p} | {r['time_s']:.4f} | {100 * r['time_s'] / total:.1f} % | {r['calls']} | "
                         f"{r['flops'] / 1e9:.2f} | {r['bytes'] / 1e9:.2f} | {rate:.1f} |")
    per_family = {f: sum(fam[p][f]["time_s"] for p in fam) for f in FAMILIES}
    lines.append("")
    lines.append(f"shares by family ({' + '.join(p for p in PHASES if p in fam)}): " + ", ".join(
        f"{f} {100 * t / total:.1f} %" for f, t in per_family.items()))
    lines += ["", kinds]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192, 32768], help="sequence lengths")
    parser.add_argument("--decode", type=int, nargs="+", metavar="C",
                        help="profile one cached decode step after each context length C (instead of --seqlens)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--malloc", choices=("default", "reuse", "bounded"), default="default",
                        help="heap policy (glm53flash_hf.train.malloc.set_malloc_policy), as bench_cpu.py --malloc")
    parser.add_argument("--compiled", action="store_true",
                        help="profile the torch.compile'd training step (op kinds only; not with --decode)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    if args.compiled and args.decode:
        parser.error("--compiled profiles the training step; it does not combine with --decode")
    torch.set_num_threads(args.threads)
    from glm53flash_hf.train.malloc import set_malloc_policy

    set_malloc_policy(args.malloc)
    model = build_model()
    results = []
    for s in args.decode or args.seqlens:
        res = profile_decode(model, s) if args.decode else profile_step(model, s, compiled=args.compiled)
        results.append(res)
        print(table(res), flush=True)
        print(flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
