"""What each drafter family costs per step: a training step (forward + backward of its objective)
and a drafting round in the eval loop (k drafts), at one shape, on one device.

    python bench/family_step.py [--hidden 576 --heads 9 --kv-heads 3 --inter 1536 --vocab 49152
                                 --draft-vocab 32000 --tokens 2048 --k 7 --context 512] [--out FILE]

Random weights and states (speed only: the math of each family is the tests'), bf16 autocast on
CUDA, fp32 elsewhere; eager forms (no CUDA graphs) so the families compare like for like. The
training step is one row of `--tokens` tokens (one document) with EAGLE-3's and P-EAGLE's TTT
unroll at K = k and DFlash's every-slot blocks of k mask slots; the round is m = 1 pending slot
after `--context` positions, k drafts (EAGLE-3: k forwards; P-EAGLE and DFlash: one). Prints and
writes JSON: median ms per training step and per round, peak memory of the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, v in (("hidden", 576), ("heads", 9), ("kv-heads", 3), ("inter", 1536), ("vocab", 49152),
                    ("draft-vocab", 32000), ("tokens", 2048), ("k", 7), ("context", 512), ("repeats", 10)):
        ap.add_argument(f"--{name}", type=int, default=v)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from specops.drafter.batch import Batch
    from specops.drafter.families import FAMILIES
    from specops.drafter.families.dflash.model import DFlashConfig
    from specops.drafter.families.dflash.objective import dflash_forward
    from specops.drafter.families.eagle3.objective import ttt_forward
    from specops.drafter.families.peagle.model import PEagleConfig
    from specops.drafter.families.peagle.objective import mask_later_inputs
    from specops.drafter.model import DrafterConfig

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    shape = dict(hidden_size=a.hidden, intermediate_size=a.inter, num_attention_heads=a.heads,
                 num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads, target_vocab_size=a.vocab,
                 draft_vocab_size=a.draft_vocab, aux_layer_ids=[2, 15, 27], target_hidden_size=a.hidden,
                 target_num_hidden_layers=30, max_position_embeddings=8192)
    configs = {"eagle3": DrafterConfig(**shape), "peagle": PEagleConfig(**shape, mask_token_id=2),
               "dflash": DFlashConfig(**shape, mask_token_id=2, num_hidden_layers=1, block_size=a.k + 1)}
    T = a.tokens
    g = torch.Generator().manual_seed(0)
    batch = Batch(input_ids=torch.randint(0, a.vocab, (1, T), generator=g), loss_mask=torch.ones(1, T, dtype=torch.bool),
                  doc=torch.zeros(1, T, dtype=torch.long), pos=torch.arange(T)[None], doc_end=torch.full((1, T), T),
                  aux=torch.randn(1, T, 3, a.hidden, generator=g), final=torch.randn(1, T, a.hidden, generator=g),
                  n_tokens=T).to(dev)
    p = torch.softmax(torch.randn(T, a.draft_vocab, generator=g), -1).to(dev)
    rows = torch.arange(T, device=dev).view(1, T)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn, n):
        out = []
        for i in range(n + 2):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            if i >= 2:  # two warm-up calls
                out.append((time.perf_counter() - t) * 1e3)
        return statistics.median(out)

    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else None
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "args": vars(a), "families": {}}
    for name, cfg in configs.items():
        fam = FAMILIES[name]
        d = fam.model_cls(cfg).to(dev)
        from specops.drafter.batch import Targets

        targets = Targets(p, p.argmax(-1), rows)

        def step():
            ctx = autocast() if autocast else torch.enable_grad()
            with ctx:
                if name == "dflash":
                    out = dflash_forward(d, batch, p, targets.argmax, rows, steps=a.k, decay=0.8)
                else:
                    later = mask_later_inputs(d)(batch) if name == "peagle" else None
                    out = ttt_forward(d, batch, targets, steps=a.k, decay=0.8, later_inputs=later)
            out.loss.backward()
            d.zero_grad(set_to_none=True)

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        train_ms = timed(step, a.repeats)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        d.eval()
        runner = fam.drafter_runner(d, "eager")
        seq = torch.randint(0, a.vocab, (1, a.context + 1), generator=g).to(dev)
        aux = torch.randn(1, a.context + 1, 3, a.hidden, generator=g).to(dev)

        def round_():
            runner.reset(a.context + a.k + 2)
            runner.prefill(seq[:, : a.context], aux[:, : a.context])
            with (autocast() if autocast else torch.no_grad()), torch.no_grad():
                runner.draft(seq[:, a.context:a.context + 1], aux[:, a.context - 1:a.context], a.context - 1, a.k,
                             temperature=0.0, gen=None)

        prefill_only = timed(lambda: (runner.reset(a.context + a.k + 2),
                                      runner.prefill(seq[:, : a.context], aux[:, : a.context])), a.repeats)
        round_ms = timed(round_, a.repeats) - prefill_only
        res["families"][name] = {"train_step_ms": round(train_ms, 2), "train_peak_gib": peak and round(peak, 2),
                                 "round_ms": round(round_ms, 3), "params": sum(x.numel() for x in d.parameters())}
        print(name, res["families"][name], flush=True)
        del d, runner
        if cuda:
            torch.cuda.empty_cache()
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
