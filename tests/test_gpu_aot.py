"""Ahead-of-time compilation of the package's own Triton kernels for ``sm_90`` without a GPU (``scripts/gpu_aot.py``).

* Every ``@triton.jit`` kernel of ``mhc_fused``, ``dsa_fused`` and ``moe_fused`` (``triton_utils.round_to`` is inlined
  into them) is launched by its launcher at the release shapes with the launch recorded, not run; one recorded
  configuration per kernel is compiled through Triton's NVIDIA pipeline and ``ptxas`` for ``sm_90`` and must fit the
  per-block limits (shared memory, registers, threads). A kernel that no longer builds for a GPU fails here.
* The same check refuses what cannot launch: a real kernel compiled with a block that needs more shared memory than
  ``sm_90`` has, a block that does not compile, and register counts over the limits.

fla's kernels are not compiled here (the script covers them); this process hides fla anyway (``tests/conftest.py``).

* The shared-memory prune of ``fla_compat`` (chained onto fla's autotuners): on stand-in devices of capability 8.0,
  9.0 and 10.0 it drops exactly the configurations of fla's ``chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64`` that
  the AOT run found over each target's limit (from their measured shared memory) and keeps every other one; it keeps
  an existing prune, is idempotent, keeps what fits or cannot be measured, measures a real kernel by Triton's compile
  for the device, and is installed only at a call with CUDA tensors.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from interp import INTERPRETING

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_aot.py")

pytestmark = pytest.mark.skipif(INTERPRETING, reason="TRITON_INTERPRET=1: kernels are interpreted, not JIT functions")
pytest.importorskip("triton")


@pytest.fixture(scope="module")
def aot():
    spec = importlib.util.spec_from_file_location("gpu_aot_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def launches(aot):
    """One recorded launch per kernel of the package's families (the first site that launches it)."""
    first = {}
    for family in aot.PACKAGE_FAMILIES:
        for launch in aot.capture(family):
            first.setdefault(launch.fn.__name__, launch)
    return first


def _module_kernels():
    from triton.runtime.jit import JITFunction

    from glm53flash_hf import dsa_fused, mhc_fused, moe_fused
    return {name for mod in (mhc_fused, dsa_fused, moe_fused) for name, obj in vars(mod).items()
            if isinstance(obj, JITFunction) and name.endswith("_kernel")}


def test_every_package_kernel_is_captured(launches):
    """The release-shape launch sites reach every kernel the modules define."""
    assert set(launches) == _module_kernels()


def test_package_kernels_compile_and_fit_sm90(aot, launches):
    """Each kernel compiles for sm_90 (TTIR to cubin through ptxas) and fits its per-block limits."""
    bad = []
    for name, launch in sorted(launches.items()):
        row = aot.compile_launch(launch, "sm_90")
        assert row["regs"] is not None or row["error"], f"{name}: no register count"
        if not row["fits"]:
            bad.append(f"{name} [{row['config']}]: {row['error'] or row['why']}")
    assert not bad, "kernels that do not build or fit sm_90:\n" + "\n".join(bad)


def test_oversized_shared_memory_is_refused(aot, launches):
    """_hc_pre_reduce_kernel with BK=512 holds a [512, 32] fp32 tile plus the [32, 512] input (over 227 KiB): it
    compiles, and the check refuses it for sm_90 by its shared memory."""
    base = launches["_hc_pre_reduce_kernel"]
    big = aot.Launch(base.fn, base.args, {**base.kwargs, "BK": 512}, base.site, "oversized BK")
    row = aot.compile_launch(big, "sm_90")
    assert row["error"] is None
    assert row["shared"] > aot.TARGETS["sm_90"][1]
    assert not row["fits"]
    assert row["why"].startswith(f"shared {row['shared']} B > 232448 B")


def test_block_that_does_not_compile_is_reported(aot, launches):
    """A block that is not a power of two (BK=24, a ``tl.arange`` range) is rejected by the compiler; the row carries
    the compiler's error and does not fit."""
    base = launches["_hc_pre_reduce_kernel"]
    row = aot.compile_launch(aot.Launch(base.fn, base.args, {**base.kwargs, "BK": 24}, base.site, "BK=24"), "sm_90")
    assert row["error"] and row["error"].startswith("CompilationError")
    assert row["fits"] is False and row["why"] == "compile error"


@pytest.mark.parametrize(("regs", "warps", "why"), [
    (256, 1, "256 registers > 255"),
    (255, 4, ""),
    (255, 8, ""),
    (255, 16, "255 registers x 512 threads > 65536"),
    (64, 64, "2048 threads > 1024"),
])
def test_register_and_thread_limits(aot, regs, warps, why):
    """check_fit on rows ptxas could report: over 255 registers per thread, over 64 Ki registers per block, over
    1024 threads per block."""
    row = {"error": None, "shared": 0, "regs": regs, "spills": 0, "num_warps": warps}
    fits, reason = aot.check_fit(row, "sm_90")
    assert fits is (why == "")
    assert why in reason
    with pytest.raises(KeyError, match="sm_75"):
        aot.check_fit(row, "sm_75")


def test_ptxas_log_parsing(aot):
    log = ("ptxas info    : Function properties for k\n    0 bytes stack frame, 44 bytes spill stores, 44 bytes "
           "spill loads\nptxas info    : Used 255 registers, used 1 barriers\n")
    assert aot.parse_ptxas_log(log) == (255, 44)
    assert aot.parse_ptxas_log("no lines") == (None, 0)


# ================================================================= the shared-memory prune of fla's autotuners
# fla's chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64 (K = V = 128, BT = 64, bf16, the KDA backward's launch) as
# scripts/gpu_aot.py --unpruned compiled it: shared bytes per (BV, num_warps, num_stages) and target.
DHU = "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64"
DHU_SHARED = {
    "sm_80": {(32, 2, 2): 61440, (32, 2, 3): 118784, (32, 2, 4): 176128, (32, 4, 2): 61440, (32, 4, 3): 118784,
              (32, 4, 4): 176128, (64, 2, 2): 73728, (64, 2, 3): 139264, (64, 2, 4): 204800, (64, 4, 2): 73728,
              (64, 4, 3): 139264, (64, 4, 4): 204800},
    "sm_90": {(32, 2, 2): 61440, (32, 2, 3): 118784, (32, 2, 4): 176128, (32, 4, 2): 122880, (32, 4, 3): 180224,
              (32, 4, 4): 237568, (64, 2, 2): 73728, (64, 2, 3): 139264, (64, 2, 4): 204800, (64, 4, 2): 147456,
              (64, 4, 3): 212992, (64, 4, 4): 278528},
    "sm_100": {(32, 2, 2): 61440, (32, 2, 3): 118784, (32, 2, 4): 176128, (32, 4, 2): 90144, (32, 4, 3): 147488,
               (32, 4, 4): 204832, (64, 2, 2): 73728, (64, 2, 3): 139264, (64, 2, 4): 204800, (64, 4, 2): 108576,
               (64, 4, 3): 174112, (64, 4, 4): 239648},
}
# the configurations that do not fit (docs/benchmarks.md, "Every fla autotune configuration")
DHU_MISFITS = {"sm_80": {(32, 2, 4), (32, 4, 4), (64, 2, 4), (64, 4, 4)}, "sm_90": {(32, 4, 4), (64, 4, 4)},
               "sm_100": {(64, 4, 4)}}


def _dhu_configs():
    """fla's list for that kernel on a device with Ampere-class shared memory or more."""
    import triton
    return [triton.Config({"BV": bv}, num_warps=w, num_stages=s) for w in (2, 4) for s in (2, 3, 4) for bv in (32, 64)]


def _cfg_key(config):
    return config.kwargs["BV"], config.num_warps, config.num_stages


class _StandInDriver:
    """triton's active driver as far as the prune and ``JITFunction.run(warmup=True)`` read it, for one target."""

    def __init__(self, target: str):
        from triton.backends.compiler import GPUTarget
        self.arch = {"sm_80": 80, "sm_90": 90, "sm_100": 100}[target]
        self.smem = {"sm_80": 166912, "sm_90": 232448, "sm_100": 232448}[target]
        self.target = GPUTarget("cuda", self.arch, 32)
        self.utils = self

    def get_device_properties(self, _device):
        return {"max_shared_mem": self.smem, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

    def get_current_device(self):
        return 0

    def get_current_stream(self, _device=None):
        return 0

    def get_current_target(self):
        return self.target


@pytest.fixture
def stand_in(monkeypatch):
    """``stand_in(target)`` makes triton's active driver report ``target`` until the test ends."""
    from triton.runtime import driver

    def use(target):
        monkeypatch.setattr(driver, "_active", _StandInDriver(target))
    return use


class _MeasuredKernel:
    """A stand-in for the JIT function under an autotuner: ``run(..., warmup=True)`` returns a compiled kernel whose
    metadata carries the measured shared bytes of :data:`DHU_SHARED`; any other call fails the test."""

    def __init__(self, shared: dict, name: str = DHU):
        def kernel():
            pass
        kernel.__name__ = name
        self.fn, self.arg_names, self.shared, self.compiled = kernel, ["BV"], shared, []

    def run(self, *args, grid, warmup, BV, num_warps, num_stages, **kwargs):
        from types import SimpleNamespace
        assert warmup is True, "the prune launched a kernel"
        key = (BV, num_warps, num_stages)
        self.compiled.append(key)
        value = self.shared[key]
        if isinstance(value, Exception):
            raise value
        return SimpleNamespace(metadata=SimpleNamespace(shared=value) if value is not None else SimpleNamespace())


def _tuner(kernel, configs, prune=None):
    from triton.runtime.autotuner import Autotuner
    return Autotuner(kernel, kernel.arg_names, configs, [], None, None,
                     prune_configs_by={"early_config_prune": prune} if prune else None)


def _prune(tuner):
    tuner.nargs = {}
    try:
        return tuner.prune_configs({"grid": (1,), "warmup": False})
    finally:
        tuner.nargs = None


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "sm_100"])
def test_prune_drops_exactly_the_misfits_of_each_target(stand_in, target):
    """On a stand-in device of each capability, the prune drops the configurations whose measured shared memory
    exceeds the device's per-block limit (the 7 misfits of the AOT run: 4 on sm_80, 2 on sm_90, 1 on sm_100) and keeps
    every other one, in fla's order; each configuration is compiled once, none launched."""
    from glm53flash_hf import fla_compat
    stand_in(target)
    kernel = _MeasuredKernel(DHU_SHARED[target])
    tuner = _tuner(kernel, _dhu_configs())
    assert fla_compat.prune_by_shared_memory(tuner) is True
    fla_compat.prune_by_shared_memory(tuner)  # idempotent: the first chain stays, no second one
    kept = _prune(tuner)
    fitting = [_cfg_key(c) for c in _dhu_configs() if _cfg_key(c) not in DHU_MISFITS[target]]
    assert [_cfg_key(c) for c in kept] == fitting and len(fitting) == 12 - len(DHU_MISFITS[target])
    assert sorted(kernel.compiled) == sorted(DHU_SHARED[target])  # each once: the chain was not installed twice


def test_prune_is_idempotent_and_keeps_the_existing_prune(stand_in):
    """A second install changes nothing (returns False, same function); an autotuner's own ``early_config_prune``
    runs first and only what it keeps is compiled; ``on_drop`` hears each configuration dropped, its need and the
    limit."""
    from glm53flash_hf import fla_compat
    stand_in("sm_90")
    calls = []

    def only_bv64(configs, nargs, **kwargs):
        calls.append(len(configs))
        return [c for c in configs if c.kwargs["BV"] == 64]

    kernel = _MeasuredKernel(DHU_SHARED["sm_90"])
    tuner = _tuner(kernel, _dhu_configs(), prune=only_bv64)
    heard = []
    assert fla_compat.prune_by_shared_memory(tuner, on_drop=lambda t, c, need, limit: heard.append((c, need, limit)))
    chained = tuner.early_config_prune
    assert fla_compat.prune_by_shared_memory(tuner) is False and tuner.early_config_prune is chained
    kept = [_cfg_key(c) for c in _prune(tuner)]
    assert calls == [12]
    assert kept == [(64, w, s) for w in (2, 4) for s in (2, 3, 4) if (w, s) != (4, 4)]
    assert sorted(kernel.compiled) == sorted(k for k in DHU_SHARED["sm_90"] if k[0] == 64)
    assert [(_cfg_key(c), need, limit) for c, need, limit in heard] == [((64, 4, 4), 278528, 232448)]
    with pytest.raises(TypeError, match="must be a triton Autotuner, got _MeasuredKernel"):
        fla_compat.prune_by_shared_memory(kernel)


def test_prune_keeps_what_fits_or_is_unknown(stand_in):
    """Kept: a need equal to the limit, a configuration that does not compile (the autotuner's to report), one whose
    metadata has no ``shared``. Dropped: one byte over the limit. When nothing fits, the list comes back unchanged."""
    import triton

    from glm53flash_hf import fla_compat
    stand_in("sm_90")
    configs = [triton.Config({"BV": bv}, num_warps=4, num_stages=2) for bv in (16, 32, 64, 128)]
    shared = {(16, 4, 2): 232448, (32, 4, 2): 232449, (64, 4, 2): RuntimeError("does not compile"),
              (128, 4, 2): None}
    tuner = _tuner(_MeasuredKernel(shared), configs)
    fla_compat.prune_by_shared_memory(tuner)
    assert [_cfg_key(c) for c in _prune(tuner)] == [(16, 4, 2), (64, 4, 2), (128, 4, 2)]

    over = {k: 300000 for k in DHU_SHARED["sm_90"]}
    tuner = _tuner(_MeasuredKernel(over), _dhu_configs())
    fla_compat.prune_by_shared_memory(tuner)
    assert [_cfg_key(c) for c in _prune(tuner)] == [_cfg_key(c) for c in _dhu_configs()]


def test_prune_compiles_a_real_kernel_for_the_device(stand_in, launches, monkeypatch):
    """The measure is Triton's own compile for the active driver's target: ``_hc_pre_reduce_kernel`` under an autotuner
    with its release block and BK=512 (over 227 KiB of shared memory on sm_90, see above); the prune keeps the first
    and drops the second, compiling both and launching neither."""
    from collections import defaultdict

    import triton

    from glm53flash_hf import fla_compat
    stand_in("sm_90")
    base = launches["_hc_pre_reduce_kernel"]
    fn = base.fn
    monkeypatch.setattr(fn, "device_caches", defaultdict(fn.create_binder))  # the stand-in target's binder, then gone
    kwargs = {k: v for k, v in base.kwargs.items() if k != "BK"}
    configs = [triton.Config({"BK": base.kwargs["BK"]}), triton.Config({"BK": 512})]
    tuner = _tuner(fn, configs)
    heard = []
    fla_compat.prune_by_shared_memory(tuner, on_drop=lambda t, c, need, limit: heard.append((c.kwargs["BK"], need)))
    tuner.nargs = dict(zip(fn.arg_names, base.args))
    kept = tuner.prune_configs({**kwargs, "grid": (1,), "warmup": False})
    assert [c.kwargs["BK"] for c in kept] == [base.kwargs["BK"]]
    assert [bk for bk, _ in heard] == [512] and heard[0][1] > 232448


def test_prune_is_installed_on_fla_autotuners_only_for_cuda_tensors(monkeypatch):
    """:func:`fla_compat.checked` installs the prune on the autotuners of the imported ``fla.*`` modules (through
    a ``Heuristics`` wrapper too) at the first call with a CUDA tensor after fla was loaded; CPU and meta tensors, or
    no tensor, install nothing; installing again changes nothing."""
    import sys
    import types

    import torch
    import triton
    from torch._subclasses.fake_tensor import FakeTensorMode
    from triton.runtime.autotuner import Heuristics

    from glm53flash_hf import fla_compat
    plain = _tuner(_MeasuredKernel({}, "k1"), _dhu_configs())
    wrapped = _tuner(_MeasuredKernel({}, "k2"), _dhu_configs())
    module = types.ModuleType("fla.ops.glm53flash_test")
    module.plain, module.wrapped = plain, Heuristics(wrapped, ["BV"], {"X": lambda args: 1})
    module.not_a_kernel = triton.Config({})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(fla_compat._PRUNE, "pending", True)
    assert {id(t) for t in fla_compat.fla_autotuners()} >= {id(plain), id(wrapped)}

    def marked():
        return [getattr(t, fla_compat._PRUNED_MARK, False) for t in (plain, wrapped)]

    def fn(x):
        return "called"

    assert fla_compat.checked(types.SimpleNamespace(fn=fn), "fn", x=torch.zeros(1))() == "called"
    assert fla_compat.checked(types.SimpleNamespace(fn=fn), "fn", x=torch.zeros(1, device="meta"))() == "called"
    assert fla_compat.checked(types.SimpleNamespace(fn=fn), "fn", x=3)() == "called"
    assert marked() == [False, False] and fla_compat._PRUNE["pending"] is True
    with FakeTensorMode():
        on_gpu = torch.empty(1, device="cuda")
    assert fla_compat.checked(types.SimpleNamespace(fn=fn), "fn", x=on_gpu)() == "called"
    assert marked() == [True, True] and fla_compat._PRUNE["pending"] is False
    chained = plain.early_config_prune
    assert fla_compat.install_shared_memory_prune() == 0 and plain.early_config_prune is chained
