"""Tests of glm53flash_hf/mhc_fused.py: fused hc_post / hc_pre (Triton, custom autograd) vs the torch path.

Oracle: ``glm53flash_hf.mhc_ops.hc_post_torch`` / ``hc_pre_torch`` (themselves tested against transformers'
glm5_next in tests/test_mhc.py), values and the gradients of every input; for bf16 gradients also a float64
evaluation.

CPU tests run the kernels under Triton's interpreter. ``TRITON_INTERPRET=1`` must be set before triton is first imported
(triton.language's own ``@jit`` helpers such as ``tl.zeros`` are decorated at import), and setting it in this process
would leak into every later test (GPU tests would silently run interpreted). So the ``interpreter`` tests run in a
child pytest process started with ``TRITON_INTERPRET=1`` (:func:`test_interpreter_tests_in_subprocess`); in this process
they are skipped with that reason. Running ``TRITON_INTERPRET=1 pytest tests/test_mhc_fused.py -m interpreter`` runs
them directly. The kernels use no autotuner.

Tolerances:
* fp32: 1e-5 relative to the largest reference magnitude: only the fp32 summation order differs.
* bf16 values: at most one bf16 ulp (``2**-7`` of the value) per element, plus 1e-6 of the scale for fp32 order noise
  near zero: both paths round the same fp32 quantity once to bf16 (the kernel with round-to-nearest-even, as torch);
  a different fp32 summation order may move a value across a rounding boundary.
* bf16 ``dy``, ``dpost``, ``dcomb`` of hc_post: the reference rounds intermediates to bf16 that the kernel keeps in
  fp32 (``dy``: each ``post_h * g_h`` product and the sum; ``dpost``: each ``g * y`` product and the sum; ``dcomb``:
  the sum before its cast to fp32), so the bound is the reference's own rounding error: one ulp of the result plus
  half an ulp (``2**-8``) of each rounded product. Against a float64 evaluation the kernel is held to one ulp
  (``dy``) or 1e-5 (the fp32 ``dpost``/``dcomb``).
"""

from __future__ import annotations

import pytest
import torch
from interp import INTERPRETING, interpreted_module, run_interpreter_child

from glm53flash_hf import dispatch, mhc, mhc_ops  # noqa: F401  (importing mhc registers the fused ops)

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton; see setup.cfg [test])")

KW = dict(sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-5)


@pytest.fixture
def tm():
    """glm53flash_hf.mhc_fused with interpreted kernels; one intra-op thread (tiny shapes)."""
    yield from interpreted_module("mhc_fused")


@pytest.mark.interpreter
def test_interpreter_tests_in_subprocess():
    """Run this file's interpreter tests in a child pytest with TRITON_INTERPRET=1 set before triton is imported."""
    run_interpreter_child(__file__)


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def assert_rel(a, b, tol, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    err = rel(a, b)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def assert_ulps(ours, ref, what, ulps=1.0, extra=None):
    """|ours - ref| <= ulps * 2**-7 * |ref| + 1e-6 * max|ref| (+ extra, elementwise): at most `ulps` bf16 ulps."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, what
    o, r = ours.double(), ref.double()
    bound = ulps * 2.0**-7 * r.abs() + 1e-6 * r.abs().max()
    if extra is not None:
        bound = bound + extra
    worst = ((o - r).abs() - bound).max().item()
    assert worst <= 0, f"{what}: exceeds the bound by {worst:.3g} (max |diff| {(o - r).abs().max().item():.3g})"


def post_inputs(b, s, n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(b, s, d, generator=g).to(dtype).requires_grad_()
    res = torch.randn(b, s, n, d, generator=g).to(dtype).requires_grad_()
    post = (2 * torch.rand(b, s, n, generator=g)).requires_grad_()
    comb = torch.rand(b, s, n, n, generator=g).requires_grad_()
    grad = torch.randn(b, s, n, d, generator=g).to(dtype)
    return (y, res, post, comb), grad


def pre_inputs(b, s, n, d, dtype, fn_dtype=torch.float32, fn_std=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = (2 + n) * n
    x = torch.randn(b, s, n, d, generator=g).to(dtype).requires_grad_()
    fn = (fn_std * torch.randn(m, n * d, generator=g)).to(fn_dtype).requires_grad_()
    base = torch.randn(m, generator=g).requires_grad_()
    scale = (0.5 + 1.5 * torch.rand(3, generator=g)).requires_grad_()
    grads = (torch.randn(b, s, n, generator=g), torch.randn(b, s, n, n, generator=g),
             torch.randn(b, s, d, generator=g).to(dtype))
    return (x, fn, base, scale), grads


def run(fn, inputs, grads, **kw):
    outs = fn(*inputs, **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = grads if isinstance(grads, tuple) else (grads,)
    got = torch.autograd.grad(outs, inputs, grads)
    return [o.detach() for o in outs], list(got)


# ------------------------------------------------------------------------------------------------------------ hc_post
@pytest.mark.interpreter
@pytest.mark.parametrize("shape", [(2, 5, 4, 48), (1, 3, 3, 20)])  # D not a power of 2; N=3 pads the stream block
def test_hc_post_fp32(tm, shape):
    inputs, grad = post_inputs(*shape, torch.float32)
    (out,), grads = run(tm.hc_post_fused, inputs, grad)
    (ref,), ref_grads = run(mhc_ops.hc_post_torch, inputs, grad)
    assert_rel(out, ref, 1e-5, "out")
    for name, a, b in zip(("dy", "dresidual", "dpost", "dcomb"), grads, ref_grads):
        assert_rel(a, b, 1e-5, name)


@pytest.mark.interpreter
def test_hc_post_bf16(tm):
    inputs, grad = post_inputs(2, 5, 4, 48, torch.bfloat16, seed=1)
    y, res, post, comb = inputs
    (out,), (dy, dres, dpost, dcomb) = run(tm.hc_post_fused, inputs, grad)
    (ref,), (rdy, rdres, rdpost, rdcomb) = run(mhc_ops.hc_post_torch, inputs, grad)
    # same fp32 quantities rounded once to bf16 in both paths
    assert_ulps(out, ref, "out")
    assert_ulps(dres, rdres, "dresidual")
    assert dpost.dtype == dcomb.dtype == torch.float32
    # float64 evaluations from the same bf16-rounded post/comb
    y64, r64, g64 = y.detach().double(), res.detach().double(), grad.double()
    p64 = post.detach().to(torch.bfloat16).double()
    dy64 = (p64.unsqueeze(-1) * g64).sum(-2)
    dpost64 = (g64 * y64.unsqueeze(-2)).sum(-1)
    dcomb64 = torch.einsum("bsid,bshd->bsih", r64, g64)
    assert_ulps(dy, dy64.to(torch.bfloat16), "dy vs float64")
    assert_rel(dpost.double(), dpost64, 1e-5, "dpost vs float64")
    assert_rel(dcomb.double(), dcomb64, 1e-5, "dcomb vs float64")
    # vs the torch path: its own rounding (half an ulp per rounded product, one ulp of the result)
    terms = (p64.unsqueeze(-1) * g64).abs().sum(-2)
    assert_ulps(dy, rdy, "dy", extra=2.0**-8 * terms)
    assert_ulps(dpost, rdpost, "dpost", extra=2.0**-8 * (g64 * y64.unsqueeze(-2)).abs().sum(-1))
    assert_ulps(dcomb, rdcomb, "dcomb")


def _rounding_probe_kernel():
    """A kernel storing the bf16 round-on-the-bits helper's rounding of its input, as the sparse-MLA kernels use it
    (cast to bf16) and as the mHC and MoE kernels do (kept in fp32) (defined lazily: only interpreter children use
    it; a jit function looks its callees up in this module's globals)."""
    import triton.language as tl

    global triton_utils
    from glm53flash_hf import triton_utils

    @triton.jit
    def kernel(x_ptr, o_dsa, o_shared, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(x_ptr + i)
        tl.store(o_dsa + i, triton_utils.round_to(x, tl.bfloat16).to(tl.bfloat16).to(tl.float32))
        tl.store(o_shared + i, triton_utils.round_to(x, tl.bfloat16))

    return kernel


@pytest.mark.interpreter
def test_rounding_helpers_keep_nan(tm):
    """The bf16 round-on-the-bits helpers of the kernel modules keep every NaN a NaN. The GPU's arithmetic NaN
    is 0x7FFFFFFF, which the bit rounding alone would turn into 0x80000000 (-0.0): the interpreter's own NaNs
    (0x7FC00000) never show this, so the patterns are fed in directly. Ordinary values round to nearest even."""
    kernel = _rounding_probe_kernel()

    bits = torch.tensor([0x7FFFFFFF, 0x7FC00000, 0xFFC00000 - 2**32, 0x7F800001, 0x3F800000, 0x3F808000, 0x3F818000,
                         0x3F80C000], dtype=torch.int32)
    x = bits.view(torch.float32)
    outs = [torch.empty(8) for _ in range(2)]
    kernel[(1,)](x, *outs, N=8)
    expect = x.to(torch.bfloat16).float()  # torch rounds to nearest even
    for name, out in zip(("round_to(...).to(bf16)", "round_to"), outs):
        assert torch.isnan(out[:4]).all(), (name, out[:4])
        assert torch.equal(out[4:], expect[4:]), (name, out[4:], expect[4:])


@pytest.mark.interpreter
def test_hc_post_bf16_mixing_weights(tm):
    """bf16 residual with bf16 post/comb (accepted by the probe): the kernel reads the 16-bit weights through the same
    rounding helper (cast to fp32 first) and equals the torch path to one bf16 ulp."""
    inputs, grad = post_inputs(2, 3, 4, 32, torch.bfloat16, seed=4)
    y, res, post, comb = inputs
    inputs16 = (y, res, post.detach().bfloat16().requires_grad_(), comb.detach().bfloat16().requires_grad_())
    (out,), _ = run(tm.hc_post_fused, inputs16, grad)
    (ref,), _ = run(mhc_ops.hc_post_torch, inputs16, grad)
    assert_ulps(out, ref, "out")


@pytest.mark.interpreter
def test_hc_post_errors(tm):
    (y, res, post, comb), _ = post_inputs(1, 2, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        tm.hc_post_fused(y[..., :8], res, post, comb)
    with pytest.raises(ValueError, match="one dtype"):
        tm.hc_post_fused(y.double(), res.double(), post, comb)


# ------------------------------------------------------------------------------------------------------------- hc_pre
@pytest.mark.interpreter
@pytest.mark.parametrize("shape,iters", [((2, 5, 4, 48), 20), ((3, 13, 4, 24), 20), ((1, 3, 3, 20), 2)])
def test_hc_pre_fp32(tm, shape, iters):
    """Values and gradients of X, fn, base, scale through every Sinkhorn step; several token blocks (39 tokens)."""
    inputs, grads = pre_inputs(*shape, torch.float32)
    kw = dict(KW, sinkhorn_iters=iters)
    outs, got = run(tm.hc_pre_fused, inputs, grads, **kw)
    refs, ref_got = run(mhc_ops.hc_pre_torch, inputs, grads, **kw)
    for name, a, b in zip(("post", "comb", "collapsed"), outs, refs):
        assert_rel(a, b, 1e-5, name)
    for name, a, b in zip(("dX", "dfn", "dbase", "dscale"), got, ref_got):
        assert_rel(a, b, 1e-5, name)


@pytest.mark.interpreter
@pytest.mark.parametrize("fn_dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_bf16(tm, fn_dtype):
    inputs, grads = pre_inputs(2, 5, 4, 48, torch.bfloat16, fn_dtype=fn_dtype, seed=3)
    (post, comb, col), (dx, dfn, dbase, dscale) = run(tm.hc_pre_fused, inputs, grads, **KW)
    (rpost, rcomb, rcol), (rdx, rdfn, rdbase, rdscale) = run(mhc_ops.hc_pre_torch, inputs, grads, **KW)
    # fp32 quantities computed from bf16 streams (exact in fp32): fp32 tolerance
    assert_rel(post, rpost, 1e-5, "post")
    assert_rel(comb, rcomb, 1e-5, "comb")
    assert_rel(dbase, rdbase, 1e-5, "dbase")
    assert_rel(dscale, rdscale, 1e-5, "dscale")
    # fp32 results rounded once to bf16 in both paths
    assert_ulps(col, rcol, "collapsed")
    assert_ulps(dx, rdx, "dX")
    if fn_dtype == torch.float32:
        assert_rel(dfn, rdfn, 1e-5, "dfn")
    else:
        assert_ulps(dfn, rdfn, "dfn (bf16)")


@pytest.mark.interpreter
def test_hc_pre_partial_outputs(tm):
    """Only some outputs used (the others get no gradient); base/scale frozen."""
    (x, fn, base, scale), grads = pre_inputs(1, 4, 4, 16, torch.float32, seed=5)
    base.requires_grad_(False)
    scale.requires_grad_(False)
    for pick in ((2,), (0, 1)):
        got = torch.autograd.grad([tm.hc_pre_fused(x, fn, base, scale, **KW)[i] for i in pick], (x, fn),
                                  [grads[i] for i in pick])
        ref = torch.autograd.grad([mhc_ops.hc_pre_torch(x, fn, base, scale, **KW)[i] for i in pick], (x, fn),
                                  [grads[i] for i in pick])
        for name, a, b in zip(("dX", "dfn"), got, ref):
            assert_rel(a, b, 1e-5, f"{name} for outputs {pick}")


@pytest.mark.interpreter
def test_entry_points_route_to_fused(tm, monkeypatch):
    """The fused alternatives registered for ``hc_pre_torch`` / ``hc_post_torch`` are the fused functions, chosen by
    ``op_for`` when the dispatcher answers "fused" (forced here: on CPU it never does)."""
    monkeypatch.setattr(dispatch, "choose_backend", lambda *a, **k: "fused")
    calls = []
    for fname in ("hc_pre_fused", "hc_post_fused"):
        original = getattr(tm, fname)
        monkeypatch.setattr(tm, fname, lambda *a, _f=original, _n=fname, **k: calls.append(_n) or _f(*a, **k))
    (x, fn, base, scale), _ = pre_inputs(1, 2, 4, 16, torch.float32)
    post, comb, col = dispatch.op_for(mhc_ops.hc_pre_torch, "fused", x, fn, base, scale)(x, fn, base, scale, **KW)
    dispatch.op_for(mhc_ops.hc_post_torch, "fused", col, x, post, comb)(col, x, post, comb)
    assert calls == ["hc_pre_fused", "hc_post_fused"]


@pytest.mark.interpreter
def test_fused_under_autocast(tm, monkeypatch):
    """Under CPU autocast (bf16) the fused ops run as without it (custom ops with autocast off, forward and backward,
    also for a backward called inside autocast) and agree with the torch path under the same autocast; the fused
    ``hc_post`` upcasts the bf16 sub-block output autocast leaves beside fp32 streams, so its kernel (one dtype) takes
    it."""
    (x, fn, base, scale), grads = pre_inputs(2, 5, 4, 48, torch.float32, seed=12)
    ref, ref_g = run(tm.hc_pre_fused, (x, fn, base, scale), grads, **KW)
    for inside in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = tm.hc_pre_fused(x, fn, base, scale, **KW)
            torch_outs = mhc_ops.hc_pre_torch(x, fn, base, scale, **KW)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=inside):
            got_g = torch.autograd.grad(outs, (x, fn, base, scale), grads)
        assert all(torch.equal(a, b) for a, b in zip(outs, ref))
        assert all(torch.equal(a, b) for a, b in zip(got_g, ref_g)), f"backward inside autocast: {inside}"
        for name, a, b in zip(("post", "comb", "collapsed"), outs, torch_outs):
            assert_rel(a.detach(), b.detach(), 1e-5, f"{name} vs torch under autocast")
    post, comb, col = (t.detach() for t in ref)
    y = torch.randn(col.shape, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16).requires_grad_()
    # the probe's hc_post dtype rule (y of residual's dtype or narrower) without its CUDA check
    monkeypatch.setattr(dispatch, "choose_backend", lambda family, requested, *t: "fused" if torch.promote_types(
        t[0].dtype, t[1].dtype) == t[1].dtype else "torch")
    called = []
    original = tm.hc_post_fused
    monkeypatch.setattr(tm, "hc_post_fused", lambda *a: called.append(a[0].dtype) or original(*a))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dispatch.op_for(mhc_ops.hc_post_torch, "auto", y, x, post, comb)(y, x, post, comb)
        want = mhc_ops.hc_post_torch(y, x, post, comb)
    assert called == [torch.bfloat16] and out.dtype == torch.float32
    assert_rel(out.detach(), want.detach(), 1e-5, "hc_post fused vs torch under autocast")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(14))
    dy, dy_ref = torch.autograd.grad(out, y, g)[0], torch.autograd.grad(want, y, g)[0]
    assert dy.dtype == torch.bfloat16
    assert_ulps(dy, dy_ref, "dy of the upcast bf16 y")


# ---------------------------------------------------------------------------------------------- custom ops, compile
OPCHECK_PASSED = {name: "SUCCESS" for name in ("test_schema", "test_autograd_registration", "test_faketensor",
                                                "test_aot_dispatch_dynamic")}


def opcheck(op, *args):
    """``torch.library.opcheck`` with its default tests (schema, autograd registration, fake tensor,
    aot_dispatch_dynamic), which raises on a failure; asserts that all four ran."""
    assert torch.library.opcheck(op, args) == OPCHECK_PASSED


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_hc_post(tm, dtype):
    """glm53flash::hc_post_fwd (differentiable: its autograd formula calls hc_post_bwd) and hc_post_bwd."""
    (y, res, post, comb), grad = post_inputs(1, 3, 3, 20, dtype, seed=10)
    opcheck(torch.ops.glm53flash.hc_post_fwd, y, res, post, comb)
    opcheck(torch.ops.glm53flash.hc_post_bwd, grad, *(t.detach() for t in (y, res, post, comb)))


@pytest.mark.interpreter
def test_opcheck_hc_pre(tm):
    """glm53flash::hc_pre_fwd (differentiable in X, fn, base, scale; three Sinkhorn steps) and its backward kernels
    hc_pre_dpre, hc_pre_dx (with and without the collapsed-output gradient) and hc_pre_dfn, on the residuals of a
    forward call."""
    (x, fn, base, scale), (_, _, dcol) = pre_inputs(1, 3, 3, 20, torch.float32, seed=11)
    cfg = (3, KW["hc_eps"], KW["norm_eps"])
    opcheck(torch.ops.glm53flash.hc_pre_fwd, x, fn, base, scale, *cfg)
    x, fn = x.detach(), fn.detach()
    *_, proj, sumsq = torch.ops.glm53flash.hc_pre_fwd(x, fn, base.detach(), scale.detach(), *cfg)
    pre = torch.rand(proj.shape[0], 3)
    opcheck(torch.ops.glm53flash.hc_pre_dpre, x, dcol)
    for dc in (dcol, None):
        opcheck(torch.ops.glm53flash.hc_pre_dx, x, fn, torch.randn_like(proj), torch.randn_like(sumsq), pre, dc)
    opcheck(torch.ops.glm53flash.hc_pre_dfn, x, torch.randn_like(proj))


@pytest.mark.interpreter
def test_compile_fullgraph_equals_eager(tm):
    """``torch.compile(fullgraph=True)`` (inductor) of hc_pre_fused -> a torch op -> hc_post_fused: no graph break
    (fullgraph raises on one), and the compiled function equals the eager one: outputs bit-equal (the kernels and
    the forward's torch part run inside the ops; the op between them rounds once), gradients of X, fn, base, scale
    and y within 1e-6 relative (the backward's Sinkhorn recomputation is plain torch, which inductor fuses into
    another fp32 evaluation order)."""
    (x, fn, base, scale), _ = pre_inputs(1, 3, 4, 24, torch.float32, seed=12)
    y = torch.randn(1, 3, 24, generator=torch.Generator().manual_seed(13)).requires_grad_()
    leaves = (x, fn, base, scale, y)

    def block(x, fn, base, scale, y):  # three Sinkhorn steps: a smaller graph for inductor to compile
        post, comb, collapsed = tm.hc_pre_fused(x, fn, base, scale, **dict(KW, sinkhorn_iters=3))
        return tm.hc_post_fused(2.0 * collapsed + y, x, post, comb)  # exact product, one rounding

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    weight = torch.randn(1, 3, 4, 24, generator=torch.Generator().manual_seed(14))
    results = []
    for fn_ in (block, compiled):
        out = fn_(*leaves)
        results.append((out.detach(), torch.autograd.grad((out * weight).sum(), leaves)))
    (out, grads), (cout, cgrads) = results
    assert torch.equal(cout, out)
    for name, a, b in zip(("dX", "dfn", "dbase", "dscale", "dy"), cgrads, grads):
        assert_rel(a, b, 1e-6, f"compiled {name}")


# ------------------------------------------------------------------------------------------------------------ dispatch
def test_dispatch_never_fused_on_cpu():
    """CPU tensors get the torch path even with triton installed (and choose_backend does not import triton)."""
    x = torch.zeros(1, 2, 4, 8)
    assert dispatch.choose_backend("mhc", "auto", x) == "torch"
    assert dispatch.FUSED_AVAILABILITY["mhc"](x) == (False, "the tensors are not on a CUDA device")


# ----------------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(INTERPRETING, reason="TRITON_INTERPRET=1: kernels would run interpreted")
def test_gpu_realistic_bf16():
    """Hidden 4096, N=4, 8k tokens, bf16 streams, fp32 fn/base/scale, init-scale fn: values and all gradients.

    Tolerances as in the CPU tests (module docstring): bf16 results within one ulp of the torch path (both round the
    same fp32 quantity once); fp32 results (post, comb, dpost, dcomb, dfn, dbase, dscale) within 1e-4 relative:
    fp32 sums over 16384 terms in another order (GPU reductions are tree-shaped) — about sqrt(16384) * 6e-8 = 8e-6 per
    sum, with margin for the Sinkhorn chain amplifying post/comb differences by < 10. bf16 ``dy``/``dpost``/``dcomb``
    of hc_post: the torch path's own bf16 rounding of intermediates.
    """
    from glm53flash_hf import mhc_fused as tm

    dev = torch.device("cuda")
    b, s, n, d = 1, 8192, 4, 4096
    (x, fn, base, scale), grads = pre_inputs(b, s, n, d, torch.bfloat16, fn_std=0.02, seed=7)
    x, fn, base, scale = (t.detach().to(dev).requires_grad_() for t in (x, fn, base, scale))
    grads = tuple(g.to(dev) for g in grads)
    assert dispatch.choose_backend("mhc", "auto", x, fn, base, scale) == "fused"
    (post, comb, col), (dx, dfn, dbase, dscale) = run(tm.hc_pre_fused, (x, fn, base, scale), grads, **KW)
    (rpost, rcomb, rcol), (rdx, rdfn, rdbase, rdscale) = run(mhc_ops.hc_pre_torch, (x, fn, base, scale), grads, **KW)
    for name, a, r in (("post", post, rpost), ("comb", comb, rcomb), ("dfn", dfn, rdfn), ("dbase", dbase, rdbase),
                       ("dscale", dscale, rdscale)):
        assert_rel(a, r, 1e-4, name)
    assert_ulps(col, rcol, "collapsed")
    assert_ulps(dx, rdx, "dX")

    inputs, grad = post_inputs(b, s, n, d, torch.bfloat16, seed=8)
    inputs = tuple(t.detach().to(dev).requires_grad_() for t in inputs)
    grad = grad.to(dev)
    (out,), (dy, dres, dpost, dcomb) = run(tm.hc_post_fused, inputs, grad)
    (ref,), (rdy, rdres, rdpost, rdcomb) = run(mhc_ops.hc_post_torch, inputs, grad)
    assert_ulps(out, ref, "out")
    assert_ulps(dres, rdres, "dresidual")
    terms = (inputs[2].detach().to(torch.bfloat16).double().unsqueeze(-1) * grad.double()).abs().sum(-2)
    assert_ulps(dy, rdy, "dy", extra=2.0**-8 * terms)
    y64, g64 = inputs[0].detach().double(), grad.double()
    assert_ulps(dpost, rdpost, "dpost", extra=2.0**-8 * (g64 * y64.unsqueeze(-2)).abs().sum(-1))
    assert_ulps(dcomb, rdcomb, "dcomb", extra=1e-4 * rdcomb.double().abs().max())


@pytest.mark.interpreter
def test_frames_from_the_decoder_layer_to_the_kernels(tm):
    """A model prefill on the fused mHC path: from the decoder layer's forward to the custom-op bodies that launch the
    Triton kernels of ``hc_pre`` and ``hc_post``, at most 3 frames of the package's own code."""
    from tiny import frames_below_decoder_layer

    pre = frames_below_decoder_layer(lambda c: c.co_name == "_hc_pre_fwd_impl", "mhc")
    post = frames_below_decoder_layer(lambda c: c.co_name == "_hc_post_fwd_impl", "mhc")
    print(f"hc_pre: {' -> '.join(pre)}; hc_post: {' -> '.join(post)}")
    assert pre == ["Glm53FlashHyperConnection.forward", "hc_pre_fused", "_hc_pre_fwd_impl"], pre
    assert post == ["hc_post_fused", "_hc_post_fwd_impl"], post
