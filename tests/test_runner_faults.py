"""Runner against a scripted loopback server: every id ends exactly once in records or failed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specops.config import config_from_dict
from specops.generate import run_generate
from specops.testing.fake_server import start_fake_server


def write_prompts(path: Path, n: int, prefix: str = "p") -> list[str]:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"{prefix}{i}", "prompt": f"question number {i}?"}) + "\n")
    return [f"{prefix}{i}" for i in range(n)]


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def make_cfg(tmp_path: Path, url: str, prompts: Path, **engine) -> object:
    return config_from_dict(
        {
            "campaign": {"name": "t", "dir": str(tmp_path / "camp")},
            "target": {"served_name": "fake-model"},
            "engine": {"kind": "openai", "endpoints": [url], "max_attempts": 3, "backoff_base_s": 0.01,
                       "backoff_max_s": 0.05, "read_timeout_s": 2.0, "connect_timeout_s": 1.0, **engine},
            "generate": {"concurrency": 8, "max_tokens": 12, "heartbeat_interval_s": 0.2, "canary_samples": 0},
            "datasets": [{"name": "ds", "path": str(prompts)}],
        }
    )


SCRIPT = [
    {"match": "^ds/p1$", "times": 2, "fault": "status", "status": 500, "message": "engine overloaded"},
    {"match": "^ds/p2$", "times": 1, "fault": "status", "status": 429, "message": "slow down"},
    {"match": "^ds/p3$", "fault": "status", "status": 400, "message": "This model's maximum context length is 2048 tokens"},
    {"match": "^ds/p4$", "times": 1, "fault": "disconnect"},
    {"match": "^ds/p5$", "times": 1, "fault": "delay", "seconds": 0.3},
    {"match": "^ds/p6$", "fault": "status", "status": 503, "message": "always down"},
    {"match": "^ds/p7$", "times": 1, "fault": "close"},
    {"match": "^ds/p8$", "times": 1, "fault": "hang"},
    {"match": "^ds/p9$", "fault": "status", "status": 404, "message": "no such route"},
]


def test_scripted_faults_end_exactly_once(tmp_path):
    ids = write_prompts(tmp_path / "prompts.jsonl", 40)
    with start_fake_server(tmp_path / "srv", script=SCRIPT, model="fake-model") as srv:
        cfg = make_cfg(tmp_path, srv.url, tmp_path / "prompts.jsonl")
        summary = run_generate(cfg, progress=False)
        reqs = [r for r in srv.requests() if r["sample"] != "specops-health-probe"]
    d = tmp_path / "camp" / "generate" / "ds"
    records = {r["id"]: r for r in read_jsonl(d / "records.jsonl")}
    failed = {r["id"]: r for r in read_jsonl(d / "failed.jsonl")}
    assert len(records) + len(failed) == 40
    assert set(records) | set(failed) == {f"ds/{i}" for i in ids}
    assert not set(records) & set(failed)
    assert set(failed) == {"ds/p3", "ds/p6", "ds/p9"}
    assert failed["ds/p3"]["attempts"] == 1 and "maximum context length" in failed["ds/p3"]["error"]
    assert failed["ds/p3"]["status"] == 400 and failed["ds/p3"]["error_kind"] == "RequestRejected"
    assert failed["ds/p6"]["attempts"] == 3 and failed["ds/p6"]["status"] == 503
    assert failed["ds/p9"]["attempts"] == 1 and failed["ds/p9"]["status"] == 404
    assert records["ds/p1"]["attempts"] == 3
    assert records["ds/p2"]["attempts"] == 2
    assert records["ds/p4"]["attempts"] == 2  # disconnect mid-response is retried
    assert records["ds/p7"]["attempts"] == 2
    assert records["ds/p8"]["attempts"] == 2  # hang -> read timeout -> retried
    assert records["ds/p5"]["attempts"] == 1
    # The server saw exactly the attempts we recorded.
    per_id: dict[str, int] = {}
    for r in reqs:
        per_id[r["sample"]] = per_id.get(r["sample"], 0) + 1
    for rid, r in records.items():
        assert per_id[rid] == r["attempts"], rid
    for rid, r in failed.items():
        assert per_id[rid] == r["attempts"], rid
    s = summary.datasets["ds"]
    assert (s["done"], s["failed"]) == (37, 3)
    stats = json.loads((d / "stats.json").read_text())
    assert stats["done"] == 37 and stats["errors"]["http_500"] == 2 and stats["errors"]["http_503"] == 3


def test_record_schema_and_length_flag(tmp_path):
    write_prompts(tmp_path / "prompts.jsonl", 3)
    with start_fake_server(tmp_path / "srv", model="fake-model") as srv:
        cfg = make_cfg(tmp_path, srv.url, tmp_path / "prompts.jsonl")
        run_generate(cfg, progress=False)
    recs = read_jsonl(tmp_path / "camp" / "generate" / "ds" / "records.jsonl")
    r = recs[0]
    assert list(r)[0] == "id"
    assert r["dataset"] == "ds" and r["model"] == "fake-model" and r["endpoint"].startswith("http://127.0.0.1")
    assert r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] == r["content"]
    assert r["reasoning"] and r["messages"][-1]["reasoning"] == r["reasoning"]  # fake server reasons
    assert r["usage"]["completion_tokens"] > 0
    t = r["turns"][0]
    assert t["token_ids"] and len(t["token_ids"]) == t["usage"]["completion_tokens"]
    assert r["finish_reason"] in ("stop", "length")
    stats = json.loads((tmp_path / "camp" / "generate" / "ds" / "stats.json").read_text())
    assert stats["reasoning_capture_rate"] == 1.0
    assert stats["finish_reasons"].get("length", 0) == stats["truncated"]


def test_second_run_sends_nothing(tmp_path):
    write_prompts(tmp_path / "prompts.jsonl", 10)
    with start_fake_server(tmp_path / "srv", model="fake-model") as srv:
        cfg = make_cfg(tmp_path, srv.url, tmp_path / "prompts.jsonl")
        run_generate(cfg, progress=False)
        samples = lambda: [r for r in srv.requests() if r["sample"] != "specops-health-probe"]  # noqa: E731
        n = len(samples())
        s2 = run_generate(cfg, progress=False)
        assert len(samples()) == n
    assert s2.datasets["ds"]["done"] == 10 and s2.datasets["ds"]["skipped_at_start"] == 10


def test_multi_turn_history_sends_no_reasoning(tmp_path):
    prompts = tmp_path / "mt.jsonl"
    prompts.write_text(json.dumps({"id": "c1", "messages": [
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "old answer"},
        {"role": "user", "content": "second"}]}) + "\n")
    with start_fake_server(tmp_path / "srv", model="fake-model", log_bodies=True) as srv:
        cfg = make_cfg(tmp_path, srv.url, prompts)
        run_generate(cfg, progress=False)
        reqs = [r for r in srv.requests() if r["sample"] == "ds/c1"]
    rec = read_jsonl(tmp_path / "camp" / "generate" / "ds" / "records.jsonl")[0]
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant", "user", "assistant"]
    assert rec["messages"][1]["content"] != "old answer" and rec["messages"][1]["reasoning"]
    assert rec["turns"][0]["index"] == 1 and rec["turns"][1]["index"] == 3
    second = reqs[1]["body"]["messages"]
    assert second[1]["content"] == rec["messages"][1]["content"] and "reasoning" not in second[1]


@pytest.mark.parametrize("mode, roles, sent_last", [
    ("first", ["system", "user", "assistant"], "first"),
    ("last", ["system", "user", "assistant", "user", "assistant"], "second"),
])
def test_turn_modes(tmp_path, mode, roles, sent_last):
    prompts = tmp_path / "mt.jsonl"
    prompts.write_text(json.dumps({"id": "c1", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "first"},
        {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "second"}]}) + "\n")
    with start_fake_server(tmp_path / "srv", model="fake-model", log_bodies=True) as srv:
        cfg = make_cfg(tmp_path, srv.url, prompts)
        cfg.datasets[0].turns = mode
        run_generate(cfg, progress=False)
        reqs = [r for r in srv.requests() if r["sample"] == "ds/c1"]
    rec = read_jsonl(tmp_path / "camp" / "generate" / "ds" / "records.jsonl")[0]
    assert [m["role"] for m in rec["messages"]] == roles and len(reqs) == 1
    assert reqs[0]["body"]["messages"][-1]["content"] == sent_last
    if mode == "last":
        assert rec["messages"][2]["content"] == "old answer"  # the original answer stays as history


def test_prometheus_exporter_on_loopback(tmp_path):
    import threading
    import urllib.request

    from specops.serverproc import free_port

    write_prompts(tmp_path / "prompts.jsonl", 30)
    port = free_port()
    seen: list[str] = []
    script = [{"match": "^ds/.*", "fault": "delay", "seconds": 0.1}]
    with start_fake_server(tmp_path / "srv", model="fake-model", script=script) as srv:
        cfg = make_cfg(tmp_path, srv.url, tmp_path / "prompts.jsonl")
        cfg.monitor.metrics_port = port

        def scrape() -> None:
            import time

            for _ in range(100):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                        seen.append(r.read().decode())
                        return
                except OSError:
                    time.sleep(0.05)

        t = threading.Thread(target=scrape)
        t.start()
        run_generate(cfg, progress=False)
        t.join()
    assert seen, "the exporter never answered"
    text = seen[0]
    assert 'specops_samples_total{dataset="ds"} 30' in text
    assert "# TYPE specops_completion_tokens_total counter" in text


def test_records_that_raise_and_empty_files_do_not_stop_generate(tmp_path):
    """`specops generate` over datasets holding records the reader or the checks refuse with an
    exception of their own, a cut gzip, and empty inputs: every bad record lands in quarantine.jsonl
    with its exception and line, every dataset after them still runs, and the empty inputs are
    reported (log, stats.json, the final summary, status) instead of passing in silence."""
    import gzip
    import subprocess
    import sys

    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([
        json.dumps({"id": "b1", "prompt": "first"}),
        '{"prompt": "big id", "id": ' + "9" * 5000 + "}",
        '{"prompt": "deep", "x": ' + "[" * 50_000 + "]" * 50_000 + "}",
        json.dumps({"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}),
        json.dumps({"id": "b5", "prompt": "last"}),
    ]) + "\n")
    arr = tmp_path / "arr.json"
    arr.write_text('[{"id": "a1", "prompt": "x"}, {"id": "a2", "prompt": "y", "n": ' + "1" * 5000 + "},"
                   ' {"id": "a3", "prompt": "z"}]')
    cut = tmp_path / "cut.jsonl.gz"
    whole = gzip.compress("".join(json.dumps({"id": f"c{i}", "prompt": f"q {i} " + "w" * 40}) + "\n"
                                  for i in range(3000)).encode())
    cut.write_bytes(whole[: len(whole) // 2])
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_text("\n  \n\n")
    good = tmp_path / "good.jsonl"
    write_prompts(good, 3, prefix="g")
    names = ["bad", "arr", "cut", "empty", "blank", "good"]
    paths = [bad, arr, cut, tmp_path / "empty.jsonl", tmp_path / "blank.jsonl", good]
    with start_fake_server(tmp_path / "srv", model="fake-model") as srv:
        toml = tmp_path / "c.toml"
        toml.write_text(
            f'[campaign]\nname = "t"\ndir = "{tmp_path / "camp"}"\n[target]\nserved_name = "fake-model"\n'
            f'[engine]\nkind = "openai"\nendpoints = ["{srv.url}"]\n'
            f'[generate]\nmax_tokens = 12\ncanary_samples = 2\nexpect_truncation = true\n'
            + "".join(f'[[datasets]]\nname = "{n}"\npath = "{p}"\n' for n, p in zip(names, paths)))
        out = subprocess.run([sys.executable, "-m", "specops", "generate", str(toml), "--no-progress"],
                             capture_output=True, text=True, timeout=300)
        st = subprocess.run([sys.executable, "-m", "specops", "status", str(tmp_path / "camp")],
                            capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    gen = tmp_path / "camp" / "generate"
    done = {n: {r["id"] for r in read_jsonl(gen / n / "records.jsonl")} for n in names}
    assert done["bad"] == {"bad/b1", "bad/b5"} and done["arr"] == {"arr/a1", "arr/a3"}
    assert done["good"] == {"good/g0", "good/g1", "good/g2"}
    assert 0 < len(done["cut"]) < 3000 and done["empty"] == done["blank"] == set()
    q = {r["where"]: r for r in read_jsonl(gen / "bad" / "quarantine.jsonl")}
    assert sorted(q) == ["line 2", "line 3", "line 4"]
    assert q["line 2"]["reason"].startswith("ValueError: Exceeds the limit (4300 digits)")
    assert q["line 3"]["reason"].startswith("RecursionError: maximum recursion depth exceeded")
    assert q["line 4"]["reason"].startswith("UnicodeEncodeError:") and q["line 4"]["dataset"] == "bad"
    assert [r["where"] for r in read_jsonl(gen / "arr" / "quarantine.jsonl")] == ["record 2"]
    (tail,) = read_jsonl(gen / "cut" / "quarantine.jsonl")
    assert tail["reason"].startswith("EOFError") and str(cut) in tail["reason"]
    for n in names:
        stats = json.loads((gen / n / "stats.json").read_text())
        assert stats["empty_input"] is (n in ("empty", "blank")), n
    for n in ("empty", "blank"):
        assert f"dataset {n!r}: " in out.stderr and "holds no records" in out.stderr
        assert f"{n}: the input holds no records" in out.stdout  # the final summary
        assert f"{n}: the input holds no records" in st.stdout  # status
    assert "bad: the input holds no records" not in out.stdout + st.stdout
