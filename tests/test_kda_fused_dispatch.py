"""Tests of glm53flash_hf/kda_fused.py, dispatch and arguments (main process, fla hidden by conftest): on CPU
``kernels="auto"`` never imports fla and equals the torch path, ``kernels={"kda": "fused"}`` warns once and runs the
torch path, the probe's reasons, the keyword guard of :mod:`glm53flash_hf.fla_compat`, the arguments the wrappers pass
to (a stand-in of) fla and refuse for an fla that would ignore them, and the argument errors.

Oracle: the torch path of :mod:`glm53flash_hf.kda` on the same weights (bit-equal), and the documented arguments.
The numerics of the fused path under Triton's interpreter: tests/test_kda_fused_numerics.py.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from interp import INTERPRETING
from kda_fused_helpers import layer_pair, layer_run, packed_batch
from test_kda import random_init_, tiny_config

from glm53flash_hf import dispatch
from glm53flash_hf.kda import Glm53FlashLinearAttention
from glm53flash_hf.packing import build_document_layout


# ========================================================================================== main process (no fla)
class _ImportRecorder(importlib.abc.MetaPathFinder):
    """Records every attempt to import fla or glm53flash_hf.kda_fused (and lets the normal machinery go on)."""

    def __init__(self):
        self.seen = []

    def find_spec(self, name, path=None, target=None):
        if name == "fla" or name.startswith("fla.") or name == "glm53flash_hf.kda_fused":
            self.seen.append(name)
        return None


@pytest.mark.skipif(INTERPRETING, reason="main-process test (CPU tensors, no interpreter)")
def test_cpu_auto_never_imports_fla_and_equals_torch(monkeypatch):
    """kernels="auto" on CPU tensors takes the torch path (bit-equal to kernels="torch", forward and backward, packed
    and unpacked) without importing fla or glm53flash_hf.kda_fused."""
    recorder = _ImportRecorder()
    monkeypatch.delitem(sys.modules, "fla", raising=False)
    monkeypatch.delitem(sys.modules, "glm53flash_hf.kda_fused", raising=False)
    monkeypatch.setattr(sys, "meta_path", [recorder] + sys.meta_path)
    auto = Glm53FlashLinearAttention(tiny_config(kernels="auto"), layer_idx=0)
    random_init_(auto, torch.Generator().manual_seed(12))
    torch_layer = Glm53FlashLinearAttention(tiny_config(kernels={"kda": "torch"}), layer_idx=0)
    torch_layer.load_state_dict(auto.state_dict())
    for x, layout in (packed_batch(64, seed=13),
                      (torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(14)),
                       build_document_layout(2, 9, "cpu"))):
        weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(15))
        out, grads = layer_run(auto, x, layout, weight)
        ref, ref_grads = layer_run(torch_layer, x, layout, weight)
        assert torch.equal(out, ref)
        for name in grads:
            assert torch.equal(grads[name], ref_grads[name]), name
    assert recorder.seen == []


@pytest.mark.skipif(INTERPRETING, reason="main-process test (CPU tensors, no interpreter)")
def test_cpu_fused_warns_once_and_runs_torch(monkeypatch):
    """kernels={"kda": "fused"} on CPU: one warning naming the reason (over several calls and the inner conv/chunk
    dispatches), then the torch path (bit-equal)."""
    monkeypatch.setattr(dispatch, "_warned", set())
    fused, torch_layer = layer_pair(seed=16)
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(17))
    layout = build_document_layout(1, 6, "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [fused(x, layout)[0] for _ in range(3)]
    messages = [str(w.message) for w in caught if "kernels['kda']" in str(w.message)]
    assert len(messages) == 1 and "not on a CUDA device" in messages[0], messages
    ref = torch_layer(x, layout)[0]
    assert all(torch.equal(o, ref) for o in outs)


@pytest.mark.skipif(INTERPRETING, reason="main-process test (fla hidden by conftest)")
def test_probe_reasons(monkeypatch):
    """fused_kda_available: dtype, head dim, device and import checks, each with its reason."""
    from glm53flash_hf import fla_compat, kda_fused

    x = torch.zeros(1, 2, 2, 16)
    assert kda_fused.fused_kda_available() == (False, "no tensors given")
    ok, reason = kda_fused.fused_kda_available(x.double())
    assert not ok and "float64" in reason
    for bad in (8, 512):
        ok, reason = kda_fused.fused_kda_available(torch.zeros(1, 2, 2, bad))
        assert not ok and f"head dim {bad}" in reason
    assert kda_fused.fused_kda_available(x, torch.tensor([0, 2])) == (False, "the tensors are not on a CUDA device")
    # Interpreter mode accepts CPU tensors; then fla must import (here conftest hides it).
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fla_compat.import_error.cache_clear()
    try:
        ok, reason = kda_fused.fused_kda_available(x)
    finally:
        fla_compat.import_error.cache_clear()
    assert not ok and "fla-core cannot be imported" in reason
    # The layer's own call: the head dim reaches the probe through dt_bias viewed [1, 1, H, K].
    seen = []
    monkeypatch.setattr(dispatch, "choose_backend", lambda family, req, *t: seen.append(t) or "torch")
    layer = Glm53FlashLinearAttention(tiny_config(linear_head_dim=8), layer_idx=0)
    layer(torch.zeros(1, 3, 64), build_document_layout(1, 3, "cpu"))
    ok, reason = kda_fused.fused_kda_available(*seen[0])
    assert not ok and "head dim 8" in reason


@pytest.mark.skipif(INTERPRETING, reason="main-process test")
def test_guard_rejects_keywords_the_function_would_ignore(monkeypatch):
    """checked raises TypeError naming the function and the argument for a keyword that is neither a named parameter
    nor read from **kwargs; kwargs names (listed in KWARGS_READ) are accepted only where the source reads them."""
    from glm53flash_hf import fla_compat

    def no_safe_gate(q, k, *, scale=None):
        return "called"

    def chunk_kda(q, **kwargs):  # reads A_log and chunk_size from **kwargs, swallows the rest (as fla's does)
        return kwargs.get("A_log"), kwargs.pop("chunk_size", 64)

    fla = SimpleNamespace(no_safe_gate=no_safe_gate, chunk_kda=chunk_kda)
    assert fla_compat.checked(fla, "no_safe_gate", q=1, k=2, scale=0.5)() == "called"
    with pytest.raises(TypeError, match=r"no_safe_gate.*\['safe_gate'\]"):
        fla_compat.checked(fla, "no_safe_gate", q=1, k=2, safe_gate=True)
    monkeypatch.setitem(fla_compat.KWARGS_READ, "chunk_kda", ("A_log", "dt_bias", "chunk_size"))
    assert fla_compat.checked(fla, "chunk_kda", q=1, A_log=3, chunk_size=32)() == (3, 32)
    with pytest.raises(TypeError, match=r"chunk_kda.*\['dt_bias'\]"):
        fla_compat.checked(fla, "chunk_kda", q=1, A_log=3, dt_bias=4)


def _fake_fla(record):
    """fla-core 0.6.0's signatures of the functions kda_fused calls (no kernels): each appends its keywords to
    ``record[name]`` and returns new zero tensors of the real outputs' shapes."""

    def log(name, arguments):
        record.setdefault(name, []).append(arguments)

    def l2norm_fwd(x, eps=1e-6, output_dtype=None):
        log("l2norm_fwd", dict(locals()))
        return torch.zeros_like(x), torch.zeros(x.shape[:-1])

    def fused_beta_sigmoid_fwd(x, scale=1.0):
        log("fused_beta_sigmoid_fwd", dict(locals()))
        return torch.zeros_like(x, dtype=torch.float32)

    def prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=None):
        log("prepare_chunk_indices", dict(locals()))
        return torch.zeros(4, 2, dtype=torch.long)

    def chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first=False,
                      cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64, safe_gate=False,
                      lower_bound=None, use_gate_in_kernel=False, A_log=None, dt_bias=None, disable_recompute=False,
                      return_intermediate_states=False, cp_context=None, use_graph=False, chunk_offsets=None):
        log("chunk_kda_fwd", dict(locals()))
        A = torch.zeros(*k.shape[:3], chunk_size)
        return torch.zeros_like(v), None, None, A, A.clone(), None, None, None, None, None, None, initial_state

    def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                            output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                            use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                            state_v_first=False, cu_seqlens=None, **kwargs):
        log("fused_recurrent_kda", dict(locals()))
        return torch.zeros_like(v), torch.zeros(*q.shape[:1], *q.shape[2:], v.shape[-1])

    def causal_conv1d_fwd(x, weight, bias, residual, initial_state=None, output_final_state=False, activation=None,
                          cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64,
                          layout_fallback=False):
        log("causal_conv1d_fwd", dict(locals()))
        return torch.zeros(x.shape), None

    def layer_norm_gated_fwd(x, g, weight, bias, activation="swish", eps=1e-5, residual=None, out_dtype=None,
                             residual_dtype=None, is_rms_norm=False):
        log("layer_norm_gated_fwd", dict(locals()))
        return torch.zeros_like(x), None, torch.zeros(x.shape[0]), x

    return SimpleNamespace(version="fake", l2norm_fwd=l2norm_fwd, fused_beta_sigmoid_fwd=fused_beta_sigmoid_fwd,
                           prepare_chunk_indices=prepare_chunk_indices, chunk_kda_fwd=chunk_kda_fwd,
                           fused_recurrent_kda=fused_recurrent_kda, causal_conv1d_fwd=causal_conv1d_fwd,
                           layer_norm_gated_fwd=layer_norm_gated_fwd)


@pytest.mark.skipif(INTERPRETING, reason="main-process test")
@pytest.mark.parametrize("lower_bound,safe", [(-5.0, True), (-8.0, False), (None, False)])
def test_wrappers_pass_the_documented_arguments(monkeypatch, lower_bound, safe):
    """With fla replaced by fakes of its 0.6.0 signatures: the layer's fused path (through the custom ops) and
    recurrent_kda_fused hand fla the gate parameters, the lower bound, safe_gate (only for bounds in [-5, 0)), the
    in-kernel gate flag, q and k to the l2-norm and the beta logits to the sigmoid (chunked path) or the in-kernel
    flags (recurrent kernel), the packed documents' cu_seqlens (device and host copies) and the norm's weight and eps;
    every call passes the guard. Every parameter handed to a kernel goes through ``dispatch.local_tensor`` (DTensor
    unwrapping; its own behaviour is tested in tests/test_dispatch.py) under a name that identifies it."""
    from glm53flash_hf import fla_compat, kda_fused

    record = {}
    unwrapped = []
    monkeypatch.setattr(fla_compat, "load", lambda: _fake_fla(record))
    monkeypatch.setattr(kda_fused, "local_tensor",
                        lambda t, name: unwrapped.append(name) or dispatch.local_tensor(t, name))
    monkeypatch.setattr(dispatch, "choose_backend", lambda family, requested, *tensors: "fused")
    layer, _ = layer_pair(seed=18, linear_lower_bound=lower_bound)
    x, layout = packed_batch(64, seed=19)
    out = layer(x, layout)[0]
    assert out.shape == x.shape
    for param in ("forget_gate.A_log", "forget_gate.dt_bias", "conv1d.weight", "o_norm.weight"):
        assert param in unwrapped, (param, unwrapped)
    (c,) = record["chunk_kda_fwd"]
    assert c["A_log"] is layer.forget_gate.A_log and c["dt_bias"] is layer.forget_gate.dt_bias
    assert c["lower_bound"] == lower_bound and c["safe_gate"] is safe
    assert c["use_gate_in_kernel"] and c["disable_recompute"] is False and c["cp_context"] is None
    assert c["state_v_first"] is False and c["g"].shape == (1, 64, 2, 16) and c["beta"].shape == (1, 64, 2)
    assert [a["x"].shape for a in record["l2norm_fwd"]] == [(1, 64, 2, 16)] * 2  # q and k
    (sig,) = record["fused_beta_sigmoid_fwd"]
    assert sig["x"].shape == (1, 64, 2) and sig["scale"] == 1.0
    assert torch.equal(c["cu_seqlens"], layout.cu_seqlens)
    assert c["cu_seqlens_cpu"].tolist() == layout.cu_seqlens.tolist()
    assert c["chunk_indices"] is not None and c["chunk_size"] == 64
    (conv,) = record["causal_conv1d_fwd"]
    assert conv["activation"] == "silu" and conv["bias"] is None and conv["residual"] is None
    assert torch.equal(conv["weight"], layer.conv1d.weight[:, 0, :])
    assert torch.equal(conv["cu_seqlens"], layout.cu_seqlens) and conv["chunk_indices"] is not None
    assert {a["cu_seqlens"].data_ptr() for a in record["prepare_chunk_indices"]} == {layout.cu_seqlens.data_ptr()}
    (norm,) = record["layer_norm_gated_fwd"]
    assert torch.equal(norm["weight"], layer.o_norm.weight) and norm["activation"] == "sigmoid"
    assert norm["is_rms_norm"] is True and norm["bias"] is None
    assert norm["eps"] == layer.o_norm.variance_epsilon
    with torch.no_grad():
        q = torch.zeros(2, 1, 2, 16)
        kda_fused.recurrent_kda_fused(q, q, q, q, torch.zeros(2, 1, 2), A_log=layer.forget_gate.A_log,
                                      dt_bias=layer.forget_gate.dt_bias, lower_bound=lower_bound,
                                      initial_state=torch.zeros(2, 2, 16, 16))
    assert "forget_gate.A_log" in unwrapped and "forget_gate.dt_bias" in unwrapped
    (r,) = record["fused_recurrent_kda"]
    assert r["use_gate_in_kernel"] and r["use_beta_sigmoid_in_kernel"] and r["use_qk_l2norm_in_kernel"]
    assert r["lower_bound"] == lower_bound and r["output_final_state"] and r["state_v_first"] is False


@pytest.mark.skipif(INTERPRETING, reason="main-process test")
def test_wrappers_refuse_an_fla_that_would_ignore_arguments(monkeypatch):
    """An fla whose functions lack parameters we pass (here a ``chunk_kda_fwd`` without A_log/dt_bias/lower_bound that
    would swallow them in **kwargs) makes every wrapper raise TypeError naming the function, before that function is
    called."""
    from glm53flash_hf import fla_compat, kda_fused

    def old_chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens=None,
                          chunk_size=64, **kwargs):
        raise AssertionError("must not be called")

    def narrow(x, **kwargs):
        raise AssertionError("must not be called")

    working = _fake_fla({})
    fake = SimpleNamespace(version="old", l2norm_fwd=working.l2norm_fwd,
                           fused_beta_sigmoid_fwd=working.fused_beta_sigmoid_fwd, chunk_kda_fwd=old_chunk_kda_fwd,
                           fused_recurrent_kda=narrow, causal_conv1d_fwd=narrow, layer_norm_gated_fwd=narrow)
    monkeypatch.setattr(fla_compat, "load", lambda: fake)
    q = torch.zeros(1, 4, 2, 16)
    beta = torch.zeros(1, 4, 2)
    A_log, dt_bias = torch.zeros(2), torch.zeros(32)
    with pytest.raises(TypeError, match=r"chunk_kda_fwd.*A_log"):
        kda_fused.chunk_kda_fused(q, q, q, q, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    with pytest.raises(TypeError, match=r"chunk_kda_fwd.*use_gate_in_kernel"):
        kda_fused.chunk_kda_fused(q, q, q, q, beta)
    with pytest.raises(TypeError, match=r"causal_conv1d_fwd.*weight"):
        kda_fused.causal_conv1d_fused(torch.zeros(1, 4, 8), torch.zeros(8, 4))
    with pytest.raises(TypeError, match=r"layer_norm_gated_fwd.*'g'"):
        kda_fused.rms_norm_gated_fused(q, q, torch.ones(16), 1e-5)
    with torch.no_grad(), pytest.raises(TypeError, match=r"fused_recurrent_kda.*A_log"):
        kda_fused.recurrent_kda_fused(q[:, :1], q[:, :1], q[:, :1], q[:, :1], beta[:, :1], A_log=A_log,
                                      dt_bias=dt_bias, lower_bound=-5.0)


@pytest.mark.skipif(INTERPRETING, reason="main-process test")
def test_argument_errors(monkeypatch):
    """Bad inputs raise ValueError/RuntimeError naming the problem before fla is touched."""
    from glm53flash_hf import fla_compat, kda_fused

    monkeypatch.setattr(fla_compat, "load", lambda: pytest.fail("fla must not be reached"))
    q = torch.zeros(1, 4, 2, 16)
    beta = torch.zeros(1, 4, 2)
    A_log, dt_bias = torch.zeros(2), torch.zeros(32)
    with pytest.raises(ValueError, match="head dim K"):
        kda_fused.chunk_kda_fused(q[..., :8], q[..., :8], q[..., :8], q[..., :8], beta)
    with pytest.raises(ValueError, match="chunk_size"):
        kda_fused.chunk_kda_fused(q, q, q, q, beta, chunk_size=16)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_fused.chunk_kda_fused(q, q, q, q, beta, A_log=A_log, dt_bias=dt_bias[:16], lower_bound=-5.0)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_fused.chunk_kda_fused(q, q, q, q, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=0.0)
    with pytest.raises(ValueError, match="need A_log"):
        kda_fused.chunk_kda_fused(q, q, q, q, beta, dt_bias=dt_bias)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda_fused.chunk_kda_fused(q, q, q, q, beta, cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="initial_state"):
        kda_fused.chunk_kda_fused(q, q, q, q, beta, initial_state=torch.zeros(2, 2, 16, 16))
    with pytest.raises(ValueError, match="activation"):
        kda_fused.causal_conv1d_fused(torch.zeros(1, 4, 8), torch.zeros(8, 4), activation="gelu")
    with torch.no_grad(), pytest.raises(ValueError, match="initial_state"):
        kda_fused.recurrent_kda_fused(q, q, q, q, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                                      initial_state=torch.zeros(2, 2, 16, 16))
