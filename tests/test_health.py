"""Tiered server health against real loopback fake servers: one scripted fault per tier."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import socket
import time
from typing import Any

import aiohttp
import pytest
from rich.console import Console

from specops.checks.server import (
    PROBE_SAMPLE,
    HealthReport,
    ServerUnhealthy,
    check_endpoint,
    check_endpoint_sync,
    metrics_from_text,
    parse_prometheus,
    read_server_metrics,
    wait_until_healthy,
)
from specops.errors import SpecopsError
from specops.testing.fake_server import start_fake_server

MODEL = "fake-model"
WINDOW_S = 0.4  # progress window: long enough to see a counter move at the rates used here
FAST = {"timeout_s": 5.0, "completion_timeout_s": 10.0, "progress_window_s": WINDOW_S}


def check(url: str, **kw: Any) -> HealthReport:
    return check_endpoint_sync(url, expected_model=kw.pop("expected_model", MODEL), **{**FAST, **kw})


def statuses(report: HealthReport) -> dict[str, str]:
    return {t.name: t.status for t in report.tiers}


def rendered(report: HealthReport) -> str:
    console = Console(record=True, width=240, file=io.StringIO())
    console.print(report.render())
    return console.export_text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def hold_request(url: str, session: aiohttp.ClientSession, sample: str) -> None:
    """A chat request the script answers slowly or never; the caller cancels it."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "write a long story"}]}
    async with session.post(f"{url}/chat/completions", json=body,
                            headers={"X-Specops-Sample": sample}) as resp:
        await resp.read()


async def wait_running(session: aiohttp.ClientSession, root: str, n: int = 1) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        m = await read_server_metrics(session, root)
        if (m.running or 0) >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the fake server never showed {n} running request(s)")


# ----------------------------------------------------------------------------------- per tier


def test_healthy_server_passes_every_tier(tmp_path):
    with start_fake_server(tmp_path) as srv:
        report = check(srv.url)
        logged = srv.requests(min_count=1)
    assert statuses(report) == dict.fromkeys(["tcp", "health", "models", "completion", "progress"],
                                             "pass"), report.to_json()
    assert report.ok and report.exit_code == 0
    assert report.tier("tcp").evidence.startswith("connected in ")
    comp = report.tier("completion")
    assert comp.data["completion_tokens"] == 8 and comp.data["finish_reason"] == "length"
    assert "8 completion tokens" in comp.evidence
    assert all(t.latency_s is not None and t.latency_s >= 0 for t in report.tiers)
    assert report.tier("progress").evidence.startswith("idle")
    assert report.tier("progress").data["running"] == 0
    assert report.tier("progress").data["gen_tokens_total"] == 8
    # The probe is the only chat request and identifies itself.
    assert [r["sample"] for r in logged] == [PROBE_SAMPLE]
    json.dumps(report.to_json())  # serialisable as is
    assert "completion" in rendered(report)


def test_closed_port_fails_tcp_and_skips_the_rest(tmp_path):
    report = check(f"http://127.0.0.1:{free_port()}/v1")
    assert statuses(report) == {"tcp": "fail", "health": "skip", "models": "skip",
                                "completion": "skip", "progress": "skip"}
    assert "connection refused" in report.tier("tcp").evidence
    assert not report.ok and report.exit_code == 2


def test_health_503_fails_health_and_skips_the_chain_but_not_progress(tmp_path):
    with start_fake_server(tmp_path, {"health_status": 503}) as srv:
        report = check(srv.url)
    assert statuses(report) == {"tcp": "pass", "health": "fail", "models": "skip",
                                "completion": "skip", "progress": "pass"}
    assert "503" in report.tier("health").evidence
    assert report.exit_code == 2


def test_wrong_model_id_names_both_ids(tmp_path):
    with start_fake_server(tmp_path, {"models": ["qwen3-8b"]}) as srv:
        report = check(srv.url, expected_model="kimi-k2")
    models = report.tier("models")
    assert models.status == "fail"
    assert models.evidence == "expected 'kimi-k2', server lists ['qwen3-8b']"
    assert report.tier("completion").status == "skip"


def test_model_id_must_match_exactly(tmp_path):
    with start_fake_server(tmp_path, {"models": ["org/Kimi-K2"]}) as srv:
        report = check(srv.url, expected_model="Kimi-K2")
    assert report.tier("models").status == "fail"
    assert "'org/Kimi-K2' is close" in report.tier("models").evidence


def test_completions_500_fails_completion(tmp_path):
    with start_fake_server(tmp_path, {"completions_fail": 500}) as srv:
        report = check(srv.url)
    assert statuses(report)["models"] == "pass"
    comp = report.tier("completion")
    assert comp.status == "fail" and "HTTP 500" in comp.evidence, comp.evidence
    assert "completions fail" in comp.evidence  # the server's own message is kept


def test_hanging_completion_fails_on_timeout(tmp_path):
    script = [{"match": PROBE_SAMPLE, "fault": "hang"}]
    with start_fake_server(tmp_path, script) as srv:
        t0 = time.monotonic()
        report = check(srv.url, completion_timeout_s=1.0)
        took = time.monotonic() - t0
    comp = report.tier("completion")
    assert comp.status == "fail" and "timeout" in comp.evidence, comp.evidence
    assert 1.0 <= comp.latency_s < 3.0
    assert took < 1.0 + WINDOW_S + 5  # the check itself does not hang
    assert not report.ok


def test_empty_generation_fails_completion(tmp_path):
    with start_fake_server(tmp_path, {"reasoning_words": 0, "content_words": 0}) as srv:
        report = check(srv.url)
    comp = report.tier("completion")
    assert comp.status == "fail"
    assert "generated nothing" in comp.evidence and comp.data["completion_tokens"] == 0


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_reasoning_cut_by_tiny_budget_is_a_pass(tmp_path, field):
    # 8 words of reasoning, budget 4: content null, finish "length", 4 tokens -- a working server.
    with start_fake_server(tmp_path, reasoning_field=field) as srv:
        report = check(srv.url, probe_max_tokens=4)
    comp = report.tier("completion")
    assert comp.status == "pass", comp.evidence
    assert comp.data["finish_reason"] == "length"
    assert comp.data["content_chars"] == 0 and comp.data["reasoning_chars"] > 0
    assert comp.data["completion_tokens"] == 4
    assert "content empty, reasoning yes" in comp.evidence
    assert report.exit_code == 0


def test_stalled_server_fails_progress(tmp_path):
    # A long request hangs (counts as running) while the generation counter is frozen.
    script = {"freeze_metrics": True, "rules": [{"match": "long-.*", "fault": "hang"}]}

    async def scenario(url: str, root: str) -> HealthReport:
        async with aiohttp.ClientSession() as session:
            held = asyncio.create_task(hold_request(url, session, "long-1"))
            try:
                await wait_running(session, root)
                return await check_endpoint(url, expected_model=MODEL, **FAST)
            finally:
                held.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await held

    with start_fake_server(tmp_path, script) as srv:
        report = asyncio.run(scenario(srv.url, srv.base_url))
    progress = report.tier("progress")
    assert report.tier("completion").status == "pass"  # the probe itself still answers
    assert progress.status == "fail", progress.evidence
    assert progress.evidence.startswith("stalled: 1 requests running, generation_tokens_total "
                                        "flat at ")
    assert progress.data["running"] == 1 and progress.data["gen_tokens_delta"] == 0
    assert report.exit_code == 2


def test_generating_server_passes_progress_with_a_rate(tmp_path):
    # 400-word answers at 100 tok/s: the held request generates for ~4 s, across the window.
    script = {"content_words": 400}

    async def scenario(url: str, root: str) -> HealthReport:
        async with aiohttp.ClientSession() as session:
            held = asyncio.create_task(hold_request(url, session, "long-1"))
            try:
                await wait_running(session, root)
                return await check_endpoint(url, expected_model=MODEL, **FAST)
            finally:
                held.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await held

    with start_fake_server(tmp_path, script, tokens_per_s=100) as srv:
        report = asyncio.run(scenario(srv.url, srv.base_url))
    progress = report.tier("progress")
    assert progress.status == "pass" and "tok/s" in progress.evidence, progress.evidence
    assert 50 < progress.data["tokens_per_s"] < 200
    assert progress.data["running"] >= 1


def test_missing_metrics_is_unknown_and_report_stays_ok(tmp_path):
    with start_fake_server(tmp_path, {"metrics_status": 404}) as srv:
        report = check(srv.url)
    progress = report.tier("progress")
    assert progress.status == "unknown" and "no /metrics" in progress.evidence
    assert report.ok and report.exit_code == 0
    assert all(t.status == "pass" for t in report.tiers if t.name != "progress")


# ------------------------------------------------------------------------------------- secrets


def test_api_key_is_sent_but_never_shown(tmp_path):
    key = "sk-PLANTED-7f3a9c1e5b"
    # A server that echoes the key back in its error, as some gateways do; the second copy
    # straddles the 200-character excerpt cut, where only a prefix of it would survive.
    head = f"Incorrect API key provided: {key};"
    message = f"{head} {'x' * (190 - len(head) - 2)} {key}"
    script = [{"match": PROBE_SAMPLE, "fault": "status", "status": 401, "message": message}]
    sent: list[tuple[str, str | None, str | None]] = []

    async def on_start(session, ctx, params: aiohttp.TraceRequestStartParams) -> None:
        sent.append((params.url.path, params.headers.get("Authorization"),
                     params.headers.get("X-Specops-Sample")))

    async def scenario(url: str) -> HealthReport:
        trace = aiohttp.TraceConfig()
        trace.on_request_start.append(on_start)
        async with aiohttp.ClientSession(trace_configs=[trace]) as session:
            return await check_endpoint(url, expected_model=MODEL, api_key=key, session=session,
                                        **FAST)

    with start_fake_server(tmp_path, script) as srv:
        report = asyncio.run(scenario(srv.url))
    assert sent and all(auth == f"Bearer {key}" for _, auth, _ in sent)
    assert ("/v1/chat/completions", f"Bearer {key}", PROBE_SAMPLE) in sent
    comp = report.tier("completion")
    assert comp.status == "fail" and "HTTP 401" in comp.evidence
    assert "Incorrect API key provided: ***" in comp.evidence
    for text in (json.dumps(report.to_json()), rendered(report), repr(report)):
        assert key[:6] not in text  # not even a prefix


# ------------------------------------------------------------------------------------- waiting


def test_wait_until_healthy_returns_once_the_server_recovers(tmp_path):
    attempts: list[HealthReport] = []

    async def scenario(srv) -> HealthReport:
        async def recover() -> None:
            while not attempts:  # at least one failing check first
                await asyncio.sleep(0.05)
            await asyncio.to_thread(srv.set_script, {})

        fixer = asyncio.create_task(recover())
        report = await wait_until_healthy(srv.url, expected_model=MODEL, timeout_s=20, poll_s=0.1,
                                          on_attempt=lambda n, r: attempts.append(r),
                                          progress_window_s=0.05)
        await fixer
        return report

    with start_fake_server(tmp_path, {"health_status": 503}) as srv:
        report = asyncio.run(scenario(srv))
    assert report.ok and report.exit_code == 0
    assert attempts[0].tier("health").status == "fail"
    assert attempts[-1] is report and len(attempts) >= 2


def test_wait_until_healthy_times_out_naming_the_failing_tier(tmp_path):
    attempts: list[int] = []
    with start_fake_server(tmp_path, {"health_status": 503}) as srv:
        t0 = time.monotonic()
        with pytest.raises(ServerUnhealthy) as info:
            asyncio.run(wait_until_healthy(srv.url, expected_model=MODEL, timeout_s=1.0,
                                           poll_s=0.2, progress_window_s=0.05,
                                           on_attempt=lambda n, r: attempts.append(n)))
        took = time.monotonic() - t0
    assert isinstance(info.value, SpecopsError)
    assert "health fail: /health HTTP 503" in str(info.value)
    assert info.value.report.tier("health").status == "fail"
    assert attempts == list(range(1, len(attempts) + 1)) and len(attempts) >= 3
    assert 1.0 <= took < 4.0


# ------------------------------------------------------------------------------------ metrics


VLLM_TWO_ENGINES = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} NaN
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:generation_tokens_total{engine="0",model_name="a b}c"} 1.5e+06 1712000000000
vllm:generation_tokens_total{engine="1",model_name="say \\"hi\\""} 500000
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9
not a metric line
"""

SGLANG = """\
sglang:num_running_reqs{model_name="q"} 4
sglang:num_queue_reqs{model_name="q"} 7
sglang:generation_tokens_total{model_name="q"} 123
sglang:token_usage{model_name="q"} 0.8
"""


def test_parse_prometheus_sums_label_sets():
    values = parse_prometheus(VLLM_TWO_ENGINES)
    assert values["vllm:num_requests_running"] == 5
    assert values["vllm:num_requests_waiting"] == 1  # the NaN sample is skipped
    assert values["vllm:generation_tokens_total"] == 2_000_000  # braces and quotes in labels
    assert "not" not in values and "vllm:prompt_tokens_total" not in values


def test_metrics_from_text_knows_both_flavors_and_unknowns():
    v = metrics_from_text(VLLM_TWO_ENGINES)
    assert (v.flavor, v.running, v.waiting, v.generation_tokens_total) == ("vllm", 5, 1, 2e6)
    assert v.kv_cache_usage == 0.5  # older name accepted; the fullest engine, not the sum
    assert v.prompt_tokens_total is None  # missing is unknown, never 0
    s = metrics_from_text(SGLANG)
    assert (s.flavor, s.running, s.waiting, s.generation_tokens_total, s.kv_cache_usage) == (
        "sglang", 4, 7, 123, 0.8)
    assert metrics_from_text("process_cpu_seconds_total 3\n").flavor is None


def test_cli_health_exit_codes(tmp_path):
    import subprocess
    import sys

    from specops.testing.fake_server import start_fake_server as _start

    with _start(tmp_path / "ok", model="m1") as srv:
        good = subprocess.run([sys.executable, "-m", "specops", "health", "--url", srv.url, "--model", "m1",
                               "--window", "0.2", "--json"], capture_output=True, text=True, timeout=60)
        bad = subprocess.run([sys.executable, "-m", "specops", "health", "--url", srv.url, "--model", "m2",
                              "--window", "0.2"], capture_output=True, text=True, timeout=60)
        no_drafter = subprocess.run([sys.executable, "-m", "specops", "health", "--url", srv.url, "--model", "m1",
                                     "--window", "0.2", "--drafter", "--json"], capture_output=True, text=True,
                                    timeout=60)
    assert good.returncode == 0, good.stderr
    assert [t["status"] for t in json.loads(good.stdout)[0]["tiers"]][:4] == ["pass"] * 4
    # without --drafter the tier runs where the server shows spec-decode counters: none here
    assert {t["name"]: t["status"] for t in json.loads(good.stdout)[0]["tiers"]}["drafter"] == "skip"
    assert no_drafter.returncode == 2, no_drafter.stderr
    tiers = {t["name"]: t for t in json.loads(no_drafter.stdout)[0]["tiers"]}
    assert tiers["drafter"]["status"] == "fail" and "without speculative decoding" in tiers["drafter"]["evidence"]
    assert bad.returncode == 2 and "m2" in bad.stdout and "m1" in bad.stdout


# ------------------------------------------------------------------------------------- drafter

SPEC = {"reasoning_words": 0, "content_words": 100}  # 100-token answers: a 150-token probe takes two


def test_drafter_tier_reports_acceptance_from_moving_counters(tmp_path):
    script = {**SPEC, "spec_decode": {"k": 3, "accepted_per_draft": 1}}
    with start_fake_server(tmp_path, script) as srv:
        report = check(srv.url, drafter=True, drafter_probe_tokens=150)
        logged = srv.requests(min_count=3)
    assert [t.name for t in report.tiers] == ["tcp", "health", "models", "completion", "drafter", "progress"]
    tier = report.tier("drafter")
    assert tier.status == "pass", tier.evidence
    # 100 + 50 tokens, one accepted per draft: ceil(100/2) + ceil(50/2) = 75 drafts, 75 accepted
    assert (tier.data["probe_tokens"], tier.data["probe_requests"]) == (150, 2)
    assert (tier.data["drafts"], tier.data["accepted"], tier.data["draft_tokens"]) == (75, 75, 225)
    assert tier.data["acceptance"] == 2.0 and tier.data["per_position"] == [1.0, 0.0, 0.0]
    assert tier.evidence.startswith("acceptance 2.00 (1 + 75 accepted / 75 drafts) over a probe of 150 "
                                    "generated tokens (2 requests); per position 1.00, 0.00, 0.00")
    assert [r["sample"] for r in logged] == [PROBE_SAMPLE] * 3  # the completion tier's probe, then two
    assert report.exit_code == 0 and "drafter" in rendered(report)


def test_drafter_that_accepts_nothing_fails(tmp_path):
    script = {**SPEC, "spec_decode": {"k": 3, "accepted_per_draft": 0}}
    with start_fake_server(tmp_path, script) as srv:
        report = check(srv.url, drafter=True, drafter_probe_tokens=40)
    tier = report.tier("drafter")
    assert tier.status == "fail" and report.exit_code == 2
    assert tier.evidence == ("the drafter accepted nothing over a probe of 40 generated tokens (1 request): 0 of "
                             "120 draft tokens in 40 drafts (acceptance 1.00): it does not predict this target")
    assert report.tier("progress").status == "pass"  # independent of the drafter


def test_drafter_counters_that_do_not_move_fail(tmp_path):
    script = {**SPEC, "spec_decode": {"k": 3, "accepted_per_draft": 2, "frozen": True}}
    with start_fake_server(tmp_path, script) as srv:
        report = check(srv.url, drafter=True, drafter_probe_tokens=40)
    tier = report.tier("drafter")
    assert tier.status == "fail"
    assert tier.evidence == ("the drafter's counters did not move over a probe of 40 generated tokens (1 request): "
                             "vllm:spec_decode_num_drafts_total stayed at 0")


def test_server_without_spec_decode_fails_only_when_a_drafter_is_expected(tmp_path):
    with start_fake_server(tmp_path, SPEC) as srv:
        expected = check(srv.url, drafter=True)
        auto = check(srv.url, drafter=None)
        logged = srv.requests(min_count=2)
        off = check(srv.url)
    tier = expected.tier("drafter")
    assert tier.status == "fail" and expected.exit_code == 2
    assert "a drafter is expected but /metrics has no vllm:spec_decode_num_drafts_total" in tier.evidence
    assert "without speculative decoding" in tier.evidence
    assert auto.tier("drafter").status == "skip" and auto.exit_code == 0
    assert len(logged) == 2  # the completion probes only: no drafter probe without counters
    assert "drafter" not in {t.name for t in off.tiers}
    with start_fake_server(tmp_path / "m", {"metrics_status": 404}) as srv:
        gone = check(srv.url, drafter=True)
    assert gone.tier("drafter").status == "fail" and "no /metrics" not in gone.tier("drafter").evidence
    assert "/metrics HTTP 404" in gone.tier("drafter").evidence


def test_drafter_tier_chain_and_bad_arguments(tmp_path):
    report = check(f"http://127.0.0.1:{free_port()}/v1", drafter=True)
    assert statuses(report) == {"tcp": "fail", "health": "skip", "models": "skip", "completion": "skip",
                                "drafter": "skip", "progress": "skip"}
    with start_fake_server(tmp_path, {**SPEC, "completions_fail": 500,
                                      "spec_decode": {"k": 2, "accepted_per_draft": 1}}) as srv:
        failed = check(srv.url, drafter=True)
    assert failed.tier("drafter").status == "skip" and "completion failed" in failed.tier("drafter").evidence
    with pytest.raises(ValueError, match="drafter_probe_tokens"):
        check("http://127.0.0.1:1/v1", drafter=True, drafter_probe_tokens=0)


def test_spec_decode_counters_sum_engines_and_positions():
    from specops.checks.server import spec_decode_from_text

    text = "\n".join([
        '# TYPE vllm:spec_decode_num_drafts_total counter',
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 7.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 2.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 5.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 1.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 3.0',
    ])
    c = spec_decode_from_text(text)
    assert (c.drafts, c.accepted, c.draft_tokens, c.per_position) == (15.0, 9.0, None, {0: 6.0, 1: 3.0})
    assert spec_decode_from_text('vllm:generation_tokens_total{engine="0"} 3.0') is None
