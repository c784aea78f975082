"""The target as SGLang serves it: EAGLE-3 features from `/generate` with `return_hidden_states`.

The alternative to vLLM's `extract_hidden_states` (target/served.py) for `extract.mode = "served"`
with `serve.engine = "sglang"`. What SGLang 0.5.23 does, read from its source (the PyPI wheel,
paths under sglang/srt/):

- Flags (`arg_groups/fields/exec_.py`; checked by `arg_groups/validation_hook.py`
  `handle_aux_hidden_state_capture`): `--enable-return-aux-hidden-states` captures aux states on a
  target with no draft; `--speculative-algorithm` then only names the capture convention (EAGLE3,
  DFLASH or DSPARK) and is reset to None; `--return-aux-hidden-state-layer-ids` lists the ids
  (non-negative, none repeated, each < L: `model_executor/model_runner_components/
  spec_aux_hidden_state.py`). The flag also sets `--return-hidden-states-mode full`
  (`arg_groups/serving_hook.py`), which a request's `"return_hidden_states": true` needs; without it
  the server answers 400 "The server is not configured to return hidden states" (`managers/
  tokenizer_manager.py`, as {"error": {"message": ...}} from `entrypoints/http_server.py`).
- Which states: the model's forward captures the residual stream entering layer i for each i in
  its `layers_to_capture` (`models/llama.py`'s loop into `layers/layer_boundary/stage.py`
  `_prepare_attention`; `models/deepseek_v2.py` the same through `capture_gathered`), so index i is
  specops' id i. The convention's hook turns the flag's ids into indices
  (`attention_backend_setup.py` `configure_aux_hidden_state_capture`). EAGLE3's
  `set_eagle3_layers_to_capture` differs by family: llama adds 1; deepseek_v2 (DeepSeek-V3,
  Kimi-K2.5) adds 1 only when the first id is 1; gpt_oss takes the ids as written when the largest
  is L. DFLASH's `set_dflash_layers_to_capture` adds 1 in most families that have it (llama, qwen3,
  qwen3_moe, deepseek_v2, gpt_oss, laguna, glm4_moe_lite, gemma4, mimo_v2, ...); beam.py and
  muse_spark.py capture the output of the layer named instead, the same state. So specops asks with
  DFLASH for id t - 1. Id 0 (the embeddings) cannot be asked for (-1), and a family without the
  hook (qwen2.py: Qwen2/2.5) stops SGLang at start.
- The final state (index L) lies past the layer loop. Only some families take it: gpt_oss.py and
  laguna.py capture the updated residual at the final norm (`final_norm(capture=...)`, the pre-norm
  stream: `layers/layer_boundary/residual/access.py`); gemma4, lfm2, lfm2_moe, mimo_v2 and
  nemotron_h append the stream after the loop; beam and muse_spark capture the last layer's output.
  Llama, Qwen and DeepSeek-V3/Kimi-K2.5 capture inside the loop only, and their server fails its
  first forward: "The model captured 3 aux hidden states, but --return-aux-hidden-state-layer-ids
  names 4 layers" (`layers/logits_processor.py` `_check_aux_hidden_states`). No response carries
  their pre-norm final state at all: under the flag the post-norm last-layer state stays in the
  process (`LogitsProcessorOutput.last_hidden_states`). specops therefore refuses, up front and
  with a ConfigError that points to vLLM, served extract through SGLang for a target whose text
  config's model_type is not in SGLANG_FINAL_STATE_MODEL_TYPES: extract's config check (from
  config.json alone), `sglang_features_argv` (`specops serve --features`) and ServedSglangTarget.
- The response (`logits_processor.py` `_get_hidden_states_to_store`, `layers/aux_hidden_states.py`,
  `managers/scheduler_components/batch_result_processor.py` `_append_prefill_hidden_states`):
  `meta_info["hidden_states"]` = [the prefill's rows, then one row per decoded token]. A row holds
  the captured states concatenated along hidden in capture order (ascending layer): K x H floats.
  With `max_new_tokens = 1` nothing is decoded, so the list holds the prefill's T rows alone. A
  radix-cache hit skips the rows of its prefix, and a chunked prefill keeps only its last chunk's
  rows; hence `--disable-radix-cache --chunked-prefill-size -1`.
- Token ids: `meta_info["prompt_tokens"]` counts them. `"return_logprob": true` with
  `logprob_start_len` s echoes ids s.. in `meta_info["input_token_logprobs"]` as [logprob, id, None]
  (`managers/scheduler_components/logprob_result_processor.py`: `origin_input_ids[s:]`). Here
  s = T - 1: the last id costs one logits row, while echoing all T ids would compute the whole
  prompt's logits (T x vocab).

Costs: one prefill per sample, with its states as JSON: T x K x H floats at ~10-20 bytes each
(~2 GB for 4096 tokens of a 7168-wide target with K = 4), parsed here into Python floats, seconds
per such sample. That is heavier than vLLM's file (4 bytes per value), but needs no shared file
system.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ConfigError, SpecopsError
from .conventions import text_field
from .served import ServedTarget

__all__ = ["SGLANG_FINAL_STATE_MODEL_TYPES", "ServedSglangTarget", "capture_layers", "sglang_family_problem",
           "sglang_features_argv", "sglang_ids_problem"]

# The text configs' model_types whose SGLang 0.5.23 model captures index L (the last layer's output
# before the final norm) when the DFLASH ids name L - 1, as the module docstring reads the source:
# at the final norm (gpt_oss.py, laguna.py: `final_norm(capture=...)`), or as the residual stream
# past the layer loop (gemma4_causal.py and gemma4_mm.py's Gemma4TextModel, lfm2.py, lfm2_moe.py,
# mimo_v2.py, nemotron_h.py), or as the output of the last layer, whose DFLASH ids name layer
# outputs (beam.py, muse_spark.py). Every other family stops SGLang at its first forward (Llama,
# Qwen3, DeepSeek-V3/Kimi-K2.5: capture inside the loop only) or at start (no DFLASH hook, or none
# that takes L - 1). Two wrappers that capture it are left out, as their text model_type names a
# family that does not: Kimi-K3 (kimi_k3.py; text config kimi_linear) and MiniMax-M3
# (minimax_m3_vl.py; text config minimax_m2).
SGLANG_FINAL_STATE_MODEL_TYPES = ("gpt_oss", "laguna", "gemma4_text", "lfm2", "lfm2_moe", "mimo_v2_flash",
                                  "nemotron_h", "beam", "muse_spark_text")


def capture_layers(layer_ids: Sequence[int], num_hidden_layers: int) -> list[int]:
    """The aux ids then L (the final state), as SGLang captures them: each once, ascending. This is
    the order of the states in a response row."""
    return sorted({*map(int, layer_ids), int(num_hidden_layers)})


def sglang_ids_problem(layer_ids: Sequence[int]) -> str | None:
    """Why SGLang cannot capture these aux ids, or None: its capture ids are layer outputs (t - 1),
    so the embeddings (id 0) are not among them."""
    if any(int(i) == 0 for i in layer_ids):
        return (f"SGLang cannot capture aux layer id 0 (the embeddings) of {list(layer_ids)}: its "
                "--return-aux-hidden-state-layer-ids name layer outputs, id t as t - 1 >= 0")
    return None


def sglang_family_problem(config: Any) -> str | None:
    """Why SGLang cannot serve this target's features, or None: its model family captures no
    pre-norm final state (SGLANG_FINAL_STATE_MODEL_TYPES). `config`: a config.json dict or a
    transformers config, wrappers looked through to the text config."""
    model_type = text_field(config, "model_type")
    if model_type in SGLANG_FINAL_STATE_MODEL_TYPES:
        return None
    return (f"SGLang 0.5.23 captures no pre-norm final state (the last layer's output, which EAGLE-3 "
            f"features need) for a {model_type!r} target: its SGLang model captures aux hidden states "
            f"inside the layer loop only, and the server would stop at its first forward (or at start). "
            f"Serve it with vLLM instead (serve.engine = \"vllm\", extract_hidden_states), which runs "
            f"Llama and DeepSeek-V3 (MLA) targets; SGLang serves features only for the model_types "
            f"{', '.join(SGLANG_FINAL_STATE_MODEL_TYPES)}")


def sglang_features_argv(layer_ids: Sequence[int], num_hidden_layers: int, config: Any) -> list[str]:
    """SGLang's flags for served extract: capture without a draft under the DFLASH convention (flag
    id = specops id - 1, module docstring), every prompt row recomputed and kept in one prefill.
    `config`: the target's config (sglang_family_problem)."""
    problem = sglang_ids_problem(layer_ids)
    if problem:
        raise ConfigError(f"extract.aux_layer_ids: {problem}")
    problem = sglang_family_problem(config)
    if problem:
        raise ConfigError(f"serve.engine = \"sglang\": {problem}")
    ids = [t - 1 for t in capture_layers(layer_ids, num_hidden_layers)]
    return ["--enable-return-aux-hidden-states", "--speculative-algorithm", "DFLASH",
            "--return-aux-hidden-state-layer-ids", *map(str, ids),
            "--disable-radix-cache", "--chunked-prefill-size", "-1"]


class ServedSglangTarget(ServedTarget):
    """The FeatureSource of a target behind SGLang servers (module docstring). `urls`: the servers'
    OpenAI base URLs (.../v1), as for vLLM; /generate is at the root beside /v1. Requests, retries,
    round-robin and the thread pool are ServedTarget's."""

    hint = ("is it started with --enable-return-aux-hidden-states --speculative-algorithm DFLASH "
            "--return-aux-hidden-state-layer-ids (specops serve --features with serve.engine = \"sglang\" "
            "passes them)?")

    def __init__(self, urls: Sequence[str], *, model: str, config: Any, model_dir: Any, layer_ids: Sequence[int],
                 **kw: Any) -> None:
        problem = sglang_family_problem(config)
        if problem:
            raise ConfigError(f"serve.engine = \"sglang\": {problem}")
        super().__init__(urls, model=model, config=config, model_dir=model_dir, layer_ids=layer_ids, **kw)
        problem = sglang_ids_problem(self.layer_ids)
        if problem:
            raise SpecopsError(problem)
        self.captured = capture_layers(self.layer_ids, self.num_hidden_layers)
        # row state k of the response -> specops' order: the aux ids as configured, then the final
        self._order = [self.captured.index(t) for t in (*self.layer_ids, self.num_hidden_layers)]

    def _post(self, url: str, ids: list[int]) -> dict[str, Any]:
        return self._post_json(f"{url.removesuffix('/v1')}/generate", {
            "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_hidden_states": True, "return_logprob": True, "logprob_start_len": len(ids) - 1})

    def _row(self, ids: torch.Tensor) -> torch.Tensor:
        """One sample's ids [T] -> its states [T, n_ids + 1, H] (fp32), the response's rows
        [T, K x H] reordered into the aux ids' order, then the final state."""
        sent = [int(t) for t in ids.tolist()]
        T, H, K = len(sent), self.hidden_size, len(self.captured)
        url, resp = self._request(sent)
        meta = resp.get("meta_info") if isinstance(resp, dict) else None
        states = (meta or {}).get("hidden_states")
        if not states:
            raise SpecopsError(f"served extract: {url} answered /generate without meta_info.hidden_states; "
                               f"{self.hint}")
        seen = meta.get("prompt_tokens")
        if seen is not None and seen != T:
            raise SpecopsError(f"served extract: the server saw other token ids than sent ({seen} vs {T} tokens)")
        echo = [e[1] for e in meta.get("input_token_logprobs") or [] if isinstance(e, (list, tuple)) and len(e) > 1]
        if echo and echo != sent[T - len(echo):]:
            raise SpecopsError(f"served extract: the server saw other token ids than sent (the last "
                               f"{len(echo)}: {echo[-8:]} vs {sent[T - len(echo):][-8:]})")
        if meta.get("cached_tokens"):
            raise SpecopsError(f"served extract: {meta['cached_tokens']} of {T} tokens came from SGLang's prefix "
                               "cache, whose rows are not recomputed: start it with --disable-radix-cache")
        try:
            x = torch.tensor(states[0], dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError) as e:
            raise SpecopsError(f"served extract: meta_info.hidden_states[0] is not a [tokens, states x hidden] "
                               f"array of numbers ({e})") from None
        if tuple(x.shape) != (T, K * H):
            flag_ids = [t - 1 for t in self.captured]
            why = ("rows for fewer tokens than sent: a chunked prefill keeps only its last chunk's rows "
                   "(start SGLang with --chunked-prefill-size -1)"
                   if x.dim() == 2 and x.shape[0] < T else
                   f"a server started with other --return-aux-hidden-state-layer-ids than {flag_ids}?")
            raise SpecopsError(f"served extract: hidden_states {tuple(x.shape)}, expected ({T}, {K * H}) (tokens, "
                               f"the states of layers {self.captured} x hidden {H}): {why}")
        return x.view(T, K, H)[:, self._order]
