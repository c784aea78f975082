"""Compare two campaign directories artefact by artefact: what a refactor must leave unchanged.

    python bench/compare_campaigns.py CAMPAIGN_A CAMPAIGN_B [--out F]

Checks (each true/false in the JSON it prints): the generated records (content and token ids per
sample id, timings ignored), the build files byte for byte, every feature shard's digest, the final
training checkpoint's tensors, both exports' tensors, the training metrics (timing fields ignored),
and the eval rows (tokens and accepted counts per turn) with the overall tau. Exit 0 when every
check holds, 1 otherwise. Report files carry wall-clock figures and timestamps, so they are not
compared byte for byte.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

TIMING_KEYS = {"time", "ts", "iso", "elapsed_s", "wall_s", "tokens_per_s", "tok_s", "step_s"}


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _records(d: Path) -> dict:
    rows = {}
    for f in sorted((d / "generate").glob("*/records.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            rows[r["id"]] = (r.get("content"), [t.get("token_ids") for t in r.get("turns") or []])
    return rows


def _last_checkpoint(d: Path) -> Path:
    return sorted((d / "drafter" / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))[-1]


def _tensors_equal(a: Path, b: Path) -> tuple[bool, float]:
    import torch
    from safetensors.torch import load_file

    ta, tb = load_file(str(a)), load_file(str(b))
    if ta.keys() != tb.keys():
        return False, float("inf")
    diff = max((float((ta[k].double() - tb[k].double()).abs().max()) for k in ta if ta[k].numel()), default=0.0)
    return all(torch.equal(ta[k], tb[k]) for k in ta), diff


def _metrics(d: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
            for line in (d / "drafter" / "metrics.jsonl").read_text().splitlines()]


def compare(a: Path, b: Path) -> dict:
    out: dict = {"generate records": _records(a) == _records(b)}
    for f in ("train.safetensors", "val.safetensors", "vocab.safetensors"):
        out[f"build/{f}"] = _sha(a / "build" / f) == _sha(b / "build" / f)
    for split in ("train", "val"):
        ia, ib = (json.loads((d / "features" / split / "index.json").read_text()) for d in (a, b))
        out[f"features/{split} shard digests"] = (
            [s.get("digest") or s.get("sha256") for s in ia["shards"]]
            == [s.get("digest") or s.get("sha256") for s in ib["shards"]])
    eq, diff = _tensors_equal(_last_checkpoint(a) / "model.safetensors", _last_checkpoint(b) / "model.safetensors")
    out["final checkpoint tensors"], out["final checkpoint max abs diff"] = eq, diff
    for fmt in ("vllm", "speculators"):
        out[f"export/{fmt} tensors"] = _tensors_equal(*(d / "drafter" / "export" / fmt / "model.safetensors"
                                                       for d in (a, b)))[0]
    ma, mb = _metrics(a), _metrics(b)
    out["train metrics"] = len(ma) == len(mb) and all(
        {k: r1.get(k) for k in r1.keys() & r2.keys()} == {k: r2.get(k) for k in r1.keys() & r2.keys()}
        for r1, r2 in zip(ma, mb))
    ea, eb = ({p.name: json.loads(p.read_text())["rows"] for p in (d / "eval").glob("*.json")
               if p.name != "summary.json"} for d in (a, b))
    out["eval rows (tokens, accepted)"] = ea.keys() == eb.keys() and all(
        [(r["spec"]["tokens"], r["spec"]["accepted"]) for r in ea[k]]
        == [(r["spec"]["tokens"], r["spec"]["accepted"]) for r in eb[k]] for k in ea)
    sa, sb = (json.loads((d / "eval" / "summary.json").read_text())["overall"].get("tau") for d in (a, b))
    out["eval tau"] = [sa, sb]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    res = compare(args.a, args.b)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    ok = all(v for k, v in res.items() if isinstance(v, bool)) and res["eval tau"][0] == res["eval tau"][1]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
