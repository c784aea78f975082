"""Benchmark and check data-parallel extract and train under torchrun (issue 9): N processes against
one, on the same data, in one run.

    python bench/multi_gpu.py extract [--nproc 2] [--tiny] [--samples 160] [--dtype bfloat16|fp8] [--out F]
    python bench/multi_gpu.py train [--nproc 2] [--shape smollm2|8b|tiny] [--seqs 256] [--steps 80]
                                    [--batch-tokens 8192] [--out F]

extract: a random-weight Llama built from a config on each rank with the same seed (8B-shaped by
default, as bench/extract_gpu.py; --tiny on CPUs), a synthetic build split, then `run_extract` in one
process and under `torch.distributed.run --nproc_per_node N` into two campaigns. Checks that the
shard sets hold the same samples with the same input ids and loss masks, reports the largest
feature difference (bf16 batches of other shapes round differently), and the scaling ratio:
tokens / the slowest rank's extract wall time, N processes over one.

train: a synthetic feature campaign (bench/train_gpu.py's; SmolLM2-shaped by default), trained by
`python -m specops train` in one process with grad_accum N and under torchrun with grad_accum
1 (the same micro-batches per optimizer step, so the same global batch), both eager; and once more
in one process with the default CUDA graphs (what one GPU gives a user; graphs are off under DDP).
Reports the loss curves' largest relative difference per logged step (tolerance: 1e-4 in fp32 on
CPUs, 2e-2 under bf16 autocast on GPUs) and tokens/s, the steady windows after the first.

Without CUDA every run uses gloo on the CPU (a correctness check: tests/test_multi_gpu_bench.py).
NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(HERE))

from specops.campaign import Campaign  # noqa: E402
from specops.config import config_from_dict, load_config  # noqa: E402

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, args: list[str], log: Path, timeout: float) -> float:
    """Run `args` (a python -m target or script and its arguments) in one process, or N under
    torch.distributed.run; returns the wall seconds. A non-zero exit stops the bench with the log's tail."""
    env = {**os.environ, **NO_MULTICAST, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if not torch.cuda.is_available():
        env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_free_port()}"]
    cmd += args
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {rc}:\n{log.read_text(errors='replace')[-3000:]}")
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------- extract


def extract_worker(a: argparse.Namespace) -> None:
    """One rank of an extract arm: the seeded random target on this rank's device, then run_extract."""
    from extract_gpu import make_target

    from specops.extract import run_extract

    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    camp = Campaign(a.camp)
    torch.manual_seed(0)  # the same weights on every rank and in every arm
    target = make_target(a.tiny, device, Path(tempfile.mkdtemp(prefix=f"rank{rank}-", dir=a.camp)))
    probe = float(target.model.model.layers[0].mlp.down_proj.weight.float().sum())
    t0 = time.perf_counter()
    run_extract(load_config(camp.config_path), camp, split="train", target=target)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    (Path(a.camp) / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "wall_s": wall, "weight_probe": probe}))


def compare_features(one: Path, many: Path) -> dict[str, object]:
    """Same samples, ids and masks exactly (else exit naming them); how far apart the features are
    (specops.features.compare_splits: per-vector relative L2 differences, the largest absolute one)."""
    from specops.features import compare_splits

    try:
        c = compare_splits(many, one)
    except ValueError as e:
        raise SystemExit(f"extract: 1 vs N processes: {e}") from None
    return {"samples": c["samples"], "samples_bit_identical": c["samples_bit_identical"],
            "max_abs_diff": c["max_abs_diff"], "max_rel": max(c["max_rel"].values(), default=0.0)}


def bench_extract(a: argparse.Namespace, work: Path) -> dict[str, object]:
    from extract_gpu import write_build

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(a.min_len, a.max_len + 1, (a.samples,), generator=g).tolist()
    vocab = 1024 if a.tiny else 128256
    prompts = work / "prompts.jsonl"
    prompts.write_text('{"id": "q0", "prompt": "hi"}\n')
    from extract_gpu import target_config

    target_config(a.tiny).save_pretrained(work / "target")  # what the config names; each rank builds the weights
    arms: dict[str, dict[str, object]] = {}
    for name, nproc in (("one", 1), ("many", a.nproc)):
        root = work / name
        cfg = config_from_dict({
            "campaign": {"name": name, "dir": str(root)}, "target": {"model": str(work / "target")},
            "datasets": [{"name": "d", "path": str(prompts)}],
            "extract": {"dtype": a.dtype, "token_budget": a.token_budget, "shard_tokens": a.shard_tokens},
        })  # fmt: skip
        Campaign.create_or_open(cfg)
        write_build(root, lens, vocab)
        launch(nproc, [__file__, "_extract-worker", "--camp", str(root), *(["--tiny"] if a.tiny else [])],
               work / f"extract-{name}.log", a.timeout)
        ranks = [json.loads((root / f"rank-{r}.json").read_text()) for r in range(nproc)]
        if len({r["weight_probe"] for r in ranks}) != 1:
            raise SystemExit(f"extract: the ranks built different weights: {ranks}")
        index = json.loads((root / "features" / "train" / "index.json").read_text())
        tokens = sum(sh["n_tokens"] for sh in index["shards"])
        wall = max(r["wall_s"] for r in ranks)
        arms[name] = {"nproc": nproc, "tokens": tokens, "shards": len(index["shards"]),
                      "ranks_wall_s": [round(r["wall_s"], 2) for r in ranks], "tokens_per_s": round(tokens / wall, 1),
                      "weight_probe": ranks[0]["weight_probe"]}
    if arms["one"]["weight_probe"] != arms["many"]["weight_probe"]:
        raise SystemExit("extract: the two arms built different weights")
    cmp = compare_features(work / "one" / "features" / "train", work / "many" / "features" / "train")
    return {"bench": "extract-multi", "nproc": a.nproc, "dtype": a.dtype, "samples": a.samples,
            "target": "tiny" if a.tiny else "llama-8B-shaped random (H4096, L32, V128256)",
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (gloo)",
            "arms": arms, "features": cmp, "same_samples": True,
            "ratio": round(arms["many"]["tokens_per_s"] / arms["one"]["tokens_per_s"], 3)}


# --------------------------------------------------------------------------------------- train


def _train_rows(camp: Path) -> list[dict]:
    rows = [json.loads(x) for x in (camp / "drafter" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if r.get("split") == "train"]


def bench_train(a: argparse.Namespace, work: Path) -> dict[str, object]:
    from train_gpu import synthetic_train_config, write_synthetic_campaign

    base, tdir = write_synthetic_campaign(work / "data", a.shape, a.seqs, a.seq_len, a.vary_len)
    cuda = torch.cuda.is_available()
    arms_cfg = [("one-eager", 1, {"grad_accum": a.nproc, "cuda_graphs": False}),
                ("ddp", a.nproc, {"grad_accum": 1, "cuda_graphs": "auto"})]
    if cuda:
        arms_cfg.append(("one-graphs", 1, {"grad_accum": a.nproc, "cuda_graphs": "auto"}))
    arms: dict[str, dict[str, object]] = {}
    for name, nproc, over in arms_cfg:
        root = work / name
        root.mkdir()
        for sub in ("build", "features"):  # the same data, not a copy
            (root / sub).symlink_to(base / sub, target_is_directory=True)
        cfg = synthetic_train_config(root, tdir, ttt_steps=a.ttt, batch_tokens=a.batch_tokens, total_steps=a.steps,
                                     max_seq_len=a.seq_len, log_every=a.log_every, **over)
        Campaign.create_or_open(cfg)
        launch(nproc, ["-m", "specops", "train", str(root)], work / f"train-{name}.log", a.timeout)
        rows = _train_rows(root)
        steady = rows[1:] or rows
        arms[name] = {"nproc": nproc, **over, "steps": rows[-1]["step"], "tokens": rows[-1]["tokens"],
                      "tokens_per_s": round(sum(r["tokens_per_s"] for r in steady) / len(steady), 1),
                      "loss": [round(r["loss"], 6) for r in rows]}
    one, ddp = _train_rows(work / "one-eager"), _train_rows(work / "ddp")
    if [r["step"] for r in one] != [r["step"] for r in ddp] or [r["tokens"] for r in one] != [r["tokens"] for r in ddp]:
        raise SystemExit("train: the DDP run logged other steps or token counts than one process at the same batch")
    rel = [abs(d["loss"] - o["loss"]) / abs(o["loss"]) for o, d in zip(one, ddp)]
    tol = 2e-2 if cuda else 1e-4
    out = {"bench": "train-multi", "nproc": a.nproc, "shape": a.shape, "batch_tokens_per_rank": a.batch_tokens,
           "global_batch_tokens": a.batch_tokens * a.nproc, "steps": a.steps,
           "device": torch.cuda.get_device_name() if cuda else "cpu (gloo)", "arms": arms,
           "loss_max_rel_diff": max(rel), "loss_tolerance": tol, "loss_match": max(rel) <= tol,
           "ratio_vs_one_eager": round(arms["ddp"]["tokens_per_s"] / arms["one-eager"]["tokens_per_s"], 3)}
    if "one-graphs" in arms:
        out["ratio_vs_one_graphs"] = round(arms["ddp"]["tokens_per_s"] / arms["one-graphs"]["tokens_per_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/multi_gpu.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("extract")
    e.add_argument("--nproc", type=int, default=2)
    e.add_argument("--tiny", action="store_true")
    e.add_argument("--samples", type=int, default=160)
    e.add_argument("--min-len", type=int, default=512)
    e.add_argument("--max-len", type=int, default=4096)
    e.add_argument("--dtype", choices=["bfloat16", "fp8"], default="bfloat16")
    e.add_argument("--token-budget", type=int, default=32768)
    e.add_argument("--shard-tokens", type=int, default=65536)
    t = sub.add_parser("train")
    t.add_argument("--nproc", type=int, default=2)
    t.add_argument("--shape", choices=["tiny", "smollm2", "8b"], default="smollm2")
    t.add_argument("--seqs", type=int, default=256)
    t.add_argument("--seq-len", type=int, default=2048)
    t.add_argument("--vary-len", type=int, default=128)
    t.add_argument("--steps", type=int, default=80)
    t.add_argument("--batch-tokens", type=int, default=8192)
    t.add_argument("--ttt", type=int, default=7)
    t.add_argument("--log-every", type=int, default=4)
    for p in (e, t):
        p.add_argument("--out", type=Path)
        p.add_argument("--keep", type=Path, help="work here and keep it (default: a temporary dir, removed)")
        p.add_argument("--timeout", type=float, default=540.0, help="seconds per launched arm")
    w = sub.add_parser("_extract-worker")  # one rank of an extract arm (launched by `extract`)
    w.add_argument("--camp", required=True)
    w.add_argument("--tiny", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "_extract-worker":
        extract_worker(a)
        return 0
    if a.nproc < 2:
        ap.error("--nproc: at least 2")
    if torch.cuda.is_available() and torch.cuda.device_count() < a.nproc:
        ap.error(f"--nproc {a.nproc}: this machine has {torch.cuda.device_count()} GPU(s)")
    if a.keep:
        a.keep.mkdir(parents=True, exist_ok=False)
    work = a.keep or Path(tempfile.mkdtemp(prefix="specops-multi-"))
    try:
        res = bench_extract(a, work) if a.cmd == "extract" else bench_train(a, work)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
