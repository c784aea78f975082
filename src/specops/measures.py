"""Acceptance measures shared by train (its val pass), the report and the benches. No torch."""

from __future__ import annotations

from collections.abc import Sequence


def simulated_tau(acc: Sequence[float]) -> float:
    """Mean accepted tokens per target step for a chain of len(acc) drafts at temperature 0, from
    the per-position accuracy of teacher-forced drafting: 1 + sum_k prod_{i<=k} acc_i."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau
