#!/usr/bin/env bash
# One prepared check for a GPU machine: installs what it needs, runs the `gpu` tests, then the GPU benchmark,
# and writes a report (with scripts/gpu_cost.py's roofline for the device in use, H100 or H200: the benchmark prints
# measured / predicted per family and sequence length, the report adds the per-kernel predictions). Its step limits add up to 500 s (tests 180, benchmark 170, roofline 30, KDA SP 120), within 10 minutes on
# one H200 (the device budget is 15 min, machine start included).
#
# Prepare (on a machine with pip's package index, once):   bash scripts/gpu_wheels.sh     (fills .whl/, ignored by git)
# Run (repo root, on the GPU machine; the device tool carries .whl with carry=[".whl"]):
#     bash scripts/gpu_check.sh
# Writes under ${OUT:-./gpu-report}: report.md (summary: versions, test results, measured errors, benchmark table),
# gpu_check.log (everything printed), gpu_test_errors.json (per-tensor errors of tests/test_gpu.py), bench.md and
# bench.json (scripts/bench_gpu.py), sp_kda.md (scripts/bench_sp_kda.py: one KDA layer at 128k tokens, hidden 4096,
# 64 x 128 heads, fwd+bwd on one device, and our sequence parallelism over every visible GPU through torchrun when
# there are >= 2; with one GPU it says SP was not measured). Six files: the device tool brings back at most eight.
#
# Knobs (environment): PYTHON (default python3), GPU_TEST_TIMEOUT (s, whole pytest run, default 180),
# GPU_TEST_PER_TEST (s, default 120), BENCH_BUDGET (s after which the benchmark starts no new case, default 120),
# BENCH_TIMEOUT (s, hard limit, default 170), BENCH_ARGS (extra arguments), SKIP_TESTS=1, SKIP_BENCH=1, NO_WHEELS=1,
# SP_KDA_TIMEOUT (s, default 120), SP_KDA_ARGS (extra arguments of bench_sp_kda.py; --smoke is added when BENCH_ARGS
# has it), SKIP_SP_KDA=1.
# A CPU dry run of the whole pipeline (tests skip, benchmark in its smoke mode):
#     NO_WHEELS=1 PYTHON=.venv/bin/python OUT=/tmp/gpu-dry BENCH_ARGS=--smoke bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR=${OUT:-$ROOT/gpu-report}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
LOG="$OUT_DIR/gpu_check.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
START=$(date +%s)
stamp() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*"; }
# run_status RC LIMIT [SUFFIX]: a step's status line from the exit code of `timeout LIMIT ...`
run_status() {
  case $1 in
    0) echo "completed" ;;
    124) echo "stopped by the $2 s limit${3:-}" ;;
    *) echo "failed (exit $1)" ;;
  esac
}

# 1. Packages: the machine has no network; wheels travel in .whl/ (scripts/gpu_wheels.sh says which and why).
if [ "${NO_WHEELS:-0}" != 1 ] && compgen -G ".whl/*.whl" > /dev/null; then
  stamp "installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into /tmp/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { stamp "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  stamp "no .whl/ folder: using the installed packages (transformers >= 5.23 and fla-core 0.6 are needed)"
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}  # the repo itself, no install needed
export PYTHONUNBUFFERED=1
export GLM53_GPU_TEST_JSON="$OUT_DIR/gpu_test_errors.json"
rm -f "$GLM53_GPU_TEST_JSON"

# 2. Versions and the device.
stamp "versions"
"$PY" - <<'EOF'
import importlib, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
for name in ("triton", "transformers", "fla", "einops", "regex", "tokenizers", "huggingface_hub", "safetensors",
             "pytest", "pytest_timeout"):
    try:
        mod = importlib.import_module(name)
        print(name, getattr(mod, "__version__", "?"), getattr(mod, "__file__", ""))
    except Exception as exc:
        print(name, "NOT IMPORTABLE:", type(exc).__name__, exc)
import glm53flash_hf
print("glm53flash_hf", glm53flash_hf.__file__)
EOF
nvidia-smi || stamp "nvidia-smi failed"

# 3. The gpu tests: every test file that marks tests `gpu` (tests/test_fp8_kept.py::test_cuda_fp8_path is the CUDA
#    FP8-kept check: transformers' FP8 kernel or the block-row forward, LoRA fwd+bwd on the FP8 base).
TEST_STATUS="not run"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  mapfile -t FILES < <(grep -l -E "mark\.gpu" tests/*.py | sort)
  stamp "gpu tests in: ${FILES[*]}"
  timeout "${GPU_TEST_TIMEOUT:-180}" "$PY" -m pytest -m gpu -q -rA -p no:cacheprovider \
    --timeout="${GPU_TEST_PER_TEST:-120}" "${FILES[@]}" 2>&1 | tee "$OUT_DIR/.pytest.out"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) TEST_STATUS="passed" ;;
    124) TEST_STATUS="stopped by the ${GPU_TEST_TIMEOUT:-180} s limit" ;;
    5) TEST_STATUS="no tests collected" ;;
    *) TEST_STATUS="failed (pytest exit $rc)" ;;
  esac
  stamp "gpu tests: $TEST_STATUS"
fi

# 4. The benchmark (writes its report after every case, so a stopped run still leaves one).
BENCH_STATUS="not run"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  stamp "benchmark"
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-170}" "$PY" scripts/bench_gpu.py --report "$OUT_DIR/bench.md" --json "$OUT_DIR/bench.json" \
    --budget-s "${BENCH_BUDGET:-120}" ${BENCH_ARGS:-}
  BENCH_STATUS=$(run_status $? "${BENCH_TIMEOUT:-170}" " (partial)")
  stamp "benchmark: $BENCH_STATUS"
fi

# 4b. The roofline model the benchmark's "predicted ms" column comes from (arithmetic only, a few seconds).
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  stamp "roofline model (scripts/gpu_cost.py: predictions, not measurements)"
  COST_DEVICE=$("$PY" -c "import torch; print('h100' if 'H100' in torch.cuda.get_device_name().upper() else 'h200')" \
    2>/dev/null || echo h200)
  timeout 30 "$PY" scripts/gpu_cost.py --device "$COST_DEVICE" > "$OUT_DIR/.cost.md" || stamp "gpu_cost.py failed"
fi

# 5. One KDA layer: our sequence parallelism vs one device (the SP part needs >= 2 GPUs).
SP_KDA_STATUS="not run"
if [ "${SKIP_SP_KDA:-0}" != 1 ]; then
  SP_SMOKE=""
  case " ${BENCH_ARGS:-} " in *" --smoke "*) SP_SMOKE="--smoke" ;; esac
  stamp "KDA layer, sequence parallel vs one device ${SP_SMOKE}"
  # shellcheck disable=SC2086
  timeout "${SP_KDA_TIMEOUT:-120}" "$PY" scripts/bench_sp_kda.py --report "$OUT_DIR/sp_kda.md" $SP_SMOKE \
    ${SP_KDA_ARGS:-}
  SP_KDA_STATUS=$(run_status $? "${SP_KDA_TIMEOUT:-120}")
  stamp "KDA layer SP: $SP_KDA_STATUS"
fi

# 6. The report.
TEST_STATUS="$TEST_STATUS" BENCH_STATUS="$BENCH_STATUS" SP_KDA_STATUS="$SP_KDA_STATUS" OUT_DIR="$OUT_DIR" WALL=$(( $(date +%s) - START )) \
"$PY" - <<'EOF'
import json, os, re
out = os.environ["OUT_DIR"]
lines = ["# GPU check", "", f"- wall time: {os.environ['WALL']} s", f"- gpu tests: {os.environ['TEST_STATUS']}",
         f"- benchmark: {os.environ['BENCH_STATUS']}", f"- KDA layer SP: {os.environ['SP_KDA_STATUS']}", ""]
log = os.path.join(out, "gpu_check.log")
text = open(log, errors="replace").read() if os.path.exists(log) else ""
names = r"^(python|torch|device|triton|transformers|fla|einops|regex) "
head = [l for l in text.splitlines()[:40] if re.match(names, l)]
lines += ["## Versions", "", "```", *head, "```", ""]
pytest_out = os.path.join(out, ".pytest.out")
if os.path.exists(pytest_out):
    results = [l for l in open(pytest_out, errors="replace").read().splitlines()
               if re.match(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) ", l)
               or re.search(r"\d+ (passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s", l)]
    lines += ["## gpu tests", "", "```", *results[-60:], "```", ""]
    os.remove(pytest_out)
errs = os.path.join(out, "gpu_test_errors.json")
if os.path.exists(errs):
    records = json.load(open(errs))
    lines += ["## Measured errors (tests/test_gpu.py: relative L2 vs the fp32 evaluation)", "",
              "| family | S | tensor | fused | torch bf16 | bound | ok |", "|---|---|---|---|---|---|---|"]
    for r in records:
        if "err_fused" in r:
            lines.append(f"| {r['family']} | {r['seq_len']} | {r['tensor']} | {r['err_fused']:.3g} | "
                         f"{r['err_torch']:.3g} | {r['bound']:.3g} | {r['ok']} |")
        else:
            lines.append(f"| {r['family']} | {r['seq_len']} | {r['tensor']} | excess {r['excess']:.3g} | | <= 0 | "
                         f"{r['ok']} |")
    lines.append("")
bench = os.path.join(out, "bench.md")
if os.path.exists(bench):
    lines += ["## Benchmark", ""] + open(bench).read().splitlines()[2:]
cost = os.path.join(out, ".cost.md")
if os.path.exists(cost):
    lines += ["", "## Roofline model (scripts/gpu_cost.py, predicted, not measured)", ""] + open(cost).read().splitlines()
    os.remove(cost)
sp_kda = os.path.join(out, "sp_kda.md")
if os.path.exists(sp_kda):
    lines += ["", "## KDA layer: sequence parallel vs one device", ""] + open(sp_kda).read().splitlines()[2:]
with open(os.path.join(out, "report.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
print(f"report: {os.path.join(out, 'report.md')}")
EOF
stamp "done"
