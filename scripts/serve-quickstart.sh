#!/usr/bin/env bash
# The quickstart's drafter served by the real vLLM for CPU: installs the vLLM environment, runs the
# quickstart if it has not run, then `specops eval --served` (vLLM with the drafter, then without it):
# served tau beside specops' loop (the interop check), the served speedup and the verdict.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
bash scripts/setup.sh
export SPECOPS_VLLM_VENV=${SPECOPS_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/specops/venv-vllm}
bash scripts/setup-vllm.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/specops run examples/quickstart.toml
exec .venv/bin/specops eval examples/quickstart.toml --served "$@"
