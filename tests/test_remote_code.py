"""target.trust_remote_code: a tokenizer directory whose auto_map names code the test writes itself
(SmolLM2's tokenizer.json behind a class of its own, as Kimi-K2 ships a tiktoken class), refused
with the files and the setting named while the setting is off, built with it on; preflight shows it
and the manifest records it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from specops.errors import ConfigError
from specops.models import resolve_model_dir
from specops.target.hf import load_config, load_tokenizer, remote_code

CODE = '''
from pathlib import Path

from tokenizers import Tokenizer
from transformers import TokenizersBackend


class ProbeTokenizer(TokenizersBackend):
    """SmolLM2's tokenizer.json, loaded by this class itself; leaves a mark that it ran."""

    def __init__(self, *args, **kwargs):
        kwargs["tokenizer_object"] = Tokenizer.from_file(str(Path(kwargs["name_or_path"]) / "tokenizer.json"))
        super().__init__(*args, **kwargs)
        Path({mark!r}).write_text(type(self).__name__)
'''


def probe_tokenizer(d: Path, mark: Path) -> Path:
    """A tokenizer directory: SmolLM2's files, tokenizer_config.json pointing at tokenization_probe.py."""
    src = resolve_model_dir("smollm2")
    d.mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / f, d / f)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.update(tokenizer_class="ProbeTokenizer", auto_map={"AutoTokenizer": [None, "tokenization_probe.ProbeTokenizer"]})
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "tokenization_probe.py").write_text(CODE.format(mark=str(mark)))
    return d


@pytest.fixture
def modules_cache(tmp_path, monkeypatch):
    """transformers copies remote code under HF_MODULES_CACHE: the test's own directory, in this
    process (read at import: already set where the suite starts it) and in the CLI's."""
    d = tmp_path / "hf-modules"
    monkeypatch.setenv("HF_MODULES_CACHE", str(d))
    import transformers.utils.hub as hub
    import transformers.dynamic_module_utils as dmu

    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(d), raising=False)
    monkeypatch.setattr(hub, "HF_MODULES_CACHE", str(d), raising=False)
    return d


def test_the_gate_refuses_shipped_code_unless_asked_and_names_the_files(tmp_path, modules_cache):
    mark = tmp_path / "ran"
    d = probe_tokenizer(tmp_path / "tok", mark)
    assert remote_code(d, "tokenizer") == ["tokenization_probe.ProbeTokenizer"]
    assert remote_code(d, "config") == [] and remote_code(resolve_model_dir("smollm2"), "tokenizer") == []
    with pytest.raises(ConfigError) as e:
        load_tokenizer(d)
    assert str(e.value) == (f"{d}: its tokenizer is code shipped with the model (tokenization_probe.ProbeTokenizer; "
                            "tokenization_probe.py); set target.trust_remote_code = true to run it")
    assert not mark.exists()  # refused before anything ran
    tok = load_tokenizer(d, trust_remote_code=True)
    ref = load_tokenizer(resolve_model_dir("smollm2"))
    assert type(tok).__name__ == mark.read_text() == "ProbeTokenizer"
    msgs = [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven is prime."}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs)
    # a config class of the model's own: the same gate
    m = tmp_path / "model"
    m.mkdir()
    cfg = json.loads((resolve_model_dir("smollm2") / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**cfg, "model_type": "probe_llama",
                                               "auto_map": {"AutoConfig": "configuration_probe.ProbeConfig"}}))
    (m / "configuration_probe.py").write_text("from transformers import LlamaConfig\n\n\nclass ProbeConfig(LlamaConfig):\n"
                                             "    model_type = 'probe_llama'\n")
    with pytest.raises(ConfigError, match=r"its config is code shipped with the model \(configuration_probe"):
        load_config(m)
    assert type(load_config(m, trust_remote_code=True)).__name__ == "ProbeConfig"


def _records(n: int = 12) -> str:
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]
        out.append({"id": f"qa/{i}", "dataset": "qa", "messages": msgs, "content": msgs[1]["content"],
                    "reasoning": None, "finish_reason": "stop", "usage": {"prompt_tokens": 10, "completion_tokens": 8},
                    "latency_s": 0.1, "endpoint": "local", "model": "smollm2", "reasoning_mode": "off", "sampling": {},
                    "turns": [{"index": 1, "finish_reason": "stop", "token_ids": None, "prompt_token_ids": None}],
                    "attempts": 1, "finished_unix": 1.0})
    return "".join(json.dumps(r) + "\n" for r in out)


def _campaign(tmp_path: Path, name: str, tokenizer: Path | None, trust: bool) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    tok = f'tokenizer = "{tokenizer}"\n' if tokenizer else ""
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(f'[campaign]\nname = "{name}"\ndir = "{tmp_path / name}"\n'
                   f'[target]\nmodel = "smollm2"\n{tok}trust_remote_code = {str(trust).lower()}\n'
                   f'[build]\nval_fraction = 0.25\nmax_length = 64\ndraft_vocab_size = 64\n'
                   f'[[datasets]]\nname = "qa"\npath = "{prompts}"\n')
    d = tmp_path / name / "generate" / "qa"
    d.mkdir(parents=True)
    (d / "records.jsonl").write_text(_records())
    return cfg


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specops", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_build_with_a_remote_code_tokenizer(tmp_path, modules_cache):
    mark = tmp_path / "ran"
    tok = probe_tokenizer(tmp_path / "tok", mark)
    env = {"HF_MODULES_CACHE": str(modules_cache)}

    # off: preflight says no-go, build refuses with the files and the setting, the records stay
    off = _campaign(tmp_path, "off", tok, trust=False)
    pf = _cli("preflight", str(off), "--phases", "build", "--json", env=env)
    row = {r["name"]: r for r in json.loads(pf.stdout)["results"]}["model.remote_code"]
    assert pf.returncode == 2 and row["status"] == "nogo", pf.stdout
    assert "tokenizer: tokenization_probe.ProbeTokenizer" in row["message"]
    assert "set target.trust_remote_code = true" in row["message"]
    b = _cli("build", str(off), env=env)
    assert b.returncode != 0 and "set target.trust_remote_code = true to run it" in b.stderr, b.stderr[-2000:]
    assert "tokenization_probe.py" in b.stderr and "Traceback" not in b.stderr
    assert not mark.exists() and not (tmp_path / "off" / "build" / "manifest.json").exists()
    assert (tmp_path / "off" / "generate" / "qa" / "records.jsonl").read_text() == _records()

    # on: preflight shows what it will run, build runs the class and builds what SmolLM2's own tokenizer builds
    on = _campaign(tmp_path, "on", tok, trust=True)
    pf = _cli("preflight", str(on), "--phases", "build", "--json", env=env)
    row = {r["name"]: r for r in json.loads(pf.stdout)["results"]}["model.remote_code"]
    assert row["status"] == "go" and row["message"] == (
        "target.trust_remote_code = true: runs the model directory's own code "
        "(tokenizer: tokenization_probe.ProbeTokenizer)"), row
    b = _cli("run", str(on), "--from", "build", "--to", "build", "--no-progress", env=env)
    assert b.returncode == 0, b.stderr[-3000:]
    assert mark.read_text() == "ProbeTokenizer"
    ref = _campaign(tmp_path, "ref", None, trust=False)
    assert _cli("build", str(ref), env=env).returncode == 0
    for split in ("train", "val"):
        got, want = (load_file(str(tmp_path / c / "build" / f"{split}.safetensors")) for c in ("on", "ref"))
        assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in got)
    m = json.loads((tmp_path / "on" / "manifest.json").read_text())
    assert m["config"]["target"]["trust_remote_code"] is True
    assert m["phases"]["build"]["made_from"]["settings"]["target.trust_remote_code"] is True
