"""Ahead-of-time compilation of the package's own Triton kernels for ``sm_90`` without a GPU (``scripts/gpu_aot.py``).

* Every ``@triton.jit`` kernel of ``mhc_fused``, ``dsa_fused`` and ``moe_fused`` (``triton_utils.round_to`` is inlined
  into them) is launched by its launcher at the release shapes with the launch recorded, not run; one recorded
  configuration per kernel is compiled through Triton's NVIDIA pipeline and ``ptxas`` for ``sm_90`` and must fit the
  per-block limits (shared memory, registers, threads). A kernel that no longer builds for a GPU fails here.
* The same check refuses what cannot launch: a real kernel compiled with a block that needs more shared memory than
  ``sm_90`` has, a block that does not compile, and register counts over the limits.

fla's kernels are not compiled here (the script covers them); this process hides fla anyway (``tests/conftest.py``).
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
