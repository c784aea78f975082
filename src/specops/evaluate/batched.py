"""Batched tau evaluation: many conversations through one speculative loop (eval.batch_size = B > 1).

The batch-1 loop (loop.speculative_generate) is what a deployment runs, and its wall clock is
the speedup. Acceptance does not need it: a small target at batch 1 leaves the device idle between
kernel launches, so a full evaluation (MT-bench 80 x 2 turns, HumanEval, GSM8K, Spec-Bench 480,
~1,000 turns) took ~1 s per turn with 8 processes sharing an H200. Here B rows advance together:

    rows        the target's static cache (fast_target.StaticTargetRunner, rows = B) and the
                drafter family's static runner (rows = B), one sequence per row, each
                at its own length P_b. A row holds one conversation turn; when it ends (eos or
                max_new_tokens) the row takes the conversation's next turn (with its own answer
                in the history, as the batch-1 loop) or the next conversation (continuous batching).
    admit       target prefill of the prompt on that row alone, the first token picked, the
                drafter's prefill over the prompt's target states (slots 0..n-2); pending = 1 slot.
    step        every row at once, the same bookkeeping as specdec's module docstring, per row:
      draft     one drafter call over k+1 pending slots per row (row b's first m_b are real; the
                rest write K/V at positions >= P_b, which no real query reads before the chain's
                own steps overwrite them), the hidden of slot m_b - 1 starts the chain; k drafts.
      verify    target over [x_P, d_1..d_k] at P_b..P_b+k per row (each row's keys masked past
                each query's own position), logits [B, k+1, V] and aux [B, k+1, n_aux, H_t].
      accept    per row, as loop.accept (greedy prefix at T = 0; speculative sampling at T > 0):
                accept_rows. The accepted tokens and their aux become the row's pending slots.
    idle rows   (no conversation left) run along at positions 1..k+1 on their own garbage; nothing
                reads it, and admit overwrites the row.

At T = 0 each row's tokens and acceptance are the batch-1 loop's up to the rounding of batched
kernels (tests: equal on CPU in fp32). At T > 0 one generator, seeded from eval.seed, drives the
whole batch, so the samples depend on the batch size and the conversations' order (not on timing);
the emitted tokens are distributed as the target's (tests). Wall-clock fields (step times, tokens/s,
speedup) are not measured: `speedup_unavailable` says so; the summary's `batched` entry gives the
loop's aggregate throughput. Eager only (no CUDA graphs): the batch fills the device.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ..drafter.families import family_of
from ..errors import ConfigError
from .fast_target import StaticTargetRunner, static_runner_problem

log = logging.getLogger("specops.eval")

__all__ = ["BATCHED_NA", "accept_rows", "BatchedLoop", "run_batched"]

BATCHED_NA = "eval.batch_size > 1: conversations share batched forwards (tau and acceptance only)"


@torch.no_grad()
def accept_rows(drafts: torch.Tensor, logits: torch.Tensor, q_draft: torch.Tensor | None, d2t: torch.Tensor | None,
                *, temperature: float, gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """loop.accept for B rows at once -> (a [B] drafts accepted per row, next token [B]).

    drafts [B, k] target ids; logits [B, k+1, V] (row j: the target after [last, d_1..d_j]);
    q_draft [B, k, Vd] the drafter's distributions the drafts were sampled from (T > 0 only).
    T = 0: the longest prefix equal to the target's argmax, then the argmax after it. T > 0:
    accept d_{j+1} with probability min(1, p_j(d) / q_j(d)); at the first rejection sample the
    residual max(0, p_a - q_a) (normalised), after k acceptances the bonus token from p_k."""
    B, k = drafts.shape
    if temperature <= 0:
        best = logits.argmax(-1)  # [B, k+1]
        a = (drafts == best[:, :k]).long().cumprod(1).sum(1)
        return a, best.gather(1, a[:, None])[:, 0]
    assert q_draft is not None and d2t is not None
    p = torch.softmax(logits.float() / temperature, dim=-1)  # [B, k+1, V]
    V = p.shape[-1]
    q = torch.zeros_like(p)  # the drafter's q in the target vocab; row k stays 0 (the bonus row)
    ids = (torch.arange(d2t.numel(), device=d2t.device) + d2t).to(p.device)
    q[:, :k, ids] = q_draft.to(p)
    p_d = p[:, :k].gather(2, drafts[..., None])[..., 0]
    q_d = q[:, :k].gather(2, drafts[..., None])[..., 0]  # > 0: each draft was sampled from q
    u = torch.rand(B, k, generator=gen, device=p.device)
    a = (u < p_d / q_d).long().cumprod(1).sum(1)
    at = a[:, None, None].expand(B, 1, V)
    pa, qa = p.gather(1, at)[:, 0], q.gather(1, at)[:, 0]  # qa = 0 where a = k: the residual is p_k
    r = (pa - qa).clamp_min(0)
    r = torch.where(r.sum(-1, keepdim=True) > 0, r, pa)  # p == q up to rounding: rejection had p ~ 0
    return a, torch.multinomial(r / r.sum(-1, keepdim=True), 1, generator=gen)[:, 0]


@dataclass
class _Turn:
    """A row's current generation."""
    owner: Any  # the caller's handle (a conversation)
    prompt_tokens: int
    generated: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)


class BatchedLoop:
    """B rows of speculative decoding on shared static caches (module docstring)."""

    def __init__(self, target: Any, drafter: Any, *, rows: int, k: int, max_new_tokens: int, temperature: float,
                 eos_ids: frozenset[int], gen: torch.Generator | None, min_capacity: int = 512):
        problem = static_runner_problem(target)
        if problem is not None:
            raise ConfigError(f"eval.batch_size > 1 needs the static target runner, which does not support this "
                              f"model: {problem}; use eval.batch_size = 1")
        self.B, self.k = int(rows), int(k)
        self.max_new, self.temperature, self.eos, self.gen = int(max_new_tokens), float(temperature), eos_ids, gen
        self.drafter = drafter
        self.tr = StaticTargetRunner(target, drafter.config.aux_layer_ids, cuda_graphs=False,
                                     min_capacity=min_capacity, rows=self.B)
        self.dr = family_of(drafter).drafter_runner(drafter, "static", cuda_graphs=False, rows=self.B,
                                                    min_capacity=min_capacity)
        self.device = self.tr.device
        self._grow(1)
        B, k, dev = self.B, self.k, self.device
        Ht = drafter.config.target_hidden_size
        n_aux = len(drafter.config.aux_layer_ids)
        self.P = [1] * B  # host copy of each row's target cache length (idle rows: 1)
        self.P_dev = torch.ones(B, dtype=torch.long, device=dev)
        self.m = torch.ones(B, dtype=torch.long, device=dev)  # pending slots per row (1..k+1)
        self.last = torch.zeros(B, dtype=torch.long, device=dev)  # x_P: verified, not yet cached
        self.pend_tok = torch.zeros(B, k + 1, dtype=torch.long, device=dev)
        self.pend_aux = torch.zeros(B, k + 1, n_aux, Ht, dtype=self.tr.dtype, device=dev)
        self.ar = torch.arange(k + 1, device=dev)
        self.turns: list[_Turn | None] = [None] * B
        self.steps = 0

    def _grow(self, needed: int) -> None:
        """Both caches hold at least `needed` positions per row; a grown buffer keeps every row."""
        keep_t, keep_d = self.tr.capacity, self.dr.capacity
        self.tr._ensure_capacity(needed, keep=keep_t)
        self.dr._ensure_capacity(needed, keep=keep_d)

    @property
    def busy(self) -> int:
        return sum(t is not None for t in self.turns)

    def free_rows(self) -> list[int]:
        return [b for b, t in enumerate(self.turns) if t is None]

    @torch.no_grad()
    def admit(self, b: int, prompt: list[int], owner: Any) -> _Turn | None:
        """Start a generation on the free row b. Returns the finished turn when it ends at once (an eos
        or max_new_tokens = 1), else None (the row is busy)."""
        assert self.turns[b] is None, f"row {b} is busy"
        n = len(prompt)
        if n < 1:
            raise ValueError("empty prompt")
        self._grow(n + self.k + 2)
        dev, row = self.device, slice(b, b + 1)
        ids = torch.tensor([prompt], dtype=torch.long, device=dev)
        pos = self.tr.arange[:n][None]
        logits, aux = self.tr._impl(ids, pos, n, aux=True, last_only=True, causal=True, rows=row)
        if self.temperature > 0:
            first = torch.multinomial(torch.softmax(logits[0, -1].float() / self.temperature, -1), 1,
                                      generator=self.gen)[0]
        else:
            first = logits[0, -1].argmax(-1)
        self.dr.prefill_row(b, ids, aux)  # the drafter over the prompt's target states
        self.P[b] = n
        self.P_dev[b] = n
        self.m[b] = 1
        self.last[b] = first
        self.pend_tok[b, 0] = first
        self.pend_aux[b, 0] = aux[0, n - 1]
        turn = _Turn(owner, n, [int(first)])
        self.turns[b] = turn
        if self._done(turn):
            self.turns[b] = None
            return turn
        return None

    def _done(self, t: _Turn) -> bool:
        return len(t.generated) >= self.max_new or bool(self.eos.intersection(t.generated[-(self.k + 1):]))

    @torch.no_grad()
    def step(self) -> list[tuple[int, _Turn]]:
        """One draft + verify + accept over every row -> the (row, turn) pairs that ended."""
        B, k, d = self.B, self.k, self.drafter
        kv_len = max(self.P) + k + 1
        self._grow(kv_len)
        P, m = self.P_dev, self.m
        # draft: the pending slots at P-m..P-1 (k+1 per row, the first m real), then k drafts
        dr, q = self.dr.draft_rows(self.pend_tok, self.pend_aux, P, m, k, kv_len, temperature=self.temperature,
                                   gen=self.gen)  # [B, k], [B, k, Vd] or None
        # verify: [x_P, d_1..d_k] at P..P+k
        ids = torch.cat([self.last[:, None], dr], 1)
        tlogits, vaux = self.tr._impl(ids, P[:, None] + self.ar[None], kv_len, aux=True, last_only=False,
                                      causal=False)
        a, nxt = accept_rows(dr, tlogits, q, d.d2t, temperature=self.temperature, gen=self.gen)
        # the accepted drafts and the target's token become each row's pending slots
        padded = torch.cat([dr, dr[:, :1]], 1)
        self.pend_tok = torch.where(self.ar[None] < a[:, None], padded, nxt[:, None])
        self.pend_aux = vaux
        self.m = a + 1
        self.last = nxt
        self.P_dev = P + a + 1
        self.steps += 1
        host = torch.cat([a[:, None], self.pend_tok], 1).tolist()  # the step's one sync
        ended: list[tuple[int, _Turn]] = []
        for b, row in enumerate(host):
            ab = row[0]
            self.P[b] += ab + 1
            t = self.turns[b]
            if t is None:
                continue
            t.accepted.append(ab)
            t.generated.extend(row[1: ab + 2])
            if self._done(t):
                self.turns[b] = None
                ended.append((b, t))
        idle = [b for b, t in enumerate(self.turns) if t is None]
        if idle:  # parked at position 1 (admit resets a row): an idle row's length never grows
            for b in idle:
                self.P[b] = 1
            at = torch.tensor(idle, device=self.device)
            self.P_dev[at] = 1
            self.m[at] = 1
        return ended


def run_batched(loop: BatchedLoop, conversations: Iterator[Any], first_prompt: Callable[[Any], list[int] | None],
                on_turn: Callable[[Any, _Turn], list[int] | None], *, log_every_s: float = 30.0) -> dict[str, Any]:
    """Drive `loop` over `conversations` until every one is done.

    first_prompt(conv) -> the first turn's prompt ids; on_turn(conv, turn) records a finished turn and
    returns the conversation's next prompt, or None when it has no more turns. Returns the loop's
    aggregate figures."""
    t0 = time.perf_counter()
    convs = iter(conversations)
    exhausted = False
    tokens = turns = 0
    last_log = t0

    def fill(b: int, conv: Any, prompt: list[int] | None) -> None:
        nonlocal tokens, turns
        while prompt is not None:
            done = loop.admit(b, prompt, conv)
            if done is None:
                return
            tokens += len(done.generated)
            turns += 1
            prompt = on_turn(conv, done)

    while True:
        for b in loop.free_rows():
            while not exhausted and loop.turns[b] is None:
                conv = next(convs, None)
                if conv is None:
                    exhausted = True
                    break
                fill(b, conv, first_prompt(conv))
        if loop.busy == 0:
            break
        for b, t in loop.step():
            tokens += len(t.generated)
            turns += 1
            fill(b, t.owner, on_turn(t.owner, t))
        now = time.perf_counter()
        if now - last_log >= log_every_s:
            last_log = now
            log.info("eval (batched, %d rows): %d turns done, %d busy, %.0f generated tokens/s", loop.B, turns,
                     loop.busy, tokens / (now - t0))
    wall = time.perf_counter() - t0
    return {"rows": loop.B, "steps": loop.steps, "turns": turns, "generated_tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1) if wall > 0 else None}
