"""Evaluation through the serving engine: tau from the engine's own counters, the served speedup,
and the interop check against specops' loop.

    endpoint with the drafter [+ the same engine without it] + eval prompts -> eval/served.json

The eval conversations (the loop eval's datasets, limits and chat template; a turn's prompt is built
from the served answers before it) go to `/v1/completions` as token ids with `return_token_ids`, so
what the engine generated is known token by token. Passes:

    drafter server   T=0, concurrency 1   per turn: tokens, tau from the /metrics deltas around the
                                          request (vLLM's spec_decode counters), the per-step
                                          accepted drafts when the server reports them
                                          (`--per-request-spec-decode-metrics detailed`); tokens/s
                     T=0, concurrency N   tokens/s; tau over the pass
                     T=1, concurrency N   tau and per-position acceptance over the pass (each
                                          request seeded: prompt_seed(eval.seed, index, turn, "served"))
    baseline server  T=0, concurrency 1 and N: tokens/s of the target alone

served speedup at c = tokens/s with the drafter / tokens/s without, both at concurrency c on the same
engine build. Tokens/s = completion tokens of the pass / its wall time (prefill included).

Interop check (`interop`): the T=0, concurrency-1 turns again through specops' own loop
(evaluate/loop.py, the target in process), on the very prompt ids the server got, with the same k
and max_new_tokens. The engine and the loop agree token for token when both run the drafter the same
way; tau may still differ by the engines' step accounting at the end of an answer (a final verify
step with fewer tokens left than k + 1). The check passes when the pooled tau agree within
`tolerance` (eval.interop_tolerance) and names the likely causes otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager

import aiohttp
import orjson

from ..campaign import atomic_write_json, now_iso
from ..checks.server import SpecDecodeCounters, spec_decode_from_text
from ..config import Config
from ..errors import InputError, SpecopsError

log = logging.getLogger("specops.eval")

SERVED_FORMAT = "specops-served-eval-v1"
# /metrics readings around a request until two agree: the engine records its counters while it
# hands the outputs over, at most a moment after the response left.
SETTLE_READS = 5
SETTLE_PAUSE_S = 0.05
LIKELY_CAUSES = (
    "aux layer ids: the export's eagle_aux_hidden_state_layer_ids are not the ids the features were "
    "extracted with (input-to-layer convention: id t is the input to layer t)",
    "d2t / t2d: the draft-to-target vocabulary map is not the one the drafter was trained with",
    "norm_before_residual: the engine reads a different default than the trainer used",
    "embed_tokens: the engine shares the target's embedding; a drafter trained with its own needs it "
    "in the export",
    "rope_theta / rope_scaling / max_position_embeddings differ from the target's",
    "the server runs another k, dtype or target than the loop",
)


class ServedEvalError(SpecopsError):
    """The served evaluation could not run (no server, no counters, no token ids)."""


@dataclass
class Endpoint:
    """An OpenAI-compatible server: base URL ending in /v1, the served model name, an API key."""

    url: str
    model: str
    api_key: str | None = None

    @property
    def root(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")

    @property
    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


@dataclass
class TurnResult:
    index: int  # the conversation's position in the ordered eval list
    dataset: str
    id: str
    turn: int
    prompt: list[int]
    tokens: list[int]
    finish_reason: str | None
    wall_s: float
    # T=0, concurrency 1 only: the spec-decode counter deltas around this request
    drafts: float | None = None
    accepted: float | None = None
    per_position: list[float] | None = None
    # from the response body, when the server reports per-request metrics
    per_step_accepted: list[int] | None = None

    @property
    def tau(self) -> float | None:
        if not self.drafts:
            return None
        return 1 + (self.accepted or 0.0) / self.drafts

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "dataset": self.dataset, "id": self.id, "turn": self.turn,
                "prompt_tokens": len(self.prompt), "new_tokens": len(self.tokens), "tokens": self.tokens,
                "finish_reason": self.finish_reason, "wall_s": round(self.wall_s, 6), "drafts": self.drafts,
                "accepted": self.accepted, "tau": self.tau, "per_position": self.per_position,
                "per_step_accepted": self.per_step_accepted}


@dataclass
class PassResult:
    name: str
    temperature: float
    concurrency: int
    turns: list[TurnResult] = field(default_factory=list)
    wall_s: float = 0.0
    counters: dict[str, Any] | None = None  # deltas over the pass (None: no spec-decode counters)

    @property
    def new_tokens(self) -> int:
        return sum(len(t.tokens) for t in self.turns)

    @property
    def tokens_per_s(self) -> float | None:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else None

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"temperature": self.temperature, "concurrency": self.concurrency,
                               "turns": len(self.turns), "new_tokens": self.new_tokens,
                               "wall_s": round(self.wall_s, 3), "tokens_per_s": self.tokens_per_s}
        if self.counters is not None:
            out.update(self.counters)
        return out


# ---------------------------------------------------------------- counters


def _delta(after: SpecDecodeCounters, before: SpecDecodeCounters) -> dict[str, Any]:
    drafts = after.drafts - before.drafts
    accepted = after.accepted - before.accepted
    pos = [after.per_position.get(p, 0.0) - before.per_position.get(p, 0.0) for p in sorted(after.per_position)]
    return {"drafts": drafts, "accepted": accepted,
            "tau": 1 + accepted / drafts if drafts > 0 else None,
            "per_position": [v / drafts for v in pos] if drafts > 0 and pos else None,
            "k": len(after.per_position) or None}


async def _counters(session: aiohttp.ClientSession, ep: Endpoint) -> SpecDecodeCounters | None:
    timeout = aiohttp.ClientTimeout(total=30)
    async with session.get(ep.root + "/metrics", headers=ep.headers, timeout=timeout) as r:
        if r.status != 200:
            raise ServedEvalError(f"{ep.root}/metrics: HTTP {r.status}")
        return spec_decode_from_text(await r.text())


def _key(c: SpecDecodeCounters | None) -> tuple[float, ...] | None:
    return None if c is None else (c.drafts, c.accepted, *sorted(c.per_position.items()))


async def _settled(session: aiohttp.ClientSession, ep: Endpoint) -> SpecDecodeCounters | None:
    """A /metrics reading that the next one, a moment later, agrees with."""
    last = await _counters(session, ep)
    for _ in range(SETTLE_READS):
        await asyncio.sleep(SETTLE_PAUSE_S)
        now = await _counters(session, ep)
        if _key(now) == _key(last):
            return now
        last = now
    return last


# ---------------------------------------------------------------- requests


async def _complete(session: aiohttp.ClientSession, ep: Endpoint, prompt: list[int], *, max_tokens: int,
                    temperature: float, seed: int | None, timeout_s: float) -> tuple[dict[str, Any], float]:
    body: dict[str, Any] = {"model": ep.model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": temperature, "return_token_ids": True, "stream": False}
    if seed is not None:
        body["seed"] = seed
    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.post(ep.url.rstrip("/") + "/completions", data=orjson.dumps(body), headers=ep.headers,
                            timeout=timeout) as r:
        raw = await r.read()
        status = r.status
    dt = time.perf_counter() - t0
    if status != 200:
        raise ServedEvalError(f"{ep.url}/completions: HTTP {status}: {raw[:300].decode('utf-8', 'replace')}")
    return orjson.loads(raw), dt


def _parse_choice(data: dict[str, Any], url: str) -> tuple[list[int], str | None, list[int] | None]:
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise ServedEvalError(f"{url}: a completion without choices: {str(data)[:300]}") from None
    tokens = choice.get("token_ids")
    if not isinstance(tokens, list):
        raise ServedEvalError(f"{url}: the completion has no token_ids: the server must honour return_token_ids "
                              "(vLLM's OpenAI server does)")
    spec = ((data.get("metrics") or {}).get("speculative_decoding") or {})
    steps = spec.get("per_step_accepted")
    return [int(t) for t in tokens], choice.get("finish_reason"), steps if isinstance(steps, list) else None


@dataclass
class Conversation:
    index: int
    dataset: str
    id: str
    messages: list[dict[str, Any]]


class PromptBuilder:
    """Chat-template token ids of a turn: the loop eval's template and kwargs (evaluate/specdec.py)."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any], eos: frozenset[int]):
        self.tokenizer, self.template_kwargs, self.eos = tokenizer, template_kwargs, eos

    def ids(self, history: list[dict[str, Any]]) -> list[int]:
        from .specdec import _prompt_ids

        return _prompt_ids(self.tokenizer, history, self.template_kwargs)

    def answer(self, tokens: list[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t not in self.eos], skip_special_tokens=True)


async def run_pass(ep: Endpoint, convs: list[Conversation], prompts: PromptBuilder, *, name: str,
                   temperature: float, concurrency: int, max_tokens: int, seed: int,
                   timeout_s: float = 1800.0, on_turn: Any = None) -> PassResult:
    """Every turn of every conversation through `ep` (a conversation's turns in order, in one
    worker); with concurrency 1, the counter deltas around each request go into its TurnResult."""
    from .specdec import _turns, prompt_seed

    res = PassResult(name=name, temperature=temperature, concurrency=concurrency)
    per_request = concurrency == 1
    connector = aiohttp.TCPConnector(limit=concurrency + 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = await _settled(session, ep)
        queue: asyncio.Queue[Conversation] = asyncio.Queue()
        for c in convs:
            queue.put_nowait(c)
        done: dict[tuple[int, int], TurnResult] = {}

        async def worker() -> None:
            nonlocal before
            while True:
                try:
                    conv = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                for history, turn in _turns(conv.messages):
                    ids = prompts.ids(history)
                    s = prompt_seed(seed, conv.index, turn, "served") & 0x7FFFFFFF if temperature > 0 else None
                    data, dt = await _complete(session, ep, ids, max_tokens=max_tokens, temperature=temperature,
                                               seed=s, timeout_s=timeout_s)
                    tokens, finish, steps = _parse_choice(data, ep.url)
                    t = TurnResult(index=conv.index, dataset=conv.dataset, id=conv.id, turn=turn, prompt=ids,
                                   tokens=tokens, finish_reason=finish, wall_s=dt, per_step_accepted=steps)
                    if per_request and before is not None:
                        after = await _settled(session, ep)
                        if after is not None:
                            d = _delta(after, before)
                            t.drafts, t.accepted, t.per_position = d["drafts"], d["accepted"], d["per_position"]
                        before = after
                    done[(conv.index, turn)] = t
                    history.append({"role": "assistant", "content": prompts.answer(tokens)})
                    if on_turn is not None:
                        on_turn(t)

        before = start
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(convs))))))
        res.wall_s = time.perf_counter() - t0
        end = await _settled(session, ep)
    res.turns = [done[k] for k in sorted(done)]
    if start is not None and end is not None:
        res.counters = _delta(end, start)
    return res


# ---------------------------------------------------------------- the interop check


def interop_check(turns: list[TurnResult], *, target: Any, drafter: Any, k: int, max_new_tokens: int,
                  eos: frozenset[int], tolerance: float) -> dict[str, Any]:
    """The T=0 served turns through specops' loop on the same prompt ids -> per-turn comparison
    and the verdict (module docstring)."""
    from .loop import TargetRunner, speculative_generate

    runner = TargetRunner(target, drafter.config.aux_layer_ids)
    rows = []
    s_acc = s_drafts = l_steps = l_sum = 0.0
    for t in turns:
        spec = speculative_generate(runner, drafter, t.prompt, k=k, max_new_tokens=max_new_tokens, eos_ids=eos)
        loop_tau = sum(a + 1 for a in spec.accepted) / len(spec.accepted) if spec.accepted else None
        l_steps += len(spec.accepted)
        l_sum += sum(a + 1 for a in spec.accepted)
        if t.drafts:
            s_acc += t.accepted or 0.0
            s_drafts += t.drafts
        diverge = next((i for i, (a, b) in enumerate(zip(t.tokens, spec.tokens)) if a != b),
                       None if len(t.tokens) == len(spec.tokens) else min(len(t.tokens), len(spec.tokens)))
        step_diverge = None
        if t.per_step_accepted is not None:
            step_diverge = next((i for i, (a, b) in enumerate(zip(t.per_step_accepted, spec.accepted)) if a != b),
                                None)
        rows.append({"dataset": t.dataset, "id": t.id, "turn": t.turn, "tokens_served": len(t.tokens),
                     "tokens_loop": len(spec.tokens), "identical": diverge is None, "first_divergent_token": diverge,
                     "tau_served": t.tau, "tau_loop": loop_tau,
                     "tau_diff": None if t.tau is None or loop_tau is None else t.tau - loop_tau,
                     "steps_served": t.drafts, "steps_loop": len(spec.accepted),
                     "first_divergent_step": step_diverge,
                     "per_step_accepted_loop": spec.accepted})
    tau_served = 1 + s_acc / s_drafts if s_drafts else None
    tau_loop = l_sum / l_steps if l_steps else None
    out: dict[str, Any] = {"k": k, "max_new_tokens": max_new_tokens, "tolerance": tolerance,
                           "tau_served": tau_served, "tau_loop": tau_loop,
                           "tau_diff": None if tau_served is None or tau_loop is None else tau_served - tau_loop,
                           "turns": len(rows), "identical_turns": sum(r["identical"] for r in rows), "rows": rows}
    if tau_served is None or tau_loop is None:
        out.update(ok=False, line="interop check: no tau from the server (no spec-decode counters moved)",
                   likely_causes=list(LIKELY_CAUSES))
        return out
    diff = tau_served - tau_loop
    ok = abs(diff) <= tolerance
    line = (f"interop check {'pass' if ok else 'FAIL'}: served tau {tau_served:.4f} vs specops' loop "
            f"{tau_loop:.4f} (diff {diff:+.4f}, tolerance {tolerance:g}); {out['identical_turns']}/{len(rows)} "
            "turns token-identical")
    out.update(ok=ok, line=line)
    if not ok:
        out["likely_causes"] = list(LIKELY_CAUSES)
    return out


# ---------------------------------------------------------------- the phase


def eval_conversations(cfg: Config) -> tuple[list[Conversation], dict[str, Any]]:
    """The loop eval's conversation list (same datasets, limits, held-out rules) -> (conversations,
    {dataset: {"quarantined": n, "excluded_seen_in_training": n}})."""
    from ..sources import open_source
    from .specdec import _eval_sections, _work_items, check_not_trained_on, prompts_seen_in_training

    evals = _eval_sections(cfg)
    sources = {ds.name: open_source(ds, default_system_prompt=cfg.generate.system_prompt) for ds in evals}
    check_not_trained_on(cfg, evals, {n: s.paths for n, s in sources.items()})
    seen = prompts_seen_in_training(cfg, sources)
    items, quarantined = _work_items(evals, sources, seen)
    convs = [Conversation(index=i["index"], dataset=i["dataset"], id=i["id"], messages=i["messages"]) for i in items]
    return convs, {ds.name: {"quarantined": len(quarantined[ds.name]),
                             "excluded_seen_in_training": len(seen.get(ds.name, {}))} for ds in evals}


def _speedups(spec: dict[str, PassResult], base: dict[str, PassResult] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("t0_c1", "t0_cN"):
        s = spec.get(key)
        b = (base or {}).get(key)
        if s is None:
            continue
        sp = s.tokens_per_s / b.tokens_per_s if b is not None and s.tokens_per_s and b.tokens_per_s else None
        out[key] = {"concurrency": s.concurrency, "spec_tokens_per_s": s.tokens_per_s,
                    "baseline_tokens_per_s": b.tokens_per_s if b is not None else None, "speedup": sp}
    return out


def run_served_eval(cfg: Config, out_dir: Path, *, spec_server: Callable[[], ContextManager[Endpoint]],
                    base_server: Callable[[], ContextManager[Endpoint]] | None, k: int | None, concurrency: int,
                    interop: bool, tolerance: float, reference_drafter: Path | None = None,
                    drafter_label: str | None = None, on_turn: Callable[[TurnResult], None] | None = None
                    ) -> dict[str, Any]:
    """The served passes (module docstring) -> eval/served.json; the interop check when `interop`
    (the target loaded in process, `reference_drafter` run by specops' loop). `spec_server` and
    `base_server` give the endpoints, each entered only for its own passes: servers that specops
    starts run one at a time, so neither measurement shares the machine with the other server."""
    from ..models import resolve_model_dir
    from ..target.hf import load_tokenizer
    from .specdec import _eos_ids

    ec = cfg.eval
    convs, per_ds = eval_conversations(cfg)  # bad input is refused before any server starts
    model_dir = resolve_model_dir(cfg.target.model)
    tok = load_tokenizer(cfg.target.tokenizer or model_dir, trust_remote_code=cfg.target.trust_remote_code)
    eos = _eos_ids(_GenerationConfigOnly(model_dir), tok)
    prompts = PromptBuilder(tok, dict((cfg.generate.extra_body or {}).get("chat_template_kwargs") or {}), eos)
    t_phase = time.time()

    def passes(ep: Endpoint, which: list[tuple[str, float, int]]) -> dict[str, PassResult]:
        got = {}
        for name, temp, conc in which:
            log.info("served eval: %s, T=%g, concurrency %d, %d conversations", ep.url, temp, conc, len(convs))
            got[name] = run_interruptible_pass(ep, convs, prompts, name=name, temperature=temp, concurrency=conc,
                                               max_tokens=ec.max_new_tokens, seed=ec.seed, on_turn=on_turn)
            p = got[name]
            tau = (p.counters or {}).get("tau")
            log.info("served eval: %s: %d tokens in %.1f s (%.1f tok/s)%s", name, p.new_tokens, p.wall_s,
                     p.tokens_per_s or 0.0, f", tau {tau:.3f}" if tau else "")
        return got

    with spec_server() as spec_ep:
        spec = passes(spec_ep, [("t0_c1", 0.0, 1), ("t0_cN", 0.0, concurrency), ("t1_cN", 1.0, concurrency)])
    c1 = spec["t0_c1"]
    if c1.counters is None:
        raise ServedEvalError(f"{spec_ep.root}/metrics has no spec-decode counters: the server at {spec_ep.url} "
                              "runs without a drafter (or is not vLLM)")
    served_k = c1.counters.get("k")
    if k is not None and served_k is not None and served_k != k:
        raise ServedEvalError(f"the server drafts {served_k} tokens per step (its per-position counters), "
                              f"not {k}: compare at the same k")
    k = k or served_k or ec.k
    base = None
    if base_server is not None:
        with base_server() as base_ep:
            base = passes(base_ep, [("t0_c1", 0.0, 1), ("t0_cN", 0.0, concurrency)])
        if base["t0_c1"].counters is not None:
            raise ServedEvalError(f"the baseline server {base_ep.url} runs with a drafter (its /metrics has "
                                  "spec-decode counters): start it without one")
    identical = None
    if base is not None:
        identical = sum(a.tokens == b.tokens for a, b in zip(c1.turns, base["t0_c1"].turns))
    result: dict[str, Any] = {
        "format": SERVED_FORMAT, "finished": None, "elapsed_s": None,
        "server": spec_ep.url, "baseline_server": base_ep.url if base is not None else None,
        "drafter": drafter_label, "k": k, "max_new_tokens": ec.max_new_tokens, "seed": ec.seed,
        "concurrency": concurrency, "datasets": per_ds,
        "tau_t0": c1.counters.get("tau"), "per_position_t0": c1.counters.get("per_position"),
        "tau_t1": (spec["t1_cN"].counters or {}).get("tau"),
        "per_position_t1": (spec["t1_cN"].counters or {}).get("per_position"),
        "passes": {n: p.summary() for n, p in spec.items()},
        "baseline_passes": {n: p.summary() for n, p in base.items()} if base is not None else None,
        "speedup": _speedups(spec, base),
        "t0_identical_to_baseline": (f"{identical}/{len(c1.turns)}" if identical is not None else None),
        "rows": [t.to_json() for t in c1.turns],
        "definitions": {
            "tau": "1 + accepted draft tokens / drafts, from vLLM's spec_decode counters (/metrics deltas)",
            "per_position": "accepted tokens at draft position i / drafts",
            "tokens_per_s": "completion tokens of the pass / its wall time (prefill included)",
            "speedup": "tokens/s with the drafter / tokens/s of the same engine without it, same concurrency",
        },
    }
    if interop:
        result["interop"] = _interop(cfg, c1.turns, reference_drafter, k, eos, tolerance)
        log.info("%s", result["interop"]["line"])
    result["finished"] = now_iso()
    result["elapsed_s"] = round(time.time() - t_phase, 3)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "served.json", result)
    return result


def _interop(cfg: Config, turns: list[TurnResult], reference: Path | None, k: int, eos: frozenset[int],
             tolerance: float) -> dict[str, Any]:
    """Load the target (fp32 on CPU) and the reference drafter; compare (interop_check)."""
    import torch

    from ..models import resolve_model_dir
    from ..target.inprocess import load_target
    from .specdec import load_eval_drafter

    if reference is None:
        raise InputError("interop check: no drafter to run in specops' loop (no training checkpoint, "
                         "no eval.drafter): set eval.drafter or eval.interop = false")
    target = load_target(resolve_model_dir(cfg.target.model), "float32", "cpu",
                         trust_remote_code=cfg.target.trust_remote_code)
    drafter = load_eval_drafter(reference, target, torch.device("cpu"))
    out = interop_check(turns, target=target, drafter=drafter, k=k, max_new_tokens=cfg.eval.max_new_tokens,
                        eos=eos, tolerance=tolerance)
    out["reference_drafter"] = str(reference)
    return out


class _GenerationConfigOnly:
    """The eos ids _eos_ids reads from a model, without loading its weights: generation_config.json
    and config.json of the model directory."""

    def __init__(self, model_dir: Path):
        import json
        from types import SimpleNamespace

        def read(name: str) -> dict[str, Any]:
            p = Path(model_dir) / name
            return json.loads(p.read_text()) if p.is_file() else {}

        self.generation_config = SimpleNamespace(eos_token_id=read("generation_config.json").get("eos_token_id"))
        self.config = SimpleNamespace(eos_token_id=read("config.json").get("eos_token_id"))


def run_interruptible_pass(ep: Endpoint, convs: list[Conversation], prompts: PromptBuilder, **kw: Any) -> PassResult:
    from ..checks.server import run_interruptible

    try:
        return run_interruptible(run_pass(ep, convs, prompts, **kw))
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise ServedEvalError(f"served eval against {ep.url}: {type(e).__name__}: {e}") from e
