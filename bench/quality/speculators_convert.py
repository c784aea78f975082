"""Convert a specops campaign's build/ + features/ into the training input of speculators 0.9.0.

    python bench/quality/speculators_convert.py CAMPAIGN_DIR OUT_DIR [--workers 16] [--max-seq-len N]

What speculators' `train` reads (speculators/train/data.py `ArrowDataset`, hs_connectors
`FileTransfer`, speculators/train/cli.py `parse_vocab_mappings`), and what is written here:

    OUT_DIR/                         --data-path: a `datasets` dir (save_to_disk), torch format,
                                     columns input_ids int64 [T], loss_mask int64 [T], seq_len int64
    OUT_DIR/hidden_states/hs_<i>.safetensors
                                     row i: token_ids int64 [T] (must equal input_ids, else the
                                     sample is dropped), hidden_states bf16 [T, 4, H]: slots 0..2 =
                                     our aux (input-to-layer ids, index order), slot 3 = our `final`
                                     (PRE-norm: speculators applies the verifier's norm, then its
                                     lm_head rows of the draft vocab, to build the teacher)
    OUT_DIR/d2t-<V>.npy, t2d-<V>.npy our build/vocab.safetensors (np.load'ed, target = i + d2t[i])
    OUT_DIR/convert_manifest.json    counts, bytes, train_data_ratio, layer ids, the args to pass

Same samples as `specops train`: our train rows first (build order), then our val rows; a sample
is kept iff our trainer keeps it (>= 3 tokens and a loss-masked token at index >= 2, after the
optional --max-seq-len cut, as `FeatureSplit`). speculators splits ONE dataset by
`--train-data-ratio`: rows [0, int(N * ratio)) train, the rest validation; the ratio written to
the manifest is (n_train + 0.5) / N, so int(N * ratio) == n_train exactly. speculators refuses an
empty validation split, so with no val rows the last train row is repeated once as validation
(the manifest says so).

Streaming: shards are memory-mapped (numpy), each sample is interleaved into one [T, 4, H] buffer
and written by a thread pool (numpy copies and file writes release the GIL); at most
~2 x workers samples are in flight. bf16 features are copied bit for bit; fp8 features are
dequantized exactly as our trainer does (`fp8.float() * scale`, then bf16). Files are written to a
temp name and renamed; a rerun skips hs files that already have the right size (resume), unless
--overwrite.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

FEATURES_FORMAT = "specops-features-v1"
SPLITS = ("train", "val")
_NP = {"I64": np.int64, "I32": np.int32, "U8": np.uint8, "F32": np.float32, "BF16": np.uint16,
       "F8_E4M3": np.uint8, "BOOL": np.bool_}


# ------------------------------------------------------------------ safetensors, by hand

def read_header(path: Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class Shard:
    """One features shard, memory-mapped; tensors are numpy views (bf16 as uint16 bits)."""

    def __init__(self, path: Path):
        self.path = path
        header, base = read_header(path)
        self.mm = np.memmap(path, dtype=np.uint8, mode="r")
        self.t: dict[str, np.ndarray] = {}
        self.dtypes: dict[str, str] = {}
        for name, info in header.items():
            a, b = info["data_offsets"]
            self.t[name] = self.mm[base + a:base + b].view(_NP[info["dtype"]]).reshape(info["shape"])
            self.dtypes[name] = info["dtype"]


def _st_header(tensors: list[tuple[str, str, tuple[int, ...], int]]) -> bytes:
    """tensors: (name, dtype, shape, nbytes) in data order -> the 8-byte length + padded JSON."""
    header, pos = {}, 0
    for name, dt, shape, n in tensors:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def hs_file_size(T: int, H: int) -> int:
    return len(_st_header([("token_ids", "I64", (T,), 8 * T), ("hidden_states", "BF16", (T, 4, H), 8 * T * H)])) \
        + 8 * T + 8 * T * H


def write_hs(path: Path, token_ids: np.ndarray, hs_bits: np.ndarray) -> int:
    """token_ids int64 [T], hs_bits uint16 [T, 4, H] (bf16 bits) -> hs_<i>.safetensors, atomically."""
    T, _, H = hs_bits.shape
    head = _st_header([("token_ids", "I64", (T,), 8 * T), ("hidden_states", "BF16", (T, 4, H), hs_bits.nbytes)])
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(head)
        f.write(memoryview(np.ascontiguousarray(token_ids, dtype=np.int64)).cast("B"))
        f.write(memoryview(hs_bits).cast("B"))
    os.replace(tmp, path)
    return len(head) + 8 * T + hs_bits.nbytes


def write_dataset(out: Path, input_ids: list[np.ndarray], loss_mask: list[np.ndarray], seq_len: list[int]) -> None:
    """The rows speculators' ArrowDataset loads from --data-path (`datasets` save_to_disk layout)."""
    try:
        from datasets import Dataset, Features, Sequence, Value
    except ImportError as e:
        raise SystemExit(f"`datasets` is not importable ({e}): put the speculators wheels dir on PYTHONPATH") from e
    feats = Features({"input_ids": Sequence(Value("int64")), "loss_mask": Sequence(Value("int64")),
                      "seq_len": Value("int64")})
    ds = Dataset.from_dict({"input_ids": [x.tolist() for x in input_ids],
                            "loss_mask": [x.tolist() for x in loss_mask], "seq_len": seq_len}, features=feats)
    ds.set_format(type="torch")  # ArrowDataset compares tensors with torch.equal
    tmp = out / ".dataset.tmp"
    if tmp.exists():
        import shutil
        shutil.rmtree(tmp)
    ds.save_to_disk(str(tmp))
    for f in tmp.iterdir():  # load_from_disk(OUT_DIR): state.json, dataset_info.json, data-*.arrow
        os.replace(f, out / f.name)
    tmp.rmdir()


# ------------------------------------------------------------------ campaign side

def usable(loss_mask: np.ndarray) -> bool:
    """Our trainer's rule (drafter/train.py `_usable`): step 0 predicts x_{t+2}."""
    return loss_mask.shape[0] >= 3 and bool(loss_mask[2:].any())


def plan_split(split_dir: Path, max_seq_len: int | None) -> tuple[dict[str, Any], list[tuple[int, int, int, int]], int]:
    """-> (index.json, [(sample_index, shard_no, start, end)] of kept samples in build order, skipped)."""
    index = json.loads((split_dir / "index.json").read_text())
    if index.get("format") != FEATURES_FORMAT or not index.get("complete"):
        raise SystemExit(f"{split_dir}/index.json: not a complete {FEATURES_FORMAT} index (run `specops extract`)")
    if index.get("final", "pre-norm") != "pre-norm":
        raise SystemExit(f"{split_dir}: final is {index.get('final')!r}; speculators needs the pre-norm final state")
    rows, skipped = [], 0
    for si, s in enumerate(index["shards"]):
        sh = Shard(split_dir / s["name"])
        offs, sidx, lm = sh.t["offsets"], sh.t["sample_index"], sh.t["loss_mask"]
        for j in range(len(sidx)):
            a, b = int(offs[j]), int(offs[j + 1])
            if max_seq_len:
                b = min(b, a + max_seq_len)
            if not usable(lm[a:b]):
                skipped += 1
                continue
            rows.append((int(sidx[j]), si, a, b))
        del sh
    rows.sort()
    if len({r[0] for r in rows}) != len(rows):
        raise SystemExit(f"{split_dir}: a build row appears in two shards")
    return index, rows, skipped


class Converter:
    def __init__(self, camp: Path, out: Path, *, workers: int, max_seq_len: int | None, overwrite: bool,
                 consume: bool = False):
        self.camp, self.out, self.workers, self.overwrite = camp, out, workers, overwrite
        self.consume = consume  # delete each features shard once all of its samples are written
        self.max_seq_len = max_seq_len
        self.local = threading.local()
        self.index: dict[str, dict[str, Any]] = {}
        self.rows: dict[str, list[tuple[int, int, int, int]]] = {}
        self.skipped: dict[str, int] = {}
        for split in SPLITS:
            d = camp / "features" / split
            if split == "val" and not (d / "index.json").is_file():
                self.index[split], self.rows[split], self.skipped[split] = {}, [], 0
                continue
            self.index[split], self.rows[split], self.skipped[split] = plan_split(d, max_seq_len)
        tr = self.index["train"]
        self.H = int(tr["hidden_size"])
        self.aux_ids = [int(i) for i in tr["aux_layer_ids"]]
        if len(self.aux_ids) != 3:
            raise SystemExit(f"features have {len(self.aux_ids)} aux layers; EAGLE-3 needs 3")
        for split in ("val",):
            ix = self.index[split]
            if ix and (ix["aux_layer_ids"] != tr["aux_layer_ids"] or ix["hidden_size"] != tr["hidden_size"]
                       or ix["dtype"] != tr["dtype"]):
                raise SystemExit("features/train and features/val disagree on layers, hidden size or dtype")

    # -- one sample
    def _shard(self, split: str, si: int) -> Shard:
        cache = self.local.__dict__.setdefault("shards", {})
        key = (split, si)
        if key not in cache:
            if len(cache) >= (1 if self.consume else 4):  # consume: unmap finished shards soon
                cache.clear()
            cache[key] = Shard(self.camp / "features" / split / self.index[split]["shards"][si]["name"])
        return cache[key]

    def _sample(self, split: str, si: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        sh = self._shard(split, si)
        ids = sh.t["input_ids"][a:b].astype(np.int64)
        mask = sh.t["loss_mask"][a:b].astype(np.int64)
        T, H = b - a, self.H
        hs = np.empty((T, 4, H), dtype=np.uint16)
        if sh.dtypes["aux"] == "BF16":
            hs[:, :3] = sh.t["aux"][a:b]
            hs[:, 3] = sh.t["final"][a:b]
        elif sh.dtypes["aux"] == "F8_E4M3":
            import torch

            def deq(name: str) -> np.ndarray:
                q = torch.from_numpy(np.array(sh.t[name][a:b])).view(torch.float8_e4m3fn)
                s = torch.from_numpy(np.array(sh.t[name + "_scale"][a:b])).float()
                return (q.float() * s[..., None]).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)

            hs[:, :3] = deq("aux")
            hs[:, 3] = deq("final")
        else:
            raise SystemExit(f"unsupported features dtype {sh.dtypes['aux']}")
        return ids, mask, hs

    def _job(self, i: int, split: str, si: int, a: int, b: int) -> tuple[int, int, bool]:
        path = self.out / "hidden_states" / f"hs_{i}.safetensors"
        if not self.overwrite and path.is_file() and path.stat().st_size == hs_file_size(b - a, self.H):
            return i, path.stat().st_size, False
        ids, _, hs = self._sample(split, si, a, b)
        return i, write_hs(path, ids, hs), True

    # -- everything
    def run(self) -> dict[str, Any]:
        t0 = time.time()
        (self.out / "hidden_states").mkdir(parents=True, exist_ok=True)
        order = [("train", r) for r in self.rows["train"]] + [("val", r) for r in self.rows["val"]]
        n_train, n_val = len(self.rows["train"]), len(self.rows["val"])
        if n_train == 0:
            raise SystemExit("no usable train sample")
        val_is_copy = n_val == 0
        if val_is_copy:  # speculators refuses an empty validation split
            order.append(order[n_train - 1])
        N = len(order)
        ratio = (n_train + 0.5) / N
        assert int(N * ratio) == n_train, (N, ratio, n_train)

        # token columns (small: a few bytes per token) straight from the shards
        input_ids, loss_mask, seq_len = [], [], []
        loss_tokens = 0
        for split, (_, si, a, b) in order:
            sh = self._shard(split, si)
            input_ids.append(sh.t["input_ids"][a:b].astype(np.int64))
            m = sh.t["loss_mask"][a:b].astype(np.int64)
            loss_mask.append(m)
            seq_len.append(b - a)
            loss_tokens += int(m.sum())
        self.local.__dict__.pop("shards", None)

        # --consume: how many kept samples of each shard are still to write; at 0 the shard goes
        left: dict[tuple[str, int], int] = {}
        for split, (_, si, _, _) in order:  # the repeated val row too: its shard must outlive it
            left[(split, si)] = left.get((split, si), 0) + 1
        freed = 0
        written = skipped_existing = 0
        nbytes = 0
        done = 0
        last = time.time()
        max_inflight = 2 * self.workers
        with cf.ThreadPoolExecutor(self.workers) as pool:
            pending: set[cf.Future] = set()
            it = iter(enumerate(order))
            while True:
                while len(pending) < max_inflight:
                    nxt = next(it, None)
                    if nxt is None:
                        break
                    i, (split, (_, si, a, b)) = nxt
                    pending.add(pool.submit(self._job, i, split, si, a, b))
                if not pending:
                    break
                finished, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                for f in finished:
                    i, n, new = f.result()
                    if self.consume:
                        split, (_, si, _, _) = order[i]
                        left[(split, si)] -= 1
                        if left[(split, si)] == 0:
                            shard = self.camp / "features" / split / self.index[split]["shards"][si]["name"]
                            freed += shard.stat().st_size if shard.exists() else 0
                            shard.unlink(missing_ok=True)
                    nbytes += n
                    done += 1
                    written += new
                    skipped_existing += not new
                if time.time() - last > 10:
                    el = time.time() - t0
                    print(f"  {done}/{N} samples, {nbytes / 1e9:.2f} GB, {nbytes / 1e6 / el:.0f} MB/s", flush=True)
                    last = time.time()
        t_hs = time.time() - t0

        write_dataset(self.out, input_ids, loss_mask, seq_len)
        vocab = self._write_vocab()
        tokens = int(sum(seq_len))
        manifest = {
            "format": "specops->speculators-0.9.0",
            "campaign": str(self.camp),
            "rows": N, "n_train": n_train, "n_val": n_val, "val_is_copy_of_last_train_row": val_is_copy,
            "train_data_ratio": ratio,
            "skipped_unusable": self.skipped,
            "max_seq_len": self.max_seq_len,
            "tokens": tokens, "train_tokens": int(sum(seq_len[:n_train])), "loss_tokens": loss_tokens,
            "max_sample_len": int(max(seq_len)),
            "hidden_size": self.H,
            "aux_layer_ids": self.aux_ids,
            "aux_layer_convention": self.index["train"].get("aux_layer_convention"),
            "features_dtype": self.index["train"].get("dtype"),
            "final": "pre-norm (hidden_states[:, 3])",
            "consumed_feature_bytes": freed,
            "hs_files": N, "hs_written": written, "hs_reused": skipped_existing, "hs_bytes": nbytes,
            "draft_vocab_size": vocab["draft_vocab_size"], "target_vocab_size": vocab["target_vocab_size"],
            "d2t_path": vocab["d2t_path"], "t2d_path": vocab["t2d_path"],
            "seconds": round(time.time() - t0, 3), "hs_seconds": round(t_hs, 3),
        }
        (self.out / "convert_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        return manifest

    def _write_vocab(self) -> dict[str, Any]:
        from safetensors.numpy import load_file

        v = load_file(str(self.camp / "build" / "vocab.safetensors"))
        d2t, t2d = v["d2t"].astype(np.int64), v["t2d"].astype(np.bool_)
        V = d2t.shape[0]
        tid = np.arange(V, dtype=np.int64) + d2t
        # speculators takes lm_head rows as lm_head[t2d] (ascending target ids) and maps draft id i
        # to i + d2t[i]: the two agree only when draft ids are in ascending target-id order.
        if not (np.all(np.diff(tid) > 0) and tid[0] >= 0 and tid[-1] < t2d.shape[0]):
            raise SystemExit("build/vocab.safetensors: draft ids are not ascending target ids")
        if int(t2d.sum()) != V or not bool(t2d[tid].all()):
            raise SystemExit("build/vocab.safetensors: t2d does not match d2t")
        d2t_path, t2d_path = self.out / f"d2t-{V}.npy", self.out / f"t2d-{V}.npy"
        np.save(d2t_path, d2t)
        np.save(t2d_path, t2d)
        return {"draft_vocab_size": V, "target_vocab_size": int(t2d.shape[0]),
                "d2t_path": str(d2t_path), "t2d_path": str(t2d_path)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("campaign", type=Path, help="campaign dir (with build/ and features/)")
    ap.add_argument("out", type=Path, help="output dir = speculators --data-path")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 4))
    ap.add_argument("--max-seq-len", type=int, default=None,
                    help="cut samples as train.max_seq_len does (default: as build wrote them)")
    ap.add_argument("--overwrite", action="store_true", help="rewrite hs files that already exist")
    ap.add_argument("--consume", action="store_true",
                    help="delete each features shard once its samples are converted (the disk holds one copy, "
                         "not two; the campaign's features are gone afterwards: only after training on them)")
    a = ap.parse_args(argv)
    conv = Converter(a.campaign.resolve(), a.out.resolve(), workers=a.workers, max_seq_len=a.max_seq_len,
                     overwrite=a.overwrite, consume=a.consume)
    m = conv.run()
    print(f"rows {m['rows']} (train {m['n_train']}, val {m['n_val']}{' [copy]' if m['val_is_copy_of_last_train_row'] else ''}),"
          f" skipped unusable {m['skipped_unusable']}")
    print(f"tokens {m['tokens']} (train {m['train_tokens']}, loss-masked {m['loss_tokens']}), longest {m['max_sample_len']}")
    print(f"hs files {m['hs_files']} ({m['hs_written']} written, {m['hs_reused']} reused), "
          f"{m['hs_bytes'] / 1e9:.3f} GB in {m['hs_seconds']:.1f} s "
          f"({m['hs_bytes'] / 1e6 / max(m['hs_seconds'], 1e-9):.0f} MB/s); total {m['seconds']:.1f} s")
    print(f"draft vocab {m['draft_vocab_size']} -> {m['d2t_path']}, {m['t2d_path']}")
    print(f"speculators args: --data-path {a.out.resolve()} --train-data-ratio {m['train_data_ratio']!r} "
          f"--target-layer-ids {' '.join(map(str, m['aux_layer_ids']))} --draft-vocab-size {m['draft_vocab_size']} "
          f"--d2t-path {m['d2t_path']} --t2d-path {m['t2d_path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
