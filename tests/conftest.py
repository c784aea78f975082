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

# Under pytest-xdist (scripts/test.sh runs the default suite on 2 processes) each process computes on
# one intra-op thread: two processes of two busy-waiting threads each on 2 cores spin more than they
# compute. Subprocesses the tests start keep their own defaults.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)

# Test files that start vLLM servers or fit drafters, longest first: collected first, so that with
# `--dist loadfile --no-loadscope-reorder` they start at once on separate processes and the short
# files fill in behind them instead of one long file ending the run alone.
FIRST = ("test_serve_drafter.py", "test_serve_peagle.py", "test_serve_dflash.py", "test_served_extract.py",
         "test_served_mla.py", "test_vllm_real.py", "test_vllm_cpu_fixes.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: file order kept otherwise


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")  # session: module fixtures that start servers need it too
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


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The interpreter of the vLLM environment (`scripts/test.sh` builds it). Absent, a test that
    needs it skips, with the reason, on a developer's machine only: under CI, or when
    SPECOPS_VLLM_PYTHON / SPECOPS_VLLM_VENV names one that does not work, it fails instead."""
    from specops.serverproc import VllmServerError, find_vllm_python

    try:
        return str(find_vllm_python())
    except VllmServerError as e:
        if os.environ.get("CI"):
            pytest.fail(f"{e} [CI is set: the vLLM environment is required]")
        if os.environ.get("SPECOPS_VLLM_PYTHON") or os.environ.get("SPECOPS_VLLM_VENV"):
            pytest.fail(str(e))  # explicitly configured but broken: not a reason to skip
        pytest.skip(f"vLLM environment absent (./scripts/test.sh builds it): {e}")



@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    """builders.chat_llama: an 8-layer random Llama with SmolLM2's tokenizer, for whole-chain runs."""
    from builders import chat_llama

    return chat_llama(tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved tiny target, its greedy sequences, and a features/ + build/ pair to copy into campaigns."""
    from train_builders import greedy_sequences, load_target, make_target, write_build, write_features

    root = tmp_path_factory.mktemp("tiny")
    target_dir = make_target(root / "target")
    model = load_target(target_dir)
    train = greedy_sequences(model, 12, seed=1)
    val = greedy_sequences(model, 4, seed=2)
    data = root / "data"
    write_features(model, train, data / "features" / "train")
    write_features(model, val, data / "features" / "val")
    write_build({"train": train, "val": val}, data / "build")
    return {"target": target_dir, "model": model, "train": train, "val": val, "data": data}
