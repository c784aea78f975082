"""Benchmark tau evaluation: the batch-1 speculative loop vs the batched loop (eval.batch_size rows).

    python bench/eval_batched.py --model DIR|smollm2 [--drafter EXPORT_DIR] [--prompts 256] [--rows 128]
                                 [--batch1-prompts 16] [--new-tokens 128] [--k 7] [--out FILE]

Prompts: Spec-Bench first turns ($SPECOPS_DATA_DIR or ../shared/data, spec_bench/question.jsonl),
every (480 / n)-th question, chat template applied. The baseline is what `specops eval` ran per
turn before: speculative_generate on the static target runner (CUDA graphs on a GPU) and the static
drafter runner, one prompt after another, over the first --batch1-prompts prompts. The batched
loop runs all --prompts through --rows rows. Reported: generated tokens/s both ways (wall clock,
prefill included, synced), the ratio, tau both ways, and for the prompts both ran, the share whose
tokens are identical (batched kernels round differently in bf16: a near-tie may flip).
--drafter: an exported drafter; default a random one shaped from the target (tau ~1: the figures are
then one draft round per token, the worst case for the batched loop). --profile FILE: afterwards,
torch.profiler over --profile-steps steps of a full batch (every row admitted, 3 steps of warm-up),
the top ops by self CPU and by device time written to FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from specops.evaluate.batched import BatchedLoop, run_batched  # noqa: E402
from specops.drafter.families.eagle3.drafting import StaticDrafterRunner  # noqa: E402
from specops.evaluate.fast_target import StaticTargetRunner  # noqa: E402
from specops.evaluate.specdec import _eos_ids, load_eval_drafter
from specops.evaluate.loop import finish_tokens as _finish, speculative_generate


def prompts(tok, n: int) -> list[list[int]]:
    root = Path(os.environ.get("SPECOPS_DATA_DIR") or REPO.parent / "shared" / "data")
    rows = [json.loads(x) for x in (root / "spec_bench" / "question.jsonl").read_text().splitlines() if x.strip()]
    rows = [rows[i * len(rows) // n] for i in range(min(n, len(rows)))]
    out = []
    for r in rows:
        ids = tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}], add_generation_prompt=True,
                                      tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def random_drafter(target, device):
    from specops.drafter.model import DrafterConfig, Eagle3Drafter

    torch.manual_seed(0)
    hf = target.model.config.to_dict()
    d = Eagle3Drafter(DrafterConfig.from_target(hf, min(32000, target.model.config.vocab_size)))
    return d.to(device=device, dtype=target.dtype).eval()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--drafter", type=Path)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--batch1-prompts", type=int, default=16)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--profile-steps", type=int, default=10)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from specops.target.inprocess import load_target
    from specops.models import resolve_device, resolve_model_dir

    dev = resolve_device("auto")
    dtype = a.dtype if a.dtype != "auto" else ("bfloat16" if torch.device(dev).type == "cuda" else "float32")
    target = load_target(resolve_model_dir(a.model), dtype, dev)
    tok = AutoTokenizer.from_pretrained(str(target.model_dir))
    d = load_eval_drafter(a.drafter, target, target.device) if a.drafter else random_drafter(target, target.device)
    eos = _eos_ids(target.model, tok)
    ps = prompts(tok, a.prompts)
    dev = torch.device(target.device)

    # the baseline: batch 1, one prompt after another (warm-up first: graphs, allocator)
    st, sd = StaticTargetRunner(target, d.config.aux_layer_ids), StaticDrafterRunner(d)
    speculative_generate(st, d, ps[0], k=a.k, max_new_tokens=16, eos_ids=eos, drafter_runner=sd)
    n1 = min(a.batch1_prompts, len(ps))
    sync(dev)
    t0 = time.perf_counter()
    one = [speculative_generate(st, d, p, k=a.k, max_new_tokens=a.new_tokens, eos_ids=eos, drafter_runner=sd)
           for p in ps[:n1]]
    sync(dev)
    t_one = time.perf_counter() - t0
    tok_one = sum(len(r.tokens) for r in one)
    acc_one = [x for r in one for x in r.accepted]
    del st, sd

    # the batched loop over every prompt
    loop = BatchedLoop(target, d, rows=a.rows, k=a.k, max_new_tokens=a.new_tokens, temperature=0.0, eos_ids=eos,
                       gen=None)
    got: dict[int, tuple[list[int], list[int]]] = {}

    def on_turn(i, t):
        got[i] = (_finish(t.generated, a.new_tokens, eos)[0], t.accepted)
        return None

    warm = BatchedLoop(target, d, rows=min(4, a.rows), k=a.k, max_new_tokens=8, temperature=0.0, eos_ids=eos, gen=None)
    run_batched(warm, iter(range(4)), lambda i: ps[i], lambda i, t: None)
    del warm
    sync(dev)
    t0 = time.perf_counter()
    fig = run_batched(loop, iter(range(len(ps))), lambda i: ps[i], on_turn)
    sync(dev)
    t_b = time.perf_counter() - t0
    tok_b = sum(len(got[i][0]) for i in range(len(ps)))
    acc_b = [x for i in range(len(ps)) for x in got[i][1]]
    same = sum(got[i][0] == one[i].tokens for i in range(n1))
    tau = lambda acc: sum(x + 1 for x in acc) / len(acc) if acc else None  # noqa: E731
    res = {
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "dtype": dtype, "k": a.k,
        "new_tokens": a.new_tokens, "drafter": str(a.drafter) if a.drafter else "random",
        "batch1": {"prompts": n1, "tokens": tok_one, "wall_s": round(t_one, 3),
                   "tokens_per_s": round(tok_one / t_one, 1), "tau": tau(acc_one)},
        "batched": {"prompts": len(ps), "rows": loop.B, "tokens": tok_b, "wall_s": round(t_b, 3),
                    "tokens_per_s": round(tok_b / t_b, 1), "tau": tau(acc_b), "steps": fig["steps"]},
        "ratio_tokens_per_s": round((tok_b / t_b) / (tok_one / t_one), 2),
        "identical_tokens_on_common_prompts": f"{same}/{n1}",
    }
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    if a.profile:
        profile_steps(target, d, ps, a, eos, dev)


def profile_steps(target, d, ps: list[list[int]], a: argparse.Namespace, eos, dev: torch.device) -> None:
    """Where a step of a full batch spends host and device time (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    loop = BatchedLoop(target, d, rows=min(a.rows, len(ps)), k=a.k, max_new_tokens=10 ** 6, temperature=0.0,
                       eos_ids=frozenset(), gen=None)
    for b in range(loop.B):
        loop.admit(b, ps[b], b)
    for _ in range(3):
        loop.step()
    sync(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(a.profile_steps):
            loop.step()
        sync(dev)
    wall = time.perf_counter() - t0
    ka = prof.key_averages()
    dev_key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    a.profile.write_text(f"{a.profile_steps} steps of {loop.B} rows: {wall / a.profile_steps * 1e3:.1f} ms per step "
                         f"(profiled)\n\n== by self CPU time\n" + ka.table(sort_by="self_cpu_time_total", row_limit=30)
                         + "\n\n== by self device time\n" + ka.table(sort_by=dev_key, row_limit=30))
    print(f"profile: {a.profile}")


if __name__ == "__main__":
    main()
