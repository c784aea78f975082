"""Evaluate a drafter: a real speculative-decoding loop (specdec.py) and the campaign report (report.py).

Names resolve lazily, so the report can be written without importing torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_eval", "speculative_generate", "target_generate", "summarize", "write_report"]


def __getattr__(name: str) -> Any:
    if name == "write_report":
        from .report import write_report

        return write_report
    if name in __all__:
        from . import specdec

        return getattr(specdec, name)
    raise AttributeError(name)
