"""Test-session setup shared by every test file.

transformers' ``glm5_next`` (our oracle) binds ``fla.ops.kda.chunk_kda`` at import when fla-core is installed
(``use_kernel_func_from_hub_with_fallback``), and fla's Triton kernels then fail on CPU tensors with
"0 active drivers" (``docs/design.md``, section "KDA"). fla-core is in the ``test`` extra for the interpreter tests of
``glm53flash_hf.kda_fused``, so in the main process we hide it *before* transformers' module is imported: the oracle
keeps its torch reference. Interpreter children (``TRITON_INTERPRET=1``) keep fla importable; they compare our fused
paths with our torch paths, not with transformers'.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1" and "fla" not in sys.modules:
    sys.modules["fla"] = None  # ``import fla`` raises ImportError: transformers falls back to its torch reference

import pytest  # noqa: E402  (after the fla stand-in above)
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Every test leaves torch's intra-op thread count as it found it: results compared bit for bit with a fresh
    process (tests/test_remote_code.py) depend on it. A test that leaves it changed fails at teardown."""
    threads = torch.get_num_threads()
    yield
    left = torch.get_num_threads()
    if left != threads:
        torch.set_num_threads(threads)
        pytest.fail(f"the test left torch.get_num_threads() = {left}; it was {threads} before the test")
