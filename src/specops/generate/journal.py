"""Exactly-once journal of one dataset: records.jsonl, failed.jsonl, quarantine.jsonl, stats.json.

Contract
- One JSON line per finished sample, written with a single `write(2)` of the whole line on an
  O_APPEND descriptor; fsync'd at a bounded interval (`fsync_interval_s`) and at close.
- At open, a torn last line (no trailing newline: the process or machine died mid-write, or the
  disk filled) is truncated away. Resume skips the ids found in records (done) and failed
  (parked), never "the first N lines".
- `stats.json` carries cumulative counters plus `journal_offset`, the size of records.jsonl it
  reflects. At open only the bytes after that offset are parsed in full; the rest of the journal is
  scanned for ids alone (a prefix slice per line), so resuming a 1M-record journal takes seconds.
- A write that fails part-way (ENOSPC) is rolled back with ftruncate and raised as `DiskFull`, so the
  journal stays whole and the runner stops cleanly.
"""

from __future__ import annotations

import bisect
import errno
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ..campaign import atomic_write_json, read_json
from ..errors import DiskFull

RECORDS = "records.jsonl"
FAILED = "failed.jsonl"
QUARANTINE = "quarantine.jsonl"
STATS = "stats.json"

_ID_PREFIX = b'{"id":"'


def dumps_line(obj: dict[str, Any]) -> bytes:
    return orjson.dumps(obj) + b"\n"


def repair_tail(path: Path) -> int:
    """Truncate a torn last line (bytes after the last newline). Returns bytes removed."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return 0
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        os.lseek(fd, size - 1, os.SEEK_SET)
        if os.read(fd, 1) == b"\n":
            return 0
        # Walk back in blocks to the last newline.
        pos, block = size, 1 << 16
        keep = 0
        while pos > 0:
            start = max(0, pos - block)
            os.lseek(fd, start, os.SEEK_SET)
            chunk = os.read(fd, pos - start)
            i = chunk.rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            pos = start
        os.ftruncate(fd, keep)
        os.fsync(fd)
        return size - keep
    finally:
        os.close(fd)


def _iter_lines(path: Path, start: int = 0, chunk: int = 1 << 22):
    """Yield (offset, line_bytes_without_newline) from `start`; the file ends with a newline."""
    with open(path, "rb") as f:
        f.seek(start)
        offset = start
        rest = b""
        while True:
            buf = f.read(chunk)
            if not buf:
                break
            buf = rest + buf
            lines = buf.split(b"\n")
            rest = lines.pop()
            for line in lines:
                yield offset, line
                offset += len(line) + 1
        if rest:
            yield offset, rest


def _fast_id(line: bytes) -> str | None:
    """The id of a record line we wrote (orjson puts "id" first, no spaces)."""
    if line.startswith(_ID_PREFIX):
        end = line.find(b'"', len(_ID_PREFIX))
        if end > 0:
            raw = line[len(_ID_PREFIX) : end]
            if b"\\" not in raw:
                return raw.decode("utf-8")
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return obj.get("id") if isinstance(obj, dict) else None


# Latency histogram: log-spaced bucket edges from 1 ms to ~3 h, 20 per decade. Percentiles from it
# are accurate to ~12 %, and it merges across runs without keeping every latency.
_EDGES = [10 ** (-3 + i / 20) for i in range(0, 20 * 7 + 1)]


@dataclass
class DatasetStats:
    done: int = 0
    failed: int = 0
    quarantined: int = 0
    truncated: int = 0  # finish_reason == "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_expected: int = 0  # records made with reasoning mode "save"
    reasoning_captured: int = 0  # ... of which carried non-empty reasoning
    finish_reasons: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)  # by kind, every failed attempt
    retries: int = 0
    latency_hist: list[int] = field(default_factory=lambda: [0] * (len(_EDGES) + 1))
    journal_offset: int = 0
    first_done_unix: float | None = None
    last_done_unix: float | None = None
    empty_input: bool = False  # the source yielded nothing at all (set by the run that read it)

    def add_record(self, rec: dict[str, Any]) -> None:
        self.done += 1
        fr = rec.get("finish_reason") or "unknown"
        self.finish_reasons[fr] += 1
        if fr == "length":
            self.truncated += 1
        usage = rec.get("usage") or {}
        self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        self.completion_tokens += int(usage.get("completion_tokens") or 0)
        if rec.get("reasoning_mode") == "save":
            self.reasoning_expected += 1
            if rec.get("reasoning"):
                self.reasoning_captured += 1
        lat = rec.get("latency_s")
        if isinstance(lat, (int, float)) and lat >= 0:
            self.latency_hist[bisect.bisect_left(_EDGES, lat)] += 1
        t = rec.get("finished_unix")
        if isinstance(t, (int, float)):
            self.first_done_unix = t if self.first_done_unix is None else min(self.first_done_unix, t)
            self.last_done_unix = t if self.last_done_unix is None else max(self.last_done_unix, t)

    def percentile(self, q: float) -> float | None:
        n = sum(self.latency_hist)
        if n == 0:
            return None
        rank = math.ceil(q / 100 * n)
        acc = 0
        for i, c in enumerate(self.latency_hist):
            acc += c
            if acc >= rank:
                return _EDGES[min(i, len(_EDGES) - 1)]
        return _EDGES[-1]

    def to_json(self, total: int | None = None) -> dict[str, Any]:
        return {
            "total": total,
            "done": self.done,
            "failed": self.failed,
            "quarantined": self.quarantined,
            "truncated": self.truncated,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "reasoning_expected": self.reasoning_expected,
            "reasoning_captured": self.reasoning_captured,
            "reasoning_capture_rate": (
                self.reasoning_captured / self.reasoning_expected if self.reasoning_expected else None
            ),
            "finish_reasons": dict(self.finish_reasons),
            "errors": dict(self.errors),
            "retries": self.retries,
            "latency_s": {f"p{q}": self.percentile(q) for q in (50, 90, 99)},
            "latency_hist": self.latency_hist,
            "journal_offset": self.journal_offset,
            "first_done_unix": self.first_done_unix,
            "last_done_unix": self.last_done_unix,
            "empty_input": self.empty_input,
            "written_unix": time.time(),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "DatasetStats":
        s = cls()
        for k in ("done", "truncated", "prompt_tokens", "completion_tokens", "reasoning_expected",
                  "reasoning_captured", "retries", "journal_offset"):
            setattr(s, k, int(d.get(k) or 0))
        s.finish_reasons = Counter(d.get("finish_reasons") or {})
        s.errors = Counter(d.get("errors") or {})
        hist = d.get("latency_hist")
        if isinstance(hist, list) and len(hist) == len(s.latency_hist):
            s.latency_hist = [int(x) for x in hist]
        s.first_done_unix = d.get("first_done_unix")
        s.last_done_unix = d.get("last_done_unix")
        return s


class Journal:
    """The files of one dataset under generate/<dataset>/."""

    def __init__(self, directory: Path, *, fsync_interval_s: float = 1.0):
        self.dir = Path(directory)
        self.fsync_interval_s = fsync_interval_s
        self.done_ids: set[str] = set()
        self.parked_ids: set[str] = set()  # in failed.jsonl: not retried unless asked
        self.quarantine_keys: set[str] = set()
        self.stats = DatasetStats()
        self.repaired_bytes: dict[str, int] = {}
        self.corrupt_lines = 0
        self._fds: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._dirty = False
        self._last_sync = time.monotonic()

    # ---------------------------------------------------------------- open / scan
    def open(self, *, retry_failed: bool = False) -> "Journal":
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in (RECORDS, FAILED, QUARANTINE):
            removed = repair_tail(self.dir / name)
            if removed:
                self.repaired_bytes[name] = removed
        if retry_failed and (self.dir / FAILED).exists():
            # Parked failures get another chance: archive (never delete) the old failed list.
            os.replace(self.dir / FAILED, self.dir / f"failed.{int(time.time())}.jsonl")
        self._scan_records()
        for _, line in self._lines(FAILED):
            obj = self._loads(line)
            if obj and obj.get("id"):
                self.parked_ids.add(obj["id"])
        self.parked_ids -= self.done_ids
        self.stats.failed = len(self.parked_ids)
        for _, line in self._lines(QUARANTINE):
            obj = self._loads(line)
            if obj and obj.get("where"):
                self.quarantine_keys.add(obj["where"])
        self.stats.quarantined = len(self.quarantine_keys)
        for name in (RECORDS, FAILED, QUARANTINE):
            path = self.dir / name
            self._fds[name] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._sizes[name] = os.fstat(self._fds[name]).st_size
        return self

    def _lines(self, name: str, start: int = 0):
        path = self.dir / name
        if not path.exists():
            return iter(())
        return _iter_lines(path, start)

    def _loads(self, line: bytes) -> dict[str, Any] | None:
        if not line.strip():
            return None
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            self.corrupt_lines += 1
            return None
        return obj if isinstance(obj, dict) else None

    def _scan_records(self) -> None:
        path = self.dir / RECORDS
        size = path.stat().st_size if path.exists() else 0
        saved = read_json(self.dir / STATS)
        offset = 0
        if saved and 0 < int(saved.get("journal_offset") or 0) <= size:
            self.stats = DatasetStats.from_json(saved)
            offset = self.stats.journal_offset
        else:
            self.stats = DatasetStats()
        done = self.done_ids
        for pos, line in self._lines(RECORDS):
            if pos < offset:
                rid = _fast_id(line)
                if rid is None:
                    if line.strip():
                        self.corrupt_lines += 1
                    continue
                done.add(rid)
                continue
            obj = self._loads(line)
            if obj is None or not obj.get("id") or obj["id"] in done:
                continue
            done.add(obj["id"])
            self.stats.add_record(obj)
        if len(done) != self.stats.done:
            # stats.json disagreed with the journal (e.g. copied from elsewhere): trust the journal.
            self.stats = DatasetStats()
            for _, line in self._lines(RECORDS):
                obj = self._loads(line)
                if obj and obj.get("id"):
                    self.stats.add_record(obj)
        self.stats.journal_offset = size

    # ---------------------------------------------------------------- append
    def _append(self, name: str, data: bytes) -> None:
        fd = self._fds[name]
        before = self._sizes[name]
        try:
            n = os.write(fd, data)
            if n != len(data):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as e:
            # Roll back a partial line so the journal never holds a torn record mid-file.
            try:
                os.ftruncate(fd, before)
            except OSError:
                pass
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise DiskFull(f"no space left writing {self.dir / name}: {e.strerror}") from e
            raise
        self._sizes[name] = before + len(data)
        self._dirty = True

    def append_record(self, rec: dict[str, Any]) -> None:
        assert next(iter(rec)) == "id", "record must start with its id (fast resume scan)"
        self._append(RECORDS, dumps_line(rec))
        self.done_ids.add(rec["id"])
        self.stats.add_record(rec)
        if rec["id"] in self.parked_ids:
            self.parked_ids.discard(rec["id"])
            self.stats.failed = len(self.parked_ids)

    def append_failed(self, entry: dict[str, Any]) -> None:
        self._append(FAILED, dumps_line(entry))
        self.parked_ids.add(entry["id"])
        self.stats.failed = len(self.parked_ids)

    def append_quarantine(self, entry: dict[str, Any]) -> None:
        if entry["where"] in self.quarantine_keys:
            return
        self._append(QUARANTINE, dumps_line(entry))
        self.quarantine_keys.add(entry["where"])
        self.stats.quarantined = len(self.quarantine_keys)

    # ---------------------------------------------------------------- durability
    def sync(self) -> None:
        if self._dirty:
            for fd in self._fds.values():
                os.fsync(fd)
            self._dirty = False
        self._last_sync = time.monotonic()

    def maybe_sync(self) -> None:
        if time.monotonic() - self._last_sync >= self.fsync_interval_s:
            self.sync()

    def write_stats(self, total: int | None) -> dict[str, Any]:
        """fsync the journal, then publish stats reflecting exactly its current size."""
        self.sync()
        self.stats.journal_offset = self._sizes.get(RECORDS, 0)
        data = self.stats.to_json(total)
        data["corrupt_lines"] = self.corrupt_lines
        atomic_write_json(self.dir / STATS, data, fsync=False)
        return data

    def close(self) -> None:
        try:
            self.sync()
        finally:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
