#!/usr/bin/env bash
# Set up glm53flash-hf in ./.venv (CPU torch wheel pinned) and run the main job, glm53flash-finetune: it makes the
# embedded tiny checkpoint, fine-tunes it (LoRA, HF Trainer) on text from pydoc_data.topics and scikit-image's
# photos and GIF, saves a Hub-style folder in ./glm53flash-finetune-out and reloads it in a fresh process to
# generate. Arguments are passed on to glm53flash-finetune (see .venv/bin/glm53flash-finetune --help).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[cpu,train,test]"
exec .venv/bin/glm53flash-finetune "$@"
