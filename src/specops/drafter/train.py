"""Train a drafter: features/ (or an in-process target) -> drafter/checkpoints/step-<n>/,
drafter/metrics.jsonl, drafter/manifest.json.

What every drafter family shares is here: the data pipeline (feature or token splits, loss masks,
length-bucketed or packed batches, collation into `batch.Batch`, online features), the trainer loop
(gradient accumulation, DDP, CUDA-graph micro-steps, the validation pass, heartbeats, metrics, the
manifest) and its checkpoints. The family (`drafter/families/`; train.drafter picks it) gives the
drafter, its objective over a batch and the teacher's targets (loss and per-position accuracy),
the simulated tau of that accuracy and the conventions the manifest records; EAGLE-3's training-time
test is `families/eagle3/objective.py`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..campaign import Campaign, DrafterHome, RunLock, atomic_write_json, now_iso, read_json
from ..errors import ConfigError, InputError, Interrupted
from ..features import FeatureReader
from ..progress import ROUTINE, phase_progress
from .checkpoint import checkpoints_dir, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from .graphs import GraphedMicroStep
from .optim import build_optimizer
from ..target import default_aux_layer_ids
from ..target.inprocess import load_target_head
from .batch import Batch, Teacher, teacher_targets
from .families import family_named
from .model import count_parameters, set_kernel_options

log = logging.getLogger("specops.train")

HEARTBEAT_S = 10.0  # the longest wall time between two training heartbeats (maybe_heartbeat)
# A run with fewer optimizer steps than this gets a warning (FEW_STEPS in the manifest): at a fixed
# number of epochs, smaller batches (more steps) reach a clearly higher val simulated tau; the
# comparison is in docs/results.md.
FEW_STEPS = 2000


FeaturesFn = Callable[[list[torch.Tensor]], dict[str, Any]]


# ---------------------------------------------------------------- data

@dataclass
class Sample:
    input_ids: torch.Tensor  # int64 [n]
    loss_mask: torch.Tensor  # bool [n]
    aux: torch.Tensor | None = None  # [n, 3, H]
    final: torch.Tensor | None = None  # [n, H] pre-norm


def _usable(loss_mask: torch.Tensor) -> bool:
    # Step 0 predicts x_{t+2}: a sample needs a trainable token at index >= 2.
    return loss_mask.numel() >= 3 and bool(loss_mask[2:].any())


MaskFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids, loss mask) -> loss mask


def turn_head(mask: torch.Tensor, n: int) -> torch.Tensor:
    """The first n tokens of each run of loss tokens (each generated turn): the window `eval`
    measures (eval.max_new_tokens new tokens per turn)."""
    m = mask.bool()
    idx = torch.arange(m.numel())
    starts = m & ~torch.cat([torch.zeros(1, dtype=torch.bool), m[:-1]])
    run_start = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), 0).values
    return m & (idx - run_start < n)


def without_repeats(ngram: int) -> MaskFn:
    """train.mask_repetition: the loss mask without the tokens that repeat an ngram-token window of
    their own turn (text.repeating_tokens: greedy loops; the first occurrence stays)."""
    import numpy as np

    from ..text import repeating_tokens

    def fn(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rep = repeating_tokens(ids.numpy().astype(np.int32), mask.numpy().astype(np.uint8), ngram)
        return mask & ~torch.from_numpy(rep)

    return fn


class _Masks:
    """How a split turns a sample's stored loss mask into the one it hands out. all_positions
    (train.loss_on_prompt, the train split only): all ones. mask_fn, applied after: e.g. the first
    tokens of each turn (the val pass's head) or the mask without greedy loops (train.mask_repetition).
    Which samples are used still follows the stored mask."""

    all_positions = False
    mask_fn: MaskFn | None = None

    def _mask(self, ids: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
        m = torch.ones_like(stored, dtype=torch.bool) if self.all_positions else stored.bool()
        return self.mask_fn(ids, m) if self.mask_fn is not None else m


class FeatureSplit(_Masks):
    """features/<split>/ through `features.FeatureReader` (read lazily); loss masks as _Masks says."""

    def __init__(self, split_dir: Path, *, max_seq_len: int | None = None, out_dtype: torch.dtype = torch.float32):
        self.reader = FeatureReader(split_dir)
        self.dir = self.reader.dir
        self.index = self.reader.index
        self.aux_layer_ids = self.reader.aux_layer_ids
        self.hidden_size = self.reader.hidden_size
        self.final_prenorm = self.reader.final_prenorm
        self.fp8 = self.reader.fp8
        self.out_dtype = out_dtype
        self.items: list[tuple[int, int, int]] = []  # (shard, start, end)
        self.lengths: list[int] = []
        self.skipped = 0
        for si in range(len(self.reader.shards)):
            offsets, lm = self.reader.sample_spans(si)
            for a, b in zip(offsets[:-1], offsets[1:]):
                if max_seq_len:
                    b = min(b, a + max_seq_len)
                if not _usable(lm[a:b]):
                    self.skipped += 1
                    continue
                self.items.append((si, a, b))
                self.lengths.append(b - a)

    def __len__(self) -> int:
        return len(self.items)

    def get(self, i: int) -> Sample:
        ids, mask, aux, final = self.reader.rows(*self.items[i], dtype=self.out_dtype)
        return Sample(ids, self._mask(ids, mask), aux, final)


class TokenSplit(_Masks):
    """build/<split>.safetensors (input_ids, loss_mask, offsets) for online mode; loss masks as
    _Masks says."""

    def __init__(self, path: Path, *, max_seq_len: int | None = None):
        from safetensors.torch import load_file

        if not path.is_file():
            raise InputError(f"{path} not found: run `specops build` first")
        t = load_file(str(path))
        self.ids, self.mask = t["input_ids"].long(), t["loss_mask"].bool()
        offsets = t["offsets"].tolist()
        self.items: list[tuple[int, int]] = []
        self.lengths: list[int] = []
        self.skipped = 0
        for a, b in zip(offsets[:-1], offsets[1:]):
            if max_seq_len:
                b = min(b, a + max_seq_len)
            if not _usable(self.mask[a:b]):
                self.skipped += 1
                continue
            self.items.append((a, b))
            self.lengths.append(b - a)

    def __len__(self) -> int:
        return len(self.items)

    def get(self, i: int) -> Sample:
        a, b = self.items[i]
        return Sample(self.ids[a:b], self._mask(self.ids[a:b], self.mask[a:b]))


def bucketed(lengths: list[int], bucket: int) -> list[int]:
    """Each length rounded up to a multiple of `bucket` (the padded rows of `collate(pad_to=bucket)`)."""
    return [-(-n // bucket) * bucket for n in lengths]


def make_batches(lengths: list[int], batch_tokens: int, *, seed: int | None, epoch: int = 0) -> list[list[int]]:
    """Length-bucketed batches: padded size (rows × longest) <= batch_tokens (a longer sample goes
    alone). seed None: no shuffle (validation). Otherwise the order is shuffled, sorted by length
    inside mega-chunks of ~64 batches (so batch composition varies by epoch), and the batch order
    is shuffled; deterministic in (seed, epoch)."""
    n = len(lengths)
    order = list(range(n))
    rng = random.Random(f"specops-train:{seed}:{epoch}") if seed is not None else None
    if rng is not None:
        rng.shuffle(order)
        per_batch = max(1, batch_tokens // max(1, sorted(lengths)[n // 2] if n else 1))
        chunk = 64 * per_batch
    else:
        chunk = max(n, 1)
    batches: list[list[int]] = []
    for c in range(0, n, chunk):
        part = sorted(order[c:c + chunk], key=lambda i: (-lengths[i], i))
        cur: list[int] = []
        longest = 0
        for i in part:
            L = lengths[i]
            if cur and (len(cur) + 1) * max(longest, L) > batch_tokens:
                batches.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, L)
        if cur:
            batches.append(cur)
    if rng is not None:
        rng.shuffle(batches)
    return batches


def pack_batches(lengths: list[int], row_tokens: int, rows_per_batch: int, *, seed: int,
                 epoch: int = 0) -> list[list[tuple[int, ...]]]:
    """Batches of `rows_per_batch` rows, each row several documents of at most `row_tokens` tokens in
    all (train.pack_rows): the order is shuffled, each chunk of 512 samples is packed first-fit
    decreasing (long samples first, each into the first row with room), the rows of all chunks are
    shuffled and cut into batches; the last batch is filled up with empty rows (padding only), so
    every batch has one shape and no sample is dropped. A batch mixes lengths and sources, unlike
    make_batches' length-sorted rows. Deterministic in (seed, epoch)."""
    too_long = [n for n in lengths if n > row_tokens]
    if too_long:
        raise ConfigError(f"train.pack_rows = {row_tokens} is shorter than {len(too_long)} sample(s) (the longest "
                          f"has {max(too_long)} tokens): raise it, or cut samples with train.max_seq_len")
    rng = random.Random(f"specops-pack:{seed}:{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    rows: list[tuple[int, ...]] = []
    for c in range(0, len(order), 512):
        chunk = sorted(order[c:c + 512], key=lambda i: (-lengths[i], i))
        open_rows: list[list[int]] = []
        room: list[int] = []
        for i in chunk:
            n = lengths[i]
            r = next((j for j, left in enumerate(room) if left >= n), None)
            if r is None:
                open_rows.append([i])
                room.append(row_tokens - n)
            else:
                open_rows[r].append(i)
                room[r] -= n
        rows += [tuple(r) for r in open_rows]
    rng.shuffle(rows)
    batches = [rows[b:b + rows_per_batch] for b in range(0, len(rows), rows_per_batch)]
    if batches and len(batches[-1]) < rows_per_batch:
        batches[-1] = batches[-1] + [()] * (rows_per_batch - len(batches[-1]))
    return batches


def collate(rows: list[list[Sample]], *, pin: bool = False, pad_to: int = 1) -> Batch:
    """rows[r] = the documents packed into row r (in order). Each sample must carry aux/final.
    pin: allocate the host tensors in page-locked memory, so that the copy to the GPU can run
    asynchronously (`Batch.to(..., non_blocking=True)`) while the GPU works on the previous step.
    pad_to: the row length is rounded up to a multiple of it (CUDA graphs: few distinct shapes)."""
    T = max(sum(s.input_ids.numel() for s in docs) for docs in rows)
    T = -(-T // pad_to) * pad_to
    B = len(rows)
    first = next(docs[0] for docs in rows if docs)  # a row may be empty (padding only: pack_batches)
    Ht, H = first.aux.shape[-1], first.final.shape[-1]
    pin = pin and first.aux.device.type == "cpu"
    ids = torch.zeros(B, T, dtype=torch.int64, pin_memory=pin)
    mask = torch.zeros(B, T, dtype=torch.bool, pin_memory=pin)
    doc = torch.full((B, T), -1, dtype=torch.int64, pin_memory=pin)
    pos = torch.zeros(B, T, dtype=torch.int64, pin_memory=pin)
    end = torch.zeros(B, T, dtype=torch.int64, pin_memory=pin)
    aux = torch.zeros(B, T, 3, Ht, dtype=first.aux.dtype, device=first.aux.device, pin_memory=pin)
    final = torch.zeros(B, T, H, dtype=first.final.dtype, device=first.final.device, pin_memory=pin)
    n_tokens = 0
    for r, docs in enumerate(rows):
        a = 0
        for d, s in enumerate(docs):
            n = s.input_ids.numel()
            b = a + n
            ids[r, a:b] = s.input_ids
            mask[r, a:b] = s.loss_mask
            doc[r, a:b] = d
            pos[r, a:b] = torch.arange(n)
            end[r, a:b] = b
            aux[r, a:b] = s.aux
            final[r, a:b] = s.final
            a = b
            n_tokens += n
    return Batch(ids, mask, doc, pos, end, aux, final, n_tokens)


def _attach_features(samples: list[Sample], features_fn: FeaturesFn, dtype: torch.dtype) -> None:
    """Online mode: features_fn([ids_i int64 [n_i]]) -> {"aux": [N, 3, H] or per-sample list,
    "final": [N, H] (pre-norm) or per-sample list}, N = sum n_i in order."""
    out = features_fn([s.input_ids for s in samples])
    for key in ("aux", "final"):
        v = out[key]
        sizes = [s.input_ids.numel() for s in samples]
        parts = list(v) if isinstance(v, (list, tuple)) else list(torch.split(v, sizes))
        for s, p, n in zip(samples, parts, sizes):
            if p.shape[0] != n:
                raise ValueError(f"features_fn returned {key} with {p.shape[0]} rows for a {n}-token sample")
            setattr(s, key, p.detach().to(dtype))  # stays on the features_fn's device


def target_features_fn(model_dir: str | os.PathLike[str], device: torch.device,
                       aux_layer_ids: list[int] | None = None, *, trust_remote_code: bool = False) -> FeaturesFn:
    """The default online features_fn: the target itself (target.inprocess: loader and forward), run on
    right-padded batches (positions 0..n-1 per row, causal mask alone keeps real tokens exact)."""
    from ..target.inprocess import compute_features, load_target

    target = load_target(model_dir, device=device, trust_remote_code=trust_remote_code)
    ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(target.num_hidden_layers)

    def fn(samples: list[torch.Tensor]) -> dict[str, Any]:
        sizes = [s.numel() for s in samples]
        batch = torch.zeros(len(samples), max(sizes), dtype=torch.long)
        for i, s in enumerate(samples):
            batch[i, :sizes[i]] = s
        out = compute_features(target, batch.to(target.device), None, ids)  # aux [B, T, 3, H], final [B, T, H]
        return {"aux": [out["aux"][i, :n] for i, n in enumerate(sizes)],
                "final": [out["final"][i, :n] for i, n in enumerate(sizes)]}

    fn.aux_layer_ids = ids  # type: ignore[attr-defined]
    return fn


# ---------------------------------------------------------------- distributed

@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def _setup_dist(device_opt: str) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_opt == "auto":
        device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    else:
        device = torch.device(device_opt)
        if device.type == "cuda" and device.index is None:
            device = torch.device(f"cuda:{local}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns = False
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
            owns = True
    return Dist(rank, world, local, device, owns)


# ---------------------------------------------------------------- the loop

def _truncate_metrics(path: Path, keep_through_step: int) -> None:
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= keep_through_step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a torn last line from a killed run
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(s + "\n" for s in kept))
    os.replace(tmp, path)


class _StopFlag:
    """SIGTERM/SIGINT -> finish the current step, checkpoint, raise Interrupted."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_StopFlag":
        if _in_main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class _Prefetcher:
    """Reads and collates the next micro-batches on a background thread while the GPU runs the
    current one (offline features only: online features need the target, which stays on the main
    thread). Measured on the H200: the first epoch's windows ran at a third of the last epoch's
    tokens/s, the signature of shard reads from a cold page cache that a serial loop waits on.

    Batches are keyed by (epoch, index in that epoch's batch list); `get` returns the prefetched
    batch or loads it inline, so the order of batches, and therefore training, is unchanged."""

    def __init__(self, load: Callable[[list[int]], Batch], depth: int):
        import concurrent.futures

        self.load, self.depth = load, depth
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="train-prefetch")
        self.pending: dict[tuple[int, int], Any] = {}

    def want(self, keys: list[tuple[tuple[int, int], list[int]]]) -> None:
        """Queue the upcoming (key, idxs) in order, keeping at most `depth` batches in flight."""
        for key, idxs in keys:
            if len(self.pending) >= self.depth:
                break
            if key not in self.pending:
                self.pending[key] = self.pool.submit(self.load, idxs)

    def get(self, key: tuple[int, int], idxs: list[int]) -> Batch:
        fut = self.pending.pop(key, None)
        return fut.result() if fut is not None else self.load(idxs)

    def close(self) -> None:
        for fut in self.pending.values():
            fut.cancel()
        self.pending.clear()
        self.pool.shutdown(wait=True)


class _Trainer:
    def __init__(self, cfg, campaign: Campaign, features_fn: FeaturesFn | None, dist: Dist, home: DrafterHome):
        from safetensors.torch import load_file

        from ..models import resolve_model_dir

        # the train section as this family reads it (drafter = its name; other families' keys unset)
        tc = cfg.train.for_family(home.family)
        self.cfg, self.tc, self.campaign, self.features_fn, self.dist = cfg, tc, campaign, features_fn, dist
        tc = self.tc
        set_kernel_options(ttt_attention=tc.ttt_attention, fused_loss=tc.fused_loss, compile_loss=tc.compile_loss,
                           compile_layer=tc.compile_layer, sdpa_cudnn=tc.sdpa_cudnn)
        self.seed = tc.seed if tc.seed is not None else cfg.campaign.seed
        self.home = home
        self.dir = home.dir
        self.metrics_path = self.dir / "metrics.jsonl"
        self.device = dist.device
        self.cuda = self.device.type == "cuda"
        feat_dtype = torch.bfloat16 if self.cuda else torch.float32
        self.feat_dtype = feat_dtype

        vocab_path = campaign.root / "build" / "vocab.safetensors"
        if not vocab_path.is_file():
            raise InputError(f"{vocab_path} not found: run `specops build` first")
        vocab = load_file(str(vocab_path))
        d2t = vocab["d2t"].long()
        if tc.draft_vocab_size is not None and tc.draft_vocab_size != d2t.numel():
            raise ConfigError(f"train.draft_vocab_size: {tc.draft_vocab_size} but build/vocab.safetensors has "
                              f"{d2t.numel()} draft ids; rebuild or drop the setting")

        self.model_dir = resolve_model_dir(cfg.target.model)
        # data
        if tc.mode == "offline":
            fdir = campaign.root / "features"
            self.train_split = FeatureSplit(fdir / "train", max_seq_len=tc.max_seq_len, out_dtype=feat_dtype)
            val_dir = fdir / "val"
            self.val_split = (FeatureSplit(val_dir, max_seq_len=tc.max_seq_len, out_dtype=feat_dtype)
                              if (val_dir / "index.json").is_file() else None)
            aux_ids, final_prenorm = self.train_split.aux_layer_ids, self.train_split.final_prenorm
            self.inputs = {"features": str(fdir)}
        else:
            if features_fn is None:
                extract_ids = getattr(getattr(cfg, "extract", None), "aux_layer_ids", None)
                features_fn = self.features_fn = target_features_fn(
                    self.model_dir, self.device, extract_ids, trust_remote_code=cfg.target.trust_remote_code)
            bdir = campaign.root / "build"
            self.train_split = TokenSplit(bdir / "train.safetensors", max_seq_len=tc.max_seq_len)
            vp = bdir / "val.safetensors"
            self.val_split = TokenSplit(vp, max_seq_len=tc.max_seq_len) if vp.is_file() else None
            aux_ids = getattr(features_fn, "aux_layer_ids", None) or getattr(getattr(cfg, "extract", None),
                                                                             "aux_layer_ids", None)
            final_prenorm = True
            self.inputs = {"build": str(bdir)}
        # train.loss_on_prompt: the training loss counts every token, the prompt's too; val never does
        self.train_split.all_positions = bool(tc.loss_on_prompt)
        if tc.mask_repetition:  # greedy loops out of the training loss; val unchanged
            self.train_split.mask_fn = without_repeats(cfg.build.repetition_ngram)
        if self.val_split is not None and len(self.val_split) == 0:
            self.val_split = None
        # The val pass again on the first eval.max_new_tokens tokens of each turn: the window eval
        # measures. Past it, greedy loops make tokens easy (on greedy SmolLM2 data step-0 accuracy is
        # ~0.7 on a response's first 128 tokens, ~0.95 past 384), so whole-turn figures overstate it.
        self.head_tokens = int(cfg.eval.max_new_tokens)
        self.val_for_status: dict[str, Any] | None = None  # the latest val pass, for the heartbeat
        self.val_head_split = None
        if self.val_split is not None:
            self.val_head_split = copy.copy(self.val_split)
            self.val_head_split.mask_fn = lambda ids, m, n=self.head_tokens: turn_head(m, n)
        if len(self.train_split) == 0:
            raise InputError("the train split has no usable sample (each needs >= 3 tokens and a trainable token)")

        # target head -> drafter + teacher
        self.family = family = family_named(home.family)
        head = load_target_head(self.model_dir)
        if aux_ids is None:
            aux_ids = family.feature_layer_ids(int(head.config["num_hidden_layers"]))
        # the family's target-dependent keys (P-EAGLE: the mask token id), resolved and checked once
        self.family_tc = family_tc = family.resolve_train(tc, head.config, self._tokenizer)
        self.dcfg = family.new_config(head.config, d2t.numel(), aux_ids, family_tc)
        if tc.mode == "offline" and self.train_split.hidden_size != self.dcfg.target_hidden_size:
            raise InputError(f"features hidden_size {self.train_split.hidden_size} != target hidden_size "
                             f"{self.dcfg.target_hidden_size}: features from another model?")
        if vocab["t2d"].numel() != self.dcfg.target_vocab_size:
            raise InputError(f"build/vocab.safetensors t2d covers {vocab['t2d'].numel()} ids, the target has "
                             f"{self.dcfg.target_vocab_size}")
        torch.manual_seed(self.seed)
        random.seed(self.seed)
        self.drafter = family.new_drafter(self.dcfg, head, d2t, vocab["t2d"].bool(), family_tc)
        self.drafter.to(self.device)
        self.teacher = Teacher(head, d2t, final_prenorm=final_prenorm, device=self.device,
                               dtype=torch.bfloat16 if self.cuda else torch.float32)
        del head

        self.module = family.objective(self.drafter, family_tc)
        if dist.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # device_ids=None: inputs are already on this rank's device (a Batch is moved by load_batch).
            self.model = DDP(self.module, device_ids=None, broadcast_buffers=False)
        else:
            self.model = self.module
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.per_step = dist.world * tc.grad_accum  # micro-batches per optimizer step, all ranks
        # CUDA graphs: the static objective (no host sync), rows padded to graph_bucket, batches planned
        # with the padded lengths; one process only (DDP's hooks cannot be captured here).
        self.micro: GraphedMicroStep | None = None
        self.pad_to = 1
        graphs = tc.cuda_graphs if tc.cuda_graphs != "auto" else self.cuda and dist.world == 1
        if graphs:
            if dist.world > 1:
                log.warning("train.cuda_graphs: not under DDP (%d processes); the eager step runs", dist.world)
            else:
                self.pad_to = tc.graph_bucket
                self.micro = GraphedMicroStep(
                    family.static_objective(self.drafter, self.teacher, family_tc), self.params, self.device,
                    loss_scale=1.0 / tc.grad_accum, use_graphs=self.cuda,
                    autocast=lambda: self.autocast(cache=False))  # no cast cache while a graph is captured
        # train.pack_rows: rows of several documents, one shape [batch_tokens / pack_rows, pack_rows]
        if tc.pack_rows is not None:
            if tc.pack_rows > tc.batch_tokens:
                raise ConfigError(f"train.pack_rows = {tc.pack_rows} exceeds train.batch_tokens = {tc.batch_tokens}")
            self.pad_to = tc.pack_rows
        self.plan_lengths = bucketed(self.train_split.lengths, self.pad_to)
        n0 = len(self.plan(0))
        self.steps_per_epoch = n0 // self.per_step
        if self.steps_per_epoch == 0:
            raise InputError(f"train split gives {n0} batches of {tc.batch_tokens} tokens, fewer than "
                             f"world_size × grad_accum = {self.per_step}; lower train.batch_tokens")
        self.total_steps = tc.total_steps or tc.epochs * self.steps_per_epoch
        self.warnings: list[str] = []
        if tc.total_steps is None and self.total_steps < FEW_STEPS:
            self.warnings.append(
                f"few optimizer steps: {self.total_steps} ({tc.epochs} epochs x {self.steps_per_epoch} steps of "
                f"{tc.batch_tokens} tokens x {self.per_step}); small campaigns learn more from more, smaller steps "
                f"(fewer than {FEW_STEPS}: consider a lower train.batch_tokens)")
            if dist.rank == 0:
                log.warning("train: %s", self.warnings[-1])
        self.optimizer, self.scheduler = build_optimizer(self.drafter, tc, fused=self.cuda, total_steps=self.total_steps)
        self._batches: dict[int, list[list[int]]] = {}  # epoch -> its batches (this and the next epoch)
        self.val_batches = (make_batches(self.val_split.lengths, tc.batch_tokens, seed=None)
                            if self.val_split is not None else [])

    # -------------------------------------------------------------- helpers
    def _tokenizer(self) -> Any:
        """The target's tokenizer (target.tokenizer, else the model's own), or None when the model
        directory has none (a family's resolve_train reads it)."""
        from ..target.hf import load_tokenizer

        where = self.cfg.target.tokenizer or self.model_dir
        try:
            return load_tokenizer(where, trust_remote_code=self.cfg.target.trust_remote_code)
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.info("train: no tokenizer at %s (%s: %s)", where, type(e).__name__, e)
            return None

    def autocast(self, cache: bool = True):
        return (torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache) if self.cuda
                else contextlib.nullcontext())

    def plan(self, epoch: int) -> list[list]:
        """The epoch's micro-batches: lists of sample indices (one document per row), or with
        train.pack_rows lists of rows, each a tuple of the indices packed into it."""
        tc = self.tc
        if tc.pack_rows is not None:
            return pack_batches(self.train_split.lengths, tc.pack_rows, tc.batch_tokens // tc.pack_rows,
                                seed=self.seed, epoch=epoch)
        return make_batches(self.plan_lengths, tc.batch_tokens, seed=self.seed, epoch=epoch)

    @staticmethod
    def rows(batch: list) -> list[list[int]]:
        """A planned batch as rows of sample indices (a packed row is a tuple; a plain entry is one row)."""
        return [list(r) if isinstance(r, tuple) else [r] for r in batch]

    def epoch_batches(self, epoch: int) -> list[list]:
        if epoch not in self._batches:
            for old in [e for e in self._batches if e < epoch - 1]:
                del self._batches[old]
            self._batches[epoch] = self.plan(epoch)
        return self._batches[epoch]

    def upcoming(self, epoch: int, micro_in_epoch: int, steps: int) -> list[tuple[tuple[int, int], list[int]]]:
        """This rank's micro-batches of the next `steps` optimizer steps from (epoch, micro_in_epoch),
        crossing epoch ends exactly as `run` does: [((epoch, batch index), idxs), ...]."""
        out = []
        for _ in range(steps):
            batches = self.epoch_batches(epoch)
            if micro_in_epoch + self.per_step > len(batches):
                epoch, micro_in_epoch = epoch + 1, 0
                batches = self.epoch_batches(epoch)
            for m in range(self.tc.grad_accum):
                bi = micro_in_epoch + m * self.dist.world + self.dist.rank
                out.append(((epoch, bi), batches[bi]))
            micro_in_epoch += self.per_step
        return out

    def load_host_batch(self, split, batch: list, pad_to: int = 1) -> Batch:
        """Read + collate on the host (pinned when training on CUDA); safe on the prefetch thread."""
        return collate([[split.get(i) for i in row] for row in self.rows(batch)], pin=self.cuda, pad_to=pad_to)

    def load_batch(self, split, batch: list, pad_to: int = 1) -> Batch:
        rows = [[split.get(i) for i in row] for row in self.rows(batch)]
        samples = [x for row in rows for x in row]
        if self.features_fn is not None and samples[0].aux is None:
            _attach_features(samples, self.features_fn, self.feat_dtype)
        return collate(rows, pin=self.cuda, pad_to=pad_to).to(self.device)

    def write_metrics(self, row: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def heartbeat(self, step: int, state: str, tokens_per_s: float | None, steps_per_s: float | None = None) -> None:
        """run/heartbeat.json for `specops status`: the step, the rates of the last interval and the ETA."""
        now = time.time()
        left = max(0, self.total_steps - step)
        atomic_write_json(self.campaign.heartbeat_path, {
            "pid": os.getpid(), "phase": "train", "family": self.home.family, "state": state, "ts": now,
            "iso": now_iso(),
            "started": self.started, "step": step, "total_steps": self.total_steps,
            "window": {"tokens_per_s": tokens_per_s, "steps_per_s": steps_per_s},
            "eta_s": round(left / steps_per_s, 1) if steps_per_s else (0.0 if not left else None),
            "last_val": self.val_for_status,  # {step, tau, tau_head, head_tokens} or None
        }, fsync=False)

    def maybe_heartbeat(self, step: int, tokens_seen: int) -> None:
        """A heartbeat at least every HEARTBEAT_S of wall time, whatever log_every is (host clock and
        host-side counts: no device sync), so status can tell a slow run from a hung one and give an
        ETA however long a logging interval lasts."""
        now = time.time()
        t, s0, tok0 = self._hb or (self.started, 0, 0)
        if now - t < HEARTBEAT_S or step <= s0:
            return
        self.heartbeat(step, "running", (tokens_seen - tok0) / (now - t), (step - s0) / (now - t))
        self._hb = (now, step, tokens_seen)

    # -------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, Any] | None:
        """The val pass over every generated token, then over the first head_tokens of each turn
        (acc_head, tau_head, positions_head)."""
        if not self.val_batches:
            return None
        out = self._val_pass(self.val_split)
        head = self._val_pass(self.val_head_split)
        return {**out, "head_tokens": self.head_tokens, "acc_head": head["acc"], "tau_head": head["tau"],
                "positions_head": head["positions"]}

    def _val_pass(self, split) -> dict[str, Any]:
        K = self.tc.ttt_steps
        acc = torch.zeros(3, K, dtype=torch.float64, device=self.device)  # ce_sum, correct, count
        self.module.eval()
        for i in range(self.dist.rank, len(self.val_batches), self.dist.world):
            batch = self.load_batch(split, self.val_batches[i])
            with self.autocast():
                out = self.module(batch, teacher_targets(self.teacher, batch))
            acc += torch.stack([out.ce_sum.double(), out.correct.double(), out.count.double()])
        self.module.train()
        self.dist.all_sum(acc)
        ce, correct, count = acc.cpu().tolist()
        per_acc = [c / n if n else 0.0 for c, n in zip(correct, count)]
        return {
            "loss": sum(self.tc.loss_decay ** k * (ce[k] / count[k] if count[k] else 0.0) for k in range(K)),
            "step_loss": [c / n if n else None for c, n in zip(ce, count)],
            "acc": per_acc,
            "tau": self.family.simulated_tau(per_acc),
            "positions": [int(n) for n in count],
        }

    # -------------------------------------------------------------- train
    def run(self, max_steps: int | None) -> dict[str, Any]:
        tc, dist = self.tc, self.dist
        K = tc.ttt_steps
        rank0 = dist.rank == 0
        self.started = time.time()
        self._hb: tuple[float, int, int] | None = None  # the last heartbeat's (time, step, tokens)
        self.dir.mkdir(parents=True, exist_ok=True)
        step, epoch, micro_in_epoch, tokens_seen = 0, 0, 0, 0
        resumed_from = None
        ck = latest_checkpoint(self.dir)
        if ck is not None:
            st = load_checkpoint(ck, self.drafter, self.optimizer, self.scheduler)
            step, epoch, micro_in_epoch = st["step"], st["epoch"], st["micro_batches_in_epoch"]
            tokens_seen = st.get("tokens_seen", 0)
            resumed_from = step
            if (st.get("seed"), st.get("batch_tokens"), st.get("pack_rows")) != (self.seed, tc.batch_tokens, tc.pack_rows):
                log.warning("resuming %s with a different seed/batch_tokens/pack_rows: the data order changes from "
                            "here", ck)
            log.info("resumed from %s (epoch %d, micro-batch %d)", ck, epoch, micro_in_epoch)
        if rank0:
            _truncate_metrics(self.metrics_path, step)  # one loss curve: drop rows past the checkpoint
            root = checkpoints_dir(self.dir)
            if root.is_dir():
                for p in root.glob(".step-*.tmp-*"):  # a checkpoint torn by a kill
                    shutil.rmtree(p, ignore_errors=True)
            self.write_manifest(state="running", resumed_from=resumed_from)
        dist.barrier()
        stop_at = self.total_steps if max_steps is None else min(self.total_steps, max_steps)
        log.info("train: %d drafter params (%d trainable), %d samples, %d steps/epoch, steps %d -> %d of %d on %s×%d",
                 count_parameters(self.drafter), count_parameters(self.drafter, True), len(self.train_split),
                 self.steps_per_epoch, step, stop_at, self.total_steps, self.device, dist.world)

        window = torch.zeros(2 + 3 * K, dtype=torch.float64, device=self.device)  # loss, tokens, ce/correct/count
        win_steps, win_t0 = 0, time.time()
        self._hb = (win_t0, step, tokens_seen)  # rates from here (a resumed run starts mid-way)
        if rank0:
            self.heartbeat(step, "running", None)
        last_ckpt = step if resumed_from is not None else None
        val = None
        # Offline features: read ahead on a thread (two optimizer steps' micro-batches in flight).
        prefetch = (_Prefetcher(lambda idxs: self.load_host_batch(self.train_split, idxs, self.pad_to),
                                depth=2 * tc.grad_accum)
                    if self.features_fn is None and tc.prefetch else None)
        with _StopFlag() as stop, contextlib.ExitStack() as stack:
            if prefetch is not None:
                stack.callback(prefetch.close)
            bar = stack.enter_context(phase_progress("train", self.total_steps, "steps", logger=log, done=step,
                                                     enabled=rank0))
            while step < stop_at:
                batches = self.epoch_batches(epoch)
                first = micro_in_epoch
                if first + self.per_step > len(batches):
                    epoch, micro_in_epoch = epoch + 1, 0
                    continue
                self.optimizer.zero_grad(set_to_none=self.micro is None)  # graphs write the same .grad
                step_tokens = 0
                if prefetch is not None:
                    prefetch.want(self.upcoming(epoch, micro_in_epoch, min(2, stop_at - step)))
                for m in range(tc.grad_accum):
                    bi = first + m * dist.world + dist.rank
                    idxs = batches[bi]
                    if prefetch is not None:
                        batch = prefetch.get((epoch, bi), idxs)  # on the host (pinned on CUDA)
                        if m == 0:  # the next steps' batches start loading while this step computes
                            prefetch.want(self.upcoming(epoch, micro_in_epoch + self.per_step,
                                                        min(2, stop_at - step - 1)))
                    else:
                        batch = self.load_batch(self.train_split, idxs, self.pad_to)
                    if self.micro is not None:  # forward + backward: a graph replay once the shape is captured
                        out = self.micro.step(batch)
                    else:
                        batch = batch.to(self.device)
                        targets = teacher_targets(self.teacher, batch)
                        sync = m == tc.grad_accum - 1 or dist.world == 1
                        ctx = contextlib.nullcontext() if sync else self.model.no_sync()
                        with ctx:
                            with self.autocast():
                                out = self.model(batch, targets)
                            (out.loss / tc.grad_accum).backward()
                    window[0] += out.loss.detach().double()
                    window[1] += batch.n_tokens
                    step_tokens += batch.n_tokens
                    window[2:] += torch.cat([out.ce_sum.double(), out.correct.double(), out.count.double()])
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, tc.max_grad_norm)
                lr = self.optimizer.param_groups[0]["lr"]
                self.optimizer.step()
                self.scheduler.step()
                step += 1
                micro_in_epoch += self.per_step
                win_steps += 1
                if dist.world > 1:
                    # One small all-reduce per step: token count, and whether any rank got SIGTERM/SIGINT.
                    flags = dist.all_sum(torch.tensor([step_tokens, float(stop.signum is not None)],
                                                      dtype=torch.float64, device=self.device)).tolist()
                    tokens_seen += int(flags[0])
                    stopping = flags[1] > 0
                else:  # one process: no device round trip (it would stall the host every step)
                    tokens_seen += step_tokens
                    stopping = stop.signum is not None

                if rank0:
                    self.maybe_heartbeat(step, tokens_seen)
                    bar.update(step)
                if step % tc.log_every == 0 or step == stop_at:
                    w = dist.all_sum(window.clone()).cpu().tolist()
                    dt = max(time.time() - win_t0, 1e-9)
                    ce, cor, cnt = w[2:2 + K], w[2 + K:2 + 2 * K], w[2 + 2 * K:]
                    row = {
                        "step": step, "split": "train", "epoch": epoch,
                        "loss": w[0] / (win_steps * self.per_step),
                        "step_loss": [c / n if n else None for c, n in zip(ce, cnt)],
                        "acc": [c / n if n else 0.0 for c, n in zip(cor, cnt)],
                        "lr": lr, "grad_norm": float(grad_norm),
                        "tokens": tokens_seen, "tokens_per_s": w[1] / dt, "time": now_iso(),
                    }
                    if rank0:
                        self.write_metrics(row)
                        log.info("step %d/%d loss %.4f acc0 %.3f lr %.2e %.0f tok/s", step, self.total_steps,
                                 row["loss"], row["acc"][0], lr, row["tokens_per_s"], extra=ROUTINE)
                        bar.update(loss=row["loss"], tok_s=row["tokens_per_s"])
                    window.zero_()
                    win_steps, win_t0 = 0, time.time()

                if step % tc.eval_every == 0 or step == self.total_steps:
                    val = self.evaluate()
                    if val is not None and rank0:
                        self.val_for_status = {"step": step, **{k: val[k] for k in ("tau", "tau_head", "head_tokens")}}
                        bar.update(tau=val["tau"])
                        self.write_metrics({"step": step, "split": "val", **val, "time": now_iso()})
                        log.info("val step %d: loss %.4f tau %.3f acc %s; first %d tokens of each turn: tau %.3f",
                                 step, val["loss"], val["tau"], " ".join(f"{a:.3f}" for a in val["acc"]),
                                 val["head_tokens"], val["tau_head"])

                if step % tc.checkpoint_every == 0 or step == stop_at or stopping:
                    self.checkpoint(step, epoch, micro_in_epoch, tokens_seen)
                    last_ckpt = step
                if stopping:
                    if rank0:
                        self.write_manifest(state="interrupted", resumed_from=resumed_from)
                    raise Interrupted(f"train stopped by signal {stop.signum} at step {step}; rerun to resume")
        if last_ckpt != step and step > 0:  # nothing left to run: make sure the final state is saved
            self.checkpoint(step, epoch, micro_in_epoch, tokens_seen)
        summary = {
            "step": step,
            "total_steps": self.total_steps,
            "finished": step >= self.total_steps,
            "resumed_from": resumed_from,
            "checkpoint": str(latest_checkpoint(self.dir)),
            "val": val if val is not None else self._last_val(),
            "tokens_seen": tokens_seen,
            "elapsed_s": round(time.time() - self.started, 3),
        }
        if self.micro is not None:
            summary["cuda_graphs"] = self.micro.summary()
            log.info("train: cuda graphs %s", summary["cuda_graphs"])
        if rank0:
            self.write_manifest(state="done" if summary["finished"] else "partial", resumed_from=resumed_from,
                                summary=summary)
            self.heartbeat(step, "finished" if summary["finished"] else "stopped", None)
        return summary

    def _last_val(self) -> dict[str, Any] | None:
        last = None
        if self.metrics_path.exists():
            for line in self.metrics_path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    row = json.loads(line)
                    if row.get("split") == "val":
                        last = row
        return last

    def checkpoint(self, step: int, epoch: int, micro_in_epoch: int, tokens_seen: int) -> None:
        if self.dist.rank == 0:
            with open(self.metrics_path, "a") as f:
                f.flush()
                os.fsync(f.fileno())
            state = {
                "epoch": epoch, "micro_batches_in_epoch": micro_in_epoch, "shuffle_seed": self.seed,
                "seed": self.seed, "world_size": self.dist.world, "grad_accum": self.tc.grad_accum,
                "batch_tokens": self.tc.batch_tokens, "pack_rows": self.tc.pack_rows, "total_steps": self.total_steps,
                "tokens_seen": tokens_seen,
            }
            path = save_checkpoint(self.dir, step, self.drafter, self.optimizer, self.scheduler, state,
                                   self.tc.keep_checkpoints)
            log.info("checkpoint %s", path)
        self.dist.barrier()

    def write_manifest(self, *, state: str, resumed_from: int | None, summary: dict | None = None) -> None:
        import transformers

        from .. import __version__

        path = self.dir / "manifest.json"
        m = read_json(path, {}) or {}
        m["train"] = {
            "state": state,
            "updated": now_iso(),
            "inputs": {**self.inputs, "target_model": str(self.model_dir),
                       "vocab": str(self.campaign.root / "build" / "vocab.safetensors")},
            "family": self.family.name,
            "drafter_config": self.dcfg.to_dict(),
            "train_config": dataclasses.asdict(self.tc),
            "seed": self.seed,
            "versions": {"specops": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
            "counts": {"train_samples": len(self.train_split), "train_skipped": self.train_split.skipped,
                       "val_samples": len(self.val_split) if self.val_split else 0,
                       "train_tokens": sum(self.train_split.lengths), "steps_per_epoch": self.steps_per_epoch,
                       "total_steps": self.total_steps, "world_size": self.dist.world},
            "warnings": self.warnings,
            "conventions": self.family.conventions(self.dcfg, self.family_tc),
            "resumed_from": resumed_from,
            "checkpoints": [str(p) for _, p in list_checkpoints(self.dir)],
            "metrics": str(self.metrics_path),
        }
        if summary is not None:
            m["train"]["summary"] = summary
        atomic_write_json(path, m)


def run_train(cfg, campaign: Campaign, *, features_fn: FeaturesFn | None = None, max_steps: int | None = None,
              lock: bool = True, family: str | None = None) -> dict[str, Any]:
    """Train (or resume) the drafter of `campaign`: `family` (default: the first of train.drafter) in
    its own home (Campaign.drafter_home), beside any other family's, which it never reads or
    touches. Returns the summary (step, val tau, checkpoint).

    Under torchrun (WORLD_SIZE > 1) every rank calls this; rank 0 takes the campaign lock, writes
    checkpoints, metrics and the manifest. `max_steps` stops early without changing the schedule
    (a later run continues the same curve). `lock=False` when the caller already holds the lock.
    """
    from ..config import check_family

    home = campaign.drafter_home(cfg, check_family(family, "--drafter") if family else None)
    phase = home.key("train")
    dist = _setup_dist(cfg.train.device)
    rank0 = dist.rank == 0
    lockctx = RunLock(campaign, "train") if (rank0 and lock) else contextlib.nullcontext()
    try:
        with lockctx:
            if rank0:
                campaign.set_phase(phase, "running", pid=os.getpid(), world_size=dist.world, family=home.family)
            try:
                summary = _Trainer(cfg, campaign, features_fn, dist, home).run(max_steps)
            except Interrupted as e:
                if rank0:
                    campaign.set_phase(phase, "pending", interrupted_reason=str(e))
                raise
            except BaseException as e:
                if rank0:
                    campaign.set_phase(phase, "failed", error=f"{type(e).__name__}: {e}")
                raise
            if rank0:
                val = summary.get("val") or {}
                campaign.set_phase(phase, "done" if summary["finished"] else "pending", step=summary["step"],
                                   total_steps=summary["total_steps"], tau=val.get("tau"),
                                   checkpoint=summary["checkpoint"])
            return summary
    finally:
        if dist.owns_group:
            import torch.distributed as tdist

            tdist.destroy_process_group()
