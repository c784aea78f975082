"""Run the speculators 0.9.0 trainer (unmodified) on data written by speculators_convert.py, then
report its training tokens/s measured the way specops' is.

    python3 bench/quality/speculators_train.py --data DATA --target TARGET_DIR --out RUN_DIR \\
        --epochs E --lr LR [--spec-path DIR] [--ttt 7] [--total-seq-len 16384] [--ours CAMPAIGN] [-- EXTRA...]
    python3 bench/quality/speculators_train.py --measure RUN_DIR [--ours CAMPAIGN]   # numbers only

The trainer runs as `speculators train` through bench/quality/speculators_launch.py (speculators'
own `app()`, plus a log handler that writes RUN_DIR/logs/train.log and metrics.jsonl) with
PYTHONPATH = --spec-path (the dir the wheels were installed into with `pip install --target`).
Checkpoints: RUN_DIR/checkpoints/<epoch>/ (config.json + model.safetensors). Summary:
RUN_DIR/summary.json.

Arguments given to `speculators train` (anything after `--` is appended and wins):
  --verifier-name-or-path TARGET_DIR   the campaign's target (HF dir: config, tokenizer, safetensors)
  --data-path DATA                     + --train-data-ratio from DATA/convert_manifest.json
  --target-layer-ids A B C             our features' aux ids (input-to-layer, vLLM's convention)
  --draft-vocab-size V --d2t-path --t2d-path   our build/vocab.safetensors, as .npy
  --ttt-steps K (7) --ttt-step-loss-decay D (0.8 = our train.loss_decay)
  --epochs E --lr LR                   as given (muon_lr defaults to lr)
  --total-seq-len S (16384 = our train.batch_tokens default: tokens per optimizer step)
  --seed SEED (0)  --on-missing raise (never asks a vLLM server)  --log-freq 1  --logger ''
  --no-norm-before-fc --no-norm-output --full-attention-indices 0   the standard EAGLE-3 layer that
      vLLM's llama_eagle3 and specops' eval run (speculators' eagle3 defaults are the "3.1" norms
      and a 2048 sliding window)
  --[no-]norm-before-residual          = --norm-before-residual here (default false, our default)
  --save-path RUN_DIR/checkpoints --log-dir RUN_DIR/logs
Left at speculators' defaults (its recipe): optimizer muon (+AdamW for 1-D params), weight decay
0.01/0.1, linear schedule with 1% warmup, loss kl_div (fused Triton), grad clip 1.0, lm_head and
embeddings frozen, simple_flex_attention (+torch.compile on CUDA), bf16 autocast, one checkpoint
and one validation pass per epoch, 12 dataloader workers.
--cpu (CPU proof only): --draft-attn-impl sdpa --loss-implementation eager --hidden-states-dtype
float32 --num-workers 0, and SPECOPS_SPECULATORS_CPU_SHIM=1 (see speculators_launch.py).

Tokens/s, both trainers the same way: every input token of the trained samples (prompt and
answer; loss-bearing or not; padding never) divided by the wall time of the training steps, after
the first logged step/window (warm-up and compilation), summed over steps:
  speculators: per step, profile.tokens_per_s * profile.step_ms = non-padding slots of the packed
      row; step_ms runs from the end of the previous step to the end of this one (data wait
      included, validation and checkpoints not). Its shift drops one token per sample, so it
      counts len-1 per sample (about 1/len fewer).
  specops: per logged window of drafter/metrics.jsonl, window tokens (the `tokens` delta = sum of
      sample lengths) / (that / tokens_per_s); windows also hold eval and checkpoint time that
      fall inside them (run with train.eval_every and checkpoint_every >= total steps, or
      log_every 1, to keep them out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


# ------------------------------------------------------------------ measurement

def speculators_rate(metrics_jsonl: Path, skip: int = 1) -> dict[str, Any]:
    rows = [json.loads(line) for line in metrics_jsonl.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if isinstance(r.get("profile"), dict) and "train" in r]
    val = [r for r in rows if "val" in r]
    if not steps:
        return {"steps": 0}
    tok = [r["profile"]["tokens_per_s"] * r["profile"]["step_ms"] / 1000.0 for r in steps]
    dt = [r["profile"]["step_ms"] / 1000.0 for r in steps]
    s = slice(skip, None) if len(steps) > skip else slice(0, None)
    out = {
        "steps": len(steps),
        "tokens": round(sum(tok)),
        "train_seconds": sum(dt),
        "tokens_per_s_all": sum(tok) / sum(dt),
        "tokens_per_s": sum(tok[s]) / sum(dt[s]),
        "skipped_first": skip if len(steps) > skip else 0,
        "first_to_last_record_s": steps[-1]["t"] - steps[0]["t"],
    }
    started = metrics_jsonl.parent.parent / "started.json"
    if started.is_file():  # start-up, data loading and compilation before its first logged step
        out["first_step_after_start_s"] = steps[0]["t"] - json.loads(started.read_text())["t"]
    last = steps[-1]["train"]
    out["last_train"] = {k: last[k] for k in sorted(last) if k.startswith(("loss_", "full_acc_", "cond_acc_"))}
    if val:
        v = val[-1]["val"]
        out["last_val"] = {k: v[k] for k in sorted(v)}
        # speculators' full_acc_k = share of loss-masked positions whose steps 0..k were ALL right
        # (a chain), so the simulated tau is 1 + sum_k full_acc_k. specops' own simulated tau is
        # 1 + sum_k prod_{i<=k} acc_i of per-step accuracies: a different estimator; compare the
        # two trainers with `specops eval` (real decoding), not with these.
        k_max = [k for k in range(64) if f"full_acc_{k}_epoch" in v]
        out["val_full_acc"] = [v[f"full_acc_{k}_epoch"] for k in k_max]
        out["val_tau_sim"] = 1.0 + sum(out["val_full_acc"])
    return out


def specops_rate(campaign: Path, skip: int = 1) -> dict[str, Any]:
    path = campaign / "drafter" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    tr = [r for r in rows if r.get("split") == "train"]
    if not tr:
        return {"windows": 0}
    tok, dt, prev = [], [], 0
    for r in tr:
        t = r["tokens"] - prev
        prev = r["tokens"]
        tok.append(t)
        dt.append(t / r["tokens_per_s"] if r["tokens_per_s"] else 0.0)
    s = slice(skip, None) if len(tr) > skip else slice(0, None)
    out = {"windows": len(tr), "steps": tr[-1]["step"], "tokens": prev, "train_seconds": sum(dt),
           "tokens_per_s_all": sum(tok) / sum(dt), "tokens_per_s": sum(tok[s]) / sum(dt[s]),
           "skipped_first": skip if len(tr) > skip else 0}
    val = [r for r in rows if r.get("split") == "val"]
    if val:
        out["last_val"] = {k: val[-1][k] for k in ("step", "loss", "acc", "tau") if k in val[-1]}
    m = campaign / "drafter" / "manifest.json"
    if m.is_file():
        summ = (json.loads(m.read_text()).get("train") or {}).get("summary") or {}
        out["elapsed_s"] = summ.get("elapsed_s")
    return out


def report(run_dir: Path, ours: Path | None, skip: int) -> dict[str, Any]:
    res: dict[str, Any] = {"speculators": speculators_rate(run_dir / "logs" / "metrics.jsonl", skip)}
    if ours is not None:
        res["specops"] = specops_rate(ours, skip)
    res["definition"] = ("input tokens (all tokens of the trained samples, loss-bearing or not, no padding) / "
                         "wall time of the training steps, after the first logged step/window")
    return res


def _fmt(name: str, r: dict[str, Any]) -> str:
    if not r.get("tokens"):
        return f"{name}: no step logged"
    return (f"{name}: {r['tokens_per_s']:.1f} tokens/s (steady, first {r['skipped_first']} skipped); "
            f"{r['tokens_per_s_all']:.1f} over all; {r['tokens']} tokens in {r['train_seconds']:.1f} s of steps")


# ------------------------------------------------------------------ run

def build_args(a: argparse.Namespace, man: dict[str, Any], run_dir: Path) -> list[str]:
    args = [
        "--verifier-name-or-path", str(a.target),
        "--data-path", str(a.data),
        "--train-data-ratio", repr(man["train_data_ratio"]),
        "--target-layer-ids", *map(str, man["aux_layer_ids"]),
        "--draft-vocab-size", str(man["draft_vocab_size"]),
        "--d2t-path", man["d2t_path"], "--t2d-path", man["t2d_path"],
        "--ttt-steps", str(a.ttt), "--ttt-step-loss-decay", repr(a.decay),
        "--epochs", str(a.epochs), "--lr", repr(a.lr),
        "--total-seq-len", str(a.total_seq_len),
        "--seed", str(a.seed),
        "--on-missing", "raise",
        "--log-freq", "1", "--logger", "",
        "--no-norm-before-fc", "--no-norm-output", "--full-attention-indices", "0",
        "--norm-before-residual" if a.norm_before_residual else "--no-norm-before-residual",
        "--save-path", str(run_dir / "checkpoints"), "--log-dir", str(run_dir / "logs"),
    ]
    if a.cpu:
        args += ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
                 "--hidden-states-dtype", "float32", "--num-workers", "0"]
    if man["max_sample_len"] > a.total_seq_len:
        print(f"warning: longest sample {man['max_sample_len']} > --total-seq-len {a.total_seq_len}: "
              "speculators truncates it", file=sys.stderr)
    return args + list(a.extra)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, help="speculators_convert.py output dir")
    ap.add_argument("--target", type=Path, help="the target model dir (the campaign's target)")
    ap.add_argument("--out", type=Path, help="run dir: checkpoints/, logs/, summary.json")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--decay", type=float, default=0.8)
    ap.add_argument("--total-seq-len", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--norm-before-residual", action="store_true")
    ap.add_argument("--spec-path", type=Path, default=None, help="dir the speculators wheels were installed into")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the trainer (default: this one)")
    ap.add_argument("--cpu", action="store_true", help="CPU proof settings (never on a GPU)")
    ap.add_argument("--skip", type=int, default=1, help="logged steps/windows left out of the steady rate")
    ap.add_argument("--ours", type=Path, help="a specops campaign dir: report its train tokens/s too")
    ap.add_argument("--measure", type=Path, help="only compute the numbers of an existing run dir")
    a = ap.parse_args(argv)
    a.extra = extra

    if a.measure:
        res = report(a.measure, a.ours, a.skip)
        print(_fmt("speculators", res["speculators"]))
        if "specops" in res:
            print(_fmt("specops", res["specops"]))
        print(json.dumps(res, indent=1))
        return 0

    for k in ("data", "target", "out"):
        if getattr(a, k) is None:
            ap.error(f"--{k} is required")
    man = json.loads((a.data / "convert_manifest.json").read_text())
    run_dir = a.out.resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    args = build_args(a, man, run_dir)
    env = dict(os.environ)
    if a.spec_path:
        env["PYTHONPATH"] = os.pathsep.join([str(a.spec_path.resolve())] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("COLUMNS", "200")  # rich progress bars / tracebacks in the console log
    if a.cpu:
        env["SPECOPS_SPECULATORS_CPU_SHIM"] = "1"
    cmd = [a.python, str(HERE / "speculators_launch.py"), str(run_dir / "logs"), "train", *args]
    (run_dir / "command.json").write_text(json.dumps({"cmd": cmd, "PYTHONPATH": env.get("PYTHONPATH")}, indent=1) + "\n")
    print("running:", " ".join(cmd[2:4]), "...", flush=True)
    t0 = time.time()
    (run_dir / "started.json").write_text(json.dumps({"t": t0}) + "\n")
    with open(run_dir / "logs" / "console.log", "ab") as console:
        rc = subprocess.call(cmd, env=env, stdout=console, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    res = report(run_dir, a.ours, a.skip)
    res.update({"rc": rc, "wall_s": wall, "args": args, "convert_manifest": str(a.data / "convert_manifest.json")})
    (run_dir / "summary.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"speculators train rc={rc}, {wall:.1f} s wall (process, incl. start-up and validation)")
    print(_fmt("speculators", res["speculators"]))
    if "specops" in res:
        print(_fmt("specops", res["specops"]))
    sp = res["speculators"]
    if sp.get("val_tau_sim") is not None:
        print(f"speculators last val: simulated tau 1 + sum(full_acc_k) = {sp['val_tau_sim']:.3f}")
    print(f"logs: {run_dir / 'logs'}; checkpoints: {run_dir / 'checkpoints'}; summary: {run_dir / 'summary.json'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
