"""Warm speculators' torch.compile cache on synthetic features, while our generation runs.

    python3 bench/quality/speculators_warm.py --target TARGET_DIR --out DIR [--samples 80]
        [--draft-vocab 32000] [--total-seq-len 16384] [--spec-path DIR] [--timeout 600] [-- EXTRA...]

Why: speculators 0.9.0 compiles its EAGLE-3 forward (`@conditional_torch_compile` on CUDA, flex
attention inside) on the first training step and again for the first validation pass. On an H200 the
first step can take more than 3.5 min, so a run capped in time may save nothing. That compile is a
one-time cost per machine, which a multi-hour run never notices; here it would eat a 30-minute
device call. This script runs the anchor's trainer, unmodified, for one short epoch on random data
of the real run's shapes: the same target (hidden size, verifier lm_head and norm), draft vocab,
total_seq_len (every batch is padded to it, so shapes are static), TTT steps and dtype. Inductor's
caches (FX graph, AOTAutograd, Triton kernels: /tmp/torchinductor_<user>) then serve the real run.
Nothing here is used for any figure except the compile cost itself: the seconds from process start
to its first logged step, written to DIR/warm.json.

Data (same layout as speculators_convert.py): `samples` rows, lengths uniform in [64, 2048],
random token ids, loss mask 1 from position 1 on, hidden states N(0, 1) in bf16, d2t = 0 (draft id
i is target id i) and t2d = the first V target ids; 80 % train (about 4 steps at 16,384 tokens),
the rest validation (one pass, which compiles the no-grad graph).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from speculators_convert import write_dataset, write_hs  # noqa: E402


def write_synthetic(target: Path, out: Path, samples: int, draft_vocab: int, *, min_len: int = 64,
                    max_len: int = 2048, seed: int = 0) -> dict:
    cfg = json.loads((target / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    H, L, vocab = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    V = min(draft_vocab, vocab)
    rng = np.random.default_rng(seed)
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    ids, masks, lens = [], [], []
    for i in range(samples):
        T = int(rng.integers(min_len, max_len + 1))
        tok = rng.integers(0, vocab, size=T, dtype=np.int64)
        mask = np.ones(T, dtype=np.int64)
        mask[0] = 0
        hs = rng.standard_normal((T, 4, H), dtype=np.float32)
        bits = (hs.view(np.uint32) >> 16).astype(np.uint16)  # bf16 by truncation: values do not matter
        write_hs(out / "hidden_states" / f"hs_{i}.safetensors", tok, bits)
        ids.append(tok)
        masks.append(mask)
        lens.append(T)
    write_dataset(out, ids, masks, lens)
    d2t_path, t2d_path = out / f"d2t-{V}.npy", out / f"t2d-{V}.npy"
    np.save(d2t_path, np.zeros(V, dtype=np.int64))
    t2d = np.zeros(vocab, dtype=np.bool_)
    t2d[:V] = True
    np.save(t2d_path, t2d)
    n_train = int(samples * 0.8)
    man = {"format": "synthetic (speculators_warm.py)", "rows": samples, "n_train": n_train,
           "train_data_ratio": (n_train + 0.5) / samples, "aux_layer_ids": [2, L // 2, L - 3],
           "draft_vocab_size": V, "d2t_path": str(d2t_path), "t2d_path": str(t2d_path),
           "max_sample_len": max(lens), "tokens": int(sum(lens)), "hidden_size": H}
    (out / "convert_manifest.json").write_text(json.dumps(man, indent=2) + "\n")
    return man


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=80)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--total-seq-len", type=int, default=16384)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--spec-path", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--cpu", action="store_true", help="speculators_train.py --cpu (the CPU proof settings)")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:  # passed on to speculators_train.py (and from there to `speculators train`)
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    a = ap.parse_args(argv)
    if a.samples < 5:
        ap.error("--samples must be >= 5 (a train and a validation split)")
    if not 3 <= a.min_len <= a.max_len:
        ap.error("need 3 <= --min-len <= --max-len")
    out = a.out.resolve()
    t0 = time.time()
    man = write_synthetic(a.target.resolve(), out / "data", a.samples, a.draft_vocab, min_len=a.min_len,
                          max_len=a.max_len)
    t_data = time.time() - t0
    cmd = [sys.executable, str(HERE / "speculators_train.py"), "--data", str(out / "data"), "--target", str(a.target),
           "--out", str(out / "run"), "--epochs", "1", "--lr", "1e-3", "--ttt", str(a.ttt),
           "--total-seq-len", str(a.total_seq_len)]
    if a.spec_path:
        cmd += ["--spec-path", str(a.spec_path)]
    if a.cpu:
        cmd.append("--cpu")
    if extra:
        cmd += ["--", *extra]
    t1 = time.time()
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        rc: int | str = proc.wait(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its dataloader workers
        proc.wait()
        rc = f"timeout after {a.timeout:.0f}s"
    wall = time.time() - t1
    res: dict = {"rc": rc, "data_s": round(t_data, 1), "train_wall_s": round(wall, 1), "rows": man["rows"],
                 "tokens": man["tokens"]}
    summ = out / "run" / "summary.json"
    if summ.is_file():
        sp = json.loads(summ.read_text()).get("speculators", {})
        res["steps"] = sp.get("steps")
        res["first_step_after_start_s"] = sp.get("first_step_after_start_s")
    (out / "warm.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
