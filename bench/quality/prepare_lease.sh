#!/usr/bin/env bash
# Everything the quality lease carries, prepared here in one go (bench/quality/README.md, "Next
# lease"): the inputs (.carry_q), the SmolLM2 GGUF in two halves (.carry_a, .carry_b), our two
# wheels (.whl: gguf, orjson) and the speculators set (.whl_spec), each a folder git ignores, with
# the sizes that must stay under the device's 64 MiB per call. Needs the project venv
# (scripts/setup.sh) and a package registry for the wheels.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
py=.venv/bin/python
[ -x "$py" ] || { echo "no .venv: run scripts/setup.sh first" >&2; exit 2; }
[ -d .carry_q ] || "$py" bench/quality/prepare_carry.py
gguf=$("$py" -c 'from specops.models import smollm2_gguf; print(smollm2_gguf())')
[ -f .carry_b/sha256 ] || ../shared/tools/split-model "$gguf" --do > /dev/null
dl() {  # dl DIR NAME==VERSION...: cp312 manylinux wheels for the H200 image, no dependencies
  local dir=$1; shift
  mkdir -p "$dir"
  for n in "$@"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$dir" "$n" 2>&1 | grep -v '^WARNING' || true
  done
}
dl .whl gguf==0.19.0 orjson==3.13.0
dl .whl_spec speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 \
  loguru==0.7.3 openai==3.57.0 pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 \
  python-dotenv==1.2.4 typing-inspection==0.4.5 annotated-types==0.8.0 distro==1.9.0 jiter==0.19.0 \
  sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
size() { du -cb "$@" | tail -1 | cut -f1; }
limit=$((64 << 20))
# the records of an earlier lease, when this machine has them (README.md, "Next lease"): call 2 carries them
rec=$(ls .cache/q*/records.tar.xz 2>/dev/null | tail -1 || true)
[ -n "$rec" ] && echo "records to carry: $rec"
for call in ".carry_a" ".carry_q .whl_spec${rec:+ $rec}" ".carry_b .whl"; do
  # shellcheck disable=SC2086
  total=$((tree + $(size $call)))
  echo "call carrying $call: $((total >> 20)) MiB of 64 (tracked tree included)"
  [ "$total" -lt "$limit" ] || { echo "over the 64 MiB per call: carry less" >&2; exit 1; }
done
