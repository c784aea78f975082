"""EAGLE-3 drafter: architecture (model.py), training with training-time test (train.py), export (export.py)."""

from .model import DrafterConfig, Eagle3Drafter

__all__ = ["DrafterConfig", "Eagle3Drafter"]
