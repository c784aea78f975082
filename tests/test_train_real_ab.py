"""bench/train_real_ab.py's arms: KEY=VALUE words -> train.* overrides in each arm's own config (a
campaign dir linking the real one's build/ and features/), refused before any arm trains when a key or
value is not the config's."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("train_real_ab", REPO / "bench" / "train_real_ab.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_real_ab"] = mod
    spec.loader.exec_module(mod)
    return mod


def campaign_config(tmp_path: Path) -> Path:
    """A campaign config whose dir holds build/ and features/ (empty: no arm trains here)."""
    from specops.config import dump_toml

    camp = tmp_path / "camp"
    for sub in ("build", "features"):
        (camp / sub).mkdir(parents=True)
    (tmp_path / "model").mkdir()
    (tmp_path / "d.jsonl").write_text('{"prompt": "x"}\n')
    path = tmp_path / "campaign.toml"
    path.write_text(dump_toml({"campaign": {"name": "c", "dir": str(camp)}, "target": {"model": str(tmp_path / "model")},
                               "train": {"lr": 2e-3, "fused_loss": "off"},
                               "datasets": [{"name": "d", "path": str(tmp_path / "d.jsonl")}]}))
    return path


def test_arm_words_become_typed_train_overrides(ab):
    got = ab.parse_overrides("a", ["fused_loss=on", "train.compile_layer=auto", "sdpa_cudnn=true",
                                   "batch_tokens=4096", "lr=1e-3", "ttt_attention=dense"])
    assert got == {"fused_loss": "on", "compile_layer": "auto", "sdpa_cudnn": True, "batch_tokens": 4096,
                   "lr": 1e-3, "ttt_attention": "dense"}
    assert ab.parse_overrides("b", []) == {}
    with pytest.raises(SystemExit, match="not KEY=VALUE"):
        ab.parse_overrides("c", ["SPECOPS_FUSED_LOSS"])


def test_an_arm_config_links_the_data_and_carries_its_overrides(ab, tmp_path):
    base = campaign_config(tmp_path)
    work = tmp_path / "ab"
    path = ab.arm_config(base, work, "fused", 12, 3, {"fused_loss": "on", "sdpa_cudnn": True})
    cfg = tomllib.loads(path.read_text())
    camp = Path(cfg["campaign"]["dir"])
    assert camp == work / "ab-fused" and (camp / "build").resolve() == (tmp_path / "camp" / "build").resolve()
    assert (camp / "features").is_symlink()
    t = cfg["train"]
    assert (t["fused_loss"], t["sdpa_cudnn"], t["lr"], t["total_steps"], t["log_every"]) == ("on", True, 2e-3, 12, 3)
    # an arm without overrides keeps the campaign's own train section
    assert tomllib.loads(ab.arm_config(base, work, "plain", 12, 3).read_text())["train"]["fused_loss"] == "off"
    with pytest.raises(SystemExit, match="--arm bad: train.fused_loss"):
        ab.arm_config(base, work, "bad", 12, 3, {"fused_loss": "1"})
    with pytest.raises(SystemExit, match="--arm typo: train.fused_los"):
        ab.arm_config(base, work, "typo", 12, 3, {"fused_los": "on"})


def test_a_bad_arm_stops_the_run_before_any_arm_trains(tmp_path):
    import subprocess

    base = campaign_config(tmp_path)
    out = tmp_path / "ab.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "train_real_ab.py"), str(base), "--out", str(out),
                        "--work", str(tmp_path / "ab"), "--arm", "good", "fused_loss=on", "--arm", "bad", "fused_loss=1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--arm bad: train.fused_loss" in p.stderr, p.stderr[-2000:]
    assert not out.exists() and not (tmp_path / "ab" / "ab-good.log").exists()  # the good arm never started
