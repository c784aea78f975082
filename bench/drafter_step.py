"""Benchmark the eval loop's drafter: ms per draft token, eager runner vs the static-cache runner
(vs the static runner with its chain replayed as a CUDA graph, on a GPU). Same drafts checked.

    python bench/drafter_step.py [--drafter EXPORT_DIR] [--k 7] [--rounds 200] [--prompt 300]
                                 [--dtype auto] [--out FILE]

--drafter: an exported drafter (vLLM format, e.g. a quality run's `drafter/export/vllm`); its
embed_tokens, when absent (engines share the target's), is random here: the timing does not
depend on it. Default: a random SmolLM2-shaped drafter (H 576, 9/3 heads of 64, draft vocab
32000, target vocab 49152). Each round drafts k tokens after m pending slots (m cycles 1..k+1,
as acceptance would give) with random aux states, from a prompt of --prompt positions; the
runners see the same inputs. Time per round / k = ms per draft token (host + device, synced).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from specops.drafter.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from specops.drafter.families.eagle3.drafting import EagerDrafterRunner, StaticDrafterRunner  # noqa: E402


def load(path: Path | None) -> Eagle3Drafter:
    if path is None:
        torch.manual_seed(0)
        cfg = DrafterConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                            head_dim=64, target_vocab_size=49152, draft_vocab_size=32000, aux_layer_ids=[2, 15, 27],
                            max_position_embeddings=8192, target_num_hidden_layers=30, target_hidden_size=576,
                            rope_theta=100000.0)
        return Eagle3Drafter(cfg)
    from specops.drafter.formats import load_exported
    from specops.drafter.formats import drafter_config_from_export

    sd, config = load_exported(path)
    d = Eagle3Drafter(drafter_config_from_export(config))
    sd = dict(sd)
    sd.setdefault("embed_tokens.weight", torch.randn(d.config.target_vocab_size, d.config.hidden_size) * 0.02)
    d.load_state_dict(sd, strict=False)
    return d


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def run(runner, d: Eagle3Drafter, *, k: int, rounds: int, prompt: int, seed: int = 0) -> tuple[float, list[list[int]]]:
    dev = d.d2t.device
    g = torch.Generator().manual_seed(seed)
    V, Ht = d.config.target_vocab_size, d.config.target_hidden_size
    dt = next(d.parameters()).dtype
    ids = torch.randint(0, V, (1, prompt + 1), generator=g)  # prefill: drafter slots 0..prompt-1
    runner.reset(prompt + rounds * (k + 1) + k + 1)
    runner.prefill(ids, torch.randn(1, prompt + 1, 3, Ht, generator=g).to(dev, dt))
    start, out, spent = prompt, [], 0.0
    for r in range(rounds):
        m = 1 + r % (k + 1)
        tok = torch.randint(0, V, (1, m), generator=g).to(dev)
        aux = torch.randn(1, m, 3, Ht, generator=g).to(dev, dt)
        sync(dev)
        t0 = time.perf_counter()
        drafts, _ = runner.draft(tok, aux, start, k, temperature=0.0, gen=None)
        sync(dev)
        if r >= 2 * (k + 1):  # warm-up rounds (and, with graphs, every pending length captured) excluded
            spent += time.perf_counter() - t0
        out.append(drafts.tolist())
        start += m
    timed = rounds - 2 * (k + 1)
    return spent / timed / k * 1e3, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", type=Path)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.rounds <= 2 * (a.k + 1):
        ap.error(f"--rounds must exceed 2*(k+1) = {2 * (a.k + 1)} warm-up rounds")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"auto": torch.bfloat16 if dev.type == "cuda" else torch.float32, "bfloat16": torch.bfloat16,
             "float32": torch.float32}[a.dtype]
    d = load(a.drafter).to(device=dev, dtype=dtype).eval().requires_grad_(False)
    runners = {"eager": EagerDrafterRunner(d), "static": StaticDrafterRunner(d, cuda_graphs=False)}
    if dev.type == "cuda":
        runners["static+graphs"] = StaticDrafterRunner(d)
    res: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "dtype": str(dtype),
                 "k": a.k, "rounds": a.rounds, "prompt": a.prompt, "drafter": str(a.drafter or "random SmolLM2-shaped"),
                 "threads": torch.get_num_threads(), "ms_per_draft_token": {}}
    drafts = {}
    for name, r in runners.items():
        ms, drafts[name] = run(r, d, k=a.k, rounds=a.rounds, prompt=a.prompt)
        res["ms_per_draft_token"][name] = round(ms, 4)
        print(f"{name:14s} {ms:8.3f} ms per draft token", flush=True)
    same = {name: drafts[name] == drafts["eager"] for name in runners}
    res["same_drafts_as_eager"] = same
    base = res["ms_per_draft_token"]["eager"]
    res["speedup_vs_eager"] = {n: round(base / v, 3) for n, v in res["ms_per_draft_token"].items()}
    if "static+graphs" in runners:
        res["graph_fallbacks"] = runners["static+graphs"].graph_fallbacks
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
