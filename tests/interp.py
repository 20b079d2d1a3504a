"""Triton-interpreter child processes, shared by the kernel test files (``tests/test_*_fused.py``).

``TRITON_INTERPRET=1`` must be set before triton is first imported, and setting it in the main test process would leak
into every later test (GPU tests would silently run interpreted). So each file's ``interpreter`` tests run in a child
pytest started with the variable set (:func:`run_interpreter_child`, called by the file's
``test_interpreter_tests_in_subprocess``) and are skipped in the main process (:func:`skip_unless_interpreting`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
import time

import pytest
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD_SKIP = "already the interpreter child"

# fla's fp32 kernels against a float64 oracle (measurements and causes: tests/test_kda_fused_numerics.py's docstring)
KERNEL_TOL = 1e-5  # outputs, states, gradients of inputs and of the parameters used per token
GATE_PARAM_TOL = 1e-4  # gradients of the gate parameters: fla's in-chunk reverse cumsum error, summed over tokens
GATE_PARAMS = ("A_log", "dt_bias", "f_a_proj", "f_b_proj")


def tol_for(what: str) -> float:
    """GATE_PARAM_TOL for the gradients of the gate parameters (a name containing one of GATE_PARAMS), else
    KERNEL_TOL."""
    return GATE_PARAM_TOL if any(p in what for p in GATE_PARAMS) else KERNEL_TOL


def skip_unless_interpreting() -> None:
    """Skip an ``interpreter`` test in the main process (it runs in the child)."""
    if not INTERPRETING:
        pytest.skip("interpreter test: runs in the TRITON_INTERPRET=1 child of test_interpreter_tests_in_subprocess")


def interpreted_module(name: str):
    """Fixture body (``yield from``): ``glm53flash_hf.<name>`` with interpreted kernels, one intra-op thread (tiny
    shapes); skips in the main process."""
    skip_unless_interpreting()
    module = importlib.import_module(f"glm53flash_hf.{name}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield module
    torch.set_num_threads(threads)


def run_interpreter_child(test_file: str, timeout: float = 540, **env: str) -> float:
    """Run ``test_file``'s ``interpreter`` tests in a child pytest with ``TRITON_INTERPRET=1`` (and ``env``) set
    before triton is imported; assert that it passed and skipped nothing but its own call of this. Skips when already
    the child. Returns the child's wall time in seconds."""
    if INTERPRETING:
        pytest.skip(CHILD_SKIP)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "interpreter", "-rs",
           os.path.abspath(test_file)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1", **env), capture_output=True,
                          text=True, timeout=timeout)
    elapsed = time.perf_counter() - start
    tail = f"{proc.stdout[-8000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"interpreter child failed (rc {proc.returncode}, {elapsed:.0f} s):\n{tail}"
    skips = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert " passed" in proc.stdout and all(CHILD_SKIP in line for line in skips), proc.stdout
    return elapsed


@contextlib.contextmanager
def fla_interpreter_patches(cp: bool = False):
    """Test-only patches that let fla-core 0.6.0's kernels run under the Triton interpreter (process must have
    ``TRITON_INTERPRET=1`` set before triton was imported); undone on exit. Never applied in fla or the package.

    * one autotune config per kernel (the autotuner's timing needs a GPU driver);
    * ``IS_GATHER_SUPPORTED = False`` in ``fla.ops.kda.chunk_intra`` (the interpreter does not patch its module-level
      ``gather = tl.gather`` alias) and ``SAFE_GATE_DOT_PRECISION = "ieee"`` (no ``bf16x3`` in the interpreter);
    * a module-global ``range`` in every ``fla.*`` module yielding ints whose ``.to(dtype)`` goes through the
      interpreter (``chunk_delta_h`` calls ``i_t.to(tl.int64)`` on a loop variable);
    * masked loads/stores treat an integer mask as ``mask != 0`` (what the compiled kernel does; the interpreter
      types ``(t < seq_len) & m_d`` int32 and rejects it);
    * ``cp=True``: also fla's context-parallel kernels (``fla.ops.cp``) are imported, their device check
      (``_check_cp_device``: NVIDIA Ampere or Ascend only) accepts CPU tensors, and their all-gather writes into the
      ``[world, *shape]`` buffer through its ``[world * shape[0], *shape[1:]]`` view (gloo's
      ``all_gather_into_tensor`` takes only the concatenated form; NCCL takes both; same bytes).
    """
    import builtins

    import numpy as np
    import triton.language as tl
    from triton.runtime import autotuner, interpreter
    from triton.runtime.interpreter import interpreter_semantic

    from glm53flash_hf import fla_compat

    fla_compat.load()  # imports every fla module whose kernels we run
    import fla.ops.kda.chunk_intra as chunk_intra

    class _LoopIndex(int):
        """A host int that also answers the Triton tensor method ``.to(dtype)`` (loop variables are tensors on GPU)."""

        def to(self, dtype, *args, **kwargs):
            return interpreter_semantic.to_tensor(int(self), False).to(dtype, *args, **kwargs)

    def _range(*args):
        return (_LoopIndex(i) for i in builtins.range(*args))

    original_run = autotuner.Autotuner.run

    def _one_config_run(self, *args, **kwargs):
        self.configs = self.configs[:1]
        return original_run(self, *args, **kwargs)

    builder = interpreter.InterpreterBuilder
    original_load, original_store = builder.create_masked_load, builder.create_masked_store

    def _bool_mask(mask):
        if mask.data.dtype == np.bool_:
            return mask
        return interpreter.TensorHandle(mask.data != 0, tl.int1)

    def _masked_load(self, ptrs, mask, other, *args):
        return original_load(self, ptrs, _bool_mask(mask), other, *args)

    def _masked_store(self, ptrs, value, mask, *args):
        return original_store(self, ptrs, value, _bool_mask(mask), *args)

    saved = [(autotuner.Autotuner, "run", original_run),
             (builder, "create_masked_load", original_load),
             (builder, "create_masked_store", original_store),
             (chunk_intra, "IS_GATHER_SUPPORTED", chunk_intra.IS_GATHER_SUPPORTED),
             (chunk_intra, "SAFE_GATE_DOT_PRECISION", chunk_intra.SAFE_GATE_DOT_PRECISION)]
    if cp:
        import fla.ops.cp.chunk_bwd
        import fla.ops.cp.chunk_delta_h
        import fla.ops.cp.chunk_fwd
        import fla.ops.cp.chunk_merge
        import fla.ops.cp.comm
        import fla.ops.cp.context

        for m in (fla.ops.cp.context, fla.ops.cp.chunk_bwd, fla.ops.cp.chunk_delta_h, fla.ops.cp.chunk_fwd,
                  fla.ops.cp.chunk_merge):
            saved.append((m, "_check_cp_device", m._check_cp_device))
            m._check_cp_device = lambda device: None

        def _gather_concatenated(inp, out=None, group=None, async_op=False):
            import torch.distributed as dist

            world = dist.get_world_size(group=group)
            if out is None:
                out = torch.empty(world, *inp.shape, device=inp.device, dtype=inp.dtype)
            flat = out.view(world * inp.shape[0], *inp.shape[1:]) if inp.dim() else out.view(world)
            return out, dist.all_gather_into_tensor(flat, inp.contiguous(), group=group, async_op=async_op)

        for m in (fla.ops.cp.comm, fla.ops.cp.chunk_delta_h):
            saved.append((m, "all_gather_into_tensor", m.all_gather_into_tensor))
            m.all_gather_into_tensor = _gather_concatenated
    autotuner.Autotuner.run = _one_config_run
    builder.create_masked_load, builder.create_masked_store = _masked_load, _masked_store
    chunk_intra.IS_GATHER_SUPPORTED = False
    chunk_intra.SAFE_GATE_DOT_PRECISION = tl.constexpr("ieee")
    patched = [m for name, m in list(sys.modules.items()) if name.startswith("fla.") and m is not None]
    for m in patched:
        m.range = _range
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
        for m in patched:
            m.__dict__.pop("range", None)
