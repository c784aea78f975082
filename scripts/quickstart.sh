#!/usr/bin/env bash
# The main job on the embedded default: bundled SmolLM2 on the local engine, CPU, a few minutes.
# Prints the campaign directory and a summary. Rerunning resumes (nothing is generated twice).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/specops generate examples/quickstart.toml "$@"
