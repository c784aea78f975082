"""Journal format and resume rules: torn tails, id scan, stats folding, rollback on a full disk."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys

import pytest

from specops.generate.journal import (
    FAILED, QUARANTINE, RECORDS, STATS, DiskFull, Journal, _fast_id, repair_tail,
)


def rec(i: int, **kw) -> dict:
    r = {"id": f"ds/{i}", "dataset": "ds", "content": f"answer {i}", "finish_reason": "stop",
         "usage": {"prompt_tokens": 3, "completion_tokens": 5}, "latency_s": 0.1 * (i + 1),
         "reasoning_mode": "save", "reasoning": "r" if i % 2 else "", "finished_unix": 1000.0 + i}
    r.update(kw)
    return r


def test_append_reopen_skips_done_and_parked(tmp_path):
    j = Journal(tmp_path).open()
    for i in range(5):
        j.append_record(rec(i))
    j.append_failed({"id": "ds/9", "attempts": 3, "error": "HTTP 400: bad"})
    j.append_quarantine({"where": "line 7", "dataset": "ds", "reason": "invalid JSON"})
    j.append_quarantine({"where": "line 7", "dataset": "ds", "reason": "invalid JSON"})  # no double entry
    j.close()
    j2 = Journal(tmp_path).open()
    assert j2.done_ids == {f"ds/{i}" for i in range(5)}
    assert j2.parked_ids == {"ds/9"}
    assert j2.quarantine_keys == {"line 7"}
    assert (j2.stats.done, j2.stats.failed, j2.stats.quarantined) == (5, 1, 1)
    assert (tmp_path / QUARANTINE).read_text().count("\n") == 1
    j2.close()


def test_torn_last_line_is_truncated(tmp_path):
    j = Journal(tmp_path).open()
    for i in range(3):
        j.append_record(rec(i))
    j.close()
    good = (tmp_path / RECORDS).read_bytes()
    with open(tmp_path / RECORDS, "ab") as f:
        f.write(b'{"id":"ds/3","dataset":"ds","content":"half a rec')
    assert repair_tail(tmp_path / RECORDS) > 0
    assert (tmp_path / RECORDS).read_bytes() == good
    with open(tmp_path / RECORDS, "ab") as f:
        f.write(b'{"id":"ds/3","datas')
    j2 = Journal(tmp_path).open()
    assert j2.repaired_bytes[RECORDS] == len(b'{"id":"ds/3","datas')
    assert j2.done_ids == {"ds/0", "ds/1", "ds/2"}
    j2.append_record(rec(3))
    j2.close()
    lines = (tmp_path / RECORDS).read_bytes().split(b"\n")
    assert lines[-1] == b"" and [json.loads(x)["id"] for x in lines[:-1]] == [f"ds/{i}" for i in range(4)]


def test_fast_id_handles_escapes_and_foreign_lines():
    assert _fast_id(b'{"id":"ds/a b","x":1}') == "ds/a b"
    assert _fast_id(b'{"id":"ds/q\\"uote","x":1}') == 'ds/q"uote'
    assert _fast_id(b'{"x": 1, "id": "ds/late"}') == "ds/late"
    assert _fast_id(b"not json") is None


def test_stats_fold_only_tail_after_offset(tmp_path):
    j = Journal(tmp_path).open()
    for i in range(4):
        j.append_record(rec(i))
    j.write_stats(total=10)
    for i in range(4, 6):  # written after the last stats: must be folded in at open
        j.append_record(rec(i, finish_reason="length"))
    j.close()
    # Simulate the crash: stats.json still reflects 4 records.
    saved = json.loads((tmp_path / STATS).read_text())
    assert saved["done"] == 4
    j2 = Journal(tmp_path).open()
    s = j2.stats
    assert s.done == 6 and s.truncated == 2 and s.completion_tokens == 30
    assert s.reasoning_expected == 6 and s.reasoning_captured == 3
    assert s.finish_reasons == {"stop": 4, "length": 2}
    assert s.percentile(50) == pytest.approx(0.3, rel=0.15)
    j2.close()


def test_stats_mismatch_rebuilds_from_journal(tmp_path):
    j = Journal(tmp_path).open()
    for i in range(3):
        j.append_record(rec(i))
    j.write_stats(total=3)
    j.close()
    bogus = json.loads((tmp_path / STATS).read_text())
    bogus["done"] = 99
    (tmp_path / STATS).write_text(json.dumps(bogus))
    j2 = Journal(tmp_path).open()
    assert j2.stats.done == 3
    j2.close()


def test_retry_failed_archives_parked(tmp_path):
    j = Journal(tmp_path).open()
    j.append_failed({"id": "ds/1", "attempts": 6, "error": "HTTP 500"})
    j.close()
    j2 = Journal(tmp_path).open(retry_failed=True)
    assert j2.parked_ids == set()
    assert len(list(tmp_path.glob("failed.*.jsonl"))) == 1
    j2.close()


def test_corrupt_middle_line_is_counted_not_fatal(tmp_path):
    (tmp_path / RECORDS).write_bytes(
        json.dumps(rec(0), separators=(",", ":")).encode() + b"\n" + b"garbage\n"
        + json.dumps(rec(1), separators=(",", ":")).encode() + b"\n"
    )
    j = Journal(tmp_path).open()
    assert j.done_ids == {"ds/0", "ds/1"} and j.corrupt_lines == 1
    j.close()


def test_disk_full_rolls_back_partial_line(tmp_path):
    # RLIMIT_FSIZE in a child: the write that crosses the limit fails; the journal must stay whole.
    code = r"""
import resource, signal, sys
from specops.generate.journal import Journal, DiskFull
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
j = Journal(sys.argv[1]).open()
resource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000))
n = 0
try:
    while True:
        j.append_record({"id": f"ds/{n}", "content": "x" * 300})
        n += 1
except DiskFull as e:
    print("DISKFULL", n, e)
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert "DISKFULL" in out.stdout, out.stderr
    n = int(out.stdout.split()[1])
    data = (tmp_path / RECORDS).read_bytes()
    assert data.endswith(b"\n")
    assert [json.loads(x)["id"] for x in data.splitlines()] == [f"ds/{i}" for i in range(n)]
