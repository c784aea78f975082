r"""Benchmark `train` forms on REAL features: one short `specops train` per arm on an existing campaign.

A trainer form can run at full speed on the synthetic features of bench/train_gpu.py and far slower
on a real campaign, whose batches take many more shapes (recompiles, per-shape plans: a form can run
~60x slower on real SmolLM2 features than on synthetic ones; docs/results.md), so trainer changes
are measured here on the real thing. Each arm trains in its own campaign dir whose build/ and
features/ are links to the given campaign's (nothing copied, nothing of the original touched), with
the arm's train.* overrides written into its config (KEY=VALUE, e.g. fused_loss=on
compile_layer=off; VALUE is read as TOML -- true, 4096 -- or else taken as a string), for --steps
optimizer steps, logging every --log-every steps; the rate is the steady one (windows after the
first, as the quality run reads it: bench/quality/speculators_train.py `specops_rate`). An arm past
--timeout is killed and its rate is read from the windows it logged. --recompiles adds
TORCH_LOGS=recompiles and counts them.

    python bench/train_real_ab.py CONFIG.toml --out ab.json [--steps 60] [--log-every 5] [--timeout 150] \
        --arm before fused_loss=off compile_layer=off \
        --arm fused fused_loss=on compile_layer=off
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench" / "quality"))

from speculators_train import specops_rate  # noqa: E402

from specops.config import ConfigError, dump_toml, load_config  # noqa: E402


def parse_overrides(label: str, assigns: list[str]) -> dict[str, Any]:
    """--arm's KEY=VALUE words -> train.* overrides ("train." before KEY is optional). VALUE is read
    as a TOML value (true, 4096, 1e-3, "x") where it is one, else kept as a string (on, dense)."""
    out: dict[str, Any] = {}
    for kv in assigns:
        k, sep, v = kv.partition("=")
        k = k.removeprefix("train.")
        if not sep or not k:
            raise SystemExit(f"--arm {label}: {kv!r} is not KEY=VALUE (a train.* key, e.g. fused_loss=on)")
        try:
            out[k] = tomllib.loads(f"v = {v}")["v"]
        except tomllib.TOMLDecodeError:
            out[k] = v
    return out


def arm_config(base_path: Path, work: Path, label: str, steps: int, log_every: int,
               train: dict[str, Any] | None = None) -> Path:
    """A copy of the campaign's config for one arm: its own campaign dir linking build/ and features/,
    the arm's train.* overrides on top of the campaign's own."""
    cfg = tomllib.loads(base_path.read_text())
    src = Path(cfg["campaign"]["dir"]).resolve()
    camp = work / f"ab-{label}"
    camp.mkdir(parents=True, exist_ok=True)
    for sub in ("build", "features"):
        if not (src / sub).is_dir():
            raise SystemExit(f"{src / sub}: missing (run build and extract first)")
        link = camp / sub
        if not link.is_symlink():
            link.symlink_to(src / sub, target_is_directory=True)
    cfg["campaign"] = {**cfg["campaign"], "name": f"{cfg['campaign'].get('name', 'c')}-ab-{label}", "dir": str(camp)}
    # total_steps = the arm's steps: small campaigns run that long too (epochs repeat); the lr
    # schedule follows, which does not matter for a rate
    cfg.setdefault("train", {}).update({**(train or {}), "log_every": log_every, "eval_every": 10 ** 7,
                                        "checkpoint_every": 10 ** 7, "total_steps": steps})
    path = work / f"ab-{label}.toml"
    path.write_text(dump_toml(cfg))
    try:
        load_config(path)  # refuse a bad config here, not inside the timed run
    except ConfigError as e:
        raise SystemExit(f"--arm {label}: {e}") from None
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", type=Path, help="the campaign's config (its campaign.dir holds build/ and features/)")
    ap.add_argument("--arm", nargs="+", action="append", required=True, metavar=("LABEL", "KEY=VALUE"),
                    help="one arm: a label, then train.* overrides such as fused_loss=on, compile_layer=auto, "
                         "ttt_attention=dense, sdpa_cudnn=true")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per arm")
    ap.add_argument("--work", type=Path, help="where the arms' campaign dirs go (default: next to the config)")
    ap.add_argument("--recompiles", action="store_true", help="TORCH_LOGS=recompiles; count them per arm")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    work = (a.work or a.config.resolve().parent / "train-ab").resolve()
    work.mkdir(parents=True, exist_ok=True)
    # every arm's config is written and checked before the first one trains
    arms = [(label, parse_overrides(label, assigns)) for label, *assigns in a.arm]
    cfgs = {label: arm_config(a.config, work, label, a.steps, a.log_every, train) for label, train in arms}
    env = {**os.environ, "TORCH_LOGS": "recompiles"} if a.recompiles else None
    results = {}
    for label, train in arms:
        cfg = cfgs[label]
        log = work / f"ab-{label}.log"
        t0 = time.time()
        with open(log, "w") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "specops", "train", str(cfg), "--max-steps", str(a.steps)],
                                    stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=a.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                rc = "timeout"
                proc.wait()
        rate = specops_rate(work / f"ab-{label}")
        text = log.read_text(errors="replace")
        results[label] = {"train": train, "rc": rc, "wall_s": round(time.time() - t0, 1), **rate,
                          "recompiles": text.count("Recompiling function") if a.recompiles else None,
                          "warnings": [ln for ln in text.splitlines() if "WARNING" in ln][:5]}
        print(label, json.dumps({k: results[label].get(k) for k in ("rc", "steps", "tokens_per_s", "recompiles")}),
              flush=True)
    a.out.write_text(json.dumps({"config": str(a.config), "steps": a.steps, "arms": results}, indent=1))


if __name__ == "__main__":
    main()
