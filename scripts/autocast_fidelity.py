#!/usr/bin/env python
"""bf16 autocast fidelity: loss and gradients under ``torch.autocast("cpu", dtype=torch.bfloat16)`` against fp32, for
our model and transformers' built-in ``glm5_next`` on the same weights.

Models (text only, ``Glm53FlashForCausalLM`` and ``Glm5NextForConditionalGeneration`` with eager attention, both
``from_pretrained`` of one folder):

- ``tiny``: the tiny checkpoint (``glm53flash-make-tiny``: hidden 64, 6 layers, 8 experts top-2, ``index_topk`` 16),
  weights as the checkpoint stores them (bf16 values);
- ``wide``: the benchmarks' wide random config (``scripts/_common.py``, ``WIDE_TEXT``: hidden 256, 3 KDA + 1 DSA
  layers, 8 experts top-2), fp32 random weights written by the built-in class;
- ``wide-all-experts``: ``wide`` with every token routed to all 8 experts, so no routing choice can flip between the
  fp32 and the autocast run (``index_topk`` 256 covers the sequence: no pool choice flips either). A flipped choice
  moves a token's output by O(1); this row shows the rounding alone.

Per model, implementation, weight dtype and seed (a batch of random token ids), one forward (``labels = input_ids``;
our MTP term off, ``mtp=False``, as the built-in has no MTP layer) and one backward:

- ``fp32`` weights: the fp32 run (no autocast) is the reference, the autocast run is measured against it;
- ``bf16`` weights (``from_pretrained(dtype=torch.bfloat16)``, fp32-kept parameters stay fp32): the reference is the
  same model cast to fp32 (``.float()``: the bf16 values exactly) run without autocast.

Reported, each the mean over the seeds: the loss's absolute and relative difference from the reference; the worst
relative gradient error over the parameters, ``max_p |g_p - g_ref_p| / |g_ref_p|`` (Frobenius norms; parameters with
a zero reference gradient skipped; the parameter it occurs in most often is named); the relative error of all
gradients together, ``|g - g_ref| / |g_ref|`` over the concatenation. ``ours / built-in`` divides ours' means by the
built-in's. Prints a markdown table.

Usage::

    python scripts/autocast_fidelity.py                      # all models, batch 2 x 64 tokens, seeds 1,2,3
    python scripts/autocast_fidelity.py --models tiny --seq 128 --seeds 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile

if "fla" not in sys.modules:  # transformers' glm5_next binds fla's Triton kernels at import; they need CUDA
    sys.modules["fla"] = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

AMP = torch.bfloat16


def canonical_name(name: str) -> str:
    """A parameter name of either implementation in ours' text-model naming (``model.layers...``): the built-in's
    ``model.language_model.`` prefix becomes ``model.``."""
    return name.replace("model.language_model.", "model.", 1)


def load_pair(folder: str, dtype: torch.dtype):
    """``(ours, builtin)`` from ``folder`` in ``dtype`` (fp32-kept parameters stay fp32), in train mode."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    from glm53flash_hf import Glm53FlashForCausalLM

    ours = Glm53FlashForCausalLM.from_pretrained(folder, dtype=dtype)
    builtin = Glm5NextForConditionalGeneration.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    return ours.train(), builtin.train()


def loss_and_grads(model, input_ids: torch.Tensor, amp: torch.dtype | None, labels: torch.Tensor | None = None):
    """``(loss, {canonical name: fp32 gradient})`` of one forward under ``torch.autocast("cpu", amp)`` (``None``: no
    autocast) and one backward outside it. Our model runs with ``mtp=False`` (the built-in has no MTP layer)."""
    model.zero_grad(set_to_none=True)
    kwargs = {"mtp": False} if type(model).__module__.startswith(("glm53flash_hf", "transformers_modules")) else {}
    context = torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext()
    with context:
        out = model(input_ids=input_ids, labels=input_ids if labels is None else labels, use_cache=False, **kwargs)
    out.loss.backward()
    grads = {canonical_name(n): p.grad.detach().float().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return out.loss.detach().float(), grads


def worst_grad_error(grads: dict, ref: dict) -> tuple[float, str]:
    """``(max over parameters of |grads[p] - ref[p]| / |ref[p]|, p)`` (Frobenius norms), parameters with a zero
    reference gradient skipped; ``RuntimeError`` when a parameter with a reference gradient has none or a non-finite
    one."""
    worst, where = 0.0, ""
    for name, g_ref in ref.items():
        denom = float(g_ref.double().norm())
        if denom == 0:
            continue
        g = grads.get(name)
        if g is None or not torch.isfinite(g).all():
            raise RuntimeError(f"{name}: no finite gradient under autocast")
        err = float((g.double() - g_ref.double()).norm()) / denom
        if err > worst:
            worst, where = err, name
    return worst, where


def all_grads_error(grads: dict, ref: dict) -> float:
    """``|g - g_ref| / |g_ref|`` over all parameters' gradients together (Frobenius)."""
    num = sum(float(((grads[n].double() - g.double()) ** 2).sum()) for n, g in ref.items())
    return (num / sum(float((g.double() ** 2).sum()) for g in ref.values())) ** 0.5


def measure(model, input_ids: torch.Tensor, weights: str) -> dict:
    """Errors of ``model``'s autocast-bf16 run against its fp32 reference (module docstring); ``model`` in ``weights``
    dtype (``"fp32"`` or ``"bf16"``; a ``bf16`` model is cast to fp32 in place for its reference)."""
    if weights == "fp32":
        ref_loss, ref_grads = loss_and_grads(model, input_ids, None)
        loss, grads = loss_and_grads(model, input_ids, AMP)
    else:
        loss, grads = loss_and_grads(model, input_ids, AMP)
        ref_loss, ref_grads = loss_and_grads(model.float(), input_ids, None)
    worst, where = worst_grad_error(grads, ref_grads)
    diff = abs(float(loss) - float(ref_loss))
    return {"ref_loss": float(ref_loss), "loss_abs": diff, "loss_rel": diff / abs(float(ref_loss)), "grad": worst,
            "grad_where": where, "grad_all": all_grads_error(grads, ref_grads)}


def make_folder(name: str, folder: str) -> None:
    """Write model ``name`` (``tiny``, ``wide`` or ``wide-all-experts``) into ``folder``."""
    if name == "tiny":
        from glm53flash_hf.tools.make_tiny import make_tiny

        make_tiny(folder, overwrite=True, show_progress=False)
    elif name in ("wide", "wide-all-experts"):
        from _common import WIDE_TEXT, make_weights

        make_weights(folder, **({"num_experts_per_tok": WIDE_TEXT["n_routed_experts"]} if name != "wide" else {}))
    else:
        raise ValueError(f"unknown model {name!r}; known: tiny, wide, wide-all-experts")


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,wide,wide-all-experts", help="comma-separated model names")
    parser.add_argument("--seq", type=int, default=64, help="tokens per row")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds of the token batches")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the built-in's "unexpected keys" of the MTP layer and the vision tower
    hf_logging.disable_progress_bar()
    rows = []
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as folder:
            make_folder(name, folder)
            vocab = AutoConfig.from_pretrained(folder).get_text_config().vocab_size
            for weights, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                runs = {"ours": [], "built-in": []}
                for seed in seeds:
                    ids = torch.randint(1, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(seed))
                    ours, builtin = load_pair(folder, dtype)  # fresh: a bf16 model is cast to fp32 by measure
                    runs["ours"].append(measure(ours, ids, weights))
                    runs["built-in"].append(measure(builtin, ids, weights))
                    del ours, builtin
                means = {impl: {k: mean(r[k] for r in rs) for k in ("ref_loss", "loss_abs", "loss_rel", "grad",
                                                                        "grad_all")}
                         for impl, rs in runs.items()}
                for impl, m in means.items():
                    where = max((r["grad_where"] for r in runs[impl]), key=[r["grad_where"] for r in runs[impl]].count)
                    ratio = ""
                    if impl == "ours":
                        b = means["built-in"]
                        ratio = " / ".join(f"{m[k] / b[k]:.2f}" for k in ("loss_abs", "grad", "grad_all"))
                    rows.append(f"| {name} | {weights} | {impl} | {m['ref_loss']:.4f} | {m['loss_abs']:.2e} | "
                                f"{m['loss_rel']:.2e} | {m['grad']:.2e} (`{where}`) | {m['grad_all']:.2e} | {ratio} |")
    print(f"batch {args.batch} x {args.seq} tokens, means over seeds {args.seeds}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")
    print("| model | weights | impl | fp32 loss | loss abs diff | loss rel diff | worst param grad rel err (where) | "
          "all grads rel err | ours / built-in (loss abs / worst grad / all grads) |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
