"""Triton-interpreter child processes, shared by the kernel test files (``tests/test_*_fused.py``).

``TRITON_INTERPRET=1`` must be set before triton is first imported, and setting it in the main test process would leak
into every later test (GPU tests would silently run interpreted). So each file's ``interpreter`` tests run in a child
pytest started with the variable set (:func:`run_interpreter_child`, called by the file's
``test_interpreter_tests_in_subprocess``) and are skipped in the main process (:func:`skip_unless_interpreting`).
"""

from __future__ import annotations

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
