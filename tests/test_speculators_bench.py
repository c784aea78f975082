"""bench/quality speculators scripts: specops features -> speculators' training input, and a
speculators checkpoint -> a specops export, on synthetic data (no speculators needed), plus an
end-to-end run of speculators' own trainer on the CPU when its wheels are installed.

The e2e test needs SPECOPS_SPECULATORS_PATH = a dir holding speculators 0.9.0 and its deps
(`pip install --no-deps --target DIR ...`, see bench/quality/README-speculators.md); it is
skipped otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench" / "quality"))

import speculators_convert as conv  # noqa: E402
import speculators_to_eval as to_eval  # noqa: E402

from specops.drafter.export import check_export  # noqa: E402
from specops.drafter.formats import load_exported  # noqa: E402
from specops.drafter.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from specops.drafter.train import FeatureSplit  # noqa: E402

H, L, TV, DV = 32, 8, 256, 64
AUX = [2, 4, 5]


def _quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(-1).clamp(min=1e-12) / 448.0
    return (x / scale[..., None]).to(torch.float8_e4m3fn), scale.float()


def make_campaign(root: Path, dtype: str = "bfloat16", seed: int = 0, tv: int = TV) -> dict[str, list[int]]:
    """build/vocab.safetensors + features/{train,val} in the DESIGN format. Returns lengths per split."""
    TV = tv
    g = torch.Generator().manual_seed(seed)
    (root / "build").mkdir(parents=True)
    chosen = torch.sort(torch.randperm(TV, generator=g)[:DV]).values
    t2d = torch.zeros(TV, dtype=torch.bool)
    t2d[chosen] = True
    save_file({"d2t": chosen - torch.arange(DV), "t2d": t2d}, str(root / "build" / "vocab.safetensors"))
    lengths = {"train": [7, 2, 11, 5, 9, 4], "val": [6, 8]}
    for split, lens in lengths.items():
        d = root / "features" / split
        d.mkdir(parents=True)
        cut = [lens[:3], lens[3:]] if split == "train" else [lens]
        shards, base = [], 0
        for k, part in enumerate(cut):
            N = sum(part)
            mask = torch.ones(N, dtype=torch.uint8)
            if split == "train" and k == 0:
                mask[7:9] = 0  # sample 1 (2 tokens) is unusable anyway; make sample 0 usable, 2 usable
            aux, final = torch.randn(N, 3, H, generator=g) * 3, torch.randn(N, H, generator=g) * 3
            t = {"input_ids": torch.randint(0, TV, (N,), generator=g).to(torch.int32), "loss_mask": mask,
                 "offsets": torch.tensor([0, *np.cumsum(part).tolist()], dtype=torch.int64),
                 "sample_index": torch.arange(base, base + len(part), dtype=torch.int64)}
            if dtype == "bfloat16":
                t.update(aux=aux.to(torch.bfloat16), final=final.to(torch.bfloat16))
            else:
                (qa, sa), (qf, sf) = _quant(aux), _quant(final)
                t.update(aux=qa, final=qf, aux_scale=sa, final_scale=sf)
            name = f"shard-00-{k:05d}.safetensors"
            save_file(t, str(d / name))
            shards.append({"name": name, "n_samples": len(part), "n_tokens": N})
            base += len(part)
        (d / "index.json").write_text(json.dumps({
            "format": "specops-features-v1", "aux_layer_ids": AUX,
            "aux_layer_convention": "input-to-layer (= HF hidden_states index)", "final": "pre-norm",
            "hidden_size": H, "num_hidden_layers": L, "dtype": dtype, "split": split,
            "shards": shards, "complete": True}))
    return lengths


def _convert(camp: Path, out: Path, monkeypatch, **kw) -> dict:
    written = {}

    def fake_dataset(out, ids, mask, seq_len):  # `datasets` may be absent here: record the columns
        written.update(ids=ids, mask=mask, seq_len=seq_len)

    monkeypatch.setattr(conv, "write_dataset", fake_dataset)
    m = conv.Converter(camp, out, workers=3, max_seq_len=kw.get("max_seq_len"), overwrite=False,
                       consume=kw.get("consume", False)).run()
    m["_columns"] = written
    return m


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_convert_matches_what_specops_trains_on(tmp_path, monkeypatch, dtype):
    camp, out = tmp_path / "camp", tmp_path / "spec"
    make_campaign(camp, dtype)
    m = _convert(camp, out, monkeypatch)
    ours_tr = FeatureSplit(camp / "features" / "train", out_dtype=torch.bfloat16)
    ours_va = FeatureSplit(camp / "features" / "val", out_dtype=torch.bfloat16)
    assert (m["n_train"], m["n_val"]) == (len(ours_tr), len(ours_va)) == (5, 2)  # the 2-token sample is out
    assert m["skipped_unusable"] == {"train": ours_tr.skipped, "val": 0}
    N = m["rows"]
    assert int(N * m["train_data_ratio"]) == m["n_train"]  # speculators' split boundary
    samples = [ours_tr.get(i) for i in range(len(ours_tr))] + [ours_va.get(i) for i in range(len(ours_va))]
    cols = m["_columns"]
    for i, s in enumerate(samples):
        f = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        assert f["token_ids"].dtype == torch.int64 and torch.equal(f["token_ids"], s.input_ids)
        hs = f["hidden_states"]
        assert hs.dtype == torch.bfloat16 and hs.shape == (s.input_ids.numel(), 4, H)
        assert torch.equal(hs[:, :3], s.aux) and torch.equal(hs[:, 3], s.final)  # bit-exact, fp8 dequantized alike
        assert np.array_equal(cols["ids"][i], s.input_ids.numpy())
        assert np.array_equal(cols["mask"][i], s.loss_mask.long().numpy()) and cols["seq_len"][i] == s.input_ids.numel()
        assert (out / "hidden_states" / f"hs_{i}.safetensors").stat().st_size == conv.hs_file_size(len(s.input_ids), H)
    v = load_file(str(camp / "build" / "vocab.safetensors"))
    assert np.array_equal(np.load(m["d2t_path"]), v["d2t"].numpy())
    assert np.array_equal(np.load(m["t2d_path"]), v["t2d"].numpy())
    # a rerun reuses every file
    m2 = _convert(camp, out, monkeypatch)
    assert m2["hs_reused"] == N and m2["hs_written"] == 0


def test_convert_without_val_repeats_last_train_row(tmp_path, monkeypatch):
    camp = tmp_path / "camp"
    make_campaign(camp)
    import shutil

    shutil.rmtree(camp / "features" / "val")
    m = _convert(camp, tmp_path / "spec", monkeypatch, max_seq_len=5)
    assert m["val_is_copy_of_last_train_row"] and m["rows"] == m["n_train"] + 1
    assert int(m["rows"] * m["train_data_ratio"]) == m["n_train"]
    assert max(m["_columns"]["seq_len"]) == 5  # --max-seq-len cuts as train.max_seq_len does


@pytest.mark.parametrize("with_val", [True, False])
def test_convert_consume_frees_each_shard_and_writes_the_same(tmp_path, monkeypatch, with_val):
    """--consume (one copy on disk, not two): every hs file is byte-identical to a normal conversion,
    and every features shard is gone at the end (the repeated val row's shard only after it)."""
    import shutil

    camp = tmp_path / "camp"
    make_campaign(camp)
    if not with_val:
        shutil.rmtree(camp / "features" / "val")
    ref = _convert(camp, tmp_path / "ref", monkeypatch)
    m = _convert(camp, tmp_path / "eat", monkeypatch, consume=True)
    assert m["rows"] == ref["rows"] and m["consumed_feature_bytes"] > 0
    for i in range(m["rows"]):
        name = f"hs_{i}.safetensors"
        assert (tmp_path / "eat" / "hidden_states" / name).read_bytes() == (tmp_path / "ref" / "hidden_states" / name).read_bytes()
    assert not list((camp / "features").rglob("shard-*.safetensors"))


# ------------------------------------------------------------------ checkpoint -> export

TARGET_CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
              "intermediate_size": 64, "num_hidden_layers": L, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 8, "vocab_size": TV, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
              "rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"}, "tie_word_embeddings": False}


def fake_speculators_checkpoint(d: Path, target: Path, *, norm_before_residual: bool, **cfg_over) -> Eagle3Drafter:
    """A checkpoint laid out as `speculators train` writes it (0.9.0, transformers 5): layers.0.*
    names, embed_tokens included, transformer_layer_config with rope only in rope_parameters."""
    dcfg = DrafterConfig.from_target(TARGET_CFG, DV, AUX, norm_before_residual=norm_before_residual)
    torch.manual_seed(1)
    drafter = Eagle3Drafter(dcfg)
    v = load_file(str(target.parent / "camp" / "build" / "vocab.safetensors"))
    drafter.set_vocab(v["d2t"])
    with torch.no_grad():
        for n, p in drafter.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    sd = {}
    for k, t in drafter.state_dict().items():
        sd[("layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k] = \
            t.to(torch.bfloat16) if t.is_floating_point() else t
    d.mkdir(parents=True)
    save_file(sd, str(d / "model.safetensors"))
    layer = {k: TARGET_CFG[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "head_dim", "max_position_embeddings",
                                        "rope_parameters", "vocab_size")}
    config = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
              "draft_vocab_size": DV, "norm_before_residual": norm_before_residual, "norm_before_fc": False,
              "fc_norm": False, "norm_output": False, "embed_requires_grad": False, "target_hidden_size": None,
              "eagle_aux_hidden_state_layer_ids": AUX,
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 7,
                                                           "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                     "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": str(target)}},
              "transformer_layer_config": {**layer, "model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu",
                                           "rms_norm_eps": 1e-5, "layer_types": ["full_attention"],
                                           "sliding_window": 2048, "tie_word_embeddings": False},
              "tie_word_embeddings": False}
    config.update(cfg_over)
    (d / "config.json").write_text(json.dumps(config))
    return drafter


@pytest.fixture
def target_and_campaign(tmp_path):
    make_campaign(tmp_path / "camp")
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET_CFG))
    return target, tmp_path / "camp"


@pytest.mark.parametrize("nbr", [False, True])
def test_checkpoint_to_export_is_the_same_drafter(tmp_path, target_and_campaign, nbr):
    target, camp = target_and_campaign
    ckpt = tmp_path / "save" / "3"
    ref = fake_speculators_checkpoint(ckpt, target, norm_before_residual=nbr)
    assert to_eval.find_checkpoint(tmp_path / "save") == ckpt
    res = to_eval.convert(ckpt, tmp_path / "export", target=None, campaign=camp, allow_sliding=False)
    assert all(res["checks"].values())
    assert check_export(res["export"], target_config=target).ok
    sd, cfg = load_exported(res["export"])
    assert cfg["rope_theta"] == 50000.0 and cfg["norm_before_residual"] is nbr
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [a - 1 for a in AUX]
    assert "embed_tokens.weight" not in sd  # shared from the target, as the engines do
    # loaded the way `specops eval` loads an export: same logits as the drafter that was saved
    from specops.drafter.formats import drafter_config_from_export

    ours = Eagle3Drafter(drafter_config_from_export(cfg, L))
    ours.load_state_dict({**{k: v.float() for k, v in sd.items()},
                          "embed_tokens.weight": ref.embed_tokens.weight.detach().to(torch.bfloat16).float()})
    saved = Eagle3Drafter(ref.config)  # the drafter as saved (bf16-rounded weights), in fp32
    saved.load_state_dict({k: v.to(torch.bfloat16).float() if v.is_floating_point() else v
                           for k, v in ref.state_dict().items()})
    ref = saved
    g = torch.Generator().manual_seed(0)
    ids, aux = torch.randint(0, TV, (1, 40), generator=g), torch.randn(1, 40, 3 * H, generator=g)
    pos = torch.arange(40)[None]
    with torch.no_grad():
        a = ours(ids, ours.fuse(aux), pos).logits
        b = ref(ids, ref.fuse(aux), pos).logits
    assert ours.config.rope_theta == 50000.0
    assert torch.equal(a, b)


@pytest.mark.parametrize("over, message", [
    ({"norm_before_fc": True}, "norm_before_fc"),
    ({"norm_output": True}, "norm_output"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 4, 5]}, "aux_ids_equal_features"),
])
def test_checkpoint_refusals(tmp_path, target_and_campaign, over, message):
    target, camp = target_and_campaign
    fake_speculators_checkpoint(tmp_path / "ck", target, norm_before_residual=False, **over)
    with pytest.raises(SystemExit, match=message):
        to_eval.convert(tmp_path / "ck", tmp_path / "export", target=None, campaign=camp, allow_sliding=False)


def test_sliding_window_layer_and_extra_tensors_are_refused(tmp_path, target_and_campaign):
    target, camp = target_and_campaign
    ck = tmp_path / "ck"
    fake_speculators_checkpoint(ck, target, norm_before_residual=False)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["transformer_layer_config"]["layer_types"] = ["sliding_attention"]
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit, match="specops evaluates full attention"):
        to_eval.convert(ck, tmp_path / "e1", target=None, campaign=camp, allow_sliding=False)
    to_eval.convert(ck, tmp_path / "e2", target=None, campaign=camp, allow_sliding=True)
    sd = load_file(str(ck / "model.safetensors"))
    sd["input_norm.weight"] = torch.ones(3 * H)
    save_file(sd, str(ck / "model.safetensors"))
    with pytest.raises(SystemExit, match="input_norm"):
        to_eval.convert(ck, tmp_path / "e3", target=None, campaign=camp, allow_sliding=True)


# ------------------------------------------------------------------ speculators' own trainer, CPU

SPEC_PATH = os.environ.get("SPECOPS_SPECULATORS_PATH")


def _tiny_target(root: Path) -> tuple[Path, int, dict[str, str]]:
    """A random-weight Llama with SmolLM2's tokenizer (speculators loads the tokenizer too)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from specops.models import resolve_model_dir

    env = {**os.environ, "PYTHONPATH": SPEC_PATH or "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2")))
    tv = len(tok)
    cfg = LlamaConfig(vocab_size=tv, hidden_size=H, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
                      rope_parameters={"rope_theta": 50000.0, "rope_type": "default"})
    torch.manual_seed(0)
    target = root / "target"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(target)
    tok.save_pretrained(target)
    return target, tv, env


# scripts/test.sh installs them (scripts/setup.sh): under CI a missing install fails, it never skips.
needs_speculators = pytest.mark.skipif(
    not (SPEC_PATH and (Path(SPEC_PATH) / "speculators").is_dir()) and not os.environ.get("CI"),
    reason="speculators 0.9.0 wheels not installed: set SPECOPS_SPECULATORS_PATH to the "
           "`pip install --target` dir (bench/quality/README-speculators.md)")


@needs_speculators
@pytest.mark.full  # the anchor's trainer runs end to end in the default suite (test_speculators_trainer_end_to_end_cpu)
def test_speculators_warm_up_trains_on_synthetic_features(tmp_path, monkeypatch):
    """The compile warm-up: synthetic data in the converter's layout, one short epoch of the anchor's
    trainer, warm.json with the time to its first step."""
    import speculators_warm as warm

    target, tv, env = _tiny_target(tmp_path)
    rows = {}
    monkeypatch.setattr(warm, "write_dataset", lambda out, ids, mask, lens: rows.update(ids=ids, mask=mask, lens=lens))
    man = warm.write_synthetic(target, tmp_path / "syn", 10, DV, min_len=6, max_len=20)
    assert man["rows"] == 10 and man["n_train"] == 8 and int(10 * man["train_data_ratio"]) == 8
    assert [len(x) for x in rows["ids"]] == rows["lens"] and all(m[0] == 0 and m[1:].all() for m in rows["mask"])
    d2t, t2d = np.load(man["d2t_path"]), np.load(man["t2d_path"])
    assert d2t.shape == (DV,) and t2d.shape == (tv,) and int(t2d.sum()) == DV
    assert t2d[np.arange(DV) + d2t].all()
    hs = load_file(str(tmp_path / "syn" / "hidden_states" / "hs_3.safetensors"))
    T = hs["token_ids"].shape[0]
    assert 6 <= T <= 20 and hs["hidden_states"].shape == (T, 4, H) and hs["hidden_states"].dtype == torch.bfloat16
    r = subprocess.run([sys.executable, str(REPO / "bench" / "quality" / "speculators_warm.py"), "--target", str(target),
                        "--out", str(tmp_path / "w"), "--samples", "10", "--draft-vocab", str(DV), "--total-seq-len", "32",
                        "--min-len", "6", "--max-len", "20", "--spec-path", SPEC_PATH, "--cpu", "--timeout", "500",
                        "--", "--seed", "3"],
                       env=env, capture_output=True, text=True, timeout=600)
    out = json.loads((tmp_path / "w" / "warm.json").read_text())
    assert r.returncode == 0 and out["rc"] == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert out["steps"] >= 1 and out["first_step_after_start_s"] > 0
    cmd = json.loads((tmp_path / "w" / "run" / "command.json").read_text())["cmd"]
    assert cmd[-2:] == ["--seed", "3"]  # arguments after `--` reach `speculators train`, last (they win)


@needs_speculators
def test_speculators_trainer_end_to_end_cpu(tmp_path):
    target, tv, env = _tiny_target(tmp_path)
    make_campaign(tmp_path / "camp", tv=tv)
    py = sys.executable
    q = REPO / "bench" / "quality"
    r = subprocess.run([py, str(q / "speculators_convert.py"), str(tmp_path / "camp"), str(tmp_path / "data"),
                        "--workers", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([py, str(q / "speculators_train.py"), "--data", str(tmp_path / "data"), "--target", str(target),
                        "--out", str(tmp_path / "run"), "--epochs", "2", "--lr", "1e-3", "--total-seq-len", "32",
                        "--spec-path", SPEC_PATH, "--cpu"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + (tmp_path / "run" / "logs" / "console.log").read_text()[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["speculators"]["steps"] >= 2 and summary["speculators"]["tokens_per_s"] > 0
    r = subprocess.run([py, str(q / "speculators_to_eval.py"), str(tmp_path / "run" / "checkpoints"),
                        str(tmp_path / "export"), "--campaign", str(tmp_path / "camp"), "--verify"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert '"step0_max_abs_diff"' in r.stdout
    assert check_export(tmp_path / "export", target_config=target).ok
