#!/usr/bin/env bash
# Download, on a machine with pip's package index, the wheels scripts/gpu_check.sh installs on the GPU machine.
#
# The GPU machine (kind nvidia-h200, /work/.library/device/KINDS.md) has no network. Its python3 (3.12,
# /opt/torch/.venv) holds torch 2.11 + CUDA, triton 3.6, transformers 5.17, peft, accelerate, einops,
# pytest-timeout, huggingface-hub 1.33, tokenizers 0.23.2, safetensors 0.8.0, typer; it lacks:
#   * transformers >= 5.23 (glm5_next; we pin the 5.24.0 we test with on CPU);
#   * fla-core 0.6.0 (KDA kernels; its only requirement, einops, is there);
#   * regex >= 2025.10.22, which transformers 5.24 checks at import (the machine's version is not recorded:
#     carrying a current one is harmless).
# Everything else transformers 5.24 requires (huggingface-hub>=1.31, tokenizers>=0.23.1,<0.24, safetensors>=0.8,
# typer, tqdm, numpy, packaging, pyyaml) is already there at a fitting version.
#
# Usage (repo root): bash scripts/gpu_wheels.sh   -> .whl/*.whl (ignored by git; name .whl in the device run's carry)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p .whl
rm -f .whl/*.whl
common=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl)
"$PY" -m pip download "${common[@]}" transformers==5.24.0 fla-core==0.6.0 "regex>=2025.10.22"
# one version of each package (two would stop the install there)
dupes=$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | sort | uniq -d)
if [ -n "$dupes" ]; then echo "more than one wheel of: $dupes" >&2; exit 1; fi
ls -l .whl
du -sh .whl
