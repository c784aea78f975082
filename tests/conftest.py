"""Shared fixtures. Helpers for specific areas live in their own test modules."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("SPECOPS_DATA_DIR", REPO.parent / "shared" / "data"))
PYTHON = sys.executable

# Never reach a hub: transformers and huggingface_hub must work from local files only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def shared_data() -> Path:
    if not (SHARED_DATA / "spec_bench" / "question.jsonl").is_file():
        pytest.fail(f"shared data not found at {SHARED_DATA} (set SPECOPS_DATA_DIR)")
    return SHARED_DATA


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: one intra-op thread is ~10x faster than two busy-waiting ones on a shared 2-core
    box. Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

