"""``scripts/bench_decode.py`` runs end to end (tiny sizes): both implementations load the same folder, decode, and
pick the same greedy tokens; the table and the per-run line are printed."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_decode_smoke(tmp_path):
    out_json = tmp_path / "runs.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_decode.py"), "--prompt", "48", "--new", "4",
         "--repeats", "1", "--json", str(out_json)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "BENCH_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| decode (tokens/s) |" in proc.stdout
    assert "same greedy tokens: 4/4" in proc.stdout, proc.stdout
    assert "all runs, decode tokens/s: transformers" in proc.stdout
    import json

    runs = json.loads(out_json.read_text())
    assert set(runs) == {"hf", "ours"} and all(len(r) == 1 and r[0]["tok_per_s"] > 0 for r in runs.values())
