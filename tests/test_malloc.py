"""``glm53flash_hf.train.malloc``: each heap policy sets exactly its ``mallopt`` parameters, the opt-out changes
nothing, a C library that is not glibc gets one warning; and, in fresh processes, the effect itself: a freed 64 MiB
tensor's pages are reused by the next one under ``reuse`` and faulted in afresh under ``default``; a freed 4 MiB
tensor's pages are kept by glibc's default heap (its mmap threshold rises past 4 MiB) and returned under ``bounded``;
huge pages are reported as in use exactly when ``THP_MEM_ALLOC_ENABLE=1`` was set before torch's first CPU allocation
(by the environment, or by a policy set before any tensor). Also the
``--malloc`` choice of ``glm53flash-finetune``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from glm53flash_hf.tools.finetune import build_parser, malloc_policy
from glm53flash_hf.train import malloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeLibc:
    def __init__(self, accept=True):
        self.calls, self.accept = [], accept

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 1 if self.accept else 0


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setattr(malloc, "_state", {"policy": "default", "warned": False})


def test_reuse_sets_the_three_parameters(fresh_state, monkeypatch):
    libc = FakeLibc()
    monkeypatch.setattr(malloc, "_glibc", lambda: libc)
    assert malloc.set_malloc_policy("reuse") is True
    # glibc malloc.h: M_TRIM_THRESHOLD -1, M_TOP_PAD -2, M_MMAP_MAX -4
    assert sorted(libc.calls) == sorted([(-4, 0), (-1, 2**31 - 1), (-2, 64 << 20)])
    assert malloc.current_malloc_policy() == "reuse"
    assert malloc.set_malloc_policy("reuse") is True and len(libc.calls) == 3  # applied once


def test_bounded_sets_the_four_parameters_and_switches(fresh_state, monkeypatch):
    libc = FakeLibc()
    monkeypatch.setattr(malloc, "_glibc", lambda: libc)
    assert malloc.set_malloc_policy("bounded") is True
    # glibc malloc.h: M_MMAP_THRESHOLD -3; M_MMAP_MAX and M_TOP_PAD back at glibc's defaults (65536, 128 KiB)
    assert sorted(libc.calls) == sorted([(-4, 65536), (-3, 2 << 20), (-1, 32 << 20), (-2, 128 << 10)])
    assert malloc.current_malloc_policy() == "bounded"
    assert malloc.set_malloc_policy("reuse") is True and malloc.current_malloc_policy() == "reuse"
    assert libc.calls[4:] == [(-4, 0), (-1, 2**31 - 1), (-2, 64 << 20)]


def test_default_is_an_opt_out(fresh_state, monkeypatch):
    libc = FakeLibc()
    monkeypatch.setattr(malloc, "_glibc", lambda: libc)
    assert malloc.set_malloc_policy("default") is False
    assert libc.calls == [] and malloc.current_malloc_policy() == "default"


def test_bad_policy_names_the_argument(fresh_state):
    names = r"\('default', 'reuse', 'bounded'\)"
    with pytest.raises(ValueError, match=rf"policy must be one of {names}; got policy='always'"):
        malloc.set_malloc_policy("always")


def test_not_glibc_warns_once(fresh_state, monkeypatch):
    monkeypatch.setattr(malloc, "_glibc", lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert malloc.set_malloc_policy("reuse") is False
        assert malloc.set_malloc_policy("reuse") is False
    assert [str(w.message) for w in caught if w.category is RuntimeWarning] == [
        f"malloc policy 'reuse' needs glibc (Linux); this C library ({sys.platform}) keeps its default"
    ]
    assert malloc.current_malloc_policy() == "default"


def test_refused_setting_warns(fresh_state, monkeypatch):
    monkeypatch.setattr(malloc, "_glibc", lambda: FakeLibc(accept=False))
    with pytest.warns(RuntimeWarning, match="mallopt refused M_MMAP_MAX, M_TRIM_THRESHOLD, M_TOP_PAD"):
        assert malloc.set_malloc_policy("reuse") is False


_CHILD = r"""
import json, resource, sys
import torch
from glm53flash_hf.train.malloc import set_malloc_policy

applied = set_malloc_policy(sys.argv[1])
faults = []
for _ in range(48):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.empty(int(sys.argv[2]) << 20, dtype=torch.uint8)
    block.fill_(1)  # touch every page
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del block
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _child(*args, thp="0", code=_CHILD):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "THP_MEM_ALLOC_ENABLE": thp}
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(malloc._glibc() is None, reason="the heap policy applies to glibc only")
@pytest.mark.parametrize("policy", ["reuse", "default"])
def test_freed_pages_are_reused_only_under_reuse(policy):
    res = _child(policy, "64")
    first, later = res["faults"][0], res["faults"][-4:]
    assert first >= 16, res  # the first 64 MiB block is new memory either way
    if policy == "reuse":
        # glibc 2.36: the first repeats may still grow the heap (posix_memalign's split-off tail sits in the tcache
        # next to the freed block): 5-8 repeats here, depending on what the process allocated before; at least 11 on
        # CI's machine (stop 44 failed with 12 repeats). From then on the freed block is reused: 0 faults
        assert res["applied"] is True
        assert all(f <= 0.05 * first for f in later), res
    else:
        assert res["applied"] is False
        assert all(f >= 0.5 * first for f in later), res  # a fresh mmap each time: faulted in again


@pytest.mark.skipif(malloc._glibc() is None, reason="the heap policy applies to glibc only")
@pytest.mark.parametrize("policy", ["bounded", "default"])
def test_freed_blocks_below_32_mib_are_returned_only_under_bounded(policy):
    res = _child(policy, "4")
    first, later = res["faults"][0], res["faults"][-4:]
    assert first >= 16, res  # 1024 pages of 4 KiB
    if policy == "bounded":
        assert res["applied"] is True
        assert all(f >= 0.5 * first for f in later), res  # its own mmap, unmapped on free: faulted in again
    else:
        # glibc raises its mmap threshold to the size of a freed mapped block (up to 32 MiB): from the second
        # block on, 4 MiB comes from the heap and stays there
        assert res["applied"] is False
        assert all(f <= 0.05 * first for f in later), res


_HUGE_CHILD = r"""
import json
from glm53flash_hf.train.malloc import huge_pages_in_use
print(json.dumps({"huge": huge_pages_in_use()}))
"""


_POLICY_HUGE_CHILD = r"""
import json, os, sys
import torch
from glm53flash_hf.train.malloc import huge_pages_in_use, set_malloc_policy

if sys.argv[1] == "allocated-first":
    torch.ones(8)  # torch reads THP_MEM_ALLOC_ENABLE at its first CPU allocation
os.environ.pop("THP_MEM_ALLOC_ENABLE")
set_malloc_policy("bounded")
print(json.dumps({"huge": huge_pages_in_use(), "variable": os.environ.get("THP_MEM_ALLOC_ENABLE")}))
"""


@pytest.mark.skipif(malloc._thp_mode() not in ("always", "madvise"), reason="the kernel offers no THP")
@pytest.mark.parametrize("thp", ["1", "0"])
def test_huge_pages_follow_the_variable_set_before_the_start(thp):
    if thp == "0" and malloc._thp_mode() == "always":
        pytest.skip("under THP mode 'always' every large anonymous mapping may get huge pages without the variable")
    assert _child(thp=thp, code=_HUGE_CHILD)["huge"] is (thp == "1")


@pytest.mark.skipif(malloc._glibc() is None or malloc._thp_mode() != "madvise", reason="glibc and THP madvise mode")
@pytest.mark.parametrize("when", ["before-any-tensor", "allocated-first"])
def test_the_policy_turns_huge_pages_on_before_the_first_tensor(when):
    res = _child(when, code=_POLICY_HUGE_CHILD)
    assert res["variable"] == "1"
    assert res["huge"] is (when == "before-any-tensor"), res  # set too late: torch keeps what it read


def test_finetune_malloc_choice():
    assert malloc_policy("auto", cuda_available=False) == "bounded"
    assert malloc_policy("auto", cuda_available=True) == "default"
    assert malloc_policy("default", cuda_available=False) == "default"
    assert malloc_policy("reuse", cuda_available=True) == "reuse"
    parser = build_parser()
    assert parser.parse_args([]).malloc == "auto"
    assert parser.parse_args(["--malloc", "default"]).malloc == "default"
    assert parser.parse_args(["--malloc", "bounded"]).malloc == "bounded"
    with pytest.raises(SystemExit):
        parser.parse_args(["--malloc", "tcmalloc"])
