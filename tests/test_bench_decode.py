"""``scripts/bench_decode.py`` runs end to end (tiny sizes): every implementation loads the same folder, generates
greedily (eager with the dynamic cache; compiled with a static cache through transformers' ``compile_config``),
and picks the same tokens; the table and the per-run line are printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_decode_smoke(tmp_path):
    out_json = tmp_path / "runs.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_decode.py"), "--prompts", "48", "--new", "4",
         "--impls", "hf", "ours", "ours-compiled", "--json", str(out_json)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "BENCH_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| prompt | transformers eager |" in proc.stdout
    assert "same greedy tokens as hf: ours 4/4, ours-compiled 4/4" in proc.stdout, proc.stdout
    assert "all runs, ms/token: hf 48:" in proc.stdout
    runs = json.loads(out_json.read_text())
    assert {r["impl"] for r in runs} == {"hf", "ours", "ours-compiled"}
    assert all("failed" not in r and r["ms_per_token"] > 0 for r in runs), runs


def test_bench_decode_mtp_smoke(tmp_path):
    """``--mtp``: plain vs ``use_mtp=True`` on the random model with an MTP layer; same tokens, acceptance and
    tokens/s reported."""
    out_json = tmp_path / "mtp.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_decode.py"), "--mtp", "--prompts", "24", "--new", "4",
         "--json", str(out_json)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "BENCH_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| model | prompt | plain tokens/s | use_mtp tokens/s |" in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| random | 24 |"))
    assert row.endswith("| yes |"), proc.stdout
    runs = json.loads(out_json.read_text())
    assert [r["impl"] for r in runs] == ["ours", "ours-mtp"]
    assert 1 <= runs[1]["acceptance"]["drafted"] <= 3 and all(r["tok_per_s"] > 0 for r in runs)
