"""Run the numerically sensitive tests under perturbed fp32 summation orders and print a summary table.

Each combination of ``OMP_NUM_THREADS`` (how torch splits its reductions across threads) and
``ATEN_CPU_CAPABILITY`` (the vector width of ATen's CPU kernels: ``default`` scalar, ``avx2``, or unset for the
machine's own best) runs ``python -m pytest -q`` on the test files in a fresh process; the table shows each run's
pytest summary line, the capability torch actually used, and the wall time. Exit status 1 if any run failed.

Usage (from the repository root)::

    .venv/bin/python scripts/investigations/numerics_matrix.py                    # the default files, 2 x 3 runs
    .venv/bin/python scripts/investigations/numerics_matrix.py tests/test_kda.py  # chosen files
    .venv/bin/python scripts/investigations/numerics_matrix.py --threads 1 --capabilities default -- -k conv

Where a capability is not supported by the CPU (``avx2`` off x86), ATen falls back to the best one it has; the
``capability`` column shows which one ran.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Files whose asserts compare fp32 evaluations of the same maths in other orders (cached vs uncached, chunked vs
# whole, ours vs transformers, merged vs adapted): the ones a machine's kernels can move.
DEFAULT_FILES = [
    "tests/test_generation.py",
    "tests/test_kda.py",
    "tests/test_peft.py",
    "tests/test_dsa.py",
    "tests/test_mhc.py",
    "tests/test_moe.py",
    "tests/test_norm.py",
    "tests/test_packing.py",
    "tests/test_grad_ckpt.py",
    "tests/test_aux_loss.py",
    "tests/test_mtp.py",
]
MACHINE = "machine"  # no ATEN_CPU_CAPABILITY: the machine's default

_PROBE = "import torch; print(torch.backends.cpu.get_cpu_capability())"


def _env(threads: str, capability: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability != MACHINE:
        env["ATEN_CPU_CAPABILITY"] = capability
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def _summary(output: str) -> str:
    """pytest's last summary line (``3 passed, 1 failed in 12.3s``), or the output's last line."""
    lines = [line.strip("= ") for line in output.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if re.search(r"\b(passed|failed|error|errors|skipped|deselected|no tests ran)\b", line):
            return line
    return lines[-1] if lines else "(no output)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help=f"test files (default: {' '.join(DEFAULT_FILES)})")
    parser.add_argument("--threads", nargs="+", default=["1", "2"], help="OMP_NUM_THREADS values (default: 1 2)")
    parser.add_argument(
        "--capabilities", nargs="+", default=["default", "avx2", MACHINE],
        help=f"ATEN_CPU_CAPABILITY values; '{MACHINE}' leaves it unset (default: default avx2 {MACHINE})",
    )
    args, pytest_args = parser.parse_known_args(argv)
    pytest_args = [a for a in pytest_args if a != "--"]
    files = args.files or DEFAULT_FILES
    rows = []
    for threads in args.threads:
        for capability in args.capabilities:
            env = _env(threads, capability)
            probe = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True)
            used = probe.stdout.strip() or "?"
            start = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, *pytest_args],
                cwd=ROOT, env=env, capture_output=True, text=True,
            )
            wall = time.perf_counter() - start
            line = _summary(proc.stdout + proc.stderr)
            rows.append((threads, capability, used, proc.returncode, f"{wall:.0f} s", line))
            print(f"OMP_NUM_THREADS={threads} ATEN_CPU_CAPABILITY={capability} ({used}): {line}", flush=True)
            if proc.returncode != 0:
                failed = [x for x in proc.stdout.splitlines() if x.startswith(("FAILED", "ERROR"))]
                print("\n".join(failed[:20]), flush=True)
    header = ("threads", "ATEN_CPU_CAPABILITY", "capability", "rc", "wall", "pytest")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print()
    for r in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0 if all(r[3] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
