"""Issue 8's quality experiment: a real SmolLM2 drafter, side by side with the speculators trainer.

    python bench/quality/run.py all --work DIR [--scale h200|smoke] [--gguf FILE] [--data DIR]

Phases (each idempotent: a rerun skips what is done, `specops run` resumes inside its phases):

    ours     `specops run` on the generated campaign config up to export: generate with the local
             engine over ShareGPT first turns + BFCL prompts, build, extract (bf16 features), train
             (K=7), export.
    lr-sweep one more drafter per recipe variant in the scale's sweep / lr_sweep (lr, tokens per
             step, loss decay, trainer switches) on the same build + features (its own campaign dir,
             lr-sweep/<variant>/); the winner by val simulated tau -> DIR/ours-drafter,
             the drafter timing and eval use.
    anchor   the same build + features converted to the speculators layout, the speculators 0.9.0
             trainer run unmodified with the same epochs and learning rate, its checkpoint converted
             for our evaluator (bench/quality/speculators_*.py).
    timing   `specops eval` alone on the GPU (1 worker): measured speedup vs the greedy baseline.
    eval     tau at k=7 for both drafters: T=0 on MT-bench, HumanEval, GSM8K, Spec-Bench; T=1 on
             MT-bench (several evaluator workers share the GPU; tau does not depend on timing).
    collect  DIR/results/quality.json: every figure, with the phase timings.

DIR/results/ holds small JSON files and logs (what a GPU run copies back); DIR/campaign is ours.
Inputs come from `.carry_q/` (bench/quality/prepare_carry.py): nothing is downloaded.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import json
import lzma
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

from specops.campaign import read_json  # noqa: E402
from specops.config import EvalSection, dump_toml, load_config  # noqa: E402

HERE = Path(__file__).resolve().parent

# What the speculators trainer does besides its lr and batch (from its training code: Muon on
# the layer's matrices, a frozen lm_head, linear decay to 0 after ~1 % warm-up, clip 1.0, weight decay
# 0.1 on the matrices), as train.* overrides of ours; a sweep variant adds its warm-up steps.
SPECULATORS_RECIPE = {"optimizer": "muon", "freeze_lm_head": True, "lr_schedule": "linear", "min_lr_ratio": 0.0,
                      "max_grad_norm": 1.0, "weight_decay": 0.1}

# Per scale: how much of everything. h200 is the real experiment; smoke checks the plumbing on a CPU.
SCALES: dict[str, dict[str, Any]] = {
    "h200": dict(
        # 7,800 ShareGPT + 3,641 BFCL prompts give 11,283 samples, 10,501 after the build's dedupe
        # (>= 10K; generation is greedy, so the same prompts give the same samples). 2 epochs for both
        # trainers: the same budget.
        sharegpt=7800, bfcl=None, max_tokens=512, batch_size=512, concurrency=1024, dtype="bfloat16",
        max_model_len=2048, draft_vocab=32000, epochs=2,
        # our recipe: chosen on the val split among the main run and these variants (phase_lr_sweep:
        # same build, features, epochs and seed; each alone on the device, capped in time).
        # The main run is speculators' recipe (SPECULATORS_RECIPE) in our trainer: on these records at
        # 4,096 tokens/step it reaches val simulated tau ~4.07 against ~2.60 for AdamW on every weight +
        # cosine (step-0 acc 0.83 vs 0.67; val loss 6.19 vs 10.25). Among tokens per step, 2,048
        # (warm-up 60, ~1 % of 6,046 steps) gives the highest val simulated tau (4.381; 4,096: 4.062;
        # 8,192: 3.401), and its drafter measures tau 2.234 against speculators' 1.745 on all 880 T=0
        # turns (1.281x); docs/results.md has the figures. The variants, in order: the loss without
        # the greedy loops (below), lr 2e-3 and the loss on the prompt's tokens too
        # (train.loss_on_prompt: more signal from the same samples, which speculators' trainer does
        # not take; val counts generated tokens only either way), each on top of the main run (at
        # 4,096 tokens/step both score above the plain recipe: 4.234, 4.199), half the tokens per
        # step (1,024), 8,192 (the anchor's step size: our train rate at its batch), then which half
        # of the recipe carries it (the frozen head with our AdamW + cosine; Muon with a trained
        # head), every TTT step weighted alike (speculators' own default; both trainers run 0.8
        # here), then its row packing. The target's final norm as the drafter's start
        # (train.init_norm_from_target) scores below the plain recipe (3.804), so no variant tries it.
        lr=1e-3, warmup=60, batch_tokens=2048, train=SPECULATORS_RECIPE,
        # 56 % of the loss tokens sit in greedy loops (build manifest `repetition`), and the full val
        # pass overstates acceptance (step-0 acc 0.68 on a response's first 128 tokens, 0.95 past
        # 384; bench/quality/eval_on_val.py): so the sweep chooses by the val pass over the first
        # eval_new_tokens tokens of each turn (sweep_by), and its first variant trains without the
        # loops (train.mask_repetition).
        sweep_by="sim_tau_head",
        sweep=({"mask_repetition": True, "timeout_s": 280},
               {"lr": 2e-3, "timeout_s": 280},
               {"loss_on_prompt": True, "timeout_s": 280},
               {"batch_tokens": 1024, "warmup_steps": 120, "timeout_s": 400},
               {"batch_tokens": 8192, "warmup_steps": 12, "timeout_s": 200},
               {"optimizer": "adamw", "lr_schedule": "cosine", "min_lr_ratio": 0.1, "max_grad_norm": 0.5,
                "weight_decay": 0.0, "warmup_steps": 50},
               {"freeze_lm_head": False},
               {"loss_decay": 1.0},
               {"pack_rows": 2048}),
        # no generation when the records come with the call (.cache/q10/records.tar.xz, --records):
        # at 4,096 tokens/step the main run is trained 1.7 min into the experiment (107 s of it), each
        # variant takes ~1.7-2.5 min, and the anchor + both evaluations take ~9 min after the sweep,
        # so no variant starts past 720 s (experiment ~22 min, ~23.4 min of device time in all)
        sweep_timeout_s=240, sweep_start_by_s=720,
        # eval/checkpoint only at the end: a mid-run val pass or checkpoint would sit inside a metrics
        # window and count against our tokens/s (speculators' step times leave both out)
        # The anchor trains at our main run's tokens per step (anchor_total_seq_len None: 2,048), the
        # step size that won our sweep, so the tau and rate rows compare the trainers at one recipe
        # (its shipped default is 8,192: `--set anchor_total_seq_len=8192`). At 2,048 it trains at
        # ~26K tok/s on an H100, ~8 min for the 2 epochs plus its compile: the cap leaves room for it.
        log_every=20, eval_every=100000, checkpoint_every=100000, anchor_lr=1e-3, anchor_timeout_s=900,
        anchor_total_seq_len=None,
        anchor_checkpoint_freq=0.5, anchor_warm=True,
        # The full sets (MT-bench 80 x 2 turns, HumanEval 80, GSM8K 80, Spec-Bench 480; T=1 MT-bench 80):
        # tau through the batched loop (eval.batch_size rows, evaluate/batched.py): 8 batch-1 workers
        # sharing the GPU take ~1 s per turn, too slow for ~1,900 turns in one device call.
        # 256 rows: a batched step is bound by its ~1,700 kernel launches, not its rows (profiled at
        # 128 rows: 209 ms per step, 16 ms of it on the device), so twice the rows should take about
        # half the steps on the 560 Spec-Bench and 320 other turns
        eval_limit=80, spec_bench_limit=480, eval_batch=256,
        eval_new_tokens=128, timing_limit=10, timing_new_tokens=256, workers=8, t1_limit=80,
        timing_runners=("static",),
    ),
    # tau on the full sets (MT-bench 80 x 2 turns, HumanEval 80, GSM8K 80, Spec-Bench 480; T=1 on
    # MT-bench 80) of drafters trained earlier: `run.py eval --ours-drafter D --anchor-drafter D`
    "h200-eval": dict(
        sharegpt=7800, bfcl=None, max_tokens=512, batch_size=512, concurrency=1024, dtype="bfloat16",
        max_model_len=2048, draft_vocab=32000, epochs=1, lr=5e-4, warmup=50, batch_tokens=16384,
        log_every=20, eval_every=160, checkpoint_every=160, anchor_lr=1e-3, anchor_timeout_s=480,
        eval_limit=80, spec_bench_limit=480, eval_new_tokens=128, timing_limit=10, timing_new_tokens=256,
        workers=8, t1_limit=80, timing_runners=("static",), eval_batch=128,
    ),
    # what fits the rest of a lease that lost its machine: a small drafter, timing + tau only
    "h200-mini": dict(
        sharegpt=1500, bfcl=500, max_tokens=512, batch_size=512, concurrency=1024, dtype="bfloat16",
        max_model_len=2048, draft_vocab=32000, epochs=1, lr=5e-4, warmup=20, batch_tokens=16384,
        log_every=10, eval_every=1000, checkpoint_every=1000, anchor_lr=1e-3, anchor_timeout_s=480, anchor_warm=True, eval_limit=20,
        spec_bench_limit=40, eval_new_tokens=128, timing_limit=10, timing_new_tokens=256, workers=8, t1_limit=20,
        timing_runners=("static",), eval_batch=128,
    ),
    # tau of a drafter trained on the GPU, measured on this 2-core CPU (fp32): fewer prompts, 1 worker
    "cpu": dict(
        sharegpt=9000, bfcl=None, max_tokens=512, batch_size=8, concurrency=16, dtype="float32",
        max_model_len=2048, draft_vocab=32000, epochs=3, lr=5e-4, warmup=50, batch_tokens=16384,
        log_every=20, eval_every=400, checkpoint_every=400, anchor_lr=1e-3, anchor_timeout_s=480,
        eval_limit=20, spec_bench_limit=20, eval_new_tokens=128, timing_limit=4, timing_new_tokens=128,
        workers=1, t1_limit=10,
    ),
    "smoke": dict(
        sharegpt=6, bfcl=4, max_tokens=24, batch_size=8, concurrency=16, dtype="float32",
        max_model_len=1024, draft_vocab=2048, epochs=1, lr=5e-4, warmup=2, batch_tokens=2048,
        lr_sweep=(1e-3,), sweep=({"lr": 1e-3, "batch_tokens": 1024, "compile_loss": "off", "timeout_s": 500},),
        sweep_timeout_s=600,
        log_every=2, eval_every=4, checkpoint_every=4, anchor_lr=1e-3, anchor_cpu=True, anchor_timeout_s=300, eval_limit=1, spec_bench_limit=2,
        anchor_warm=True, anchor_warm_samples=10, anchor_warm_max_len=256,
        eval_new_tokens=12, timing_limit=1, timing_new_tokens=12, workers=2, t1_limit=1, eval_batch=2,
    ),
}
K = 7
# speculators' own options for every GPU run of its trainer. Its default fused Triton loss cannot be
# traced by torch 2.11's Dynamo inside its compiled forward: "AssertionError: ListVariable(length=21)
# is already tracked for mutation ... loss_backward_kernel.configs" (on an H200, after ~5 min of
# compilation; docs/results.md quotes the log). Its eager loss (plain
# torch ops, compiled with the rest of the forward) trains: README-speculators.md.
ANCHOR_GPU_ARGS = ("--loss-implementation", "eager")


# when the experiment began: h200_bg.sh exports QUALITY_T0 (one lease runs several run.py phases)
_T0 = float(os.environ.get("QUALITY_T0") or time.time())


def log(msg: str) -> None:
    print(f"[quality {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd: list[Any], logfile: Path, *, env: dict[str, str] | None = None, ok: tuple[int, ...] = (0,),
       timeout: float | None = None) -> float:
    """Run cmd with its output appended to logfile; returns the wall seconds. An exit code outside
    `ok` stops the experiment with the log's tail (`specops eval` exits 1 on a NO-GO verdict). Past
    `timeout` seconds the command's whole process group is killed (SIGTERM, then SIGKILL)."""
    log(" ".join(map(str, cmd)) + f"  (log: {logfile.name})")
    t0 = time.time()
    with open(logfile, "a") as fh:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=fh, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = f"timeout after {timeout:.0f}s"
    dt = time.time() - t0
    if rc not in ok:
        tail = logfile.read_text(errors="replace")[-3000:]
        raise SystemExit(f"command failed ({rc}) after {dt:.0f}s: {' '.join(map(str, cmd))}\n{tail}")
    return dt


def specops(*args: Any) -> list[str]:
    return [sys.executable, "-m", "specops", *map(str, args)]


def write_result(work: Path, name: str, obj: dict[str, Any]) -> None:
    res = work / "results"
    res.mkdir(parents=True, exist_ok=True)
    tmp = res / f".{name}.json.tmp"
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, res / f"{name}.json")


def read_result(work: Path, name: str) -> dict[str, Any] | None:
    p = work / "results" / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


# ---------------------------------------------------------------- inputs and configs


def unpack(work: Path, carry: Path) -> Path:
    data = work / "data"
    if (data / ".complete").is_file():
        return data
    data.mkdir(parents=True, exist_ok=True)
    with lzma.open(carry / "sharegpt_first.jsonl.xz", "rb") as src, open(data / "sharegpt_first.jsonl", "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    for name in ("bfcl.tar.xz", "eval.tar.xz"):
        with tarfile.open(carry / name) as tf:
            tf.extractall(data, filter="data")
    (data / ".complete").write_text("ok\n")
    return data


def eval_entries(data: Path) -> list[str]:
    e = data / "eval"
    return [f"mtbench:{e / 'mtbench' / 'question.jsonl'}", f"humaneval:{e / 'HumanEval.jsonl.gz'}",
            f"gsm8k:{e / 'gsm8k' / 'test.jsonl'}", f"spec_bench:{e / 'spec_bench' / 'question.jsonl'}"]


def base_config(work: Path, data: Path, model: str, s: dict[str, Any]) -> dict[str, Any]:
    datasets = [
        {"name": "sharegpt", "source": "sharegpt", "path": str(data / "sharegpt_first.jsonl"),
         "limit": s["sharegpt"], "turns": "first"},
        {"name": "bfcl", "source": "bfcl", "path": str(data / "bfcl")},
    ]
    if s["bfcl"] is not None:
        datasets[1]["limit"] = s["bfcl"]
    return {
        "campaign": {"name": "quality", "dir": str(work / "campaign"), "seed": 0},
        "target": {"model": model, "dtype": s["dtype"]},
        "engine": {"kind": "local", "batch_size": s["batch_size"], "max_model_len": s["max_model_len"]},
        "generate": {"reasoning": "off", "max_tokens": s["max_tokens"], "temperature": 0.0,
                     "concurrency": s["concurrency"], "expect_truncation": True, "canary_samples": 2},
        "datasets": datasets,
        "build": {"draft_vocab_size": s["draft_vocab"], "max_length": s["max_model_len"]},
        "extract": {"dtype": "bfloat16", "mode": "offline"},
        "train": {"ttt_steps": K, "epochs": s["epochs"], "lr": s["lr"], "warmup_steps": s["warmup"],
                  "batch_tokens": s["batch_tokens"], "log_every": s["log_every"], "eval_every": s["eval_every"],
                  "checkpoint_every": s["checkpoint_every"], **main_train(s)},
        # max_new_tokens: the evaluations' window, which the trainer's val pass also reports (tau_head)
        "eval": {"datasets": eval_entries(data)[:1], "limit_per_dataset": 1, "k": K,
                 "max_new_tokens": s["eval_new_tokens"]},
    }


def eval_config(base: dict[str, Any], work: Path, name: str, drafter: Path, *, own_dir: bool = True,
                **ev: Any) -> Path:
    """A config for one evaluation: the campaign's own settings (so eval refuses any training set),
    its own campaign dir (each evaluation keeps its own eval/) unless own_dir=False (then the
    report lands in the main campaign, next to the training curves), the drafter given explicitly."""
    cfg = json.loads(json.dumps(base))
    if own_dir:
        cfg["campaign"] = {"name": f"eval-{name}", "dir": str(work / f"eval-{name}"), "seed": 0}
    has_workers = any(f.name == "workers" for f in fields(EvalSection))
    if not has_workers:
        ev.pop("workers", None)
    cfg["eval"] = {"k": K, "drafter": str(drafter), **ev}
    path = work / f"eval-{name}.toml"
    path.write_text(dump_toml(cfg))
    load_config(path)  # validate now, not after a model load
    return path


# ---------------------------------------------------------------- phases


def phase_ours(work: Path, cfg_path: Path, ours_drafter: Path | None = None) -> None:
    """`specops run` to export; with ours_drafter (a drafter trained by another run on the same
    records, e.g. fetched back from a GPU machine) only to extract, which the anchor needs."""
    if (r := read_result(work, "ours")) and r.get("done"):
        log("ours: done already")
        return
    cmd = specops("run", cfg_path, "--to", "extract" if ours_drafter else "export")
    try:
        dt = sh(cmd, work / "results" / "ours.log")
    except SystemExit as e:
        # The trainer's faster forms (block TTT attention, compiled and fused loss, compiled layer
        # regions) may meet a compiler or kernel failure on a device the tests never ran on: if
        # training fails, resume once with the reference forms (TRAIN_FALLBACK; generate, build and
        # extract are done and skipped) and say so in the result.
        mpath = work / "campaign" / "manifest.json"
        ph = json.loads(mpath.read_text()).get("phases", {}) if mpath.is_file() else {}
        state = lambda name: (ph.get(name) or {}).get("state")  # noqa: E731
        if ours_drafter or state("extract") != "done" or state("train") == "done":
            raise
        log(f"ours: training failed ({str(e)[-400:]}); resuming with train "
            + " ".join(f"{k}={v}" for k, v in TRAIN_FALLBACK.items()))
        # recorded, so the lr sweep and a rerun of this script train the same way (train_fallback)
        write_result(work, "ours-train-fallback", {"error": str(e)[-3000:], "train": TRAIN_FALLBACK})
        cfg = tomllib.loads(cfg_path.read_text())
        cfg.setdefault("train", {}).update(TRAIN_FALLBACK)
        cfg_path.write_text(dump_toml(cfg))
        load_config(cfg_path)
        dt = sh(cmd, work / "results" / "ours.log")
    man = json.loads((work / "campaign" / "manifest.json").read_text())
    metrics_path = work / "campaign" / "drafter" / "metrics.jsonl"
    metrics = [json.loads(x) for x in metrics_path.read_text().splitlines() if x] if metrics_path.is_file() else []
    write_result(work, "ours", {"done": True, "wall_s": dt, "phases": man["phases"],
                                "drafter": str(ours_drafter) if ours_drafter else None,
                                "train_metrics_tail": metrics[-6:], "val": [m for m in metrics if m.get("split") == "val"]})


# The trainer's reference forms (drafter/model.py KernelOptions): dense [T, (k+1)T] TTT attention
# masks, the eager soft CE, no compiled layer regions. The same loss and gradients, slower, and
# nothing compiled that could fail.
TRAIN_FALLBACK = {"ttt_attention": "dense", "fused_loss": "off", "compile_loss": "off", "compile_layer": "off"}


def train_fallback(work: Path) -> dict[str, Any]:
    """The train.* overrides phase_ours fell back to in this work dir ({} when it did not)."""
    return dict((read_result(work, "ours-train-fallback") or {}).get("train") or {})


def ours_export(work: Path, ours_drafter: Path | None = None) -> Path:
    """Our drafter for timing and eval: --ours-drafter, else the lr sweep's winner (work/ours-drafter
    links to its export dir), else the main campaign's export."""
    if ours_drafter:
        return ours_drafter
    winner = work / "ours-drafter" / "vllm"
    return winner if winner.is_dir() else work / "campaign" / "drafter" / "export" / "vllm"


def main_train(s: dict[str, Any]) -> dict[str, Any]:
    """The main run's train.* overrides beyond lr / warm-up / tokens per step (the scale's `train`
    entry; the sweep's variants apply on top of them), checked against the keys a variant may set."""
    t = dict(s.get("train") or {})
    allowed = SWEEP_KEYS - {"lr", "warmup_steps", "batch_tokens", *_NOT_TRAIN}  # those three: own scale entries
    if bad := [k for k in t if k not in allowed]:
        raise SystemExit(f"scale train: key(s) {bad} not allowed (allowed: {sorted(allowed)})")
    return t


def sweep_variants(s: dict[str, Any]) -> list[dict[str, Any]]:
    """The scale's recipe variants besides the main run: `sweep` entries (dicts of train.* overrides,
    the trainer's kernel keys such as fused_loss = "on" among them, plus an optional time cap
    "timeout_s") and `lr_sweep` (one variant per lr). A variant equal to the main recipe, or to an
    earlier variant, is dropped. Each comes back with its name (the directory and result key) and its lr
    (the main one unless it sets its own: the winner's lr is reported whichever run wins)."""
    main = {"lr": float(s["lr"])}
    # the main run's own train values: a variant entry that repeats one of them changes nothing
    same = {"batch_tokens": s.get("batch_tokens"), "warmup_steps": s.get("warmup"), **main_train(s)}
    out, seen = [], {variant_name(main)}
    for v in [*({"lr": float(x)} for x in s.get("lr_sweep", ())), *s.get("sweep", ())]:
        v = {k: (float(x) if k == "lr" else x) for k, x in v.items()}
        bad = [k for k in v if k not in SWEEP_KEYS]
        if bad:
            raise SystemExit(f"sweep: unknown key(s) {bad}; allowed: {sorted(SWEEP_KEYS)}")
        v = {k: x for k, x in v.items() if k in _NOT_TRAIN or k not in same or same[k] != x}
        name = variant_name({**main, **v})
        if name not in seen:
            seen.add(name)
            out.append({"lr": main["lr"], **v, "name": name})
    return out


# what a sweep variant may change: train.* keys (the same data and epochs always), the kernel keys
# (how the step is computed: drafter/model.py KernelOptions) among them, and its time cap
SWEEP_KEYS = {"lr", "batch_tokens", "loss_decay", "warmup_steps", "min_lr_ratio", "weight_decay",
              "norm_before_residual", "max_grad_norm", "cuda_graphs", "graph_bucket", "optimizer", "freeze_lm_head",
              "lr_schedule", "pack_rows", "loss_on_prompt", "init_norm_from_target", "mask_repetition",
              "ttt_attention", "fused_loss", "compile_loss", "compile_layer", "sdpa_cudnn", "timeout_s"}
_NOT_TRAIN = ("name", "timeout_s")  # variant keys that are not train.* overrides


def variant_name(v: dict[str, Any]) -> str:
    """lr-0.002, lr-0.0015_batch_tokens-8192, lr-0.003_fused_loss-on: stable, path-safe."""
    parts = [f"lr-{float(v['lr']):g}"]
    parts += [f"{k}-{v[k]:g}" if isinstance(v[k], float) else f"{k}-{v[k]}"
              for k in sorted(v) if k not in ("lr", *_NOT_TRAIN)]
    return "_".join(parts)


def specops_rate_of(camp: Path) -> dict[str, Any]:
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    from speculators_train import specops_rate  # the rate both trainers are measured by

    return specops_rate(camp)


def _sweep_run(camp: Path, variant: dict[str, Any]) -> dict[str, Any]:
    """One trained + exported drafter of the sweep: its last val line (the end-of-run pass), the
    simulated tau of its per-step val acc, the steady train rate (as the anchor's --measure reports
    ours), and the train + export wall seconds from the campaign manifest."""
    import datetime

    from specops.measures import simulated_tau

    rows = [json.loads(x) for x in (camp / "drafter" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    vals = [r for r in rows if r.get("split") == "val"]
    if not vals:
        raise SystemExit(f"sweep: no val line in {camp / 'drafter' / 'metrics.jsonl'} (no val split?)")
    val = {k: vals[-1][k] for k in ("step", "loss", "step_loss", "acc", "tau", "positions", "head_tokens", "acc_head",
                                    "tau_head", "positions_head") if k in vals[-1]}
    rate = specops_rate_of(camp)
    ph = json.loads((camp / "manifest.json").read_text())["phases"]
    t = datetime.datetime.fromisoformat
    export = camp / "drafter" / "export"
    if not (export / "vllm" / "config.json").is_file():
        raise SystemExit(f"sweep: no vllm export under {export}")
    return {**{k: x for k, x in variant.items() if k != "name"}, "variant": variant["name"], "campaign": str(camp),
            "val": val, "sim_tau": simulated_tau(val["acc"]),
            "sim_tau_head": simulated_tau(val["acc_head"]) if val.get("acc_head") else None,
            "train_tokens_per_s": rate.get("tokens_per_s"), "train_tokens_per_s_all": rate.get("tokens_per_s_all"),
            "train_steps": rate.get("steps"), "train_elapsed_s": rate.get("elapsed_s"),
            "wall_s": (t(ph["export"]["done_at"]) - t(ph["train"]["running_at"])).total_seconds(),
            "export": str(export / "vllm"), "exports": sorted(p.name for p in export.iterdir() if p.is_dir()),
            # train.cuda_graphs: shapes captured, replays, eager steps, capture seconds, why off if it went off
            "cuda_graphs": (((read_json(camp / "drafter" / "manifest.json", {}).get("train") or {}).get("summary") or {})
                            .get("cuda_graphs"))}


def choose_run(runs: dict[str, dict[str, Any]], by: str | None) -> tuple[dict[str, Any], str]:
    """The sweep's winner among the runs with a result (skipped ones have none): the highest `by`
    (default sim_tau), ties to the run listed first (the main run leads). A key some run lacks (e.g.
    sim_tau_head from a trainer that does not report it) falls back to sim_tau for all, so every run is
    judged alike."""
    ok = [r for r in runs.values() if r.get("sim_tau") is not None]
    by = by or "sim_tau"
    if by != "sim_tau" and any(r.get(by) is None for r in ok):
        log(f"lr-sweep: not every run reports {by}; choosing by sim_tau")
        by = "sim_tau"
    return max(ok, key=lambda r: round(r[by], 9)), by  # max() keeps the first of equals


def phase_lr_sweep(work: Path, base: dict[str, Any], s: dict[str, Any], ours_drafter: Path | None = None) -> None:
    """Our recipe, chosen on the validation split (never on the eval sets): one more drafter per
    variant of sweep_variants(s) (learning rate, tokens per step, loss decay, trainer switches; the
    data, epochs, seed and K never change), trained and exported exactly as the main one otherwise,
    each in its own campaign work/lr-sweep/<variant>/ whose build/ and features/ are links to the main
    campaign's (`specops run --from train --to export`). The winner has the highest simulated tau of
    its end-of-run val acc (ties: the main run, then the earlier variant); work/ours-drafter links to
    its export dir, which timing, eval and h200_wait.sh use. Each variant runs alone on the device, so
    its train rate is clean; past `sweep_timeout_s` it is stopped and counts as failed (a trainer
    form that is slow on real data must not eat the device time). Resumable: a variant with a result is
    not trained again. Must run before the anchor (its convert consumes the features)."""
    if ours_drafter:
        log("lr-sweep: skipped (--ours-drafter: no drafter trained here)")
        return
    main = {"lr": float(s["lr"]), "batch_tokens": s["batch_tokens"], **main_train(s),
            "name": variant_name({"lr": float(s["lr"])})}
    extra = sweep_variants(s)
    prior = (read_result(work, "lr-sweep") or {}).get("runs", {})
    runs: dict[str, Any] = {main["name"]: {**_sweep_run(work / "campaign", main), "main": True}}
    failed = []
    camp_main = work / "campaign"
    start_by = s.get("sweep_start_by_s")  # seconds after the experiment began (a lease is 30 minutes)
    for v in extra:
        key = v["name"]
        camp = work / "lr-sweep" / key
        if (r := prior.get(key)) and r.get("sim_tau") is not None and Path(r["export"], "config.json").is_file():
            log(f"lr-sweep: {key} done already")
            runs[key] = r
            continue
        if start_by is not None and time.time() - _T0 > start_by:
            log(f"lr-sweep: {key} skipped: {time.time() - _T0:.0f} s into the experiment, past sweep_start_by_s "
                f"{start_by} (the anchor and both evaluations still need the device time)")
            runs[key] = {**{k: x for k, x in v.items() if k != "name"}, "variant": key, "skipped": "sweep_start_by_s"}
            continue
        try:
            if not any((camp_main / "features" / "train").glob("shard-*.safetensors")):
                raise SystemExit(f"lr-sweep: no feature shards in {camp_main / 'features' / 'train'} "
                                 "(the anchor's convert --consume deletes them): the sweep must run before it")
            camp.mkdir(parents=True, exist_ok=True)
            for sub in ("build", "features"):  # the same data, not a copy
                if not (camp / sub).is_symlink():
                    (camp / sub).symlink_to(os.path.relpath(camp_main / sub, camp), target_is_directory=True)
            cfg = json.loads(json.dumps(base))
            cfg["campaign"] = {"name": f"quality-{key}", "dir": str(camp), "seed": base["campaign"]["seed"]}
            # the main run's forms if it fell back to the reference ones, then the variant's own keys
            cfg["train"].update({**train_fallback(work), **{k: x for k, x in v.items() if k not in _NOT_TRAIN}})
            cfg_path = work / "lr-sweep" / f"{key}.toml"
            cfg_path.write_text(dump_toml(cfg))
            load_config(cfg_path)
            dt = sh(specops("run", cfg_path, "--from", "train", "--to", "export"), work / "results" / f"lr-sweep-{key}.log",
                    timeout=v.get("timeout_s", s.get("sweep_timeout_s")))
            runs[key] = {**_sweep_run(camp, v), "command_wall_s": dt}
        except (SystemExit, Exception) as e:  # this variant failed: the others still count
            log(f"lr-sweep: {key} FAILED: {str(e)[:1000]}")
            runs[key] = {**{k: x for k, x in v.items() if k != "name"}, "variant": key, "error": str(e)[-3000:]}
            try:  # how fast it trained before it stopped (a slow form's rate is the finding)
                runs[key]["partial_rate"] = specops_rate_of(camp)
            except Exception:  # noqa: BLE001 - no metrics written yet
                pass
            failed.append(key)
    best, by = choose_run(runs, s.get("sweep_by"))
    link, tmp = work / "ours-drafter", work / ".ours-drafter.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(os.path.relpath(Path(best["export"]).parent, work), target_is_directory=True)
    os.replace(tmp, link)
    write_result(work, "lr-sweep", {
        "done": not failed, "variants": [main["name"], *(v["name"] for v in extra)], "runs": runs, "failed": failed,
        "chosen": best["variant"], "chosen_lr": best["lr"], "chosen_sim_tau": best["sim_tau"],
        "chosen_sim_tau_head": best.get("sim_tau_head"),
        "ours_drafter": str(link / "vllm"), "winner_export": best["export"],
        "chosen_by": f"max {by}: the simulated tau (1 + sum_k prod_{{i<=k}} acc_i) of the end-of-run val pass"
                     + (" over the first eval_new_tokens tokens of each turn" if by == "sim_tau_head" else "")
                     + "; ties -> main, then order"})
    log(f"lr-sweep: chosen {best['variant']} by {by} (" + ", ".join(
        f"{k}: {r[by]:.4f}" for k, r in runs.items() if r.get(by) is not None) + f"); {link} -> {best['export']}")
    if failed:
        raise SystemExit(f"lr-sweep: {', '.join(failed)} failed; chosen among the rest: {best['variant']}")


def _anchor_env() -> dict[str, str]:
    site = os.environ.get("SPECULATORS_SITE", "")
    return {"PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), site) if p)}


def start_anchor_warm(work: Path, s: dict[str, Any], model: str) -> threading.Thread | None:
    """speculators' torch.compile on synthetic features of the real shapes (speculators_warm.py), in
    a thread while `specops run` generates: the compile is CPU work, generation GPU work. It starts
    once our run has converted the target (generate has begun) and phase_anchor waits for it."""
    if read_result(work, "anchor-warm") or (read_result(work, "anchor") or {}).get("done"):
        return None

    def go() -> None:
        from specops.models import resolve_model_dir

        man = work / "campaign" / "manifest.json"
        deadline = time.time() + 1800
        while time.time() < deadline:
            try:
                if json.loads(man.read_text())["phases"]["generate"].get("state"):
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(5)
        site = os.environ.get("SPECULATORS_SITE", "")
        cmd = [sys.executable, HERE / "speculators_warm.py", "--target", resolve_model_dir(model), "--out",
               work / "anchor-warm", "--total-seq-len", anchor_seq_len(s), "--draft-vocab", s["draft_vocab"],
               "--ttt", K, "--timeout", s.get("anchor_warm_timeout_s", 900)]
        if site:
            cmd += ["--spec-path", site]
        if s.get("anchor_cpu"):
            cmd.append("--cpu")
        if s.get("anchor_warm_samples"):
            cmd += ["--samples", s["anchor_warm_samples"], "--max-len", s["anchor_warm_max_len"]]
        if not s.get("anchor_cpu"):
            cmd += ["--", *ANCHOR_GPU_ARGS]
        try:
            sh(cmd, work / "results" / "anchor-warm.log", env=_anchor_env(), ok=(0, 1))
            warm = json.loads((work / "anchor-warm" / "warm.json").read_text())
        except (SystemExit, Exception) as e:
            warm = {"error": str(e)[-3000:]}
        write_result(work, "anchor-warm", warm)
        log(f"anchor-warm: {json.dumps(warm)}")

    t = threading.Thread(target=go, name="anchor-warm", daemon=True)
    t.start()
    return t


_WARM: threading.Thread | None = None


def anchor_seq_len(s: dict[str, Any]) -> int:
    """speculators' --total-seq-len (tokens per step): the scale's anchor_total_seq_len, else ours."""
    return int(s.get("anchor_total_seq_len") or s["batch_tokens"])


def phase_anchor(work: Path, s: dict[str, Any], model: str, on_trained: Any = None) -> None:
    """The speculators trainer, unmodified, on the same build, features and draft vocab and the same
    epochs (its own recipe otherwise: Muon + AdamW at its default lr). bench/quality/README-speculators.md.
    `on_trained()` is called once its training has ended (alone on the device, for a clean rate): what
    follows (its checkpoint's conversion and logit check) is untimed and may share the device.

    Two results, so a failure after training costs nothing already measured: `anchor-train` (its
    training rate, wall time and last validation, written as soon as training ends) and `anchor`
    (the converted, checked drafter). A rerun with `anchor-train` present converts the saved
    checkpoint again instead of training again (its convert consumed the features)."""
    if (r := read_result(work, "anchor")) and r.get("done"):
        log("anchor: done already")
        return
    from specops.models import resolve_model_dir

    env = _anchor_env()
    out, camp = work / "anchor", work / "campaign"
    logf = work / "results" / "anchor.log"
    trained = read_result(work, "anchor-train")
    if trained and not _anchor_checkpoints(out):
        log("anchor: anchor-train is recorded but no checkpoint is left: training again")
        trained = None
    if trained:
        log(f"anchor: trained already ({trained['train_wall_s']:.0f} s); converting its checkpoint")
    else:
        trained = _anchor_train(work, s, model, out, camp, logf, env, resolve_model_dir)
        write_result(work, "anchor-train", trained)
        log("anchor: trained; rate " + str(((trained.get("summary") or {}).get("speculators") or {}).get("tokens_per_s")))
    if on_trained is not None:
        on_trained()
    t_conv2 = sh([sys.executable, HERE / "speculators_to_eval.py", out / "run" / "checkpoints", out / "eval_drafter",
                  "--campaign", camp, "--verify"], logf, env=env)
    sh(specops("export", "--check", out / "eval_drafter"), logf)
    write_result(work, "anchor", {"done": True, **trained, "to_eval_s": t_conv2})


def _anchor_checkpoints(out: Path) -> list[str]:
    ckpts = out / "run" / "checkpoints"
    return sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []


def _anchor_train(work: Path, s: dict[str, Any], model: str, out: Path, camp: Path, logf: Path,
                  env: dict[str, str], resolve_model_dir: Any) -> dict[str, Any]:
    """Convert our features to speculators' layout (consuming them) and run its trainer; returns the
    `anchor-train` result: convert and train wall seconds, whether the time cap stopped it, the
    epochs it saved and speculators_train.py's summary (rates of both trainers, its last val)."""
    if _WARM is not None and _WARM.is_alive():
        log("anchor: waiting for the compile warm-up to finish")
        _WARM.join()
    site = os.environ.get("SPECULATORS_SITE", "")
    t_conv = sh([sys.executable, HERE / "speculators_convert.py", camp, out / "data", "--workers",
                 str(min(16, os.cpu_count() or 1)), "--consume"], logf, env=env)
    train = [sys.executable, HERE / "speculators_train.py", "--data", out / "data", "--target",
             resolve_model_dir(model), "--out", out / "run", "--epochs", s["epochs"], "--lr", s["anchor_lr"],
             "--ttt", K, "--total-seq-len", anchor_seq_len(s), "--ours", camp]
    if site:
        train += ["--spec-path", site]
    if s.get("anchor_cpu"):
        train.append("--cpu")
    extra = list(ANCHOR_GPU_ARGS) if not s.get("anchor_cpu") else []
    if s.get("anchor_checkpoint_freq"):  # its own option: sub-epoch checkpoints, so a time cap keeps one
        extra += ["--checkpoint-freq", s["anchor_checkpoint_freq"]]
    if extra:
        train += ["--", *extra]
    timed_out = False
    try:
        t_train = sh(train, logf, env=env, timeout=s.get("anchor_timeout_s"))
    except SystemExit as e:
        # Out of lease time: keep what its finished epochs saved (it checkpoints once per epoch) and
        # say so in the result; with no checkpoint at all the anchor failed.
        if "timeout after" not in str(e) or not _anchor_checkpoints(out):
            raise
        timed_out, t_train = True, float(s["anchor_timeout_s"])
        log(f"anchor: stopped at the {s['anchor_timeout_s']} s limit; evaluating its last saved checkpoint")
        measure = [sys.executable, HERE / "speculators_train.py", "--measure", out / "run", "--ours", camp]
        with open(out / "run" / "summary.json", "w") as fh:
            subprocess.run([str(c) for c in measure], stdout=fh, stderr=subprocess.DEVNULL, check=False,
                           env={**os.environ, **env})
    summ = out / "run" / "summary.json"
    summary = None
    if summ.is_file():
        txt = summ.read_text()  # --measure prints lines of text before its JSON
        start = 0 if txt.startswith("{") else txt.find("\n{") + 1
        summary = json.loads(txt[start:]) if start or txt.startswith("{") else None
    return {"convert_s": t_conv, "train_wall_s": t_train, "timed_out": timed_out,
            "tokens_per_step": anchor_seq_len(s), "epochs_saved": _anchor_checkpoints(out), "summary": summary}


def _summary(camp: Path) -> dict[str, Any]:
    return json.loads((camp / "eval" / "summary.json").read_text())


def phase_timing(work: Path, base: dict[str, Any], s: dict[str, Any], data: Path,
                 ours_drafter: Path | None = None) -> None:
    """Wall-clock speedup at batch 1, alone on the GPU, with each target runner: "hf" (eager, dynamic
    cache) and "static" (static cache + CUDA graphs). The static run writes the main campaign's report."""
    if read_result(work, "timing"):
        log("timing: done already")
        return
    drafter = ours_drafter or work / "campaign" / "drafter" / "export" / "vllm"
    out: dict[str, Any] = {}
    runners = list(s.get("timing_runners", ("hf", "static")))
    for runner in runners:
        cfg = eval_config(base, work, f"timing-{runner}", drafter, own_dir=runner == "hf", datasets=eval_entries(data)[:1],
                          limit_per_dataset=s["timing_limit"], max_new_tokens=s["timing_new_tokens"], temperature=0.0,
                          target_runner=runner)
        try:
            dt = sh(specops("eval", cfg), work / "results" / f"timing-{runner}.log", ok=(0, 1))
        except SystemExit as e:
            out[runner] = {"error": str(e)[-3000:]}
            if "hf" not in runners:  # the static runner failed: measure with the eager one instead
                runners.append("hf")
            continue
        out[runner] = {"wall_s": dt, "summary": _summary(work / ("eval-timing-hf" if runner == "hf" else "campaign"))}
    write_result(work, "timing", out)


def phase_eval(work: Path, base: dict[str, Any], s: dict[str, Any], data: Path, which: list[str],
               ours_drafter: Path | None = None, anchor_drafter: Path | None = None) -> None:
    drafters = {"ours": ours_drafter or work / "campaign" / "drafter" / "export" / "vllm",
                "anchor": anchor_drafter or work / "anchor" / "eval_drafter"}
    from specops.models import resolve_model_dir

    resolve_model_dir(base["target"]["model"])  # convert the target once, before 2 x `workers` processes load it
    jobs = []
    for who in which:
        if not (drafters[who] / "config.json").is_file():
            log(f"eval: no {who} drafter at {drafters[who]}: skipped")
            continue
        for temp, sets, limit in ((0.0, eval_entries(data), None), (1.0, eval_entries(data)[:1], s["t1_limit"])):
            name = f"{who}-t{int(temp)}"
            if read_result(work, f"eval-{name}"):
                continue
            # tau only (the timing phase measures speed, alone): no target-only run per turn; the
            # batched loop when the scale has eval_batch > 1, else `workers` batch-1 processes
            ev = dict(datasets=sets, temperature=temp, max_new_tokens=s["eval_new_tokens"], target_runner="auto",
                      baseline=False, **_eval_parallelism(s))
            ev["limit_per_dataset"] = limit or max(s["eval_limit"], s["spec_bench_limit"])
            jobs.append((name, drafters[who], ev))
    # Spec-Bench runs all its prompts; the other sets their first eval_limit (limit is per set, so
    # the T=0 run caps the others by trimming its prompt files instead).
    def run_jobs(todo: list[tuple[str, Path, dict[str, Any]]]) -> None:
        for name, drafter, ev in todo:
            logf = work / "results" / f"eval-{name}.log"
            try:
                dt = sh(specops("eval", eval_config(base, work, name, drafter, **ev)), logf, ok=(0, 1))
            except SystemExit:  # new code on a GPU: fall back once to batch-1 workers (static runners)
                ev = {**ev, "batch_size": 1, "workers": s["workers"]}
                dt = sh(specops("eval", eval_config(base, work, name, drafter, **ev)), logf, ok=(0, 1))
            write_result(work, f"eval-{name}", {"wall_s": dt, "summary": _summary(work / f"eval-{name}")})

    # tau does not depend on timing, so the drafters are evaluated side by side (one thread each,
    # its T=0 then its T=1 run); wall-clock speedups come from the timing phase, run alone.
    groups = [[j for j in jobs if j[0].startswith(who + "-")] for who in which]
    groups = [g for g in groups if g]
    with concurrent.futures.ThreadPoolExecutor(max(1, len(groups))) as ex:
        for fut in [ex.submit(run_jobs, g) for g in groups]:
            fut.result()


def _eval_parallelism(s: dict[str, Any]) -> dict[str, int]:
    """tau evaluations: one batched loop of eval_batch rows, or `workers` batch-1 processes."""
    if s.get("eval_batch", 1) > 1:
        return {"batch_size": s["eval_batch"], "workers": 1}
    return {"batch_size": 1, "workers": s["workers"]}


def trim_eval_sets(data: Path, limit: int, spec_limit: int | None = None) -> None:
    """MT-bench, HumanEval and GSM8K: their first `limit` prompts. Spec-Bench: all 480, or with
    spec_limit < 480 that many spread evenly over the file (its 13 categories lie in blocks, so a
    prefix would be MT-bench questions only). Idempotent: a trimmed file is left alone."""
    import gzip

    p = data / "eval" / "spec_bench" / "question.jsonl"
    lines = p.read_text().splitlines()
    if spec_limit and len(lines) > spec_limit:
        n = len(lines)
        p.write_text("\n".join(lines[i * n // spec_limit] for i in range(spec_limit)) + "\n")

    for rel in ("mtbench/question.jsonl", "gsm8k/test.jsonl"):
        p = data / "eval" / rel
        lines = p.read_text().splitlines()
        if len(lines) > limit:
            p.write_text("\n".join(lines[:limit]) + "\n")
    p = data / "eval" / "HumanEval.jsonl.gz"
    with gzip.open(p, "rt") as fh:
        lines = fh.read().splitlines()
    if len(lines) > limit:
        with gzip.open(p, "wt") as fh:
            fh.write("\n".join(lines[:limit]) + "\n")


def phase_collect(work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"work": str(work)}
    for name in ("env", "ours", "lr-sweep", "lr-sweep-error", "anchor", "anchor-train", "anchor-error", "timing", "eval-ours-t0", "eval-anchor-t0", "eval-ours-t1", "eval-anchor-t1"):
        out[name] = read_result(work, name)
    taus: dict[str, Any] = {}
    for temp in ("t0", "t1"):
        o, a = out.get(f"eval-ours-{temp}"), out.get(f"eval-anchor-{temp}")
        for who, r in (("ours", o), ("anchor", a)):
            if not r:
                continue
            for ds, d in (r["summary"].get("datasets") or {}).items():
                taus.setdefault(f"{ds}-{temp}", {})[who] = d.get("tau")
    # all T=0 turns pooled: the evaluator's tau (mean of accepted + 1 over target steps) over every
    # set's target steps together
    for temp in ("t0", "t1"):
        pooled = {}
        for who in ("ours", "anchor"):
            r = out.get(f"eval-{who}-{temp}")
            sets = (r or {}).get("summary", {}).get("datasets") or {}
            steps = sum(d.get("target_steps") or 0 for d in sets.values())
            if steps:
                pooled[who] = sum((d.get("tau") or 0) * (d.get("target_steps") or 0) for d in sets.values()) / steps
        if len(pooled) == 2 and temp == "t0":
            taus["all-t0"] = pooled
    for row in taus.values():
        if row.get("ours") and row.get("anchor"):
            row["ratio"] = row["ours"] / row["anchor"]
    out["tau"] = taus
    # training rates, measured the same way for both (speculators_train.py --measure): the anchor's
    # run, our main run, and the sweep's chosen variant (the drafter whose tau is above)
    anchor_run = out.get("anchor") or out.get("anchor-train") or {}  # its rate even when its conversion failed
    anchor_rate = ((anchor_run.get("summary") or {}).get("speculators") or {}).get("tokens_per_s")
    sweep = out.get("lr-sweep") or {}
    runs = sweep.get("runs") or {}
    main_run = next((r for r in runs.values() if r.get("main")), {})
    chosen = runs.get(sweep.get("chosen"), {})
    train = {"anchor_tokens_per_s": anchor_rate, "ours_main_tokens_per_s": main_run.get("train_tokens_per_s"),
             "ours_chosen": sweep.get("chosen"), "ours_chosen_tokens_per_s": chosen.get("train_tokens_per_s")}
    # the like-for-like rate: our run (main or variant) at the anchor's tokens per step, if there is one
    args = (anchor_run.get("summary") or {}).get("args") or []
    if "--total-seq-len" in args:
        seq = int(args[args.index("--total-seq-len") + 1])
        same = next((n for n, r in runs.items() if r.get("batch_tokens") == seq and r.get("train_tokens_per_s")), None)
        train.update(anchor_tokens_per_step=seq, ours_same_batch=same,
                     ours_same_batch_tokens_per_s=runs[same]["train_tokens_per_s"] if same else None)
    for k in ("main", "chosen", "same_batch"):
        v = train.get(f"ours_{k}_tokens_per_s")
        if v and anchor_rate:
            train[f"ratio_{k}"] = v / anchor_rate
    out["train"] = train
    write_result(work, "quality", out)
    return out


def env_info(work: Path) -> None:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0],
                            "cuda": torch.cuda.is_available(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    write_result(work, "env", info)


def scale_settings(scale: str, sets: list[str] = (), *, main_only: bool = False) -> dict[str, Any]:
    """The scale's entries with the `--set KEY=VALUE` overrides (values parsed as Python literals,
    else kept as strings); main_only empties the sweep (the main recipe alone)."""
    s = {"lr_sweep": (), "sweep": (), "sweep_timeout_s": None, "sweep_start_by_s": None, "sweep_by": None, "train": {},
         **SCALES[scale]}
    for kv in sets:
        key, sep, val = kv.partition("=")
        if not sep or key not in s:
            raise ValueError(f"--set {kv!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(s))}")
        try:
            s[key] = ast.literal_eval(val)
        except (ValueError, SyntaxError):
            s[key] = val
    if main_only:
        s["sweep"], s["lr_sweep"] = (), ()
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["all", "ours", "lr-sweep", "anchor", "timing", "eval", "collect", "configs"])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--scale", choices=sorted(SCALES), default="h200")
    ap.add_argument("--model", default="smollm2", help="target.model: 'smollm2', a .gguf or an HF dir")
    ap.add_argument("--carry", type=Path, default=REPO / ".carry_q")
    ap.add_argument("--skip-anchor", action="store_true")
    ap.add_argument("--skip", action="append", default=[], choices=["lr-sweep", "anchor", "timing", "eval"],
                    help="leave this phase out of `all` (e.g. timing, when the device time left is too short)")
    ap.add_argument("--ours-drafter", type=Path,
                    help="our drafter from another run on the same records (an export dir): ours stops at "
                         "extract (the anchor needs the features) and timing/eval use this drafter")
    ap.add_argument("--anchor-drafter", type=Path,
                    help="the anchor's drafter from another run (speculators_to_eval.py output): phase eval "
                         "evaluates it (with --ours-drafter: `run.py eval` needs no campaign, no GPU training)")
    ap.add_argument("--records", type=Path,
                    help="records.tar.xz of another run (generate/<dataset>/records.jsonl): seeds the campaign, "
                         "so generate resumes with every sample done (same datasets and sampling)")
    ap.add_argument("--main-only", action="store_true",
                    help="train the main recipe alone: no sweep variants (sweep=() lr_sweep=()); the lr-sweep "
                         "phase then only records the main run (its val figures and rate) and links it as ours")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one entry of the scale (e.g. lr=1e-3, epochs=2, eval_limit=40); the value is "
                         "parsed as a Python literal, else kept as a string")
    args = ap.parse_args()
    try:
        s = scale_settings(args.scale, args.set, main_only=args.main_only)
    except ValueError as e:
        ap.error(str(e))
    work = args.work.resolve()
    if args.ours_drafter:
        args.ours_drafter = args.ours_drafter.resolve()
    if args.anchor_drafter:
        args.anchor_drafter = args.anchor_drafter.resolve()
    (work / "results").mkdir(parents=True, exist_ok=True)
    data = unpack(work, args.carry)
    trim_eval_sets(data, s["eval_limit"], s.get("spec_bench_limit"))
    base = base_config(work, data, args.model, s)
    base["train"].update(train_fallback(work))  # a rerun keeps the forms an earlier fallback chose
    if args.records and not (work / "campaign" / "generate").exists():
        (work / "campaign").mkdir(parents=True, exist_ok=True)
        with tarfile.open(args.records) as tf:
            tf.extractall(work / "campaign", filter="data")
        log(f"seeded campaign/generate from {args.records}")
    cfg_path = work / "ours.toml"
    cfg_path.write_text(dump_toml(base))
    load_config(cfg_path)
    if args.phase == "configs":
        print(cfg_path)
        return
    if args.phase == "all":
        env_info(work)
    # Ours first and evaluated first: the anchor's failure must not cost our figures.
    # Then timing (alone on the GPU), the anchor's training (alone, for a fair tokens/s), and both
    # drafters' tau side by side.
    which = ["ours"] if args.skip_anchor else ["ours", "anchor"]
    # tau needs no quiet device: once the anchor's training is over, our drafter's evaluation starts
    # beside the anchor's conversion (about 2 minutes of a lease); phase eval then waits for it.
    early: list[concurrent.futures.Future] = []
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def eval_ours_early() -> None:
        if "eval" in wanted and "ours" in which:
            early.append(pool.submit(phase_eval, work, base, s, data, ["ours"], ours_export(work, args.ours_drafter)))

    def eval_all() -> None:
        for fut in early:
            try:
                fut.result()
            except (SystemExit, Exception) as e:  # retried below, with the anchor's
                log(f"eval (ours, early): FAILED: {str(e)[:2000]}")
        phase_eval(work, base, s, data, which, ours_export(work, args.ours_drafter), args.anchor_drafter)

    steps = {
        "ours": lambda: phase_ours(work, cfg_path, args.ours_drafter),
        "lr-sweep": lambda: phase_lr_sweep(work, base, s, args.ours_drafter),
        "anchor": lambda: phase_anchor(work, s, args.model, on_trained=eval_ours_early),
        "eval": eval_all,
        "timing": lambda: phase_timing(work, base, s, data, ours_export(work, args.ours_drafter)),
    }
    wanted = {"all": list(steps), "ours": ["ours", "lr-sweep"], "lr-sweep": ["lr-sweep"], "timing": ["timing"], "anchor": ["anchor"],
              "eval": ["eval"], "collect": []}[args.phase]
    if args.skip_anchor:
        args.skip.append("anchor")
    wanted = [w for w in wanted if w not in args.skip]
    global _WARM
    if "anchor" in wanted and s.get("anchor_warm"):
        _WARM = start_anchor_warm(work, s, args.model)
    for name in wanted:
        try:
            steps[name]()
            (work / "results" / f"{name}-error.json").unlink(missing_ok=True)
        except (SystemExit, Exception) as e:  # record it; go on unless our own drafter is missing
            log(f"{name}: FAILED: {str(e)[:2000]}")
            write_result(work, f"{name}-error", {"error": str(e)[-6000:]})
            if name == "ours":
                raise
    for fut in early:  # an early evaluation whose phase eval was not wanted, or failed
        try:
            fut.result()
        except (SystemExit, Exception) as e:
            log(f"eval (ours, early): FAILED: {str(e)[:2000]}")
    pool.shutdown()
    out = phase_collect(work)
    log("collect: " + json.dumps(out.get("tau"), indent=None))


if __name__ == "__main__":
    main()
