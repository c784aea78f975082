"""Benchmark `local-engine`: specops' local engine vs HF `generate`, same model, same run.

Model: a random-weight model with SmolLM2-135M's exact shape (30 layers, hidden 576, 9/3 heads,
vocab 49152) in bf16, or the real SmolLM2 with --model DIR. Every request generates exactly
--new-tokens (eos disabled) so both sides do the same work. HF generate runs at --hf-batch (its
usual large-batch setting); the engine runs at each --batch. Reports tokens/s and the ratio.

    python bench/local_engine_gpu.py --tokenizer DIR [--model DIR] [--batch 64 256] [--hf-batch 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from specops.generate.local import LocalEngine  # noqa: E402
from specops.generate.types import ChatRequest, SamplingParams  # noqa: E402

PROMPTS = ["Hi.", "What is the capital of France?", "Write a short poem about the sea at night.",
           "List three colors.", "Explain why the sky is blue, mentioning Rayleigh scattering.", "2+2?"]


def make_model(tok_dir: Path, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                      rms_norm_eps=1e-5, rope_theta=100000.0)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        m.lm_head.weight[2].fill_(-1.0)  # discourage eos; exact lengths are forced below anyway
    m.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def requests(n: int, new: int) -> list[ChatRequest]:
    return [ChatRequest(f"b/{i}", [{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + f" #{i}"}],
                        SamplingParams(max_tokens=new)) for i in range(n)]


async def engine_run(model_dir: Path, batch: int, n: int, new: int, max_len: int) -> tuple[float, int]:
    eng = LocalEngine(model_dir, batch_size=batch, max_model_len=max_len, dtype="bfloat16")
    await eng.start()
    eng.eos_ids = set()  # fixed-length generation: same work as HF with min_new_tokens
    await asyncio.gather(*[eng.complete(r) for r in requests(batch, 16)])  # warm-up: graph capture
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[eng.complete(r) for r in requests(n, new)])
    dt = time.perf_counter() - t0
    await eng.close()
    return sum(o.completion_tokens for o in outs) / dt, sum(o.completion_tokens for o in outs)


def hf_run(model_dir: Path, batch: int, new: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    if tok.pad_token is None:  # the converted SmolLM2 has none: pad with id 2 (what generate is told below)
        tok.pad_token = tok.convert_ids_to_tokens(2)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda().eval()
    texts = [tok.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False)
             for r in requests(batch, new)]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to("cuda")
    model.generate(**enc, do_sample=False, max_new_tokens=8, pad_token_id=2)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(**enc, do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=2)
    torch.cuda.synchronize()
    return batch * new / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--requests-per-slot", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model_dir = a.model or make_model(a.tokenizer, Path(tempfile.mkdtemp()) / "smollm2-shape")
    res: dict = {"device": torch.cuda.get_device_name(), "model": str(a.model or "random SmolLM2-shape bf16"),
                 "new_tokens": a.new_tokens}
    hf = hf_run(model_dir, a.hf_batch, a.new_tokens)
    res[f"hf_generate_batch{a.hf_batch}_tok_s"] = round(hf, 1)
    for b in a.batch:
        tps, n = engine_run_sync(model_dir, b, b * a.requests_per_slot, a.new_tokens)
        res[f"engine_batch{b}_tok_s"] = round(tps, 1)
        res[f"ratio_batch{b}_vs_hf{a.hf_batch}"] = round(tps / hf, 1)
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")


def engine_run_sync(model_dir: Path, batch: int, n: int, new: int) -> tuple[float, int]:
    return asyncio.run(engine_run(model_dir, batch, n, new, max_len=512))


if __name__ == "__main__":
    main()
