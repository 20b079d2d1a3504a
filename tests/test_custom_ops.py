"""Registration of the fused kernels as ``torch.library`` custom ops (``glm53flash::<name>``), main process only.

What runs the ops (``torch.library.opcheck`` per op, ``torch.compile(fullgraph=True)`` per family) needs the kernels,
so it is in the interpreter tests of each family's file (``tests/test_{kda,mhc,dsa,moe}_fused.py``, run in their
``TRITON_INTERPRET=1`` child). Here: every fused module registers its ops at import (the fla-core ops without
importing fla), with a fake implementation and, for the forward ops, an autograd formula; none mutates its inputs;
:func:`glm53flash_hf.graph_ops.define_op` registers a name once (a second copy of a module shares the first
registration).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch
from interp import INTERPRETING

from glm53flash_hf import graph_ops

pytestmark = pytest.mark.skipif(INTERPRETING, reason="main-process test (no kernel runs)")

FAMILY_OPS = {
    "kda_fused": {"fla_chunk_kda_fwd", "fla_chunk_kda_bwd", "fla_causal_conv1d_fwd", "fla_causal_conv1d_bwd",
                  "fla_rms_norm_gated_fwd", "fla_rms_norm_gated_bwd", "fla_fused_recurrent_kda"},
    "mhc_fused": {"hc_post_fwd", "hc_post_bwd", "hc_pre_fwd", "hc_pre_dpre", "hc_pre_dx", "hc_pre_dfn"},
    "dsa_fused": {"sparse_mla_fwd", "sparse_mla_bwd"},
    "moe_fused": {"clamped_swiglu_fwd", "clamped_swiglu_bwd", "weighted_combine_fwd", "weighted_combine_bwd"},
}
# the modules holding each fused module's op bodies (kda_fused registers fla_compat's calls of fla)
BODIES = {"kda_fused": ("kda_fused", "fla_compat")}
# ops with an autograd formula; the others are backward ops (a backward through them raises)
DIFFERENTIABLE = {"fla_chunk_kda_fwd", "fla_causal_conv1d_fwd", "fla_rms_norm_gated_fwd", "fla_fused_recurrent_kda",
                  "hc_post_fwd", "hc_pre_fwd", "sparse_mla_fwd", "clamped_swiglu_fwd", "weighted_combine_fwd"}


def _has_kernel(qualname: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key)


@pytest.mark.parametrize("module", sorted(FAMILY_OPS))
def test_fused_modules_register_their_ops(module):
    """Importing ``glm53flash_hf.<module>`` registers ``glm53flash::<name>`` for each of its ops (exactly the ops whose
    implementation that module, or the module of its op bodies, defines): a fake (Meta) kernel, a schema without
    mutated or aliased arguments, and an autograd formula exactly for the forward ops. The KDA ops register without
    importing fla (hidden in this process by conftest)."""
    if module != "kda_fused":
        pytest.importorskip("triton", reason="triton is not installed")
    importlib.import_module(f"glm53flash_hf.{module}")
    defined_by = {qualname.split("::", 1)[1] for qualname, opdef in torch._library.custom_ops.OPDEFS.items()
                  if qualname.startswith(f"{graph_ops.NAMESPACE}::")
                  and opdef._init_fn.__module__.rsplit(".", 1)[-1] in BODIES.get(module, (module,))}
    assert defined_by == FAMILY_OPS[module]
    if module == "kda_fused":
        assert sys.modules.get("fla", None) is None, "registering the KDA ops imported fla"
    for name in FAMILY_OPS[module]:
        qualname = f"{graph_ops.NAMESPACE}::{name}"
        overload = getattr(torch.ops.glm53flash, name).default
        schema = overload._schema
        assert not schema.is_mutable and all(a.alias_info is None for a in schema.arguments), (name, schema)
        assert all(r.alias_info is None for r in schema.returns), (name, schema)
        assert _has_kernel(qualname, "Meta"), f"{name}: no fake kernel"
        assert _has_kernel(qualname, "CompositeExplicitAutograd"), f"{name}: no implementation"
        info = torch._library.custom_ops.OPDEFS[qualname]
        assert (info._backward_fn is not None) == (name in DIFFERENTIABLE), name


def test_define_op_registers_once():
    """A second ``define_op`` of an existing name (what a second copy of a kernel module does: the package and the same
    files loaded as transformers remote code) returns the registered op and leaves its implementation, fake and
    autograd formula in place."""

    def first(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def second(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    def fake(x):
        return torch.empty_like(x)

    name = "_define_op_registers_once_test"
    op = graph_ops.define_op(name, first, fake, backward=lambda ctx, g: 2 * g)
    again = graph_ops.define_op(name, second, fake, backward=lambda ctx, g: 3 * g)
    assert again is getattr(torch.ops.glm53flash, name)
    x = torch.ones(3, requires_grad=True)
    for call in (op, again):
        y = call(x)
        assert torch.equal(y, 2 * x.detach())
        assert torch.equal(torch.autograd.grad(y.sum(), x)[0], torch.full((3,), 2.0))
    with torch._subclasses.fake_tensor.FakeTensorMode():
        assert again(torch.empty(5)).shape == (5,)


def test_second_module_copy_shares_the_registration():
    """``mhc_fused`` executed a second time under another module name (as transformers' remote-code loader does with
    the checkpoint's copy of the file) imports without re-registering: its ops are the registered ones."""
    pytest.importorskip("triton", reason="triton is not installed")
    from glm53flash_hf import mhc_fused

    path = os.path.join(os.path.dirname(mhc_fused.__file__), "mhc_fused.py")
    spec = importlib.util.spec_from_file_location("glm53flash_hf._second_copy_of_mhc_fused", path)
    copy = importlib.util.module_from_spec(spec)
    copy.__package__ = "glm53flash_hf"
    spec.loader.exec_module(copy)
    for name in ("hc_post_fwd", "hc_post_bwd", "hc_pre_fwd", "hc_pre_dpre", "hc_pre_dx", "hc_pre_dfn"):
        op = getattr(copy, f"_{name.upper()}")
        assert op is getattr(torch.ops.glm53flash, name)
        assert torch._library.custom_ops.OPDEFS[f"glm53flash::{name}"] is getattr(mhc_fused, f"_{name.upper()}")


def test_recompute_op_gradient_of_a_strided_input_under_compile():
    """A :func:`~glm53flash_hf.graph_ops.recompute_op` backward returns contiguous gradients and its fake says so,
    also for an input that is a strided view (inductor checks a custom op's output strides against its fake)."""
    op = graph_ops.recompute_op(
        "_recompute_op_strided_input_test", lambda x, w: (x * w, None), tensor_args=[("x", False), ("w", False)],
        static_args=[], num_outputs=2, fake=lambda x, w: (x.new_empty(x.shape), x.new_empty(0)),
    )

    def loss(a, w):
        return (op(a.t(), w)[0] ** 2).sum()

    a, w = torch.randn(3, 5, requires_grad=True), torch.randn(5, 3, requires_grad=True)
    expected = torch.autograd.grad(((a.t() * w) ** 2).sum(), (a, w))
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(a, w), (a, w))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
