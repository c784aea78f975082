"""campaign.toml validation: every mistake is one clear line naming the key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specops.config import config_from_dict, dump_toml, load_config
from specops.errors import ConfigError

BASE = {"datasets": [{"name": "a", "source": "spec_bench"}]}


def cfg(**sections):
    d = {k: v for k, v in BASE.items()}
    d.update(sections)
    return config_from_dict(d)


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"datasets": [{"name": "a", "source": "spec_bench", "limt": 3}]}, "datasets[0].limt: unknown key (did you mean 'limit'?)"),
        ({"datasets": [{"name": "a", "source": "spec_bench", "limit": "ten"}]}, "datasets[0].limit: expected an integer, got 'ten'"),
        ({"datasets": [{"name": "a", "source": "spec_bench", "limit": 0}]}, "datasets[0].limit: must be > 0"),
        ({"datasets": [{"name": "a", "source": "nope"}]}, "datasets[0].source: unknown source 'nope'"),
        ({"datasets": [{"name": "a", "path": "/does/not/exist.jsonl"}]}, "datasets[0].path: not found"),
        ({"datasets": [{"name": "a"}]}, "datasets[0].path: required when source = 'file'"),
        ({"datasets": [{"source": "gsm8k"}]}, "datasets[0].name: required key is missing"),
        ({"datasets": [{"name": "a", "source": "gsm8k"}, {"name": "a", "source": "gsm8k"}]}, "duplicate dataset name"),
        ({"datasets": []}, "datasets: at least one"),
        ({**BASE, "engine": {"kind": "openai"}}, "engine.endpoints: required"),
        ({**BASE, "engine": {"kind": "vllm"}}, "engine.kind: expected one of 'local', 'openai', got 'vllm'"),
        ({**BASE, "engine": {"kind": "openai", "endpoints": ["localhost:8000"]}}, "engine.endpoints[0]: expected an http(s) URL"),
        ({**BASE, "engine": {"api_key_env": "sk-abc123 secret"}}, "engine.api_key_env: expected the NAME"),
        ({**BASE, "generate": {"reasoning": "yes"}}, "generate.reasoning: expected one of 'save', 'off'"),
        ({**BASE, "generate": {"top_p": 1.5}}, "generate.top_p: must be in (0, 1]"),
        ({**BASE, "generate": {"concurrency": True}}, "generate.concurrency: expected an integer, got True"),
        ({**BASE, "target": {"model": "/no/such/model"}}, "target.model: not found"),
        ({**BASE, "bogus": {}}, "bogus: unknown key"),
        ({**BASE, "eval": {"workers": 0}}, "eval.workers: must be >= 1 (worker processes on the eval device), got 0"),
        ({**BASE, "eval": {"workers": -2}}, "eval.workers: must be >= 1"),
        ({**BASE, "eval": {"workers": "4"}}, "eval.workers: expected an integer, got '4'"),
        ({**BASE, "eval": {"workers": True}}, "eval.workers: expected an integer, got True"),
        ({**BASE, "eval": {"workers": 2.0}}, "eval.workers: expected an integer, got 2.0"),
        ({**BASE, "train": {"cuda_graphs": "yes"}}, "train.cuda_graphs: expected true or false or one of 'auto', got 'yes'"),
        ({**BASE, "train": {"graph_bucket": 0}}, "train.graph_bucket: must be > 0"),
        ({**BASE, "train": {"optimizer": "sgd"}}, "train.optimizer: expected one of 'adamw', 'muon', got 'sgd'"),
        ({**BASE, "train": {"lr_schedule": "step"}}, "train.lr_schedule: expected one of 'cosine', 'linear'"),
    ],
)
def test_errors_name_the_key(data, needle):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_defaults_and_overrides(tmp_path):
    p = tmp_path / "c.toml"
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    p.write_text(
        '[campaign]\nname = "x"\n[generate]\nmax_tokens = 64\nconcurrency = 4\n'
        '[[datasets]]\nname = "p"\npath = "prompts.jsonl"\nmax_tokens = 8\n'
        '[[datasets]]\nname = "q"\nsource = "gsm8k"\nconcurrency = 32\n'
    )
    c = load_config(p)
    assert c.datasets[0].path == str(tmp_path / "prompts.jsonl")  # relative to the config file
    assert c.sampling_for(c.datasets[0]).max_tokens == 8
    assert c.sampling_for(c.datasets[1]).max_tokens == 64
    assert c.concurrency_for(c.datasets[0]) == 4 and c.concurrency_for(c.datasets[1]) == 32
    assert c.campaign_dir() == tmp_path / "campaigns" / "x"
    # The resolved config round-trips through TOML.
    again = config_from_dict(__import__("tomllib").loads(dump_toml(c.to_dict())))
    assert again.to_dict() == c.to_dict()


def test_eval_workers_default_and_override():
    assert cfg().eval.workers == 1
    assert cfg(eval={"workers": 8}).eval.workers == 8
    import dataclasses

    from specops.config import EvalSection

    with pytest.raises(ConfigError, match="eval.workers: must be >= 1"):
        dataclasses.replace(EvalSection(), workers=0)  # the CLI's --workers override goes through here


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[campaign\nname=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_cli_prints_one_line_and_exits_nonzero(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[[datasets]]\nname = "a"\nsource = "gsm8k"\nlimit = "ten"\n')
    out = subprocess.run([sys.executable, "-m", "specops", "generate", str(p)], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip() == "ConfigError: datasets[0].limit: expected an integer, got 'ten'"


def test_train_cuda_graphs_is_auto_unless_set():
    assert cfg().train.cuda_graphs == "auto"
    assert cfg(train={"cuda_graphs": False}).train.cuda_graphs is False
    assert cfg(train={"cuda_graphs": True, "graph_bucket": 64}).train.graph_bucket == 64


@pytest.mark.parametrize(
    "sections, needle",
    [
        ({"train": {"drafter": ["eagle3", "dflsh"]}},
         "train.drafter: unknown drafter family 'dflsh' (did you mean 'dflash'?)"),
        ({"train": {"drafter": ["eagle3", "dflash", "eagle3"]}}, "train.drafter: 'eagle3' is listed twice"),
        ({"train": {"drafter": []}}, "train.drafter: an empty list"),
        ({"train": {"drafter": 3}}, "train.drafter: expected a string or a list, got 3"),
        ({"train": {"drafter": ["eagle3", "dflash"]}, "eval": {"batch_size": 4, "baseline": False}},
         "eval.batch_size > 1: the batched loop has no DFlash runner, and train.drafter lists \"dflash\""),
        ({"train": {"drafter": "eagle3", "mask_token_id": 2}}, "train.mask_token_id: EAGLE-3 drafts from its own"),
        ({"train": {"drafter": ["eagle3", "peagle"]}, "serve": {"engine": "sglang"}, "eval": {"served": True}},
         "eval.served with serve.engine = \"sglang\": SGLang serves no P-EAGLE drafter"),
        ({"train": {"drafter": ["eagle3", "dflash"]}, "eval": {"drafter": "/some/export"}},
         "eval.drafter: names one drafter, and train.drafter lists 2 families (eagle3, dflash)"),
        ({"train": {"drafter": ["eagle3", "dflash"]}, "eval": {"server_url": "http://127.0.0.1:8000/v1"}},
         "eval.server_url: a running server holds one drafter"),
        ({"train": {"drafter": ["eagle3", "dflash"]}, "serve": {"drafter": "export:speculators"},
          "eval": {"served": True}}, "serve.drafter = 'export:speculators': the served eval of several families"),
    ],
)
def test_drafter_family_lists_are_checked_at_load(sections, needle):
    with pytest.raises(ConfigError) as e:
        cfg(**sections)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_list_of_families_loads_in_order_and_round_trips(tmp_path):
    c = cfg(train={"drafter": ["dflash", "eagle3"], "mask_token_id": 2})
    assert c.train.families == ("dflash", "eagle3")
    assert cfg(train={"drafter": "peagle"}).train.families == ("peagle",)
    (tmp_path / "c.toml").write_text(dump_toml(c.to_dict()))
    assert load_config(tmp_path / "c.toml").train.families == ("dflash", "eagle3")


def test_the_two_families_example_is_the_quickstart_with_two_drafters(tmp_path):
    """examples/two-families.toml opens the quickstart's campaign: every setting but train.drafter
    equal, so the quickstart's phases stay done and only DFlash runs; `specops preflight` takes it."""
    import os

    ex = Path(__file__).resolve().parents[1] / "examples"
    qs, two = load_config(ex / "quickstart.toml"), load_config(ex / "two-families.toml")
    assert two.train.families == ("eagle3", "dflash") and qs.train.families == ("eagle3",)
    a, b = qs.to_dict(), two.to_dict()
    assert b["train"].pop("drafter") == ["eagle3", "dflash"] and a["train"].pop("drafter", "eagle3") == "eagle3"
    assert a == b and qs.campaign_dir() == two.campaign_dir()
    src = Path(__file__).resolve().parents[1] / "src"
    out = subprocess.run([sys.executable, "-m", "specops", "preflight", str(ex / "two-families.toml"), "--json",
                          "--phases", "train"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1",
                              "TRANSFORMERS_OFFLINE": "1"})
    assert out.returncode in (0, 1), out.stdout[-2000:] + out.stderr[-2000:]  # 1: warnings (a shared host)
    rep = json.loads(out.stdout)
    assert rep["campaign_dir"] == str(qs.campaign_dir()) and rep["status"] in ("go", "warn")
    assert {"model.config": "go"}.items() <= {r["name"]: r["status"] for r in rep["results"]}.items()
