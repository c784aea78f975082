#!/usr/bin/env bash
# The main job on the embedded default: every phase with the bundled SmolLM2 on CPU (minutes).
# Ends with one line per phase (how long it took, what it made), the verdict (GO/NO-GO and why)
# and the report's path; --json prints each phase's result instead. Rerunning skips what is done.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/specops run examples/quickstart.toml "$@"
