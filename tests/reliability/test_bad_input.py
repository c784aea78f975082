"""Item 5: bad input. One JSONL dataset mixes good prompts with malformed records of every kind, a
BFCL-style dataset mixes good and broken function docs, and one 50 MB line rides along. Each bad
record is quarantined with its reason (or, rejected by the server, failed with the server's
reason); everything else completes; the summary and `status` count them; a rerun changes nothing.
A prompt longer than the model's context goes to the real local engine (SmolLM2, max_model_len
2048), which rejects it: failed, with the reason. A broken tools file refuses the dataset up front
with one error line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specops.testing.fake_server import start_fake_server

from .helpers import PROBE, error_lines, read_journal, specops, status_json, write_config

pytestmark = pytest.mark.reliability

HUGE_MB = 50
CONTEXT_ERROR = ("This model's maximum context length is 32768 tokens. However, you requested 8738134 tokens "
                 "in the messages. Please reduce the length of the messages.")

J = json.dumps


def tool(name, params=None, **fn):
    f = {"name": name, "parameters": {"type": "object", "properties": {}} if params is None else params, **fn}
    return {"type": "function", "function": f}


# (raw line, outcome, reason substring): outcome "ok" (a record), "quarantine" or "failed"
CASES: list[tuple[bytes, str, str | None]] = [
    (b"\xef\xbb\xbf" + J({"id": "g0", "prompt": "a BOM before the first record is fine"}).encode(), "ok", None),
    (J({"id": "b1", "prompt": "unclosed"}).encode()[:-1], "quarantine", "invalid JSON"),
    (b"this is not json at all", "quarantine", "invalid JSON"),
    (b"[1, 2, 3]", "quarantine", "record is not a JSON object (got a list)"),
    (b'"a bare string"', "quarantine", "record is not a JSON object"),
    (b"null", "quarantine", "record is not a JSON object (got null)"),
    (J({"id": "g1", "prompt": "what is a journal?", "unknown_field": {"nested": [1, 2]}, "x": None}).encode(), "ok", None),
    (J({"id": "b6", "messages": [{"content": "a message without a role"}]}).encode(), "quarantine", "missing role"),
    (J({"id": "b7", "messages": [{"role": "wizard", "content": "hi"}]}).encode(), "quarantine", "unknown role 'wizard'"),
    (J({"id": "b8", "messages": [{"role": "system", "content": "only a system prompt"}]}).encode(), "quarantine",
     "no user message"),
    (J({"id": "b9", "messages": [{"role": "assistant", "content": "an answer to nothing"}]}).encode(), "quarantine",
     "no user message"),
    (J({"id": "b10", "prompt": ""}).encode(), "quarantine", "empty user message"),
    (J({"id": "b11", "messages": [{"role": "user", "content": "  \n\t "}]}).encode(), "quarantine", "empty user message"),
    (J({"id": "g2", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}).encode(),
     "ok", None),
    (J({"id": "b12", "messages": []}).encode(), "quarantine", "'messages' is empty"),
    (J({"id": "b13", "messages": "hello"}).encode(), "quarantine", "'messages' must be a list"),
    (J({"id": "b14", "messages": [{"role": "user", "content": 42}]}).encode(), "quarantine",
     "content must be a string, got a number"),
    (J({"id": "b15", "prompt": 123}).encode(), "quarantine", "'prompt' must be a string"),
    (b'{"id": "b16", "prompt": "caf\xe9 au lait"}', "quarantine", "not valid UTF-8"),
    (b'{"id": "b17", "prompt": "\\ud800 a lone surrogate"}', "quarantine", "not valid Unicode"),
    (J({"id": "g3", "prompt": "the first record with id g3"}).encode(), "ok", None),
    (J({"id": "g3", "prompt": "a second record claiming id g3"}).encode(), "quarantine", "duplicate id 'ds/g3'"),
    (J({"prompt": "the same text twice, no id"}).encode(), "ok", None),
    (J({"prompt": "the same text twice, no id"}).encode(), "quarantine", "duplicate id"),
    (J({"id": "b20", "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]}).encode(),
     "quarantine", "a system message is only allowed first"),
    (J({"id": "b21", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
       ).encode(), "quarantine", "unsupported content part type 'image_url'"),
    (J({"id": "b22", "messages": [{"role": "user", "content": "hi", "tool_calls": []}]}).encode(), "quarantine",
     "'tool_calls' must be a list on an assistant message"),
    (J({"id": "b23", "foo": "bar"}).encode(), "quarantine", "cannot detect the record format"),
    (J({"id": "b24", "conversations": [{"from": "narrator", "value": "once upon a time"}]}).encode(), "quarantine",
     "unknown role 'narrator'"),
    (J({"id": "b25", "turns": [1, 2]}).encode(), "quarantine", "turn 1 must be a string"),
    (J({"id": {"nested": 1}, "prompt": "an id of the wrong type: the content hash is the id"}).encode(), "ok", None),
    (J({"id": "g4", "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"},
                                      {"from": "human", "value": "how are you?"}]}).encode(), "ok", None),
    (J({"id": "b26", "prompt": "call it", "tools": {"name": "f"}}).encode(), "quarantine",
     "bad tool schema: tools must be a list"),
    (J({"id": "b27", "prompt": "x", "tools": [tool("bad name!")]}).encode(), "quarantine", "must match"),
    (J({"id": "b28", "prompt": "x", "tools": [tool("f", {"type": "string"})]}).encode(), "quarantine",
     "parameters type must be 'object'"),
    (J({"id": "b29", "prompt": "x", "tools": [tool("f"), tool("f")]}).encode(), "quarantine", "duplicate function name 'f'"),
    (J({"id": "b30", "prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}).encode(), "quarantine",
     "'parameters' must be a JSON Schema object"),
    (J({"id": "g5", "prompt": "what is the weather?", "tools": [tool("get_weather", description="weather")]}).encode(),
     "ok", None),
    (b"HUGE", "failed", CONTEXT_ERROR[:40]),  # replaced by the 50 MB line
    (J({"id": "g6", "prompt": "the last good record"}).encode(), "ok", None),
    (b'{"id": "b31", "prompt": "the file ends in the mid', "quarantine", "truncated last line"),
]

BFCL_GOOD = {"id": "simple_0", "question": [[{"role": "user", "content": "Area of a triangle, base 10, height 5?"}]],
             "function": [{"name": "geometry.triangle_area", "description": "Area of a triangle",
                           "parameters": {"type": "dict", "properties": {"base": {"type": "integer"},
                                                                          "height": {"type": "float"}},
                                          "required": ["base", "height"]}}]}


def bfcl_case(i: int, **change) -> dict:
    rec = json.loads(json.dumps(BFCL_GOOD))
    rec["id"] = f"simple_{i}"
    for k, v in change.items():
        if k == "fn":
            rec["function"][0].update(v)
        else:
            rec[k] = v
    return rec


BFCL_CASES: list[tuple[dict, str, str | None]] = [
    (bfcl_case(0), "ok", None),
    (bfcl_case(1, fn={"parameters": {"type": "dict", "properties": {"q": {"type": "quaternion"}}}}), "quarantine",
     "unknown type 'quaternion'"),
    (bfcl_case(2, fn={"name": ""}), "quarantine", "function 1 has no name"),
    (bfcl_case(3, function={"name": "f"}), "quarantine", "'function' must be a list"),
    (bfcl_case(4, fn={"parameters": {"type": "string"}}), "quarantine", "parameters must be an object schema"),
    (bfcl_case(5, fn={"parameters": {"type": "dict", "properties": {}, "required": "base"}}), "quarantine",
     "'required' must be a list of names"),
    (bfcl_case(6, question="what is 2+2?"), "quarantine", "'question' must be a non-empty list of turns"),
    (bfcl_case(7, function=[{"name": "math.add", "parameters": {"type": "dict", "properties": {}}},
                            {"name": "math_add", "parameters": {"type": "dict", "properties": {}}}]),
     "quarantine", "duplicate function name 'math_add'"),
    (bfcl_case(8, fn={"parameters": {"type": "dict", "properties": ["base"]}}), "quarantine",
     "'properties' must be an object"),
    (bfcl_case(9), "ok", None),
]


def write_cases(path: Path, huge_bytes: int) -> dict[str, tuple[str, str | None]]:
    """The dataset file; returns {"line N": (outcome, reason)}."""
    expect = {}
    with open(path, "wb") as f:
        for n, (raw, outcome, reason) in enumerate(CASES, 1):
            if raw == b"HUGE":
                words = huge_bytes // 6
                raw = b'{"id": "huge", "prompt": "' + b"lorem " * words + b'"}'
            f.write(raw + (b"\n" if n < len(CASES) else b""))  # the last line is cut: no newline
            expect[f"line {n}"] = (outcome, reason)
    return expect


def test_malformed_records_are_quarantined_with_reasons(tmp_path, figures):
    fig = figures("5", "bad input: malformed records quarantined or failed with reasons")
    data = tmp_path / "bad.jsonl"
    expect = write_cases(data, HUGE_MB << 20)
    assert data.stat().st_size >= HUGE_MB << 20
    bfcl = tmp_path / "BFCL_v3_simple_python.json"
    bfcl.write_text("".join(json.dumps(r) + "\n" for r, _, _ in BFCL_CASES))
    script = [{"match": "^ds/huge$", "fault": "status", "status": 400, "message": CONTEXT_ERROR}]
    with start_fake_server(tmp_path / "srv", script=script, model="fake-model") as srv:
        cfg = write_config(tmp_path, srv.url, data, engine={"max_attempts": 2},
                           datasets=[{"name": "ds", "path": str(data)},
                                     {"name": "bfcl", "source": "bfcl", "path": str(bfcl)}])
        out = specops("generate", str(cfg), "--no-progress", "--json", timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        summary = json.loads(out.stdout)["datasets"]
        reqs = [r for r in srv.requests() if r["sample"] != PROBE]
        again = specops("generate", str(cfg), "--no-progress", "--json", timeout=300)
        assert again.returncode == 0, again.stderr[-3000:]
        reqs_after_rerun = [r for r in srv.requests() if r["sample"] != PROBE]
    camp = tmp_path / "camp"
    n_bad = {"ds": 0, "bfcl": 0}
    checked = 0
    for ds, cases in (("ds", expect), ("bfcl", {f"{bfcl.name} line {i}": (o, r) for i, (_, o, r) in enumerate(BFCL_CASES, 1)})):
        d = camp / "generate" / ds
        quarantine = [json.loads(x) for x in (d / "quarantine.jsonl").read_text().splitlines()]
        failed = [json.loads(x) for x in (d / "failed.jsonl").read_text().splitlines()]
        records = read_journal(d / "records.jsonl", keep=True)
        by_where = {q["where"]: q for q in quarantine}
        assert len(by_where) == len(quarantine), "a record was quarantined twice (the rerun?)"
        for where, (outcome, reason) in cases.items():
            if outcome == "quarantine":
                assert where in by_where, f"{ds} {where} was not quarantined (expected: {reason})"
                assert reason in by_where[where]["reason"], (ds, where, by_where[where]["reason"])
                n_bad[ds] += 1
                checked += 1
            elif outcome == "failed":
                f = next(x for x in failed if x["id"] == f"{ds}/huge")
                assert f["status"] == 400 and reason in f["error"] and f["attempts"] == 1, f
                n_bad[ds] += 1
                checked += 1
            else:
                assert where not in by_where, (ds, where, by_where.get(where))
        n_ok = sum(1 for o, _ in cases.values() if o == "ok")
        assert len(records.ids) == len(set(records.ids)) == n_ok, (ds, records.ids)
        s = summary[ds]
        assert (s["done"], s["quarantined"], s["failed"]) == (
            n_ok, sum(1 for o, _ in cases.values() if o == "quarantine"),
            sum(1 for o, _ in cases.values() if o == "failed")), s
        assert all(len(q["excerpt"]) <= 500 for q in quarantine)
    # The huge line went to the server once (rejected, not retried); the rerun sent nothing at all.
    assert sum(1 for r in reqs if r["sample"] == "ds/huge") == 1
    n_sent = sum(1 for o, _ in expect.values() if o in ("ok", "failed")) + \
        sum(1 for _, o, _ in BFCL_CASES if o in ("ok", "failed"))
    assert len({r["sample"] for r in reqs}) == n_sent and len(reqs_after_rerun) == len(reqs)
    rerun = json.loads(again.stdout)["datasets"]
    assert all(rerun[k]["skipped_at_start"] == summary[k]["done"] + summary[k]["failed"] for k in rerun)
    rc, st = status_json(camp)
    assert rc == 0 and {k: st["datasets"][k]["quarantined"] for k in n_bad} == \
        {k: summary[k]["quarantined"] for k in n_bad}
    fig.trials = checked
    fig.faults_injected = checked
    fig.records_expected = sum(1 for o, _ in expect.values() if o == "ok") + sum(1 for _, o, _ in BFCL_CASES if o == "ok")
    fig.records_lost = 0
    fig.records_duplicated = 0
    fig.details = {"malformed_cases": checked, "by_dataset": n_bad, "huge_line_mb": HUGE_MB,
                   "summary": {k: {x: v[x] for x in ("done", "quarantined", "failed")} for k, v in summary.items()}}
    fig.finish()


def test_prompt_longer_than_the_context_fails_with_the_reason(tmp_path, figures):
    """The real local engine (SmolLM2-135M, max_model_len 2048) rejects an over-long prompt."""
    fig = figures("5", "bad input: prompt longer than the model context (real local engine)")
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"id": "short", "prompt": "Say hi."}) + "\n"
                    + json.dumps({"id": "long", "prompt": " ".join(["word"] * 3000)}) + "\n")
    cfg = write_config(tmp_path, None, data, target={"model": "smollm2", "served_name": "smollm2"},
                       engine={"kind": "local"}, generate={"max_tokens": 4, "reasoning": "off"})
    out = specops("generate", str(cfg), "--no-progress", "--json", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    s = json.loads(out.stdout)["datasets"]["ds"]
    d = tmp_path / "camp" / "generate" / "ds"
    failed = [json.loads(x) for x in (d / "failed.jsonl").read_text().splitlines()]
    assert (s["done"], s["failed"]) == (1, 1)
    assert failed[0]["id"] == "ds/long" and failed[0]["status"] == 400
    assert "max_model_len is 2048" in failed[0]["error"] and "prompt has" in failed[0]["error"]
    fig.trials = fig.faults_injected = 1
    fig.records_expected, fig.records_lost, fig.records_duplicated = 1, 0, 0
    fig.details = {"failed_reason": failed[0]["error"]}
    fig.finish()


def test_broken_tools_file_refuses_the_dataset(tmp_path, figures):
    fig = figures("5", "bad input: broken tools file refused with one error line")
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "lookup"}}]))
    with start_fake_server(tmp_path / "srv", model="fake-model") as srv:
        cfg = write_config(tmp_path, srv.url, data, datasets=[{"name": "ds", "path": str(data), "tools": str(tools)}])
        out = specops("generate", str(cfg), "--no-progress", timeout=120)
        sent = [r for r in srv.requests() if r["sample"] != PROBE]
    errs = error_lines(out.stderr)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert len(errs) == 1 and errs[0].startswith("InputError: ") and "bad tools file" in errs[0], errs
    assert "'parameters' must be a JSON Schema object" in errs[0]
    assert sent == []
    fig.trials = fig.faults_injected = 1
    fig.details = {"error_line": errs[0]}
    fig.finish()
