"""The EAGLE-3 drafting rule in the eval loop: a chain of k drafter steps after the pending slots,
on a growing K/V (the reference) or a preallocated one whose greedy chain replays as one CUDA graph.

Two drafter runners share one interface (`families.base.DrafterRunner`), used by
`evaluate/loop.py` `speculative_generate`:

    reset(max_len)          an empty cache sized for max_len positions
    prefill(ids, aux)       the prompt ids [1, n] (x_0..x_{n-1}) and its target states aux [1, n, 3, H_t]:
                            drafter slots t = 0..n-2 (token x_{t+1}, hidden fc(aux_t), position t)
    draft(tokens, aux, start, k, temperature, gen)
                            the pending slots (tokens [1, m], aux [1, m, 3, H_t]) at start..start+m-1,
                            then k drafts: -> (target ids int64 [k], q [k, Vd] float32 or None);
                            afterwards the cache holds positions 0..start+m-1
    len(runner)             positions held

`draft` is the chain (evaluate/loop.py's module docstring has the bookkeeping): one drafter call
over the m pending slots, whose last output predicts d_1; draft j >= 2 feeds d_{j-1} with the
previous call's pre-norm output at the next position (training's step j-1). The positions made
from the drafter's own hidden states are dropped afterwards and recomputed next round from the
target's (as vLLM's eagle proposer reruns the drafter over the accepted tokens).

`EagerDrafterRunner` (eval.drafter_runner = "eager") is the reference: the drafter's own forward
with a growing K/V (`DrafterCache`). `StaticDrafterRunner` ("static") keeps K/V in one buffer
[rows, kv_heads, capacity, head_dim] (rows = 1; evaluate/batched.py: a sequence per row, through
`prefill_row` and `draft_rows`), capacity a power of two (grown, prefix copied). Every call attends over keys 0..bucket-1 (bucket:
the next power of two >= the last position + 1, from 256) with keys past each query's position
masked, so the shapes depend on (m, bucket) only. Draft
positions past start+m-1 are written into the buffer and left there: every later call writes a
position before any query reads it.

CUDA graphs (CUDA, temperature 0, eval.cuda_graphs = false turns them off): the whole chain -- the
m pending slots, k argmax drafts and the k-1 one-token steps between them -- is captured once per
(m, bucket, k) and replayed: one launch per target step instead of ~k x (layer kernels + host
work), ~1.5 ms per draft token eagerly on an H200 (c = 0.39 of a target step at SmolLM2 scale). A graph's first replay is checked against the same chain run eagerly on the
static cache; a capture that raises or a replay that differs turns graphs off for the runner with
a warning, and the chain runs eagerly. At temperature > 0 (sampling with a torch.Generator) the
chain always runs eagerly on the static cache.

"auto": static on CUDA, eager elsewhere. The math is the drafter's own (drafter/model.py: its
norms, projections, RoPE, MLP, lm_head and d2t), so the static and eager runners agree to rounding.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from ....errors import ConfigError, SpecopsError
from ....target.fastpath import pow2_at_least
from ...model import _MASKED_BACKENDS, Eagle3Drafter, _rotate_half
from ..base import sample_token

log = logging.getLogger("specops.eval")

__all__ = ["DRAFTER_RUNNERS", "DrafterCache", "draft", "EagerDrafterRunner", "StaticDrafterRunner",
           "make_drafter_runner"]

DRAFTER_RUNNERS = ("auto", "eager", "static")
MIN_BUCKET = 256


class DrafterCache:
    """The drafter's KV: k, v [1, nkv, S, head_dim] for positions 0..S-1 (k after RoPE)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def past(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [] if self.k is None else [(self.k, self.v)]

    def append(self, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        k, v = kv
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)

    def crop(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


@torch.no_grad()
def draft(drafter: Eagle3Drafter, dcache: DrafterCache, tokens: torch.Tensor, aux: torch.Tensor, start: int,
          k: int, *, temperature: float, gen: torch.Generator | None
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chain of k drafts. tokens [1, m] (x_{t+1}), aux [1, m, 3, H_t] (aux_t) for t = start..start+m-1;
    `dcache` holds positions 0..start-1 and is left holding 0..start+m-1.

    Returns drafts as target ids, int64 [k], and at temperature > 0 the drafter's distributions
    q over the draft vocab, float32 [k, Vd] (d_j was sampled from q[j-1])."""
    m = tokens.shape[1]
    dev = drafter.d2t.device
    positions = torch.arange(start, start + m, device=dev)[None]
    out = drafter(tokens.to(dev), drafter.fuse(aux.to(dev)), positions, past_kv=dcache.past(), return_logits=False)
    dcache.append(out.kv)
    hidden = out.hidden[:, -1:]  # [1, 1, H] pre-norm: the next draft's hidden input
    logits = drafter.compute_logits(hidden[0, -1]).float()  # [Vd]
    pos = start + m - 1
    drafts, qs = [], []
    for j in range(k):
        if temperature > 0:
            q = torch.softmax(logits / temperature, dim=-1)
            d = sample_token(q, gen)
            qs.append(q)
        else:
            d = logits.argmax(-1)
        d = drafter.draft_to_target(d)  # target id = i + d2t[i]
        drafts.append(d)
        if j == k - 1:
            break
        pos += 1
        out = drafter(d.view(1, 1), hidden, torch.tensor([[pos]], device=dev), past_kv=dcache.past())
        dcache.append(out.kv)
        hidden = out.hidden
        logits = out.logits[0, -1].float()
    dcache.crop(start + m)  # keep only what the target's states produced
    return torch.stack(drafts), (torch.stack(qs) if qs else None)


class EagerDrafterRunner:
    """The drafter's own forward on a growing K/V (the reference runner; `draft`)."""

    name = "eager"
    use_graphs = False

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self._new = DrafterCache
        self.cache = DrafterCache()

    def __len__(self) -> int:
        return len(self.cache)

    def reset(self, max_len: int) -> None:
        self.cache = self._new()

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, aux: torch.Tensor) -> None:
        n = ids.shape[1] - 1  # slots 0..n-1: token x_{t+1}, the target's state at t
        if n < 1:
            return
        dev = self.drafter.d2t.device
        fused = self.drafter.fuse(aux[:, :n].to(dev))
        out = self.drafter(ids[:, 1:].to(dev), fused, torch.arange(n, device=dev)[None], return_logits=False)
        self.cache.append(out.kv)

    def draft(self, tokens: torch.Tensor, aux: torch.Tensor, start: int, k: int, *, temperature: float,
              gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return draft(self.drafter, self.cache, tokens, aux, start, k, temperature=temperature, gen=gen)




class StaticDrafterRunner:
    """The drafter on a preallocated K/V, the greedy chain as one CUDA graph (module docstring)."""

    name = "static"

    def __init__(self, drafter: Eagle3Drafter, *, cuda_graphs: bool = True, min_capacity: int = 512,
                 rows: int = 1):
        self.drafter = d = drafter
        cfg = d.config
        self.device = d.d2t.device
        self.dtype = next(d.parameters()).dtype
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rep = self.nh // self.nkv
        self.min_capacity = int(min_capacity)
        self.rows = int(rows)  # sequences the cache holds (evaluate/batched.py: > 1, no graphs)
        self.row_ids = torch.arange(self.rows, device=self.device)
        self.capacity = 0
        self.length = 0
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.use_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.graph_fallbacks = 0
        self._graphs: dict[tuple[int, int, int], tuple[Any, torch.Tensor]] = {}
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._pool = None

    def __len__(self) -> int:
        return self.length

    # ------------------------------------------------------------------ the cache
    def _ensure_capacity(self, needed: int, keep: int | None = None) -> None:
        """At least `needed` positions per row; the first `keep` (default: the held length) are
        copied into a grown buffer."""
        if needed <= self.capacity:
            return
        cap = pow2_at_least(needed, max(self.min_capacity, self.capacity, 1))
        keep = self.length if keep is None else keep
        with torch.inference_mode(False), torch.no_grad():
            k = torch.zeros(self.rows, self.nkv, cap, self.hd, device=self.device, dtype=self.dtype)
            v = torch.zeros_like(k)
            if keep:
                k[:, :, :keep].copy_(self.k_cache[:, :, :keep])
                v[:, :, :keep].copy_(self.v_cache[:, :, :keep])
            self.arange = torch.arange(cap, device=self.device)
        self.k_cache, self.v_cache, self.capacity = k, v, cap
        self._graphs.clear()  # captured against the old buffers; their pool goes with them
        self._pool = None

    def reset(self, max_len: int) -> None:
        self.length = 0
        self._ensure_capacity(max(int(max_len), 1))

    def _bucket(self, needed: int) -> int:
        return min(pow2_at_least(needed, MIN_BUCKET), self.capacity)

    # ------------------------------------------------------------------ the math
    def _layer(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, kv_len: int,
               rows: slice | None = None) -> torch.Tensor:
        """One drafter step for ids [B, T] / hidden [B, T, H] at positions pos [B, T] (row b at its own
        positions; B = every row of the cache, or those `rows` selects): K/V written at pos, attention
        over keys 0..kv_len-1 (each query sees keys <= its position) -> pre-norm h [B, T, H].
        Graph-capturable: shapes depend on (B, T, kv_len) only, no host syncs."""
        d = self.drafter
        ml, at = d.midlayer, d.midlayer.self_attn
        B, T = ids.shape
        cos, sin = d.rope(pos)  # [B, T, hd] fp32
        e = ml.input_layernorm(d.embed_tokens(ids))
        g = ml.hidden_norm(hidden)
        residual = g if ml.norm_before_residual else hidden
        x = torch.cat([e.to(g.dtype), g], dim=-1)
        q = at.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = at.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = at.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        cos, sin = cos.to(q.dtype)[:, None], sin.to(q.dtype)[:, None]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        kc = self.k_cache if rows is None else self.k_cache[rows]  # [B, KV, M, hd]
        vc = self.v_cache if rows is None else self.v_cache[rows]
        if B == 1:  # the batch-1 runner (CUDA graphs): an index_copy_ along the positions
            kc[0].index_copy_(1, pos[0], k[0])
            vc[0].index_copy_(1, pos[0], v[0])
        else:
            bi = self.row_ids[:B, None].expand(B, T)
            kc[bi, :, pos] = k.transpose(1, 2)  # [B, T, KV, hd] at (row, position)
            vc[bi, :, pos] = v.transpose(1, 2)
        keys, vals = kc[:, :, :kv_len], vc[:, :, :kv_len]
        if self.rep > 1:
            keys = keys.repeat_interleave(self.rep, dim=1)
            vals = vals.repeat_interleave(self.rep, dim=1)
        mask = (self.arange[:kv_len][None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, kv_len]
        if q.is_cuda:
            with sdpa_kernel(_MASKED_BACKENDS):
                o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        else:
            o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        h = residual + at.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))
        return h + ml.mlp(ml.post_attention_layernorm(h))

    def _chain(self, tok: torch.Tensor, aux: torch.Tensor, pos0: torch.Tensor, k: int, kv_len: int,
               temperature: float = 0.0, gen: torch.Generator | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pending tok [1, m] / aux [1, m, 3, H_t] at pos0 + 0..m-1, then k drafts -> (target ids [k],
        q [k, Vd] or None). Temperature 0: argmax drafts, graph-capturable (pos0 is a 0-d device
        tensor, a graph input). Temperature > 0: each draft sampled from softmax(logits / T) with
        `gen` (eager only: the generator's state lives on the host)."""
        d = self.drafter
        m = tok.shape[1]
        pos = (pos0 + self.arange[:m])[None]  # [1, m]
        h = self._layer(tok, d.fuse(aux), pos, kv_len)[:, -1:]
        drafts, qs = [], []
        for j in range(k):
            logits = d.compute_logits(h[0, -1]).float()
            if temperature > 0:
                qs.append(torch.softmax(logits / temperature, dim=-1))
                t = d.draft_to_target(sample_token(qs[-1], gen))
            else:
                t = d.draft_to_target(logits.argmax(-1))
            drafts.append(t)
            if j == k - 1:
                break
            h = self._layer(t.view(1, 1), h, pos[:, -1:] + 1 + j, kv_len)
        return torch.stack(drafts), (torch.stack(qs) if qs else None)

    # ------------------------------------------------------------------ the verbs
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, aux: torch.Tensor) -> None:
        n = ids.shape[1] - 1  # slots 0..n-1: token x_{t+1}, the target's state at t
        if n < 1:
            return
        self._ensure_capacity(n)
        fused = self.drafter.fuse(aux[:, :n].to(self.device))
        self._layer(ids[:, 1:].to(self.device), fused, self.arange[:n][None], self._bucket(n))
        self.length = n

    @torch.no_grad()
    def draft(self, tokens: torch.Tensor, aux: torch.Tensor, start: int, k: int, *, temperature: float,
              gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if start != self.length:
            raise SpecopsError(f"static drafter cache: a draft at start {start} != the cache's length {self.length}")
        m = int(tokens.shape[1])
        self._ensure_capacity(start + m + k)
        kv_len = self._bucket(start + m + k)
        tok = tokens.to(self.device)
        aux = aux.to(self.device)
        drafts = self._graphed(tok, aux, start, k, kv_len) if self.use_graphs and temperature == 0 else None
        q = None
        if drafts is None:
            drafts, q = self._chain(tok, aux, torch.tensor(start, device=self.device), k, kv_len, temperature, gen)
        self.length = start + m
        return drafts, q

    # ------------------------------------------------------------------ rows > 1 (evaluate/batched.py)
    @torch.no_grad()
    def prefill_row(self, row: int, ids: torch.Tensor, aux: torch.Tensor) -> None:
        """`prefill` into row `row` alone (ids [1, n], aux [1, n, 3, H_t]); the other rows are untouched."""
        n = ids.shape[1] - 1
        if n >= 1:
            self._layer(ids[:, 1:], self.drafter.fuse(aux[:, :n]), self.arange[:n][None], n, rows=slice(row, row + 1))

    @torch.no_grad()
    def draft_rows(self, tokens: torch.Tensor, aux: torch.Tensor, P: torch.Tensor, m: torch.Tensor, k: int,
                   kv_len: int, *, temperature: float, gen: torch.Generator | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`draft` for every row at once: row b's pending slots are the first m[b] of tokens [B, S] /
        aux [B, S, 3, H_t] at positions P[b]-m[b].. (the other S - m[b] write K/V at positions >= P[b],
        which the chain's own steps overwrite before any query reads them); k drafts after slot
        m[b]-1, keys 0..kv_len-1 -> (target ids [B, k], q [B, k, Vd] or None)."""
        d = self.drafter
        pos = (P - m)[:, None] + self.arange[: tokens.shape[1]][None]
        h = self._layer(tokens, d.fuse(aux), pos, kv_len)[self.row_ids, m - 1]  # [B, H]
        drafts, qs = [], []
        for j in range(k):
            logits = d.compute_logits(h).float()  # [B, Vd]
            if temperature > 0:
                qs.append(torch.softmax(logits / temperature, dim=-1))
                t = sample_token(qs[-1], gen)
            else:
                t = logits.argmax(-1)
            drafts.append(d.draft_to_target(t))
            if j == k - 1:
                break
            h = self._layer(drafts[-1][:, None], h[:, None], (P + j)[:, None], kv_len)[:, 0]
        return torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None)

    # ------------------------------------------------------------------ CUDA graphs
    def _in_buffers(self, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if m not in self._inputs:
            Ht = self.drafter.config.target_hidden_size
            with torch.inference_mode(False):
                self._inputs[m] = (torch.zeros(1, m, dtype=torch.long, device=self.device),
                                   torch.zeros(1, m, 3, Ht, dtype=self.dtype, device=self.device),
                                   torch.zeros((), dtype=torch.long, device=self.device))
        return self._inputs[m]

    def _capture(self, m: int, k: int, kv_len: int) -> tuple[Any, torch.Tensor]:
        tok, aux, pos0 = self._in_buffers(m)
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            for _ in range(2):  # writes the K/V the current inputs produce anyway
                self._chain(tok, aux, pos0, k, kv_len)
        cur.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out, _ = self._chain(tok, aux, pos0, k, kv_len)
        log.info("eval: captured a CUDA graph of the drafter chain (%d pending, k=%d, kv length %d)", m, k, kv_len)
        return graph, out

    def _graphed(self, tok: torch.Tensor, aux: torch.Tensor, start: int, k: int, kv_len: int) -> torch.Tensor | None:
        m = tok.shape[1]
        key = (m, k, kv_len)
        try:
            t_in, a_in, p_in = self._in_buffers(m)
            t_in.copy_(tok)
            a_in.copy_(aux)
            p_in.fill_(start)
            entry = self._graphs.get(key)
            first = entry is None
            if first:
                entry = self._capture(m, k, kv_len)
            graph, out = entry
            graph.replay()
            drafts = out.clone()
            if first:
                ref, _ = self._chain(t_in, a_in, p_in, k, kv_len)
                if not torch.equal(ref, drafts):
                    raise SpecopsError("the replayed drafter graph's drafts differ from the eager chain")
                self._graphs[key] = entry
            return drafts
        except Exception as e:  # noqa: BLE001 - any failure: graphs off, this chain and the rest eager
            self.use_graphs = False
            self._graphs.clear()
            self._pool = None
            self.graph_fallbacks += 1
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(self.device)
            log.warning("eval: CUDA graph capture of the drafter chain failed (%d pending, k=%d, kv length %d; "
                        "%s: %s); the drafter runs eagerly on its static cache from now on",
                        m, k, kv_len, type(e).__name__, e)
            return None


def make_drafter_runner(drafter: Eagle3Drafter, kind: str = "auto", *, cuda_graphs: bool = True
                        ) -> EagerDrafterRunner | StaticDrafterRunner:
    """eval.drafter_runner -> a runner; "auto": static on CUDA, eager elsewhere."""
    if kind not in DRAFTER_RUNNERS:
        raise ConfigError(f"eval.drafter_runner: expected one of {', '.join(map(repr, DRAFTER_RUNNERS))}, got {kind!r}")
    if kind == "static" or (kind == "auto" and drafter.d2t.device.type == "cuda"):
        return StaticDrafterRunner(drafter, cuda_graphs=cuda_graphs)
    return EagerDrafterRunner(drafter)
