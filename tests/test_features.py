"""The feature-shard format (specops.features): the one writer, the one reader, the one fp8
dequantiser, and the shard digest. Real files; no model (extract's tests cover the features)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from specops import features
from specops.errors import InputError
from specops.features import FORMAT, FeatureReader, ShardWriter, read_shard, read_split, to_storage

from builders import digest

H, N_AUX = 16, 3


def write_split(split_dir: Path, dtype: str, lengths: list[int], seed: int = 0) -> dict[int, dict]:
    """One shard through ShardWriter (rows written in two calls, out of order) + a complete index.
    Returns the samples as written, float32, by sample index."""
    g = torch.Generator().manual_seed(seed)
    split_dir.mkdir(parents=True)
    n = sum(lengths)
    aux = 3 * torch.randn(n, N_AUX, H, generator=g)
    final = torch.randn(n, H, generator=g)
    ids = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32)
    mask = (torch.rand(n, generator=g) > 0.5).to(torch.uint8)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    w = ShardWriter(split_dir / "shard-0-0.safetensors", n, len(lengths), H, dtype)
    try:
        stored = to_storage(aux, final, dtype)
        half = n // 2
        for name, t in stored.items():  # second half first: rows land at their own offsets
            w.write(name, half, t[half:])
            w.write(name, 0, t[:half])
        w.write("input_ids", 0, ids)
        w.write("loss_mask", 0, mask)
        w.write("offsets", 0, offsets)
        w.write("sample_index", 0, torch.arange(len(lengths), dtype=torch.int64) + 10)
    finally:
        w.close()
    (split_dir / "index.json").write_text(json.dumps({
        "format": FORMAT, "complete": True, "aux_layer_ids": [2, 4, 5], "hidden_size": H, "dtype": dtype,
        "final": "pre-norm", "shards": [{"name": "shard-0-0.safetensors"}]}))
    o = offsets.tolist()
    return {10 + i: {"input_ids": ids[o[i]:o[i + 1]], "loss_mask": mask[o[i]:o[i + 1]],
                     "aux": aux[o[i]:o[i + 1]], "final": final[o[i]:o[i + 1]]} for i in range(len(lengths))}


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_written_shard_reads_back_through_every_reader(tmp_path, dtype):
    want = write_split(tmp_path / "val", dtype, [5, 9, 1, 7])
    shard = read_shard(tmp_path / "val" / "shard-0-0.safetensors")
    assert set(shard) >= {"offsets", "sample_index", "input_ids", "loss_mask", "aux", "final"}
    assert ("aux_scale" in shard) == (dtype == "float8_e4m3fn")
    got = read_split(tmp_path / "val", dequantize=True)
    reader = FeatureReader(tmp_path / "val")
    offsets, mask = reader.sample_spans(0)
    assert reader.fp8 == (dtype == "float8_e4m3fn") and reader.aux_layer_ids == [2, 4, 5] and reader.final_prenorm
    assert sorted(got) == sorted(want)
    for j, si in enumerate(sorted(want)):
        w, g = want[si], got[si]
        assert torch.equal(g["input_ids"], w["input_ids"]) and torch.equal(g["loss_mask"], w["loss_mask"])
        if dtype == "bfloat16":  # the stored values exactly: the bf16 cast of what was written
            assert torch.equal(g["aux"], w["aux"].to(torch.bfloat16)) and torch.equal(g["final"], w["final"].to(torch.bfloat16))
        else:  # e4m3 keeps 3 mantissa bits: within 2^-4 relative of each row's absmax scale
            for k in ("aux", "final"):
                bound = w[k].abs().amax(-1, keepdim=True) / 16 + 1e-6
                assert ((g[k] - w[k]).abs() <= bound).all(), k
        # the lazy reader gives the same rows, dequantised by the same function
        ids, m, aux, final = reader.rows(0, offsets[j], offsets[j + 1], dtype=torch.float32)
        assert torch.equal(ids, w["input_ids"].long()) and torch.equal(m, mask[offsets[j]:offsets[j + 1]])
        assert torch.equal(aux, g["aux"].float()) and torch.equal(final, g["final"].float())


def test_the_reader_refuses_a_missing_or_incomplete_index(tmp_path):
    with pytest.raises(InputError, match="index.json not found: run `specops extract` first"):
        FeatureReader(tmp_path / "nothing")
    write_split(tmp_path / "val", "bfloat16", [3])
    index = json.loads((tmp_path / "val" / "index.json").read_text())
    (tmp_path / "val" / "index.json").write_text(json.dumps({**index, "complete": False}))
    with pytest.raises(InputError, match="not a complete specops-features-v1 index"):
        FeatureReader(tmp_path / "val")


def test_shard_layout_is_aligned_and_sized():
    for dtype in ("bfloat16", "float8_e4m3fn"):
        head, layout, total = features.shard_layout(1000, 7, H, dtype)
        assert len(head) % 8 == 0
        for name, (dt, shape, off) in layout.items():
            assert off % dt.itemsize == 0, (dtype, name)
        assert total - len(head) == 1000 * features.feature_bytes_per_token(H, dtype) + 8 * (7 + 1) + 8 * 7


def test_shard_digest_is_the_sha256_of_its_pieces_digests(tmp_path, monkeypatch):
    """features.shard_digest equals the independent definition (builders.digest) for pieces that
    divide the file, that do not, one piece for all, reads smaller than a piece, and an empty file."""
    import hashlib

    f = tmp_path / "x"
    f.write_bytes(os.urandom(10_007))
    for unit in (1000, 4096, 10_007, 1 << 20):
        assert features.shard_digest(f, unit=unit) == digest(f, unit=unit), unit
    monkeypatch.setattr(features, "_READ_CHUNK", 300)  # several reads per piece
    assert features.shard_digest(f, unit=1000) == digest(f, unit=1000)
    assert features.shard_digest(f, unit=1000) != hashlib.sha256(f.read_bytes()).hexdigest()
    e = tmp_path / "e"
    e.write_bytes(b"")
    assert features.shard_digest(e) == hashlib.sha256(hashlib.sha256(b"").digest()).hexdigest() == digest(e)
