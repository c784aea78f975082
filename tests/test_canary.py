"""The canary stops a campaign before the full run when its first records show a problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specops.config import config_from_dict
from specops.generate import run_generate
from specops.generate.canary import CanaryFailed, check_records
from specops.testing.fake_server import start_fake_server


def cfg_for(tmp_path: Path, url: str, *, max_tokens: int = 64, reasoning: str = "save", model: str = "fake-model"):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"hi {i}"}) + "\n" for i in range(20)))
    return config_from_dict({
        "campaign": {"name": "c", "dir": str(tmp_path / "camp")},
        "target": {"served_name": model},
        "engine": {"kind": "openai", "endpoints": [url], "max_attempts": 1},
        "generate": {"max_tokens": max_tokens, "reasoning": reasoning, "canary_samples": 3},
        "datasets": [{"name": "ds", "path": str(prompts)}],
    })


def records_of(tmp_path: Path) -> Path:
    return tmp_path / "camp" / "generate" / "ds" / "records.jsonl"


def test_canary_passes_then_full_run(tmp_path):
    with start_fake_server(tmp_path / "srv", model="fake-model") as srv:
        s = run_generate(cfg_for(tmp_path, srv.url), progress=False)
        reqs = [r for r in srv.requests() if r["sample"] != "specops-health-probe"]
    assert s.datasets["ds"]["done"] == 20
    assert len(reqs) == 23  # 3 canary + 20
    manifest = json.loads((tmp_path / "camp" / "manifest.json").read_text())
    assert [e for e in manifest["events"] if e["kind"] == "canary"][0]["ok"] is True


@pytest.mark.parametrize(
    "kwargs, server, needle",
    [
        ({}, {"reasoning_field": "none"}, "reasoning mode is 'save' but none of 3 samples carried reasoning"),
        ({"max_tokens": 4}, {}, "all 3 samples hit max_tokens=4"),
    ],
)
def test_canary_stops_before_the_full_run(tmp_path, kwargs, server, needle):
    with start_fake_server(tmp_path / "srv", model="fake-model", **server) as srv:
        with pytest.raises(CanaryFailed) as e:
            run_generate(cfg_for(tmp_path, srv.url, **kwargs), progress=False)
        assert len([r for r in srv.requests() if r["sample"] != "specops-health-probe"]) == 3  # canary only
    assert needle in str(e.value)
    assert not records_of(tmp_path).exists() or not records_of(tmp_path).read_text()
    manifest = json.loads((tmp_path / "camp" / "manifest.json").read_text())
    assert manifest["phases"]["generate"]["state"] == "failed"


def test_reasoning_off_needs_no_reasoning(tmp_path):
    with start_fake_server(tmp_path / "srv", model="fake-model", reasoning_field="none") as srv:
        s = run_generate(cfg_for(tmp_path, srv.url, reasoning="off"), progress=False)
    assert s.datasets["ds"]["done"] == 20


def test_check_records_flags_stray_think_and_empty_content():
    recs = [
        {"id": "a", "content": "<think>hmm</think> answer", "reasoning": None, "finish_reason": "stop", "model": "m"},
        {"id": "b", "content": "", "reasoning": "r", "finish_reason": "stop", "model": "m"},
        {"id": "c", "content": "fine", "reasoning": "r", "finish_reason": "stop", "model": "other"},
    ]
    probs = check_records("ds", recs, [], reasoning_mode="save", expected_model="m", max_tokens=10)
    text = " | ".join(probs)
    assert "think markers left in content (a)" in text
    assert "1/3 samples came back with empty content (b)" in text
    assert "responses came from model ['other'], expected 'm'" in text
    assert check_records("ds", recs[2:], [], reasoning_mode="save", expected_model="other", max_tokens=10) == []


def test_wrong_model_is_refused_before_any_sample(tmp_path):
    from specops.checks.server import ServerUnhealthy

    with start_fake_server(tmp_path / "srv", model="qwen3-8b") as srv:
        with pytest.raises(ServerUnhealthy) as e:
            run_generate(cfg_for(tmp_path, srv.url, model="kimi-k2"), progress=False)
        assert all(r["sample"] == "specops-health-probe" for r in srv.requests())
    assert "kimi-k2" in str(e.value) and "qwen3-8b" in str(e.value)


def test_all_cut_samples_that_loop_are_called_a_degenerate_decode():
    """Every canary sample at max_tokens: if every one loops (token ids, else words), the finding
    says so and points at the template and sampling; long honest answers keep the max_tokens advice."""
    from specops.generate.canary import loop_share

    loop_ids = [5, 6, 7] + [11, 12, 13, 14, 15, 16, 17, 18] * 8
    looping = [{"id": f"l{i}", "content": "x", "reasoning": None, "finish_reason": "length", "model": "m",
                "turns": [{"index": 1, "token_ids": loop_ids}]} for i in range(2)]
    words = [{"id": "w", "content": "the cat sat on the mat and " * 20, "reasoning": None,
              "finish_reason": "length", "model": "m"}]
    honest = [{"id": f"h{i}", "content": " ".join(f"w{i}x{j}" for j in range(80)), "reasoning": None,
               "finish_reason": "length", "model": "m"} for i in range(2)]
    assert loop_share(looping[0]) > 0.5 and loop_share(words[0]) > 0.8 and loop_share(honest[0]) == 0.0
    for recs, loops in ((looping, True), (looping + words, True), (honest, False), (looping[:1] + honest, False)):
        (p,) = check_records("ds", recs, [], reasoning_mode="off", expected_model="m", max_tokens=64)
        assert p.startswith(f"ds: all {len(recs)} samples hit max_tokens=64")
        assert ("every one loops" in p and "repetition penalty" in p) == loops
        assert ("raise max_tokens (or set generate.expect_truncation" in p) == (not loops)
    assert check_records("ds", looping, [], reasoning_mode="off", expected_model="m", max_tokens=64,
                         expect_truncation=True) == []
