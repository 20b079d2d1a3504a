"""GPU tests at realistic shapes: each operator family's module with ``kernels={family: "fused"}`` against the same
module with ``"torch"``, both in bf16, each measured against an fp32 evaluation of the same module (torch path) on the
same bf16-rounded weights and inputs. Marked ``gpu``; skipped without CUDA (run by ``scripts/gpu_check.sh``).

Shapes: the release's (``scripts/gpu_modules.py``): hidden 4096; KDA 64 heads x 128; DSA 64 heads, q_lora 1536, kv_lora
512, qk_nope 256, v 256, indexer 32 x 128, top-k 2048, k-pool 4 (width 2051); mHC 4 streams, 20 Sinkhorn steps; MoE
expert width 2048, top-8 of 64 experts (the release has 288: 64 keeps the fp32 reference copy and its gradients within
memory, and 1024 rows per expert is as much GEMM work per expert as the release at 36k tokens). S = 8192 tokens for
every family, plus 32768 for KDA and DSA. bf16 activations and weights; the parameters transformers keeps in fp32
(``_keep_in_fp32_modules_strict``: conv1d, A_log, dt_bias, router weight and bias, mHC base/scale) stay fp32.

Why an fp32 oracle: two bf16 paths differ from each other by their rounding, which says nothing about which is right.
Each bf16 path's error is measured against the fp32 evaluation as a relative L2 error ``||a - ref|| / ||ref||`` of
the outputs and of the gradients of the input and of every parameter, and the fused path must satisfy
``err_fused <= max(2 * err_torch, floor)``: no more than twice the torch path's own bf16 error, or the family's floor
where the fused kernel by design computes in lower precision than our torch path (which keeps fp32 inside):

* mHC, MoE: floor ``2**-8`` (one bf16 rounding, relative): both kernels keep every intermediate in fp32 and round
  where the torch path rounds (tests/test_mhc_fused.py, tests/test_moe_fused.py show ulp agreement). mHC's ``post``
  and ``comb`` are fp32 functions of the same inputs in all three runs (the bf16 streams are exact in fp32), so the
  torch path's error there is 0 and the floor is 1e-4: fp32 sums over 16384 terms in another order (about
  sqrt(16384) * 6e-8 = 8e-6) with a margin of 10 for the Sinkhorn steps (tests/test_mhc_fused.py's GPU test).
* DSA: floor ``1e-2``: the sparse kernel feeds bf16 operands to its tensor-core products (scores and P @ V with P
  rounded to bf16, relative 2**-9 each, over 2051 keys); xtuner's bound for its FlashMLA sparse kernel against its torch
  path is 1e-2 relative L2 for the gradients (``docs/design.md``, section "DSA").
* KDA: floor ``2e-2``: fla's ``chunk_kda`` rounds the operands of its chunk products to bf16 and chains about four of
  them per chunk plus the state update; xtuner's bound for the same kernel against an fp32 token loop is 2e-2 relative
  L2 for the gradients (``docs/design.md``, section "KDA").

For MoE the routed experts' fused and torch bf16 outputs are also compared directly: at most one bf16 ulp apart (both
round the same fp32 sums; CUDA's ``index_add_`` in the torch path adds in an unspecified order) plus ``2**-12`` of the
largest value for sums that cancel and for the rare activation that Triton's and ATen's fp32 ``exp`` round to
neighbouring bf16 values (one ulp of one of 2048 terms of a down-projection dot product).

Every test also asserts that the fused path really ran: no "cannot run" fallback warning from
:func:`glm53flash_hf.dispatch.choose_backend` (its cache of warnings is cleared first).

The measured errors are written to the JSON file named by ``GLM53_GPU_TEST_JSON`` (``scripts/gpu_check.sh`` sets it
and copies the numbers into its report). :func:`test_bodies_on_cpu_tiny` runs the same test bodies on CPU at tiny
shapes (where "fused" falls back to torch) so this file cannot rot between GPU runs.

Test-process note: ``tests/conftest.py`` hides fla-core (``sys.modules["fla"] = None``) so transformers' oracle keeps
its torch path on CPU; the GPU tests need fla for the fused KDA, so :func:`cuda_session` un-hides it (only when CUDA
is present; transformers' module has long been imported by then).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import warnings

import gpu_modules
import pytest
import torch
from gpu_modules import TINY_TEXT, randomize_, to_model_dtypes_

from glm53flash_hf import dispatch
from glm53flash_hf.configuration_glm53flash import Glm53FlashTextConfig
from glm53flash_hf.packing import build_document_layout

HAS_CUDA = torch.cuda.is_available()
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"),
    pytest.mark.skipif(INTERPRETING, reason="TRITON_INTERPRET=1: kernels would run interpreted"),
]


def gpu_test(fn):
    for mark in reversed(gpu):
        fn = mark(fn)
    return fn


# the release's sizes (scripts/gpu_modules.py) with 64 of its 288 experts (module docstring)
RELEASE_TEXT = dict(gpu_modules.RELEASE_TEXT, n_routed_experts=64)

FLOORS = {"mhc": 2.0**-8, "moe": 2.0**-8, "dsa": 1e-2, "kda": 2e-2}
# fp32 results computed from the same fp32 inputs in both paths: only the summation order differs (module docstring)
FLOOR_OVERRIDES = {("mhc", "post"): 1e-4, ("mhc", "comb"): 1e-4}

RECORDS: list[dict] = []


def text_config(sizes: dict, family: str, choice: str) -> Glm53FlashTextConfig:
    """Our text config with the given sizes and ``kernels={family: choice}`` (other families "torch")."""
    kernels = {f: "torch" for f in ("kda", "mhc", "dsa", "moe")}
    kernels[family] = choice
    return Glm53FlashTextConfig(**sizes, kernels=kernels)


@pytest.fixture(scope="module")
def cuda_session():
    """fla importable again (see the module docstring), TF32 off (the fp32 oracle must be fp32), results file."""
    if sys.modules.get("fla", False) is None:
        del sys.modules["fla"]
        # A probe run earlier in this process (another file's GPU test) may have cached "cannot import fla":
        # fresh lazy probes import again.
        for family, (module, probe) in dispatch.PROBES.items():
            dispatch.FUSED_AVAILABILITY[family] = dispatch._lazy_probe(module, probe)
        compat = sys.modules.get("glm53flash_hf.fla_compat")  # its own cache of fla's import failure
        for name in ("import_error", "load", "load_cp"):
            cached = getattr(compat, name, None)
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()
    matmul_tf32, cudnn_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul_tf32, cudnn_tf32
    path = os.environ.get("GLM53_GPU_TEST_JSON")
    if path:
        with open(path, "w") as f:
            json.dump(RECORDS, f, indent=1)


# ------------------------------------------------------------------------------------------------------------ helpers
def three_modules(build, sizes: dict, family: str, device, seed: int = 0):
    """(fused bf16, torch bf16, torch fp32 reference) copies of one module with the same bf16-rounded weights."""
    with torch.device(device):
        master = build(text_config(sizes, family, "torch"))
        randomize_(master, seed)
        torch_bf16 = to_model_dtypes_(copy.deepcopy(master), torch.bfloat16)
        fused = to_model_dtypes_(build(text_config(sizes, family, "fused")), torch.bfloat16)
    fused.load_state_dict(torch_bf16.state_dict(), strict=True)
    reference = master
    reference.load_state_dict(torch_bf16.state_dict(), strict=True)  # same (bf16-rounded) values, fp32 storage
    for m in (fused, torch_bf16, reference):
        m.train()
    return fused, torch_bf16, reference


def forward_backward(module, inputs: list, forward, grad_outputs: list, *, expect_fused: bool, family: str):
    """Run ``forward(module, *inputs)`` (a tensor or a tuple of tensors) and backward with ``grad_outputs`` (one per
    output; ``None``: no gradient from that output).

    Returns ``(outputs, grads)``, grads keyed ``"input<i>"`` and by parameter name. With ``expect_fused`` asserts that
    the dispatcher did not fall back to torch (no "cannot run" warning for ``family``).
    """
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    dispatch._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = forward(module, *inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        used = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None]
        grads = torch.autograd.grad(
            [o for o, _ in used], [*inputs, *(p for _, p in params)], [g for _, g in used], allow_unused=True
        )
    fallbacks = [str(w.message) for w in caught if "cannot run" in str(w.message) and f"'{family}'" in str(w.message)]
    if expect_fused:
        assert not fallbacks, f"{family}: the fused path was not taken: {fallbacks}"
    names = [f"input{i}" for i in range(len(inputs))] + [n for n, _ in params]
    return [o.detach() for o in outs], {n: g for n, g in zip(names, grads) if g is not None}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def check(family: str, seq_len: int, name: str, fused, torch_, ref) -> None:
    """``err_fused <= max(2 * err_torch, FLOORS[family])`` (module docstring); the numbers go to :data:`RECORDS`."""
    assert fused.shape == torch_.shape == ref.shape, f"{family} {name}: shapes differ"
    assert fused.dtype == torch_.dtype, f"{family} {name}: dtypes {fused.dtype} vs {torch_.dtype}"
    assert torch.isfinite(fused).all(), f"{family} {name}: non-finite values in the fused result"
    e_f, e_t = rel_l2(fused, ref), rel_l2(torch_, ref)
    bound = max(2.0 * e_t, FLOOR_OVERRIDES.get((family, name), FLOORS[family]))
    RECORDS.append(dict(family=family, seq_len=seq_len, tensor=name, err_fused=e_f, err_torch=e_t, bound=bound,
                        ok=e_f <= bound))
    assert e_f <= bound, f"{family} S={seq_len} {name}: fused rel. L2 {e_f:.3g} > {bound:.3g} (torch path {e_t:.3g})"


def compare_all(family, seq_len, names, runs):
    """``runs`` = [(outs, grads) fused, torch bf16, fp32 reference]; compare outputs ``names`` and every gradient."""
    (outs_f, grads_f), (outs_t, grads_t), (outs_r, grads_r) = runs
    for name, a, b, r in zip(names, outs_f, outs_t, outs_r):
        check(family, seq_len, name, a, b, r)
    assert grads_f.keys() == grads_t.keys() == grads_r.keys(), f"{family}: different gradient sets"
    for key in grads_f:
        check(family, seq_len, f"d/d{key}", grads_f[key], grads_t[key], grads_r[key])


def run_three(modules, make_inputs, forward, make_grads, family, expect_fused):
    """Forward and backward of the three copies on the same inputs (bf16 for the first two, fp32 for the reference)."""
    inputs, grads = make_inputs(), make_grads()
    runs = []
    for i, module in enumerate(modules):
        dtype = torch.float32 if i == 2 else None
        ins = [t.detach().to(dtype or t.dtype).requires_grad_(t.is_floating_point()) for t in inputs]
        ins = [t if t.is_floating_point() else t.detach() for t in ins]
        gos = [None if g is None else g.to(dtype or g.dtype) for g in grads]
        runs.append(forward_backward(module, ins, forward, gos, expect_fused=expect_fused and i == 0, family=family))
        if module is not modules[-1] and ins[0].is_cuda:
            torch.cuda.synchronize()
    return runs


# ------------------------------------------------------------------------------------------------------- test bodies
def check_kda(sizes: dict, seq_len: int, device, expect_fused: bool) -> None:
    from glm53flash_hf.kda import Glm53FlashLinearAttention

    modules = three_modules(lambda c: Glm53FlashLinearAttention(c, layer_idx=0), sizes, "kda", device, seed=1)
    gen = torch.Generator(device=device).manual_seed(11)
    hidden = sizes["hidden_size"]
    layout = build_document_layout(1, seq_len, device)
    runs = run_three(
        modules,
        lambda: [torch.randn(1, seq_len, hidden, generator=gen, device=device).to(torch.bfloat16)],
        lambda m, x: m(x, layout)[0],
        lambda: [torch.randn(1, seq_len, hidden, generator=gen, device=device).to(torch.bfloat16)],
        "kda",
        expect_fused,
    )
    compare_all("kda", seq_len, ["out"], runs)


def check_dsa(sizes: dict, seq_len: int, device, expect_fused: bool) -> None:
    """The indexer (torch in every path, no gradient) runs once: its selection from the fused bf16 run is given to
    the other two (forward hook), so all three attend over the same tokens."""
    from glm53flash_hf.dsa import Glm53FlashAttention

    modules = three_modules(lambda c: Glm53FlashAttention(c, layer_idx=3, indexer_type="full"), sizes, "dsa", device,
                            seed=2)
    selection = []

    def capture(_module, _inputs, output):
        selection.append(output)

    def replay(_module, _inputs, _output):
        return selection[0]

    hooks = [modules[0].indexer.register_forward_hook(capture)]
    hooks += [m.indexer.register_forward_hook(replay) for m in modules[1:]]
    gen = torch.Generator(device=device).manual_seed(12)
    hidden = sizes["hidden_size"]
    layout = build_document_layout(1, seq_len, device)
    try:
        runs = run_three(
            modules,
            lambda: [torch.randn(1, seq_len, hidden, generator=gen, device=device).to(torch.bfloat16)],
            lambda m, x: m(x, layout)[0],
            lambda: [torch.randn(1, seq_len, hidden, generator=gen, device=device).to(torch.bfloat16)],
            "dsa",
            expect_fused,
        )
    finally:
        for h in hooks:
            h.remove()
    assert len(selection) == 1 and selection[0].shape == (1, seq_len, sizes["index_topk"] + sizes["index_kpool"] - 1)
    compare_all("dsa", seq_len, ["out"], runs)


def check_mhc(sizes: dict, seq_len: int, device, expect_fused: bool) -> None:
    """One mHC site: ``post, comb, collapsed = hc_pre(X)``; ``out = hc_post(collapsed, X, post, comb)`` (the block
    output stands in as ``collapsed``), gradients from ``out``."""
    from glm53flash_hf.dispatch import op_for, requested_backend
    from glm53flash_hf.mhc import Glm53FlashHyperConnection
    from glm53flash_hf.mhc_ops import hc_post_torch

    modules = three_modules(Glm53FlashHyperConnection, sizes, "mhc", device, seed=3)
    gen = torch.Generator(device=device).manual_seed(13)
    n, hidden = sizes["hc_mult"], sizes["hidden_size"]

    def forward(m, x):
        post, comb, col = m(x)
        out = op_for(hc_post_torch, requested_backend(m.config, "mhc"), col, x, post, comb)(col, x, post, comb)
        return post, comb, col, out

    runs = run_three(
        modules,
        lambda: [torch.randn(1, seq_len, n, hidden, generator=gen, device=device).to(torch.bfloat16)],
        forward,
        lambda: [None, None, None, torch.randn(1, seq_len, n, hidden, generator=gen, device=device).to(torch.bfloat16)],
        "mhc",
        expect_fused,
    )
    compare_all("mhc", seq_len, ["post", "comb", "collapsed", "out"], runs)


def check_moe(sizes: dict, seq_len: int, device, expect_fused: bool) -> None:
    """The router (fp32 in every path, from the same bf16 input) runs once: its routing from the fused bf16 run is
    given to the other two (forward hook); the router weight still gets its gradient through the routing weights."""
    from glm53flash_hf.modeling_glm53flash import Glm53FlashMoE

    modules = three_modules(Glm53FlashMoE, sizes, "moe", device, seed=4)
    routing = []

    def capture(_module, _inputs, output):
        routing.append(tuple(o.detach() for o in output))

    def replay(_module, _inputs, output):
        logits, weights, _ = output
        return logits, weights, routing[0][2]  # same expert ids; the weights stay differentiable

    routed = []
    hooks = [modules[0].gate.register_forward_hook(capture)]
    hooks += [m.gate.register_forward_hook(replay) for m in modules[1:]]
    hooks += [m.experts.register_forward_hook(lambda _m, _i, out: routed.append(out.detach())) for m in modules[:2]]
    gen = torch.Generator(device=device).manual_seed(14)
    hidden = sizes["hidden_size"]
    try:
        runs = run_three(
            modules,
            lambda: [torch.randn(1, seq_len, hidden, generator=gen, device=device).to(torch.bfloat16)],
            lambda m, x: m(x),
            lambda: [torch.randn(1, seq_len, hidden, generator=gen, device=device).to(torch.bfloat16)],
            "moe",
            expect_fused,
        )
    finally:
        for h in hooks:
            h.remove()
    compare_all("moe", seq_len, ["out"], runs)
    fused, torch_ = routed[0].double(), routed[1].double()  # the routed experts' outputs, before the shared expert
    bound = 2.0**-7 * torch_.abs() + 2.0**-12 * torch_.abs().max()
    worst = ((fused - torch_).abs() - bound).max().item()
    RECORDS.append(dict(family="moe", seq_len=seq_len, tensor="out fused vs torch (ulp bound)", excess=worst,
                        ok=worst <= 0))
    assert worst <= 0, f"moe: fused and torch outputs more than one bf16 ulp apart (excess {worst:.3g})"


# ------------------------------------------------------------------------------------------------------------- tests
@gpu_test
@pytest.mark.parametrize("seq_len", [8192, 32768])
def test_kda_fused_vs_torch(cuda_session, seq_len):
    check_kda(RELEASE_TEXT, seq_len, cuda_session, expect_fused=True)


@gpu_test
@pytest.mark.parametrize("seq_len", [8192, 32768])
def test_dsa_fused_vs_torch(cuda_session, seq_len):
    check_dsa(RELEASE_TEXT, seq_len, cuda_session, expect_fused=True)


@gpu_test
def test_mhc_fused_vs_torch(cuda_session):
    check_mhc(RELEASE_TEXT, 8192, cuda_session, expect_fused=True)


@gpu_test
def test_moe_fused_vs_torch(cuda_session):
    check_moe(RELEASE_TEXT, 8192, cuda_session, expect_fused=True)


def test_bodies_on_cpu_tiny():
    """The GPU test bodies at tiny shapes on CPU ("fused" falls back to torch there, so fused == torch and every bound
    holds trivially): catches API drift in this file between GPU runs. Checks one non-trivial bound too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for body, seq_len in ((check_kda, 40), (check_dsa, 40), (check_mhc, 24), (check_moe, 24)):
                before = len(RECORDS)
                body(TINY_TEXT, seq_len, torch.device("cpu"), expect_fused=False)
                records = RECORDS[before:]
                assert records and all(r["ok"] for r in records)
                # the torch bf16 path really differs from the fp32 oracle (a bound that measures something)
                assert any(r.get("err_torch", 0) > 1e-4 for r in records), body.__name__
        with pytest.raises(AssertionError, match="fused rel. L2"):
            ref = torch.ones(8)
            check("mhc", 8, "synthetic", ref * 1.1, ref, ref)
    finally:
        torch.set_num_threads(threads)
        del RECORDS[:]
