"""GPU tests at realistic shapes: each operator family's module with ``kernels={family: "fused"}`` against the same
module with ``"torch"``, both in bf16, each measured against an fp32 evaluation of the same module (torch path) on the
same bf16-rounded weights and inputs. Marked ``gpu``; skipped without CUDA (run by ``scripts/gpu_check.sh``).

Shapes: the release's (model-spec §1): hidden 4096; KDA 64 heads x 128; DSA 64 heads, q_lora 1536, kv_lora 512,
qk_nope 256, v 256, indexer 32 x 128, top-k 2048, k-pool 4 (width 2051); mHC 4 streams, 20 Sinkhorn steps; MoE expert
width 2048, top-8 of 64 experts (the release has 288: 64 keeps the fp32 reference copy and its gradients within
memory, and 1024 rows per expert is as much GEMM work per expert as the release at 36k tokens). S = 8192 tokens for
every family, plus 32768 for KDA and DSA. bf16 activations and weights; the parameters transformers keeps in fp32
(``_keep_in_fp32_modules_strict``: conv1d, A_log, dt_bias, router weight and bias, mHC base/scale) stay fp32.

Why an fp32 oracle: two bf16 paths differ from each other by their rounding, which says nothing about which is right.
Each bf16 path's error is measured against the fp32 evaluation as a relative L2 error ``||a - ref|| / ||ref||`` of
the outputs and of the gradients of the input and of every parameter, and the fused path must satisfy
``err_fused <= max(2 * err_torch, floor)``: no more than twice the torch path's own bf16 error, or the family's floor
where the fused kernel by design computes in lower precision than our torch path (which keeps fp32 inside):

* mHC, MoE: floor ``2**-8`` (one bf16 rounding, relative): both kernels keep every intermediate in fp32 and round
  where the torch path rounds (tests/test_triton_mhc.py, tests/test_triton_moe.py show ulp agreement). mHC's ``post``
  and ``comb`` are fp32 functions of the same inputs in all three runs (the bf16 streams are exact in fp32), so the
  torch path's error there is 0 and the floor is 1e-4: fp32 sums over 16384 terms in another order (about
  sqrt(16384) * 6e-8 = 8e-6) with a margin of 10 for the Sinkhorn steps (tests/test_triton_mhc.py's GPU test).
* DSA: floor ``1e-2``: the sparse kernel feeds bf16 operands to its tensor-core products (scores and P @ V with P
  rounded to bf16, relative 2**-9 each, over 2051 keys); xtuner's bound for its FlashMLA sparse kernel against its torch
  path is 1e-2 relative L2 for the gradients (kernels.md §4.3).
* KDA: floor ``2e-2``: fla's ``chunk_kda`` rounds the operands of its chunk products to bf16 and chains about four of
  them per chunk plus the state update; xtuner's bound for the same kernel against an fp32 token loop is 2e-2 relative
  L2 for the gradients (model-spec §14 "KDA chunk vs fp32 token loop").

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

import pytest
import torch

from glm53flash_hf import dispatch, mhc
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


RELEASE_TEXT = dict(
    vocab_size=1024,
    hidden_size=4096,
    intermediate_size=12288,
    moe_intermediate_size=2048,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    indexer_types=["full", "full", "full", "full"],
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=256,
    qk_rope_head_dim=0,
    v_head_dim=256,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
    index_kpool=4,
    index_kpool_always_select_tail=True,
    linear_num_heads=64,
    linear_head_dim=128,
    linear_conv_kernel_dim=4,
    linear_lower_bound=-5.0,
    n_routed_experts=64,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    swiglu_limit=10.0,
    hc_mult=4,
    hc_eps=1e-6,
    hc_sinkhorn_iters=20,
    rms_norm_eps=1e-5,
    attention_bias=False,
    attention_dropout=0.0,
    pad_token_id=0,
)

TINY_TEXT = dict(
    RELEASE_TEXT,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    v_head_dim=16,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=16,
    linear_num_heads=2,
    linear_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
)

# transformers' Glm5NextPreTrainedModel._keep_in_fp32_modules_strict, plus the standalone mHC module's names.
KEEP_FP32 = ("e_score_correction_bias", "gate.weight", "conv1d", "dt_bias", "A_log", "base", "scale")

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
        if hasattr(dispatch, "_lazy_probe"):
            for family, (module, probe) in {"kda": ("fla_kda", "fused_kda_available"),
                                            "mhc": ("triton_mhc", "fused_mhc_available"),
                                            "dsa": ("triton_dsa", "fused_dsa_available"),
                                            "moe": ("triton_moe", "fused_moe_available")}.items():
                dispatch.FUSED_AVAILABILITY[family] = dispatch._lazy_probe(module, probe)
        kernels = sys.modules.get("glm53flash_hf.fla_kda")  # its own cache of fla's import failure
        for name in ("_fla_import_error", "_load_fla"):
            cached = getattr(kernels, name, None)
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
def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Non-degenerate weights at realistic scales: fan-in scaled normals for matrices (``gate_up_proj`` twice as
    wide, so the SwiGLU clamp at 10 is reached by a few activations), norms near 1, fp32 gate parameters in ranges
    where the KDA decay is neither 0 nor 1, random mHC base/scale and k-pool gate, a small router bias."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen, device=gen.device) * std + mean

    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.rand(p.shape, generator=gen, device=gen.device) - 0.5)
            elif leaf == "dt_bias":
                p.copy_(normal(p.shape, 0.5))
            elif leaf == "scale":
                p.copy_(normal(p.shape, 0.2, 1.0))
            elif leaf in ("base", "index_kpool_compress_ape"):
                p.copy_(normal(p.shape, 0.5))
            elif "norm" in name:
                p.copy_(normal(p.shape, 0.1, 1.0 if leaf == "weight" else 0.0))
            elif p.dim() >= 2:
                fan_in = p[0].numel() if p.dim() == 2 else p.shape[-1] * (p.shape[1] if "conv" in name else 1)
                p.copy_(normal(p.shape, (2.0 if leaf == "gate_up_proj" else 1.0) / fan_in**0.5))
            else:
                p.copy_(normal(p.shape, 0.1))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(normal(b.shape, 0.05))


def to_model_dtypes_(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module.to(dtype)`` except the tensors transformers keeps in fp32 (:data:`KEEP_FP32`)."""
    module.to(dtype)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if any(key in name for key in KEEP_FP32):
                t.data = t.data.float()
    return module


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
        lambda m, x: m(x, layout),
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
    from glm53flash_hf.dispatch import requested_backend
    from glm53flash_hf.mhc import Glm53FlashHyperConnection

    modules = three_modules(Glm53FlashHyperConnection, sizes, "mhc", device, seed=3)
    gen = torch.Generator(device=device).manual_seed(13)
    n, hidden = sizes["hc_mult"], sizes["hidden_size"]

    def forward(m, x):
        post, comb, col = m(x)
        out = mhc.hc_post(col, x, post, comb, backend=requested_backend(m.config, "mhc"))
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
    from glm53flash_hf.moe import Glm53FlashMoE

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
