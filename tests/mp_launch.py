"""Launching multi-process (gloo, CPU) test workers: the loop shared by tests/test_fsdp2.py,
tests/test_expert_parallel.py and tests/test_sequence_parallel.py.

A worker is a module-level function ``worker(rank, *args)`` (picklable under ``spawn``) that writes its results to
a file; :func:`run_workers` starts ``nprocs`` of them with ``torch.multiprocessing`` and waits, failing the test
(``pytest.fail``) on a worker exception or on the deadline, and terminating any worker still alive either way.
"""

from __future__ import annotations

import socket
import time

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of the call (for ``init_method=tcp://127.0.0.1:<port>``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(fn, args: tuple, nprocs: int, what: str, deadline_s: float = 420) -> None:
    """Run ``fn(rank, *args)`` on ``nprocs`` spawned processes until all return.

    Raises (through ``pytest.fail``): a worker raised (its traceback in the message), or the workers still run
    after ``deadline_s`` seconds; ``what`` names them in the message (e.g. ``"SP"``).
    """
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    start = time.monotonic()
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() - start > deadline_s:
                pytest.fail(f"{what} workers still running after {deadline_s} s")
    except mp.ProcessRaisedException as exc:
        pytest.fail(f"an {what} worker failed:\n{exc}")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
