"""A static-cache target runner for the eval loop (batch 1), with CUDA graphs on GPU.

`StaticTargetRunner` has `loop.TargetRunner`'s interface (new_cache, crop, forward) and results,
built from the local engine's fast-path pieces (generate/local.py: the HF model's own embeddings,
norms, q/k/v/o projections, q/k norms, MLPs, lm_head and rotary table, our attention around them):

    cache       one preallocated K/V pair per runner, [layers, rows, kv_heads, capacity, head_dim] (rows = 1
                here; evaluate/batched.py holds one sequence per row), in
                the model dtype. capacity: a power of two >= max(new_cache's max_len, min_capacity),
                grown (reallocated, the valid prefix copied) when a forward needs more. A cache
                handle is its length; crop(cache, n) sets the length (rollback is free). new_cache
                reuses the memory, so a runner has one live cache: an older handle is refused.
    forward     ids [1, T] at positions start..start+T-1 (start = the cache's length): K/V written
                at those positions; query t attends to keys 0..start+t (within the window on
                sliding-window layers). T <= 32: each GQA group's query heads are folded into the
                query axis (K/V read once per kv head) under a boolean mask; longer calls (prefill)
                repeat K/V, causal SDPA when start = 0. Aux states are copied in-line: the input to
                layer i, i = L the final norm's input, as TargetRunner's hooks see them.
    CUDA graphs on CUDA (eval.cuda_graphs = false turns them off): every call with start > 0 and
                T <= 32 (the baseline's one-token decode, the k+1-token verification) replays a
                graph per (T, KV bucket, aux), the bucket the next power of two >= start+T from 256
                (keys past start+T are masked). Inputs go through static buffers; outputs are
                copied out. A graph's first replay is checked against the eager forward; a capture
                that raises or a replay that differs turns graphs off for the runner with a
                warning, and the call runs eagerly. Prefill is always eager.

Selection: eval.target_runner = "auto" (static on CUDA for a supported decoder, else hf), "hf"
(TargetRunner: eager HF forward with a DynamicCache) or "static" (refused for an unsupported
architecture; on CPU it runs without graphs). Supported: Llama, Mistral, Qwen2, Qwen3 decoders
with a RoPE table that does not depend on the sequence length (target.fastpath.fast_path_problem).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..errors import ConfigError, InputError, SpecopsError
from ..target.fastpath import _Layer, _layer_window, _rope, fast_path_problem, pow2_at_least
from .loop import TargetRunner

log = logging.getLogger("specops.eval")

__all__ = ["TARGET_RUNNERS", "StaticTargetRunner", "StaticKV", "static_runner_problem", "make_target_runner",
           "runner_info"]

TARGET_RUNNERS = ("auto", "hf", "static")
FOLD_MAX_TOKENS = 32  # up to this many query tokens: GQA heads folded into the query axis
GRAPH_MAX_TOKENS = 32  # calls at start > 0 with at most this many tokens replay CUDA graphs
MIN_BUCKET = 256  # smallest KV length a graph attends over


def static_runner_problem(target: Any) -> str | None:
    """Why `target` (a target.inprocess.TargetModel) cannot use the static runner, or None."""
    problem = fast_path_problem(target.model, 0)
    if problem is None and target.decoder is not target.model.model:
        problem = "the decoder is not the model's `model` submodule"
    if problem is None and len(target.layers) != target.num_hidden_layers:
        problem = f"{len(target.layers)} layers, the config says {target.num_hidden_layers}"
    return problem


class StaticKV:
    """A handle on a StaticTargetRunner's K/V: positions 0..length-1 hold the sequence."""

    __slots__ = ("length",)

    def __init__(self) -> None:
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length


class StaticTargetRunner:
    """The target on a preallocated KV cache, CUDA graphs for short calls on CUDA (module docstring)."""

    name = "static"

    def __init__(self, target: Any, aux_layer_ids: Sequence[int], *, cuda_graphs: bool = True,
                 min_capacity: int = 512, rows: int = 1):
        problem = static_runner_problem(target)
        if problem is not None:
            raise ConfigError(f"the static target runner does not support this model: {problem}")
        self.target = target  # target.inprocess.TargetModel
        self.model = target.model
        self.device = torch.device(target.device)
        self.dtype = target.dtype
        L = target.num_hidden_layers
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        for i in self.aux_layer_ids:
            if not 0 <= i <= L:
                raise InputError(f"aux layer id {i} out of range 0..{L} (input-to-layer ids)")
        self._aux_at: dict[int, list[int]] = {}  # layer index -> aux columns holding its input
        for j, i in enumerate(self.aux_layer_ids):
            self._aux_at.setdefault(i, []).append(j)
        dec, cfg = target.decoder, target.model.config
        self.embed, self.norm, self.lm_head, self.rotary = dec.embed_tokens, dec.norm, target.lm_head, dec.rotary_emb
        # A window is kept whatever the sequence length (TargetRunner's HF mask keeps it too).
        self.layers = [_Layer(layer, _layer_window(cfg, layer, sys.maxsize)) for layer in dec.layers]
        self.windows = sorted({ly.window for ly in self.layers if ly.window is not None})
        attn0 = dec.layers[0].self_attn
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(attn0, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.n_rep = self.n_heads // self.n_kv
        self.hidden = target.hidden_size
        self.min_capacity = int(min_capacity)
        self.rows = int(rows)  # sequences the cache holds (evaluate/batched.py: > 1, no graphs)
        if self.rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.row_ids = torch.arange(self.rows, device=self.device)
        self.capacity = 0
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self._live: StaticKV | None = None
        self.use_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.graph_fallbacks = 0
        self._graphs: dict[tuple[int, int, bool], tuple[Any, torch.Tensor, torch.Tensor | None]] = {}
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pool = None
        if self.use_graphs:
            self._probe()

    # ------------------------------------------------------------------ the cache
    def _ensure_capacity(self, needed: int, keep: int | None = None) -> None:
        """At least `needed` positions per row; the first `keep` (default: the live cache's length)
        are copied into a grown buffer."""
        if needed <= self.capacity:
            return
        cap = pow2_at_least(needed, max(self.min_capacity, self.capacity, 1))
        if keep is None:
            keep = self._live.length if self._live is not None else 0
        shape = (len(self.layers), self.rows, self.n_kv, cap, self.head_dim)
        # Plain tensors even when called under inference_mode: they are written in place later.
        with torch.inference_mode(False), torch.no_grad():
            k = torch.zeros(shape, device=self.device, dtype=self.dtype)
            v = torch.zeros(shape, device=self.device, dtype=self.dtype)
            if keep:
                k[..., :keep, :].copy_(self.k_cache[..., :keep, :])
                v[..., :keep, :].copy_(self.v_cache[..., :keep, :])
            pos = torch.arange(cap, device=self.device)[None]
            cos, sin = self.rotary(torch.zeros(1, device=self.device, dtype=self.dtype), position_ids=pos)
            self.cos, self.sin = cos[0].to(self.dtype).contiguous(), sin[0].to(self.dtype).contiguous()
            self.arange = torch.arange(cap, device=self.device)
        self.k_cache, self.v_cache, self.capacity = k, v, cap
        self._drop_graphs()  # captured against the old buffers

    def _drop_graphs(self) -> None:
        """Forget every graph, and with them their memory pool: the allocator keeps a pool only
        while a graph captured into it lives, so a later capture into the old handle would trip
        its `use_count > 0` assert (seen on the H200 when the cache grew). The next capture makes
        a fresh pool."""
        self._graphs.clear()
        self._pool = None

    def new_cache(self, max_len: int | None = None) -> StaticKV:
        """An empty cache; `max_len` (prompt + new tokens + k + 1) sizes the buffers up front."""
        self._live = None  # the memory is reused: no contents to keep
        self._ensure_capacity(max(int(max_len or 0), 1))
        self._live = StaticKV()
        return self._live

    def _check(self, cache: Any) -> None:
        if cache is not self._live:
            raise SpecopsError("this static KV cache is no longer live (the runner handed out a newer one; "
                               "a StaticTargetRunner holds one sequence at a time)")

    def crop(self, cache: StaticKV, length: int) -> None:
        """Keep the first `length` positions (the rest is overwritten by later forwards)."""
        self._check(cache)
        assert 0 <= length <= cache.length, f"crop to {length} of a cache holding {cache.length}"
        cache.length = length

    # ------------------------------------------------------------------ the forward
    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: StaticKV, start: int, *, aux: bool, last_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [1, T] at positions start..start+T-1, appended to `cache` ->
        (logits float32 [T, V] (or [1, V] with last_only), aux [T, 3, H_t] in the model dtype or None)."""
        self._check(cache)
        T = int(ids.shape[1])
        if start != cache.length:
            raise SpecopsError(f"static KV cache: a forward at start {start} != the cache's length {cache.length}")
        self._ensure_capacity(start + T)
        tok = ids.to(self.device).view(T)
        out = None
        if self.use_graphs and start > 0 and T <= GRAPH_MAX_TOKENS:
            out = self._graphed(tok, start, T, aux)
        if out is None:
            pos = torch.arange(start, start + T, device=self.device)
            logits, buf = self._impl(tok[None], pos[None], start + T, aux=aux, last_only=last_only, causal=start == 0)
            out = (logits[0].float(), buf[0] if buf is not None else None)
        cache.length = start + T
        logits, buf = out
        if last_only and logits.shape[0] > 1:
            logits = logits[-1:]
        return logits, buf

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:  # [B, KV, S, D] -> [B, heads, S, D]
        if self.n_rep == 1:
            return x
        b, h, s, d = x.shape
        return x[:, :, None].expand(b, h, self.n_rep, s, d).reshape(b, h * self.n_rep, s, d)

    def _impl(self, tok: torch.Tensor, pos: torch.Tensor, kv_len: int, *, aux: bool, last_only: bool,
              causal: bool, rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward over tok [B, T] at pos [B, T] (row b's tokens at its own positions) against
        keys 0..kv_len-1 of each row (those past a query's position masked) -> (logits [B, T, V]
        ([B, 1, V] with last_only) in the model dtype, aux [B, T, n_aux, H] or None). B is every
        row of the cache, or the rows that `rows` (a slice) selects. causal: pos = 0..T-1 and
        kv_len = T (the plain causal mask is exact). Graph-capturable: shapes depend on
        (B, T, kv_len) only, no host syncs."""
        nh, nkv, D, rep = self.n_heads, self.n_kv, self.head_dim, self.n_rep
        B, T = tok.shape
        K = self.k_cache if rows is None else self.k_cache[:, rows]  # [L, B, KV, M, D]
        V = self.v_cache if rows is None else self.v_cache[:, rows]
        cos = self.cos[pos][:, None]  # [B, 1, T, D]
        sin = self.sin[pos][:, None]
        fold = T <= FOLD_MAX_TOKENS
        ar = self.arange[:kv_len][None, None, :]
        valid = ar <= pos[:, :, None]  # [B, T, kv_len]: query t sees keys 0..pos_t
        masks: dict[int | None, torch.Tensor] = {None: valid}
        for w in self.windows:
            masks[w] = valid & (ar > pos[:, :, None] - w)
        if fold:  # query rows ordered (head in group, t), as the folded queries below
            masks = {w: m.repeat(1, rep, 1) for w, m in masks.items()}
        masks = {w: m[:, None] for w, m in masks.items()}  # [B, 1, rows, kv_len]
        bi = self.row_ids[:B, None].expand(B, T)
        buf = None
        if aux:
            buf = torch.empty(B, T, len(self.aux_layer_ids), self.hidden, device=self.device, dtype=self.dtype)
        h = self.embed(tok)  # [B, T, H]
        for li, ly in enumerate(self.layers):
            if aux:
                for j in self._aux_at.get(li, ()):
                    buf[:, :, j].copy_(h)
            x = ly.ln1(h)
            q = ly.q(x).view(B, T, nh, D)
            k = ly.k(x).view(B, T, nkv, D)
            v = ly.v(x).view(B, T, nkv, D)
            if ly.q_norm is not None:
                q = ly.q_norm(q)
            if ly.k_norm is not None:
                k = ly.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            kc, vc = K[li], V[li]  # [B, KV, M, D]
            if B == 1:  # the batch-1 runner (CUDA graphs): an index_copy_ along the positions
                kc[0].index_copy_(1, pos[0], k[0])
                vc[0].index_copy_(1, pos[0], v[0])
            else:
                kc[bi, :, pos] = k.transpose(1, 2)  # [B, T, KV, D] at (row, position)
                vc[bi, :, pos] = v.transpose(1, 2)
            if fold:  # head h = kv * n_rep + r (HF's repeat_kv order) -> [B, KV, n_rep * T, D]
                qg = q.reshape(B, nkv, rep * T, D)
                o = F.scaled_dot_product_attention(qg, kc[:, :, :kv_len], vc[:, :, :kv_len],
                                                   attn_mask=masks[ly.window], scale=ly.scaling)
                o = o.reshape(B, nh, T, D)
            else:
                kr, vr = self._repeat_kv(kc[:, :, :kv_len]), self._repeat_kv(vc[:, :, :kv_len])
                if causal and ly.window is None:
                    o = F.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=ly.scaling)
                else:
                    o = F.scaled_dot_product_attention(q, kr, vr, attn_mask=masks[ly.window], scale=ly.scaling)
            h = h + ly.o(o.transpose(1, 2).reshape(B, T, nh * D))
            h = h + ly.mlp(ly.ln2(h))
        if aux:
            for j in self._aux_at.get(len(self.layers), ()):
                buf[:, :, j].copy_(h)
        if last_only:
            h = h[:, -1:]
        return self.lm_head(self.norm(h)), buf

    # ------------------------------------------------------------------ CUDA graphs
    def _bucket(self, needed: int) -> int:
        return min(pow2_at_least(needed, MIN_BUCKET), self.capacity)

    def _in_buffers(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Static inputs of the graphs for T tokens: (token ids [1, T], positions [1, T])."""
        if T not in self._inputs:
            with torch.inference_mode(False):
                self._inputs[T] = (torch.zeros(1, T, dtype=torch.long, device=self.device),
                                   torch.zeros(1, T, dtype=torch.long, device=self.device))
        return self._inputs[T]

    def _capture(self, T: int, kv_len: int, aux: bool) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
        """Warm up on a side stream, then capture _impl on the static inputs. Running it is
        harmless: it writes the K/V that the current inputs produce anyway."""
        tok, pos = self._in_buffers(T)
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            for _ in range(2):
                self._impl(tok, pos, kv_len, aux=aux, last_only=False, causal=False)
        cur.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, buf = self._impl(tok, pos, kv_len, aux=aux, last_only=False, causal=False)
        log.info("eval: captured a CUDA graph for %d token(s), kv length %d%s", T, kv_len, ", aux" if aux else "")
        return graph, logits, buf

    def _graphed(self, tok: torch.Tensor, start: int, T: int, aux: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Replay (capture and check on first use) the graph for this call; None: run it eagerly."""
        kv_len = self._bucket(start + T)
        key = (T, kv_len, aux)
        try:
            t_in, p_in = self._in_buffers(T)
            t_in[0].copy_(tok)
            torch.add(self.arange[:T], start, out=p_in[0])
            entry = self._graphs.get(key)
            first = entry is None
            if first:
                entry = self._capture(T, kv_len, aux)
            graph, logits, buf = entry
            graph.replay()
            out = (logits[0].to(torch.float32, copy=True), buf[0].clone() if buf is not None else None)
            if first:
                ref_l, ref_b = self._impl(t_in, p_in, kv_len, aux=aux, last_only=False, causal=False)
                ref_l, ref_b = ref_l[0], (ref_b[0] if ref_b is not None else None)
                same = _close(out[0], ref_l, self.dtype) and (ref_b is None or _close(out[1], ref_b, self.dtype))
                if not same:
                    raise SpecopsError("the replayed graph's output differs from the eager forward")
                self._graphs[key] = entry
            return out
        except Exception as e:  # noqa: BLE001 - any failure: graphs off, this call and the rest eager
            self.use_graphs = False
            self._drop_graphs()
            self.graph_fallbacks += 1
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(self.device)
            log.warning("eval: CUDA graph capture failed for %d token(s) at kv length %d (%s: %s); the target "
                        "runs eagerly on the static cache from now on", T, kv_len, type(e).__name__, e)
            return None

    def _probe(self) -> None:
        """Capture and check the one-token decode graph now, so that `use_graphs` says from the
        start whether graphs work here (a later capture can still fail, with a warning)."""
        cache = self.new_cache(2)
        one = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.forward(one, cache, 0, aux=False)
        self.forward(one, cache, 1, aux=False)
        self._live = None


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Same values up to kernel-level rounding (the eager and replayed forwards run the same ops)."""
    a, b = a.float(), b.float()
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    return bool((a - b).abs().max() <= tol * (1 + b.abs().max()))  # False on a NaN


def make_target_runner(target: Any, aux_layer_ids: Sequence[int], kind: str = "auto", *,
                       cuda_graphs: bool = True) -> Any:
    """eval.target_runner -> a TargetRunner ("hf") or a StaticTargetRunner ("static"); "auto": static
    on CUDA when the architecture is supported, else hf."""
    if kind not in TARGET_RUNNERS:
        raise ConfigError(f"eval.target_runner: expected one of {', '.join(map(repr, TARGET_RUNNERS))}, got {kind!r}")
    if kind == "hf":
        return TargetRunner(target, aux_layer_ids)
    problem = static_runner_problem(target)
    if kind == "static":
        if problem is not None:
            raise ConfigError(f"eval.target_runner = 'static': {problem}; use 'hf' (or 'auto') for this target")
        return StaticTargetRunner(target, aux_layer_ids, cuda_graphs=cuda_graphs)
    if torch.device(target.device).type == "cuda":
        if problem is None:
            return StaticTargetRunner(target, aux_layer_ids, cuda_graphs=cuda_graphs)
        log.info("eval: the HF target runner (DynamicCache, no CUDA graphs): %s", problem)
    return TargetRunner(target, aux_layer_ids)


def runner_info(runner: Any) -> dict[str, Any]:
    """What the summary records: which runner, and whether it replays CUDA graphs."""
    return {"target_runner": getattr(runner, "name", "hf"), "cuda_graphs": bool(getattr(runner, "use_graphs", False))}
