"""preflight: forecast arithmetic, disk/memory/model/port checks, exit codes, the report."""

from __future__ import annotations

import io
import json
import shutil
import socket
from pathlib import Path

import pytest

from specops.campaign import Campaign
from specops.checks.forecast import (
    CHECKPOINT_BYTES_PER_PARAM,
    DEFAULT_PROMPT_TOKENS,
    RECORD_OVERHEAD_BYTES,
    build_bytes,
    checkpoint_bytes,
    drafter_params,
    feature_bytes,
    forecast_campaign,
    records_bytes,
)
from specops.checks.gpu import NvmlSource, RecordedSource
from specops.checks.host import check_disk, check_memory, check_model, check_ports, inspect_safetensors
from specops.config import config_from_dict
from specops.preflight import PreflightReport, record_skip, run_preflight

FIXTURES = Path(__file__).parent / "fixtures" / "gpus"
GB = 10**9
MEMINFO_OK = "MemTotal: 263000000 kB\nMemAvailable: 250000000 kB\nSwapTotal: 0 kB\nSwapFree: 0 kB\n"


# ---------------------------------------------------------------- helpers


def make_model(d: Path, *, hidden=64, layers=4, vocab=256, nested=False) -> Path:
    from safetensors.torch import save_file
    import torch

    d.mkdir(parents=True, exist_ok=True)
    text = {"hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": vocab, "intermediate_size": 4 * hidden,
            "model_type": "llama"}
    if nested:
        config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                  "text_config": text, "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27}}
    else:
        config = {"architectures": ["LlamaForCausalLM"], **text}
    (d / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(vocab, hidden, dtype=torch.bfloat16)},
              str(d / "model.safetensors"))
    (d / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    return d


def make_cfg(tmp: Path, model: Path, *, samples=100, max_tokens=1024):
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(samples)))
    return config_from_dict({
        "campaign": {"dir": str(tmp / "camp")},
        "target": {"model": str(model)},
        "generate": {"max_tokens": max_tokens},
        "datasets": [{"name": "qa", "path": str(prompts)}],
    })


def fake_disk(free: int):
    return lambda path: shutil._ntuple_diskusage(10 * free + 1, 9 * free, free)


@pytest.fixture
def meminfo(tmp_path) -> Path:
    p = tmp_path / "meminfo"
    p.write_text(MEMINFO_OK)
    return p


def by_name(results):
    return {r.name: r for r in results}


IDLE = RecordedSource(FIXTURES / "h200x8_idle.json")


# ---------------------------------------------------------------- forecast arithmetic


def test_feature_forecast_matches_the_known_figures():
    tokens = 10_000 * 2_888  # 10K samples × ~2.9K tokens
    # bf16, 3 aux + final, + 5 bytes of ids/mask: 28.88e6 × (4 × 7168 × 2 + 5) = 1.656e12
    assert feature_bytes(tokens, 7168) == 28_880_000 * (4 * 7168 * 2 + 5) == 1_656_239_120_000
    # fp8 + one fp32 scale per vector: 28.88e6 × (4 × (7168 + 4) + 5) ≈ 828.7e9, the quoted ~828 GB
    fp8 = feature_bytes(tokens, 7168, dtype="fp8")
    assert fp8 == 828_653_840_000
    assert abs(fp8 - 828 * GB) / (828 * GB) < 0.10
    # speculators' published ~1.6 TB: 50K Llama-3.1-8B samples, ~1024 tokens, bf16
    assert abs(feature_bytes(50_000 * 1024, 4096) - 1.6e12) / 1.6e12 < 0.10
    assert feature_bytes(1000, 4096, n_aux=2) == 1000 * (3 * 4096 * 2 + 5)


def test_records_build_and_checkpoint_arithmetic():
    # prompt × (4.5 text + 6 ids) + completion × (2 × 4.5 text + 6 ids) + overhead, per record
    assert records_bytes(10, 100, 300) == 10 * (100 * 10.5 + 300 * 15 + RECORD_OVERHEAD_BYTES)
    assert records_bytes(10, 100, 300, token_ids=False) == 10 * (100 * 4.5 + 300 * 9 + RECORD_OVERHEAD_BYTES)
    assert build_bytes(1000) == 5000 and build_bytes(1000, 2) == 5000 + 2 * 136
    h, i, v = 4096, 14336, 32000
    p = drafter_params(h, i, v)
    assert p == 3 * h * h + (2 * h * h + 2 * 2 * h * h + h * h) + 3 * h * i + 4 * h + h * v
    assert checkpoint_bytes(p, kept=2) == p * (2 * CHECKPOINT_BYTES_PER_PARAM + 2)


def test_forecast_campaign_uses_config_counts_and_model(tmp_path):
    model = make_model(tmp_path / "m", hidden=7168, nested=True)
    cfg = make_cfg(tmp_path, model, samples=40, max_tokens=2000)
    f = forecast_campaign(cfg)
    tokens = 40 * 2048  # 512 prompt + 2000 completion, cut at build.max_length = 2048
    assert f["generate"] == records_bytes(40, DEFAULT_PROMPT_TOKENS, 2000)
    assert f["build"] == build_bytes(tokens, 40)
    assert f["extract"] == feature_bytes(tokens, 7168)
    assert f["train"] == checkpoint_bytes(drafter_params(7168, 4 * 7168, 256))  # draft vocab capped by 256
    cfg.extract.dtype = "float8_e4m3fn"
    assert forecast_campaign(cfg)["extract"] == feature_bytes(tokens, 7168, dtype="fp8")
    cfg.extract.aux_layer_ids = [1, 2]
    assert forecast_campaign(cfg)["extract"] == feature_bytes(tokens, 7168, n_aux=2, dtype="fp8")
    cfg.extract.mode = "online"
    assert forecast_campaign(cfg)["extract"] == 0
    cfg.datasets[0].limit = 10  # the limit wins over the file's count
    assert forecast_campaign(cfg, phases=["generate"]) == {"generate": records_bytes(10, DEFAULT_PROMPT_TOKENS, 2000)}


# ---------------------------------------------------------------- disk


def test_disk_nogo_when_forecast_exceeds_free(tmp_path, meminfo):
    cfg = make_cfg(tmp_path, make_model(tmp_path / "m"), samples=1000)
    rep = run_preflight(cfg, phases=["generate"], gpu_source=IDLE, disk_usage=fake_disk(1_000_000), meminfo=meminfo)
    r = by_name(rep.results)["disk.generate"]
    assert r.status == "nogo" and "does not fit" in r.message and str(tmp_path) in r.message
    assert rep.exit_code == 2


def test_exit_codes_go_warn_nogo(tmp_path, meminfo):
    cfg = make_cfg(tmp_path, make_model(tmp_path / "m"), samples=100)
    need = forecast_campaign(cfg, phases=["generate", "build"])
    total = sum(need.values())
    run = lambda free: run_preflight(cfg, phases=["generate", "build"], gpu_source=IDLE,  # noqa: E731
                                     disk_usage=fake_disk(free), meminfo=meminfo)
    go, warn, nogo = run(100 * total), run(int(total / 0.9)), run(total - 1)
    assert (go.exit_code, warn.exit_code, nogo.exit_code) == (0, 1, 2), [
        [(r.name, r.status) for r in rep.results if r.status in ("warn", "nogo")] for rep in (go, warn, nogo)]
    assert by_name(warn.results)["disk.generate+build"].status == "warn"
    assert (go.status, warn.status, nogo.status) == ("go", "warn", "nogo")


def test_outputs_on_one_filesystem_share_its_free_space(tmp_path):
    free = 100 * GB
    outs = [("generate", tmp_path / "a" / "generate", 60 * GB), ("extract", tmp_path / "a" / "extract", 60 * GB)]
    (r,) = check_disk(outs, disk_usage=fake_disk(free))  # each fits alone, not together
    assert r.status == "nogo" and r.data["forecast"] == 120 * GB and r.data["path"] == str(tmp_path)
    (r,) = check_disk(outs[:1], disk_usage=fake_disk(free))
    assert r.status == "go"


# ---------------------------------------------------------------- memory


def test_memory_low_and_swapping_warn(tmp_path):
    p = tmp_path / "meminfo"
    p.write_text("MemTotal: 64000000 kB\nMemAvailable: 1000000 kB\nSwapTotal: 8000000 kB\nSwapFree: 1000000 kB\n")
    res = by_name(check_memory(p))
    assert res["memory"].status == "warn" and "low" in res["memory"].message
    assert res["swap"].status == "warn" and res["swap"].data["mem_available"] == 1_000_000 * 1024
    p.write_text(MEMINFO_OK)
    assert [r.status for r in check_memory(p)] == ["go", "info"]


# ---------------------------------------------------------------- model files


def test_nested_text_config_reports_the_language_model_shape(tmp_path, meminfo):
    model = make_model(tmp_path / "vlm", hidden=96, layers=6, vocab=300, nested=True)
    results, config = check_model(model)
    res = by_name(results)
    assert res["model.config"].status == "go"
    data = res["model.config"].data
    assert data["hidden_size"] == 96 and data["text_config_key"] == "text_config"
    assert "hidden_size 96, 6 layers, vocab 300 (from text_config)" in res["model.config"].message
    assert res["model.weights"].status == "go" and res["model.tokenizer"].status == "go"
    # The nested hidden size (not the vision tower's) drives the feature forecast.
    cfg = make_cfg(tmp_path, model, samples=10)
    rep = run_preflight(cfg, phases=["extract"], gpu_source=IDLE, disk_usage=fake_disk(10**15), meminfo=meminfo)
    f = by_name(rep.results)["forecast"]
    assert f.data["inputs"]["hidden_size"] == 96
    assert f.data["bytes"]["extract"] == feature_bytes(10 * (DEFAULT_PROMPT_TOKENS + 1024), 96)
    assert rep.exit_code == 0


def test_corrupt_config_is_nogo_naming_the_file(tmp_path, meminfo):
    model = make_model(tmp_path / "m")
    (model / "config.json").write_text('{"hidden_size": 64,')
    cfg = make_cfg(tmp_path, model)
    rep = run_preflight(cfg, phases=["generate"], gpu_source=IDLE, disk_usage=fake_disk(10**15), meminfo=meminfo)
    r = by_name(rep.results)["model.config"]
    assert r.status == "nogo" and str(model / "config.json") in r.message and "not valid JSON" in r.message
    assert rep.exit_code == 2
    (model / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 2}}))
    r = by_name(check_model(model)[0])["model.config"]
    assert r.status == "nogo" and "hidden_size" in r.message


def test_weight_files_truncated_missing_or_absent(tmp_path):
    model = make_model(tmp_path / "m")
    st = model / "model.safetensors"
    assert inspect_safetensors(st) is None
    st.write_bytes(st.read_bytes()[:-10])  # a download cut short
    r = by_name(check_model(model)[0])["model.weights"]
    assert r.status == "nogo" and "truncated" in r.message and str(st) in r.message
    st.write_bytes(b"\xff" * 64)
    assert "header length" in inspect_safetensors(st)
    st.unlink()
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    r = by_name(check_model(model)[0])["model.weights"]
    assert r.status == "nogo" and "model-00001-of-00002.safetensors" in r.message and "missing" in r.message
    (model / "model.safetensors.index.json").unlink()
    r = by_name(check_model(model)[0])["model.weights"]
    assert r.status == "nogo" and "no *.safetensors" in r.message


def test_missing_tokenizer(tmp_path):
    model = make_model(tmp_path / "m")
    (model / "tokenizer.json").unlink()
    assert by_name(check_model(model)[0])["model.tokenizer"].status == "nogo"
    assert by_name(check_model(model, need_tokenizer=False)[0])["model.tokenizer"].status == "warn"


# ---------------------------------------------------------------- ports


def test_port_in_use_is_nogo_naming_the_port(meminfo):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rep = run_preflight(None, phases=[], gpu_source=IDLE, ports=[port], meminfo=meminfo)
        r = by_name(rep.results)[f"port.{port}"]
        assert r.status == "nogo" and f"port {port}" in r.message and "in use" in r.message
        assert rep.exit_code == 2
    (r,) = check_ports([port])
    assert r.status == "go"


# ---------------------------------------------------------------- GPUs inside preflight


def _driver_present() -> bool:
    from specops.checks.gpu import GpuUnavailable

    try:
        NvmlSource().describe()
    except GpuUnavailable:
        return False
    return True


@pytest.mark.skipif(_driver_present(), reason="this host has an NVIDIA driver")
def test_no_driver_is_info_and_the_rest_still_runs(tmp_path, meminfo):
    cfg = make_cfg(tmp_path, make_model(tmp_path / "m"))
    rep = run_preflight(cfg, phases=["generate"], gpu_source=NvmlSource(), disk_usage=fake_disk(10**15),
                        meminfo=meminfo)
    res = by_name(rep.results)
    assert res["gpus"].status == "info" and res["gpus"].message.startswith("no NVIDIA driver (NVML: ")
    assert {"model.config", "model.weights", "forecast", "disk.generate", "memory"} <= set(res)
    assert rep.exit_code == 0
    rep = run_preflight(cfg, phases=["generate", "extract"], need_gpus=1, disk_usage=fake_disk(10**15),
                        meminfo=meminfo)  # default source: NVML on this machine
    res = by_name(rep.results)
    assert res["gpus"].status == "nogo" and rep.exit_code == 2
    assert res["disk.generate+extract"].status == "go"


def test_busy_gpu_in_plan_fails_preflight(meminfo):
    src = RecordedSource(FIXTURES / "h200x8_gpu3_busy.json")
    assert run_preflight(None, phases=[], gpu_source=src, need_gpus=8, meminfo=meminfo, env={}).exit_code == 2
    assert run_preflight(None, phases=[], gpu_source=src, need_gpus=1, meminfo=meminfo, env={}).exit_code == 0


# ---------------------------------------------------------------- report, skip


def test_report_json_and_render(tmp_path, meminfo):
    cfg = make_cfg(tmp_path, make_model(tmp_path / "m"))
    rep = run_preflight(cfg, phases=["generate", "extract", "train"], need_gpus=8,
                        gpu_source=RecordedSource(FIXTURES / "h200x8_gpu5_ecc.json"),
                        disk_usage=fake_disk(10**15), meminfo=meminfo, env={})
    doc = json.loads(json.dumps(rep.to_json()))
    assert doc["status"] == "nogo" and doc["exit_code"] == 2
    assert doc["phases"] == ["generate", "extract", "train"]
    assert {r["name"] for r in doc["results"]} >= {"gpus", "gpu5", "forecast", "memory", "model.config"}
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=200).print(rep.render())
    text = buf.getvalue()
    assert "NO-GO" in text and "uncorrected ECC" in text
    assert text.index("gpu5") < text.index("gpu0")  # worst first


def test_a_crashing_check_is_a_nogo_not_a_crash(meminfo):
    def boom(path):
        raise RuntimeError("disk probe exploded")

    rep = run_preflight(None, phases=[], campaign_dir=Path("/"), gpu_source=IDLE, disk_usage=boom, meminfo=meminfo)
    r = by_name(rep.results)["disk"]
    assert r.status == "nogo" and "RuntimeError: disk probe exploded" in r.message
    assert "memory" in by_name(rep.results)


def test_unknown_phase_is_rejected():
    with pytest.raises(ValueError, match="unknown phase 'bake'"):
        run_preflight(None, phases=["bake"], gpu_source=IDLE)


def test_record_skip_appends_a_manifest_event(tmp_path):
    cfg = make_cfg(tmp_path, make_model(tmp_path / "m"))
    camp = Campaign.create_or_open(cfg)
    record_skip(camp, "operator override: GPUs checked by hand", phases=["generate"])
    ev = camp.read_manifest()["events"][-1]
    assert ev["kind"] == "preflight_skipped" and ev["reason"] == "operator override: GPUs checked by hand"
    assert ev["phases"] == ["generate"] and ev["at"]


def test_empty_report_is_go():
    assert PreflightReport([], []).exit_code == 0
