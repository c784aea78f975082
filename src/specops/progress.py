"""Progress of a long phase: a live bar on a terminal, plain log lines everywhere else.

`phase_progress(phase, total, unit)` returns a PhaseProgress (a context manager) that the phase
feeds with `advance(n, **figures)` or `update(done, **figures)`; figures are a few named numbers
shown beside the count (loss, tau, tok_s as "tok/s"), each kept until it is given again.

Where it goes is settled once, at start:

- the stream (stderr) is a terminal: a rich bar on it (done/total, rate, elapsed, ETA, figures),
  redrawn twice a second by rich's thread. While it shows, the log handlers that write to that same
  terminal print through it (above the bar, which stays whole), and records tagged ROUTINE (the
  phase's periodic progress lines, which the bar stands in for) are left off the terminal; file
  handlers such as run/runner.log still get every record.
- anything else (a pipe, a file, CI, a `--detach`ed run, SPECOPS_PROGRESS=plain, TERM=dumb):
  nothing is drawn and no escape sequence is written.

Either way, a plain line such as
    train: 120/1000 steps (12.0%), 3.20 steps/s, ETA 4m35s, elapsed 37s; loss 2.341, tau 2.31
goes through the phase's logger, tagged ROUTINE, at most once every `every_s` seconds and once at
the end, so logs get the rate and ETA too. A total of None (not known) degrades to a counter: no
bar, percentage or ETA. The rate is taken over the last RATE_WINDOW_S seconds, from this run's
start (a resumed phase passes `done=` what was finished before, which does not count as speed).

Costs: an update is a clock read and a lock (plus rich's own update while the bar shows), cheap
enough per optimizer step or per sample. Only one bar shows at a time per process; a second phase
progress opened while one shows logs plain lines only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections import deque
from typing import IO, Any

ROUTINE = {"specops_routine": True}  # log(..., extra=ROUTINE): a periodic line the bar stands in for
ENV = "SPECOPS_PROGRESS"  # "plain" (or off/0/no): never a bar; "bar": a bar even off a terminal
RATE_WINDOW_S = 30.0  # the rate (and so the ETA) is over this much recent time
SAMPLE_S = 0.5  # at most one rate sample per this many seconds (the window holds <= 61)
REFRESH_PER_S = 2.0

_live_lock = threading.Lock()
_live_owner: PhaseProgress | None = None  # the PhaseProgress whose bar shows now
_open: dict[str, PhaseProgress] = {}  # phase -> its started progress (current())


def phase_progress(phase: str, total: int | None, unit: str, *, logger: logging.Logger | None = None,
                   stream: IO[str] | None = None, force_tty: bool | None = None, every_s: float | None = 30.0,
                   done: int = 0, enabled: bool = True) -> PhaseProgress:
    """Progress of `phase` over `total` `unit`s (None: not known). `logger`: the phase's (default
    specops.<phase>). `stream`: where a bar would show (default: sys.stderr at start). `force_tty`:
    True/False decide bar or plain; None: a bar when the stream is a terminal, unless the
    environment says otherwise (module docstring). `every_s`: seconds between plain lines (None:
    only the end line, for a phase that logs its own periodic lines). `done`: already finished at
    start. `enabled=False` (say, a rank other than 0): shows and logs nothing, but on a terminal it
    still keeps this process's ROUTINE lines off it (another process's bar is there)."""
    return PhaseProgress(phase, total, unit, logger=logger, stream=stream, force_tty=force_tty, every_s=every_s,
                         done=done, enabled=enabled)


def current(phase: str) -> PhaseProgress:
    """The started progress of `phase` in this process, or one that does nothing: for a helper that
    logs the phase's routine lines from several call paths and has no handle on it."""
    return _open.get(phase) or PhaseProgress(phase, None, "", logger=None, stream=None, force_tty=False,
                                             every_s=None, done=0, enabled=False)


def wants_bar(stream: IO[str], force_tty: bool | None = None) -> bool:
    """Whether a bar should show on `stream` (see phase_progress's `force_tty`)."""
    if force_tty is not None:
        return force_tty
    env = os.environ.get(ENV, "").strip().lower()
    if env in ("plain", "off", "0", "no", "false"):
        return False
    if env in ("bar", "on", "1", "yes", "true"):
        return True
    if os.environ.get("TERM", "") == "dumb":
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or closed
        return False


def _same_file(a: Any, b: Any) -> bool:
    """a and b write to the same open file (device and inode, e.g. the same terminal)."""
    try:
        return os.path.samestat(os.fstat(a.fileno()), os.fstat(b.fileno()))
    except (AttributeError, ValueError, OSError):  # no fileno (StringIO, pytest's capture), or closed
        return False


def _drop_routine(record: logging.LogRecord) -> bool:
    return not getattr(record, "specops_routine", False)


def _stream_handlers() -> list[logging.StreamHandler]:
    """Every console-like handler (a StreamHandler that is not a FileHandler) of every logger."""
    loggers = [logging.getLogger()] + [lg for lg in list(logging.Logger.manager.loggerDict.values())
                                       if isinstance(lg, logging.Logger)]
    out: list[logging.StreamHandler] = []
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) and h not in out:
                out.append(h)
    return out


# ---------------------------------------------------------------- formatting


def fmt_count(n: float) -> str:
    """12 -> "12", 9999 -> "9999", 12345 -> "12.3k", 1234567 -> "1.23M"."""
    if abs(n) < 10_000:
        return f"{n:.0f}" if float(n).is_integer() else f"{n:.3g}"
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:.0f}"


def fmt_rate(r: float | None) -> str:
    if r is None:
        return "-"
    if r >= 10_000:
        return fmt_count(r)
    return f"{r:.0f}" if r >= 100 else f"{r:.1f}" if r >= 10 else f"{r:.2f}"


def fmt_duration(s: float | None) -> str:
    """37 -> "37s", 275 -> "4m35s", 7380 -> "2h03m"."""
    if s is None:
        return "-"
    s = max(0, int(round(s)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def fmt_figure(name: str, v: Any) -> str:
    label = name[:-2] + "/s" if name.endswith("_s") else name
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"{label} {v}"
    if isinstance(v, int) or abs(v) >= 10_000:
        return f"{label} {fmt_count(v)}"
    return f"{label} {f'{v:#.4g}'.rstrip('.')}"  # 4 significant digits, zeros kept: 1.000, 2.346


# ---------------------------------------------------------------- the progress


class PhaseProgress:
    """See phase_progress. `live`: the bar shows now."""

    def __init__(self, phase: str, total: int | None, unit: str, *, logger: logging.Logger | None,
                 stream: IO[str] | None, force_tty: bool | None, every_s: float | None, done: int, enabled: bool):
        self.phase, self.total, self.unit = phase, total, unit
        self.log = logger or logging.getLogger(f"specops.{phase}")
        self._stream, self._force, self.every_s, self.enabled = stream, force_tty, every_s, enabled
        self.done = self.done0 = done
        self.figures: dict[str, Any] = {}
        self._tallies: dict[str, list[float]] = {}  # name -> [sum of numerators, sum of denominators]
        self.live = False
        self.started = False
        self._lock = threading.RLock()
        self._samples: deque[tuple[float, float]] = deque()
        self._t0 = self._last_line = time.monotonic()
        self._progress: Any = None  # rich.progress.Progress while the bar shows
        self._task: Any = None
        self._handlers: list[tuple[logging.StreamHandler, Any]] = []  # (handler, its own stream) we re-pointed
        self._filtered: list[logging.StreamHandler] = []

    # ------------------------------------------------------------ life
    def __enter__(self) -> PhaseProgress:
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.stop(failed=exc_type is not None)

    def start(self) -> PhaseProgress:
        global _live_owner
        if self.started:
            return self
        self.started = True
        self._t0 = self._last_line = time.monotonic()
        self._samples.append((self._t0, self.done))
        if self.enabled:
            _open[self.phase] = self
        stream = self._stream if self._stream is not None else sys.stderr
        bar = wants_bar(stream, self._force)
        if not self.enabled:
            if bar:  # another process draws the bar on this terminal: keep our periodic lines off it
                self._filter_terminal(stream)
            return self
        if bar:
            with _live_lock:
                if _live_owner is None:
                    _live_owner = self
                else:
                    bar = False  # one bar at a time: this one logs plain lines
        if bar:
            try:
                self._start_bar(stream)
            except Exception as e:  # noqa: BLE001 - a display problem must not stop the phase
                self._restore_handlers()
                with _live_lock:
                    _live_owner = None
                self.log.warning("%s: progress bar unavailable (%s: %s); plain lines instead", self.phase,
                                 type(e).__name__, e)
        return self

    def stop(self, failed: bool = False) -> None:
        global _live_owner
        if not self.started:
            return
        self.started = False
        try:
            if self.enabled:
                self._end_line(time.monotonic(), failed)
            if self._progress is not None:
                with contextlib.suppress(Exception):
                    self._progress.update(self._task, completed=self.done, total=self.total)
                    self._progress.stop()
        finally:
            self._progress = None
            self.live = False
            self._restore_handlers()
            if _open.get(self.phase) is self:
                del _open[self.phase]
            with _live_lock:
                if _live_owner is self:
                    _live_owner = None

    def _start_bar(self, stream: IO[str]) -> None:
        from rich.console import Console
        from rich.file_proxy import FileProxy
        from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
        from rich.text import Text

        owner = self

        class Bar(BarColumn):
            def render(self, task: Any) -> Any:  # a counter when the total is not known: no pulsing bar
                return super().render(task) if task.total is not None else Text("")

        class Stats(ProgressColumn):
            def render(self, task: Any) -> Text:
                parts, figs = owner._parts(time.monotonic(), bar=True)
                # one line whatever the width: a narrow terminal loses the last figures, not the layout
                return Text("  ".join(parts + figs), no_wrap=True, overflow="ellipsis")

        console = Console(file=stream, force_terminal=True)
        self._progress = Progress(
            TextColumn("[bold]{task.description}"), Bar(bar_width=20), Stats(), console=console,
            refresh_per_second=REFRESH_PER_S, transient=False,
            redirect_stdout=_same_file(sys.stdout, stream), redirect_stderr=_same_file(sys.stderr, stream),
        )
        self._task = self._progress.add_task(self.phase, total=self.total, completed=self.done)
        # Log handlers on this terminal print through the console (above the bar) and leave ROUTINE
        # records to the bar; others (files, pipes, pytest's capture) are untouched.
        for h in _stream_handlers():
            if _same_file(h.stream, stream):
                self._handlers.append((h, h.stream))
                h.setStream(FileProxy(console, h.stream))
        self._filter_terminal(stream)
        self._progress.start()
        self.live = True

    def _filter_terminal(self, stream: IO[str]) -> None:
        """ROUTINE records off the handlers writing to `stream`'s file (a re-pointed one too: rich's
        proxy answers fileno() with the terminal's); one filtered already is left to its filterer."""
        for h in _stream_handlers():
            if _same_file(h.stream, stream) and _drop_routine not in h.filters:
                h.addFilter(_drop_routine)
                self._filtered.append(h)

    def _restore_handlers(self) -> None:
        for h, own in self._handlers:
            with contextlib.suppress(Exception):
                h.flush()
                h.setStream(own)
        for h in self._filtered:
            h.removeFilter(_drop_routine)
        self._handlers, self._filtered = [], []

    # ------------------------------------------------------------ feeding
    def advance(self, n: float = 1, **figures: Any) -> None:
        """`n` more units done (and these figures)."""
        if self.enabled:
            self.update(self.done + n, **figures)

    def update(self, done: float | None = None, *, total: Any = ..., **figures: Any) -> None:
        """Done so far (None: unchanged), optionally a new total, and figures (None drops one)."""
        if not self.enabled:
            return
        now = time.monotonic()
        with self._lock:
            if total is not ...:
                self.total = total
            if done is not None:
                self.done = done
                if not self._samples or now - self._samples[-1][0] >= SAMPLE_S:
                    self._samples.append((now, done))
                while len(self._samples) > 2 and self._samples[1][0] <= now - RATE_WINDOW_S:
                    self._samples.popleft()
            for k, v in figures.items():
                if v is None:
                    self.figures.pop(k, None)
                else:
                    self.figures[k] = v
            due = self.started and self.every_s is not None and now - self._last_line >= self.every_s
            if due:
                self._last_line = now  # under the lock: two threads never both log the same line
        prog = self._progress  # read once: stop() may clear it from another thread
        if prog is not None:
            prog.update(self._task, completed=self.done, total=self.total)
        if due:
            self._line(now)

    def tally(self, name: str, num: float, den: float) -> None:
        """Figure `name` = sum(num) / sum(den) over every call (a pooled mean, e.g. tau = accepted
        tokens + 1 summed over turns / target steps summed over turns)."""
        if not self.enabled:
            return
        with self._lock:
            t = self._tallies.setdefault(name, [0.0, 0.0])
            t[0] += num
            t[1] += den
            if t[1]:
                self.figures[name] = t[0] / t[1]

    # ------------------------------------------------------------ reading
    def rate(self, now: float | None = None) -> float | None:
        """Units per second over the recent window (None before any progress)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            t, d = self._samples[0] if self._samples else (self._t0, self.done0)
            dt = now - t
            return (self.done - d) / dt if dt > 1e-3 and self.done > d else None

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left at the current rate (None: no total, or no rate yet)."""
        if self.total is None:
            return None
        left = max(0.0, self.total - self.done)
        if not left:
            return 0.0
        r = self.rate(now)
        return left / r if r else None

    def _parts(self, now: float, *, bar: bool = False) -> tuple[list[str], list[str]]:
        """(["120/1000 steps (12.0%)", "3.20 steps/s", "ETA 4m35s", "elapsed 37s"], ["loss 2.341", ...]);
        for the bar (bar=True) no percentage (the bar shows it) and, given a total, no elapsed time
        (the ETA matters more in 80 columns)."""
        with self._lock:
            done, total, figures = self.done, self.total, dict(self.figures)
        count = f"{fmt_count(done)}/{fmt_count(total)}" if total is not None else fmt_count(done)
        parts = [f"{count} {self.unit}" + (f" ({100.0 * done / total if total else 100.0:.1f}%)"
                                           if not bar and total is not None else "")]
        parts.append(f"{fmt_rate(self.rate(now))} {self.unit}/s")
        if total is not None:
            parts.append(f"ETA {fmt_duration(self.eta(now))}")
        if not (bar and total is not None):
            parts.append(f"elapsed {fmt_duration(now - self._t0)}")
        return parts, [fmt_figure(k, v) for k, v in figures.items()]

    def line(self, now: float | None = None) -> str:
        """The plain line, as logged."""
        parts, figs = self._parts(time.monotonic() if now is None else now)
        return f"{self.phase}: {', '.join(parts)}" + (f"; {', '.join(figs)}" if figs else "")

    def _line(self, now: float) -> None:
        self.log.info("%s", self.line(now), extra=ROUTINE)

    def _end_line(self, now: float, failed: bool) -> None:
        """The last line, e.g. `train: finished at 1000/1000 steps after 5m12s (3.21 steps/s); loss 2.01`
        with this run's average rate; "stopped" after an exception, "ended" short of the total (or
        with none known)."""
        with self._lock:
            done, total, figures = self.done, self.total, dict(self.figures)
        end = "stopped" if failed else "finished" if total is not None and done >= total else "ended"
        elapsed = now - self._t0
        avg = (done - self.done0) / elapsed if elapsed > 1e-3 and done > self.done0 else None
        count = f"{fmt_count(done)}/{fmt_count(total)}" if total is not None else fmt_count(done)
        figs = ", ".join(fmt_figure(k, v) for k, v in figures.items())
        self.log.info("%s: %s at %s %s after %s (%s %s/s)%s", self.phase, end, count, self.unit,
                      fmt_duration(elapsed), fmt_rate(avg), self.unit, f"; {figs}" if figs else "", extra=ROUTINE)
