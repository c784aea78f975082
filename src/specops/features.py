"""The feature-shard format: one writer (`ShardWriter`), one reader (`FeatureReader`, and
`read_shard` / `read_split` for whole files), one fp8 (de)quantiser.

    features/<split>/shard-<rank>-<k>.safetensors (+ <name>.done sidecar), index.json

A shard is a safetensors file with, for its S samples of N tokens in all (`shard_layout`):
    offsets int64 [S+1], sample_index int64 [S] (position in build/<split>), input_ids int32 [N],
    aux [N, n_aux, H] and final [N, H] (bfloat16, or float8_e4m3fn with aux_scale float32 [N, n_aux]
    and final_scale float32 [N]), loss_mask uint8 [N].
`aux` holds the inputs to the aux layers (target.AUX_CONVENTION), `final` the last layer's output
before the final norm. fp8 scales are per token and per layer: x ~= q * scale (absmax / 448).
index.json (FORMAT, complete, aux_layer_ids, hidden_size, dtype, shards...) is written last.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import errno
import hashlib
import json
import logging
import os
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from .campaign import read_json
from .errors import InputError
from .target.conventions import AUX_CONVENTION

log = logging.getLogger("specops.features")

FORMAT = "specops-features-v1"
CONVENTION = AUX_CONVENTION
FP8_MAX = 448.0  # largest finite float8_e4m3fn

_STORE_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}
_ST_NAMES = {  # safetensors header dtype names
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
}
def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> (q float8_e4m3fn [..., H], scale float32 [...]) with x ~= q.float() * scale[..., None].

    scale = absmax over H / 448 (per token, per aux layer); an all-zero row gets scale 0 and q 0.
    """
    xf = x.float()
    scale = xf.abs().amax(-1) / FP8_MAX
    q = (xf / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.unsqueeze(-1)


def to_storage(aux: torch.Tensor, final: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """Features as stored in a shard: the tensors for keys aux, final (+ aux_scale, final_scale for fp8)."""
    if dtype == "bfloat16":
        return {"aux": aux.to(torch.bfloat16), "final": final.to(torch.bfloat16)}
    if dtype == "float8_e4m3fn":
        qa, sa = quantize_fp8(aux)
        qf, sf = quantize_fp8(final)
        return {"aux": qa, "aux_scale": sa, "final": qf, "final_scale": sf}
    raise ValueError(f"feature dtype: expected bfloat16 or float8_e4m3fn, got {dtype!r}")


def read_shard(path: str | os.PathLike[str], *, dequantize: bool = False) -> dict[str, torch.Tensor]:
    """Load a shard; with dequantize, fp8 aux/final come back as float32 (scales applied, keys dropped)."""
    from safetensors.torch import load_file

    t = load_file(str(path))
    if dequantize and "aux_scale" in t:
        t["aux"] = dequantize_fp8(t["aux"], t.pop("aux_scale"))
        t["final"] = dequantize_fp8(t["final"], t.pop("final_scale"))
    return t


def read_split(split_dir: str | os.PathLike[str], *, dequantize: bool = False) -> dict[int, dict[str, torch.Tensor]]:
    """features/<split>/ whole, by sample index: {sample: {input_ids, loss_mask, aux, final (+ the
    fp8 scales unless dequantize)}}, each a view of that sample's token rows. For inspection, tests
    and benches; training reads shards lazily (drafter/train.py FeatureSplit)."""
    split_dir = Path(split_dir)
    index = json.loads((split_dir / "index.json").read_text())
    out: dict[int, dict[str, torch.Tensor]] = {}
    for sh in index["shards"]:
        t = read_shard(split_dir / sh["name"], dequantize=dequantize)
        offs = t["offsets"].tolist()
        for j, si in enumerate(t["sample_index"].tolist()):
            out[si] = {k: v[offs[j]:offs[j + 1]] for k, v in t.items() if k not in ("offsets", "sample_index")}
    return out


def compare_splits(a_dir: str | os.PathLike[str], b_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Two extractions of the same build split (e.g. served vs in process; N processes vs one): the
    same samples with the same ids and masks (else ValueError naming them), and how far apart the
    features are. Per vector (one token, one layer), rel = |a - b| / |b| (L2 norms); reported per
    feature ("aux0".."auxN", "final") as the largest and the mean over tokens, with the largest
    absolute difference over everything and the count of bit-identical samples.

    Stored bf16 (8 significant bits): two fp32 computations that agree to ~1e-6 round each element
    to the same value or to neighbours one ulp (<= 2^-7 of the element) apart, so their vectors
    differ by at most 2^-7 relative; features from other layers differ by 1e-1 and more."""
    a, b = read_split(a_dir, dequantize=True), read_split(b_dir, dequantize=True)
    if sorted(a) != sorted(b):
        missing, extra = sorted(set(b) - set(a))[:10], sorted(set(a) - set(b))[:10]
        raise ValueError(f"{a_dir} and {b_dir} hold other samples (missing from the first: {missing}; "
                         f"missing from the second: {extra})")
    worst: dict[str, float] = {}
    sums: dict[str, float] = {}
    tokens, identical, max_abs = 0, 0, 0.0
    for i in sorted(a):
        for k in ("input_ids", "loss_mask"):
            if not torch.equal(a[i][k], b[i][k]):
                raise ValueError(f"sample {i}: {k} differs between {a_dir} and {b_dir}")
        x = torch.cat([a[i]["aux"].float(), a[i]["final"].float().unsqueeze(1)], 1)  # [T, n_aux + 1, H]
        y = torch.cat([b[i]["aux"].float(), b[i]["final"].float().unsqueeze(1)], 1)
        if not x.numel():
            identical += 1
            continue
        d = x - y
        max_abs = max(max_abs, d.abs().max().item())
        identical += bool((d == 0).all())
        rel = d.norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-12)  # [T, n_aux + 1]
        names = [f"aux{j}" for j in range(x.shape[1] - 1)] + ["final"]
        for j, name in enumerate(names):
            worst[name] = max(worst.get(name, 0.0), rel[:, j].max().item())
            sums[name] = sums.get(name, 0.0) + rel[:, j].sum().item()
        tokens += x.shape[0]
    return {"samples": len(a), "tokens": tokens, "samples_bit_identical": identical, "max_abs_diff": max_abs,
            "max_rel": worst, "mean_rel": {k: v / max(tokens, 1) for k, v in sums.items()}}


def feature_bytes_per_token(hidden_size: int, dtype: str, n_aux: int = 3) -> int:
    """Bytes per token in a shard: input_ids (4) + loss_mask (1) + (n_aux + 1) x H features (+ scales)."""
    if dtype == "bfloat16":
        return 5 + (n_aux + 1) * hidden_size * 2
    return 5 + (n_aux + 1) * hidden_size + (n_aux + 1) * 4


def shard_layout(n_tokens: int, n_samples: int, hidden_size: int, dtype: str, n_aux: int = 3):
    """(header bytes, {name: (dtype, shape, byte offset from the file start)}, total file bytes).

    Order: 8-byte types first and loss_mask last, so every tensor starts aligned to its element size.
    """
    fdt = _STORE_DTYPES[dtype]
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
        ("offsets", torch.int64, (n_samples + 1,)),
        ("sample_index", torch.int64, (n_samples,)),
    ]
    if dtype == "float8_e4m3fn":
        specs += [("aux_scale", torch.float32, (n_tokens, n_aux)), ("final_scale", torch.float32, (n_tokens,))]
    specs += [
        ("input_ids", torch.int32, (n_tokens,)),
        ("aux", fdt, (n_tokens, n_aux, hidden_size)),
        ("final", fdt, (n_tokens, hidden_size)),
        ("loss_mask", torch.uint8, (n_tokens,)),
    ]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    sizes = []
    for name, dt, shape in specs:
        n = dt.itemsize
        for d in shape:
            n *= d
        header[name] = {"dtype": _ST_NAMES[dt], "shape": list(shape), "data_offsets": [pos, pos + n]}
        sizes.append((name, dt, shape, pos))
        pos += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # data section 8-byte aligned, as safetensors pads it
    head = struct.pack("<Q", len(hb)) + hb
    layout = {name: (dt, shape, len(head) + off) for name, dt, shape, off in sizes}
    return head, layout, len(head) + pos


def _pwrite_all(fd: int, buf: Any, offset: int) -> None:
    mv = memoryview(buf).cast("B")
    while len(mv):
        n = os.pwrite(fd, mv, offset)  # Linux writes at most ~2 GiB per call
        mv = mv[n:]
        offset += n


# Eager writeback (see `resolve_writeback`): sync_file_range(2) through ctypes (Linux only).
def _libc_sync_file_range() -> Any:
    """libc's sync_file_range as a ctypes function (the call releases the GIL), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return fn


_sync_file_range = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait

# A shard's rows land in the page cache, and the kernel starts writing them to disk only past
# vm.dirty_background_ratio (10 % of RAM) or after 30 s: on a large host the disk idles while a
# shard is written and its fsync then has all of it to write. Eager writeback asks for the writeback
# of each range right after it is written, so the disk works from the first batch and the fsync
# only waits for what is still in flight. A hint: durability still comes from that fsync alone, and
# only SYNC_FILE_RANGE_WRITE is used (waiting through sync_file_range would advance the file's
# writeback-error cursor, and the fsync could then miss an earlier I/O error).
#
# `extract.eager_writeback` picks where the hint is given:
#   "async": by one flusher thread (`_flusher`), so the writer never waits on a busy disk queue;
#   "sync": by the writer thread itself, after each pwrite (costs the writer the calls' time);
#   "off": never; each shard's fsync writes it all;
#   "auto" (default): async where the process may use >= 8 CPUs, else off: on a 2-CPU machine the
#   extra thread competes with the writer and the digest (bench/extract_write_cpu.py measures it).
def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; the machine's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


WRITEBACK_MODES = ("auto", "async", "sync", "off")


def resolve_writeback(mode: str) -> str:
    """extract.eager_writeback -> "async" | "sync" | "off" for this process; "off" where the
    platform has no sync_file_range."""
    if mode not in WRITEBACK_MODES:
        raise ValueError(f"eager writeback: expected one of {', '.join(WRITEBACK_MODES)}, got {mode!r}")
    if mode == "auto":
        mode = "async" if _usable_cpus() >= 8 else "off"
    return mode if _sync_file_range is not None else "off"


_flusher_pool: concurrent.futures.ThreadPoolExecutor | None = None
_flusher_lock = threading.Lock()


def _flusher() -> concurrent.futures.ThreadPoolExecutor:
    """The process's one writeback thread (async mode), started on first use."""
    global _flusher_pool
    with _flusher_lock:
        if _flusher_pool is None:
            _flusher_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shard-writeback")
        return _flusher_pool


class ShardWriter:
    """Streams one shard: the header is known up front, rows land at their offsets (pwrite).

    Memory stays at one batch however large the shard; the file is a valid safetensors file
    once every row is written.
    """

    def __init__(self, path: Path, n_tokens: int, n_samples: int, hidden_size: int, dtype: str, *,
                 writeback: str = "off"):
        head, self.layout, self.nbytes = shard_layout(n_tokens, n_samples, hidden_size, dtype)
        self.path = path
        self.mode = resolve_writeback(writeback)  # eager writeback, see `resolve_writeback`
        self.writeback = self.mode != "off"
        self.flushes: collections.deque[concurrent.futures.Future] = collections.deque()  # async mode
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        # seconds the writer thread spent per part of the write path (the sidecar's "timings")
        self.timings = {"copy_wait": 0.0, "pwrite": 0.0, "writeback": 0.0}
        _pwrite_all(self.fd, head, 0)
        os.ftruncate(self.fd, self.nbytes)

    def byte_range(self, name: str, row: int, n: int) -> tuple[int, int]:
        """(file offset, length) of rows [row, row + n) of tensor `name`."""
        dt, shape, off = self.layout[name]
        row_bytes = dt.itemsize
        for d in shape[1:]:
            row_bytes *= d
        return off + row * row_bytes, n * row_bytes

    def write(self, name: str, row: int, t: torch.Tensor) -> None:
        """Write rows [row, row + len(t)) of tensor `name` (t on CPU, the stored dtype)."""
        dt, shape, _ = self.layout[name]
        assert t.dtype == dt and tuple(t.shape[1:]) == shape[1:] and row + len(t) <= shape[0], (name, t.shape)
        if t.numel() == 0:
            return
        start, nbytes = self.byte_range(name, row, len(t))
        t0 = time.perf_counter()
        _pwrite_all(self.fd, t.contiguous().view(torch.uint8).numpy(), start)
        t1 = time.perf_counter()
        self.timings["pwrite"] += t1 - t0
        if self.writeback:
            if self.mode == "async":  # the flusher thread asks; the writer goes on at once
                while self.flushes and self.flushes[0].done():
                    self.flushes.popleft()
                self.flushes.append(_flusher().submit(self._async_writeback, start, nbytes))
            else:
                self.writeback = self._start_writeback(start, nbytes)
            self.timings["writeback"] += time.perf_counter() - t1

    def _async_writeback(self, start: int, nbytes: int) -> None:
        """Flusher thread: one range's hint; after a failure this shard asks no more."""
        if self.writeback and self.fd >= 0:
            self.writeback = self._start_writeback(start, nbytes)

    def drain_writeback(self) -> None:
        """Drop the hints not yet given (the fsync that follows writes everything) and wait for the
        one being given, so that nothing uses the fd after this returns."""
        pending = [f for f in self.flushes if not f.cancel()]  # all at once: the flusher takes the next meanwhile
        self.flushes.clear()
        concurrent.futures.wait(pending)

    def _start_writeback(self, start: int, nbytes: int) -> bool:
        """Ask the kernel to start writing bytes [start, start + nbytes) to disk; False: stop asking."""
        if _sync_file_range(self.fd, start, nbytes, _SYNC_FILE_RANGE_WRITE) == 0:
            return True
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ESPIPE):  # those: unsupported here
            log.warning("%s: sync_file_range failed (%s); going on without eager writeback (the fsync "
                        "before the rename still reports any I/O error)", self.path.name, os.strerror(err))
        return False

    def close(self, *, sync: bool = True) -> None:
        if self.fd < 0:
            return
        self.drain_writeback()
        try:
            if sync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1


# A shard's digest: sha256 over the concatenated sha256 digests of its consecutive 64 MiB pieces (the
# last one shorter). Unlike one sha256 over the whole file, the pieces hash on several threads: a 2 GB
# bf16 shard takes ~2 s to hash whole on one core, and a window's shards all finish with its last
# batches, so a whole-file hash there is time the device waits. Sidecars and index entries name the
# kind they hold: "digest" (DIGEST_KIND) or a whole-file "sha256".
DIGEST_KIND = "sha256 of the sha256 digests of 64 MiB pieces"
DIGEST_UNIT = 64 << 20
_READ_CHUNK = 16 << 20
_digest_pool: concurrent.futures.ThreadPoolExecutor | None = None
_digest_lock = threading.Lock()
_digest_tls = threading.local()


def _digest_workers() -> concurrent.futures.ThreadPoolExecutor:
    global _digest_pool
    with _digest_lock:
        if _digest_pool is None:
            _digest_pool = concurrent.futures.ThreadPoolExecutor(max(1, _usable_cpus() // 2),
                                                                 thread_name_prefix="shard-digest")
        return _digest_pool


def _piece_digest(fd: int, offset: int, size: int) -> bytes:
    buf = getattr(_digest_tls, "buf", None)
    if buf is None:  # one reused read buffer per thread
        buf = _digest_tls.buf = bytearray(_READ_CHUNK)
    mv = memoryview(buf)
    h = hashlib.sha256()
    end = offset + size
    while offset < end:
        n = os.preadv(fd, [mv[:min(_READ_CHUNK, end - offset)]], offset)
        if n <= 0:
            raise OSError(f"short read at byte {offset} of a shard being hashed")
        h.update(mv[:n])  # hashlib drops the GIL for large blocks
        offset += n
    return h.digest()


def shard_digest(path: Path, *, unit: int = DIGEST_UNIT) -> str:
    """A shard file's digest (DIGEST_KIND): sha256(sha256(piece_0) + sha256(piece_1) + ...) over its
    consecutive `unit`-byte pieces, hashed side by side on a shared thread pool. An empty file is one
    empty piece. Independent check: hash each piece with any sha256 tool, then hash the 32-byte
    digests concatenated in order."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        offsets = range(0, size, unit) if size else [0]
        parts = list(_digest_workers().map(lambda off: _piece_digest(fd, off, min(unit, size - off)), offsets))
    finally:
        os.close(fd)
    return hashlib.sha256(b"".join(parts)).hexdigest()


class FeatureReader:
    """features/<split>/ read lazily: index.json checked, one open handle per shard, rows of a
    sample sliced on demand and fp8 dequantised by `dequantize_fp8`.

    `samples`: (shard, start, end) token rows of each sample, in shard order; `loss_masks(si)` the
    shard's whole loss mask (cheap: uint8 [N]).
    """

    def __init__(self, split_dir: str | os.PathLike[str]):
        self.dir = Path(split_dir)
        index = read_json(self.dir / "index.json")
        if index is None:
            raise InputError(f"{self.dir}/index.json not found: run `specops extract` first")
        if index.get("format") != FORMAT or not index.get("complete"):
            raise InputError(f"{self.dir}/index.json: not a complete {FORMAT} index")
        self.index = index
        self.aux_layer_ids = list(index["aux_layer_ids"])
        self.hidden_size = int(index["hidden_size"])
        self.final_prenorm = index.get("final", "pre-norm") == "pre-norm"
        self.fp8 = index.get("dtype") == "float8_e4m3fn"
        self.shards = [self.dir / s["name"] for s in index["shards"]]
        self._handles: dict[int, Any] = {}

    def _h(self, si: int) -> Any:
        from safetensors import safe_open

        if si not in self._handles:
            self._handles[si] = safe_open(str(self.shards[si]), "pt")
        return self._handles[si]

    def sample_spans(self, si: int) -> tuple[list[int], torch.Tensor]:
        """(offsets [S+1] as a list, loss_mask uint8 [N]) of shard si."""
        h = self._h(si)
        return h.get_tensor("offsets").tolist(), h.get_tensor("loss_mask")

    def rows(self, si: int, a: int, b: int, dtype: torch.dtype = torch.float32
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token rows [a, b) of shard si: (input_ids int64 [n], loss_mask uint8 [n], aux [n, n_aux, H],
        final [n, H]), features dequantised where stored in fp8, then cast to `dtype`."""
        h = self._h(si)
        aux, final = h.get_slice("aux")[a:b], h.get_slice("final")[a:b]
        if self.fp8:
            aux = dequantize_fp8(aux, h.get_slice("aux_scale")[a:b])
            final = dequantize_fp8(final, h.get_slice("final_scale")[a:b])
        return (h.get_slice("input_ids")[a:b].long(), h.get_slice("loss_mask")[a:b],
                aux.to(dtype), final.to(dtype))
