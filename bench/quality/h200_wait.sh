#!/usr/bin/env bash
# Follow the detached experiment for up to $1 seconds (default 540), printing progress, then pack
# what came out into $OUT: results.tar.xz (JSON, logs, reports) and, once present, the generated
# records and our exported drafter (split under the 16 MiB per-file limit).
set -u
limit=${1:-540}
W=${QUALITY_WORK:-/root/q}
repo=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH=/tmp/site:$repo/src HF_HUB_OFFLINE=1
t0=$(date +%s)
while :; do
  now=$(date +%s)
  echo "=== +$((now - t0))s $(tail -1 "$W/results/bg.state" 2>/dev/null)"
  tail -2 "$W/results/run.log" 2>/dev/null
  if [ -f "$W/campaign/manifest.json" ]; then
    python3 -m specops status "$W/campaign" 2>&1 | head -12
  fi
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  grep -q finished "$W/results/bg.state" 2>/dev/null && break
  [ $((now - t0 + 60)) -ge "$limit" ] && break
  sleep 45
done
out=${OUT:-/tmp/out}; mkdir -p "$out"
(cd "$W" && tar -cJf "$out/results.tar.xz" results $(ls -d eval-*/eval 2>/dev/null) \
   campaign/manifest.json campaign/drafter/metrics.jsonl campaign/build/manifest.json campaign/eval \
   $(ls lr-sweep/*/drafter/metrics.jsonl 2>/dev/null) \
   $(ls anchor/run/*.json 2>/dev/null) 2>/dev/null)
if [ -n "${QUALITY_FETCH_RECORDS:-}" ] && ls "$W"/campaign/generate/*/records.jsonl >/dev/null 2>&1; then
  (cd "$W/campaign" && tar -cf - generate/*/records.jsonl | xz -T8 -6 > "$out/records.tar.xz")
fi
# QUALITY_FETCH_DRAFTER="ours anchor" (either or both: a SmolLM2 drafter export is 47 MB, 3 parts
# under the 16 MiB per-file limit; $OUT holds 8 files)
for who in ${QUALITY_FETCH_DRAFTER:-}; do
  case $who in
    ours|1) d="$W/ours-drafter"  # run.py's lr sweep winner (a link to its export dir), else the main export
      [ -d "$d/vllm" ] || d="$W/campaign/drafter/export"
      [ -d "$d/vllm" ] && (cd -P "$d" && tar -cf - vllm | split -b 16000000 -d - "$out/drafter-ours.tar.part") ;;
    anchor) [ -d "$W/anchor/eval_drafter" ] && \
      (cd "$W/anchor" && tar -cf - eval_drafter | split -b 16000000 -d - "$out/drafter-anchor.tar.part") ;;
  esac
done
ls -la "$out"
