"""The generate runner: sources -> engine -> journal, exactly once per sample id.

Flow per dataset: stream the source; skip ids already in records (done) or failed (parked); keep
at most `concurrency` samples in flight (a semaphore taken before a task exists, so memory stays
flat for any input size); each sample regenerates its assistant turns in order; the finished
record is appended in one write with no await between the last response and the append, so a
cancelled task either wrote its whole record or nothing.

Retries: `TransientError` (connection, 5xx, 429, timeout) is retried up to `max_attempts` with
exponential backoff and full jitter; `RequestRejected` (other 4xx) fails the sample at once.
Failures go to failed.jsonl with their attempt count and the server's message.

SIGINT/SIGTERM: stop submitting, cancel in-flight requests (they were not recorded, so a rerun
sends them again), flush the journal and stats, release the lock, exit 130.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..campaign import Campaign, atomic_write_json, now_iso
from ..config import Config, DatasetSection
from ..errors import InputError, Interrupted, SpecopsError
from ..progress import ROUTINE, phase_progress
from .journal import DiskFull, Journal
from ..sources import Quarantined, Sample, open_source
from .types import (
    ChatRequest,
    Completion,
    Engine,
    EngineError,
    RequestRejected,
    SamplingParams,
    TransientError,
)

log = logging.getLogger("specops.generate")


class SampleFailed(Exception):
    def __init__(self, err: BaseException, attempts: int):
        super().__init__(str(err))
        self.err = err
        self.attempts = attempts


@dataclass
class DatasetRun:
    ds: DatasetSection
    journal: Journal
    total: int
    sampling: SamplingParams
    concurrency: int
    turns: str
    extra_body: dict[str, Any]
    in_flight: int = 0
    skipped: int = 0  # already done or parked at start
    finished: bool = False
    tasks: set[asyncio.Task] = field(default_factory=set)


@dataclass
class GenerateSummary:
    campaign: str
    datasets: dict[str, dict[str, Any]]
    elapsed_s: float
    interrupted: bool = False

    @property
    def total_done(self) -> int:
        return sum(d["done"] for d in self.datasets.values())


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Full-jitter exponential backoff: uniform(0, min(cap, base * 2**(attempt-1)))."""
    return rng.uniform(0, min(cap, base * (2 ** (attempt - 1))))


def build_engine(cfg: Config) -> Engine:
    from ..models import resolve_model_dir, served_name

    e = cfg.engine
    name = served_name(cfg.target.model, cfg.target.served_name)
    if e.kind == "openai":
        from .client import OpenAIEngine

        from ..auth import client_key

        return OpenAIEngine(
            e.endpoints,
            model=name,
            api_key=client_key(cfg),  # engine.api_key_env's, else the campaign's serve key
            connect_timeout_s=e.connect_timeout_s,
            read_timeout_s=e.read_timeout_s,
            return_token_ids=e.return_token_ids,
        )
    from .local import LocalEngine

    return LocalEngine(
        resolve_model_dir(cfg.target.model),
        device=e.device,
        dtype=cfg.target.dtype,
        batch_size=e.batch_size,
        max_model_len=e.max_model_len,
        model_name=name,
        tokenizer_dir=cfg.target.tokenizer,
        cuda_graphs=e.cuda_graphs,
        trust_remote_code=cfg.target.trust_remote_code,
    )


def require_usable_records(cfg: Config) -> None:
    """Every dataset must yield at least one sample: one whose every record is quarantined while it
    is read (a binary file, the wrong shape, every line broken) stops the campaign here, before any
    engine starts or request goes out, naming the dataset, the count and the first reason. Reads
    each dataset up to its first usable record (the whole of it only when none is usable). An input
    with no records at all (an empty file) passes: the runner warns about it and reports it."""
    for ds in cfg.datasets:
        source = open_source(ds, default_system_prompt=cfg.generate.system_prompt)
        quarantined, first = 0, None
        for item in source:
            if isinstance(item, Sample):
                break
            quarantined += 1
            first = first or item
        else:
            if first is not None:
                what = ", ".join(source.paths) or f"source {ds.source!r}"
                every = "its one record was" if quarantined == 1 else f"all {quarantined} of its records were"
                raise InputError(
                    f"dataset {ds.name!r}: {every} quarantined while reading {what} (first, {first.where}: "
                    f"{first.reason}); nothing to generate, no request sent. Fix the input, or leave the "
                    "dataset out of the campaign")


class Runner:
    def __init__(
        self,
        cfg: Config,
        campaign: Campaign,
        engine: Engine,
        *,
        retry_failed: bool = False,
        progress: bool | None = None,
        on_heartbeat: Callable[[dict[str, Any]], None] | None = None,
        manage_engine: bool = True,
    ):
        self.cfg = cfg
        self.campaign = campaign
        self.engine = engine
        self.retry_failed = retry_failed
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.on_heartbeat = on_heartbeat
        self.manage_engine = manage_engine  # False: the caller starts and closes the engine
        self.runs: dict[str, DatasetRun] = {}
        self.stop = asyncio.Event()
        self.stop_reason: str | None = None
        self.fatal: BaseException | None = None
        self.rng = random.Random(cfg.campaign.seed ^ os.getpid())
        self.started = time.time()
        self._window: deque[tuple[float, int, int]] = deque()
        self._window_s = 60.0
        self._last_done_unix: float | None = None
        self._stats_every_s = 5.0
        # Health gate per endpoint (openai engine): a connection-level failure probes the server;
        # while it is down, requests wait here instead of burning their retry attempts.
        self._gates: dict[str, asyncio.Future] = {}
        self.servers: dict[str, dict[str, Any]] = {}
        self.alerter = None

    # ---------------------------------------------------------------- setup
    def _open_datasets(self) -> None:
        g = self.cfg.generate
        for ds in self.cfg.datasets:
            journal = Journal(self.campaign.dataset_dir(ds.name), fsync_interval_s=g.fsync_interval_s)
            journal.open(retry_failed=self.retry_failed)
            for name, n in journal.repaired_bytes.items():
                log.warning("%s/%s: truncated a torn last line (%d bytes) left by an interrupted write",
                            ds.name, name, n)
            source = open_source(ds, default_system_prompt=g.system_prompt)
            s = self.cfg.sampling_for(ds)
            extra = dict(g.extra_body)
            extra.update(ds.extra_body)
            if g.reasoning == "off":
                ctk = dict(extra.get("chat_template_kwargs") or {})
                ctk.setdefault("enable_thinking", False)
                extra["chat_template_kwargs"] = ctk
            self.runs[ds.name] = DatasetRun(
                ds=ds,
                journal=journal,
                total=source.count(),
                sampling=SamplingParams(s.max_tokens, s.temperature, s.top_p, s.seed),
                concurrency=self.cfg.concurrency_for(ds),
                turns=ds.turns or g.turns,
                extra_body=extra,
            )
            self._sources[ds.name] = source

    # ---------------------------------------------------------------- one sample
    async def _call(self, run: DatasetRun, sample: Sample, messages: list[dict[str, Any]]) -> tuple[Completion, int]:
        e = self.cfg.engine
        attempt = 0
        free_retries = 3  # retries after a server outage that do not count as attempts
        while True:
            attempt += 1
            req = ChatRequest(
                sample_id=sample.id,
                messages=messages,
                sampling=run.sampling,
                tools=sample.tools,
                extra_body=run.extra_body,
                attempt=attempt,
            )
            try:
                return await self.engine.complete(req), attempt
            except TransientError as err:
                run.journal.stats.errors[self._err_key(err)] += 1
                if err.status is None and free_retries > 0 and hasattr(self.engine, "probe"):
                    # Connection refused / cut / timed out: is the server itself down?
                    if await self._gate(err.endpoint):
                        free_retries -= 1
                        attempt -= 1  # it was the server, not this sample: retry for free
                        continue
                if attempt >= e.max_attempts:
                    raise SampleFailed(err, attempt) from err
                run.journal.stats.retries += 1
                delay = backoff_delay(attempt, e.backoff_base_s, e.backoff_max_s, self.rng)
                log.debug("%s: attempt %d failed (%s); retrying in %.1fs", sample.id, attempt, err, delay)
                await asyncio.sleep(delay)
            except RequestRejected as err:
                run.journal.stats.errors[self._err_key(err)] += 1
                raise SampleFailed(err, attempt) from err

    async def _gate(self, endpoint: str) -> bool:
        """Probe `endpoint` once (shared by every request that failed on it); if it is down, wait
        until every health tier passes again. Returns True when the endpoint had been down."""
        fut = self._gates.get(endpoint)
        if fut is None or fut.done():
            fut = asyncio.ensure_future(self._probe_until_healthy(endpoint))
            self._gates[endpoint] = fut
        return await asyncio.shield(fut)

    async def _probe_until_healthy(self, endpoint: str) -> bool:
        from ..checks.server import ServerUnhealthy, wait_until_healthy

        rep = await self.engine.probe(endpoint, progress_window_s=0.5, completion_timeout_s=60.0)
        if rep.ok:
            return False
        bad = rep.first_failure()
        reason = f"{bad.name} {bad.status}: {bad.evidence}" if bad else "unhealthy"
        since = time.time()
        self.servers[endpoint] = {"state": "down", "since": since, "reason": reason}
        self.engine.down.add(endpoint)
        log.warning("server %s is down (%s); requests wait behind the health gate", endpoint, reason)
        if self.alerter:
            self.alerter.fire("server_down", f"{endpoint}: {reason}", endpoint=endpoint)
        self.heartbeat()
        timeout = self.cfg.engine.health_gate_timeout_s

        def on_attempt(n: int, r: Any) -> None:
            f = r.first_failure()
            self.servers[endpoint]["reason"] = f"{f.name} {f.status}: {f.evidence}" if f else "recovering"
            self.servers[endpoint]["probes"] = n

        try:
            await wait_until_healthy(endpoint, expected_model=self.engine.model, api_key=self.engine._api_key,
                                     timeout_s=timeout, poll_s=2.0, on_attempt=on_attempt,
                                     progress_window_s=0.5)
        except ServerUnhealthy as e:
            self._fail(ServerUnhealthy(f"{endpoint} stayed down for {timeout:.0f}s: {e}", e.report))
            raise
        down_s = time.time() - since
        self.servers[endpoint] = {"state": "up", "since": time.time(), "last_outage_s": round(down_s, 1)}
        self.engine.down.discard(endpoint)
        log.warning("server %s is back after %.0fs; resuming", endpoint, down_s)
        if self.alerter:
            self.alerter.fire("server_up", f"{endpoint} back after {down_s:.0f}s", endpoint=endpoint)
        return True

    @staticmethod
    def _err_key(err: EngineError) -> str:
        return f"http_{err.status}" if err.status else err.kind

    async def _generate_sample(self, run: DatasetRun, sample: Sample) -> dict[str, Any]:
        msgs = sample.messages
        mode = run.turns
        if any(m.get("role") == "tool" for m in msgs):
            mode = "last"  # tool results answer the original assistant's calls: keep that history
        history: list[dict[str, Any]] = []
        turns: list[dict[str, Any]] = []
        comps: list[Completion] = []

        async def gen() -> None:
            # The server sees no reasoning of earlier turns (chat templates drop it); the record keeps it.
            sent = [{k: v for k, v in m.items() if k != "reasoning"} if m.get("role") == "assistant" else m
                    for m in history]
            comp, attempts = await self._call(run, sample, sent)
            comps.append(comp)
            amsg: dict[str, Any] = {"role": "assistant", "content": comp.content}
            if comp.tool_calls:
                amsg["tool_calls"] = comp.tool_calls
            if comp.reasoning is not None:
                amsg["reasoning"] = comp.reasoning
            turns.append(
                {
                    "index": len(history),
                    "finish_reason": comp.finish_reason,
                    "usage": {"prompt_tokens": comp.prompt_tokens, "completion_tokens": comp.completion_tokens,
                              "reasoning_tokens": comp.reasoning_tokens},
                    "token_ids": comp.token_ids,
                    "prompt_token_ids": comp.prompt_token_ids,
                    "latency_s": round(comp.latency_s, 4),
                    "endpoint": comp.endpoint,
                    "attempts": attempts,
                }
            )
            history.append(amsg)

        if mode == "last":
            last_user = max(i for i, m in enumerate(msgs) if m.get("role") == "user")
            history.extend(msgs[: last_user + 1])
            await gen()
        elif mode == "first":
            first_user = min(i for i, m in enumerate(msgs) if m.get("role") == "user")
            history.extend(m for m in msgs[:first_user] if m.get("role") == "system")
            history.append(msgs[first_user])
            await gen()
        else:
            for m in msgs:
                if m.get("role") == "assistant":
                    continue  # replaced by the target's own answer
                history.append(m)
                if m.get("role") == "user":
                    await gen()
        last = comps[-1]
        rec: dict[str, Any] = {
            "id": sample.id,
            "dataset": run.ds.name,
            "messages": history,
            "content": last.content,
            "reasoning": last.reasoning,
            "finish_reason": last.finish_reason,
            "usage": {
                "prompt_tokens": sum(c.prompt_tokens for c in comps),
                "completion_tokens": sum(c.completion_tokens for c in comps),
            },
            "latency_s": round(sum(c.latency_s for c in comps), 4),
            "endpoint": last.endpoint,
            "model": last.model,
            "reasoning_mode": self.cfg.generate.reasoning,
            "sampling": {"max_tokens": run.sampling.max_tokens, "temperature": run.sampling.temperature,
                         "top_p": run.sampling.top_p, "seed": run.sampling.seed},
            "turns": turns,
            "attempts": sum(t["attempts"] for t in turns),
            "finished_unix": round(time.time(), 3),
        }
        if sample.tools:
            rec["tools"] = sample.tools
        if sample.meta:
            rec["meta"] = sample.meta
        return rec

    async def _handle(self, run: DatasetRun, sample: Sample, sem: asyncio.Semaphore) -> None:
        run.in_flight += 1
        try:
            try:
                rec = await self._generate_sample(run, sample)
            except SampleFailed as f:
                err = f.err
                run.journal.append_failed(
                    {
                        "id": sample.id,
                        "dataset": run.ds.name,
                        "attempts": f.attempts,
                        "error_kind": err.kind if isinstance(err, EngineError) else type(err).__name__,
                        "status": getattr(err, "status", None),
                        "error": str(err)[:1000],
                        "endpoint": getattr(err, "endpoint", ""),
                        "failed_unix": round(time.time(), 3),
                    }
                )
                log.info("%s: failed after %d attempt(s): %s", sample.id, f.attempts, err)
                return
            except (asyncio.CancelledError, DiskFull):
                raise
            except SpecopsError:
                # The run is stopping (server gone past the gate's timeout): not this sample's fault,
                # so it is neither recorded nor parked; a rerun sends it again.
                return
            except Exception as err:  # a bug or an engine-side surprise: park the sample, keep the run
                log.error("%s: unexpected error\n%s", sample.id, traceback.format_exc())
                run.journal.append_failed(
                    {"id": sample.id, "dataset": run.ds.name, "attempts": 1, "error_kind": "internal",
                     "status": None, "error": f"{type(err).__name__}: {err}"[:1000], "endpoint": "",
                     "failed_unix": round(time.time(), 3)}
                )
                return
            run.journal.append_record(rec)
            run.journal.maybe_sync()
            self._last_done_unix = rec["finished_unix"]
            self._advance(run)
        except DiskFull as e:
            self._fail(e)
        finally:
            run.in_flight -= 1
            sem.release()

    def _fail(self, err: BaseException) -> None:
        if self.fatal is None:
            self.fatal = err
            self.stop_reason = str(err)
        self.stop.set()

    # ---------------------------------------------------------------- one dataset
    async def _run_dataset(self, run: DatasetRun) -> None:
        sem = asyncio.Semaphore(run.concurrency)
        j = run.journal
        source = self._sources[run.ds.name]
        it = iter(source)
        items = 0
        exhausted = False
        while not self.stop.is_set():
            # Reading the source is synchronous; yield to the loop every item so responses flow.
            try:
                item = next(it)
            except StopIteration:
                exhausted = True
                break
            items += 1
            if isinstance(item, Quarantined):
                if item.where not in j.quarantine_keys:
                    try:
                        j.append_quarantine(
                            {"where": item.where, "dataset": item.dataset, "reason": item.reason,
                             "excerpt": item.excerpt[:500], "at": now_iso()}
                        )
                    except DiskFull as e:
                        self._fail(e)
                        break
                    self._advance(run)
                continue
            if item.id in j.done_ids or item.id in j.parked_ids:
                run.skipped += 1
                continue
            await sem.acquire()
            if self.stop.is_set():
                sem.release()
                break
            t = asyncio.create_task(self._handle(run, item, sem))
            run.tasks.add(t)
            t.add_done_callback(run.tasks.discard)
        if exhausted and items == 0:
            j.stats.empty_input = True
            log.warning("dataset %r: %s holds no records (an empty file or only blank lines): nothing to generate",
                        run.ds.name, ", ".join(source.paths) or f"source {run.ds.source!r}")
        if run.tasks and not self.stop.is_set():
            await asyncio.wait(set(run.tasks))
        run.finished = not self.stop.is_set()

    # ---------------------------------------------------------------- heartbeat and stats
    def _advance(self, run: DatasetRun) -> None:
        if self._progress is not None:
            self._progress.update(sum(self._settled(r) for r in self.runs.values()))

    @staticmethod
    def _settled(run: DatasetRun) -> int:
        s = run.journal.stats
        return s.done + s.failed + s.quarantined

    def heartbeat(self, state: str = "running") -> dict[str, Any]:
        now = time.time()
        done = sum(r.journal.stats.done for r in self.runs.values())
        toks = sum(r.journal.stats.completion_tokens for r in self.runs.values())
        self._window.append((now, done, toks))
        while len(self._window) > 2 and now - self._window[0][0] > self._window_s:
            self._window.popleft()
        t0, d0, k0 = self._window[0]
        dt = now - t0
        datasets = {}
        for name, r in self.runs.items():
            s = r.journal.stats
            datasets[name] = {
                "total": r.total,
                "done": s.done,
                "failed": s.failed,
                "quarantined": s.quarantined,
                "in_flight": r.in_flight,
                "completion_tokens": s.completion_tokens,
                "finished": r.finished,
                "empty_input": s.empty_input,
            }
        hb = {
            "pid": os.getpid(),
            "phase": "generate",
            "state": state,
            "engine": self.engine.name,
            "ts": now,
            "iso": now_iso(),
            "started": self.started,
            "in_flight": sum(r.in_flight for r in self.runs.values()),
            "last_done_unix": self._last_done_unix,
            "window": {
                "seconds": round(dt, 2),
                "samples_per_s": (done - d0) / dt if dt > 0 else None,
                "tokens_per_s": (toks - k0) / dt if dt > 0 else None,
            },
            "datasets": datasets,
            "servers": self.servers,
            "stop_reason": self.stop_reason,
        }
        atomic_write_json(self.campaign.heartbeat_path, hb, fsync=False)
        if self.on_heartbeat:
            self.on_heartbeat(hb)
        return hb

    def _watch_stall(self, hb: dict[str, Any]) -> None:
        """In flight but nothing completed for monitor.stall_s: say so loudly (log + alert)."""
        last = hb.get("last_done_unix") or hb["started"]
        idle = hb["ts"] - last
        if hb["in_flight"] and idle > self.cfg.monitor.stall_s:
            msg = f"stalled: {hb['in_flight']} samples in flight, no completion for {idle:.0f}s"
            if not getattr(self, "_stalled", False):
                log.warning(msg)
            self._stalled = True
            if self.alerter:
                self.alerter.fire("stall", msg)
        else:
            self._stalled = False

    def write_stats(self) -> None:
        for r in self.runs.values():
            r.journal.write_stats(r.total)

    async def _heartbeat_loop(self) -> None:
        interval = self.cfg.generate.heartbeat_interval_s
        last_stats = time.monotonic()
        last_log = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            try:
                for r in self.runs.values():
                    r.journal.maybe_sync()
                if time.monotonic() - last_stats >= self._stats_every_s:
                    self.write_stats()
                    last_stats = time.monotonic()
                hb = self.heartbeat()
                self._watch_stall(hb)
            except DiskFull as e:
                self._fail(e)
                return
            except OSError as e:
                log.warning("heartbeat write failed: %s", e)
                continue
            rate = hb["window"]["tokens_per_s"]
            if self._progress is not None:
                self._progress.update(tok_s=rate)
            if time.monotonic() - last_log >= 30:
                last_log = time.monotonic()
                parts = [f"{n} {d['done']}/{d['total']}" for n, d in hb["datasets"].items()]
                log.info("progress: %s; %s tok/s", ", ".join(parts), f"{rate:.0f}" if rate else "-", extra=ROUTINE)

    # ---------------------------------------------------------------- main
    async def run(self) -> GenerateSummary:
        self._sources: dict[str, Any] = {}
        self._progress = None
        self._open_datasets()
        loop = asyncio.get_running_loop()

        def on_signal(signame: str) -> None:
            if not self.stop.is_set():
                log.warning("%s received: stopping; in-flight samples will be redone on resume", signame)
                self.stop_reason = f"interrupted by {signame}"
                self.stop.set()

        # the CLI's handlers (SIGTERM as Ctrl-C: `cli.main`) come back after the run
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            loop.add_signal_handler(sig, on_signal, sig.name)
        hb_task = None
        exporter = None
        try:
            if self.cfg.monitor.metrics_port:
                exporter = await self._start_exporter()
            if self.manage_engine:
                await self.engine.start()
            self.heartbeat()
            hb_task = asyncio.create_task(self._heartbeat_loop())
            if self.progress:
                self._start_progress()
            work: list[Any]
            if self.cfg.generate.ordering == "interleaved":
                work = [self._run_dataset(r) for r in self.runs.values()]
                main = asyncio.gather(*work)
            else:
                async def sequential() -> None:
                    for r in self.runs.values():
                        if self.stop.is_set():
                            break
                        await self._run_dataset(r)
                main = asyncio.ensure_future(sequential())
            stopper = asyncio.ensure_future(self.stop.wait())
            await asyncio.wait({main, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if self.stop.is_set():
                # Cancel in-flight samples: not recorded, so a rerun sends them again.
                main.cancel()
                for r in self.runs.values():
                    for t in list(r.tasks):
                        t.cancel()
                pending = [t for r in self.runs.values() for t in r.tasks]
                await asyncio.gather(main, *pending, return_exceptions=True)
            else:
                await main
            stopper.cancel()
        finally:
            if hb_task:
                hb_task.cancel()
                await asyncio.gather(hb_task, return_exceptions=True)
            if exporter is not None:
                await exporter.cleanup()
            for sig, handler in previous.items():
                loop.remove_signal_handler(sig)
                if handler is not None:
                    signal.signal(sig, handler)
            if self._progress is not None:
                self._progress.stop()
            try:
                if self.manage_engine:
                    await self.engine.close()
            finally:
                final_state = "finished" if not self.stop.is_set() else (
                    "failed" if self.fatal else "interrupted")
                for r in self.runs.values():
                    try:
                        r.journal.write_stats(r.total)
                    except OSError as e:
                        log.error("could not write stats for %s: %s", r.ds.name, e)
                    r.journal.close()
                try:
                    self.heartbeat(final_state)
                except OSError:
                    pass
        summary = GenerateSummary(
            campaign=str(self.campaign.root),
            datasets={n: {**r.journal.stats.to_json(r.total), "skipped_at_start": r.skipped}
                      for n, r in self.runs.items()},
            elapsed_s=time.time() - self.started,
            interrupted=self.stop.is_set(),
        )
        if self.fatal is not None:
            raise self.fatal
        if self.stop.is_set():
            raise Interrupted(f"generate {self.stop_reason}; rerun the same command to resume")
        return summary

    # ---------------------------------------------------------------- Prometheus exporter
    def metrics_text(self) -> str:
        """Campaign metrics in the Prometheus text format (served on monitor.metrics_port)."""
        lines = []

        def metric(name: str, kind: str, help_: str, rows: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP specops_{name} {help_}")
            lines.append(f"# TYPE specops_{name} {kind}")
            lines.extend(f"specops_{name}{{{labels}}} {value}" for labels, value in rows)

        per = [(f'dataset="{n}"', r) for n, r in self.runs.items()]
        metric("samples_done_total", "counter", "samples recorded", [(lb, r.journal.stats.done) for lb, r in per])
        metric("samples_failed", "gauge", "samples parked in failed.jsonl", [(lb, r.journal.stats.failed) for lb, r in per])
        metric("samples_quarantined", "gauge", "bad input records", [(lb, r.journal.stats.quarantined) for lb, r in per])
        metric("samples_total", "gauge", "samples in the input", [(lb, r.total) for lb, r in per])
        metric("in_flight", "gauge", "samples being generated", [(lb, r.in_flight) for lb, r in per])
        metric("completion_tokens_total", "counter", "generated tokens",
               [(lb, r.journal.stats.completion_tokens) for lb, r in per])
        metric("retries_total", "counter", "retried attempts", [(lb, r.journal.stats.retries) for lb, r in per])
        metric("server_up", "gauge", "1 when the endpoint passes the health gate",
               [(f'endpoint="{ep}"', 0 if sv.get("state") == "down" else 1) for ep, sv in self.servers.items()])
        return "\n".join(lines) + "\n"

    async def _start_exporter(self):
        from aiohttp import web

        m = self.cfg.monitor
        app = web.Application()

        async def handle(_req: web.Request) -> web.Response:
            return web.Response(text=self.metrics_text(), content_type="text/plain")

        app.router.add_get("/metrics", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, m.metrics_host, m.metrics_port)
        await site.start()
        log.info("campaign metrics on http://%s:%d/metrics", m.metrics_host, m.metrics_port)
        return runner

    def _start_progress(self) -> None:
        """The bar over samples settled (done, failed or quarantined) of every dataset's total;
        _heartbeat_loop's "progress:" line (per-dataset counts) is the periodic plain line."""
        self._progress = phase_progress(
            "generate", sum(r.total for r in self.runs.values()), "samples", logger=log, every_s=None,
            done=sum(self._settled(r) for r in self.runs.values()),
        ).start()
