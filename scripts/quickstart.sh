#!/usr/bin/env bash
# Set up glm53flash-hf in ./.venv (CPU torch wheel pinned) and run the main job.
# Until the fine-tuning job exists (issue 7) the main job is the demo forward/backward pass.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[cpu,train,test]"
exec .venv/bin/glm53flash-demo "$@"
