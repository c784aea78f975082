"""The speculative-decoding loop at batch 1: HF target + EAGLE-3 drafter -> tokens and acceptance.

Verbs, gpt-fast style: `prefill`, `draft`, `verify`, `accept`, `speculative_generate` (the loop),
`target_generate` (the no-speculation baseline on the same cache machinery), and their results.
`draft` is the drafter family's runner (`drafter/families/base.py` DrafterRunner; EAGLE-3's, the
chain below, is `drafter/families/eagle3/drafting.py`).

Bookkeeping (x_0..x_{n-1} the prompt; aux_t [3, H_t] the target's inputs to layers aux_layer_ids
at position t; P = tokens in the target's KV cache; `last` = x_P, verified but not yet cached):

    prefill     target([x_0..x_{n-1}]) at 0..n-1 -> cache 0..n-1, aux_0..aux_{n-1}, x_n (P = n)
                drafter slots t = 0..n-2 (token x_{t+1}, hidden fc(aux_t), position t) -> drafter
                cache 0..n-2; pending = (aux_{n-1}, x_n): m = 1 slot
    round       the drafter cache holds 0..P-m-1; pending = aux [1, m, 3, H_t] for positions
                P-m..P-1 and tokens [1, m] = x_{P-m+1}..x_P (each slot: the target's state AT t and
                the token AFTER t, training's step-0 alignment)
      draft     catch-up: one drafter call over the m pending slots (positions P-m..P-1) -> its
                cache holds 0..P-1, all from target states; the last slot's output predicts d_1.
                Draft j >= 2: token d_{j-1}, hidden = the previous call's pre-norm output [1, 1, H],
                position P+j-2 (training's step j-1) -> d_j. Then the drafter cache is cut back to
                P: the entries made from its own hidden states are recomputed next round from the
                target's (as vLLM's eagle proposer reruns the drafter over the accepted tokens).
      verify    target([x_P, d_1..d_k]) at P..P+k -> logits [k+1, V], aux [k+1, 3, H_t]
      accept    a drafts accepted (0..k), then one token b from the target: the step emits a + 1
      rollback  target cache cut to P+a+1 (x_P, d_1..d_a); pending = (aux[:a+1] for positions
                P..P+a, tokens d_1..d_a, b); P += a + 1; last = b

tau = mean over target steps of (a + 1). Acceptance per position i (1..k) is conditional:
P(draft i accepted | drafts 1..i-1 accepted), so tau = 1 + sum_k prod_{i<=k} acc_i, the quantity
training simulates (measures.simulated_tau). Stats come from the verifications themselves; the emitted
text is cut at the first eos and at max_new_tokens.

Times: a target step is one verification forward (k+1 tokens); a drafter step is the drafter's
time in that round divided by k (per draft token: the catch-up call plus k-1 one-token calls). The
cost ratio c = drafter step / target step gives the ideal speedup tau / (1 + k·c); the measured
speedup is tokens/s against `target_generate` on the same prompts (wall clock, prefill included).
On CUDA every timed section ends with a synchronize (a CPU-GPU sync point, as intended). The
target runner (eval.target_runner) is the same for the loop and the baseline: `TargetRunner` (HF
forward, DynamicCache) or fast_target.StaticTargetRunner (preallocated KV cache; on CUDA the decode
and verify steps replay CUDA graphs), the default on CUDA for supported decoders.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from ..drafter.families import family_of
from ..drafter.families.base import sample_token
from ..errors import InputError, SpecopsError


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- target with a KV cache


class TargetRunner:
    """The HF target with a DynamicCache; aux states captured by forward pre-hooks on the layers
    (input to layer i = HF hidden_states index i; i = L is the final norm's input)."""

    def __init__(self, target: Any, aux_layer_ids: Sequence[int]):
        self.target = target  # target.inprocess.TargetModel
        self.model = target.model
        # transformers renamed forward's `past_key_values` to `cache` (5.2x); an unknown keyword is
        # swallowed by **kwargs, which would run every step without a cache: ask the signature.
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.device = torch.device(target.device)
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        L = target.num_hidden_layers
        for i in self.aux_layer_ids:
            if not 0 <= i <= L:
                raise InputError(f"aux layer id {i} out of range 0..{L} (input-to-layer ids)")

    def new_cache(self, max_len: int | None = None) -> Any:
        # max_len (a sizing hint for preallocated caches) is not needed here. No config: every layer is a full, croppable DynamicLayer (sliding-window models keep their
        # window through the attention mask, at the memory cost of the full history).
        from transformers import DynamicCache

        return DynamicCache()

    @staticmethod
    def crop(cache: Any, length: int) -> None:
        """Keep the first `length` positions. transformers 5: crop(-n) removes the last n."""
        extra = cache.get_seq_length() - length
        assert extra >= 0, f"crop to {length} of a cache holding {length + extra}"
        if extra:
            if not getattr(cache, "is_croppable", True):
                raise SpecopsError("the target's KV cache cannot be rolled back (sliding-window or linear "
                                   "attention layers); speculative decoding needs a croppable cache")
            cache.crop(-extra)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: Any, start: int, *, aux: bool, last_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [1, T] at positions start..start+T-1, appended to `cache` ->
        (logits float32 [T, V] (or [1, V] with last_only), aux [T, 3, H_t] in the model dtype or None)."""
        T = ids.shape[1]
        buf = None
        handles = []
        if aux:
            buf = torch.empty(T, len(self.aux_layer_ids), self.target.hidden_size, dtype=self.target.dtype,
                              device=self.device)
            L = self.target.num_hidden_layers
            for j, i in enumerate(self.aux_layer_ids):
                module = self.target.norm if i == L else self.target.layers[i]

                def hook(mod, args, kwargs, j=j):
                    h = args[0] if args else kwargs["hidden_states"]
                    buf[:, j].copy_(h[0])  # copy at once: the layer may reuse its input

                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        try:
            pos = torch.arange(start, start + T, device=self.device)[None]
            out = self.model(input_ids=ids.to(self.device), position_ids=pos, **{self.cache_kw: cache}, use_cache=True,
                             logits_to_keep=1 if last_only else 0)
        finally:
            for h in handles:
                h.remove()
        return out.logits[0].float(), buf


# ---------------------------------------------------------------- the verbs


def prefill(runner: TargetRunner, prompt: torch.Tensor, cache: Any, *, aux: bool
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """prompt [1, n] -> (logits float32 [V] after x_{n-1}, aux [n, 3, H_t] or None)."""
    logits, states = runner.forward(prompt, cache, 0, aux=aux, last_only=True)
    return logits[-1], states


def verify(runner: TargetRunner, cache: Any, last: torch.Tensor, drafts: torch.Tensor, start: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over [last, d_1..d_k] at positions start..start+k ->
    (logits float32 [k+1, V]: row i is the distribution after d_i (row 0: after last), aux [k+1, 3, H_t])."""
    ids = torch.cat([last.view(1), drafts.to(last.device)]).view(1, -1)
    logits, states = runner.forward(ids, cache, start, aux=True)
    return logits, states


def accept(drafts: torch.Tensor, target_logits: torch.Tensor, q_draft: torch.Tensor | None,
           d2t: torch.Tensor | None, *, temperature: float, gen: torch.Generator | None
           ) -> tuple[int, torch.Tensor]:
    """-> (a = drafts accepted, 0..k; the token the target adds after them).

    drafts int64 [k] (target ids d_1..d_k); target_logits [k+1, V], row j the target's next-token
    logits after [last, d_1..d_j]; q_draft [k, Vd] (row j: the drafter's distribution d_{j+1} was
    sampled from) and d2t [Vd], at T > 0 only; q_draft None at T > 0: the drafts were taken
    greedily (argmax of the drafter), q is one-hot at each draft. Draft d_{j+1} is judged against
    row j.

    T = 0 (greedy): accept the longest prefix with d_{j+1} == argmax row j; then the argmax of
    row a (the correction at the first mismatch, or the bonus token when all k match). The output
    is exactly the target's greedy decoding.

    T > 0 (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023): p_j = softmax(row j / T),
    q_j = the drafter's row j mapped into the target vocab (0 outside the draft vocab). Accept
    d_{j+1} with probability min(1, p_j(d) / q_j(d)); at the first rejection (row a) sample from the
    residual r = max(0, p_a - q_a) / sum(max(0, p_a - q_a)) and stop; if all k are accepted, sample
    the bonus token from p_k. Each emitted token is then distributed exactly as p:
        P(x) = q(x)·min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y)))·r(x)
             = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x)
    (the rejection mass 1 - sum min(p, q) equals sum max(0, p - q), r's normaliser).
    With greedy drafts (q one-hot at d) the same rule reads: accept d with probability p_j(d), and
    at a rejection sample from p_a with d_{a+1} removed. This is vLLM v1's rejection sampler with
    draft_probs None (its default draft_sample_method "greedy", the EAGLE proposers' argmax drafts):
    the output is still distributed as p, but the acceptance differs from sampled drafts'
    (E[accept] = p(argmax q) against sum_x min(p(x), q(x))).
    """
    k = drafts.numel()
    drafts = drafts.to(target_logits.device)
    if temperature <= 0:
        best = target_logits.argmax(-1)  # [k+1]
        a = int((drafts == best[:k]).long().cumprod(0).sum())  # sync point
        return a, best[a]
    p = torch.softmax(target_logits / temperature, dim=-1)  # [k+1, V]
    rows = torch.arange(k, device=p.device)
    if q_draft is None:  # greedy drafts: q one-hot, min(1, p/q) = p(d), residual = p without d
        u = torch.rand(k, generator=gen, device=gen.device if gen is not None else p.device).to(p.device)
        a = int((u < p[rows, drafts]).long().cumprod(0).sum())  # sync point
        if a == k:
            return k, sample_token(p[k], gen)
        residual = p[a].clone()
        residual[drafts[a]] = 0
        if float(residual.sum()) <= 0:  # p is one-hot at the draft: the rejection had probability 0
            residual = p[a]
        return a, sample_token(residual / residual.sum(), gen)
    assert d2t is not None
    V = p.shape[-1]
    q = torch.zeros(k, V, dtype=p.dtype, device=p.device)  # q in the target vocab: 0 outside the draft vocab
    ids = (torch.arange(d2t.numel(), device=d2t.device) + d2t).to(p.device)
    q[:, ids] = q_draft.to(p.device, p.dtype)
    p_d, q_d = p[rows, drafts], q[rows, drafts]  # q_d > 0: d was sampled from q
    u = torch.rand(k, generator=gen, device=gen.device if gen is not None else p.device).to(p.device)
    ok = u < p_d / q_d  # u ~ U[0, 1): P(ok) = min(1, p/q)
    a = int(ok.long().cumprod(0).sum())  # sync point
    if a == k:
        return k, sample_token(p[k], gen)
    residual = (p[a] - q[a]).clamp_min(0)
    if float(residual.sum()) <= 0:  # p == q up to rounding: the rejection had probability ~0
        residual = p[a]
    return a, sample_token(residual / residual.sum(), gen)


# ---------------------------------------------------------------- the loop


@dataclass
class SpecResult:
    prompt_tokens: int
    k: int
    tokens: list[int]  # generated ids, at most max_new_tokens, the eos included when hit
    finish_reason: str  # "stop" (an eos id) or "length"
    accepted: list[int] = field(default_factory=list)  # per target step: drafts accepted, 0..k
    target_step_s: list[float] = field(default_factory=list)  # per verification forward (k+1 tokens)
    drafter_step_s: list[float] = field(default_factory=list)  # per target step: drafter time / k
    prefill_s: float = 0.0  # target prefill
    drafter_prefill_s: float = 0.0  # drafter over the prompt's target states
    wall_s: float = 0.0

    @property
    def target_steps(self) -> int:
        return len(self.accepted)

    def position_counts(self) -> tuple[list[int], list[int]]:
        """(reached[i], accepted[i]) for draft position i+1: steps whose drafts 1..i were accepted,
        and steps whose draft i+1 was accepted too."""
        reached = [sum(1 for a in self.accepted if a >= i) for i in range(self.k)]
        ok = [sum(1 for a in self.accepted if a > i) for i in range(self.k)]
        return reached, ok

    def to_json(self) -> dict[str, Any]:
        reached, ok = self.position_counts()
        steps = max(self.target_steps, 1)
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": len(self.tokens), "tokens": self.tokens,
            "finish_reason": self.finish_reason, "k": self.k, "target_steps": self.target_steps,
            "tau": sum(a + 1 for a in self.accepted) / steps if self.accepted else None,
            "accepted": self.accepted, "position_reached": reached, "position_accepted": ok,
            "target_step_s": [round(x, 6) for x in self.target_step_s],
            "drafter_step_s": [round(x, 6) for x in self.drafter_step_s],
            "prefill_s": round(self.prefill_s, 6), "drafter_prefill_s": round(self.drafter_prefill_s, 6),
            "wall_s": round(self.wall_s, 6),
            "tokens_per_s": len(self.tokens) / self.wall_s if self.wall_s > 0 else None,
        }


@dataclass
class BaselineResult:
    prompt_tokens: int
    tokens: list[int]
    finish_reason: str
    step_s: list[float] = field(default_factory=list)  # per one-token decode forward
    prefill_s: float = 0.0
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": len(self.tokens), "tokens": self.tokens,
            "finish_reason": self.finish_reason, "step_s": [round(x, 6) for x in self.step_s],
            "prefill_s": round(self.prefill_s, 6), "wall_s": round(self.wall_s, 6),
            "tokens_per_s": len(self.tokens) / self.wall_s if self.wall_s > 0 else None,
        }


def finish_tokens(tokens: list[int], max_new_tokens: int, eos_ids: frozenset[int]) -> tuple[list[int], str]:
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos_ids:
            return tokens[: i + 1], "stop"
    return tokens[:max_new_tokens], "length"


def _pick(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    return sample_token(torch.softmax(logits / temperature, dim=-1), gen)


@torch.no_grad()
def speculative_generate(runner: TargetRunner, drafter: nn.Module, prompt: Sequence[int] | torch.Tensor, *,
                         k: int, max_new_tokens: int, temperature: float = 0.0,
                         eos_ids: Iterable[int] = (), gen: torch.Generator | None = None,
                         drafter_runner: Any = None, draft_sample: str = "sample") -> SpecResult:
    """Generate up to max_new_tokens after `prompt` (ids, chat template already applied).
    drafter_runner: the drafting rule of `drafter`'s family (families.base.DrafterRunner; default:
    its eager runner). draft_sample (T > 0 only): "sample" draws each draft from the drafter's
    distribution and accepts min(1, p/q); "greedy" takes the drafter's argmax and accepts with p(d),
    as vLLM does by default (`accept`)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if draft_sample not in ("sample", "greedy"):
        raise ValueError(f"draft_sample must be 'sample' or 'greedy', got {draft_sample!r}")
    draft_t = 0.0 if draft_sample == "greedy" else temperature  # 0: argmax drafts, no q
    dev = runner.device
    eos = frozenset(int(e) for e in eos_ids)
    ids = torch.as_tensor(list(prompt) if not torch.is_tensor(prompt) else prompt, dtype=torch.long).view(1, -1).to(dev)
    n = ids.shape[1]
    if n < 1:
        raise ValueError("empty prompt")
    res = SpecResult(prompt_tokens=n, k=k, tokens=[], finish_reason="length")
    _sync(dev)
    t_start = time.perf_counter()
    cache = runner.new_cache(n + max_new_tokens + k + 1)
    logits, aux = prefill(runner, ids, cache, aux=True)  # aux [n, 3, H_t]
    last = _pick(logits, temperature, gen)  # x_n
    _sync(dev)
    t1 = time.perf_counter()
    res.prefill_s = t1 - t_start
    # Drafter prefill: the prompt and its target states (EAGLE-3: slots 0..n-2, token x_{t+1},
    # hidden fc(aux_t), position t); slot n-1 is the first round's pending slot, whose token x_n
    # the target just produced.
    if drafter_runner is None:
        drafter_runner = family_of(drafter).drafter_runner(drafter, "eager")
    dr = drafter_runner
    dr.reset(n + max_new_tokens + k + 1)
    dr.prefill(ids, aux[None])
    _sync(dev)
    res.drafter_prefill_s = time.perf_counter() - t1
    generated = [int(last)]
    P = n  # tokens in the target cache; `last` = x_P sits at position P
    pend_tok = last.view(1, 1)  # [1, m]: x_{P-m+1}..x_P
    pend_aux = aux[None, n - 1:]  # [1, m, 3, H_t]: aux at positions P-m..P-1
    while len(generated) < max_new_tokens and not eos.intersection(generated[-(k + 1):]):
        m = pend_tok.shape[1]
        assert len(dr) == P - m and cache.get_seq_length() == P, (len(dr), P, m)
        t0 = time.perf_counter()
        drafts, q = dr.draft(pend_tok, pend_aux, P - m, k, temperature=draft_t, gen=gen)
        _sync(dev)
        t1 = time.perf_counter()
        logits, vaux = verify(runner, cache, last, drafts, P)  # [k+1, V], [k+1, 3, H_t]
        _sync(dev)
        t2 = time.perf_counter()
        a, nxt = accept(drafts, logits, q, drafter.d2t, temperature=temperature, gen=gen)
        # Roll back: the target keeps x_P, d_1..d_a (positions P..P+a); the drafter already holds 0..P-1.
        runner.crop(cache, P + a + 1)
        new = torch.cat([drafts[:a].to(dev), nxt.view(1).to(dev)])  # d_1..d_a, b = x_{P+1}..x_{P+a+1}
        pend_tok, pend_aux = new.view(1, -1), vaux[None, : a + 1]
        last = nxt.view(())
        P += a + 1
        generated.extend(new.tolist())
        res.accepted.append(a)
        res.drafter_step_s.append((t1 - t0) / k)
        res.target_step_s.append(t2 - t1)
    _sync(dev)
    res.wall_s = time.perf_counter() - t_start
    res.tokens, res.finish_reason = finish_tokens(generated, max_new_tokens, eos)
    return res


@torch.no_grad()
def target_generate(runner: TargetRunner, prompt: Sequence[int] | torch.Tensor, *, max_new_tokens: int,
                    temperature: float = 0.0, eos_ids: Iterable[int] = (),
                    gen: torch.Generator | None = None) -> BaselineResult:
    """The baseline: prefill, then one target forward per token on the same cache machinery."""
    dev = runner.device
    eos = frozenset(int(e) for e in eos_ids)
    ids = torch.as_tensor(list(prompt) if not torch.is_tensor(prompt) else prompt, dtype=torch.long).view(1, -1).to(dev)
    n = ids.shape[1]
    res = BaselineResult(prompt_tokens=n, tokens=[], finish_reason="length")
    _sync(dev)
    t_start = time.perf_counter()
    cache = runner.new_cache(n + max_new_tokens + 1)
    logits, _ = prefill(runner, ids, cache, aux=False)
    tok = _pick(logits, temperature, gen)
    generated = [int(tok)]
    _sync(dev)
    res.prefill_s = time.perf_counter() - t_start
    pos = n
    while len(generated) < max_new_tokens and generated[-1] not in eos:
        t0 = time.perf_counter()
        logits, _ = runner.forward(tok.view(1, 1), cache, pos, aux=False)
        tok = _pick(logits[-1], temperature, gen)
        generated.append(int(tok))  # sync point
        res.step_s.append(time.perf_counter() - t0)
        pos += 1
    _sync(dev)
    res.wall_s = time.perf_counter() - t_start
    res.tokens, res.finish_reason = finish_tokens(generated, max_new_tokens, eos)
    return res
