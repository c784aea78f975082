"""Training curves of several runs on the same data (e.g. the lr sweep) -> two SVG line charts.

    python bench/quality/plot_lr.py OUT_DIR LABEL=METRICS.jsonl [LABEL=METRICS.jsonl ...]

Writes OUT_DIR/lr_loss.svg (train loss per step) and OUT_DIR/lr_tau.svg (simulated tau from each
logged step's per-position accuracy, val points included), one line per run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from specops.evaluate.report import line_chart, training_curves  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not all("=" in a for a in argv[1:]):
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    runs = {label: training_curves(Path(path)) for label, path in (a.split("=", 1) for a in argv[1:])}
    loss = {f"{label} train": c["train_loss"] for label, c in runs.items()}
    tau = {f"{label} {split}": c[f"{split}_tau"] for label, c in runs.items() for split in ("train", "val")}
    (out / "lr_loss.svg").write_text(line_chart("training loss", loss, xlabel="step", ylabel="loss (7 TTT steps)"))
    (out / "lr_tau.svg").write_text(line_chart("simulated tau (train windows, val at the end)", tau, xlabel="step",
                                               ylabel="tau", markers=True))
    for label, c in runs.items():
        v = c["val_tau"][-1][1] if c["val_tau"] else None
        print(f"{label}: {len(c['train_loss'])} train points, final val tau {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
