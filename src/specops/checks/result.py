"""CheckResult: one verdict of a flight check, shared by preflight, health and status."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["go", "warn", "nogo", "info"]

# Severity order for combining verdicts; "info" is evidence that changes nothing (e.g. no GPU on a
# CPU-only plan), so it ranks with "go".
SEVERITY: dict[str, int] = {"info": 0, "go": 0, "warn": 1, "nogo": 2}


@dataclass(slots=True)
class CheckResult:
    name: str  # stable, dotted: "gpu3", "disk.features", "model.config", "port.8000"
    status: Status
    message: str  # one line a human acts on: what, where, how much
    data: dict[str, Any] = field(default_factory=dict)  # the evidence, JSON-serialisable

    def __post_init__(self) -> None:
        assert self.status in SEVERITY, self.status

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "message": self.message, "data": self.data}


def worst(results: list[CheckResult]) -> str:
    """The most severe status among `results` ("go" for none)."""
    status = "go"
    for r in results:
        if SEVERITY[r.status] > SEVERITY[status]:
            status = r.status
    return status


def fmt_bytes(n: float | int | None) -> str:
    """Decimal units (1 GB = 1e9 bytes), as disk vendors and `df -H` count."""
    if n is None:
        return "?"
    x = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(x) < 1000 or unit == "PB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    raise AssertionError("unreachable")
