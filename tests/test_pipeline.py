"""`specops run` end to end on a tiny random target (local engine, CPU): every phase, then a rerun
that skips them all; a failing gate stops before the phase."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specops.config import config_from_dict
from specops.models import resolve_model_dir
from specops.pipeline import GateFailed, run_all

STOP_AT = "eval"


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2")))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    d = tmp_path_factory.mktemp("tiny") / "target"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def make_cfg(tmp_path: Path, target: Path, **extra):
    data = {
        "campaign": {"name": "pipe", "dir": str(tmp_path / "camp")},
        "target": {"model": str(target), "dtype": "float32"},
        "engine": {"kind": "local", "batch_size": 4, "max_model_len": 512},
        "generate": {"max_tokens": 24, "reasoning": "off", "expect_truncation": True, "canary_samples": 1,
                     "turns": "first"},
        "build": {"draft_vocab_size": 256, "max_length": 256},
        "train": {"ttt_steps": 2, "batch_tokens": 512, "warmup_steps": 1, "total_steps": 3, "log_every": 1,
                  "eval_every": 3, "checkpoint_every": 3},
        "datasets": [{"name": "sg", "source": "sharegpt", "limit": 10}],
    }
    for k, v in extra.items():
        data.setdefault(k, {}).update(v)
    return config_from_dict(data)


def test_full_pipeline_then_resume_skips_everything(tmp_path, tiny_target):
    cfg = make_cfg(tmp_path, tiny_target, eval={"datasets": ["mtbench"], "limit_per_dataset": 2, "k": 2,
                                               "max_new_tokens": 12})
    res = run_all(cfg, stop=STOP_AT, progress=False)
    camp = tmp_path / "camp"
    m = json.loads((camp / "manifest.json").read_text())
    for phase in ("generate", "build", "extract", "train", "export", "eval")[: 1 + ("generate", "build", "extract", "train", "export", "eval").index(STOP_AT)]:
        assert m["phases"][phase]["state"] == "done", (phase, m["phases"][phase])
    assert res["generate"]["sg"]["done"] == 10
    assert (camp / "features" / "train" / "index.json").is_file()
    assert (camp / "drafter" / "export" / "vllm" / "config.json").is_file()
    assert [e for e in m["events"] if e["kind"] == "preflight"], "a gate ran before the phases"
    again = run_all(cfg, stop=STOP_AT, progress=False)
    assert all(v == "skipped (done)" for v in again.values()), again


def test_gate_stops_before_the_phase(tmp_path, tiny_target, monkeypatch):
    import shutil
    from functools import partial

    import specops.preflight as pf

    cfg = make_cfg(tmp_path, tiny_target)

    def tiny_disk(path):
        u = shutil.disk_usage(path)
        return type(u)(u.total, u.total - 1000, 1000)  # 1 kB free

    monkeypatch.setattr(pf, "run_preflight", partial(pf.run_preflight, disk_usage=tiny_disk))
    with pytest.raises(GateFailed, match="no-go"):
        run_all(cfg, stop="build", progress=False)
    m = json.loads((tmp_path / "camp" / "manifest.json").read_text())
    assert m["phases"]["generate"]["state"] == "pending"  # nothing started
    assert not (tmp_path / "camp" / "generate").exists()
