"""Tests of glm53flash_hf/kda_fused.py, numerics: the fla-core KDA path (conv, chunk_kda with the gate in the kernel,
gated norm, fused_recurrent_kda) vs our torch path, its custom ops and ``torch.compile``, the cached decode and the
frames from the layer to its kernel. The keyword guard and the per-call dispatch: tests/test_kda_fused_dispatch.py.

Oracle: the torch path of :mod:`glm53flash_hf.kda_ops` and :mod:`glm53flash_hf.kda` (``chunk_kda_torch``,
``causal_conv1d_torch``, ``recurrent_kda_torch``, ``Glm53FlashForgetGate``, ``Glm53FlashRMSNormGated``; tested against
transformers' glm5_next and naive recurrences in tests/test_kda.py, whose float64 recurrence and helpers this file
reuses; the layer helpers are in tests/kda_fused_helpers.py). The layer test runs the *same* weights through two
modules built from configs with ``kernels={"kda": "fused"}`` and ``{"kda": "torch"}``, and compares the output and the
gradients of the input and of every parameter (A_log, dt_bias, conv weight, all projections, o_norm weight).

CPU runs of fla's kernels use Triton's interpreter, which must be switched on (``TRITON_INTERPRET=1``) before triton is
first imported and would leak into later tests, so the ``interpreter`` tests run in a child pytest
(:func:`test_interpreter_tests_in_subprocess`, one torch thread) and are skipped in this process. In the child the
``fla_interp`` fixture applies test-only patches (never in fla or in the package): one autotune config
per kernel; ``IS_GATHER_SUPPORTED = False`` in ``fla.ops.kda.chunk_intra`` (the interpreter does not patch the
module-level ``gather = tl.gather`` alias); a module-global ``range`` in every ``fla.*`` module yielding ints whose
``.to(dtype)`` goes through the interpreter (``chunk_delta_h`` calls ``i_t.to(tl.int64)`` on a loop variable); and
``SAFE_GATE_DOT_PRECISION = "ieee"`` (the interpreter has no ``bf16x3``; backward with ``safe_gate`` only); and for
fla's ``compute_dh0_kernel`` (gradient of the conv's initial state) builds
the load mask ``(t < seq_len) & m_d``, which the interpreter types int32 and then rejects ("mask has unsupported
dtype"); masked loads/stores treat an integer mask as ``mask != 0`` (what the compiled kernel does). On CPU the
dispatcher never answers "fused" (CUDA only), so the child forces it by replacing ``dispatch.choose_backend`` with a
function that asks the real probe (:func:`fused_kda_available`, which accepts CPU tensors under the interpreter) and
fails the test if the probe refuses.

Tolerances (fp32 everywhere; ``rel_err`` = max |a - b| / max |reference|; both sides compute in fp32 by different
algorithms, and the interpreter's ``tl.dot`` is an exact fp32 matmul):

* ``KERNEL_TOL = 1e-5``: outputs, states, and the gradients of inputs and of parameters used per token (q/k/v/b/g
  projections, conv weight, o_norm, o_proj).
* ``GATE_PARAM_TOL = 1e-4``: gradients of the gate parameters ``A_log``, ``dt_bias``, ``f_a_proj``, ``f_b_proj``,
  sums of the per-token gate gradient over all tokens, where fla's shared in-chunk rounding adds coherently.
  :func:`test_gate_in_kernel_core_matches_float64` pins both paths against float64.

Why these bounds, the figures measured against them and how far real defects lie above them: ``docs/design.md``,
section "KDA".
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from interp import (
    KERNEL_TOL,
    fla_interpreter_patches,
    run_interpreter_child,
    skip_unless_interpreting,
    tol_for,
)
from kda_fused_helpers import layer_pair, layer_run, packed_batch
from test_kda import naive_kda, rel_err, tiny_config
from tiny import package_frames_at

from glm53flash_hf import dispatch
from glm53flash_hf import kda as kda_module
from glm53flash_hf.kda_ops import causal_conv1d_torch, chunk_kda_torch, recurrent_kda_torch
from glm53flash_hf.packing import build_document_layout


# ------------------------------------------------------------------------------------------------------------ helpers
def assert_rel(a, b, what, tol=None, log=None):
    tol = tol_for(what) if tol is None else tol
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    err = rel_err(a, b)
    if log is not None:
        log[what] = err
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def count_calls(monkeypatch, module, name: str) -> list:
    """Wrap ``module.name`` (for this test) so that every call appends to the returned list, then runs it."""
    calls = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def unpacked_batch(batch):
    """``[batch, 24, 64]`` inputs, trivial layout and loss weights of the unpacked layer tests."""
    x = torch.randn(batch, 24, 64, generator=torch.Generator().manual_seed(2))
    layout = build_document_layout(batch, 24, "cpu")
    assert layout.trivial
    return x, layout, torch.randn(x.shape, generator=torch.Generator().manual_seed(3))



# ============================================================================================ interpreter child (CPU)
@pytest.fixture(scope="module")
def fla_interp():
    """glm53flash_hf.kda_fused with fla's kernels interpreted (the module docstring's test-only patches, applied by
    :func:`interp.fla_interpreter_patches`), one torch thread."""
    skip_unless_interpreting()
    from glm53flash_hf import kda_fused

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with fla_interpreter_patches():
        yield kda_fused
    torch.set_num_threads(threads)


@pytest.fixture
def force_fused(fla_interp, monkeypatch):
    """dispatch.choose_backend -> "fused" for KDA requests other than "torch", after the real probe accepted the
    tensors."""
    def choose(family, requested, *tensors):
        if requested == "torch" or family != "kda":
            return "torch"
        ok, reason = fla_interp.fused_kda_available(*tensors)
        assert ok, f"the probe refused tensors the fused path should take: {reason}"
        return "fused"

    monkeypatch.setattr(dispatch, "choose_backend", choose)
    return fla_interp


@pytest.mark.interpreter
def test_interpreter_tests_in_subprocess():
    """Run this file's interpreter tests in a child pytest with TRITON_INTERPRET=1 set before triton is imported."""
    print(f"interpreter child: {run_interpreter_child(__file__, OMP_NUM_THREADS='1'):.1f} s")


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "packed,lower_bound,batch",
    [(False, -5.0, 2), (True, -5.0, 2), (False, None, 1)],
    ids=["unpacked-bound", "packed-bound", "unpacked-softplus"],
)
def test_layer_fused_matches_torch(force_fused, monkeypatch, packed, lower_bound, batch):
    """The layer's fused path (fla conv, chunk_kda with gate/beta/l2norm in the kernel, gated norm) vs its torch path:
    output and the gradients of the input and of every parameter, fp32.

    * bound -5: ``safe_gate=True`` (fla's bounded-gate path; backward needs the dot-precision patch);
    * packed: 5 segments incl. a padding run (``cu_seqlens`` through conv and chunk_kda);
    * softplus gate (``linear_lower_bound=None``): ``safe_gate=False``, ``-exp(A_log) * softplus`` (one row: fla's
      non-safe gate path is the slowest under the interpreter).
    """
    fused, torch_layer = layer_pair(seed=1, linear_lower_bound=lower_bound)
    if packed:
        x, layout = packed_batch(64)
        weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)) * layout.valid[..., None]
    else:
        x, layout, weight = unpacked_batch(batch)
    calls = count_calls(monkeypatch, force_fused, "chunk_kda_fused")
    out, grads = layer_run(fused, x, layout, weight)
    assert calls == [1], "the fused layer path did not run"
    ref, ref_grads = layer_run(torch_layer, x, layout, weight)
    valid = layout.valid
    log = {}
    assert_rel(out[valid], ref[valid], "output", log=log)
    assert set(grads) == set(ref_grads) and {"forget_gate.A_log", "forget_gate.dt_bias", "conv1d.weight",
                                             "o_norm.weight"} <= set(grads)
    for name, g in grads.items():
        r = ref_grads[name]
        assert r.abs().max() > 0, f"reference gradient of {name} is zero: the test could not see a dropped gradient"
        if name == "hidden_states":
            g, r = g[valid], r[valid]
        assert_rel(g, r, f"grad {name}", log=log)
    print("max rel err", max(log.values()), log)


def activated_gate(g_raw, A_log, dt_bias, lower_bound):
    """GLM's forget gate on its pre-activation ``g_raw`` ``[B, T, H, K]``: ``lb * sigmoid(exp(A_log) * (g_raw +
    dt_bias))``, or ``-exp(A_log) * softplus(g_raw + dt_bias)`` without a lower bound (in ``g_raw``'s dtype)."""
    H, K = g_raw.shape[2], g_raw.shape[3]
    f = g_raw + dt_bias.view(H, K)
    rate = A_log.exp().view(H, 1)
    return lower_bound * torch.sigmoid(rate * f) if lower_bound is not None else -rate * torch.nn.functional.softplus(f)


def naive_gated_kda_f64(q, k, v, g_raw, beta_logits, A_log, dt_bias, lower_bound, cu_seqlens):
    """Float64 token-by-token KDA with GLM's gate: :func:`activated_gate`, ``beta = sigmoid(logits)``, then the
    float64 recurrence ``naive_kda`` of tests/test_kda.py (written from the update rule, not from either
    implementation), the state restarting at every document."""
    q, k, v, g_raw, beta_logits, A_log, dt_bias = (t.double() for t in (q, k, v, g_raw, beta_logits, A_log, dt_bias))
    g = activated_gate(g_raw, A_log, dt_bias, lower_bound)
    return naive_kda(q, k, v, g, torch.sigmoid(beta_logits), cu_seqlens=cu_seqlens)[0]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["bound-packed", "softplus-layer"])
def test_gate_in_kernel_core_matches_float64(fla_interp, monkeypatch, case):
    """``chunk_kda_fused`` with the gate parameters (one fla ``chunk_kda`` call: gate, beta sigmoid, l2-norm in the
    kernel) and, as a control, ``chunk_kda_torch`` with the same arguments (gate and beta activated in torch), vs
    the float64 token loop :func:`naive_gated_kda_f64`: output and
    the gradients of q, k, v, the gate pre-activation, the beta logits, A_log and dt_bias. Bounded gate over 5 packed
    documents (10, 22, 3, 13, 16 tokens; ``safe_gate``) with random inputs; softplus gate on the exact core inputs
    and output gradient of the ``unpacked-softplus`` layer test (captured from its torch path), the case with the
    largest fused-vs-torch gate-parameter difference. fla is held to the bounds of ``interp.tol_for``, the torch path
    to ``KERNEL_TOL`` throughout.
    """
    H, K = 2, 16
    if case == "bound-packed":
        lower_bound = -5.0
        gen = torch.Generator().manual_seed(20)
        cu = torch.tensor([0, 10, 32, 35, 48, 64])
        T = int(cu[-1])
        q, k, v, g_raw = (torch.randn(1, T, H, K, generator=gen) for _ in range(4))
        beta_logits = torch.randn(1, T, H, generator=gen)
        A_log = torch.empty(H).uniform_(-1.0, 1.0, generator=gen)
        dt_bias = 0.5 * torch.randn(H * K, generator=gen)
        do = torch.randn(1, T, H, K, generator=gen)
    else:
        lower_bound = None
        _, layer = layer_pair(seed=1, linear_lower_bound=None)
        x, layout, weight = unpacked_batch(1)
        captured = {}
        original = kda_module.chunk_kda_torch

        @functools.wraps(original)  # op_for finds the fused alternative by the torch op's name
        def capture(q, k, v, g, beta, **kwargs):
            captured["qkv"] = (q.detach(), k.detach(), v.detach())
            o, final = original(q, k, v, g, beta, **kwargs)
            o.register_hook(lambda grad: captured.__setitem__("do", grad.detach()))
            return o, final

        monkeypatch.setattr(kda_module, "chunk_kda_torch", capture)
        layer_run(layer, x, layout, weight)
        q, k, v = captured["qkv"]
        do = captured["do"]
        gate = layer.forget_gate
        with torch.no_grad():
            g_raw = gate.f_b_proj(gate.f_a_proj(x)).view(1, 24, H, K)
            beta_logits = layer.b_proj(x)
            A_log, dt_bias = gate.A_log.clone(), gate.dt_bias.clone()
        cu = torch.tensor([0, 24])
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g_raw, beta_logits, A_log, dt_bias)]
    q, k, v, g_raw, beta_logits, A_log, dt_bias = leaves
    gate = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    o, final = fla_interp.chunk_kda_fused(q, k, v, g_raw, beta_logits, **gate, cu_seqlens=cu)
    assert final is None
    grads = torch.autograd.grad((o * do).sum(), leaves)
    o_t, _ = chunk_kda_torch(q, k, v, g_raw, beta_logits, **gate, cu_seqlens=cu)  # control: the torch op
    grads_t = torch.autograd.grad((o_t * do).sum(), leaves)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    o64 = naive_gated_kda_f64(*leaves64, lower_bound, cu)
    grads64 = torch.autograd.grad((o64 * do.double()).sum(), leaves64)
    log = {}
    assert_rel(o.double(), o64, "fla o", log=log)
    assert_rel(o_t.double(), o64, "torch o", tol=KERNEL_TOL, log=log)
    for name, a, b, ref in zip(("q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias"), grads, grads_t, grads64):
        assert_rel(a.double(), ref, f"fla d{name}", log=log)
        assert_rel(b.double(), ref, f"torch d{name}", tol=KERNEL_TOL, log=log)
    print("max rel err", max(log.values()), log)


@pytest.mark.interpreter
def test_layer_checkpoint_recompute_takes_the_fused_path(force_fused):
    """Reentrant activation checkpointing (first forward without grad, recompute with grad) runs the fused path both
    times and gives the gradients of the plain fused run (bit-equal: same kernels, same inputs)."""
    fused, _ = layer_pair(seed=4)
    x = torch.randn(1, 20, 64, generator=torch.Generator().manual_seed(5))
    layout = build_document_layout(1, 20, "cpu")
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    out, grads = layer_run(fused, x, layout, weight)
    choices = []
    original = dispatch.choose_backend

    def recording(*args):
        choices.append(original(*args))
        return choices[-1]

    dispatch.choose_backend = recording
    try:
        xc = x.clone().requires_grad_()
        out_c = torch.utils.checkpoint.checkpoint(fused, xc, layout, use_reentrant=True)[0]
        (out_c * weight).sum().backward()  # reentrant checkpointing does not support autograd.grad
    finally:
        dispatch.choose_backend = original
    assert choices == ["fused"] * 6, choices  # conv, chunk core, gated norm; forward and recompute
    assert torch.equal(out_c.detach(), out)
    grads_c = [xc.grad] + [p.grad for _, p in fused.named_parameters()]
    for (name, g), gc in zip(grads.items(), grads_c):
        assert gc is not None and torch.equal(gc, g), name


@pytest.mark.interpreter
def test_chunk_and_conv_entry_points_with_states(fla_interp):
    """``chunk_kda_fused`` / ``causal_conv1d_fused`` vs the torch functions:
    activated gate, packed documents of 7, 33 and 8 tokens (chunk 32: one document spans two chunks), per-document
    initial states, final states; values and gradients of every input including the initial states; the conv's final
    state (a copy of inputs) bit-equal.
    """
    gen = torch.Generator().manual_seed(7)
    H, K, T = 2, 16, 48
    cu = torch.tensor([0, 7, 40, 48])
    q, k, v = (torch.randn(1, T, H, K, generator=gen) for _ in range(3))
    g = -5.0 * torch.sigmoid(torch.randn(1, T, H, K, generator=gen))
    beta = torch.sigmoid(torch.randn(1, T, H, generator=gen))
    h0 = 0.5 * torch.randn(3, H, K, K, generator=gen)
    core_inputs = [t.requires_grad_() for t in (q, k, v, g, beta, h0)]
    x = torch.randn(1, T, 3 * H * K, generator=gen).requires_grad_()
    w = (0.5 * torch.randn(3 * H * K, 4, generator=gen)).requires_grad_()
    c0 = torch.randn(3, 3 * H * K, 4, generator=gen).requires_grad_()
    log = {}

    def core(fn, **kw):
        o, ht = fn(*core_inputs[:5], initial_state=core_inputs[5], output_final_state=True, cu_seqlens=cu,
                   chunk_size=32, **kw)
        do, dht = (torch.randn(t.shape, generator=torch.Generator().manual_seed(8)) for t in (o, ht))
        return (o, ht), torch.autograd.grad((o * do).sum() + (ht * dht).sum(), core_inputs)

    (o, ht), grads = core(fla_interp.chunk_kda_fused)
    (ro, rht), rgrads = core(chunk_kda_torch)
    assert_rel(o, ro, "o", log=log)
    assert_rel(ht, rht, "final state", log=log)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), grads, rgrads):
        assert_rel(a, b, f"d{name}", log=log)

    def conv(fn, **kw):
        y, yt = fn(x, w, cu_seqlens=cu, activation="silu", initial_state=c0, output_final_state=True, **kw)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9))
        return (y, yt), torch.autograd.grad((y * dy).sum(), [x, w, c0])

    (y, yt), cgrads = conv(fla_interp.causal_conv1d_fused)
    (ry, ryt), rcgrads = conv(causal_conv1d_torch)
    assert_rel(y.contiguous(), ry.contiguous(), "conv y", log=log)
    assert torch.equal(yt, ryt), "conv final state (a copy of inputs) differs"
    for name, a, b in zip(("dx", "dweight", "dinitial_state"), cgrads, rcgrads):
        assert_rel(a, b, f"conv {name}", log=log)
    print("max rel err", max(log.values()), log)


@pytest.mark.interpreter
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bound", "softplus"])
def test_fused_recurrent_step_matches_torch(fla_interp, lower_bound):
    """``recurrent_kda_fused`` without gradients (fla's ``fused_recurrent_kda``: gate, beta sigmoid, l2-norm in the
    kernel) vs ``recurrent_kda_torch`` on the gate of ``Glm53FlashForgetGate``: one decode token per row, B=2, from a
    random fp32 state; output and new state. The input state is not modified."""
    layer, _ = layer_pair(seed=10, linear_lower_bound=lower_bound)
    gate = layer.forget_gate
    gen = torch.Generator().manual_seed(11)
    B, H, K = 2, 2, 16
    x = torch.randn(B, 1, 64, generator=gen)
    q, k, v = (torch.randn(B, 1, H, K, generator=gen) for _ in range(3))
    state = torch.randn(B, H, K, K, generator=gen)
    state_before = state.clone()
    with torch.no_grad():
        g_raw = gate.f_b_proj(gate.f_a_proj(x)).view(B, 1, H, K)
        beta_logits = layer.b_proj(x)
        o, new_state = fla_interp.recurrent_kda_fused(q, k, v, g_raw, beta_logits, A_log=gate.A_log,
                                                      dt_bias=gate.dt_bias, lower_bound=gate.lower_bound,
                                                      initial_state=state, output_final_state=True)
        ro, rstate = recurrent_kda_torch(q, k, v, gate(x), torch.sigmoid(beta_logits.float()), initial_state=state,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    log = {}
    assert_rel(o, ro, "o", log=log)
    assert_rel(new_state, rstate, "state", log=log)
    assert torch.equal(state, state_before)
    print("max rel err", max(log.values()), log)


# ------------------------------------------------------------------------------------------ custom ops, compile
OPCHECK_PASSED = {name: "SUCCESS" for name in ("test_schema", "test_autograd_registration", "test_faketensor",
                                                "test_aot_dispatch_dynamic")}


def opcheck(op, *args):
    """``torch.library.opcheck`` with its default tests (schema, autograd registration, fake tensor,
    aot_dispatch_dynamic), which raises on a failure; asserts that all four ran."""
    assert torch.library.opcheck(op, args) == OPCHECK_PASSED


def core_inputs(seed, T=20, H=1, K=16, requires_grad=True):
    """Random ``q, k, v, g, beta`` (``[1, T, H, K]``, beta ``[1, T, H]``) and the generator, for the op tests."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g = (torch.randn(1, T, H, K, generator=gen) for _ in range(4))
    beta = torch.randn(1, T, H, generator=gen)
    tensors = [q, k, v, g, beta]
    return [t.requires_grad_(requires_grad) for t in tensors], gen


class _ZeroFilledEmpty:
    """``torch`` for one fla module, with ``empty`` returning zeros (test-only, see test_opcheck_chunk_kda)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        return torch.zeros(*args, **kwargs)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["gate-in-kernel", "packed"])
def test_opcheck_chunk_kda(fla_interp, monkeypatch, case):
    """glm53flash::fla_chunk_kda_fwd (differentiable; its autograd formula calls fla_chunk_kda_bwd) and
    fla_chunk_kda_bwd on that forward's residuals. ``gate-in-kernel``: the layer's flags (gate, beta sigmoid and
    l2-norm in the kernel, bound -5 with safe_gate), an initial state and the final state; ``packed``: activated gate
    and beta (chunk_kda_fused's flags), two documents (chunk indices of data-dependent length), final states.

    fla allocates the residual ``Aqk`` with ``torch.empty`` and writes only the blocks its kernels read back (the
    causal lower part of each chunk); opcheck compares every output of two runs, so the test makes that allocation
    zero-filled (in ``fla.ops.kda.chunk_intra`` only, for this test)."""
    import fla.ops.kda.chunk_intra as chunk_intra

    monkeypatch.setattr(chunk_intra, "torch", _ZeroFilledEmpty())
    (q, k, v, g, beta), gen = core_inputs(50)
    H, K = q.shape[2], q.shape[3]
    if case == "gate-in-kernel":
        A_log = torch.randn(H, generator=gen).requires_grad_()
        dt_bias = torch.randn(H * K, generator=gen).requires_grad_()
        h0 = torch.randn(1, H, K, K, generator=gen).requires_grad_()
        cu, flags = None, (True, True, True, True, -5.0, 32)
    else:
        with torch.no_grad():
            g.copy_(-torch.sigmoid(g))
            beta.copy_(torch.sigmoid(beta))
        A_log = dt_bias = h0 = None
        cu, flags = torch.tensor([0, 7, 20]), (True, False, False, False, None, 32)
    op = torch.ops.glm53flash.fla_chunk_kda_fwd
    args = (q, k, v, g, beta, A_log, dt_bias, h0, cu, K**-0.5, True, *flags)
    opcheck(op, *args)
    detached = [t.detach() if isinstance(t, torch.Tensor) else t for t in args]
    o, final, *residuals = op(*detached)
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(final.shape, generator=gen)
    opcheck(torch.ops.glm53flash.fla_chunk_kda_bwd, do, dht, *detached[:9], *residuals, K**-0.5, *flags)


@pytest.mark.interpreter
def test_opcheck_conv_norm_recurrent(fla_interp):
    """glm53flash::fla_causal_conv1d_fwd / _bwd (two documents, initial and final states), fla_rms_norm_gated_fwd /
    _bwd, and the inference-only fla_fused_recurrent_kda (inputs without grad)."""
    gen = torch.Generator().manual_seed(51)
    x = torch.randn(1, 20, 32, generator=gen).requires_grad_()
    w = torch.randn(32, 4, generator=gen).requires_grad_()
    c0 = torch.randn(2, 32, 4, generator=gen).requires_grad_()
    cu = torch.tensor([0, 7, 20])
    conv = torch.ops.glm53flash.fla_causal_conv1d_fwd
    opcheck(conv, x, w, c0, cu, "silu", True)
    y, _, indices = conv(x.detach(), w.detach(), c0.detach(), cu, "silu", True)
    dy, dht = torch.randn(y.shape, generator=gen), torch.randn(c0.shape, generator=gen)
    opcheck(torch.ops.glm53flash.fla_causal_conv1d_bwd, dy, dht, x.detach(), w.detach(), c0.detach(), cu, indices,
            "silu")

    xn, gate = (torch.randn(1, 6, 2, 16, generator=gen).requires_grad_() for _ in range(2))
    weight = torch.rand(16, generator=gen).requires_grad_()
    norm = torch.ops.glm53flash.fla_rms_norm_gated_fwd
    opcheck(norm, xn, gate, weight, 1e-5)
    _, rstd = norm(xn.detach(), gate.detach(), weight.detach(), 1e-5)
    opcheck(torch.ops.glm53flash.fla_rms_norm_gated_bwd, torch.randn(xn.shape, generator=gen), xn.detach(),
            gate.detach(), weight.detach(), rstd, 1e-5)

    q, k, v, g = (torch.randn(2, 1, 2, 16, generator=gen) for _ in range(4))
    beta = torch.randn(2, 1, 2, generator=gen)
    state = torch.randn(2, 2, 16, 16, generator=gen)
    opcheck(torch.ops.glm53flash.fla_fused_recurrent_kda, q, k, v, g, beta, torch.randn(2, generator=gen),
            torch.randn(32, generator=gen), state, None, -5.0)


@pytest.mark.interpreter
def test_ops_equal_fla_entry_points(fla_interp):
    """The op-based functions equal fla's own entry points (their autograd Functions) bit for bit, values and every
    gradient: chunk_kda_fused with the gate parameters vs ``fla.ops.kda.chunk_kda`` with the gate, beta sigmoid and
    l2-norm in the kernel (bound -5, safe_gate, two packed documents, initial and final states), causal_conv1d_fused vs
    ``fla.modules.causal_conv1d.causal_conv1d`` (two documents, initial and final states) and rms_norm_gated_fused vs
    ``fla.modules.norm.fused_norm_gate.rms_norm_gated``."""
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.ops.kda import chunk_kda

    (q, k, v, g, beta), gen = core_inputs(53, H=2)
    A_log = torch.randn(2, generator=gen).requires_grad_()
    dt_bias = torch.randn(32, generator=gen).requires_grad_()
    h0 = torch.randn(2, 2, 16, 16, generator=gen).requires_grad_()
    cu = torch.tensor([0, 7, 20])
    leaves = (q, k, v, g, beta, A_log, dt_bias, h0)
    do, dht = torch.randn(1, 20, 2, 16, generator=gen), torch.randn(2, 2, 16, 16, generator=gen)

    def fla_core():
        return chunk_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         safe_gate=True, lower_bound=-5.0, cu_seqlens=cu, cu_seqlens_cpu=cu, A_log=A_log,
                         dt_bias=dt_bias, chunk_size=32)

    def ours_core():
        return fla_interp.chunk_kda_fused(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                                          initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=32)

    x = torch.randn(1, 20, 24, generator=gen).requires_grad_()
    w = torch.randn(24, 4, generator=gen).requires_grad_()
    c0 = torch.randn(2, 24, 4, generator=gen).requires_grad_()
    dy, dct = torch.randn(1, 20, 24, generator=gen), torch.randn(2, 24, 4, generator=gen)
    xn, gate = (torch.randn(1, 20, 2, 16, generator=gen).requires_grad_() for _ in range(2))
    nw = torch.rand(16, generator=gen).requires_grad_()
    cases = {
        "chunk_kda": (fla_core, ours_core, leaves, (do, dht)),
        "causal_conv1d": (
            lambda: causal_conv1d(x=x, weight=w, initial_state=c0, output_final_state=True, activation="silu",
                                  cu_seqlens=cu, cu_seqlens_cpu=cu),
            lambda: fla_interp.causal_conv1d_fused(x, w, cu_seqlens=cu, initial_state=c0, output_final_state=True),
            (x, w, c0), (dy, dct)),
        "rms_norm_gated": (
            lambda: (rms_norm_gated(x=xn, g=gate, weight=nw, bias=None, activation="sigmoid", eps=1e-5),),
            lambda: (fla_interp.rms_norm_gated_fused(xn, gate, nw, 1e-5),),
            (xn, gate, nw), (do,)),
    }
    for name, (theirs, ours, inputs, cotangents) in cases.items():
        results = []
        for fn in (theirs, ours):
            outs = fn()
            results.append([o.detach() for o in outs] + list(torch.autograd.grad(outs, inputs, cotangents)))
        for i, (a, b) in enumerate(zip(*results)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: result {i} differs"


@pytest.mark.interpreter
def test_compile_fullgraph_equals_eager(fla_interp):
    """``torch.compile(fullgraph=True)`` (inductor) of the layer's fused core on two packed documents: fla's conv ->
    split -> chunk_kda_fused with the gate parameters (bound -5) -> the gated norm, with cu_seqlens (read inside the
    ops). No graph break, and the compiled function equals the eager one bit for bit: output, final states and the
    gradients of every input (the kernels run inside the ops; between them only views)."""
    gen = torch.Generator().manual_seed(52)
    H, K, T = 1, 16, 20
    cu = torch.tensor([0, 7, 20])
    x = torch.randn(1, T, 3 * H * K, generator=gen).requires_grad_()
    w = (0.5 * torch.randn(3 * H * K, 4, generator=gen)).requires_grad_()
    g_raw, gate = (torch.randn(1, T, H, K, generator=gen).requires_grad_() for _ in range(2))
    beta_logits = torch.randn(1, T, H, generator=gen).requires_grad_()
    A_log = torch.randn(H, generator=gen).requires_grad_()
    dt_bias = torch.randn(H * K, generator=gen).requires_grad_()
    norm_w = torch.rand(K, generator=gen).requires_grad_()
    leaves = (x, w, g_raw, gate, beta_logits, A_log, dt_bias, norm_w)

    def core(x, w, g_raw, gate, beta_logits, A_log, dt_bias, norm_w):
        y, _ = fla_interp.causal_conv1d_fused(x, w, cu_seqlens=cu)
        q, k, v = y.view(1, T, 3, H, K).unbind(2)
        o, final = fla_interp.chunk_kda_fused(q, k, v, g_raw, beta_logits, A_log=A_log, dt_bias=dt_bias,
                                              lower_bound=-5.0, output_final_state=True, cu_seqlens=cu, chunk_size=32)
        return fla_interp.rms_norm_gated_fused(o, gate, norm_w, 1e-5), final

    torch._dynamo.reset()
    compiled = torch.compile(core, fullgraph=True)
    do = torch.randn(1, T, H, K, generator=gen)
    dht = torch.randn(2, H, K, K, generator=gen)
    results = []
    for fn in (core, compiled):
        out, final = fn(*leaves)
        results.append((out.detach(), final.detach(), *torch.autograd.grad((out, final), leaves, (do, dht))))
    names = ("out", "final state", "dx", "dconv_weight", "dg_raw", "dgate", "dbeta_logits", "dA_log", "ddt_bias",
             "dnorm_weight")
    for name, a, b in zip(names, *results):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------- cached decode, call frames
@pytest.mark.interpreter
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bound", "softplus"])
def test_cached_decode_takes_the_fused_step(force_fused, monkeypatch, lower_bound):
    """The layer with a cache: prefill 9 tokens, 3 decode steps without gradients, then one with gradients. With
    kernels="fused" every call runs fla's causal_conv1d (from the cached conv state), each no-grad decode step fla's
    fused_recurrent_kda (gate and beta in the kernel) and the decode step with gradients fla's chunk_kda (one token
    from the cached state); with "torch" causal_conv1d_torch and recurrent_kda_torch. Outputs and the cached recurrent
    and conv states agree (fp32, bound 1e-5 relative), and equal the uncached forward over all 13
    tokens."""
    from transformers import DynamicCache

    fused, torch_layer = layer_pair(seed=4, linear_lower_bound=lower_bound)
    config = tiny_config(linear_lower_bound=lower_bound)
    x = torch.randn(2, 13, 64, generator=torch.Generator().manual_seed(5))
    steps = count_calls(monkeypatch, force_fused, "_RECURRENT")
    chunks = count_calls(monkeypatch, force_fused, "chunk_kda_fused")
    outs = {}
    for name, layer in (("fused", fused), ("torch", torch_layer)):
        cache = DynamicCache(config=config)
        with torch.no_grad():
            parts = [layer(x[:, :9], build_document_layout(2, 9, "cpu"), cache=cache)[0]]
            for t in range(9, 12):
                parts.append(layer(x[:, t : t + 1], build_document_layout(2, 1, "cpu"), cache=cache)[0])
        last = layer(x[:, 12:], build_document_layout(2, 1, "cpu"), cache=cache)[0]
        assert last.requires_grad
        parts.append(last.detach())
        outs[name] = (torch.cat(parts, dim=1), cache.layers[0].recurrent_states[0], cache.layers[0].conv_states[0])
    assert len(steps) == 3, "the fused decode step was not taken"
    assert len(chunks) == 2, "the prefill and the decode step with gradients did not run fla's chunk_kda"
    for a, b, what in zip(outs["fused"], outs["torch"], ("output", "recurrent state", "conv state")):
        assert_rel(a.detach(), b.detach(), what, tol=1e-5)
    with torch.no_grad():
        full = torch_layer(x, build_document_layout(2, 13, "cpu"))[0]
    assert_rel(outs["fused"][0], full, "cached vs uncached", tol=1e-5)


def fla_function(name: str, file: str):
    """Matcher of :func:`package_frames_at` for fla's function ``name`` defined in ``fla/ops/kda/<file>``."""
    path = os.path.join("fla", "ops", "kda", file)
    return lambda code: code.co_name == name and code.co_filename.endswith(path)


@pytest.mark.interpreter
def test_frames_from_the_layer_to_its_kernel(force_fused):
    """From the KDA layer's forward to its kernel: at most 3 frames of the package's own code, on the fused path (to
    fla's ``chunk_kda_fwd``; for a cached decode step without gradients to fla's ``fused_recurrent_kda``) and on the
    torch path (to the chunked core ``_chunk_kda_core``; for the decode step to ``recurrent_kda_torch``)."""
    from transformers import DynamicCache

    fused, torch_layer = layer_pair(seed=6)
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(7))

    def prefill_and_decode(layer, kernel, step):
        cache = DynamicCache(config=tiny_config())
        return (package_frames_at(lambda: layer(x[:, :8], build_document_layout(1, 8, "cpu"), cache=cache), kernel),
                package_frames_at(lambda: layer(x[:, 8:], build_document_layout(1, 1, "cpu"), cache=cache), step))

    chunk, step = fla_function("chunk_kda_fwd", "chunk_fwd.py"), fla_function("fused_recurrent_kda",
                                                                              "fused_recurrent.py")
    with torch.no_grad():
        found = dict(zip(("fused", "fused decode"), prefill_and_decode(fused, chunk, step)))
        found.update(zip(("torch", "torch decode"), prefill_and_decode(
            torch_layer, lambda c: c.co_name == "_chunk_kda_core", lambda c: c.co_name == "recurrent_kda_torch")))
    print("\n".join(f"{name}: {' -> '.join(frames)}" for name, frames in found.items()))
    for frames in found.values():
        assert frames[0] == "Glm53FlashLinearAttention.forward" and len(frames) <= 3, frames
