"""SGLang eagle_config layer ids per target family: what export writes, what check_export accepts.

The capture rules below are re-derived from SGLang 0.5.23 (python/sglang/srt/models/llama.py,
qwen2.py, qwen3.py, qwen3_moe.py, deepseek_v2.py, kimi_k25.py, gpt_oss.py:
`set_eagle3_layers_to_capture` and the model's forward loop), written as a simulation of the
forward loop rather than as the list arithmetic the exporter inverts, so the two can disagree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specops.drafter.export import check_export
from specops.drafter.families.eagle3.export import SglangRule, sglang_layer_ids, sglang_rule
from specops.drafter.formats import ExportError
from export_builders import AUX, TARGET, L, export, names

# ---------------------------------------------------------------------------------------------
# SGLang, simulated


def _llama_set_layers(eagle_ids, num_layers):  # llama.py, qwen2.py, qwen3.py, qwen3_moe.py
    return [val + 1 for val in eagle_ids]


def _deepseek_set_layers(eagle_ids, num_layers):  # deepseek_v2.py (kimi_k25.py delegates to it)
    if eagle_ids and eagle_ids[0] == 1:
        return [val + 1 for val in eagle_ids]
    return list(eagle_ids)


def _gpt_oss_set_layers(eagle_ids, num_layers):  # gpt_oss.py
    if eagle_ids and max(eagle_ids) == num_layers:
        return list(eagle_ids)
    return [val + 1 for val in eagle_ids]


SET_LAYERS = {
    "LlamaForCausalLM": _llama_set_layers,
    "Qwen2ForCausalLM": _llama_set_layers,
    "Qwen3ForCausalLM": _llama_set_layers,
    "Qwen3MoeForCausalLM": _llama_set_layers,
    "DeepseekV3ForCausalLM": _deepseek_set_layers,
    "KimiK25ForConditionalGeneration": _deepseek_set_layers,
    "GptOssForCausalLM": _gpt_oss_set_layers,
}


def sglang_captures(arch: str, eagle_config: dict, num_layers: int) -> list[int]:
    """Input-to-layer ids whose hidden states SGLang hands the drafter, in the order it appends
    them: the layer loop captures the residual stream entering layer i when i is in the set
    (gpt_oss also the last layer's output, index L)."""
    eagle_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if eagle_ids is None:
        to_capture = [2, num_layers // 2, num_layers - 3]
    else:
        to_capture = SET_LAYERS[arch](eagle_ids, num_layers)
    captured = [i for i in range(num_layers) if i in to_capture]
    if arch == "GptOssForCausalLM" and num_layers in to_capture:
        captured.append(num_layers)
    return captured


# ---------------------------------------------------------------------------------------------
# Targets


def target(arch: str, model_type: str) -> dict:
    return dict(TARGET, architectures=[arch], model_type=model_type)


def kimi_k25(text_model_type: str = "deepseek_v3", **top) -> dict:
    """Kimi-K2.5's config.json shape (multimodal): the DeepSeek-V3 language model under text_config."""
    text = dict(TARGET, architectures=["DeepseekV3ForCausalLM"], model_type=text_model_type)
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "media_placeholder_token_id": 163605, "tie_word_embeddings": False, "text_config": text,
           "vision_config": {"model_type": "kimi_k25_vision", "vt_hidden_size": 32, "vt_num_hidden_layers": 2}}
    cfg.update(top)
    return {k: v for k, v in cfg.items() if v is not None}


LLAMA = target("LlamaForCausalLM", "llama")
DEEPSEEK_V3 = target("DeepseekV3ForCausalLM", "deepseek_v3")
KIMI_K2 = target("DeepseekV3ForCausalLM", "kimi_k2")  # Kimi-K2 ships the DeepSeek-V3 class


def exported(tmp_path: Path, target_config: dict, aux: list[int]) -> tuple[Path, dict]:
    out = export("vllm", tmp_path / "x", target_config=target_config, aux_layer_ids=aux)
    return out, json.loads((out / "config.json").read_text())


def assert_sglang_gets(arch: str, config: dict, aux: list[int]) -> None:
    assert config["eagle_aux_hidden_state_layer_ids"] == aux  # vLLM: as trained
    assert sglang_captures(arch, config["eagle_config"], L) == aux


# ---------------------------------------------------------------------------------------------
# Export, one family at a time (L = 8: the default ids are [2, 4, 5])


@pytest.mark.parametrize("aux, written", [(AUX, [1, 3, 4]), ([1, 4, 7], [0, 3, 6]), ([3, 5, 6], [2, 4, 5])])
def test_llama_target_gets_ids_minus_one(tmp_path, aux, written):
    _, config = exported(tmp_path, LLAMA, aux)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == written
    assert_sglang_gets("LlamaForCausalLM", config, aux)


@pytest.mark.parametrize("arch, model_type", [("Qwen2ForCausalLM", "qwen2"), ("Qwen3ForCausalLM", "qwen3"),
                                              ("Qwen3MoeForCausalLM", "qwen3_moe")])
@pytest.mark.parametrize("aux, written", [(AUX, [1, 3, 4]), ([1, 4, 7], [0, 3, 6])])
def test_qwen_targets_get_ids_minus_one(tmp_path, arch, model_type, aux, written):
    _, config = exported(tmp_path, target(arch, model_type), aux)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == written
    assert_sglang_gets(arch, config, aux)


@pytest.mark.parametrize("tgt", [DEEPSEEK_V3, KIMI_K2], ids=["deepseek_v3", "kimi_k2"])
@pytest.mark.parametrize("aux, written", [
    (AUX, [1, 3, 4]),  # first id 2: written [1, ...], which SGLang shifts back
    ([2, 5, 6], [1, 4, 5]),
    ([3, 4, 6], [3, 4, 6]),  # first id 3: written as trained, taken as written
    ([4, 5, 7], [4, 5, 7]),
])
def test_deepseek_family_target_gets_its_own_rule(tmp_path, tgt, aux, written):
    out, config = exported(tmp_path, tgt, aux)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == written
    assert_sglang_gets("DeepseekV3ForCausalLM", config, aux)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sglang_eagle_config_layer_ids"] == written
    assert manifest["sglang_layer_rule"]["family"] == "deepseek"


@pytest.mark.parametrize("tgt", [DEEPSEEK_V3, kimi_k25()], ids=["deepseek_v3", "kimi_k25"])
def test_deepseek_family_refuses_a_first_id_of_1(tmp_path, tgt):
    out = tmp_path / "x"
    with pytest.raises(ExportError) as e:
        export("vllm", out, target_config=tgt, aux_layer_ids=[1, 4, 5])
    msg = str(e.value)
    assert "DeepSeek-family" in msg and "[1, 4, 5]" in msg and "deepseek_v2.py" in msg
    assert "[2, 5, 6]" in msg and "[0, 3, 4]" in msg  # what each in-order list would capture
    assert "--format speculators" in msg and "first aux layer id of 2" in msg
    assert not out.exists()
    # every in-order candidate really fails under the simulated rule; the reordered one does not
    for written in ([1, 4, 5], [0, 3, 4]):
        assert sglang_captures("DeepseekV3ForCausalLM", {"eagle_aux_hidden_state_layer_ids": written}, L) != [1, 4, 5]
    assert sglang_captures("DeepseekV3ForCausalLM", {"eagle_aux_hidden_state_layer_ids": [4, 1, 5]}, L) == [1, 4, 5]
    # the speculators format carries no eagle_config, so it still exports
    assert check_export(export("speculators", tmp_path / "s", target_config=tgt, aux_layer_ids=[1, 4, 5])).ok


@pytest.mark.parametrize("text_model_type", ["deepseek_v3", "kimi_k2"])
def test_kimi_k25_nested_config_gets_the_deepseek_rule(tmp_path, text_model_type):
    cfg = kimi_k25(text_model_type)
    assert sglang_rule(cfg) == SglangRule("deepseek", True, "architectures KimiK25ForConditionalGeneration")
    for aux, written in ((AUX, [1, 3, 4]), ([3, 4, 6], [3, 4, 6])):
        out, config = exported(tmp_path / str(aux[0]), cfg, aux)
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == written
        assert_sglang_gets("KimiK25ForConditionalGeneration", config, aux)
        # read back through the manifest alone: the rule is found again, nothing to warn about
        report = check_export(out)
        assert report.ok and report.problems == [], report.render()
        assert report.facts["SGLang layer-id rule"].startswith("deepseek rule from architectures KimiK25")


def test_rule_detection_reads_the_text_config_and_model_types():
    # no top-level architectures: the nested DeepSeek-V3 config decides
    assert sglang_rule(kimi_k25(architectures=None)).family == "deepseek"
    assert sglang_rule(kimi_k25(architectures=None)).source == "text_config architectures DeepseekV3ForCausalLM"
    # a wrapper class specops does not list, around a DeepSeek-V3 text config
    assert sglang_rule(kimi_k25(architectures=["SomeWrapperForConditionalGeneration"])).family == "deepseek"
    # model_type only, top level or nested
    assert sglang_rule({"model_type": "kimi_k2", "num_hidden_layers": L}).family == "deepseek"
    bare = {"model_type": "wrapper", "text_config": {"model_type": "deepseek_v3", "num_hidden_layers": L}}
    assert sglang_rule(bare) == SglangRule("deepseek", True, "text_config model_type deepseek_v3")
    assert sglang_rule({"architectures": ["Qwen3ForCausalLM"]}).family == "llama"
    assert sglang_rule({"architectures": ["GptOssForCausalLM"]}).family == "gpt_oss"
    unknown = sglang_rule({"architectures": ["FooForCausalLM"], "model_type": "foo"})
    assert (unknown.family, unknown.known) == ("llama", False)
    assert "FooForCausalLM" in unknown.source and "foo" in unknown.source
    assert sglang_rule(None).known is False


@pytest.mark.parametrize("aux, written", [(AUX, [1, 3, 4]), ([1, 4, 7], [0, 3, 6])])
def test_gpt_oss_target_gets_ids_minus_one(tmp_path, aux, written):
    _, config = exported(tmp_path, target("GptOssForCausalLM", "gpt_oss"), aux)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == written
    assert_sglang_gets("GptOssForCausalLM", config, aux)
    # ids reaching the layer count are taken as written: the inverse never produces them for
    # ids in [1, L-1], and refuses ids whose shifted form would collide with that branch
    with pytest.raises(ExportError):
        sglang_layer_ids([2, 4, L + 1], sglang_rule({"architectures": ["GptOssForCausalLM"]}), num_layers=L)


def test_unknown_target_gets_the_llama_rule_and_a_warning(tmp_path):
    out, config = exported(tmp_path, target("FooForCausalLM", "foo"), AUX)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    report = check_export(out)
    assert report.ok and names(report) == {"layer_ids.sglang_rule"}
    warn = report.problems[0]
    assert warn.status == "warn" and "FooForCausalLM" in warn.message and "llama rule" in warn.message
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sglang_layer_rule"] == {"family": "llama", "known": False,
                                             "source": "architectures FooForCausalLM, model_type foo"}


# ---------------------------------------------------------------------------------------------
# check_export against the target's rule


def with_eagle_ids(d: Path, top: list[int], eagle_ids: list[int]) -> Path:
    cfg = json.loads((d / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = top
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = eagle_ids
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "manifest.json").unlink()  # a third-party dir: the target comes from the argument
    return d


@pytest.mark.parametrize("top, eagle_ids, tgt, expect", [
    # Llama-rule ids (top - 1) on a DeepSeek target whose first id is not 2: SGLang takes them as
    # written, one layer early
    ([3, 4, 6], [2, 3, 5], DEEPSEEK_V3, "layer_ids.offset"),
    ([3, 4, 6], [2, 3, 5], kimi_k25(), "layer_ids.offset"),
    # the same list is right for a Llama target
    ([3, 4, 6], [2, 3, 5], LLAMA, None),
    # the DeepSeek form on a Llama target: SGLang adds 1
    ([3, 4, 6], [3, 4, 6], LLAMA, "layer_ids.offset"),
    ([3, 4, 6], [3, 4, 6], DEEPSEEK_V3, None),
    # default ids: the same list for both rules
    (AUX, [1, 3, 4], DEEPSEEK_V3, None),
    (AUX, [1, 3, 4], LLAMA, None),
    (AUX, [2, 4, 5], DEEPSEEK_V3, None),  # taken as written by 0.5.23
    # first trained id 1 on DeepSeek: neither in-order list works, a non-1 id first does
    ([1, 4, 5], [0, 3, 4], DEEPSEEK_V3, "layer_ids.offset"),
    ([1, 4, 5], [1, 4, 5], DEEPSEEK_V3, "layer_ids.offset"),
    ([1, 4, 5], [4, 1, 5], DEEPSEEK_V3, None),
    ([3, 4, 6], [2, 3, 6], DEEPSEEK_V3, "layer_ids.disagree"),
])
def test_check_compares_eagle_config_under_the_targets_rule(tmp_path, top, eagle_ids, tgt, expect):
    d = with_eagle_ids(export("vllm", tmp_path / "x"), top, eagle_ids)
    report = check_export(d, target_config=tgt)
    arch = tgt["architectures"][0]
    simulated = sglang_captures(arch, {"eagle_aux_hidden_state_layer_ids": eagle_ids}, L)
    assert (simulated == sorted(top)) == (expect is None)  # the simulation agrees with the verdict
    if expect is None:
        assert report.ok and report.problems == [], report.render()
    else:
        assert not report.ok and expect in names(report), report.render()


def test_check_advice_follows_the_targets_rule(tmp_path):
    d = with_eagle_ids(export("vllm", tmp_path / "x"), [3, 4, 6], [2, 3, 5])
    msg = next(p.message for p in check_export(d, target_config=DEEPSEEK_V3).problems if p.name == "layer_ids.offset")
    assert "write eagle_config = [3, 4, 6]" in msg and "deepseek rule" in msg
    d2 = with_eagle_ids(export("vllm", tmp_path / "y"), [3, 4, 6], [3, 4, 6])
    msg = next(p.message for p in check_export(d2, target_config=target("Qwen3ForCausalLM", "qwen3")).problems
               if p.name == "layer_ids.offset")
    assert "write eagle_config = [2, 3, 5]" in msg and "llama rule" in msg
    # ids DeepSeek's rule cannot carry in order: the advice says so and offers the alternatives
    d3 = with_eagle_ids(export("vllm", tmp_path / "z"), [1, 4, 5], [1, 4, 5])
    msg = next(p.message for p in check_export(d3, target_config=DEEPSEEK_V3).problems
               if p.name == "layer_ids.offset")
    assert "cannot carry aux layer ids [1, 4, 5]" in msg and "[4, 1, 5]" in msg


def test_check_reads_a_nested_target_config_from_a_directory(tmp_path):
    model_dir = tmp_path / "kimi"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(kimi_k25()))
    d = with_eagle_ids(export("vllm", tmp_path / "x"), [3, 4, 6], [2, 3, 5])
    report = check_export(d, target_config=model_dir)
    assert "layer_ids.offset" in names(report) and not report.ok
    assert report.facts["SGLang captures (input-to-layer)"] == [2, 3, 5]
    # no target at all: the Llama rule is assumed, with a warning, and the same list passes
    report = check_export(d)
    assert report.ok and names(report) == {"layer_ids.sglang_rule"}
    assert "no target config is reachable" in report.problems[0].message
