#!/usr/bin/env python
"""bf16 precision audit: which ops dominate the bf16-vs-fp32 error of the logits and the gradients.

Model: the wide tiny config of ``_common.py`` (hidden 256, 3 KDA + 1 DSA layers, 8 routed experts, mHC 4 streams),
weights written by transformers' ``Glm5NextForConditionalGeneration``, with every token routed to all 8 experts
(``num_experts_per_tok = n_routed_experts``); ``index_topk`` (256 tokens) covers the whole sequence (``--seq`` 256).
So the indexer selects every causal token and the router every expert in every precision: no selection flips
(a flipped expert or pool choice moves a token's output by O(1) and would swamp the rounding errors measured here).

Runs, each a forward (``labels = input_ids``, so the loss includes the MTP term where the model has one) and a backward:

- the fp32 reference (ours, loaded with ``dtype=torch.float32``);
- one run per op group with only that group in bf16 and the rest in fp32: the group's modules are cast to bf16
  (parameters that transformers keeps in fp32, ``_keep_in_fp32_modules_strict``, stay fp32) and their floating inputs
  cast to bf16 and outputs back to fp32 by hooks; a function op (the KDA short convolution, the KDA chunk recurrence,
  the sparse MLA core) gets its activation inputs in bf16 through a wrapper, the other arguments as the model passes
  them;
- the whole model in bf16 (``from_pretrained(dtype=torch.bfloat16)``, what users run), ours and transformers'
  built-in, each against its own fp32 run on the same weights.

Error of a run: relative Frobenius error of the logits, ``|L - L_ref| / |L_ref|``, and of all parameter gradients
together, ``sqrt(sum |g - g_ref|^2) / sqrt(sum |g_ref|^2)`` (bf16 gradients cast to fp32). Independent rounding
errors add in quadrature, so the share of a group is its squared error over the sum of the groups' squared errors
(and the root of that sum is close to the whole model's error). Prints a markdown table.

Usage::

    python scripts/investigations/bf16_audit.py                 # batch 2 x 256 tokens
    python scripts/investigations/bf16_audit.py --seq 128 --batch 1
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import tempfile

if "fla" not in sys.modules:  # transformers' glm5_next binds fla's Triton kernels at import; they need CUDA
    sys.modules["fla"] = None

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))  # _common, bench_sp: the benchmarks' helpers

import torch  # noqa: E402
from _common import WIDE_TEXT, make_weights  # noqa: E402
from torch import nn  # noqa: E402

BF16 = torch.bfloat16


def _cast(obj, src, dst):
    """``obj`` with every tensor of dtype ``src`` (also inside tuples, lists, dicts) cast to ``dst``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dst) if obj.dtype == src else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_cast(x, src, dst) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast(x, src, dst) for x in obj)
    if isinstance(obj, dict):
        for key in list(obj.keys()):
            obj[key] = _cast(obj[key], src, dst)
        return obj
    return obj


def _keep_fp32(model, name: str) -> bool:
    return any(pattern in name for pattern in model._keep_in_fp32_modules_strict)


def _groups(model) -> dict[str, list[nn.Module]]:
    """Op groups of our model: disjoint lists of modules (function ops are patched apart, see ``FUNCTION_OPS``)."""
    mods = dict(model.named_modules())

    def of_type(cls):
        return [mod for mod in mods.values() if type(mod).__name__ == cls]

    def linears_under(cls, exclude=()):
        out = []
        for name, mod in mods.items():
            if type(mod) is not nn.Linear:
                continue
            owners = [mods[".".join(name.split(".")[:i])] for i in range(1, name.count(".") + 1)]
            if any(type(o).__name__ == cls for o in owners) and not any(type(o).__name__ in exclude for o in owners):
                out.append(mod)
        return out

    return {
        "embedding": of_type("Embedding"),
        "lm_head": [model.lm_head],
        "RMSNorm (layer, q/kv-lora, final)": of_type("Glm53FlashRMSNorm"),
        "mHC hc_pre / hc_post (incl. Sinkhorn)": of_type("Glm53FlashHyperConnection"),
        "KDA projections (q, k, v, g, o)": linears_under("Glm53FlashLinearAttention", ("Glm53FlashForgetGate",)),
        "KDA forget gate": of_type("Glm53FlashForgetGate"),
        "KDA gated output norm": of_type("Glm53FlashRMSNormGated"),
        "DSA projections (q/kv-lora, o)": linears_under("Glm53FlashAttention", ("Glm53FlashIndexer",)),
        "DSA indexer": of_type("Glm53FlashIndexer"),
        "MoE router": of_type("Glm53FlashTopkRouter"),
        "MoE routed experts": of_type("Glm53FlashExperts"),
        "dense MLP / shared expert": of_type("Glm53FlashMLP"),
    }


# function ops: (module, attribute, how many leading positional arguments are activations)
FUNCTION_OPS = {
    "KDA short convolution": ("glm53flash_hf.kda", "causal_conv1d_torch", 1),
    "KDA chunk recurrence (q, k, v in bf16)": ("glm53flash_hf.kda", "chunk_kda_torch", 3),
    "DSA sparse MLA core": ("glm53flash_hf.dsa", "sparse_mla_torch", 2),
}


@contextlib.contextmanager
def modules_in_bf16(model, modules):
    """Cast ``modules`` to bf16 (fp32-kept parameters excepted) with bf16-in / fp32-out hooks; undone on exit."""
    names = {id(mod): name for name, mod in model.named_modules()}
    saved, handles = [], []
    for mod in modules:
        for pname, p in mod.named_parameters():
            if not _keep_fp32(model, f"{names[id(mod)]}.{pname}"):
                saved.append((p, p.data))
                p.data = p.data.to(BF16)
        handles.append(mod.register_forward_pre_hook(
            lambda mod, args, kwargs: (_cast(args, torch.float32, BF16), _cast(kwargs, torch.float32, BF16)),
            with_kwargs=True))
        handles.append(mod.register_forward_hook(lambda mod, args, out: _cast(out, BF16, torch.float32)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for p, data in saved:
            p.data = data
            p.grad = None


@contextlib.contextmanager
def function_in_bf16(module_name: str, attr: str, n_act: int):
    """Replace ``module_name.attr`` by a wrapper feeding its first ``n_act`` arguments in bf16, first output as fp32."""
    import importlib

    module = importlib.import_module(module_name)
    fn = getattr(module, attr)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        args = tuple(a.to(BF16) if i < n_act and a.dtype == torch.float32 else a for i, a in enumerate(args))
        out = fn(*args, **kwargs)
        if isinstance(out, tuple):
            return (out[0].float(),) + tuple(out[1:])
        return out.float()

    setattr(module, attr, wrapper)
    try:
        yield
    finally:
        setattr(module, attr, fn)


def run(model, ids):
    """Logits (fp32) and ``{name: fp32 gradient}`` of one forward + backward."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().float(), grads


def errors(got, ref) -> tuple[float, float]:
    logits, grads = got
    ref_logits, ref_grads = ref
    if grads.keys() != ref_grads.keys():
        raise RuntimeError(f"gradient sets differ: {sorted(grads.keys() ^ ref_grads.keys())}")
    num = sum(((grads[n] - ref_grads[n]) ** 2).sum() for n in ref_grads)
    den = sum((ref_grads[n] ** 2).sum() for n in ref_grads)
    return float((logits - ref_logits).norm() / ref_logits.norm()), float((num / den).sqrt())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=256, help="tokens per row (at most index_topk)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--whole-only", action="store_true", help="only the whole-model rows (no per-op runs)")
    args = parser.parse_args()
    if args.seq > WIDE_TEXT["index_topk"]:
        parser.error(f"--seq must be <= index_topk={WIDE_TEXT['index_topk']} (no selection may flip); got {args.seq}")
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    from glm53flash_hf import Glm53FlashForCausalLM

    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(1, WIDE_TEXT["vocab_size"], (args.batch, args.seq), generator=gen)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        make_weights(folder, num_experts_per_tok=WIDE_TEXT["n_routed_experts"])
        ours = Glm53FlashForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
        ref = run(ours, ids)
        for name, modules in ([] if args.whole_only else _groups(ours).items()):
            with modules_in_bf16(ours, modules):
                rows.append((name, *errors(run(ours, ids), ref)))
        for name, (module_name, attr, n_act) in ([] if args.whole_only else FUNCTION_OPS.items()):
            with function_in_bf16(module_name, attr, n_act):
                rows.append((name, *errors(run(ours, ids), ref)))
        whole = errors(run(Glm53FlashForCausalLM.from_pretrained(folder, dtype=BF16).train(), ids), ref)

        def hf(dtype):
            return Glm5NextForConditionalGeneration.from_pretrained(
                folder, dtype=dtype, attn_implementation="eager"
            ).train()

        hf_ref = run(hf(torch.float32), ids)
        hf_whole = errors(run(hf(BF16), ids), hf_ref)

    total_l = sum(r[1] ** 2 for r in rows) or 1.0
    total_g = sum(r[2] ** 2 for r in rows) or 1.0
    print(f"\nbatch {args.batch} x {args.seq} tokens, wide tiny config (all experts routed), bf16 vs fp32 "
          "(relative Frobenius errors)")
    print("| op in bf16 (rest fp32) | logits error | share | gradient error | share |")
    print("|---|---|---|---|---|")
    for name, el, eg in sorted(rows, key=lambda r: -r[2]):
        print(f"| {name} | {el:.2e} | {el**2 / total_l:.0%} | {eg:.2e} | {eg**2 / total_g:.0%} |")
    if rows:
        print(f"| root of the sum of squares over the groups | {total_l**0.5:.2e} | | {total_g**0.5:.2e} | |")
    print(f"| **whole model in bf16, ours** | {whole[0]:.2e} | | {whole[1]:.2e} | |")
    print(f"| **whole model in bf16, transformers' glm5_next** | {hf_whole[0]:.2e} | | {hf_whole[1]:.2e} | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
