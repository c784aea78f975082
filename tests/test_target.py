"""The target's conventions, each defined once (specops.target): the text config of any config, and
the default aux layer ids, which extract, train, export and eval must all take from one place."""

from __future__ import annotations

import json

import pytest
import torch

from specops.target import (
    FeatureSource,
    aux_layer_ids_problem,
    default_aux_layer_ids,
    engine_default_aux_layer_ids,
    read_text_config,
    text_config,
    text_field,
)


@pytest.mark.parametrize("L", range(3, 81))
def test_default_aux_ids_are_three_distinct_inputs_of_the_stack(L):
    ids = default_aux_layer_ids(L)
    assert len(ids) == 3 and len(set(ids)) == 3 and ids == sorted(ids)
    assert all(0 <= i <= L for i in ids)
    assert aux_layer_ids_problem(ids, L) is None
    if L >= 7:  # where the engines' formula gives three distinct ids, it is the default
        assert ids == engine_default_aux_layer_ids(L) == [2, L // 2, L - 3]
    else:  # below 7 layers the engines' formula repeats an id (or, at 3, names the same three)
        engine = engine_default_aux_layer_ids(L)
        assert len(set(engine)) < 3 or set(engine) == set(ids)


def test_default_aux_ids_known_values():
    assert default_aux_layer_ids(30) == [2, 15, 27]  # SmolLM2-135M
    assert default_aux_layer_ids(61) == [2, 30, 58]  # DeepSeek-V3 / Kimi-K2
    assert default_aux_layer_ids(6) == [2, 3, 5]  # the engines' formula repeats 3 here: [2, 3, 3]
    assert engine_default_aux_layer_ids(6) == [2, 3, 3]
    assert default_aux_layer_ids(5) == [2, 3, 4] and default_aux_layer_ids(4) == [2, 3, 4]
    assert default_aux_layer_ids(3) == [0, 1, 2]
    for L in (0, 1, 2):
        with pytest.raises(ValueError, match="aux_layer_ids"):
            default_aux_layer_ids(L)


def test_aux_ids_problems_name_the_fault():
    assert "out of range 0..8" in aux_layer_ids_problem([2, 4, 9], 8)
    assert "repeat" in aux_layer_ids_problem([2, 3, 3], 6)
    assert "integers" in aux_layer_ids_problem([2, "4", 5], 8)
    assert "no aux" in aux_layer_ids_problem([], 8)
    assert aux_layer_ids_problem([0, 4, 8], 8) is None  # 0 = embedding output, L = the last layer's output


def test_text_config_of_dicts():
    text = {"hidden_size": 64, "num_hidden_layers": 6, "vocab_size": 100}
    assert text_config(text) is text
    for key in ("text_config", "language_config", "llm_config", "language_model"):
        wrapped = {"architectures": ["X"], key: text, "vision_config": {"hidden_size": 8, "num_hidden_layers": 2}}
        assert text_config(wrapped) is text, key
    # a nested value that is not a config (a string, a number) is never taken for one
    assert text_config({"language_model": "llama", "model_type": "x"})["model_type"] == "x"
    # fields fall back to the top level (multimodal configs keep some there)
    wrapped = {"text_config": {"num_hidden_layers": 6}, "tie_word_embeddings": True}
    assert text_field(wrapped, "num_hidden_layers") == 6 and text_field(wrapped, "tie_word_embeddings") is True
    assert text_field(wrapped, "absent", 7) == 7


def test_text_config_of_transformers_objects(tmp_path):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    llama = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2)
    assert text_config(llama) is llama
    llava = LlavaConfig(text_config=llama.to_dict(), vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                                                                num_hidden_layers=1).to_dict())
    tc = text_config(llava)
    assert tc.num_hidden_layers == 6 and tc.hidden_size == 32
    llava.save_pretrained(tmp_path)
    assert read_text_config(tmp_path).num_hidden_layers == 6
    # the dict and the object agree
    assert text_config(json.loads((tmp_path / "config.json").read_text()))["num_hidden_layers"] == 6


def test_the_in_process_target_is_a_feature_source_and_refuses_bad_ids(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from specops.target.inprocess import compute_features, load_target

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=6,
                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    t = load_target(tmp_path, "float32", "cpu")
    assert isinstance(t, FeatureSource)
    f = compute_features(t, torch.arange(5)[None])
    assert f["aux"].shape == (1, 5, 3, 16) and f["final"].shape == (1, 5, 16)
    with pytest.raises(ValueError, match="repeat"):
        t.forward_features(torch.arange(5)[None], layer_ids=[2, 3, 3])
    with pytest.raises(ValueError, match="out of range"):
        t.forward_features(torch.arange(5)[None], layer_ids=[2, 3, 7])


def test_extract_train_and_export_agree_on_the_ids_of_a_small_target(tmp_path):
    """A 6-layer target, where the engines' formula [2, 3, 3] would repeat an id: `specops run` to
    export, and every phase records the same ids, the default's [2, 3, 5], which export --check
    accepts against the target."""
    from specops.drafter.export import check_export
    from specops.pipeline import run_all

    from builders import chat_llama, pipeline_config

    target = chat_llama(tmp_path / "target", layers=6, hidden=32)
    cfg = pipeline_config(tmp_path, target, generate={"max_tokens": 12, "canary_samples": 0},
                          build={"draft_vocab_size": 128, "max_length": 128},
                          train={"batch_tokens": 256, "total_steps": 2, "eval_every": 2, "checkpoint_every": 2},
                          datasets=[{"name": "sg", "source": "sharegpt", "limit": 6}])
    run_all(cfg, stop="export", progress=False)
    camp = tmp_path / "camp"
    want = default_aux_layer_ids(6)
    assert want == [2, 3, 5]
    assert json.loads((camp / "features" / "train" / "index.json").read_text())["aux_layer_ids"] == want
    ckpts = sorted((camp / "drafter" / "checkpoints").glob("step-*"))
    assert json.loads((ckpts[-1] / "drafter_config.json").read_text())["aux_layer_ids"] == want
    vllm_cfg = json.loads((camp / "drafter" / "export" / "vllm" / "config.json").read_text())
    assert vllm_cfg["eagle_aux_hidden_state_layer_ids"] == want
    for fmt in ("vllm", "speculators"):
        rep = check_export(camp / "drafter" / "export" / fmt, target_config=target)
        assert rep.ok and not [p for p in rep.problems if p.name.startswith("layer_ids")], rep.problems
