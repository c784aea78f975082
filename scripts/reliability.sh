#!/usr/bin/env bash
# The full reliability suite (RELIABILITY.md): every item of tests/reliability at its full trial
# count (SPECOPS_RELIABILITY_FULL=1), the full-only items (real vLLM killed and restarted, extract
# killed at several points), and the existing kill/resume, lock, outage and wrong-model tests the
# suite builds on. Writes machine-readable results to bench/results/reliability.json (and the
# table as .md beside it) and refreshes the results table in RELIABILITY.md.
#
#   scripts/reliability.sh [--out FILE] [--no-doc] [extra pytest args]
#
# SPECOPS_RELIABILITY_SEED changes every random choice (kill points, delays); SPECOPS_SKIP_SETUP=1
# skips the environment setup (scripts/setup.sh, scripts/setup-vllm.sh) when it is known current.
# Exit code: pytest's (0 when every test passed or is a recorded known bug).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
out=bench/results/reliability.json
doc=RELIABILITY.md
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --no-doc) doc=; shift ;;
    *) break ;;
  esac
done
export SPECOPS_VLLM_VENV=${SPECOPS_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/specops/venv-vllm}
if [ "${SPECOPS_SKIP_SETUP:-0}" != 1 ]; then
  bash scripts/setup.sh
  bash scripts/setup-vllm.sh
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SPECOPS_RELIABILITY_FULL=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export SPECOPS_RELIABILITY_OUT="$work/figures.jsonl"
start=$(date +%s)
rc=0
.venv/bin/python -m pytest -p no:cacheprovider -m "not gpu" -rA --junitxml="$work/junit.xml" \
  tests/reliability \
  tests/test_resume_kill.py \
  tests/test_status_detach.py::test_server_outage_waits_behind_the_gate_and_status_shows_it \
  tests/test_status_detach.py::test_dead_runner_and_stall_are_flagged \
  tests/test_journal.py::test_disk_full_rolls_back_partial_line \
  tests/test_canary.py::test_wrong_model_is_refused_before_any_sample \
  tests/test_extract.py::test_kill9_mid_extraction_then_resume_is_byte_identical \
  tests/test_train.py::test_kill9_and_sigterm_then_resume_replay_the_same_loss_curve \
  "$@" || rc=$?
wall=$(( $(date +%s) - start ))
.venv/bin/python tests/reliability/report.py --figures "$work/figures.jsonl" --junit "$work/junit.xml" \
  --out "$out" --wall-s "$wall" ${doc:+--doc "$doc"}
echo "results: $out (table: ${out%.json}.md)" >&2
exit "$rc"
