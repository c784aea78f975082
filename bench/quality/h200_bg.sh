#!/usr/bin/env bash
# The quality experiment on the GPU machine, meant to run detached (setsid) so that it outlives
# the device call that starts it; bench/quality/h200_wait.sh follows it from later calls.
#   setsid nohup bash bench/quality/h200_bg.sh >/root/q/bg.log 2>&1 < /dev/null &
# Expects: /root/model/smollm2.gguf, /root/carry/.carry_q, our wheels in /tmp/site and the
# speculators wheels in /tmp/specsite (bench/quality/h200_call2.sh sets all of that up).
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"  # never the carried tree a later call replaces (h200_call2.sh)
W=${QUALITY_WORK:-/root/q}
mkdir -p "$W/results"
export PYTHONPATH=/tmp/site:$repo/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export SPECOPS_CACHE=/root/cache SPECULATORS_SITE=/tmp/specsite
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
echo "started $(date -u +%FT%TZ)" > "$W/results/bg.state"
export QUALITY_T0=${QUALITY_T0:-$(date +%s)}  # run.py's sweep_start_by_s counts from here
# The disk the features land on: sequential write speed with an fsync (extract's bound in bf16).
if [ ! -f "$W/results/disk.txt" ]; then
  { dd if=/dev/zero of="$W/ddtest" bs=16M count=256 conv=fsync 2>&1 | tail -1; nproc; df -h "$W" | tail -1; } > "$W/results/disk.txt"
  rm -f "$W/ddtest"
fi
# The GPU-only tests (the static-cache runner: CUDA graphs vs eager vs HF; the drafter families), alongside
# generation (tiny models: a minute of a sliver of the GPU; the experiment's figures are later).
tests_pid=
if [ ! -f "$W/results/gpu-tests.log" ]; then
  (cd "$repo" && timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fast_target.py tests/test_fast_drafter.py tests/test_batched_eval.py tests/test_train.py tests/test_train_graphs.py tests/test_extract_write.py tests/test_mla_drafter.py tests/test_dflash.py tests/test_peagle.py) > "$W/results/gpu-tests.log" 2>&1 &
  tests_pid=$!
fi
# Where speculators' trainer spends its start-up (its first step can take over 3.5 min): with
# QUALITY_PYSPY=1, py-spy dumps of its main process every 40 s while one runs (the warm-up's and the
# real run's), at most 16. Off by default: each dump pauses the trainer, and its rate is a result.
spy=/tmp/specsite/bin/py-spy
if [ -n "${QUALITY_PYSPY:-}" ] && [ -x "$spy" ]; then
  ( n=0
    while [ $n -lt 16 ] && ! grep -q "experiment rc" "$W/results/bg.state" 2>/dev/null; do
      sleep 40
      pid=$(pgrep -o -f speculators_launch.py) || continue
      echo "=== $(date -u +%T) pid $pid"; timeout 30 "$spy" dump --pid "$pid" 2>&1 | head -80; n=$((n + 1))
    done ) >> "$W/results/anchor-pyspy.log" 2>&1 &
fi
# Phases that time on the GPU from the start (no generation first, e.g. "timing") wait for the tests.
case "${QUALITY_PHASE:-all}" in all*|ours*) ;; *) [ -n "$tests_pid" ] && wait "$tests_pid" && tests_pid= ;; esac
# QUALITY_PHASE: run.py phases in order (default "all"; e.g. "eval timing" for drafters trained earlier)
rc=0
for phase in ${QUALITY_PHASE:-all}; do
  python3 "$repo/bench/quality/run.py" "$phase" --work "$W" --model /root/model/smollm2.gguf \
    --carry /root/carry/.carry_q ${QUALITY_ARGS:-} 2>&1 | tee -a "$W/results/run.log"
  r=${PIPESTATUS[0]}
  [ "$r" -ne 0 ] && rc=$r
done
[ -n "$tests_pid" ] && wait "$tests_pid"
echo "experiment rc=$rc $(date -u +%FT%TZ)" >> "$W/results/bg.state"
# With device time left: the earlier issues' GPU benchmarks again on this machine (issue 8, item 3).
# Their inputs are synthetic except the local engine's, which runs the real converted SmolLM2.
# QUALITY_BENCHES: a space-separated subset of "local-engine extract train train-ab ttt-ab
# drafter-step train-prof" (default the first three; "" none).
#   train-ab: SmolLM2-shaped training on varied lengths, torch's cuDNN attention choice kept vs the
#             memory-efficient kernel forced (train.sdpa_cudnn)
#   ttt-ab: the same with the reference forms (dense TTT attention, eager loss), with block + probe
#           attention, and with the compiled loss too (train.ttt_attention, train.compile_loss)
#   drafter-step: eval's drafter runners (eager, static, static + CUDA graph), bench/drafter_step.py
#   train-real-ab: the trainer's forms (fused loss, compiled layer regions) on the real campaign's
#                  features, 60 steps each (bench/train_real_ab.py); needs the features
#   loss-ab: SmolLM2-shaped training with neither, then with the fused lm_head + soft CE and the
#            drafter layer's compiled regions (train.fused_loss, train.compile_layer)
#   train-graphs: SmolLM2-shaped training at 8,192 tokens/step, eager vs train.cuda_graphs
#   train-prof: a torch.profiler table of a SmolLM2-shaped training run (host and device time)
#   eval-batched: tau evaluation, the batch-1 loop vs the batched loop (bench/eval_batched.py)
benches=${QUALITY_BENCHES-local-engine extract train}
if [ -n "$benches" ]; then
  # 64 GB of disk; done with once the anchor has its result (a failed anchor keeps them, so that a
  # later call can rerun it without extracting again)
  cd "$repo"
  case " $benches " in *" train-real-ab "*)  # trainer forms on the real features (before the features go)
    python3 bench/train_real_ab.py "$W/ours.toml" --work "$W/train-ab" --steps 60 --log-every 5 --timeout 100 \
      --recompiles --out "$W/results/bench-train-real-ab.json" \
      --arm before fused_loss=off compile_layer=off --arm fused-loss fused_loss=on compile_layer=off \
      --arm layer fused_loss=off compile_layer=auto --arm both fused_loss=on compile_layer=auto \
      > "$W/results/bench-train-real-ab.log" 2>&1
    cp "$W"/train-ab/*.log "$W/results/" 2>/dev/null ;; esac
  [ -f "$W/results/anchor.json" ] && rm -rf "$W/anchor/data" "$W/campaign/features"
  # QUALITY_DROP_FEATURES=1: a lease without the anchor (e.g. QUALITY_PHASE="ours lr-sweep") frees the disk too
  [ -n "${QUALITY_DROP_FEATURES:-}" ] && rm -rf "$W/campaign/features"
  case " $benches " in *" local-engine "*)
    hf=$(dirname "$(ls /root/cache/models/*/config.json | head -1)")
    python3 bench/local_engine_gpu.py --tokenizer "$hf" --model "$hf" --batch 256 --hf-batch 64 \
      --out "$W/results/bench-local-engine.json" > "$W/results/bench-local-engine.log" 2>&1 ;; esac
  case " $benches " in *" extract "*)
    python3 bench/extract_gpu.py --out "$W/results/bench-extract.json" > "$W/results/bench-extract.log" 2>&1 ;; esac
  # SmolLM2-shaped training on varied lengths, one run per arm, an arm being train_gpu.py's kernel
  # flags (train.* keys) then its label: train_arms NAME SEQS "[--FLAG VALUE ...] LABEL"...
  train_arms() {
    local name=$1 seqs=$2 arm label flags; shift 2
    for arm in "$@"; do
      label=${arm##* } flags=
      [ "$arm" != "$label" ] && flags=${arm% *}
      python3 bench/train_gpu.py $flags --shape smollm2 --seq-len 2048 --vary-len 128 --seqs "$seqs" --steps 16 \
        --out "$W/results/bench-$name-$label.json" > "$W/results/bench-$name-$label.log" 2>&1
    done
  }
  case " $benches " in *" train-ab "*)
    train_arms train-ab 256 "cudnn0" "--sdpa-cudnn cudnn1" ;; esac
  case " $benches " in *" ttt-ab "*)  # TTT attention, then the compiled loss (drafter/model.py, train.py)
    train_arms ttt-ab 256 "--ttt-attention dense --compile-loss off before" \
      "--ttt-attention block --compile-loss off attn" "--ttt-attention block --compile-loss auto attn+loss" ;; esac
  case " $benches " in *" loss-ab "*)  # the fused loss and the compiled layer regions (drafter/train.py, model.py)
    train_arms loss-ab 128 "--fused-loss off --compile-layer off before" \
      "--fused-loss on --compile-layer auto fused-loss+layer" ;; esac
  case " $benches " in *" train-graphs "*)  # the training micro-step as CUDA graphs, SmolLM2-shaped, 8,192 tokens/step
    for arm in eager graphs; do
      python3 bench/train_gpu.py --shape smollm2 --seq-len 2048 --vary-len 128 --seqs 256 --steps 120 --batch-tokens 8192 \
        $( [ $arm = graphs ] && echo --cuda-graphs ) --out "$W/results/bench-train-graphs-$arm.json" \
        > "$W/results/bench-train-graphs-$arm.log" 2>&1
    done ;; esac
  case " $benches " in *" drafter-step "*)  # eval's drafter: eager vs static cache vs static + CUDA graph
    d=${QUALITY_DRAFTER:-$W/campaign/drafter/export/vllm}
    python3 bench/drafter_step.py $( [ -f "$d/config.json" ] && echo --drafter "$d" ) --rounds 400 \
      --out "$W/results/bench-drafter-step.json" > "$W/results/bench-drafter-step.log" 2>&1 ;; esac
  case " $benches " in *" train-prof "*)  # where a SmolLM2-shaped step spends host and device time
    python3 bench/train_gpu.py --shape smollm2 --seq-len 2048 --vary-len 128 --seqs 128 --steps 8 \
      --profile "$W/results/train-prof.txt" --out "$W/results/bench-train-prof.json" > "$W/results/bench-train-prof.log" 2>&1 ;; esac
  case " $benches " in *" eval-batched "*)  # tau evaluation: the batch-1 loop vs the batched loop, same prompts
    hf=$(dirname "$(ls /root/cache/models/*/config.json | head -1)")
    d=${QUALITY_DRAFTER:-$W/ours-drafter/vllm}; [ -f "$d/config.json" ] || d=$W/campaign/drafter/export/vllm
    SPECOPS_DATA_DIR=$W/data/eval python3 bench/eval_batched.py --model "$hf" $( [ -f "$d/config.json" ] && echo --drafter "$d" ) \
      --prompts 256 --rows 128 --batch1-prompts 16 --out "$W/results/bench-eval-batched.json" \
      --profile "$W/results/eval-batched-prof.txt" > "$W/results/bench-eval-batched.log" 2>&1 ;; esac
  case " $benches " in *" train "*)
    python3 bench/train_gpu.py --seqs 48 --steps 10 --out "$W/results/bench-train.json" > "$W/results/bench-train.log" 2>&1 ;; esac
fi
echo "finished rc=$rc $(date -u +%FT%TZ)" >> "$W/results/bg.state"
