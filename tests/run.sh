#!/usr/bin/env bash
# Set up the environment on a fresh machine and run the CPU test suite.
#   bash tests/run.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v nvidia-smi >/dev/null 2>&1; then
    # Install the CPU torch first, so the package's torch>=2.6 requirement never pulls a CUDA build.
    "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[dev]"
# torchtitan's DeepSeek-V3, the peer of benchmarks/model_step.py (tests/test_peer_torchtitan.py): pure-Python
# packages, installed without their dependencies (the model modules import none of them).
"$PY" -m pip install -q --no-deps $("$PY" -c "from benchmarks.peer_torchtitan import REQUIREMENTS; print(REQUIREMENTS)")
exec "$PY" -m pytest -q -m "not gpu" --timeout=900 "$@"
