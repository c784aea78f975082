"""Run speculators' own CLI unmodified (`from speculators.cli import app; app()`), capturing its logs.

    PYTHONPATH=<speculators wheels dir> python3 bench/quality/speculators_launch.py LOG_DIR train ARGS...

Before the CLI starts, one handler goes on the ROOT logger. Nothing of speculators is changed: its
`setup_root_logger` calls `logging.basicConfig`, which leaves a root logger that already has a
handler alone (so the rich console handler is not added), and its `setup_metric_logger`
(dictConfig) configures only the `speculators*` loggers, whose records still propagate to root.
The handler writes
  LOG_DIR/train.log        every record as plain text, with a wall-clock stamp
  LOG_DIR/metrics.jsonl    every dict-valued record (speculators' metric records:
                           {"train": ..., "profile": {"step_ms", "tokens_per_s", ...}, "epoch",
                           "lr", "global_step"} per logged step, {"val": ..., "epoch"} per epoch)
                           as one JSON line with "t" (time.time()) added
Both are also echoed to stderr (text only).

SPECOPS_SPECULATORS_CPU_SHIM=1 (CPU proof runs only; never on a GPU): speculators 0.9.0 cannot
train without an accelerator: speculators/train/trainer.py:348 `self.model.to(self.local_rank)`
with local_rank the int 0 raises "RuntimeError: Cannot access accelerator device when none is
available." (no flag or environment variable changes that: train/distributed.py always sets an
int), and its step timer calls torch.accelerator.synchronize(), which raises the same. The shim
rebinds the trainer module's `get_local_rank` to return "cpu" and makes
torch.accelerator.synchronize a no-op when no accelerator exists. CUDA autocast is then disabled
by torch (compute in fp32): pass --hidden-states-dtype float32 on CPU.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path


class _Capture(logging.Handler):
    def __init__(self, log_dir: Path):
        super().__init__(logging.INFO)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.text = open(log_dir / "train.log", "a", buffering=1)
        self.jsonl = open(log_dir / "metrics.jsonl", "a", buffering=1)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
            if isinstance(record.msg, Mapping):
                row = {"t": record.created, **_plain(record.msg)}
                self.jsonl.write(json.dumps(row) + "\n")
                line = f"{stamp} {record.name} {json.dumps(_plain(record.msg))}"
            else:
                line = f"{stamp} {record.levelname} {record.name}: {record.getMessage()}"
            self.text.write(line + "\n")
            print(line, file=sys.stderr, flush=True)
        except Exception:  # a log line must never kill the run
            self.handleError(record)


def _plain(x):
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def _cpu_shim() -> None:
    import torch

    import speculators.train.trainer as trainer

    trainer.get_local_rank = lambda: "cpu"
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *a, **k: None
    print("speculators_launch: CPU shim on (trainer.get_local_rank -> 'cpu', accelerator.synchronize no-op)",
          file=sys.stderr)


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    log_dir = Path(sys.argv[1])
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(_Capture(log_dir))
    if os.environ.get("SPECOPS_SPECULATORS_CPU_SHIM") == "1":
        _cpu_shim()
    from speculators.cli import app

    sys.argv = ["speculators", *sys.argv[2:]]
    app()


if __name__ == "__main__":
    main()
