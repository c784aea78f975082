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


def test_a_dataset_whose_every_record_is_quarantined_stops_before_any_request(tmp_path):
    """`specops generate` on two datasets, one whose every record is quarantined while it is read:
    one line naming the dataset, the count and the first reason, before the engine is probed or a
    request sent; nothing generated for the good dataset either; the phase is marked failed."""
    import subprocess
    import sys

    from specops.config import dump_toml

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"id": "x", "prompt": "caf\xe9"}\n["a list, not a record"]\n{"id": "y", "prompt": \n')
    with start_fake_server(tmp_path / "srv", model="fake-model") as srv:
        cfg = cfg_for(tmp_path, srv.url)
        toml = tmp_path / "c.toml"
        toml.write_text(dump_toml(cfg.to_dict()).replace(
            "[[datasets]]", f'[[datasets]]\nname = "bad"\npath = "{bad}"\n\n[[datasets]]', 1))
        out = subprocess.run([sys.executable, "-m", "specops", "generate", str(toml), "--no-progress"],
                             capture_output=True, text=True, timeout=120)
        assert srv.requests() == []  # not even the health probe
    line = (f"InputError: dataset 'bad': all 3 of its records were quarantined while reading {bad} (first, line 1: "
            "not valid UTF-8 (byte 0xe9 at offset 26 of the line)); nothing to generate, no request sent. Fix the "
            "input, or leave the dataset out of the campaign")
    assert out.returncode == 2 and out.stderr.splitlines()[-1] == line, out.stderr[-2000:]
    assert out.stdout == "" and "Traceback" not in out.stderr
    gen = json.loads((tmp_path / "camp" / "manifest.json").read_text())["phases"]["generate"]
    assert gen["state"] == "failed" and gen["error"] == line
    assert not records_of(tmp_path).exists()


def test_the_canary_says_its_records_were_quarantined_not_that_requests_failed(tmp_path):
    """The canary itself (run_canary, the path that reported "every canary request failed (first
    error: no sample produced)" for a dataset it could not read a sample from): no request sent,
    the count and the first quarantine reason."""
    import asyncio

    from specops.campaign import Campaign
    from specops.generate.canary import run_canary
    from specops.generate.runner import build_engine

    with start_fake_server(tmp_path / "srv", model="fake-model") as srv:
        cfg = cfg_for(tmp_path, srv.url)
        one = tmp_path / "one.jsonl"
        one.write_text('{"id": "q0", "messages": [{"role": "assistant", "content": "no user turn"}]}\n')
        cfg.datasets[0].path = str(one)
        engine = build_engine(cfg)

        async def canary():
            await engine.start()
            try:
                return await run_canary(cfg, Campaign.create_or_open(cfg), engine)
            finally:
                await engine.close()

        report = asyncio.run(canary())
        assert srv.requests() == []
    (problem,) = report.problems
    reason = json.loads((tmp_path / "camp" / "canary" / "generate" / "ds" / "quarantine.jsonl").read_text())["reason"]
    assert problem == f"ds: no canary request was sent: the one record it read was quarantined (first, line 1: {reason})"
    assert report.datasets["ds"]["quarantined"] == 1 and report.datasets["ds"]["records"] == 0
    probs = check_records("ds", [], [], reasoning_mode="off", expected_model=None, max_tokens=8,
                          quarantined=[{"where": "line 2", "reason": "r2"}, {"where": "line 5", "reason": "r5"}])
    assert probs == ["ds: no canary request was sent: all 2 records it read were quarantined (first, line 2: r2)"]
    assert check_records("ds", [], [{"error": "HTTP 500"}], reasoning_mode="off", expected_model=None,
                         max_tokens=8) == ["ds: every canary request failed (first error: HTTP 500)"]
