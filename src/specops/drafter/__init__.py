"""Drafters: the families (families/: model, objective, drafting rule, export formats, serve flags
behind one interface), and what they share: training (train.py, batch.py, losses.py, graphs.py,
optim.py, checkpoint.py), the export phase (export.py) and the file layouts (formats.py)."""

from .model import DrafterConfig, Eagle3Drafter

__all__ = ["DrafterConfig", "Eagle3Drafter"]
