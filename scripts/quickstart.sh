#!/usr/bin/env bash
# The main job on the embedded default: every phase with the bundled SmolLM2 on CPU (minutes).
# Prints each phase result, tau and the report path. Rerunning skips what is done.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/specops run examples/quickstart.toml "$@"
