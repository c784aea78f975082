"""Speculative decoding on the build's own validation prompts: does the evaluator reproduce the
acceptance that training's val pass reports, and if not, where does the difference come from?

    python bench/quality/eval_on_val.py --campaign DIR --model HF_DIR --drafter EXPORT_DIR \
        [--metrics METRICS.jsonl] [--samples 24] [--k 7] [--new-tokens 128] [--out F]

For each of the first --samples val samples (build/val.safetensors, build order) the prompt is
every token before the first loss-bearing one (the chat template as generation saw it, system and
tool turns included). Three measurements per sample:
1. teacher-forced, on the recorded sequence: the drafter's step-0 prediction at every response
   token from the target's states over the true prefix (what training's val pass counts), in
   buckets of the token's offset in the response (0-127, 128-255, ...);
2. our evaluator's own loop (evaluate.specdec.speculative_generate, T=0, k, new tokens) from the
   prompt: tau and acceptance per draft position;
3. teacher-forced again, on the tokens the loop generated: over every generated token after the
   first (the target's own pick after the prompt, never drafted), and over the tokens where a round
   began only (the first draft of a round is the one position 1 counts).
   If the loop is right, the second equals its position-1 acceptance exactly.
Plus the share of response tokens that repeat a 16-token window seen earlier in the same response
(greedy loops), and the training val pass's last row (--metrics) for comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


def val_prompts(build_dir: Path, n: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, recorded response ids) of the first n val samples that have a response."""
    from safetensors.torch import load_file

    t = load_file(str(build_dir / "val.safetensors"))
    ids, mask, offs = t["input_ids"].long(), t["loss_mask"].bool(), t["offsets"].tolist()
    out = []
    for s in range(len(offs) - 1):
        a, b = offs[s], offs[s + 1]
        m = mask[a:b].nonzero()
        if len(m) == 0 or int(m[0]) == 0:
            continue
        first = int(m[0])
        out.append((ids[a:a + first].tolist(), ids[a + first:b].tolist()))
        if len(out) == n:
            break
    return out


def repeated_share(tokens: list[int], n: int = 16) -> float:
    """Share of tokens that repeat an n-token window already seen earlier in `tokens` (the
    build's measure, text.repeating_tokens, over one turn)."""
    from specops.text import count_repeating

    return count_repeating(tokens, n) / len(tokens) if tokens else 0.0


def step0_hits(target_runner, drafter, seq: list[int]):
    """Teacher-forced step 0 over `seq`: bool [len(seq) - 2], slot t right when the drafter's
    prediction from the target's states at 0..t and tokens 1..t+1 equals seq[t + 2]."""
    import torch

    x = torch.tensor(seq, dtype=torch.long)
    _, aux = target_runner.forward(x.view(1, -1), target_runner.new_cache(), 0, aux=True)
    dev = drafter.d2t.device
    with torch.no_grad():
        out = drafter(x[1:].view(1, -1).to(dev), drafter.fuse(aux[None, :-1].to(dev)),
                      torch.arange(len(seq) - 1, device=dev)[None])
    d = drafter.draft_to_target(out.logits[0].float().argmax(-1)).cpu()
    return d[: len(seq) - 2] == x[2:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--campaign", type=Path, required=True, help="a campaign dir with build/val.safetensors")
    ap.add_argument("--model", type=Path, required=True, help="the target's HF dir")
    ap.add_argument("--drafter", type=Path, required=True, help="an export dir or a training checkpoint")
    ap.add_argument("--metrics", type=Path, help="the drafter's metrics.jsonl (its last val row is reported)")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--bucket", type=int, default=128, help="response-offset bucket width of measurement 1")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from specops.measures import simulated_tau
    from specops.evaluate.specdec import _eos_ids, load_eval_drafter
    from specops.evaluate.loop import TargetRunner, speculative_generate
    from specops.target.inprocess import load_target

    prompts = val_prompts(a.campaign / "build", a.samples)
    if not prompts:
        raise SystemExit(f"{a.campaign}/build/val.safetensors: no val sample with a response")
    target = load_target(a.model, a.dtype, a.device)
    drafter = load_eval_drafter(a.drafter, target)
    runner = TargetRunner(target, drafter.config.aux_layer_ids)  # the reference runner (eager HF)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(a.model))
    except (OSError, ValueError):  # a model dir without a tokenizer: the eos ids of its configs only
        tokenizer = None
    eos = _eos_ids(target.model, tokenizer)
    buckets: dict[int, list[int]] = {}  # offset bucket -> [right, count] (measurement 1)
    reached, ok, steps, accepted_sum, new = [0] * a.k, [0] * a.k, 0, 0, 0
    gen_right = gen_all = start_right = start_all = 0  # measurement 3
    rep_tokens = rep_all = 0
    t0 = time.time()
    for i, (prompt, ref) in enumerate(prompts):
        n0 = len(prompt)
        hits = step0_hits(runner, drafter, prompt + ref)
        for off in range(len(ref)):  # slot n0 + off - 2 predicts ref[off]
            if n0 + off - 2 >= 0:
                b = buckets.setdefault(off // a.bucket, [0, 0])
                b[0] += int(hits[n0 + off - 2])
                b[1] += 1
        share = repeated_share(ref)
        rep_tokens += round(share * len(ref))
        rep_all += len(ref)
        r = speculative_generate(runner, drafter, prompt, k=a.k, max_new_tokens=a.new_tokens, eos_ids=eos)
        rr, oo = r.position_counts()
        reached = [x + y for x, y in zip(reached, rr)]
        ok = [x + y for x, y in zip(ok, oo)]
        steps += r.target_steps
        accepted_sum += sum(r.accepted)
        new += len(r.tokens)
        seq = prompt + r.tokens
        if len(seq) > n0 + 1:
            g = step0_hits(runner, drafter, seq)
            gen_right += int(g[n0 - 1:].sum())
            gen_all += len(g) - (n0 - 1)
            P = n0
            for acc in r.accepted:  # a round at P drafts seq[P + 1] first: slot P - 1
                if P - 1 < len(g):
                    start_right += int(g[P - 1])
                    start_all += 1
                P += acc + 1
        print(f"sample {i}: prompt {n0}, response {len(ref)} tokens ({share:.0%} repeated), loop: {len(r.tokens)} new, "
              f"tau {(sum(r.accepted) + r.target_steps) / max(r.target_steps, 1):.3f}", flush=True)
    acc = [o / x if x else None for o, x in zip(ok, reached)]
    out = {
        "bench": "eval-on-val", "campaign": str(a.campaign), "drafter": str(a.drafter), "samples": len(prompts),
        "k": a.k, "new_tokens": a.new_tokens, "temperature": 0.0, "device": str(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "teacher_forced_step0_by_response_offset": {
            f"{b * a.bucket}-{(b + 1) * a.bucket - 1}": {"acc": r_ / c_, "tokens": c_}
            for b, (r_, c_) in sorted(buckets.items())},
        "teacher_forced_step0_all_recorded": sum(r_ for r_, _ in buckets.values()) / max(sum(c_ for _, c_ in buckets.values()), 1),
        "loop": {"target_steps": steps, "generated_tokens": new,
                 "tau": (accepted_sum + steps) / steps if steps else None,
                 "acceptance_per_position": acc, "position_reached": reached, "position_accepted": ok},
        "teacher_forced_step0_on_loop_tokens": {"all": gen_right / gen_all if gen_all else None, "tokens": gen_all,
                                                "round_starts": start_right / start_all if start_all else None,
                                                "rounds": start_all},
        "recorded_responses_repeated_16gram_share": rep_tokens / rep_all if rep_all else None,
        "wall_s": round(time.time() - t0, 1),
    }
    if a.metrics:
        vals = [json.loads(line) for line in a.metrics.read_text().splitlines() if line.strip()]
        vals = [v for v in vals if v.get("split") == "val"]
        if vals:
            out["training_val"] = {"step": vals[-1]["step"], "acc": vals[-1]["acc"],
                                   "simulated_tau": simulated_tau(vals[-1]["acc"])}
    print(json.dumps(out, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
