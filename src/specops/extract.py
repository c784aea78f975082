"""Extract: the target's hidden states for EAGLE-3 training, as feature shards.

    build/<split>.safetensors -> features/<split>/shard-<rank>-<k>.safetensors (+ <name>.done), index.json

What is captured (DESIGN, "EAGLE-3 conventions"):

* `aux` [N, 3, H]: the INPUTS to layers `aux_layer_ids` ("input-to-layer" = HF `output_hidden_states`
  index i; i = 0 is the embedding output, i = L the last layer's output). Forward pre-hooks on those
  layers copy them into one preallocated buffer, so the L+1 hidden states are never all held.
* `final` [N, H]: the last decoder layer's output BEFORE the final norm, taken as the norm's input
  by a pre-hook on it. HF's `hidden_states[-1]` cannot serve: transformers 5's `capture_outputs`
  replaces it with `last_hidden_state`, the norm's OUTPUT. Teacher logits = lm_head(norm(final)).

Only the decoder stack runs (never lm_head: [B, T, vocab] logits would dwarf the features).

Shard plan, a pure function of (build offsets, shard_tokens, world size, tail_split): samples in
build order are cut into consecutive runs of at most `shard_tokens` tokens (a longer sample is a
shard of its own; with tail_split = n > 1, runs that reach into the split's last W x shard_tokens
tokens are cut at shard_tokens // n, a shorter tail to wait on); global shard g belongs to rank
g % W as that rank's shard k = g // W. Right padding under a causal mask leaves every real token's
states exact (no real token attends to a later position), so batches pass no attention mask.

Batch windows (`extract.batch_window` = w): a rank's own shard list (k order) is cut into
consecutive windows of w shards (`plan_windows`); the samples of a window are sorted longest first
and packed into forward batches of <= token_budget padded tokens (`plan_window_batches`), so a batch
holds rows of several shards and far fewer padded tokens than one shard's ~25 samples would allow.
Each row is written at its offset in its own shard; a shard goes to the finalizer right after the
last batch holding its rows, and its sidecar's `padded_tokens` sums the padded length of the batch
of each of its rows. w = 1 is the per-shard batching of runs from before windows, bit for bit.
Default w = 8: on the H200 bench's shape (160 samples of 512..4096 tokens, 64K-token shards,
32K-token batches) padding falls from 18.7 % of the forwards (18 batches) to 5.4 % (13, the global
plan's); on a long run of such lengths from 18 % to 4.7 %, where 16 would gain ~2 points more while
doubling what a window costs: its shards open at once (w x 2.1 GB of page cache for an 8B-shaped
target), its shards' finalizes bunched at its end, and up to a window per rank redone after a kill.

Determinism: bf16 forwards are not batch-invariant (a row's features can change in the last bits
with the other rows of its batch and the padded length), so a shard's bytes are kept a function of
the plan alone, never of where an earlier run stopped: windows are a fixed function of the shard
plan and w, a window's batches a fixed function of its samples, and a window with unfinished shards
is computed with the SAME batches as an uninterrupted run (rows of its finished shards are dropped,
batches holding nothing else skipped); a window whose shards are all finished is skipped. w changes
the batches, so it is part of the plan key (w = 1 leaves it out: older plans keep their keys).

Resume: a shard is finished when its file and `<name>.done` both exist and the file has the size
the sidecar records. The sidecar (digest, bytes, plan key, timings) is written BEFORE the temp file
`.<name>.tmp` is renamed, so the final name only ever appears complete. Finished shards are skipped,
never rewritten; shards of a different plan (other layers, dtype, model, build, world size, batch
window) are refused. Rank 0 writes `index.json` last, atomically, once every rank has passed the
final barrier.

Pipelining (`_Pipeline`): the main thread only launches work. Batch features go device->host into
pinned slots without a sync, on a copy stream beside the compute stream; a writer thread pwrites
each row into its shard once the copy is done (and a flusher thread asks the kernel to start
writing each range to disk at once, `extract.eager_writeback`); a pool of finalizer threads fsyncs, digests
(`shard_digest`: 64 MiB pieces on a shared pool), writes the
sidecar and renames shards side by side while the next batches compute. The bytes and the order
sidecar-then-rename are as above; a run joins every thread before any index, barrier or error exit,
and a failure in any is raised by `run_extract`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import datetime
import errno
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .campaign import Campaign, atomic_write_json, now_iso, read_json, sha256_file
from .config import Config
from .errors import ConfigError, DiskFull, InputError, SpecopsError
from .features import (
    CONVENTION,
    DIGEST_KIND,
    FORMAT,
    ShardWriter,
    _usable_cpus,
    feature_bytes_per_token,
    shard_digest,
    shard_layout,
    to_storage,
)
from .models import resolve_dtype, resolve_model_dir
from .progress import ROUTINE, phase_progress
from .target import default_aux_layer_ids, read_text_config
from .target.inprocess import TargetModel, compute_features, load_target
from .target.served import ServedTarget

log = logging.getLogger("specops.extract")

SPLITS = ("train", "val")


# ---------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Shard:
    g: int  # global shard number (build order)
    rank: int
    k: int  # this rank's shard number
    start: int  # sample rows [start, stop) of build/<split>
    stop: int
    tok_start: int  # token range [tok_start, tok_stop) of build/<split>
    tok_stop: int

    @property
    def name(self) -> str:
        return f"shard-{self.rank:02d}-{self.k:05d}.safetensors"

    @property
    def n_tokens(self) -> int:
        return self.tok_stop - self.tok_start

    @property
    def n_samples(self) -> int:
        return self.stop - self.start


def plan_shards(offsets: Sequence[int], shard_tokens: int, world_size: int, tail_split: int = 1) -> list[Shard]:
    """Cut samples (build order) into runs of <= shard_tokens tokens; global shard g -> rank g % W.
    tail_split > 1: a run that would reach into the split's last world_size * shard_tokens tokens is
    cut at shard_tokens // tail_split instead, so each rank's final shard (whose fsync + hash nothing
    overlaps) is that many times smaller."""
    if shard_tokens <= 0 or world_size <= 0 or tail_split <= 0:
        raise ValueError("shard_tokens, world_size and tail_split must be > 0")
    offs = [int(o) for o in offsets]
    S = len(offs) - 1
    tail_from = offs[-1] - world_size * shard_tokens
    shards: list[Shard] = []
    start = 0
    while start < S:
        cap = shard_tokens
        if tail_split > 1 and offs[start] + shard_tokens > tail_from:
            cap = max(1, shard_tokens // tail_split)
        stop = start + 1
        while stop < S and offs[stop + 1] - offs[start] <= cap:
            stop += 1
        g = len(shards)
        shards.append(Shard(g, g % world_size, g // world_size, start, stop, offs[start], offs[stop]))
        start = stop
    return shards


def plan_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices into `lengths`, longest first, packed so len(batch) * max length <= token_budget.

    A sample longer than the budget runs alone. Longest first: an out-of-memory shows in the first
    batch, not hours in. Zero-length samples are left out (nothing to compute).
    """
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > token_budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def plan_windows(shards: Sequence[Shard], batch_window: int) -> list[list[Shard]]:
    """A rank's shards (its whole list, k order; finished ones too) cut into consecutive windows of
    `batch_window` shards (the last may be shorter). A fixed function of the plan: never of which
    shards a run finds finished, so a resumed window is the window of an uninterrupted run."""
    if batch_window <= 0:
        raise ValueError(f"batch_window must be > 0, got {batch_window}")
    return [list(shards[i : i + batch_window]) for i in range(0, len(shards), batch_window)]


def plan_window_batches(
    window: Sequence[Shard], offsets: Sequence[int], token_budget: int
) -> list[list[tuple[int, int]]]:
    """The forward batches of one window: `plan_batches` over the lengths of its samples (window
    order: shard by shard, build order inside), each row as (shard position in the window, sample
    row in that shard). A window of one shard gives that shard's `plan_batches`, row for row."""
    rows = [(p, j) for p, s in enumerate(window) for j in range(s.n_samples)]
    lengths = [int(offsets[window[p].start + j + 1]) - int(offsets[window[p].start + j]) for p, j in rows]
    return [[rows[i] for i in b] for b in plan_batches(lengths, token_budget)]


# ---------------------------------------------------------------------------------------- run


@dataclass
class _Split:
    name: str
    build_path: Path
    out_dir: Path
    offsets: torch.Tensor  # int64 [S+1]
    shards: list[Shard]
    plan: dict[str, Any]
    plan_key: str

    def done_path(self, s: Shard) -> Path:
        return self.out_dir / (s.name + ".done")

    def refusal(self, name: str, other: Any) -> str:
        """Why a shard of another plan is refused: what differs, and how to go on."""
        other = other if isinstance(other, dict) else {}
        keys = sorted(set(other) | set(self.plan), key=str)
        diff = [k for k in keys if other.get(k) != self.plan.get(k)]
        shown = {"batch_window": 1, "tail_split": 1}  # left out of a plan at their value 1

        def val(plan: dict, k: str) -> Any:
            return plan.get(k, shown.get(k, "absent"))

        what = "; ".join(f"{k}: {val(other, k)!r} there, {val(self.plan, k)!r} now" for k in diff)
        hint = f"Remove {self.out_dir} to extract again"
        if diff == ["batch_window"]:
            hint = f"Set extract.batch_window = {val(other, 'batch_window')} to resume it, or remove {self.out_dir}"
        return (f"{self.out_dir}: {name} belongs to another extraction plan (differs in {what or 'its key'}; "
                f"its plan: {other or None}; this run's plan: {self.plan}). {hint}.")

    def finished(self, s: Shard, nbytes: int) -> dict[str, Any] | None:
        """The sidecar of a finished shard of this plan, or None. A foreign plan's shard is refused."""
        done = read_json(self.done_path(s))
        if done is None:
            return None
        if done.get("plan_key") != self.plan_key:
            raise SpecopsError(self.refusal(s.name, done.get("plan")))
        path = self.out_dir / s.name
        if not path.is_file() or path.stat().st_size != nbytes or done.get("bytes") != nbytes:
            return None
        return done


def _dist_env() -> tuple[int, int, int]:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    return rank, world, local


def _model_fingerprint(model_dir: Path) -> str:
    # config.json bytes + weight file names and sizes: changes when the target does, costs no reads.
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for p in sorted(model_dir.iterdir()):
        if p.suffix in (".safetensors", ".bin", ".pt"):
            h.update(f"{p.name}:{p.stat().st_size}".encode())
    return h.hexdigest()[:16]


HEARTBEAT_S = 10.0  # rank 0 writes run/heartbeat.json at least this often while extract runs


class _Heartbeat:
    """run/heartbeat.json for `specops status` while extract runs: per split, the shards and tokens
    finished of the plan (every rank's: `.done` sidecars in the shared split dirs), the rate since
    this run began and the ETA. Rank 0 writes it from a thread, so it keeps beating while the rank
    waits at a barrier for the others."""

    def __init__(self, campaign: Campaign, splits: list[_Split], interval: float = HEARTBEAT_S):
        self.campaign, self.splits, self.interval = campaign, splits, interval
        self.started = time.time()
        self.tokens0: int | None = None  # tokens finished when this run began (a resume starts mid-way)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def progress(self) -> dict[str, dict[str, int]]:
        out = {}
        for sp in self.splits:
            names = {p.name[: -len(".done")] for p in sp.out_dir.glob("*.done")} if sp.out_dir.is_dir() else set()
            done = [s for s in sp.shards if s.name in names]
            out[sp.name] = {"shards_done": len(done), "shards": len(sp.shards),
                            "tokens_done": sum(s.n_tokens for s in done),
                            "tokens": sum(s.n_tokens for s in sp.shards)}
        return out

    def beat(self, state: str = "running") -> dict[str, Any]:
        now = time.time()
        prog = self.progress()
        done = sum(v["tokens_done"] for v in prog.values())
        left = sum(v["tokens"] - v["tokens_done"] for v in prog.values())
        if self.tokens0 is None:
            self.tokens0 = done
        rate = (done - self.tokens0) / (now - self.started) if now > self.started and done > self.tokens0 else None
        hb = {"pid": os.getpid(), "phase": "extract", "state": state, "ts": now, "iso": now_iso(),
              "started": self.started, "splits": prog, "window": {"tokens_per_s": rate},
              "eta_s": round(left / rate, 1) if rate else (0.0 if not left else None)}
        atomic_write_json(self.campaign.heartbeat_path, hb, fsync=False)
        return hb

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except OSError as e:  # a full disk must not kill extraction over a status file
                log.warning("extract heartbeat: %s", e)

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._run, name="extract-heartbeat", daemon=True)
        self._thread.start()

    def stop(self, state: str) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(OSError):
            self.beat(state)


def _open_split(
    campaign: Campaign,
    split: str,
    *,
    shard_tokens: int,
    world: int,
    plan_base: dict[str, Any],
    tail_split: int = 1,
    batch_window: int = 1,
) -> _Split:
    from safetensors import safe_open

    build = campaign.root / "build"
    path = build / f"{split}.safetensors"
    if not path.is_file():
        raise InputError(f"{path}: not found; run `specops build` first")
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        missing = {"input_ids", "loss_mask", "offsets"} - keys
        if missing:
            raise InputError(f"{path}: missing tensors {sorted(missing)}")
        offsets = f.get_tensor("offsets").to(torch.int64)
        n_ids = f.get_slice("input_ids").get_shape()[0]
        n_mask = f.get_slice("loss_mask").get_shape()[0]
    if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != n_ids or n_mask != n_ids:
        raise InputError(f"{path}: offsets do not cover input_ids/loss_mask ({n_ids} tokens, {n_mask} mask)")
    if bool((offsets.diff() < 0).any()):
        raise InputError(f"{path}: offsets are not non-decreasing")
    ids_path = build / f"{split}.ids.jsonl"
    if ids_path.is_file():
        with open(ids_path, "rb") as f:
            n_lines = sum(1 for line in f if line.strip())
        if n_lines != len(offsets) - 1:
            raise InputError(f"{ids_path}: {n_lines} ids for {len(offsets) - 1} samples in {path.name}")
    plan = dict(plan_base, build_sha256=sha256_file(path), shard_tokens=shard_tokens, world_size=world, split=split)
    if tail_split > 1:  # only then: plans (and keys) of uniform runs stay as they were
        plan["tail_split"] = tail_split
    if batch_window > 1:  # windows change the batches, so the bytes; 1: the plans (keys) from before
        plan["batch_window"] = batch_window
    key = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]
    return _Split(
        name=split,
        build_path=path,
        out_dir=campaign.root / "features" / split,
        offsets=offsets,
        shards=plan_shards(offsets.tolist(), shard_tokens, world, tail_split),
        plan=plan,
        plan_key=key,
    )


def _check_extract_config(cfg: Config) -> None:
    x = cfg.extract
    if x.mode == "served" and not x.server_urls:  # extract would start [serve] serving hidden states
        from .auth import check_exposure

        check_exposure(cfg, features=True)
    if x.token_budget <= 0:
        raise ConfigError(f"extract.token_budget: must be > 0, got {x.token_budget}")
    if x.shard_tokens <= 0:
        raise ConfigError(f"extract.shard_tokens: must be > 0, got {x.shard_tokens}")
    if x.tail_split <= 0:
        raise ConfigError(f"extract.tail_split: must be > 0, got {x.tail_split}")
    if isinstance(x.batch_window, bool) or not isinstance(x.batch_window, int) or x.batch_window < 1:
        raise ConfigError(f"extract.batch_window: must be an integer >= 1, got {x.batch_window!r}")
    if x.aux_layer_ids is not None and len(x.aux_layer_ids) != 3:
        raise ConfigError(f"extract.aux_layer_ids: EAGLE-3 takes exactly 3 layers, got {x.aux_layer_ids}")
    if isinstance(x.served_concurrency, bool) or not isinstance(x.served_concurrency, int) or x.served_concurrency < 1:
        raise ConfigError(f"extract.served_concurrency: must be an integer >= 1, got {x.served_concurrency!r}")
    for i, url in enumerate(x.server_urls):
        if not url.startswith(("http://", "https://")) or not url.rstrip("/").endswith("/v1"):
            raise ConfigError(f"extract.server_urls[{i}]: expected the OpenAI base URL ending in /v1, got {url!r}")
    if x.server_urls and x.mode != "served":
        raise ConfigError("extract.server_urls: only with extract.mode = \"served\"")
    if x.mode == "served" and cfg.serve.engine == "sglang":  # target/served_sglang.py
        from .target.served_sglang import sglang_family_problem, sglang_ids_problem

        if x.served_dir is not None:
            raise ConfigError("extract.served_dir: SGLang returns the states in each /generate response and "
                              "writes no files (served_dir is for vLLM's connector); remove it")
        problem = sglang_ids_problem(x.aux_layer_ids) if x.aux_layer_ids is not None else None
        if problem:
            raise ConfigError(f"extract.aux_layer_ids: {problem}")
        config_json = resolve_model_dir(cfg.target.model) / "config.json"  # the config alone, no weights
        try:
            problem = sglang_family_problem(json.loads(config_json.read_text()))
        except (OSError, ValueError) as e:
            raise ConfigError(f"target.model: cannot read {config_json} ({e})") from None
        if problem:
            raise ConfigError(f"serve.engine = \"sglang\": {problem}")


# Pipeline bounds (see `_Pipeline`). Pinned slots: each holds one batch's features (about
# token_budget x bytes/token, ~1 GiB for an 8B target in bf16 at 32K tokens).
_STAGING_SLOTS = 3
# Windows of shards written but not yet finalized, at most (x batch_window shards): a window's
# shards all reach the finalizers within its last batches, and may do so while the previous
# window's are still being hashed.
_FINALIZE_DEPTH = 2
_STAGE_CPU = False  # tests: run the staging-slot path on CPU too (plain buffers, no events)


@dataclass(eq=False)
class _ShardJob:
    """A shard being written: its temp file's writer and the write jobs queued for it."""

    shard: Shard
    writer: ShardWriter
    tmp: Path
    t0: float
    writes: list[concurrent.futures.Future]
    padded: int = 0  # sum over its rows of their batch's padded length
    wait: float = 0.0  # seconds the main thread waited for the writer (a free staging slot), its rows' share
    busy: float | None = None  # main-thread seconds spent on its rows (their share of each batch); None: t0 on
    queued: float | None = None  # when its last row was queued (`finish_shard`)


# A batch's rows for the writer: (shard job, row in the batch, row offset in the shard, n tokens).
_Route = tuple[_ShardJob, int, int, int]


class _Pipeline:
    """Keeps the device busy while a run writes, hashes and syncs shards.

    Main thread: builds a batch, launches its forward, queues the device->host copy of its features
    and hands the rows to the writer thread, each for its own shard; then goes on to the next batch
    at once. Writer thread (one, FIFO; a file's buffered writes serialize on its inode lock in ext4
    and XFS anyway): waits for the batch's copy (a CUDA event), pwrites each row into its shard (and
    has its writeback started, by the flusher thread or itself: `extract.eager_writeback`). Finalizers (a pool of
    min(batch_window, usable CPUs // 2) threads, at least one): once a shard's writes are done,
    fsync + sha256 it, write the sidecar, rename. A window's shards finish within its last batches,
    so their read-backs (~1.9 s per 2 GB shard) run side by side rather than one after another.

    CUDA: features are copied non_blocking into a few pinned host slots, reused (pinning is costly),
    on a copy stream of their own (overlapping the next forward); a slot is handed out again only
    when the writer is done with it, so at most `_STAGING_SLOTS` batches are in flight. CPU: the
    features are already on the host; one batch is written while the next computes. At most
    `_FINALIZE_DEPTH` x batch_window shards wait for or run their finalize.

    Errors: a failed write or finalize is re-raised on the main thread (at the next batch or shard,
    or at `join`). `abort` waits for every queued job, so no thread touches a shard after it returns.
    """

    def __init__(self, device: torch.device, token_budget: int, batch_window: int = 1, *, writeback: str = "off"):
        self.device = device
        self.writeback = writeback  # extract.eager_writeback, for every shard writer
        self.pinned = device.type == "cuda"
        staged = self.pinned or _STAGE_CPU
        self.slots: list[dict[str, torch.Tensor]] | None = [{} for _ in range(_STAGING_SLOTS)] if staged else None
        self.free = collections.deque(range(_STAGING_SLOTS)) if staged else collections.deque()
        self.max_inflight = _STAGING_SLOTS if staged else 1
        self.min_tokens = token_budget  # a slot grows past one token budget only for a longer lone sample
        self.finalize_depth = _FINALIZE_DEPTH * batch_window
        self.writes: collections.deque[tuple[concurrent.futures.Future, int | None]] = collections.deque()
        self.finals: collections.deque[concurrent.futures.Future] = collections.deque()
        self.completed: list[dict[str, Any]] = []  # sidecars of shards finalized since `take_done`
        self.open: list[_ShardJob] = []  # shards being written (no finalize owns them yet)
        # CUDA: the device->host copies go on a stream of their own, so the copy engine moves batch
        # i's features while the compute stream already runs batch i+1's forward (on the compute
        # stream, each copy held up the next forward for its whole duration).
        self.copy_stream = torch.cuda.Stream(device) if self.pinned else None
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shard-writer")
        n_final = min(batch_window, max(1, _usable_cpus() // 2))
        self._finalizer = concurrent.futures.ThreadPoolExecutor(n_final, thread_name_prefix="shard-finalize")

    # -- batches

    def input_ids(self, rows: list[torch.Tensor], T: int) -> torch.Tensor:
        """[B, T] long, right-padded with id 0; on CUDA uploaded from pinned memory without a sync."""
        x = torch.zeros(len(rows), T, dtype=torch.long, pin_memory=self.pinned)
        for b, r in enumerate(rows):
            x[b, : len(r)] = r
        # The host block is not reused before the copy is done (the caching host allocator records it).
        return x.to(self.device, non_blocking=True) if self.pinned else x

    def write_batch(self, routes: list[_Route], feats: dict[str, torch.Tensor]) -> None:
        """Queue rows (shard job, b, row offset in that shard, n tokens) of batch features `feats`
        [B, T, ...]; rows of several shards share the batch's one staging slot."""
        self.poll()
        t0 = time.perf_counter()
        while len(self.writes) >= self.max_inflight:  # bound the batches in flight; frees a slot
            self._reclaim()
        wait = time.perf_counter() - t0
        B = next(iter(feats.values())).shape[0]
        groups: dict[int, tuple[_ShardJob, list[tuple[int, int, int]]]] = {}
        for job, b, row, n in routes:
            job.wait += wait / B  # each row's share
            groups.setdefault(id(job), (job, []))[1].append((b, row, n))
        slot, event = None, None
        if self.slots is None:
            feats = {k: v.cpu() for k, v in feats.items()}  # CPU: no copy
        else:
            slot = self.free.popleft()
            feats, event = self._stage(self.slots[slot], feats)
        work = [(job.writer, rows) for job, rows in groups.values()]
        fut = self._writer.submit(_write_batch, work, feats, event)
        for job, _ in groups.values():
            job.writes.append(fut)
        self.writes.append((fut, slot))

    def _stage(self, bufs: dict[str, torch.Tensor], feats: dict[str, torch.Tensor]):
        out = {}
        copy_ctx: Any = contextlib.nullcontext()
        if self.copy_stream is not None:
            # The copies start only once the compute stream has produced `feats` (everything queued
            # on it so far: the forward, the casts), then run beside the next forward.
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            copy_ctx = torch.cuda.stream(self.copy_stream)
        with copy_ctx:
            for key, v in feats.items():
                need = v.numel() * v.element_size()
                buf = bufs.get(key)
                if buf is None or buf.numel() < need:
                    per_token = need // (v.shape[0] * v.shape[1])
                    bufs.pop(key, None)
                    del buf  # drop the old block before taking a bigger one
                    buf = bufs[key] = torch.empty(
                        max(need, per_token * self.min_tokens), dtype=torch.uint8, pin_memory=self.pinned
                    )
                dst = buf[:need].view(v.dtype).view(v.shape)
                dst.copy_(v, non_blocking=self.pinned)
                if self.copy_stream is not None:
                    # `v` belongs to the compute stream's pool: without this, its memory could go to
                    # the next forward (freed when the caller drops `feats`) before the copy read it.
                    v.record_stream(self.copy_stream)
                out[key] = dst
        event = None
        if self.copy_stream is not None:
            # The writer waits on this (blocking: it sleeps rather than spins) before it reads the slot.
            event = torch.cuda.Event(blocking=True)
            event.record(self.copy_stream)
        return out, event

    def _reclaim(self) -> None:
        fut, slot = self.writes.popleft()
        fut.result()  # a failed write surfaces here
        if slot is not None:
            self.free.append(slot)

    # -- shards

    def start_shard(self, job: _ShardJob) -> None:
        self.poll()
        self.open.append(job)

    def finish_shard(self, sp: _Split, job: _ShardJob) -> None:
        """Hand a shard whose rows are all queued to the finalizers; waits only while
        `finalize_depth` shards are ahead of it."""
        self.open.remove(job)  # the finalize owns the writer now (it closes it)
        job.queued = time.perf_counter()
        self.finals.append(self._finalizer.submit(_finalize_shard, sp, job))
        while len(self.finals) > self.finalize_depth:
            concurrent.futures.wait(self.finals, return_when=concurrent.futures.FIRST_COMPLETED)
            self.poll()
        self.poll()

    def poll(self) -> None:
        """Collect finished finalizes (any of the pool's, in queue order) without waiting; re-raise
        the first failure."""
        if not any(f.done() for f in self.finals):
            return
        for f in [f for f in self.finals if f.done()]:
            self.completed.append(f.result())  # a failure raises with the future still queued
            self.finals.remove(f)

    def take_done(self) -> list[dict[str, Any]]:
        done, self.completed = self.completed, []
        return done

    def join(self) -> list[dict[str, Any]]:
        """Wait for every queued write and finalize (before an index or barrier); re-raise a failure."""
        while self.writes:
            self._reclaim()
        while self.finals:
            self.completed.append(self.finals[0].result())
            self.finals.popleft()
        return self.take_done()

    def abort(self) -> None:
        """After an error or interrupt: let every queued job end, then close the unfinished shards.

        Finalizes already queued still run (their shards then count as finished on the next run);
        their errors are logged, the caller re-raises its own.
        """
        for fut, _ in self.writes:
            concurrent.futures.wait([fut])
        self.writes.clear()
        for job in self.open:
            concurrent.futures.wait(job.writes)
            job.writer.close(sync=False)  # its temp file stays for the next run to overwrite
        self.open.clear()
        for fut in self.finals:
            concurrent.futures.wait([fut])
            if not fut.cancelled() and fut.exception() is not None:
                log.error("finalizing a shard failed: %r", fut.exception())
        self.finals.clear()

    def shutdown(self) -> None:
        self._writer.shutdown(wait=True)
        self._finalizer.shutdown(wait=True)


def _write_batch(
    groups: list[tuple[ShardWriter, list[tuple[int, int, int]]]], feats: dict[str, torch.Tensor], event: Any
) -> None:
    """Writer thread: one batch's rows, each shard's rows through `_write_rows` with its writer."""
    if event is not None:
        t0 = time.perf_counter()
        event.synchronize()  # the device->host copy of these features is complete
        dt = time.perf_counter() - t0
        n = sum(len(rows) for _, rows in groups)
        for w, rows in groups:  # each shard's share: its rows'
            w.timings["copy_wait"] += dt * len(rows) / n
    for w, rows in groups:
        _write_rows(w, rows, feats, None)


def _write_rows(
    w: ShardWriter, rows: list[tuple[int, int, int]], feats: dict[str, torch.Tensor], event: Any
) -> None:
    """Rows (b, row offset in w's shard, n tokens) of batch features `feats` [B, T, ...] into w."""
    if event is not None:
        t0 = time.perf_counter()
        event.synchronize()  # the device->host copy of these features is complete
        w.timings["copy_wait"] += time.perf_counter() - t0
    for b, row, n in rows:
        for key, t in feats.items():
            w.write(key, row, t[b, :n])


def _extract_window(
    pipe: _Pipeline,
    target: TargetModel,
    sp: _Split,
    window: list[Shard],
    todo: set[int],
    layer_ids: list[int],
    dtype: str,
    token_budget: int,
    offsets: list[int],
) -> None:
    """Compute one window (`plan_window_batches`) and queue the writes of its shards in `todo`
    (global numbers), each shard's finalize right after its last row; returns once all is queued.

    The whole window's batches are the batches of an uninterrupted run, whichever of its shards are
    finished: their rows are dropped, and a batch holding nothing else is skipped.
    """
    from safetensors import safe_open

    H = target.hidden_size
    t0 = time.perf_counter()
    batches = plan_window_batches(window, offsets, token_budget)
    local = [[o - offsets[s.start] for o in offsets[s.start : s.stop + 1]] for s in window]  # shard-local offsets
    ids: list[torch.Tensor] = []
    jobs: dict[int, _ShardJob] = {}  # window position -> the job of a shard to write
    with safe_open(str(sp.build_path), framework="pt") as f:
        for p, s in enumerate(window):
            ids.append(f.get_slice("input_ids")[s.tok_start : s.tok_stop].to(torch.int32))
            if s.g not in todo:
                continue  # finished: its samples still join their batches, its rows are dropped
            mask = f.get_slice("loss_mask")[s.tok_start : s.tok_stop].to(torch.uint8)
            tmp = sp.out_dir / f".{s.name}.tmp"
            w = ShardWriter(tmp, s.n_tokens, s.n_samples, H, dtype, writeback=pipe.writeback)
            job = jobs[p] = _ShardJob(shard=s, writer=w, tmp=tmp, t0=t0, writes=[], busy=0.0)
            pipe.start_shard(job)  # from here on, `pipe.abort` closes the writer
            w.write("input_ids", 0, ids[p])
            w.write("loss_mask", 0, mask)
            w.write("offsets", 0, torch.tensor(local[p], dtype=torch.int64))
            w.write("sample_index", 0, torch.arange(s.start, s.stop, dtype=torch.int64))
    if not jobs:
        return
    last: dict[int, int] = {}  # window position -> index of the last batch holding one of its rows
    for bi, batch in enumerate(batches):
        for p, _ in batch:
            last[p] = bi
    ends: dict[int, list[int]] = collections.defaultdict(list)  # batch index -> shards complete after it
    for p in jobs:
        ends[last.get(p, -1)].append(p)
    clock = time.perf_counter()
    for job in jobs.values():  # the window's set-up, shared out
        job.busy = (clock - t0) / len(jobs)
    for p in ends.pop(-1, []):  # no rows to compute (empty samples only): complete already
        pipe.finish_shard(sp, jobs[p])
    for bi, batch in enumerate(batches):
        routes = [(jobs[p], b, local[p][j], local[p][j + 1] - local[p][j])
                  for b, (p, j) in enumerate(batch) if p in jobs]  # fmt: skip
        if routes:  # else: rows of finished shards only, nothing to write
            rows = [ids[p][local[p][j] : local[p][j + 1]] for p, j in batch]
            T = len(rows[0])  # longest first: the batch max
            if isinstance(target, ServedTarget):  # one request per sample; finished shards' rows are not sent
                x = None
                f = target.rows_features([r if p in jobs else None for r, (p, _) in zip(rows, batch)], T)
            else:
                x = pipe.input_ids(rows, T)
                f = compute_features(target, x, layer_ids=layer_ids)
            stored = to_storage(f["aux"], f["final"], dtype)
            del f, x
            pipe.write_batch(routes, stored)
            del stored
            now = time.perf_counter()
            for job, *_ in routes:  # each row: its batch's padded length, its share of the batch's time
                job.padded += T
                job.busy += (now - clock) / len(batch)
            clock = now
        for p in ends.get(bi, ()):
            pipe.finish_shard(sp, jobs[p])


def _extract_shard(
    pipe: _Pipeline, target: TargetModel, sp: _Split, s: Shard, layer_ids: list[int], dtype: str, token_budget: int
) -> None:
    """One shard as a window of its own (batch_window 1; bench/extract_write_cpu.py drives this)."""
    _extract_window(pipe, target, sp, [s], {s.g}, layer_ids, dtype, token_budget, sp.offsets.tolist())


def _timed(fn: Callable[..., Any], *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _finalize_shard(sp: _Split, job: _ShardJob) -> dict[str, Any]:
    """Finalizer thread: wait for the shard's writes, fsync + digest, sidecar, THEN rename; returns the sidecar."""
    s, w, tmp = job.shard, job.writer, job.tmp
    try:
        for fut in job.writes:
            fut.result()
        if job.busy is None or job.queued is None:
            seconds = time.perf_counter() - job.t0
        else:  # its share of the window's main-thread time, then the wait for its last writes
            seconds = job.busy + time.perf_counter() - job.queued
        w.drain_writeback()  # hints still queued for this shard: its fsync does their work now
        t1 = time.perf_counter()
        # The read-back hashes the bytes while they are still in the page cache; the fsync runs
        # alongside it. Both finish before the sidecar exists. Rows arrive longest sample first
        # while aux and final are separate regions, so no prefix of the file is complete before the
        # shard is: the digest is taken here, once it is complete (off the main thread), its 64 MiB
        # pieces side by side (shard_digest).
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shard-fsync") as ex:
            synced = ex.submit(_timed, os.fsync, w.fd)
            digest = shard_digest(tmp)
            t_hash = time.perf_counter() - t1
            t_fsync = synced.result()
        if hasattr(os, "posix_fadvise"):  # clean now: let the kernel drop the pages (a hint only)
            try:
                os.posix_fadvise(w.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
    finally:
        w.close(sync=False)  # the fd is closed once nothing uses it; the temp file stays on failure
    done = {
        "name": s.name,
        "g": s.g,
        "rank": s.rank,
        "n_samples": s.n_samples,
        "n_tokens": s.n_tokens,
        "padded_tokens": job.padded,
        "bytes": w.nbytes,
        "digest": digest,
        "digest_kind": DIGEST_KIND,
        "seconds": round(seconds, 3),
        "finalize_seconds": round(time.perf_counter() - t1, 3),
        # where the time went (diagnostics only, not part of the shard's identity): the main thread's
        # waits for a staging slot, the writer thread's parts, the finalizer's fsync and read-back hash
        "timings": {"main_wait": round(job.wait, 3), **{k: round(v, 3) for k, v in w.timings.items()},
                    "fsync": round(t_fsync, 3), "hash": round(t_hash, 3)},
        "plan_key": sp.plan_key,
        "plan": sp.plan,
    }
    atomic_write_json(sp.done_path(s), done)  # before the rename: the final name appears complete
    os.replace(tmp, sp.out_dir / s.name)
    fd = os.open(sp.out_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return done


def _write_index(sp: _Split, target_info: dict[str, Any], dtype: str, layer_ids: list[int], bpt: int) -> dict:
    shards, tokens, padded, seconds, nbytes, samples = [], 0, 0, 0.0, 0, 0
    for s in sp.shards:
        _, _, size = shard_layout(s.n_tokens, s.n_samples, target_info["hidden_size"], dtype)
        done = sp.finished(s, size)
        if done is None:
            raise SpecopsError(f"{sp.out_dir}: {s.name} is not finished; rerun extract to complete it")
        # the digest as the sidecar has it (shards of runs before the piecewise digest: "sha256")
        shards.append({k: done[k] for k in ("name", "n_samples", "n_tokens", "bytes", "digest", "digest_kind", "sha256")
                       if k in done})
        tokens += s.n_tokens
        samples += s.n_samples
        padded += done["padded_tokens"]
        seconds += done["seconds"]
        nbytes += done["bytes"]
    index = {
        "format": FORMAT,
        "aux_layer_ids": layer_ids,
        "aux_layer_convention": CONVENTION,
        "final": "pre-norm",
        "hidden_size": target_info["hidden_size"],
        "num_hidden_layers": target_info["num_hidden_layers"],
        "vocab_size": target_info["vocab_size"],
        "dtype": dtype,
        "split": sp.name,
        "n_samples": samples,
        "n_tokens": tokens,
        "bytes_per_token": bpt,
        "bytes": nbytes,
        "digest_kind": DIGEST_KIND,  # of each shard's "digest" (extract.shard_digest)
        "plan_key": sp.plan_key,
        "plan": sp.plan,
        "stats": {
            "padded_tokens": padded,
            "padding_waste": round(1 - tokens / padded, 4) if padded else 0.0,
            "shard_seconds": round(seconds, 3),  # summed over ranks
            "tokens_per_s_per_rank": round(tokens / seconds, 1) if seconds else None,
        },
        "shards": shards,
        "complete": True,
    }
    atomic_write_json(sp.out_dir / "index.json", index)
    return index


def _log_finished(split: str, dones: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for d in dones:
        log.info(
            "%s %s: %d samples, %d tokens, %.0f tokens/s, padding %.1f%%, finalized in %.1fs",
            split, d["name"], d["n_samples"], d["n_tokens"], d["n_tokens"] / max(d["seconds"], 1e-9),
            100 * (1 - d["n_tokens"] / max(d["padded_tokens"], 1)), d["finalize_seconds"], extra=ROUTINE,
        )  # fmt: skip
    return dones


def served_features(cfg: Config, campaign: Campaign) -> tuple[list[int], int, Path]:
    """(aux layer ids, layer count L, the directory the servers write to) of this campaign's served
    extract: what `specops serve --features` and extract's own server are started with."""
    text_cfg = read_text_config(resolve_model_dir(cfg.target.model), trust_remote_code=cfg.target.trust_remote_code)
    L = int(text_cfg.num_hidden_layers)
    ids = list(cfg.extract.aux_layer_ids) if cfg.extract.aux_layer_ids is not None else default_aux_layer_ids(L)
    storage = Path(cfg.extract.served_dir) if cfg.extract.served_dir else campaign.root / "features" / ".served"
    return ids, L, storage


def _served_target(cfg: Config, campaign: Campaign, model_dir: Path, text_cfg: Any, layer_ids: list[int],
                   stack: contextlib.ExitStack) -> ServedTarget:
    """The target behind extract.server_urls, or behind [serve] started here with the features
    flags (and stopped when `stack` closes)."""
    from .models import served_name

    x = cfg.extract
    urls = list(x.server_urls)
    if not urls:
        from .serve import start

        storage = served_features(cfg, campaign)[2]
        where = f"files in {storage}" if cfg.serve.engine == "vllm" else "states in each /generate response"
        log.info("served extract: starting %s with the features of layers %s (+ %d, the final state); %s",
                 cfg.serve.engine, layer_ids, int(text_cfg.num_hidden_layers), where)
        srv = start(cfg, campaign, features=(layer_ids, int(text_cfg.num_hidden_layers), storage))
        stack.callback(srv.stop)
        log.info("served extract: %s up in %.0f s", srv.url, srv.startup_s)
        urls, key = [srv.url], srv.api_key
    else:
        from .auth import client_key

        key = client_key(cfg)
    cls: type[ServedTarget] = ServedTarget
    if cfg.serve.engine == "sglang":  # the engine extract starts, and the one behind server_urls
        from .target.served_sglang import ServedSglangTarget

        cls = ServedSglangTarget
    t = cls(urls, model=served_name(cfg.target.model, cfg.target.served_name), config=text_cfg,
            model_dir=model_dir, layer_ids=layer_ids, concurrency=x.served_concurrency, api_key=key)
    stack.callback(t.close)
    return t


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def run_extract(
    cfg: Config,
    campaign: Campaign,
    *,
    split: str = "both",
    free_bytes: Callable[[Path], int] = _free_bytes,
    target: TargetModel | None = None,
) -> dict[str, Any]:
    """Extract features for `split` ("train", "val" or "both"); rank/world from torchrun's env.

    Every rank writes its own shards; rank 0 writes each index.json after a barrier and keeps the
    manifest's extract phase. Returns rank 0's summary (counts, tokens/s, padding waste, bytes per token).
    `target` reuses an already loaded model (it must be the configured one).
    """
    if split not in ("train", "val", "both"):
        raise ValueError(f"split: expected train, val or both, got {split!r}")
    x = cfg.extract
    _check_extract_config(cfg)
    if x.mode == "online":
        log.info("extract.mode = online: features are computed during training; nothing to write")
        if int(os.environ.get("RANK", "0")) == 0:
            campaign.set_phase("extract", "done", mode="online")
        return {"mode": "online", "splits": {}}

    rank, world, local = _dist_env()
    model_dir = Path(target.model_dir) if target is not None else resolve_model_dir(cfg.target.model)
    text_cfg = target.config if target is not None else read_text_config(
        model_dir, trust_remote_code=cfg.target.trust_remote_code)
    L, H = int(text_cfg.num_hidden_layers), int(text_cfg.hidden_size)
    layer_ids = list(x.aux_layer_ids) if x.aux_layer_ids is not None else default_aux_layer_ids(L)
    for i in layer_ids:
        if not 0 <= i <= L:
            raise ConfigError(f"extract.aux_layer_ids: {i} out of range 0..{L} (input-to-layer ids, L = {L})")
    if x.device == "auto":
        device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(x.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", local)
    served = x.mode == "served"
    if served:  # the engine's states arrive as files on this host, read as fp32
        device, compute_dtype = torch.device("cpu"), torch.float32
    else:
        compute_dtype = target.dtype if target is not None else resolve_dtype(cfg.target.dtype, device)

    own_group = False
    if world > 1 and not torch.distributed.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # Long timeout: rank 0 waits at the final barrier while other ranks finish their shards.
        torch.distributed.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=12)
        )
        own_group = True

    def barrier() -> None:
        if world > 1:
            if device.type == "cuda":
                torch.distributed.barrier(device_ids=[device.index])
            else:
                torch.distributed.barrier()

    plan_base = {
        "format": FORMAT,
        "model": _model_fingerprint(model_dir),
        "aux_layer_ids": layer_ids,
        "final": "pre-norm",
        "dtype": x.dtype,
        "compute_dtype": str(compute_dtype).removeprefix("torch."),
    }
    if served:  # a split is made by one kind of source: a resume with the other is refused
        plan_base["source"] = "served" if cfg.serve.engine == "vllm" else f"served:{cfg.serve.engine}"
    names = list(SPLITS) if split == "both" else [split]
    if rank == 0:
        campaign.set_phase("extract", "running", splits=names, world_size=world)
    stack = contextlib.ExitStack()  # a server extract started, and the served target's threads
    try:
        splits = [
            _open_split(campaign, n, shard_tokens=x.shard_tokens, world=world, plan_base=plan_base,
                        tail_split=x.tail_split, batch_window=x.batch_window) for n in names
        ]
        # Disk forecast over every rank's unfinished shards (all ranks see the same directory).
        need = 0
        todo: dict[str, list[tuple[list[Shard], set[int]]]] = {}  # this rank's windows to compute + shards to write
        unfinished: dict[str, int] = {}  # shards of any rank unfinished at start, per split
        for sp in splits:
            sp.out_dir.mkdir(parents=True, exist_ok=True)
            for p in sp.out_dir.glob("*.done"):  # a leftover from another plan is refused up front
                other = read_json(p) or {}
                if other.get("plan_key") != sp.plan_key:
                    raise SpecopsError(sp.refusal(p.name[: -len(".done")], other.get("plan")))
            unfinished[sp.name] = 0
            left: set[int] = set()  # global numbers of this rank's unfinished shards
            for s in sp.shards:
                nbytes = shard_layout(s.n_tokens, s.n_samples, H, x.dtype)[2]
                if sp.finished(s, nbytes) is None:
                    need += nbytes
                    unfinished[sp.name] += 1
                    if s.rank == rank:
                        left.add(s.g)
            # Windows over the rank's WHOLE shard list (a fixed function of the plan), then those
            # with a shard to write: each is computed whole, with an uninterrupted run's batches.
            windows = plan_windows([s for s in sp.shards if s.rank == rank], x.batch_window)
            todo[sp.name] = [(win, {s.g for s in win} & left) for win in windows if any(s.g in left for s in win)]
        free = free_bytes(campaign.root / "features")
        if need > free:
            raise SpecopsError(
                f"not enough disk for features: need {need / 2**30:.2f} GiB "
                f"({feature_bytes_per_token(H, x.dtype)} bytes/token x remaining tokens), "
                f"{free / 2**30:.2f} GiB free at {campaign.root / 'features'}; free space, use "
                "extract.dtype = 'float8_e4m3fn' (about half), or extract.mode = 'online'"
            )

        if target is None and any(todo.values()):
            if served:
                target = _served_target(cfg, campaign, model_dir, text_cfg, layer_ids, stack)
            else:
                target = load_target(model_dir, compute_dtype, device,
                                     trust_remote_code=cfg.target.trust_remote_code)
        target_info = {"hidden_size": H, "num_hidden_layers": L, "vocab_size": None}
        if target is not None:
            target_info["vocab_size"] = target.vocab_size
        else:
            target_info["vocab_size"] = int(getattr(text_cfg, "vocab_size", 0)) or None

        summary: dict[str, Any] = {"mode": "offline", "rank": rank, "world_size": world, "splits": {}}
        bpt = feature_bytes_per_token(H, x.dtype)
        pipe = (_Pipeline(target.device, x.token_budget, x.batch_window, writeback=x.eager_writeback)
                if target is not None else None)
        beats = _Heartbeat(campaign, splits) if rank == 0 else None

        def plan_done() -> int:  # tokens in every rank's finished shards (their .done sidecars); rank 0
            return sum(v["tokens_done"] for v in beats.progress().values()) if beats is not None else 0

        bar = phase_progress("extract", sum(s.n_tokens for sp in splits for s in sp.shards), "tok", logger=log,
                             done=plan_done(), enabled=beats is not None)
        if beats is not None:
            beats.start()
        bar.start()
        ok = False
        try:
            for sp in splits:
                t0 = time.perf_counter()
                dones: list[dict[str, Any]] = []  # sidecars of the shards this run finished, as they finish
                try:
                    offsets = sp.offsets.tolist()
                    with torch.inference_mode():
                        for window, write in todo[sp.name]:
                            assert pipe is not None and target is not None
                            _extract_window(pipe, target, sp, window, write, layer_ids, x.dtype, x.token_budget,
                                            offsets)  # fmt: skip
                            dones += _log_finished(sp.name, pipe.take_done())
                            bar.update(plan_done())
                    if pipe is not None:  # every shard of this rank finished before the barrier/index
                        dones += _log_finished(sp.name, pipe.join())
                        bar.update(plan_done())
                except BaseException:
                    if pipe is not None:
                        pipe.abort()  # let the writer and finalizer end; then re-raise (KeyboardInterrupt too)
                    raise
                written = len(dones)
                tokens = sum(d["n_tokens"] for d in dones)
                padded = sum(d["padded_tokens"] for d in dones)
                elapsed = time.perf_counter() - t0
                barrier()
                entry = {
                    "shards": len(sp.shards),
                    "written": written,
                    "skipped": sum(1 for s in sp.shards if s.rank == rank) - written,
                    "tokens_written": tokens,
                    "tokens_per_s": round(tokens / elapsed, 1) if written else None,
                    "padding_waste": round(1 - tokens / padded, 4) if padded else 0.0,
                    "bytes_per_token": bpt,
                }
                if rank == 0:
                    old = read_json(sp.out_dir / "index.json")
                    if unfinished[sp.name] or not (old and old.get("complete") and old.get("plan_key") == sp.plan_key):
                        old = _write_index(sp, target_info, x.dtype, layer_ids, bpt)
                    entry.update(
                        n_samples=old["n_samples"], n_tokens=old["n_tokens"], bytes=old["bytes"],
                        index=str(sp.out_dir / "index.json"), total_padding_waste=old["stats"]["padding_waste"],
                    )  # fmt: skip
                summary["splits"][sp.name] = entry
            ok = True
        finally:
            if beats is not None:
                beats.stop("done" if ok else "stopped")
            bar.stop(failed=not ok)
            if pipe is not None:
                pipe.shutdown()
        barrier()
        if rank == 0:
            campaign.set_phase(
                "extract", "done", aux_layer_ids=layer_ids, dtype=x.dtype, splits=summary["splits"], world_size=world
            )
        return summary
    except BaseException as e:
        err: BaseException = e
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            # Finished shards (with their .done) are whole; the unfinished one stays a temp file.
            err = DiskFull(f"no space left writing features under {campaign.root / 'features'}: {e.strerror}; "
                           "free space (or use extract.dtype = 'float8_e4m3fn' / mode = 'online') and rerun: "
                           "finished shards are kept")
        if rank == 0:
            try:
                campaign.set_phase("extract", "failed", error=f"{type(err).__name__}: {err}")
            except OSError as w:  # a full disk must not hide the cause
                log.error("could not record extract as failed in the manifest: %s", w)
        if err is not e:
            raise err from e
        raise
    finally:
        stack.close()
        if own_group:
            torch.distributed.destroy_process_group()
