"""Benchmark `extract`: end-to-end feature extraction (forward + hooks + shard writes + digest +
index) vs a bare forward with `output_hidden_states=True` over the same batches, same run.

Target: a random-weight Llama built from a config on the device (8B-shaped by default: hidden 4096,
32 layers, 32 heads / 8 KV heads, intermediate 14336, vocab 128256), bf16. Data: synthetic build
split of `--samples` sequences with lengths uniform in [--min-len, --max-len]. Reports tokens/s of
both, the ratio, and bytes per token on disk for bf16 and fp8, and the padded share of the forwards:
extract's (batches planned over windows of `--batch-window` shards, extract.batch_window) beside the
bare forward's (one plan over every sample). Optional arms in the same run: `--tail-split N` (bf16
with smaller final shards, extract.tail_split) and `--writeback-ab` (bf16 once more with extract's
eager writeback flipped: extract.eager_writeback "off" where "auto" resolves to async or sync on
this machine, else "async"; `resolve_writeback` in specops/features.py).

    python bench/extract_gpu.py [--tiny] [--samples 160] [--batch-window N] [--tail-split N] [--writeback-ab]
                                [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from safetensors.torch import save_file  # noqa: E402

from specops.campaign import Campaign  # noqa: E402
from specops.config import ExtractSection, config_from_dict  # noqa: E402
from specops.extract import plan_batches, plan_shards, plan_window_batches, plan_windows, run_extract
from specops.target.inprocess import TargetModel, find_decoder


def target_config(tiny: bool):
    """The bench target's LlamaConfig: 8B-shaped, or a tiny one for CPUs."""
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096)
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)


def make_target(tiny: bool, device: torch.device, work: Path) -> TargetModel:
    from transformers import AutoModelForCausalLM

    cfg = target_config(tiny)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval().requires_grad_(False)
    mdir = work / "model"
    mdir.mkdir()
    cfg.save_pretrained(mdir)  # config only: the weights live on the device
    dec = find_decoder(model, cfg.num_hidden_layers)
    return TargetModel(model=model, decoder=dec, lm_head=model.get_output_embeddings(), config=cfg,
                       model_dir=mdir, device=device, dtype=dtype)


def write_build(camp: Path, lens: list[int], vocab: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    build = camp / "build"
    build.mkdir(parents=True)
    for split, ls in (("train", lens), ("val", lens[:2])):
        ids = torch.randint(0, vocab, (sum(ls),), generator=g, dtype=torch.int32)
        offsets = torch.tensor([0] + list(torch.tensor(ls).cumsum(0).tolist()), dtype=torch.int64)
        save_file({"input_ids": ids, "loss_mask": torch.ones(sum(ls), dtype=torch.uint8), "offsets": offsets},
                  str(build / f"{split}.safetensors"))
        with open(build / f"{split}.ids.jsonl", "w") as f:
            for i, L in enumerate(ls):
                f.write(json.dumps({"id": f"b/{i}", "dataset": "b", "n_tokens": L, "n_trainable": L}) + "\n")


def padding_waste(lens: list[int], batches: list[list[int]]) -> float:
    """The padded share of forwards that run `batches` (indices into lens, longest first) right-padded."""
    padded = sum(len(b) * lens[b[0]] for b in batches)
    return round(1 - sum(lens[i] for b in batches for i in b) / padded, 4) if padded else 0.0


def extract_batches(lens: list[int], budget: int, shard_tokens: int, batch_window: int) -> int:
    """How many forwards extract runs over `lens` (one rank): its shard plan cut into windows."""
    offs = [0] + torch.tensor(lens).cumsum(0).tolist()
    wins = plan_windows(plan_shards(offs, shard_tokens, 1), batch_window)
    return sum(len(plan_window_batches(w, offs, budget)) for w in wins)


def bare_forward(target: TargetModel, lens: list[int], budget: int, vocab: int) -> float:
    """The usual hand-written extraction loop's compute: HF forward with all hidden states."""
    g = torch.Generator().manual_seed(1)
    batches = plan_batches(lens, budget)
    dev = target.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        warm = torch.randint(0, vocab, (1, 256), generator=g).to(dev)
        target.model(warm, output_hidden_states=True)
        sync()
        t0 = time.perf_counter()
        tokens = 0
        for b in batches:
            T = max(lens[i] for i in b)
            ids = torch.randint(0, vocab, (len(b), T), generator=g).to(dev, non_blocking=True)
            out = target.model.model(ids, output_hidden_states=True)
            hs = out.hidden_states
            assert len(hs) == target.num_hidden_layers + 1
            tokens += sum(lens[i] for i in b)
        sync()
    return tokens / (time.perf_counter() - t0)


def specops_extract(target: TargetModel, work: Path, lens: list[int], budget: int, dtype: str,
                    shard_tokens: int, tail_split: int = 1, tag: str = "", batch_window: int = 1,
                    writeback: str = "auto") -> dict:
    camp_dir = work / f"camp-{dtype}-{tail_split}{tag}"
    vocab = target.vocab_size
    write_build(camp_dir, lens, vocab)
    cfg = config_from_dict({
        "campaign": {"name": "bench", "dir": str(camp_dir)},
        "target": {"model": str(target.model_dir)},
        "extract": {"dtype": dtype, "token_budget": budget, "shard_tokens": shard_tokens, "tail_split": tail_split,
                    "batch_window": batch_window, "eager_writeback": writeback},
        "datasets": [{"name": "b", "path": str(work / "dummy.jsonl")}],
    })
    camp = Campaign.create_or_open(cfg)
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    summary = run_extract(cfg, camp, split="train", target=target)
    sync()
    dt = time.perf_counter() - t0
    tr = summary["splits"]["train"] if "splits" in summary else summary["train"]
    # Where the time beyond the forward goes: each shard's sidecar has its compute+write seconds and
    # its finalize (fsync + digest read-back); the last shard's finalize is a tail nothing overlaps.
    sides = sorted((json.loads(f.read_text()) for f in (camp_dir / "features" / "train").glob("*.done")),
                   key=lambda d: d["g"])
    out = {"tokens_per_s": sum(lens) / dt, "seconds": dt, "bytes_per_token": tr.get("bytes_per_token"),
           "bytes": tr.get("bytes"), "padding_waste": tr.get("padding_waste"),
           "shard_seconds": [d["seconds"] for d in sides], "finalize_seconds": [d["finalize_seconds"] for d in sides],
           # summed over shards: the main thread's waits for the writer, the writer's copy waits,
           # pwrites and writeback hints, the finalizer's fsyncs and read-back hashes
           "timings": {k: round(sum(d.get("timings", {}).get(k, 0.0) for d in sides), 3)
                       for k in ("main_wait", "copy_wait", "pwrite", "writeback", "fsync", "hash")}}
    shutil.rmtree(camp_dir)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    ap.add_argument("--samples", type=int, default=160)
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--token-budget", type=int, default=32768)
    ap.add_argument("--shard-tokens", type=int, default=1 << 16, help="default: extract.shard_tokens's")
    ap.add_argument("--batch-window", type=int, default=ExtractSection().batch_window,
                    help="extract.batch_window: shards whose samples are batched together (default: the config's)")
    ap.add_argument("--tail-split", type=int, default=1,
                    help="> 1: also bf16 with extract.tail_split = N (smaller final shards), same run")
    ap.add_argument("--writeback-ab", action="store_true",
                    help="also bf16 with extract's eager writeback flipped (the default's opposite: off, or "
                         "async where the default is off), same run")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(tempfile.mkdtemp(prefix="specops-extract-bench-"))
    (work / "dummy.jsonl").write_text('{"prompt": "x"}\n')
    try:
        target = make_target(a.tiny, dev, work)
        g = torch.Generator().manual_seed(0)
        lens = torch.randint(a.min_len, a.max_len + 1, (a.samples,), generator=g).tolist()
        base = bare_forward(target, lens, a.token_budget, target.vocab_size)
        bw = a.batch_window
        bf16 = specops_extract(target, work, lens, a.token_budget, "bfloat16", a.shard_tokens, batch_window=bw)
        fp8 = specops_extract(target, work, lens, a.token_budget, "float8_e4m3fn", a.shard_tokens, batch_window=bw)
        tail = (specops_extract(target, work, lens, a.token_budget, "bfloat16", a.shard_tokens, a.tail_split,
                                batch_window=bw) if a.tail_split > 1 else None)  # fmt: skip
        from specops.features import resolve_writeback

        default = resolve_writeback("auto")  # what the runs above used
        flipped = None
        if a.writeback_ab:  # the default writeback mode vs its opposite (off, or async where it is off)
            flipped = specops_extract(target, work, lens, a.token_budget, "bfloat16", a.shard_tokens, tag="-wb",
                                      batch_window=bw, writeback="async" if default == "off" else "off")
        res = {
            "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "model": "tiny" if a.tiny else "llama-8B-shaped random (H4096, L32, V128256)",
            "samples": a.samples, "tokens": sum(lens), "token_budget": a.token_budget,
            "bare_forward_tok_s": round(base, 1),
            "specops_bf16_tok_s": round(bf16["tokens_per_s"], 1),
            "ratio_bf16": round(bf16["tokens_per_s"] / base, 3),
            "specops_fp8_tok_s": round(fp8["tokens_per_s"], 1),
            "ratio_fp8": round(fp8["tokens_per_s"] / base, 3),
            "bytes_per_token_bf16": bf16["bytes_per_token"], "bytes_per_token_fp8": fp8["bytes_per_token"],
            "batch_window": bw, "shard_tokens": a.shard_tokens,
            # padded share of the forwards: extract's window plans vs the bare forward's one global plan
            "padding_waste": bf16["padding_waste"],
            "padding_waste_bare_forward": padding_waste(lens, plan_batches(lens, a.token_budget)),
            "forward_batches": {"extract": extract_batches(lens, a.token_budget, a.shard_tokens, bw),
                                "bare_forward": len(plan_batches(lens, a.token_budget))},
            "seconds": {"bare": round(sum(lens) / base, 3), "bf16": round(bf16["seconds"], 3),
                        "fp8": round(fp8["seconds"], 3)},
            "shards": {k: {"shard_seconds": r["shard_seconds"], "finalize_seconds": r["finalize_seconds"],
                           "timings": r["timings"]}
                       for k, r in (("bf16", bf16), ("fp8", fp8), ("bf16_tail", tail)) if r is not None},
        }
        if flipped is not None:
            res.update({"eager_writeback_default": default, "eager_writeback_flipped": "async" if default == "off" else "off",
                        "specops_bf16_writeback_flipped_tok_s": round(flipped["tokens_per_s"], 1),
                        "ratio_bf16_writeback_flipped": round(flipped["tokens_per_s"] / base, 3),
                        "seconds_bf16_writeback_flipped": round(flipped["seconds"], 3)})
            res["shards"]["bf16_writeback_flipped"] = {"shard_seconds": flipped["shard_seconds"],
                                                       "finalize_seconds": flipped["finalize_seconds"],
                                                       "timings": flipped["timings"]}
        res.setdefault("eager_writeback_default", default)
        if tail is not None:
            res.update({"tail_split": a.tail_split, "specops_bf16_tail_tok_s": round(tail["tokens_per_s"], 1),
                        "ratio_bf16_tail": round(tail["tokens_per_s"] / base, 3),
                        "seconds_bf16_tail": round(tail["seconds"], 3)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
