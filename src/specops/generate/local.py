"""The `local` engine: in-process generation with transformers.

One worker thread owns the model and runs a batched decode loop with continuous refill: up to
`batch_size` sequences decode together, and when one finishes (an eos id, `max_tokens`, or
`max_model_len`) its slot is given to the next queued request at once, without waiting for the
others. `complete()` tokenizes the chat on the caller's event loop, queues the request and awaits
a future that the worker resolves through `loop.call_soon_threadsafe`.

Two paths:

* fast path (Llama, Mistral, Qwen2, Qwen3 decoders): our own attention and KV cache around the HF
  model's submodules (embeddings, norms, q/k/v/o projections, MLPs, lm_head, rotary table). The
  cache is preallocated `[layers, batch, kv_heads, max_model_len, head_dim]`; every row writes
  its new K/V at its own position and attends through a boolean mask built from its length, so
  rows of different lengths decode in one static-shape step. A newly admitted prompt is
  prefilled on its own (prompts admitted together are prefilled as one right-padded batch,
  which is exact under a causal mask) straight into its slot. On CUDA the decode step is
  captured once per KV-length bucket as a CUDA graph and replayed.
* fallback (any other architecture, or RoPE variants whose table depends on the sequence
  length): HF `forward` with its own cache, left-padded batches run as waves (no refill).

Conventions of the returned `Completion`:

* `token_ids` are every generated id, the terminating eos included, as vLLM's `return_token_ids`
  reports them (DESIGN, records format): `completion_tokens == len(token_ids)`; `content` is
  decoded without the eos.
* `finish_reason` is "stop" (an eos id) or "length" (`max_tokens`, or the prompt plus the
  completion reached `max_model_len`).
* `content` is the decoded text (special tokens skipped). If it holds `</think>`, the part
  before it (minus a leading `<think>`) is `reasoning` and the stripped rest is `content`; an
  unclosed `<think>` makes everything after it `reasoning`. Otherwise `reasoning` is None.
* eos ids are the union of the generation config's, the model config's and the tokenizer's.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..models import resolve_device, resolve_dtype
from ..target.fastpath import _Layer, _layer_window, _rope, fast_path_problem
from ..text import split_think
from .types import ChatRequest, Completion, EngineError, RequestRejected, TransientError

log = logging.getLogger("specops.generate.local")

_STOP = object()  # queue sentinel


@dataclass(eq=False)
class _Item:
    """One request from submission to completion."""

    request: ChatRequest
    prompt_ids: list[int]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    t_submit: float
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    generator: torch.Generator | None = None
    generated: list[int] = field(default_factory=list)
    slot: int = -1

    @property
    def length(self) -> int:  # tokens in the sequence so far (prompt + generated)
        return len(self.prompt_ids) + len(self.generated)


class FastDecoder:
    """Batched prefill + static-shape decode step over a preallocated per-slot KV cache."""

    def __init__(self, model: Any, *, batch_size: int, max_model_len: int, device: torch.device, dtype: torch.dtype,
                 cuda_graphs: bool = True):
        cfg = model.config
        base = model.model
        self.device, self.dtype = device, dtype
        self.batch_size, self.max_model_len = batch_size, max_model_len
        self.embed = base.embed_tokens
        self.norm = base.norm
        self.lm_head = model.lm_head
        self.layers = [_Layer(layer, _layer_window(cfg, layer, max_model_len)) for layer in base.layers]
        attn0 = base.layers[0].self_attn
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(attn0, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.n_rep = self.n_heads // self.n_kv
        self.windows = sorted({ly.window for ly in self.layers if ly.window is not None})

        # cos/sin for every position, computed by the model's own rotary module.
        pos = torch.arange(max_model_len, device=device)[None]
        dummy = torch.zeros(1, device=device, dtype=dtype)
        cos, sin = base.rotary_emb(dummy, position_ids=pos)
        self.cos = cos[0].to(dtype).contiguous()  # [M, head_dim]
        self.sin = sin[0].to(dtype).contiguous()

        shape = (len(self.layers), batch_size, self.n_kv, max_model_len, self.head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.arange = torch.arange(max_model_len, device=device)
        self.rows = torch.arange(batch_size, device=device)
        self.head_offsets = torch.arange(self.n_kv, device=device)

        # Static inputs of the decode step (CUDA graphs replay from these addresses).
        self.tokens = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.use_graphs = device.type == "cuda" and cuda_graphs
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    # ------------------------------------------------------------------ helpers
    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        if self.n_rep == 1:
            return x
        n, h, t, d = x.shape
        return x[:, :, None].expand(n, h, self.n_rep, t, d).reshape(n, h * self.n_rep, t, d)

    def kv_bucket(self, needed: int) -> int:
        """KV length the decode step attends over (static per bucket, >= needed)."""
        m = self.max_model_len
        if self.use_graphs:
            b = 256
            while b < needed:
                b *= 2
            return min(b, m)
        return min(m, -(-needed // 64) * 64)

    # ------------------------------------------------------------------ prefill
    def prefill(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Run the prompts (right-padded into one batch), write their K/V into `slots`, and
        return the logits at each prompt's last token, [n, vocab]."""
        n, t = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(n, t, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(self.device)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        slot_t = torch.tensor(slots, dtype=torch.long, device=self.device)
        cos, sin = self.cos[:t][None, None], self.sin[:t][None, None]  # [1, 1, T, D]
        masks: dict[int, torch.Tensor] = {}
        if self.windows:
            i = self.arange[:t, None]
            j = self.arange[None, :t]
            for w in self.windows:
                masks[w] = (j <= i) & (j > i - w)
        h = self.embed(ids)
        for li, ly in enumerate(self.layers):
            x = ly.ln1(h)
            q = ly.q(x).view(n, t, self.n_heads, self.head_dim)
            k = ly.k(x).view(n, t, self.n_kv, self.head_dim)
            v = ly.v(x).view(n, t, self.n_kv, self.head_dim)
            if ly.q_norm is not None:
                q = ly.q_norm(q)
            if ly.k_norm is not None:
                k = ly.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            self.k_cache[li][:, :, :t].index_copy_(0, slot_t, k)
            self.v_cache[li][:, :, :t].index_copy_(0, slot_t, v)
            kr, vr = self._repeat_kv(k), self._repeat_kv(v)
            if ly.window is None:
                o = F.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=ly.scaling)
            else:
                o = F.scaled_dot_product_attention(q, kr, vr, attn_mask=masks[ly.window], scale=ly.scaling)
            o = o.transpose(1, 2).reshape(n, t, self.n_heads * self.head_dim)
            h = h + ly.o(o)
            h = h + ly.mlp(ly.ln2(h))
        h = h[torch.arange(n, device=self.device), last]
        return self.lm_head(self.norm(h))

    # ------------------------------------------------------------------ decode
    def _step_impl(self, n: int, kv_len: int) -> torch.Tensor:
        tok = self.tokens[:n]
        pos = self.positions[:n]
        rows = self.rows[:n]
        cos = self.cos.index_select(0, pos)[:, None, None, :]  # [n, 1, 1, D]
        sin = self.sin.index_select(0, pos)[:, None, None, :]
        ar = self.arange[:kv_len][None, :]
        valid = ar <= pos[:, None]  # [n, kv_len]
        masks = {None: valid[:, None, None, :]}
        for w in self.windows:
            masks[w] = (valid & (ar > pos[:, None] - w))[:, None, None, :]
        # flat row index of (slot, kv head, position) in a layer's cache viewed as [B*KV*M, D]
        slot_head = rows[:, None] * self.n_kv + self.head_offsets[None, :]  # [n, KV]
        flat = (slot_head * self.max_model_len + pos[:, None]).reshape(-1)
        h = self.embed(tok)[:, None, :]  # [n, 1, H]
        for li, ly in enumerate(self.layers):
            x = ly.ln1(h)
            q = ly.q(x).view(n, 1, self.n_heads, self.head_dim)
            k = ly.k(x).view(n, 1, self.n_kv, self.head_dim)
            v = ly.v(x).view(n, 1, self.n_kv, self.head_dim)
            if ly.q_norm is not None:
                q = ly.q_norm(q)
            if ly.k_norm is not None:
                k = ly.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [n, heads, 1, D]
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            kc, vc = self.k_cache[li], self.v_cache[li]
            d = self.head_dim
            kc.view(-1, d).index_copy_(0, flat, k.reshape(-1, d))
            vc.view(-1, d).index_copy_(0, flat, v.reshape(-1, d))
            # One query token per row: fold each GQA group's query heads into the query-length
            # axis, so K/V are read once per kv head instead of being repeated.
            qg = q.reshape(n, self.n_kv, self.n_rep, d)
            o = F.scaled_dot_product_attention(
                qg, kc[:n, :, :kv_len], vc[:n, :, :kv_len], attn_mask=masks[ly.window], scale=ly.scaling
            )
            h = h + ly.o(o.reshape(n, 1, self.n_heads * d))
            h = h + ly.mlp(ly.ln2(h))
        return self.lm_head(self.norm(h[:, 0]))

    def step(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Feed tokens[i] at positions[i] for rows 0..len-1 (padding rows: token 0 at 0) and
        return the logits [n_rows, vocab]. With CUDA graphs every step runs all batch rows."""
        n = self.batch_size if self.use_graphs else len(tokens)
        if len(tokens) < n:
            tokens = tokens + [0] * (n - len(tokens))
            positions = positions + [0] * (n - len(positions))
        kv_len = self.kv_bucket(max(positions) + 1)
        self.tokens[:n].copy_(torch.tensor(tokens, dtype=torch.long), non_blocking=True)
        self.positions[:n].copy_(torch.tensor(positions, dtype=torch.long), non_blocking=True)
        if not self.use_graphs:
            return self._step_impl(n, kv_len)
        entry = self._graphs.get(kv_len)
        if entry is None:
            entry = self._capture(kv_len)
        graph, out = entry
        graph.replay()
        return out

    def _capture(self, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream (lazy init, kernel selection), then capture. The decode step is
        # idempotent for fixed inputs (it rewrites the same K/V), so running it here is harmless.
        n = self.batch_size
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step_impl(n, kv_len)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._step_impl(n, kv_len)
        self._graphs[kv_len] = (graph, out)
        log.info("local engine: captured a CUDA graph for batch %d, kv length %d", n, kv_len)
        return graph, out


class LocalEngine:
    """In-process transformers generation (see the module docstring)."""

    name = "local"

    def __init__(
        self,
        model_dir: Path | str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 8,
        max_model_len: int = 2048,
        model_name: str = "local",
        tokenizer_dir: Path | str | None = None,
        prefill_token_budget: int | None = None,
        cuda_graphs: bool = True,
        trust_remote_code: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.model_dir = Path(model_dir)
        self.tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else self.model_dir
        self.device_spec, self.dtype_spec = device, dtype
        self.trust_remote_code = trust_remote_code
        self.batch_size = batch_size
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.cuda_graphs = cuda_graphs
        # padded tokens in one prefill batch (a longer prompt still runs, alone)
        self.prefill_token_budget = prefill_token_budget or max(4096, max_model_len)

        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        self.tokenizer: Any = None
        self.model: Any = None
        self.eos_ids: frozenset[int] = frozenset()
        self.fast_path_problem: str | None = None  # None once started on the fast path
        self._decoder: FastDecoder | None = None
        self._tok_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._slots: list[_Item | None] = [None] * batch_size
        self._closing = False
        self._dead: BaseException | None = None
        self._threads = 1
        # Observability: counters and a bounded event log ("admit"/"finish", sample id, step).
        self.stats: collections.Counter = collections.Counter()
        self.events: collections.deque = collections.deque(maxlen=10000)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._closing = False
        self._dead = None
        await asyncio.to_thread(self._load)
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._worker, name="specops-local-engine", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM

        from ..target.hf import load_model, load_tokenizer

        self.device = resolve_device(self.device_spec)
        self.dtype = resolve_dtype(self.dtype_spec, self.device)
        self.tokenizer = load_tokenizer(self.tokenizer_dir, trust_remote_code=self.trust_remote_code)
        # dtype= at load time: .to(dtype) afterwards would also cast the fp32 RoPE buffers.
        model = load_model(AutoModelForCausalLM, self.model_dir, trust_remote_code=self.trust_remote_code,
                           dtype=self.dtype)
        model.to(self.device)
        model.eval()
        self.model = model
        self.eos_ids = frozenset(self._collect_eos_ids())
        max_pos = getattr(model.config, "max_position_embeddings", None)
        if max_pos and self.max_model_len > max_pos:
            log.warning(
                "local engine: max_model_len %d exceeds the model's max_position_embeddings %d",
                self.max_model_len,
                max_pos,
            )
        if not self.eos_ids:
            log.warning("local engine: no eos id found; every completion will run to its length limit")
        self.fast_path_problem = fast_path_problem(model, self.max_model_len)
        if self.fast_path_problem is None:
            with torch.inference_mode():
                self._decoder = FastDecoder(
                    model,
                    batch_size=self.batch_size,
                    max_model_len=self.max_model_len,
                    device=self.device,
                    dtype=self.dtype,
                    cuda_graphs=self.cuda_graphs,
                )
            log.info(
                "local engine: %s on %s (%s), fast path with continuous refill, batch %d, max_model_len %d%s",
                model.config.model_type,
                self.device,
                str(self.dtype).replace("torch.", ""),
                self.batch_size,
                self.max_model_len,
                ", CUDA graphs" if self._decoder.use_graphs else "",
            )
        else:
            log.warning(
                "local engine: %s on %s: fast path unavailable (%s); using the slower HF forward path "
                "in waves of %d (no continuous refill)",
                getattr(model.config, "model_type", "?"),
                self.device,
                self.fast_path_problem,
                self.batch_size,
            )

    def _collect_eos_ids(self) -> set[int]:
        ids: set[int] = set()

        def add(v: Any) -> None:
            if v is None:
                return
            if isinstance(v, (list, tuple, set)):
                for x in v:
                    add(x)
            else:
                ids.add(int(v))

        gc = getattr(self.model, "generation_config", None)
        add(getattr(gc, "eos_token_id", None))
        add(getattr(self.model.config, "eos_token_id", None))
        add(getattr(self.tokenizer, "eos_token_id", None))
        return ids

    async def close(self) -> None:
        self._closing = True
        thread = self._thread
        if thread is not None:
            self._queue.put(_STOP)
            await asyncio.to_thread(thread.join)
            self._thread = None
        self._drain_queue(EngineError("local engine closed", endpoint="local"))

    # ------------------------------------------------------------------ requests
    async def complete(self, request: ChatRequest) -> Completion:
        t0 = time.monotonic()
        if self._dead is not None:
            raise EngineError(f"local engine worker died: {self._dead!r}", endpoint="local")
        if self._thread is None or self._closing:
            raise EngineError("local engine is not running (call start() first)", endpoint="local")
        sp = request.sampling
        if sp.max_tokens is None or sp.max_tokens < 1:
            raise RequestRejected(f"max_tokens must be >= 1, got {sp.max_tokens}", status=400, endpoint="local")
        if sp.temperature is None or sp.temperature < 0:
            raise RequestRejected(f"temperature must be >= 0, got {sp.temperature}", status=400, endpoint="local")
        if not (0 < (sp.top_p if sp.top_p is not None else 1.0) <= 1):
            raise RequestRejected(f"top_p must be in (0, 1], got {sp.top_p}", status=400, endpoint="local")
        prompt_ids = self._encode(request)
        if len(prompt_ids) > self.max_model_len - 1:
            raise RequestRejected(
                f"prompt has {len(prompt_ids)} tokens, max_model_len is {self.max_model_len}",
                status=400,
                endpoint="local",
            )
        loop = asyncio.get_running_loop()
        item = _Item(
            request=request,
            prompt_ids=prompt_ids,
            future=loop.create_future(),
            loop=loop,
            t_submit=t0,
            max_tokens=int(sp.max_tokens),
            temperature=float(sp.temperature),
            top_p=float(sp.top_p if sp.top_p is not None else 1.0),
            seed=sp.seed,
        )
        self._queue.put(item)
        return await item.future

    def encode(self, request: ChatRequest) -> list[int]:
        """The prompt ids for a request (the chat template with the generation prompt)."""
        return self._encode(request)

    def _encode(self, request: ChatRequest) -> list[int]:
        kwargs = dict((request.extra_body or {}).get("chat_template_kwargs") or {})
        try:
            with self._tok_lock:
                out = self.tokenizer.apply_chat_template(
                    request.messages,
                    tools=request.tools or None,
                    add_generation_prompt=True,
                    tokenize=True,
                    **kwargs,
                )
        except Exception as e:  # template errors (roles, unsupported content) reject the sample
            raise RequestRejected(f"chat template failed: {e}", status=400, endpoint="local") from e
        if hasattr(out, "keys"):
            out = out["input_ids"]
        if out and isinstance(out[0], list):
            out = out[0]
        return [int(x) for x in out]

    # ------------------------------------------------------------------ resolving futures
    @staticmethod
    def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _resolve(self, item: _Item, result: Any = None, exc: BaseException | None = None) -> None:
        try:
            item.loop.call_soon_threadsafe(self._settle, item.future, result, exc)
        except RuntimeError:  # the caller's loop is closed; nobody is waiting
            pass

    def _drain_queue(self, exc: BaseException) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                self._resolve(item, exc=exc)

    def _finish(self, item: _Item, reason: str) -> None:
        gen = item.generated
        ids = list(gen)
        with self._tok_lock:
            text = self.tokenizer.decode(ids[:-1] if reason == "stop" else ids, skip_special_tokens=True)
        reasoning, content = split_think(text)
        comp = Completion(
            content=content,
            reasoning=reasoning,
            finish_reason=reason,
            prompt_tokens=len(item.prompt_ids),
            completion_tokens=len(gen),
            latency_s=time.monotonic() - item.t_submit,
            endpoint="local",
            model=self.model_name,
            token_ids=ids,
            prompt_token_ids=list(item.prompt_ids),
        )
        self.stats["finished"] += 1
        self.stats["generated_tokens"] += len(gen)
        self.events.append(("finish", item.request.sample_id, self.stats["steps"], time.monotonic()))
        self._resolve(item, comp)

    def _append_token(self, item: _Item, tok: int) -> str | None:
        """Record a generated token; the finish reason if the sequence is now done."""
        item.generated.append(tok)
        if tok in self.eos_ids:
            return "stop"
        if len(item.generated) >= item.max_tokens or item.length >= self.max_model_len:
            return "length"
        return None

    # ------------------------------------------------------------------ sampling
    def _choose(self, items: list[_Item], logits: torch.Tensor) -> list[int]:
        """Next token per row of `logits` ([len(items), vocab]) for each item's sampling params."""
        out = torch.argmax(logits, dim=-1).tolist()
        for i, it in enumerate(items):
            if it.temperature > 0:
                out[i] = self._sample(logits[i], it)
        return out

    def _sample(self, row: torch.Tensor, it: _Item) -> int:
        if it.generator is None and it.seed is not None:
            it.generator = torch.Generator(device=row.device)
            it.generator.manual_seed(int(it.seed))
        probs = torch.softmax(row.float() / it.temperature, dim=-1)
        if it.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_p, dim=0) - sorted_p  # mass of strictly more likely tokens
            sorted_p = sorted_p.masked_fill(before >= it.top_p, 0.0)
            pick = torch.multinomial(sorted_p, 1, generator=it.generator)
            return int(order[pick])
        return int(torch.multinomial(probs, 1, generator=it.generator))

    # ------------------------------------------------------------------ worker
    def _worker(self) -> None:
        torch.set_num_threads(self._threads)
        try:
            with torch.inference_mode():
                if self._decoder is not None:
                    self._fast_loop()
                else:
                    self._wave_loop()
        except BaseException as e:  # a bug in the loop itself: fail everything, refuse new work
            log.exception("local engine worker died")
            self._dead = e
            err = TransientError(f"local engine worker died: {e!r}", endpoint="local")
            for s, it in enumerate(self._slots):
                if it is not None:
                    self._resolve(it, exc=err)
                    self._slots[s] = None
            self._drain_queue(err)
            return
        closed = EngineError("local engine closed", endpoint="local")
        for s, it in enumerate(self._slots):
            if it is not None:
                self._resolve(it, exc=closed)
                self._slots[s] = None
        self._drain_queue(closed)

    def _take(self, n: int, block: bool) -> tuple[list[_Item], bool]:
        """Up to n queued live items; waits for the first one when `block`. (items, stop?)"""
        items: list[_Item] = []
        stop = False
        while len(items) < n:
            try:
                item = self._queue.get(timeout=0.5) if (block and not items) else self._queue.get_nowait()
            except queue.Empty:
                if block and not items and not self._closing:
                    continue
                break
            if item is _STOP:
                stop = True
                break
            if item.future.done():  # cancelled while queued
                continue
            items.append(item)
        return items, stop

    def _fast_loop(self) -> None:
        dec = self._decoder
        assert dec is not None
        while not self._closing:
            free = [s for s, it in enumerate(self._slots) if it is None]
            if free:
                idle = len(free) == self.batch_size
                items, stop = self._take(len(free), block=idle)
                if stop:
                    return
                if items:
                    self._admit(items, free)
            self._drop_cancelled()
            if any(it is not None for it in self._slots):
                self._decode_step()

    def _drop_cancelled(self) -> None:
        for s, it in enumerate(self._slots):
            if it is not None and it.future.done():
                self._slots[s] = None
                self.stats["cancelled"] += 1

    def _admit(self, items: list[_Item], free: list[int]) -> None:
        dec = self._decoder
        assert dec is not None
        for it, slot in zip(items, free):
            it.slot = slot
        # Prefill groups: similar lengths together, padded tokens within the budget.
        items = sorted(items, key=lambda it: len(it.prompt_ids))
        groups: list[list[_Item]] = []
        for it in items:
            g = groups[-1] if groups else None
            if g is not None and (len(g) + 1) * len(it.prompt_ids) <= self.prefill_token_budget:
                g.append(it)
            else:
                groups.append([it])
        for g in groups:
            try:
                logits = dec.prefill([it.prompt_ids for it in g], [it.slot for it in g])
                toks = self._choose(g, logits)
            except Exception as e:
                log.exception("local engine: prefill failed")
                err = self._step_error("prefill", e)
                for it in g:
                    self._resolve(it, exc=err)
                continue
            self.stats["prefill_batches"] += 1
            for it, tok in zip(g, toks):
                self.stats["admitted"] += 1
                self.events.append(("admit", it.request.sample_id, self.stats["steps"], time.monotonic()))
                reason = self._append_token(it, tok)
                if reason is not None:
                    self._finish(it, reason)
                else:
                    self._slots[it.slot] = it

    @staticmethod
    def _step_error(what: str, e: Exception) -> EngineError:
        # The batch may have failed because of another request in it: let the runner retry.
        return TransientError(f"local engine {what} failed: {e!r}", endpoint="local")

    def _decode_step(self) -> None:
        dec = self._decoder
        assert dec is not None
        active = [(s, it) for s, it in enumerate(self._slots) if it is not None]
        n = active[-1][0] + 1  # rows 0..n-1 (free rows in between decode a dummy token)
        tokens = [0] * n
        positions = [0] * n
        for s, it in active:
            tokens[s] = it.generated[-1]
            positions[s] = it.length - 1
        try:
            logits = dec.step(tokens, positions)
            if len(active) == n:
                rows = logits[:n]
            else:
                rows = logits.index_select(0, torch.tensor([s for s, _ in active], device=logits.device))
            toks = self._choose([it for _, it in active], rows)
        except Exception as e:
            log.exception("local engine: decode step failed")
            err = self._step_error("decode step", e)
            for s, it in active:
                self._resolve(it, exc=err)
                self._slots[s] = None
            return
        self.stats["steps"] += 1
        self.stats["row_steps"] += len(active)
        for (s, it), tok in zip(active, toks):
            reason = self._append_token(it, tok)
            if reason is not None:
                self._slots[s] = None
                self._finish(it, reason)

    # ------------------------------------------------------------------ fallback: HF forward, waves
    def _wave_loop(self) -> None:
        while not self._closing:
            items, stop = self._take(self.batch_size, block=True)
            if items:
                try:
                    self._run_wave(items)
                except Exception as e:
                    log.exception("local engine: wave failed")
                    err = self._step_error("forward", e)
                    for it in items:
                        self._resolve(it, exc=err)
                    for s in range(self.batch_size):
                        self._slots[s] = None
            if stop:
                return

    def _run_wave(self, items: list[_Item]) -> None:
        model = self.model
        dev = self.device
        n = len(items)
        for s, it in enumerate(items):
            it.slot = s
            self._slots[s] = it
        pad = getattr(self.tokenizer, "pad_token_id", None)
        pad = int(pad) if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)
        t = max(len(it.prompt_ids) for it in items)
        ids = torch.full((n, t), pad, dtype=torch.long)
        mask = torch.zeros((n, t), dtype=torch.long)
        for i, it in enumerate(items):  # left padding
            p = it.prompt_ids
            ids[i, t - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, t - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        params = inspect.signature(model.forward).parameters
        cache_kw = "cache" if "cache" in params else "past_key_values"
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        self.stats["prefill_batches"] += 1
        live = list(range(n))
        for it in items:
            self.stats["admitted"] += 1
            self.events.append(("admit", it.request.sample_id, self.stats["steps"], time.monotonic()))
        while True:
            logits = out.logits[:, -1]
            rows = [i for i in live if not items[i].future.done()]
            for i in set(live) - set(rows):
                self._slots[i] = None
                self.stats["cancelled"] += 1
            toks = self._choose([items[i] for i in rows], logits[rows]) if rows else []
            live = []
            for i, tok in zip(rows, toks):
                reason = self._append_token(items[i], tok)
                if reason is not None:
                    self._slots[i] = None
                    self._finish(items[i], reason)
                else:
                    live.append(i)
            if not live:
                return
            nxt = torch.full((n, 1), pad, dtype=torch.long)
            for i in live:
                nxt[i, 0] = items[i].generated[-1]
            nxt = nxt.to(dev)
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=dev)], dim=1)
            pos = pos[:, -1:] + 1
            cache = getattr(out, "cache", None)
            if cache is None:
                cache = out.past_key_values
            out = model(input_ids=nxt, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kw: cache})
            self.stats["steps"] += 1
            self.stats["row_steps"] += len(live)
