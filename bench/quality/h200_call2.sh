#!/usr/bin/env bash
# Second device call of the quality experiment (the first copied .carry_a/part00 and .carry_q to
# /root): rebuild the GGUF, check its digest, install the carried wheels, start the experiment
# detached, then follow it for the rest of this call.
set -eu
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
cat /root/model/part00 .carry_b/part01 > /root/model/smollm2.gguf
echo "$(cat .carry_b/sha256)  /root/model/smollm2.gguf" | sha256sum -c -
mkdir -p /tmp/site /tmp/specsite /root/q
# ours needs gguf + orjson beyond the image; the anchor its own set (kept apart from ours)
ours=$(ls .whl/gguf-*.whl .whl/orjson-*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $ours
# (the speculators set may come in .whl or, to keep each call's carry under 64 MiB, in .whl_spec
# by an earlier call that installed it already: see README.md)
spec=$(ls .whl/*.whl .whl_spec/*.whl 2>/dev/null | grep -v -e '/gguf-' -e '/orjson-' || true)
[ -n "$spec" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/specsite $spec
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "gpus", torch.cuda.device_count())'
# The experiment runs from a snapshot of this tree: later calls refresh the carried tree under
# the repository root, and a run that outlives its call must not import half of a newer edit.
snap=/root/snap
rm -rf "$snap" && mkdir -p "$snap"
tar -C "$repo" --exclude=./.carry_a --exclude=./.carry_b --exclude=./.whl --exclude=./.git -cf - . | tar -C "$snap" -xf -
# Its working directory is the snapshot too: a later call replaces the carried tree, and a process
# whose cwd was removed fails every getcwd() (Python's imports and oneMKL's library loads among them).
(cd "$snap" && setsid nohup bash "$snap/bench/quality/h200_bg.sh" > /root/q/bg.log 2>&1 < /dev/null &)
sleep 5
exec bash bench/quality/h200_wait.sh "${1:-500}"
