"""Benchmark the write path of `extract` alone, on the CPU: shard writer + finalizer vs a dd-like baseline.

Synthetic bf16 features shaped like an 8B target (hidden 4096, 3 aux layers + final: 32,773 bytes per
token) go through the same code a real run uses (`specops.extract._extract_shard` with a `_Pipeline`:
writer, finalizer with fsync + digest + sidecar + rename) into `--dir`. Only the forward is replaced:
a stand-in target hands out views of two preallocated tensors, so the figures are the write path's.

Each repeat runs, back to back on the same disk:

* `dd`: the same number of bytes written by one thread with plain `os.write` (16 MiB blocks) and one
  `fsync` at the end (what `dd bs=16M conv=fsync` measures);
* `raw`: the extract write path with an instant forward: its GB/s (file bytes / wall time, the last
  shard's fsync, hash, sidecar and rename included) and the ratio to `dd`;
* `paced` (unless `--pace 0`): the forward is emulated by sleeping, at a rate that produces feature
  bytes at `--pace` x the dd rate just measured (the H200 case: the bare forward needs ~0.9 of what
  the disk writes), or at `--pace-gbs` GB/s. Its ratio = emulated forward time / wall time, the
  analogue of the GPU benchmark's "extract vs bare forward" ratio (1.0 = the writes are completely
  hidden).

`--eager-writeback async|sync|off` forces the write path's eager writeback (extract.eager_writeback:
sync_file_range after each written range, by a flusher thread or by the writer; see
`resolve_writeback` and `ShardWriter` in specops/features.py), to compare them in the same
conditions; `--staged` takes the CUDA path's reused staging slots (here plain host buffers) instead
of handing the features over directly.

The disk of a shared machine varies from second to second, so repeats alternate the three and the
medians are reported next to every repeat's figures.

    python bench/extract_write_cpu.py --dir /work/tmpbench [--gb 4] [--repeats 3] [--pace 0.9] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from safetensors.torch import save_file  # noqa: E402

from specops import extract  # noqa: E402
from specops.features import feature_bytes_per_token, resolve_writeback, shard_digest, shard_layout  # noqa: E402


class StandInTarget:
    """What `_extract_shard` needs of a target: `hidden_size` and `forward_features`.

    The features are views of two preallocated contiguous tensors (aux [budget, n_aux, H], final
    [budget, H]), shaped [B, T, ...] as a real forward returns them; `delay_per_token` > 0 sleeps
    that long per padded token to stand in for the forward's time.
    """

    def __init__(self, hidden: int, n_aux: int, max_tokens: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.hidden_size = hidden
        self.n_aux = n_aux
        # Random bits (not zeros): no file system can shortcut them. Filled in int16 (cheap), viewed as bf16.
        self.aux = torch.randint(-(1 << 15), 1 << 15, (max_tokens, n_aux, hidden), generator=g, dtype=torch.int16)
        self.aux = self.aux.view(torch.bfloat16)
        self.final = torch.randint(-(1 << 15), 1 << 15, (max_tokens, hidden), generator=g, dtype=torch.int16)
        self.final = self.final.view(torch.bfloat16)
        self.delay_per_token = 0.0
        self.slept = 0.0

    def forward_features(self, input_ids, attention_mask=None, layer_ids=None):
        B, T = input_ids.shape
        if B * T > len(self.aux):
            raise ValueError(f"batch of {B}x{T} tokens exceeds the stand-in's {len(self.aux)} tokens")
        if self.delay_per_token > 0:
            d = B * T * self.delay_per_token
            time.sleep(d)
            self.slept += d
        return self.aux[: B * T].view(B, T, self.n_aux, self.hidden_size), self.final[: B * T].view(B, T, -1)


def make_split(root: Path, lengths: list[int], shard_tokens: int) -> extract._Split:
    """A build split of `lengths` (random token ids) and the `_Split` a one-rank run would open for it."""
    build = root / "build"
    build.mkdir(parents=True, exist_ok=True)
    n = sum(lengths)
    offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    g = torch.Generator().manual_seed(1)
    path = build / "train.safetensors"
    save_file(
        {
            "input_ids": torch.randint(0, 128256, (n,), generator=g, dtype=torch.int32),
            "loss_mask": torch.ones(n, dtype=torch.uint8),
            "offsets": offsets,
        },
        str(path),
    )
    plan = {"bench": "extract_write_cpu", "shard_tokens": shard_tokens, "world_size": 1}
    return extract._Split(
        name="train",
        build_path=path,
        out_dir=root / "features" / "train",
        offsets=offsets,
        shards=extract.plan_shards(offsets.tolist(), shard_tokens, 1),
        plan=plan,
        plan_key="bench",
    )


def run_write_path(sp: extract._Split, target: StandInTarget, token_budget: int, verify: bool,
                   writeback: str = "off") -> dict:
    """Every shard of `sp` through `_extract_shard` + the pipeline, as `run_extract` drives them."""
    shutil.rmtree(sp.out_dir, ignore_errors=True)
    sp.out_dir.mkdir(parents=True)
    target.slept = 0.0
    pipe = extract._Pipeline(torch.device("cpu"), token_budget, writeback=writeback)
    t0 = time.perf_counter()
    dones: list[dict] = []
    try:
        with torch.inference_mode():
            for s in sp.shards:
                extract._extract_shard(pipe, target, sp, s, [2, 16, 29], "bfloat16", token_budget)
                dones += pipe.take_done()
        t_queued = time.perf_counter()
        dones += pipe.join()
        t_end = time.perf_counter()
    except BaseException:
        pipe.abort()
        raise
    finally:
        pipe.shutdown()
    wall = t_end - t0
    nbytes = sum(d["bytes"] for d in dones)
    assert len(dones) == len(sp.shards) and all((sp.out_dir / d["name"]).is_file() for d in dones)
    if verify:  # the sidecar's digest is the file's (read back here, outside the timed part)
        for d in dones:
            assert shard_digest(sp.out_dir / d["name"]) == d["digest"], d["name"]
    shutil.rmtree(sp.out_dir)
    return {
        "bytes": nbytes,
        "seconds": round(wall, 3),
        "gb_s": round(nbytes / wall / 1e9, 3),
        "tail_s": round(t_end - t_queued, 3),  # after the last batch was queued: writes + last finalize
        "forward_s": round(target.slept, 3),
        "finalize_s": [d["finalize_seconds"] for d in dones],
    }


def run_dd(path: Path, nbytes: int, block: int = 16 << 20) -> dict:
    """`dd bs=16M conv=fsync` in Python: one thread, plain os.write of one buffer, fsync at the end."""
    buf = os.urandom(block)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf if left >= block else buf[:left])
        os.fsync(fd)
    finally:
        os.close(fd)
    wall = time.perf_counter() - t0
    os.unlink(path)
    return {"bytes": nbytes, "seconds": round(wall, 3), "gb_s": round(nbytes / wall / 1e9, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="where to write (a scratch dir on the disk to measure)")
    ap.add_argument("--gb", type=float, default=4.0, help="feature bytes per run, in GB (1e9)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--n-aux", type=int, default=3)
    ap.add_argument("--token-budget", type=int, default=8192, help="padded tokens per batch")
    ap.add_argument("--shard-tokens", type=int, default=40960,
                    help="tokens per shard (40960: 3 shards in 4 GB, like 128K-token shards in the H200 run's 12 GB)")
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pace", type=float, default=0.9,
                    help="paced run: emulated forward producing bytes at this fraction of the dd rate (0: skip)")
    ap.add_argument("--pace-gbs", type=float, default=0.0,
                    help="paced run at this absolute rate in GB/s instead of a fraction of dd's")
    ap.add_argument("--staged", action="store_true", help="use the staging-slot path (the CUDA path's, on CPU)")
    ap.add_argument("--verify", action="store_true", help="check every sidecar digest against a read-back")
    ap.add_argument("--eager-writeback", choices=("auto", "async", "sync", "on", "off"), default="auto",
                    help="start each written range's writeback at once: async (a flusher thread), sync or on (the "
                         "writer itself), off (leave it to each shard's fsync); auto: extract's own choice "
                         "(extract.eager_writeback = auto: async with >= 8 usable CPUs, else off)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if a.staged:
        extract._STAGE_CPU = True
    eager = resolve_writeback({"on": "sync"}.get(a.eager_writeback, a.eager_writeback))

    root = a.dir / f"extract-write-bench-{os.getpid()}"
    root.mkdir(parents=True)
    try:
        bpt = feature_bytes_per_token(a.hidden, "bfloat16", a.n_aux)
        g = torch.Generator().manual_seed(0)
        lengths: list[int] = []
        while sum(lengths) * bpt < a.gb * 1e9:
            lengths.append(int(torch.randint(a.min_len, a.max_len + 1, (1,), generator=g)))
        sp = make_split(root, lengths, a.shard_tokens)
        file_bytes = sum(
            shard_layout(s.n_tokens, s.n_samples, a.hidden, "bfloat16", a.n_aux)[2] for s in sp.shards
        )
        target = StandInTarget(a.hidden, a.n_aux, max(a.token_budget, a.max_len))
        reps = []
        for r in range(a.repeats):
            rep: dict = {"dd": run_dd(root / "dd.bin", file_bytes)}
            target.delay_per_token = 0.0
            rep["raw"] = run_write_path(sp, target, a.token_budget, a.verify, eager)
            rep["raw"]["ratio_to_dd"] = round(rep["raw"]["gb_s"] / rep["dd"]["gb_s"], 3)
            if a.pace > 0 or a.pace_gbs > 0:
                # Feature bytes at pace x dd's rate (or pace_gbs) -> seconds per padded token of the emulated forward.
                real_tokens = sum(lengths)
                padded = 0
                for s in sp.shards:
                    ls = lengths[s.start : s.stop]
                    padded += sum(len(b) * ls[b[0]] for b in extract.plan_batches(ls, a.token_budget))
                rate = a.pace_gbs if a.pace_gbs > 0 else a.pace * rep["dd"]["gb_s"]
                forward_s = real_tokens * bpt / (rate * 1e9)
                target.delay_per_token = forward_s / padded
                rep["paced"] = run_write_path(sp, target, a.token_budget, a.verify, eager)
                rep["paced"]["ratio_to_forward"] = round(rep["paced"]["forward_s"] / rep["paced"]["seconds"], 3)
            reps.append(rep)
            print(f"repeat {r}: dd {rep['dd']['gb_s']:.3f} GB/s | write path {rep['raw']['gb_s']:.3f} GB/s "
                  f"(x{rep['raw']['ratio_to_dd']:.2f} of dd, tail {rep['raw']['tail_s']:.2f}s)"
                  + (f" | paced at {rate:.3f} GB/s: {rep['paced']['ratio_to_forward']:.3f} of the forward's rate"
                     if "paced" in rep else ""), flush=True)  # fmt: skip

        def med(*keys):
            vals = []
            for rep in reps:
                v = rep
                for k in keys:
                    v = v[k]
                vals.append(v)
            return round(statistics.median(vals), 3)

        res = {
            "bench": "extract_write_cpu",
            "dir": str(a.dir),
            "extract_module": extract.__file__,
            "cpus": os.cpu_count(),
            "shape": {"hidden": a.hidden, "n_aux": a.n_aux, "dtype": "bfloat16", "bytes_per_token": bpt},
            "tokens": sum(lengths),
            "file_bytes": file_bytes,
            "shards": len(sp.shards),
            "shard_tokens": a.shard_tokens,
            "token_budget": a.token_budget,
            "staged": a.staged,
            "eager_writeback": eager,
            "repeats": reps,
            "median_dd_gb_s": med("dd", "gb_s"),
            "median_write_path_gb_s": med("raw", "gb_s"),
            "median_ratio_to_dd": med("raw", "ratio_to_dd"),
        }
        if "paced" in reps[0]:
            res["pace"] = {"gb_s": a.pace_gbs} if a.pace_gbs > 0 else {"fraction_of_dd": a.pace}
            res["median_paced_gb_s"] = med("paced", "gb_s")
            res["median_paced_ratio_to_forward"] = med("paced", "ratio_to_forward")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({k: v for k, v in res.items() if k != "repeats"}, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
