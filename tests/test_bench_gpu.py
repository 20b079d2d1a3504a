"""CPU checks of the GPU-only scripts, so they cannot rot between GPU runs.

* ``scripts/bench_gpu.py --smoke`` runs end to end in a child process (tiny shapes, CPU, every variant that can run
  there: transformers' modules, ours with "fused" falling back to torch, ours with "torch", our entry points; the raw
  kernels are reported "n/a") and writes its markdown and JSON reports.
* The report's target logic is checked on synthetic GPU-like results (speed-ups, OOM, errors, fallbacks, the DSA
  memory-growth check and the entry-point overhead), which the CPU smoke cannot produce.
* ``scripts/gpu_check.sh`` and ``scripts/gpu_wheels.sh`` pass ``bash -n``; the check script names only benchmark options
  that exist.
* ``scripts/bench_sp_kda.py --smoke`` (the KDA-layer sequence-parallel part of gpu_check.sh): one device and SP=2
  over gloo through torchrun, tiny shapes on CPU; without ``--smoke`` and without CUDA it refuses (exit 2).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "scripts", "bench_gpu.py")


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run(tmp_path):
    """The whole script on CPU in a child process (its own fla hiding, as on the GPU): every family and S has a row,
    the variants that can run on CPU have times, the fused requests are reported as fallbacks, raw is n/a."""
    report, results = tmp_path / "bench.md", tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, BENCH, "--smoke", "--report", str(report), "--json", str(results)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads(results.read_text())
    rows = {(r["family"], r["seq"]): r["variants"] for r in data["results"]}
    assert sorted(rows) == sorted((f, s) for f in ("kda", "dsa", "mhc", "moe") for s in (32, 64))
    for (family, seq), v in rows.items():
        for name in ("hf", "ours", "ours_torch", "entry"):
            assert v[name]["status"] == "ok" and v[name]["ms"] > 0, (family, seq, name, v[name])
        assert v["ours"]["fallback"] and "not on a CUDA device" in v["ours"]["fallback"][0]
        assert "fallback" not in v["ours_torch"]
        assert v["raw"]["skip"].startswith("n/a")
    # the roofline prediction of every case (gpu_cost.family_cost at the tiny shapes), shown in the report
    bench = load_bench()
    for r in data["results"]:
        assert r["predicted_ms"] == pytest.approx(bench.predicted_ms(r["family"], bench.TINY_TEXT, r["seq"]))
        assert r["predicted_ms"] > 0
    entry_lines = [line for line in proc.stdout.splitlines() if re.match(r"\[bench\] \w+ S=\d+ entry:", line)]
    assert len(entry_lines) == 8 and all("(H200 SXM roofline), measured/predicted" in line for line in entry_lines)
    text = report.read_text()
    assert text.count("| kda |") == 2 and "## Targets" in text and "device: cpu (smoke)" in text


def synthetic_results():
    ok = lambda ms, gib=1.0: dict(status="ok", ms=ms, peak_gib=gib)  # noqa: E731
    return [
        dict(family="kda", seq=8192, variants=dict(hf=ok(120.0), ours=ok(10.0), entry=ok(5.2), raw=ok(5.0)),
             predicted_ms=2.5),
        dict(family="kda", seq=32768, variants=dict(hf=dict(status="OOM"), ours=ok(40.0), entry=ok(23.0),
                                                     raw=ok(20.0))),
        dict(family="mhc", seq=8192, variants=dict(hf=ok(30.0), ours=ok(10.0, 0.5), ours_torch=dict(skip="-"),
                                                    entry=dict(status="error: RuntimeError: boom"), raw=ok(1.0))),
        dict(family="dsa", seq=8192, variants=dict(hf=ok(50.0, 9.0), ours=ok(8.0, 2.0))),
        dict(family="dsa", seq=32768, variants=dict(hf=dict(status="OOM"), ours=ok(33.0, 12.0),
                                                     entry=dict(status="ok", ms=3.0, peak_gib=1.0,
                                                                fallback=["kernels['dsa']='fused' ... cannot run"]))),
        dict(family="moe", seq=8192, variants={}, skipped="skipped: time budget of 150 s spent"),
    ]


def test_targets_and_report_on_synthetic_results(tmp_path):
    bench = load_bench()
    results = synthetic_results()
    lines = bench.targets(results)
    assert "- kda S=8192: ours vs built-in 12.0x (target >= 10x): met" in lines
    assert "- kda S=32768: ours vs built-in - (target >= 10x): met (built-in OOM)" in lines
    assert "- mhc S=8192: ours vs built-in 3.0x (target >= 4x): NOT met" in lines
    assert "- dsa S=32768: ours vs built-in - (target >= 5x): met (built-in OOM)" in lines
    assert not any("dsa S=8192: ours vs" in line for line in lines)  # the DSA speed target is at the longest S
    assert "- dsa peak memory S=32768 / S=8192: 6.00 (linear in S: <= 5.0): NOT met" in lines
    assert "- kda S=8192: entry point overhead over the raw kernel +4.0% (target <= 15%): met" in lines
    assert "- kda S=32768: entry point overhead over the raw kernel +15.0% (target <= 15%): met" in lines
    assert not any("mhc S=8192: entry point" in line for line in lines)  # entry errored: no ratio
    path = tmp_path / "r.md"
    bench.write_report(str(path), results, dict(device="test"))
    text = path.read_text()
    assert "| kda | 32768 | OOM | - | 40.0 | 1.00 | - |" in text
    assert "| mhc | 8192 | 30.0 | 1.00 | 10.0 | 0.50 | 3.0x | - | error: RuntimeError: boom | 1.0 | - | - | - |" in text
    assert "| kda | 8192 | 120.0 | 1.00 | 10.0 | 1.00 | 12.0x | - | 5.2 | 5.0 | +4.0% | 2.50 | 2.00 |" in text
    assert "entry: fell back to torch" in text and "skipped: time budget" in text
    header = [line for line in text.splitlines() if line.startswith("| family")][0]
    assert all(line.count("|") == header.count("|") for line in text.splitlines() if line.startswith("| kda"))


def test_measure_reports_errors_and_oom():
    """run_variant turns an OOM into "OOM" and another exception into "error: ..."; fallbacks are collected."""
    import torch

    bench = load_bench()
    cpu = torch.device("cpu")

    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB")

    def bad():
        raise ValueError("shapes do not fit\nsecond line")

    assert bench.run_variant("x", oom, [], cpu, 0, 1) == dict(status="OOM")
    assert bench.run_variant("x", bad, [], cpu, 0, 1) == dict(status="error: ValueError: shapes do not fit")
    res = bench.run_variant("x", lambda: None, [], cpu, 1, 2)
    assert res["status"] == "ok" and res["ms"] >= 0 and res["peak_gib"] is None


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts", script)], check=True, timeout=30)


def test_gpu_check_uses_existing_bench_options():
    """The options gpu_check.sh passes to the benchmark parse (a renamed option would fail only on the GPU)."""
    bench = load_bench()
    text = open(os.path.join(ROOT, "scripts", "gpu_check.sh")).read()
    call = text[text.index('"$PY" scripts/bench_gpu.py'):]
    call = call[: call.index("BENCH_STATUS=$(run_status")]
    options = re.findall(r"(--[a-z-]+)", call)
    assert options == ["--report", "--json", "--budget-s"], options
    args = bench.parse_args(["--report", "r.md", "--json", "r.json", "--budget-s", "150"])
    assert (args.report, args.json, args.budget_s, args.seqs, args.repeats) == ("r.md", "r.json", 150.0,
                                                                                [8192, 32768], 3)


def test_bench_sp_kda_smoke(tmp_path):
    """The SP KDA-layer benchmark's smoke mode: a one-device row and an SP=2 row (two torchrun processes, gloo) with
    times, the JSON rows, and the note naming the target; the release shape without CUDA exits 2."""
    script = os.path.join(ROOT, "scripts", "bench_sp_kda.py")
    report, results = tmp_path / "sp.md", tmp_path / "sp.json"
    proc = subprocess.run([sys.executable, script, "--smoke", "--iters", "2", "--warmup", "1", "--report", str(report),
                           "--json", str(results)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = json.loads(results.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["one device", "SP=2"] and all(r["ms"] > 0 for r in rows), rows
    assert len(rows[1]["ms_all"]) == 2
    assert "| SP=2 | 2 | cpu |" in report.read_text() and "44.35 ms" in report.read_text()
    if not __import__("torch").cuda.is_available():
        proc = subprocess.run([sys.executable, script], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "no CUDA device" in proc.stdout
