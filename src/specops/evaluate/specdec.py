"""Evaluate: the eval phase around the speculative-decoding loop (evaluate/loop.py) -> measured tau.

    drafter (export dir or checkpoint) + held-out prompt sets -> eval/<dataset>.json, eval/summary.json

The loop, its verbs and its bookkeeping are in evaluate/loop.py; this module reads the datasets,
loads target and drafter, runs the loop (or its batched and multi-worker forms) and writes eval/.

Sampling (T > 0): every generation draws from its own generator, seeded from eval.seed, the
conversation's index in the ordered list of all eval conversations (datasets in order), the turn
and the stream (speculative or baseline): `prompt_seed`. Results never depend on what ran before
in the process, so they are the same for any number of workers.

Batched (eval.batch_size = B > 1, `specops eval --batch-size B`): tau and acceptance only, B
conversations decoded together in one loop on shared static caches (evaluate/batched.py); each
row's tokens and acceptance are this loop's, no wall-clock figures.

Workers (eval.workers = N > 1, `specops eval --workers N`): the loop stays batch 1, and N processes
(`python -m specops.evaluate.worker`, each loading the target and drafter on the same device) share
the conversations: worker w takes w, w+N, w+2N, ... of the ordered list (a conversation's turns stay
in one worker: turn 2 sees turn 1's answer). The parent reads the datasets, holds the campaign lock,
records the worker pids in the manifest's eval entry, merges the rows back in the list's order and
writes the same eval/<dataset>.json rows and the same tau / acceptance as one worker (timing fields
aside). The workers share the device, so wall-clock throughput is not the batch-1 speed: with N > 1
spec/baseline tokens/s and the measured speedup are null with `speedup_unavailable` = "concurrent
workers: speedup needs workers = 1", and the verdict judges tau only (eval.min_tau); step times
(c, ideal speedup) are still recorded, measured with the device shared. A worker that raises or is
killed fails the eval (EvalWorkerFailed: its error and exit code) after the others are ended;
SIGTERM and Ctrl-C end every worker (Interrupted / KeyboardInterrupt); workers die with the parent
(PR_SET_PDEATHSIG). Nothing is written to eval/ unless every conversation came back.

Data: eval.datasets are built-in sources or files read by sources.py, `limit_per_dataset`
prompts each, chat template applied with add_generation_prompt. Every user message is a generated
turn with the model's own earlier answers in the history (MT-bench: both turns). A set that a
training dataset reads (same built-in source, or a shared file) is refused; single prompts whose
first user message also appears in a training dataset (Spec-Bench holds MT-bench's questions) are
left out and listed in eval/<dataset>.json.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from ..campaign import Campaign, DrafterHome, RunLock, atomic_write_json, now_iso
from ..config import Config, DatasetSection, check_family, parse_eval_dataset
from ..drafter.families import family_of
from ..errors import ConfigError, EvalWorkerFailed, InputError, Interrupted, SpecopsError
from ..progress import ROUTINE, current, phase_progress
from .loop import SpecResult, finish_tokens, speculative_generate, target_generate
from .report import verdict

log = logging.getLogger("specops.eval")

__all__ = [
    "summarize",
    "verdict",
    "load_eval_drafter",
    "run_eval",
]


# ---------------------------------------------------------------- metrics


def summarize(rows: list[dict[str, Any]], k: int, *, speedup_unavailable: str | None = None) -> dict[str, Any]:
    """Pooled metrics over turns; each row has "spec" (SpecResult.to_json) and optionally "baseline".
    `speedup_unavailable` (a reason: the turns ran in processes sharing the device) nulls the
    wall-clock throughput (tokens/s both ways and the measured speedup); step times stay."""
    specs = [r["spec"] for r in rows]
    bases = [r["baseline"] for r in rows if r.get("baseline")]
    accepted = [a for s in specs for a in s["accepted"]]
    steps = len(accepted)
    reached = [sum(s["position_reached"][i] for s in specs) for i in range(k)]
    ok = [sum(s["position_accepted"][i] for s in specs) for i in range(k)]
    t_steps = [x for s in specs for x in s["target_step_s"]]
    d_steps = [x for s in specs for x in s["drafter_step_s"]]
    b_steps = [x for b in bases for x in b["step_s"]]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    tau = sum(a + 1 for a in accepted) / steps if steps else None
    t_ms, d_ms = mean(t_steps), mean(d_steps)
    c = d_ms / t_ms if t_ms and d_ms is not None else None
    spec_tok, spec_wall = sum(s["new_tokens"] for s in specs), sum(s["wall_s"] for s in specs)
    base_tok, base_wall = sum(b["new_tokens"] for b in bases), sum(b["wall_s"] for b in bases)
    spec_tps = spec_tok / spec_wall if spec_wall > 0 and not speedup_unavailable else None
    base_tps = base_tok / base_wall if base_wall > 0 and not speedup_unavailable else None
    hist = [0] * (k + 1)
    for a in accepted:
        hist[a] += 1
    same = [r["identical"] for r in rows if r.get("identical") is not None]
    v = t_ms / mean(b_steps) if t_ms and b_steps else None
    return {
        "turns": len(rows),
        "target_steps": steps,
        "new_tokens": spec_tok,
        "k": k,
        "tau": tau,
        "acceptance_per_position": [o / r if r else None for o, r in zip(ok, reached)],
        "position_reached": reached,
        "position_accepted": ok,
        "accepted_histogram": hist,
        "target_step_ms": t_ms * 1e3 if t_ms is not None else None,
        "drafter_step_ms": d_ms * 1e3 if d_ms is not None else None,
        "baseline_step_ms": mean(b_steps) * 1e3 if b_steps else None,
        # a verification (k+1 tokens) over a one-token decode step: why measured < ideal on compute-bound hardware
        "verify_over_decode": v,
        "cost_ratio_c": c,
        "ideal_speedup": tau / (1 + k * c) if tau is not None and c is not None else None,
        "speedup_by_k": speedup_by_k(hist, c, v),
        "spec_tokens_per_s": spec_tps,
        "baseline_tokens_per_s": base_tps,
        "measured_speedup": spec_tps / base_tps if spec_tps and base_tps else None,
        "speedup_unavailable": speedup_unavailable,
        "identical_to_baseline": (sum(same) / len(same)) if same else None,
    }


def speedup_by_k(hist: list[int], c: float | None, verify_over_decode: float | None) -> list[dict[str, Any]] | None:
    """What a shorter chain would give, from one run at k: for each k' in 1..k, tau(k') and the
    predicted speedup tau(k') / (v + k'·c).

    tau(k') = mean over target steps of 1 + min(accepted, k'), from the accepted-count histogram:
    a chain cut at k' drafts the same first k' tokens (exact at T=0 on the same steps). v is the
    verify-over-decode ratio measured at k + 1 tokens (1.0 when no baseline ran), an upper bound
    for the shorter verifies, so the prediction errs low for k' < k.
    """
    steps = sum(hist)
    if not steps or c is None:
        return None
    v = verify_over_decode if verify_over_decode is not None else 1.0
    out = []
    for kk in range(1, len(hist)):
        tau = sum(n * (1 + min(a, kk)) for a, n in enumerate(hist)) / steps
        out.append({"k": kk, "tau": tau, "predicted_speedup": tau / (v + kk * c)})
    return out


# ---------------------------------------------------------------- loading


def load_eval_drafter(path: str | os.PathLike[str], target: Any, device: torch.device | None = None
                      ) -> torch.nn.Module:
    """A training checkpoint (drafter_config.json) or an export dir (config.json, in a format of a
    drafter family), checked against the target; an export without embed_tokens gets the target's
    embedding."""
    from ..drafter.checkpoint import load_drafter
    from ..drafter.families import open_export
    from ..drafter.formats import ExportError

    p = Path(path)
    device = device or torch.device(target.device)
    if (p / "drafter_config.json").is_file():
        drafter = load_drafter(p)
    elif (p / "config.json").is_file():
        report, _, _ = open_export(p)
        if report.family is None:
            raise ExportError(f"{p}: " + "; ".join(f"[{r.name}] {r.message}" for r in report.problems))
        drafter = report.family.drafter_from_export(p, target_num_hidden_layers=target.num_hidden_layers,
                                                    target_embed=target.embed_tokens.weight)
    else:
        raise InputError(f"{p}: neither a training checkpoint (drafter_config.json) nor an export (config.json)")
    c = drafter.config
    problems = []
    if c.target_vocab_size != target.vocab_size:
        problems.append(f"target vocab {target.vocab_size} != the drafter's {c.target_vocab_size}")
    if c.target_hidden_size != target.hidden_size:
        problems.append(f"target hidden size {target.hidden_size} != the drafter's {c.target_hidden_size}")
    if c.target_num_hidden_layers is not None and c.target_num_hidden_layers != target.num_hidden_layers:
        problems.append(f"target layers {target.num_hidden_layers} != the drafter's {c.target_num_hidden_layers}")
    if problems:
        raise InputError(f"{p}: drafter trained for another target: " + "; ".join(problems))
    dtype = target.dtype if device.type == "cuda" else torch.float32
    return drafter.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _latest_drafter(campaign: Campaign, home: DrafterHome) -> Path:
    """The newest of the family's latest training checkpoint and its exports, by weight-file mtime."""
    from ..drafter.checkpoint import latest_checkpoint

    root = home.dir
    cands = [p for p in (latest_checkpoint(root), root / "export" / "vllm", root / "export" / "speculators")
             if p is not None and (p / "model.safetensors").is_file()]
    if not cands:
        flag = "" if home.first else f" --drafter {home.family}"
        raise InputError(f"no drafter under {root} (no checkpoint, no export): run `specops train{flag}` first, "
                         "or set eval.drafter")
    return max(cands, key=lambda p: (p / "model.safetensors").stat().st_mtime)


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, (list, tuple, set)):
            for x in v:
                add(x)
        elif v is not None:
            ids.add(int(v))

    add(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    add(getattr(model.config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    return frozenset(ids)


# ---------------------------------------------------------------- datasets


def _eval_sections(cfg: Config) -> list[DatasetSection]:
    base = cfg.source_path.parent if cfg.source_path else Path.cwd()
    out = []
    for entry in cfg.eval.datasets:
        name, source, path = parse_eval_dataset(entry)
        if path is not None:
            path = str((base / path).resolve()) if not Path(path).is_absolute() else path
        out.append(DatasetSection(name=name, source=source, path=path, format="auto",
                                  limit=cfg.eval.limit_per_dataset))
    return out


def _resolved(paths: Iterable[str]) -> set[str]:
    out = set()
    for p in paths:
        with contextlib.suppress(OSError):
            out.add(str(Path(p).resolve()))
    return out


def check_not_trained_on(cfg: Config, evals: list[DatasetSection], eval_paths: dict[str, list[str]]) -> None:
    """Refuse an eval set that a training dataset also reads: the same built-in source (same path or
    both default), or any shared input file."""
    from ..sources import open_source

    for ev in evals:
        mine = _resolved(eval_paths.get(ev.name, []))
        for tr in cfg.datasets:
            same_source = ev.source != "file" and tr.source == ev.source and (
                tr.path is None or ev.path is None or _resolved([tr.path]) == _resolved([ev.path]))
            shared: set[str] = set()
            if not same_source:
                try:
                    shared = mine & _resolved(open_source(tr).paths)
                except SpecopsError:  # a training input that cannot be opened now: compare the config only
                    shared = mine & _resolved([tr.path] if tr.path else [])
            if same_source or shared:
                what = f"source {tr.source!r}" if same_source else f"file {sorted(shared)[0]}"
                raise ConfigError(f"eval.datasets: {ev.name!r} was used in training (datasets {tr.name!r}, {what}); "
                                  "evaluate on a held-out set, never a set used in training")


def _prompt_key(messages: list[dict[str, Any]]) -> str | None:
    """The first user message's text, whitespace-normalised and hashed: the same question however
    the set that holds it names or wraps it (Spec-Bench carries MT-bench's 80 questions)."""
    import hashlib

    for m in messages:
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            return hashlib.sha256(" ".join(m["content"].split()).encode()).hexdigest()[:32]
    return None


def prompts_seen_in_training(cfg: Config, sources: dict[str, Any]) -> dict[str, dict[str, str]]:
    """{eval dataset: {sample id: training dataset}} for eval prompts whose first user message is
    also a prompt of a training dataset (each read as generate read it, its limit included).
    Streams the training sources once; a source that cannot be opened now is skipped with a warning."""
    from ..sources import Sample, open_source

    want: dict[str, list[tuple[str, str]]] = {}
    for name, src in sources.items():
        for item in src:
            if isinstance(item, Sample) and (key := _prompt_key(item.messages)) is not None:
                want.setdefault(key, []).append((name, item.id))
    seen: dict[str, dict[str, str]] = {}
    for tr in cfg.datasets:
        try:
            for item in open_source(tr):
                if isinstance(item, Sample):
                    for name, sid in want.get(_prompt_key(item.messages) or "", ()):
                        seen.setdefault(name, {}).setdefault(sid, tr.name)
        except SpecopsError as e:
            log.warning("cannot read training dataset %r to check eval prompts against it: %s", tr.name, e)
    return seen


def _turns(messages: list[dict[str, Any]]) -> Iterable[tuple[list[dict[str, Any]], int]]:
    """(history up to and including a user message, turn index) for every user message; the
    caller appends the generated answer to the same history list. Source assistant messages are
    dropped: every assistant turn is generated (MT-bench's turn 2 sees the model's own turn 1)."""
    history: list[dict[str, Any]] = []
    turn = 0
    for msg in messages:
        if msg.get("role") == "assistant":
            continue
        history.append({"role": msg["role"], "content": msg.get("content", "")})
        if msg.get("role") == "user":
            yield history, turn
            turn += 1


# ---------------------------------------------------------------- the phase


def _prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **template_kwargs)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


SPEEDUP_UNAVAILABLE = "concurrent workers: speedup needs workers = 1"
NO_BASELINE = "eval.baseline = false: no target-only run to compare with"


def prompt_seed(seed: int, index: int, turn: int, stream: str) -> int:
    """The sampling seed of one generation: eval.seed, the conversation's index in the ordered eval
    list (all datasets), the turn and the stream ("spec" or "baseline"), hashed to 63 bits. Seeded
    per generation, never per process: the samples do not depend on which worker ran a conversation,
    on how many workers there are, or on what ran before it."""
    h = hashlib.sha256(f"specops-eval/{seed}/{index}/{turn}/{stream}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def run_eval(cfg: Config, campaign: Campaign, *, drafter_dir: str | os.PathLike[str] | None = None,
             lock: bool = True, target: Any = None, family: str | None = None) -> dict[str, Any]:
    """The eval phase of `family` (default: the first of train.drafter): measured tau and speedup per
    dataset -> <its eval dir>/<dataset>.json and summary.json (eval/ for the first family,
    drafters/<family>/eval/ for another).

    `drafter_dir` (else eval.drafter, else the family's latest checkpoint or export). `target`
    reuses a loaded target.inprocess.TargetModel (workers = 1 only: each worker loads its own). With
    eval.workers = N > 1, N worker processes share the conversations (module docstring). Returns
    the summary; nothing is written to eval/ unless every conversation was evaluated.
    """
    from ..sources import open_source

    ec = cfg.eval
    evals = _eval_sections(cfg)
    sources = {}
    for ds in evals:
        sources[ds.name] = open_source(ds, default_system_prompt=cfg.generate.system_prompt)
    check_not_trained_on(cfg, evals, {n: s.paths for n, s in sources.items()})
    seen = prompts_seen_in_training(cfg, sources)
    for name, ids in seen.items():
        log.warning("eval %s: %d prompt(s) also in training data are left out: %s", name, len(ids), sorted(ids)[:5])
    home = campaign.drafter_home(cfg, check_family(family, "--family") if family else None)
    phase = home.key("eval")
    dpath = Path(drafter_dir or ec.drafter or _latest_drafter(campaign, home))
    out_dir = home.eval_dir
    lockctx = RunLock(campaign, "eval") if lock else contextlib.nullcontext()
    with lockctx, phase_progress("eval", None, "turns", logger=log):  # the total once _run has the items
        campaign.set_phase(phase, "running", pid=os.getpid(), drafter=str(dpath), workers=ec.workers,
                           worker_pids=None, family=home.family)
        try:
            summary = _run(cfg, evals, sources, seen, dpath, out_dir, target,
                           on_workers=lambda pids: _record_worker_pids(campaign, pids, phase))
        except BaseException as e:
            campaign.set_phase(phase, "failed", error=f"{type(e).__name__}: {e}")
            raise
        o = summary["overall"]
        if summary.get("drafter_family") not in (None, home.family):
            log.warning("eval %s: the drafter %s is a %s drafter", home.family, dpath, summary["drafter_family"])
        campaign.set_phase(phase, "done", tau=o["tau"], spec_tokens_per_s=o["spec_tokens_per_s"],
                           measured_speedup=o["measured_speedup"], go=summary["verdict"]["go"],
                           verdict=summary["verdict"]["line"], summary=str(out_dir / "summary.json"))
    return summary


def _record_worker_pids(campaign: Campaign, pids: list[int], phase: str = "eval") -> None:
    """The running eval's worker pids into its manifest entry (for humans and `status`)."""
    m = campaign.read_manifest() or {"phases": {}}
    m.setdefault("phases", {}).setdefault(phase, {})["worker_pids"] = pids
    campaign.write_manifest(m)


def _work_items(evals: list[DatasetSection], sources: dict[str, Any], seen: dict[str, dict[str, str]]
                ) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """The ordered conversation list over all datasets ({index, dataset, id, messages}; `index` is
    the position in it) and the quarantined records per dataset. Read before any model loads."""
    from ..sources import Quarantined

    items: list[dict[str, Any]] = []
    quarantined: dict[str, list[dict[str, Any]]] = {}
    for ds in evals:
        q = quarantined.setdefault(ds.name, [])
        first = len(items)
        for item in sources[ds.name]:
            if isinstance(item, Quarantined):
                q.append({"where": item.where, "reason": item.reason})
            elif item.id not in seen.get(ds.name, {}):
                items.append({"index": len(items), "dataset": ds.name, "id": item.id, "messages": item.messages})
        if len(items) == first:
            raise InputError(_no_usable_prompt(ds.name, q, seen.get(ds.name, {})))
    return items, quarantined


def _no_usable_prompt(name: str, quarantine: list[dict[str, Any]], in_training: dict[str, str]) -> str:
    """Why an eval dataset has nothing left: its prompts are training prompts, quarantined, or both.
    `quarantine`: its quarantined records ({where, reason}), the first named with its reason."""
    n = len(in_training)
    quarantined = len(quarantine)
    if not n:
        first = f"; first, {quarantine[0]['where']}: {quarantine[0]['reason']}" if quarantine else ""
        return f"eval dataset {name!r}: no usable prompt ({quarantined} quarantined{first})"
    where = ", ".join(repr(t) for t in sorted(set(in_training.values())))
    if n == 1:
        why = f"1 prompt was left out because it is a training prompt (training dataset {where})"
    else:
        why = f"{n} prompts were left out because they are training prompts (training dataset {where})"
    why = f"no usable prompt: {quarantined} quarantined, {why}" if quarantined else ("all " if n > 1 else "its ") + why
    return f"eval dataset {name!r}: {why}; evaluate on prompts the drafter was not trained on"


class _Evaluator:
    """One process's models (target, tokenizer, drafter) and the per-conversation loop."""

    def __init__(self, cfg: Config, dpath: Path, target: Any = None, *, runners: bool = True):
        from ..models import resolve_device, resolve_model_dir
        from ..target.hf import load_tokenizer
        from ..target.inprocess import load_target

        self.ec = ec = cfg.eval
        trust_remote_code = cfg.target.trust_remote_code
        if target is None:
            target = load_target(resolve_model_dir(cfg.target.model), cfg.target.dtype, resolve_device(ec.device),
                                 trust_remote_code=trust_remote_code)
        self.target = target
        self.device = torch.device(target.device)
        self.tokenizer = load_tokenizer(cfg.target.tokenizer or target.model_dir, trust_remote_code=trust_remote_code)
        self.drafter = load_eval_drafter(dpath, target, self.device)
        self.eos = _eos_ids(target.model, self.tokenizer)
        self.template_kwargs = dict((cfg.generate.extra_body or {}).get("chat_template_kwargs") or {})
        if not runners:  # the batched loop (evaluate/batched.py) builds its own
            return
        from .fast_target import make_target_runner

        self.runner = make_target_runner(target, self.drafter.config.aux_layer_ids, ec.target_runner,
                                         cuda_graphs=ec.cuda_graphs)
        self.drunner = family_of(self.drafter).drafter_runner(self.drafter, ec.drafter_runner,
                                                              cuda_graphs=ec.cuda_graphs)

    def info(self) -> dict[str, Any]:
        from .fast_target import runner_info

        out = {"target": str(self.target.model_dir), "aux_layer_ids": self.drafter.config.aux_layer_ids,
               "drafter_family": family_of(self.drafter).name,
               "device": str(self.device), "dtype": str(self.target.dtype).removeprefix("torch.")}
        if not hasattr(self, "runner"):  # the batched loop's
            return {**out, "target_runner": "batched", "cuda_graphs": False, "drafter_runner": "batched",
                    "drafter_cuda_graphs": False}
        return {**out, **runner_info(self.runner), "drafter_runner": self.drunner.name,
                "drafter_cuda_graphs": bool(self.drunner.use_graphs)}

    def _gen(self, index: int, turn: int, stream: str) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(prompt_seed(self.ec.seed, index, turn, stream))

    def warm_up(self) -> None:
        """Allocator, kernels, lazy init: the timings after it are steady-state."""
        ec = self.ec
        warm = _prompt_ids(self.tokenizer, [{"role": "user", "content": "Hello"}], self.template_kwargs)
        gen = self._gen(-1, 0, "warmup")
        speculative_generate(self.runner, self.drafter, warm, k=ec.k, max_new_tokens=min(8, ec.max_new_tokens),
                             temperature=ec.temperature, eos_ids=self.eos, gen=gen, drafter_runner=self.drunner)
        target_generate(self.runner, warm, max_new_tokens=min(8, ec.max_new_tokens), temperature=ec.temperature,
                        eos_ids=self.eos, gen=gen)

    def run_item(self, item: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
        """Every turn of one conversation -> (rows, seconds spent)."""
        ec, tok, eos = self.ec, self.tokenizer, self.eos
        k, T = ec.k, ec.temperature
        t0 = time.perf_counter()
        rows: list[dict[str, Any]] = []
        for history, turn in _turns(item["messages"]):
            ids = _prompt_ids(tok, history, self.template_kwargs)
            spec = speculative_generate(self.runner, self.drafter, ids, k=k, max_new_tokens=ec.max_new_tokens,
                                        temperature=T, eos_ids=eos, gen=self._gen(item["index"], turn, "spec"),
                                        drafter_runner=self.drunner)
            base = None
            if ec.baseline:
                base = target_generate(self.runner, ids, max_new_tokens=ec.max_new_tokens, temperature=T,
                                       eos_ids=eos, gen=self._gen(item["index"], turn, "baseline"))
            answer = tok.decode([t for t in spec.tokens if t not in eos], skip_special_tokens=True)
            history.append({"role": "assistant", "content": answer})
            rows.append({"id": item["id"], "turn": turn, "prompt_tokens": len(ids), "answer": answer,
                         "spec": spec.to_json(), "baseline": base.to_json() if base is not None else None,
                         "identical": (spec.tokens == base.tokens) if T == 0 and base is not None else None})
        return rows, time.perf_counter() - t0

    def run_batched(self, items: list[dict[str, Any]]
                    ) -> tuple[list[tuple[list[dict[str, Any]], float]], dict[str, Any]]:
        """Every turn of every conversation through one batched loop (eval.batch_size rows,
        evaluate/batched.py) -> ([(rows, seconds from admission to its last turn)] in items' order,
        the loop's aggregate figures)."""
        from .batched import BatchedLoop, run_batched

        ec, tok, eos, kwargs = self.ec, self.tokenizer, self.eos, self.template_kwargs
        gen = self._gen(-1, 0, "batched") if ec.temperature > 0 else None
        loop = BatchedLoop(self.target, self.drafter, rows=min(ec.batch_size, max(1, len(items))), k=ec.k,
                           max_new_tokens=ec.max_new_tokens, temperature=ec.temperature, eos_ids=eos, gen=gen)
        out: dict[int, tuple[list[dict[str, Any]], float]] = {}

        class Conv:
            def __init__(self, item: dict[str, Any]):
                self.item, self.turns, self.rows = item, _turns(item["messages"]), []
                self.t0 = time.perf_counter()

            def next_prompt(self) -> list[int] | None:
                nxt = next(self.turns, None)
                if nxt is None:
                    out[self.item["index"]] = (self.rows, time.perf_counter() - self.t0)
                    return None
                self.history, self.turn = nxt
                self.ids = _prompt_ids(tok, self.history, kwargs)
                return self.ids

        def on_turn(conv: Conv, t: Any) -> list[int] | None:
            res = SpecResult(prompt_tokens=t.prompt_tokens, k=ec.k, tokens=[], finish_reason="length",
                             accepted=t.accepted)
            res.tokens, res.finish_reason = finish_tokens(t.generated, ec.max_new_tokens, eos)
            answer = tok.decode([x for x in res.tokens if x not in eos], skip_special_tokens=True)
            conv.history.append({"role": "assistant", "content": answer})
            conv.rows.append({"id": conv.item["id"], "turn": conv.turn, "prompt_tokens": len(conv.ids),
                              "answer": answer, "spec": res.to_json(), "baseline": None, "identical": None})
            _log_rows(conv.rows[-1:])
            return conv.next_prompt()

        figures = run_batched(loop, (Conv(it) for it in items), lambda c: c.next_prompt(), on_turn)
        return [out[it["index"]] for it in items], figures


def _log_rows(rows: list[dict[str, Any]]) -> None:
    bar = current("eval")
    for r in rows:
        sj, bj = r["spec"], r["baseline"]
        bar.tally("tau", sum(a + 1 for a in sj["accepted"]), len(sj["accepted"]))  # pooled, as summarize does
        bar.tally("tok_s", sj["new_tokens"], sj["wall_s"])
        bar.advance()
        if bj is None:
            log.info("%s turn %d: %d tokens, tau %.2f, %.1f tok/s", r["id"], r["turn"], len(sj["tokens"]),
                     sj["tau"] or 0.0, sj["tokens_per_s"] or 0.0, extra=ROUTINE)
            continue
        log.info("%s turn %d: %d tokens, tau %.2f, %.1f vs %.1f tok/s", r["id"], r["turn"], len(sj["tokens"]),
                 sj["tau"] or 0.0, sj["tokens_per_s"] or 0.0, bj["tokens_per_s"] or 0.0, extra=ROUTINE)


def _run(cfg: Config, evals: list[DatasetSection], sources: dict[str, Any], seen: dict[str, dict[str, str]],
         dpath: Path, out_dir: Path, target: Any, on_workers: Any = None) -> dict[str, Any]:
    import transformers

    from .. import __version__

    ec = cfg.eval
    t_phase = time.time()
    items, quarantined = _work_items(evals, sources, seen)
    current("eval").update(total=sum(m.get("role") == "user" for it in items for m in it["messages"]))
    k, T = ec.k, ec.temperature
    workers = min(ec.workers, len(items))  # never a worker without a conversation
    batched = None
    if ec.batch_size > 1:
        ev = _Evaluator(cfg, dpath, target, runners=False)
        info = ev.info()
        results, batched = ev.run_batched(items)
    elif workers == 1:
        ev = _Evaluator(cfg, dpath, target)
        info = ev.info()
        ev.warm_up()
        results = []
        for item in items:
            results.append(ev.run_item(item))
            _log_rows(results[-1][0])
    else:
        if target is not None:
            log.info("eval.workers = %d: each worker loads its own target (the loaded one is not used)", workers)
        info, results = _run_workers(cfg, dpath, items, workers, on_workers)
    na = SPEEDUP_UNAVAILABLE if workers > 1 else None
    if not ec.baseline:
        na = NO_BASELINE
    if batched is not None:
        from .batched import BATCHED_NA

        na = BATCHED_NA

    per_ds: dict[str, Any] = {}
    per_rows: dict[str, list[dict[str, Any]]] = {ds.name: [] for ds in evals}
    spent: dict[str, float] = {ds.name: 0.0 for ds in evals}
    for item, (rows, elapsed) in zip(items, results):
        per_rows[item["dataset"]].extend(rows)
        spent[item["dataset"]] += elapsed
    for ds in evals:  # every dataset checked before anything is written
        if not per_rows[ds.name]:
            raise InputError(f"eval dataset {ds.name!r}: no usable prompt ({len(quarantined[ds.name])} quarantined)")
    out_dir.mkdir(parents=True, exist_ok=True)
    all_rows: list[dict[str, Any]] = []
    for ds in evals:
        rows = per_rows[ds.name]
        metrics = summarize(rows, k, speedup_unavailable=na)
        per_ds[ds.name] = {**metrics, "prompts": len({r["id"] for r in rows}),
                           "quarantined": len(quarantined[ds.name]),
                           "excluded_seen_in_training": len(seen.get(ds.name, {})),
                           "elapsed_s": round(spent[ds.name], 3)}
        atomic_write_json(out_dir / f"{ds.name}.json", {
            "dataset": ds.name, "source": ds.source, "paths": sources[ds.name].paths, "drafter": str(dpath),
            "k": k, "temperature": T, "max_new_tokens": ec.max_new_tokens, "summary": per_ds[ds.name],
            "quarantined": quarantined[ds.name], "excluded_seen_in_training": seen.get(ds.name, {}), "rows": rows,
        })
        all_rows.extend(rows)
    overall = summarize(all_rows, k, speedup_unavailable=na)
    v = verdict(overall, baseline_tokens_per_s=ec.baseline_tokens_per_s, min_tau=ec.min_tau)
    summary = {
        "format": "specops-eval-v1",
        "finished": now_iso(),
        "elapsed_s": round(time.time() - t_phase, 3),
        "target": info["target"],
        "drafter": str(dpath),
        "drafter_family": info.get("drafter_family"),  # whose drafting rule the loop ran
        "aux_layer_ids": info["aux_layer_ids"],
        "aux_layer_convention": "input-to-layer (= HF hidden_states index)",
        "device": info["device"],
        "dtype": info["dtype"],
        "k": k,
        "temperature": T,
        "max_new_tokens": ec.max_new_tokens,
        "seed": ec.seed,
        "workers": workers,
        "target_runner": info.get("target_runner"),
        "cuda_graphs": info.get("cuda_graphs"),
        "drafter_runner": info.get("drafter_runner"),
        "drafter_cuda_graphs": info.get("drafter_cuda_graphs"),
        "speedup_unavailable": na,
        "batch_size": ec.batch_size,
        "batched": batched,
        "datasets": per_ds,
        "overall": overall,
        "baseline_tokens_per_s_line": ec.baseline_tokens_per_s,
        "min_tau": ec.min_tau,
        "verdict": v,
        "definitions": {
            "tau": "mean accepted tokens per target step, the target's own token included",
            "acceptance_per_position": "P(draft i accepted | drafts 1..i-1 accepted)",
            "cost_ratio_c": "drafter time per draft token / target verification step time",
            "ideal_speedup": "tau / (1 + k·c), which assumes a verification costs one decode step",
            "verify_over_decode": "verification step time / one-token decode step time",
            "speedup_by_k": "per k' <= k: tau(k') = mean(1 + min(accepted, k')) and tau(k') / (verify_over_decode + k'·c)",
            "measured_speedup": "speculative tokens/s / in-process target-only tokens/s (wall clock, prefill included)",
            "workers": "processes sharing the device; > 1: tokens/s and measured speedup are null "
                       "(speedup_unavailable), step times are measured with the device shared",
            "target_runner": "hf: HF forward with a DynamicCache; static: preallocated KV cache (fast_target.py); "
                             "the speculative loop and the baseline use the same one. cuda_graphs: the static "
                             "runner replays CUDA graphs for decode/verify (as of the start; a failed capture "
                             "later falls back to eager with a warning)",
            "seed": "each generation samples from its own generator, seeded from (seed, conversation index, "
                    "turn, spec|baseline)",
        },
        "versions": {"specops": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
    }
    atomic_write_json(out_dir / "summary.json", summary)
    return summary


# ---------------------------------------------------------------- worker processes (eval.workers > 1)


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel SIGKILLs this process when its parent dies (no orphan worker holding a GPU
    after the eval process itself is SIGKILLed)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)


def _worker_main(argv: list[str]) -> int:
    """A worker process: `python -m specops.evaluate.worker ARGS RESULT_FD` (started by _run_workers
    only). ARGS: a JSON file {w, workers, config, source_path, dpath, items, parent_pid}. Loads the models, evaluates
    its items in order and sends on RESULT_FD (a multiprocessing Connection): ("ready", info),
    ("item", index, rows, seconds) per conversation, then ("done",), or ("error", text, traceback).
    SIGINT is ignored (a terminal's Ctrl-C reaches the whole group: the parent ends the workers);
    SIGTERM keeps its default action, the parent's way to end a worker. Returns the exit code."""
    import traceback
    from multiprocessing.connection import Connection

    from ..config import config_from_dict

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = json.loads(Path(argv[0]).read_text())
    conn = Connection(int(argv[1]), readable=False)
    _die_with_parent(args["parent_pid"])
    w, workers = args["w"], args["workers"]
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s eval-worker-{w}: %(message)s")
    code = 0
    try:
        # the CPU's threads shared among the workers (on a GPU the device is the shared part)
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // workers)))
        src = args["source_path"]
        ev = _Evaluator(config_from_dict(args["config"], Path(src) if src else None), Path(args["dpath"]))
        conn.send(("ready", ev.info()))
        ev.warm_up()
        for item in args["items"]:
            rows, spent = ev.run_item(item)
            conn.send(("item", item["index"], rows, spent))
        conn.send(("done",))
    except BaseException as e:  # noqa: BLE001 - everything goes to the parent, which raises it
        code = e.exit_code if isinstance(e, SpecopsError) else 1
        with contextlib.suppress(BaseException):
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
    finally:
        with contextlib.suppress(BaseException):
            conn.close()
    return code


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Interrupted(f"eval stopped by {signal.Signals(signum).name}: every worker ended, nothing written; "
                      "rerun to evaluate again")


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"exit code {code} (killed by {signal.Signals(-code).name})"
    return f"exit code {code}"


def _run_workers(cfg: Config, dpath: Path, items: list[dict[str, Any]], workers: int, on_workers: Any
                 ) -> tuple[dict[str, Any], list[tuple[list[dict[str, Any]], float]]]:
    """Start `workers` processes (`python -m specops.evaluate.worker`; worker w gets items w, w+N, ...)
    and collect their rows by item index. A worker that fails (an error, a signal, an exit before
    finishing) ends the others and raises EvalWorkerFailed with its error and exit code; SIGTERM
    (handled while this runs in the main thread) and Ctrl-C end them too. Returns (the first
    worker's info, [(rows, seconds)] in item order)."""
    import subprocess
    import tempfile
    from multiprocessing.connection import Connection, wait

    if not ((dpath / "drafter_config.json").is_file() or (dpath / "config.json").is_file()):
        raise InputError(f"{dpath}: neither a training checkpoint (drafter_config.json) nor an export (config.json)")
    env = dict(os.environ)  # the workers import this very specops, installed or not
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    procs: list[subprocess.Popen] = []
    conns: list[Connection] = []
    results: dict[int, tuple[list[dict[str, Any]], float]] = {}
    info: dict[str, Any] | None = None
    done: set[int] = set()
    errors: dict[int, tuple[str, str]] = {}
    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    tmp = tempfile.TemporaryDirectory(prefix="specops-eval-")
    try:
        for w in range(workers):
            args = Path(tmp.name) / f"worker-{w}.json"
            args.write_text(json.dumps({"w": w, "workers": workers, "config": cfg.to_dict(),
                                        "source_path": str(cfg.source_path) if cfg.source_path else None,
                                        "dpath": str(dpath), "items": items[w::workers], "parent_pid": os.getpid()}))
            r, wfd = os.pipe()
            conns.append(Connection(r, writable=False))
            try:
                procs.append(subprocess.Popen([sys.executable, "-m", "specops.evaluate.worker", str(args), str(wfd)],
                                              pass_fds=(wfd,), env=env, stdin=subprocess.DEVNULL))
            finally:
                os.close(wfd)  # the worker holds the only write end: its end is EOF here
        pids = [p.pid for p in procs]
        log.info("eval: %d conversations over %d workers (pids %s)", len(items), workers, pids)
        if on_workers is not None:
            on_workers(pids)

        def receive(w: int) -> bool:
            """One message from worker w; False at EOF (it closed its end: it is ending)."""
            nonlocal info
            try:
                msg = conns[w].recv()
            except (EOFError, OSError):
                return False
            if msg[0] == "ready":
                info = info or msg[1]
                log.info("eval worker %d (pid %d) ready: %s", w, procs[w].pid, msg[1]["device"])
            elif msg[0] == "item":
                results[msg[1]] = (msg[2], msg[3])
                _log_rows(msg[2])
            elif msg[0] == "done":
                done.add(w)
            elif msg[0] == "error":
                errors[w] = (msg[1], msg[2])
            return True

        def finish(w: int) -> None:
            p = procs[w]
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.returncode != 0 or w not in done:
                text, tb = errors.get(w, ("no error reported (killed by a signal, or out of memory?)" if p.returncode
                                          else "it ended before finishing its conversations", ""))
                if tb:
                    log.error("eval worker %d (pid %d) traceback:\n%s", w, p.pid, tb.rstrip())
                raise EvalWorkerFailed(f"eval worker {w} (pid {p.pid}) failed, {_exit_text(p.returncode)}: {text}")

        pending = set(range(workers))
        while pending:
            for c in wait([conns[w] for w in pending], timeout=5.0):
                w = conns.index(c)
                if not receive(w):
                    pending.discard(w)
                    finish(w)
            for w in list(pending):  # ended without its end closing (a descendant holding it): judge it now
                if procs[w].poll() is not None:
                    while conns[w].poll() and receive(w):
                        pass
                    pending.discard(w)
                    finish(w)
        missing = [it["index"] for it in items if it["index"] not in results]
        if missing or info is None:
            raise EvalWorkerFailed(f"eval workers finished without results for conversations {missing[:10]}")
        return info, [results[it["index"]] for it in items]
    finally:
        for w, p in enumerate(procs):
            if p.poll() is None:
                log.info("eval: ending worker %d (pid %d)", w, p.pid)
                p.terminate()
        deadline = time.time() + 10.0
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for c in conns:
            c.close()
        tmp.cleanup()
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def with_workers(cfg: Config, workers: int | None, batch_size: int | None = None) -> Config:
    """cfg with eval.workers and/or eval.batch_size overridden (validated as in campaign.toml); None:
    unchanged. A batch size > 1 is tau only: it also sets baseline = false and (unless `workers` is
    given: then > 1 is refused) workers = 1."""
    import dataclasses

    ev = cfg.eval
    if workers is not None:
        ev = dataclasses.replace(ev, workers=workers)
    if batch_size is not None:
        extra = {"baseline": False, **({"workers": 1} if workers is None else {})} if batch_size > 1 else {}
        ev = dataclasses.replace(ev, batch_size=batch_size, **extra)
    return cfg if ev is cfg.eval else dataclasses.replace(cfg, eval=ev)
