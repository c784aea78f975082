"""The EAGLE-3 export formats: vLLM / SGLang (`LlamaForCausalLMEagle3`) and speculators; their check.

Each serving engine reads a drafter directory (config.json + model.safetensors) with its own
conventions, and two of them fail silently: SGLang skips weight names it does not know, and a
layer id read under the wrong convention still "works" with one layer's worth of acceptance lost.
So an export is validated before it is written, written to a temp dir and renamed, and then read
back by `check_export`, the same checker that `specops export --check DIR` runs on third-party dirs
(`drafter/export.py` finds the family that reads a dir, then runs its check).

What the loaders read (at the commits named in tests/test_export.py):

* vLLM `vllm/model_executor/models/llama_eagle3.py`, `Eagle3LlamaForCausalLM.load_weights`:
  skips `t2d`; renames `d2t` -> `draft_id_to_target_id` (absent: that buffer stays zeros, i.e. an
  identity map, which is wrong for a reduced draft vocab); prefixes `model.` to every name but
  `lm_head.*`; `LlamaModel.load_weights` renames `midlayer.` -> `layers.0.` and stacks q/k/v into
  `qkv_proj`, gate/up into `gate_up_proj`. Unknown names fail in `AutoWeightsLoader`.
  `embed_tokens.weight` is optional: when absent, `SpecDecodeBaseProposer._maybe_share_embeddings`
  (vllm/v1/spec_decode/llm_base_proposer.py) gives the drafter the target's embedding.
  Config: `draft_vocab_size` (absent: = vocab_size), `target_hidden_size` (fc in = 3x it),
  `norm_before_residual` (getattr default False), `eagle_config.use_aux_hidden_state` (default True).
  Architecture "LlamaForCausalLMEagle3" is registered to `Eagle3LlamaForCausalLM`.
* SGLang `python/sglang/srt/models/llama_eagle3.py`, `LlamaForCausalLMEagle3.load_weights`:
  `d2t` -> `hot_token_id = d2t + arange`; skips `t2d`; stacks q/k/v and gate/up; looks a name up
  as-is or with `model.` prefixed, and silently skips anything else. Its module is named
  `midlayer` (so `layers.0.*` weights are dropped without a word). `tie_word_embeddings: true`
  makes lm_head the embedding; `draft_vocab_size` None loads lm_head from the target. The eagle
  worker always replaces the drafter's embedding with the target's (`set_embed`), except when
  `target_hidden_size != hidden_size`.
* speculators `src/speculators/models/eagle3/core.py`, `Eagle3DraftModel`: weights `layers.0.*`,
  `fc`, `norm`, `lm_head`, buffers `d2t`, `t2d`, `embed_tokens` (missing allowed, filled from the
  verifier). vLLM reads this format through `vllm/transformers_utils/configs/speculators/`:
  `transformer_layer_config` is merged into the top level and `norm_before_residual` defaults to
  **True** there, against False in llama_eagle3.py and in speculators itself: so we always write it.

Layer ids. Ours are "input to layer" ids = HF `output_hidden_states` indices, default
`[2, L//2, L-3]`. Below, T is the list a drafter was trained on (each id in [1, L-1]), E the
list written to `eagle_config`, C the capture indices an engine ends up with.
* vLLM (`vllm/v1/worker/gpu_model_runner.py` `_get_eagle3_aux_layers_from_config`, and
  `vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py` `get_eagle3_aux_layers_from_config`)
  passes top-level `eagle_aux_hidden_state_layer_ids` unchanged to `set_aux_hidden_state_layers`;
  `LlamaModel.forward` (vllm/model_executor/models/llama.py) appends `hidden_states + residual`
  *before* running layer idx when idx is in the set: id t = input to layer t. No offset.
* SGLang (0.5.23) reads only the draft's `eagle_config["eagle_aux_hidden_state_layer_ids"]`
  (`model_executor/model_runner_components/spec_aux_hidden_state.py`
  `_resolve_eagle_aux_hidden_state`; a missing key gives None) and passes E to the *target*
  model's `set_eagle3_layers_to_capture` (`attention_backend_setup.py`
  `configure_aux_hidden_state_capture`). That method turns E into C, and the model's forward loop
  captures the residual stream entering layer i for every i in C (the decoder layer's
  `attn_boundary.prepare`), appending in layer order whatever the order of C: C holds
  input-to-layer ids. The draft side reads only len(E) (`llama_eagle3.py`, fc width). E = None
  gives C = [2, L//2, L-3] in every family below. How E becomes C depends on the target's class:
  - llama rule: `models/llama.py` `LlamaForCausalLM.set_eagle3_layers_to_capture` sets
    C = [e + 1 for e in E]; qwen2.py, qwen3.py, qwen2_moe.py, qwen3_moe.py, qwen3_next.py,
    qwen3_vl.py, gemma3/gemma4, glm4_moe.py `Glm4MoeForCausalLM`, minimax_m2.py and the rest of
    `_SGLANG_LLAMA_RULE_ARCHS` carry the same line. Inverse: E = T - 1, for every T.
  - deepseek rule: `models/deepseek_v2.py` `DeepseekV2ForCausalLM.set_eagle3_layers_to_capture`
    adds 1 to every id only when E[0] == 1 and otherwise takes E as C unchanged (SGLang PR
    #25454; releases without it always add 1). DeepSeek-V3/V3.2 and Kimi-K2 (`DeepseekV3ForCausalLM`),
    GLM-5 (`GlmMoeDsaForCausalLM`) and Mistral-Large-3 inherit it, `models/kimi_k25.py`
    `KimiK25ForConditionalGeneration` (Kimi-K2.5) hands E to its `DeepseekV3ForCausalLM`, and
    `glm4_moe_lite.py` has a copy. Inverse, by T's first id:
      T[0] == 2 (the default): E = T - 1, whose first id 1 makes SGLang add 1 back; releases
        without #25454 read that list the same way.
      T[0] >= 3: E = T, taken as written (E[0] != 1). Releases without #25454 would add 1, and
        no single list suits both: specops writes the 0.5.23 form.
      T[0] == 1: no list in T's order works. [1, ...] (= T) is shifted to [2, ...]; [0, ...]
        (= T - 1) is taken as written and captures the embedding output. Export refuses. Listing
        a non-1 id first (e.g. [T[1], 1, ...]) is taken as written and captured in layer order,
        so check_export accepts such a list; export writes lists only in T's order.
  - gpt_oss rule: `models/gpt_oss.py` `GptOssForCausalLM.set_eagle3_layers_to_capture` takes E
    as written when max(E) == L (its loop also captures the last layer's output) and otherwise
    adds 1 to every id. Inverse for T within [1, L-1]: E = T - 1 (max(E) <= L - 2).
  - other architectures: the llama rule is assumed, and check_export warns that it is.
  `sglang_rule` picks the family from the target config: the top-level `architectures` SGLang
  dispatches on, then the text config's (`text_config` etc.), then the `model_type`s.
* speculators: `eagle_aux_hidden_state_layer_ids` in the vLLM convention (its data generation hands
  the same list to vLLM, scripts/launch_vllm.py).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import safetensors
import torch
from safetensors.torch import save_file

from ....campaign import sha256_file
from ....checks.result import CheckResult
from ....target import AUX_CONVENTION, engine_default_aux_layer_ids, text_config
from ...formats import (
    _DROPPED_SUFFIXES,
    EMBED_KEY,
    EXPORT_FORMAT,
    MLA_MODEL_TYPE,
    MLA_VLLM_ARCH,
    REQUIRED_KEYS,
    SPECULATORS_ARCH,
    SPECULATORS_NAME_MAP,
    VLLM_ARCH,
    WEIGHT_KEYS,
    ExportError,
    _Checkpoint,
    _detect_format,
    _our_names,
    is_mla_export,
)
from ..base import CheckReport, open_drafter_dir

__all__ = [
    "Extra",
    "SPECULATORS_ARCHS",
    "export_vllm",
    "export_speculators",
    "check_export",
    "export_format",
    "sglang_layer_ids",
    "sglang_rule",
    "sglang_captured_ids",
    "SglangRule",
]


# SGLang 0.5.23 target classes by the rule their set_eagle3_layers_to_capture applies to
# eagle_config ids (module docstring), keyed by the `architectures` name SGLang dispatches on.
# Draft-only classes (NextN, Eagle heads) are left out: a drafter's target is never one.
_SGLANG_DEEPSEEK_RULE_ARCHS = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
    "Glm4MoeLiteForCausalLM", "MistralLarge3ForCausalLM", "KimiK25ForConditionalGeneration",
})
_SGLANG_GPT_OSS_RULE_ARCHS = frozenset({"GptOssForCausalLM"})
_SGLANG_LLAMA_RULE_ARCHS = frozenset({
    "LlamaForCausalLM", "Llama4ForCausalLM", "Llama4ForConditionalGeneration", "MistralForCausalLM",
    "Ministral3ForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM", "IQuestCoderForCausalLM",
    "TeleFLMForCausalLM", "ApertusForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
    "Qwen2_5_VLForConditionalGeneration", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
    "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
    "Qwen4ExpForConditionalGeneration", "Cosmos3ForConditionalGeneration", "InternS1ProForConditionalGeneration",
    "InternS2MobiusForConditionalGeneration", "InternS2PreviewForConditionalGeneration", "MellumForCausalLM",
    "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration",
    "Gemma4UnifiedForConditionalGeneration", "Glm4MoeForCausalLM", "Glm5NextForConditionalGeneration",
    "MiniMaxM2ForCausalLM", "MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration",
    "LongcatFlashForCausalLM", "BailingMoEForCausalLM", "BailingMoeForCausalLM", "BailingMoeV2ForCausalLM",
    "SarvamMoEForCausalLM", "ExaoneMoEForCausalLM", "ExaoneMoeForCausalLM",
})
_SGLANG_ARCH_RULE = {
    **{a: "llama" for a in _SGLANG_LLAMA_RULE_ARCHS},
    **{a: "deepseek" for a in _SGLANG_DEEPSEEK_RULE_ARCHS},
    **{a: "gpt_oss" for a in _SGLANG_GPT_OSS_RULE_ARCHS},
}
# Fallback when no architecture name is known: the transformers model_type of those classes.
_SGLANG_MODEL_TYPE_RULE = {
    **{t: "deepseek" for t in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25",
                               "glm_moe_dsa", "glm4_moe_lite")},
    "gpt_oss": "gpt_oss",
    **{t: "llama" for t in ("llama", "llama4", "llama4_text", "mistral", "ministral3", "phi3", "qwen2",
                            "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next", "gemma3", "gemma3_text",
                            "glm4_moe", "minimax_m2")},
}
_NO_TARGET = "no target config"
_SGLANG_RULE_WHERE = {
    "llama": "python/sglang/srt/models/llama.py LlamaForCausalLM.set_eagle3_layers_to_capture: adds 1 to every id",
    "deepseek": "python/sglang/srt/models/deepseek_v2.py DeepseekV2ForCausalLM.set_eagle3_layers_to_capture: "
                "adds 1 to every id when the first is 1, else takes the ids as written",
    "gpt_oss": "python/sglang/srt/models/gpt_oss.py GptOssForCausalLM.set_eagle3_layers_to_capture: takes the ids "
               "as written when the largest is the layer count, else adds 1 to every id",
}


@dataclass(frozen=True, slots=True)
class SglangRule:
    """How SGLang turns a target's `eagle_config` layer ids into the layers it captures."""

    family: str  # "llama" | "deepseek" | "gpt_oss"
    known: bool  # False: the target is not one specops recognises; the llama rule is assumed
    source: str  # what in the target config decided it, for messages

    def describe(self) -> str:
        assumed = "" if self.known else " (assumed)"
        return f"{self.family} rule{assumed} from {self.source}: {_SGLANG_RULE_WHERE[self.family]}"

    def to_json(self) -> dict[str, Any]:
        return {"family": self.family, "known": self.known, "source": self.source}


def sglang_rule(target_config: Mapping[str, Any] | None) -> SglangRule:
    """The SGLang layer-id rule for a target config (a config.json dict, or our manifest's target
    block). Looks at the top-level `architectures`, the text config's, then the `model_type`s."""
    if not isinstance(target_config, Mapping):
        return SglangRule("llama", False, _NO_TARGET)
    text = text_config(target_config)
    text = text if isinstance(text, Mapping) and text is not target_config else {}  # {}: not a wrapper
    seen: list[str] = []
    for where, cfg in (("architectures", target_config), ("text_config architectures", text)):
        archs = cfg.get("architectures") or []
        for arch in [archs] if isinstance(archs, str) else archs:
            if arch in _SGLANG_ARCH_RULE:
                return SglangRule(_SGLANG_ARCH_RULE[arch], True, f"{where} {arch}")
            seen.append(f"{where} {arch}")
    for where, cfg in (("model_type", target_config), ("text_config model_type", text)):
        model_type = cfg.get("model_type")
        if model_type in _SGLANG_MODEL_TYPE_RULE:
            return SglangRule(_SGLANG_MODEL_TYPE_RULE[model_type], True, f"{where} {model_type}")
        if model_type is not None:
            seen.append(f"{where} {model_type}")
    return SglangRule("llama", False, ", ".join(seen) or "a target config naming no architecture")


def sglang_captured_ids(eagle_ids: list[int], rule: SglangRule, num_layers: int | None = None) -> list[int]:
    """eagle_config ids -> the input-to-layer ids SGLang captures (in the order given; SGLang
    itself captures in layer order). `num_layers` matters only to the gpt_oss rule."""
    ids = list(eagle_ids)
    if rule.family == "deepseek" and not (ids and ids[0] == 1):
        return ids
    if rule.family == "gpt_oss" and ids and num_layers is not None and max(ids) == num_layers:
        return ids
    return [e + 1 for e in ids]


def sglang_layer_ids(aux_layer_ids: list[int], rule: SglangRule | None = None, *,
                     num_layers: int | None = None) -> list[int]:
    """Input-to-layer ids -> the `eagle_config` ids that make SGLang capture exactly them.

    `rule` defaults to the llama rule. Raises ExportError when the target's rule cannot carry the
    ids in their order (the deepseek rule with a first id of 1; module docstring, "Layer ids").
    """
    rule = rule or SglangRule("llama", False, _NO_TARGET)
    ids = list(aux_layer_ids)
    if rule.family == "deepseek":
        if ids and ids[0] == 1:
            raise ExportError(_deepseek_first_id_1(ids, rule, num_layers))
        written = [t - 1 for t in ids] if ids and ids[0] == 2 else ids
    else:
        written = [t - 1 for t in ids]
    if sglang_captured_ids(written, rule, num_layers) != ids:  # each branch above inverts its rule
        raise ExportError(f"SGLang's {rule.family} rule cannot carry aux layer ids {ids}")
    return written


def _deepseek_first_id_1(ids: list[int], rule: SglangRule, num_layers: int | None) -> str:
    default = ""
    if num_layers is not None and num_layers >= 7:
        d = engine_default_aux_layer_ids(num_layers)
        default = f" (the default {d} is written as {[t - 1 for t in d]})"
    reordered = [ids[1], ids[0], *ids[2:]] if len(ids) > 1 else None
    by_hand = (f"; SGLang 0.5.23 also captures them from a hand-written eagle_config that lists a non-1 id "
               f"first, e.g. {reordered}, because it captures in layer order" if reordered else "")
    return (f"the SGLang eagle_config cannot carry aux layer ids {ids} in this order for a DeepSeek-family target "
            f"({rule.source}; {_SGLANG_RULE_WHERE['deepseek']}): written as {ids} SGLang captures "
            f"{[t + 1 for t in ids]}, written as {[t - 1 for t in ids]} it captures {[t - 1 for t in ids]} (id 0 "
            f"is the embedding output). Train with a first aux layer id of 2 or more{default}, or export only "
            f"the speculators format (`specops export --format speculators`, which vLLM serves and which has no "
            f"eagle_config){by_hand}")


# speculators_model_type -> the architecture speculators' config class writes by default
# (models/eagle3/config.py Eagle3SpeculatorConfig, models/peagle/config.py PEagleSpeculatorConfig).
SPECULATORS_ARCHS = {"eagle3": SPECULATORS_ARCH, "peagle": "PEagleSpeculator"}

CheckFn = Callable[[CheckReport, Path, Mapping[str, Any], _Checkpoint, Any], None]


@dataclass(frozen=True)
class Extra:
    """What a family built on EAGLE-3's dirs adds to one (P-EAGLE: mask_hidden, mask_token_id):
    tensors written as given (cast to the export dtype), config.json and manifest.json fields, the
    speculators_model_type, and the check the written dir is read back with."""

    tensors: Mapping[str, torch.Tensor]
    config: Mapping[str, Any]
    manifest: Mapping[str, Any]
    speculators_type: str
    check: CheckFn


# ---------------------------------------------------------------------------------------------
# Shapes


@dataclass(frozen=True, slots=True)
class _Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    target_hidden: int
    n_aux: int
    draft_vocab: int
    target_vocab: int
    # an MLA layer (drafter/mla.py): (q_lora_rank or None, kv_lora_rank, qk_nope, qk_rope, v head dims)
    mla: tuple[int | None, int, int, int, int] | None = None

    def attention_shapes(self) -> dict[str, tuple[int, ...]]:
        h, nh = self.hidden, self.heads
        if self.mla is None:
            q, kv = nh * self.head_dim, self.kv_heads * self.head_dim
            return {
                "self_attn.q_proj.weight": (q, 2 * h),  # attention input is [embed normed, hidden normed]
                "self_attn.k_proj.weight": (kv, 2 * h),
                "self_attn.v_proj.weight": (kv, 2 * h),
                "self_attn.o_proj.weight": (h, q),
            }
        ql, r, n, p, v = self.mla
        query = ({"self_attn.q_a_proj.weight": (ql, 2 * h), "self_attn.q_a_layernorm.weight": (ql,),
                  "self_attn.q_b_proj.weight": (nh * (n + p), ql)} if ql else
                 {"self_attn.q_proj.weight": (nh * (n + p), 2 * h)})
        return {
            **query,
            "self_attn.kv_a_proj_with_mqa.weight": (r + p, 2 * h),
            "self_attn.kv_a_layernorm.weight": (r,),
            "self_attn.kv_b_proj.weight": (nh * (n + v), r),
            "self_attn.o_proj.weight": (h, nh * v),
        }

    def weight_keys(self) -> tuple[str, ...]:
        """The weights every loader needs (no d2t/t2d, no embedding): WEIGHT_KEYS for the Llama layer."""
        return tuple(k for k in self.shapes() if k not in ("d2t", "t2d", EMBED_KEY))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        h = self.hidden
        mid = {
            "input_layernorm.weight": (h,),
            "hidden_norm.weight": (h,),
            **self.attention_shapes(),
            "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (self.intermediate, h),
            "mlp.up_proj.weight": (self.intermediate, h),
            "mlp.down_proj.weight": (h, self.intermediate),
        }
        return {
            "fc.weight": (h, self.n_aux * self.target_hidden),
            **{f"midlayer.{k}": v for k, v in mid.items()},
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab, h),
            "d2t": (self.draft_vocab,),
            "t2d": (self.target_vocab,),
            EMBED_KEY: (self.target_vocab, h),
        }


def _target_int(target_config: Mapping[str, Any], key: str) -> int:
    """An integer field of the target's text config (multimodal configs may keep vocab_size on top)."""
    tgt = text_config(target_config)
    value = tgt.get(key, target_config.get(key))
    if not isinstance(value, int) or isinstance(value, bool):
        raise ExportError(f"target_config has no integer {key}")
    return value


def _nogo(name: str, message: str, **data: Any) -> CheckResult:
    return CheckResult(name, "nogo", message, data)


def _warn(name: str, message: str, **data: Any) -> CheckResult:
    return CheckResult(name, "warn", message, data)


def _check_tensors(
    meta: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]],
    dims: _Dims | None,
    *,
    shown: Mapping[str, str] | None = None,
    need_embed: bool = False,
    need_vocab: bool = True,
) -> list[CheckResult]:
    """Missing / unknown keys, shapes and dtypes. `meta` is keyed by our names; `shown` maps our
    name to the name in the file, for messages."""
    shown = shown or {}
    out: list[CheckResult] = []
    weights = dims.weight_keys() if dims is not None else WEIGHT_KEYS
    required = list(weights) + (["d2t", "t2d"] if need_vocab else [])
    if need_embed:
        required.append(EMBED_KEY)
    missing = [k for k in required if k not in meta]
    if missing:
        out.append(_nogo("keys.missing", f"missing tensors: {', '.join(shown.get(k, k) for k in missing)}",
                         missing=[shown.get(k, k) for k in missing]))
    known = (set(weights) | {"d2t", "t2d"} if dims is not None else set(REQUIRED_KEYS)) | {EMBED_KEY}
    unknown = sorted(k for k in meta if k not in known)
    if unknown:
        out.append(_nogo("keys.unknown", f"tensors no EAGLE-3 loader reads (vLLM fails on them, SGLang "
                         f"drops them silently): {', '.join(shown.get(k, k) for k in unknown)}",
                         unknown=[shown.get(k, k) for k in unknown]))
    expected = dims.shapes() if dims is not None else {}
    for name, (shape, dtype) in meta.items():
        label = shown.get(name, name)
        if name in expected and tuple(shape) != expected[name]:
            out.append(_nogo(f"shape.{label}", f"{label} has shape {list(shape)}, config says {list(expected[name])}",
                             shape=list(shape), expected=list(expected[name])))
        if name == "d2t" and dtype != torch.int64:
            out.append(_nogo("dtype.d2t", f"{label} is {_dtype_name(dtype)}, must be int64 (target_id = i + d2t[i])"))
        elif name == "t2d" and dtype != torch.bool:
            out.append(_nogo("dtype.t2d", f"{label} is {_dtype_name(dtype)}, must be bool (a mask over the "
                             "target vocab)"))
        elif name in known and name not in ("d2t", "t2d") and (dtype is None or not dtype.is_floating_point):
            out.append(_nogo(f"dtype.{label}", f"{label} is {_dtype_name(dtype)}, must be a floating-point dtype"))
    return out


def _check_vocab(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab: int, target_vocab: int) -> list[CheckResult]:
    """d2t/t2d agree: i + d2t[i] is a distinct in-range target id for every draft id i, and t2d is
    True exactly there. vLLM scatters draft logits to `arange + d2t` (Eagle3LlamaForCausalLM.
    compute_logits); SGLang uses `d2t + arange` as hot_token_id."""
    if tuple(d2t.shape) != (draft_vocab,) or tuple(t2d.shape) != (target_vocab,):
        return []  # reported by the shape check
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        return []  # reported by the dtype check
    target_ids = torch.arange(draft_vocab, dtype=torch.int64) + d2t  # [draft_vocab]
    bad = ((target_ids < 0) | (target_ids >= target_vocab)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        return [_nogo("vocab.d2t_range", f"d2t maps {bad.numel()} draft ids outside the target vocab "
                      f"[0, {target_vocab}) (first: draft id {i} -> {int(target_ids[i])})")]
    out = []
    if target_ids.unique().numel() != draft_vocab:
        out.append(_nogo("vocab.d2t_duplicates", f"d2t maps {draft_vocab - target_ids.unique().numel()} draft ids "
                         "onto target ids already taken"))
    if int(t2d.sum()) != draft_vocab:
        out.append(_nogo("vocab.t2d_count", f"t2d has {int(t2d.sum())} True entries, draft vocab is {draft_vocab}"))
    off = (~t2d[target_ids]).nonzero().flatten()
    if off.numel():
        i = int(off[0])
        out.append(_nogo("vocab.t2d_mismatch", f"t2d is False at {off.numel()} target ids that d2t maps to "
                         f"(first: draft id {i} -> target id {int(target_ids[i])})"))
    return out


def _check_aux_ids(ids: Any, num_layers: int | None, *, field_name: str) -> list[CheckResult]:
    """Input-to-layer ids usable by vLLM's Llama capture loop: 3 distinct ints in [1, L-1].
    Id 0 would add a None residual (vLLM captures `hidden_states + residual` before layer 0), and
    id L is never reached inside the loop over layers 0..L-1."""
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return [_nogo("layer_ids.type", f"{field_name} must be a list of ints, got {ids!r}")]
    out = []
    if len(ids) != 3:
        out.append(_nogo("layer_ids.count", f"{field_name} has {len(ids)} ids; EAGLE-3's fc in vLLM and SGLang "
                         "takes exactly 3 aux states"))
    if len(set(ids)) != len(ids):
        out.append(_nogo("layer_ids.duplicate", f"{field_name} repeats an id: {ids}"))
    if num_layers is not None:
        bad = [i for i in ids if not 1 <= i <= num_layers - 1]
        if bad:
            out.append(_nogo("layer_ids.range", f"{field_name} {ids}: {bad} outside [1, {num_layers - 1}] for a "
                             f"{num_layers}-layer target (input-to-layer ids)", num_layers=num_layers))
    return out


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "unknown" if dtype is None else str(dtype).removeprefix("torch.")


def _raise_if_nogo(problems: list[CheckResult], what: str) -> None:
    bad = [p for p in problems if p.status == "nogo"]
    if bad:
        raise ExportError(f"{what}: " + "; ".join(f"[{p.name}] {p.message}" for p in bad))


# ---------------------------------------------------------------------------------------------
# Export


def _draft_fields(drafter_config: Mapping[str, Any], target_config: Mapping[str, Any]) -> dict[str, Any]:
    """The Llama decoder-layer fields of the drafter, drafter_config first, the target's as fallback
    for what the drafter inherits (norm eps, RoPE, context length)."""
    tgt = text_config(target_config)
    problems = []

    def pick(key: str, *, inherit: bool) -> Any:
        if key in drafter_config:
            return drafter_config[key]
        if inherit and key in tgt:
            return tgt[key]
        also = " (nor has the target config)" if inherit else ""
        problems.append(_nogo(f"config.{key}", f"drafter_config has no {key}{also}"))
        return None

    hidden = pick("hidden_size", inherit=False)
    heads = pick("num_attention_heads", inherit=False)
    fields = {
        "hidden_size": hidden,
        "intermediate_size": pick("intermediate_size", inherit=False),
        "num_attention_heads": heads,
        "num_key_value_heads": drafter_config.get("num_key_value_heads", heads),
        "head_dim": drafter_config.get("head_dim") or (hidden // heads if hidden and heads else None),
        "hidden_act": drafter_config.get("hidden_act", "silu"),
        "rms_norm_eps": pick("rms_norm_eps", inherit=True),
        "max_position_embeddings": pick("max_position_embeddings", inherit=True),
        "draft_vocab_size": pick("draft_vocab_size", inherit=False),
        "norm_before_residual": drafter_config.get("norm_before_residual"),
        "layer": drafter_config.get("layer", "llama"),
    }
    if fields["layer"] == "mla":
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            fields[key] = pick(key, inherit=False)
        fields["q_lora_rank"] = drafter_config.get("q_lora_rank")
        fields["num_key_value_heads"] = heads
        if not fields["q_lora_rank"]:
            # deepseek_eagle3.py's loader maps kv_a_proj_with_mqa into fused_qkv_a_proj, which exists
            # only with a q_lora_rank: "There is no module or parameter named
            # 'layers.0.self_attn.fused_qkv_a_proj' in DeepseekV2Eagle3Model".
            problems.append(_nogo("config.q_lora_rank", "an MLA drafter without a q_lora_rank (a full-rank q_proj) "
                                  "does not load in vLLM 0.32 (deepseek_eagle3.py loads q_a_proj + "
                                  "kv_a_proj_with_mqa as one fused projection)"))
    elif fields["layer"] != "llama":
        problems.append(_nogo("config.layer", f"drafter_config.layer {fields['layer']!r} is neither 'llama' nor 'mla'"))
    if fields["hidden_act"] != "silu":
        problems.append(_nogo("config.hidden_act", f"hidden_act {fields['hidden_act']!r}: vLLM's LlamaMLP runs "
                              "silu only"))
    if not isinstance(fields["norm_before_residual"], bool):
        # llama_eagle3.py reads it with getattr default False, vLLM's speculators adapter with default
        # True: absent, the two paths build different drafters from one checkpoint.
        problems.append(_nogo("config.norm_before_residual", "drafter_config.norm_before_residual must be given "
                              f"explicitly as a bool (got {fields['norm_before_residual']!r})"))
    fields.update(_rope_fields(drafter_config, tgt, problems))
    _raise_if_nogo(problems, "drafter config")
    return fields


def _rope_fields(drafter: Mapping[str, Any], target: Mapping[str, Any], problems: list[CheckResult]) -> dict[str, Any]:
    """rope_theta / rope_scaling in the legacy layout both transformers 4 and 5 read (5 folds them
    into `rope_parameters` on load); converted from `rope_parameters` when that is all there is."""
    src = drafter if any(k in drafter for k in ("rope_theta", "rope_scaling", "rope_parameters")) else target
    theta, scaling = src.get("rope_theta"), src.get("rope_scaling")
    params = src.get("rope_parameters")
    if theta is None and isinstance(params, Mapping) and "rope_theta" in params:
        theta = params["rope_theta"]
        if params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if theta is None:
        problems.append(_nogo("config.rope_theta", "no rope_theta in drafter_config or target_config"))
    return {"rope_theta": theta, "rope_scaling": scaling}


def _prepare(
    state_dict: Mapping[str, torch.Tensor],
    drafter_config: Mapping[str, Any],
    *,
    target_config: Mapping[str, Any],
    aux_layer_ids: list[int],
    dtype: torch.dtype,
    embed_tokens: bool | None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], _Dims, bool]:
    """Validate the checkpoint against its config; return tensors (our names, export dtypes), the
    Llama layer fields, dims, and whether embed_tokens is written."""
    if not dtype.is_floating_point:
        raise ExportError(f"export dtype {dtype} is not floating-point")
    num_layers, target_hidden, target_vocab = (_target_int(target_config, k)
                                               for k in ("num_hidden_layers", "hidden_size", "vocab_size"))
    fields = _draft_fields(drafter_config, target_config)
    dims = _Dims(
        hidden=int(fields["hidden_size"]),
        heads=int(fields["num_attention_heads"]),
        kv_heads=int(fields["num_key_value_heads"]),
        head_dim=int(fields["head_dim"]),
        intermediate=int(fields["intermediate_size"]),
        target_hidden=target_hidden,
        n_aux=len(aux_layer_ids),
        draft_vocab=int(fields["draft_vocab_size"]),
        target_vocab=target_vocab,
        mla=_mla_dims(fields),
    )
    problems = _check_aux_ids(list(aux_layer_ids), num_layers, field_name="aux_layer_ids")
    # Fields a DrafterConfig also carries must agree with the target and the ids given here.
    for key, given in (("aux_layer_ids", list(aux_layer_ids)), ("target_vocab_size", target_vocab),
                       ("target_hidden_size", target_hidden), ("target_num_hidden_layers", num_layers)):
        if drafter_config.get(key) is not None and drafter_config[key] != given:
            problems.append(_nogo(f"config.{key}", f"drafter_config.{key} {drafter_config[key]} != {given} "
                                  "from the target config / aux_layer_ids argument"))
    if dims.draft_vocab > target_vocab:
        problems.append(_nogo("config.draft_vocab_size", f"draft_vocab_size {dims.draft_vocab} exceeds the target "
                              f"vocab {target_vocab}"))
    # SGLang's set_embed keeps the drafter's own embedding only when the hidden sizes differ, and
    # vLLM asserts embed width == hidden width: then embed_tokens must ship. Otherwise it is a
    # [target_vocab, H] duplicate that both engines replace with the target's.
    write_embed = embed_tokens if embed_tokens is not None else dims.hidden != dims.target_hidden

    kept = {k: v.detach().to("cpu") for k, v in state_dict.items() if not k.endswith(_DROPPED_SUFFIXES)}
    if not write_embed:
        kept.pop(EMBED_KEY, None)
    meta = {k: (tuple(v.shape), v.dtype) for k, v in kept.items()}
    problems += _check_tensors(meta, dims, need_embed=write_embed)
    if "d2t" in kept and "t2d" in kept:
        problems += _check_vocab(kept["d2t"], kept["t2d"], dims.draft_vocab, dims.target_vocab)
    for name, t in kept.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            problems.append(_nogo(f"values.{name}", f"{name} has non-finite values"))
    _raise_if_nogo(problems, "refusing to export")

    out: dict[str, torch.Tensor] = {}
    for name, t in kept.items():
        # clone: safetensors refuses tensors sharing storage (e.g. a tied view)
        out[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous().clone()
    return out, fields, dims, write_embed


def _mla_dims(layer: Mapping[str, Any]) -> tuple[int | None, int, int, int, int] | None:
    """_Dims.mla from MLA config fields (None when the layer is Llama's)."""
    if layer.get("layer", "mla" if layer.get("kv_lora_rank") else "llama") != "mla":
        return None
    ql = layer.get("q_lora_rank")
    return (int(ql) if ql else None, int(layer["kv_lora_rank"]), int(layer["qk_nope_head_dim"]),
            int(layer["qk_rope_head_dim"]), int(layer["v_head_dim"]))


def _layer_config(fields: Mapping[str, Any], dims: _Dims, dtype: torch.dtype) -> dict[str, Any]:
    """The decoder layer's config.json fields: Llama's, or for an MLA layer the DeepseekV2Config
    fields vLLM's DeepseekV2Eagle3DecoderLayer reads (its attention sizes, intermediate_size of the
    dense MLP, rope_* for the interleaved RoPE)."""
    out = _llama_layer_config(fields, dims, dtype)
    if dims.mla is None:
        return out
    ql, r, n, p, v = dims.mla
    for key in ("head_dim", "attention_bias", "mlp_bias"):
        out.pop(key)
    out.update(model_type=MLA_MODEL_TYPE, num_key_value_heads=dims.heads, q_lora_rank=ql, kv_lora_rank=r,
               qk_nope_head_dim=n, qk_rope_head_dim=p, v_head_dim=v)
    return out


def _llama_layer_config(fields: Mapping[str, Any], dims: _Dims, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "hidden_act": fields["hidden_act"],
        "rms_norm_eps": fields["rms_norm_eps"],
        "rope_theta": fields["rope_theta"],
        "rope_scaling": fields["rope_scaling"],
        "max_position_embeddings": fields["max_position_embeddings"],
        "attention_bias": False,
        "mlp_bias": False,
        "num_hidden_layers": 1,
        "vocab_size": dims.target_vocab,  # target vocab: embedding rows, t2d length, logits scattered back
        "tie_word_embeddings": False,  # SGLang would make lm_head the [target_vocab, H] embedding
        "torch_dtype": _dtype_name(dtype),
    }


def _manifest(flavor: str, *, target_config: Mapping[str, Any], target_name_or_path: str,
              aux_layer_ids: list[int], tensors: Mapping[str, torch.Tensor], write_embed: bool,
              sglang: tuple[list[int], SglangRule] | None = None) -> dict[str, Any]:
    text = text_config(target_config)
    return {
        "format": EXPORT_FORMAT,
        "flavor": flavor,
        "target": {
            "name_or_path": target_name_or_path,
            "architectures": list(target_config.get("architectures") or []),
            # with architectures, what check_export picks the SGLang layer-id rule from
            "model_type": target_config.get("model_type") or (text.get("model_type") if isinstance(text, Mapping)
                                                              else None),
            "num_hidden_layers": _target_int(target_config, "num_hidden_layers"),
            "hidden_size": _target_int(target_config, "hidden_size"),
            "vocab_size": _target_int(target_config, "vocab_size"),
        },
        "aux_layer_ids": list(aux_layer_ids),
        "aux_layer_convention": AUX_CONVENTION,
        "sglang_eagle_config_layer_ids": sglang[0] if sglang else None,
        "sglang_layer_rule": sglang[1].to_json() if sglang else None,
        "embed_tokens": "included" if write_embed else "shared from the target by the engine",
        "tensors": {k: {"shape": list(v.shape), "dtype": _dtype_name(v.dtype)} for k, v in sorted(tensors.items())},
        "versions": {"torch": torch.__version__, "safetensors": safetensors.__version__},
    }


def _write_dir(out_dir: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
               manifest: dict[str, Any], target_config: Mapping[str, Any], check: CheckFn | None = None) -> Path:
    """Write into a temp sibling, re-check it (`check`, default `check_export`, in the format
    manifest["flavor"]), then swap it into place. A refused or crashed export leaves an existing
    out_dir untouched."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        weights = tmp / "model.safetensors"
        save_file(tensors, str(weights), metadata={"format": "pt"})
        manifest["sha256"] = {"model.safetensors": sha256_file(weights)}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        report, written, weights = open_drafter_dir(tmp)
        if written is not None:
            report.format = manifest["flavor"]
            (check or check_export)(report, tmp, written, weights, target_config)
        _raise_if_nogo(report.problems, f"export read back from {tmp} fails its check")
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _add_extra(tensors: dict[str, torch.Tensor], config: dict[str, Any], manifest: dict[str, Any],
               extra: Extra | None, dtype: torch.dtype) -> None:
    """Another family's tensors (checked by it already: names outside EAGLE-3's), config fields and
    manifest fields on top of the EAGLE-3 dir."""
    if extra is None:
        return
    for name, t in extra.tensors.items():
        t = t.detach().to("cpu")
        tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous().clone()
    config.update(extra.config)
    manifest.update(extra.manifest)
    manifest["tensors"] = {k: {"shape": list(v.shape), "dtype": _dtype_name(v.dtype)} for k, v in sorted(tensors.items())}


def export_vllm(
    state_dict: Mapping[str, torch.Tensor],
    drafter_config: Mapping[str, Any],
    out_dir: str | Path,
    *,
    target_config: Mapping[str, Any],
    aux_layer_ids: list[int],
    target_name_or_path: str,
    dtype: torch.dtype = torch.bfloat16,
    embed_tokens: bool | None = None,
    extra: Extra | None = None,
) -> Path:
    """Write the vLLM (`method: eagle3`) / SGLang (`EAGLE3`) drafter dir: config.json,
    model.safetensors (our names: midlayer.*, fc, norm, lm_head, d2t, t2d), manifest.json.

    `aux_layer_ids` are input-to-layer ids (HF hidden_states indices) the drafter was trained on.
    `embed_tokens`: None writes `embed_tokens.weight` only when the drafter's hidden size differs
    from the target's (the engines share the target's embedding otherwise). Raises ExportError,
    naming every problem, before anything is written.
    """
    aux = [int(i) for i in aux_layer_ids]
    tensors, fields, dims, write_embed = _prepare(state_dict, drafter_config, target_config=target_config,
                                                  aux_layer_ids=aux, dtype=dtype, embed_tokens=embed_tokens)
    rule = sglang_rule(target_config)
    sglang_ids = sglang_layer_ids(aux, rule, num_layers=_target_int(target_config, "num_hidden_layers"))
    config = {
        "architectures": [VLLM_ARCH if dims.mla is None else MLA_VLLM_ARCH],
        **_layer_config(fields, dims, dtype),
        "draft_vocab_size": dims.draft_vocab,
        "target_hidden_size": dims.target_hidden,
        "norm_before_residual": fields["norm_before_residual"],
        # vLLM: read as-is, input-to-layer (gpu_model_runner._get_eagle3_aux_layers_from_config).
        "eagle_aux_hidden_state_layer_ids": aux,
        # SGLang: read from here and mapped by the target's set_eagle3_layers_to_capture (sglang_rule).
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_ids, "use_aux_hidden_state": True},
    }
    manifest = _manifest("vllm", target_config=target_config, target_name_or_path=target_name_or_path,
                         aux_layer_ids=aux, tensors=tensors, write_embed=write_embed, sglang=(sglang_ids, rule))
    _add_extra(tensors, config, manifest, extra, dtype)
    return _write_dir(Path(out_dir), config, tensors, manifest, target_config, extra.check if extra else None)


def export_speculators(
    state_dict: Mapping[str, torch.Tensor],
    drafter_config: Mapping[str, Any],
    out_dir: str | Path,
    *,
    target_config: Mapping[str, Any],
    aux_layer_ids: list[int],
    target_name_or_path: str,
    dtype: torch.dtype = torch.bfloat16,
    speculative_tokens: int = 3,
    embed_tokens: bool | None = None,
    extra: Extra | None = None,
) -> Path:
    """Write the speculators-format dir (`speculators_model_type: eagle3`), which vLLM also serves.

    Weights are renamed by SPECULATORS_NAME_MAP (`midlayer.` -> `layers.0.`). `speculative_tokens`
    is the greedy proposal length vLLM takes as num_lookahead_tokens when the serving command gives
    none (vllm/transformers_utils/configs/speculators/base.py).
    """
    if not isinstance(speculative_tokens, int) or speculative_tokens < 1:
        raise ExportError(f"speculative_tokens must be an int >= 1, got {speculative_tokens!r}")
    aux = [int(i) for i in aux_layer_ids]
    if drafter_config.get("layer", "llama") == "mla":
        raise ExportError("an MLA EAGLE-3 drafter has no speculators format: speculators 0.9 defines EAGLE-3 "
                          "layers for llama and qwen3 only; export the vLLM format")
    tensors, fields, dims, write_embed = _prepare(state_dict, drafter_config, target_config=target_config,
                                                  aux_layer_ids=aux, dtype=dtype, embed_tokens=embed_tokens)
    renamed = {SPECULATORS_NAME_MAP[k]: v for k, v in tensors.items()}
    # Field names: speculators src/speculators/config.py (SpeculatorsConfig, VerifierConfig) and
    # models/eagle3/config.py (Eagle3SpeculatorConfig); proposal: proposals/greedy.py.
    kind = extra.speculators_type if extra else "eagle3"
    config = {
        "architectures": [SPECULATORS_ARCHS[kind]],
        "speculators_model_type": kind,
        "transformer_layer_config": _llama_layer_config(fields, dims, dtype),
        "draft_vocab_size": dims.draft_vocab,
        "norm_before_residual": fields["norm_before_residual"],
        "target_hidden_size": dims.target_hidden,
        "eagle_aux_hidden_state_layer_ids": aux,  # vLLM convention (input-to-layer), no eagle_config
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target_name_or_path,
                         "architectures": list(target_config.get("architectures") or [])},
        },
        "torch_dtype": _dtype_name(dtype),
    }
    manifest = _manifest("speculators", target_config=target_config, target_name_or_path=target_name_or_path,
                         aux_layer_ids=aux, tensors=renamed, write_embed=write_embed)
    manifest["name_map"] = {k: v for k, v in SPECULATORS_NAME_MAP.items() if k in tensors}
    _add_extra(renamed, config, manifest, extra, dtype)
    return _write_dir(Path(out_dir), config, renamed, manifest, target_config, extra.check if extra else None)


def _target_layers(d: Path, config: Mapping[str, Any], fmt: str,
                   target_config: Mapping[str, Any] | str | Path | None
                   ) -> tuple[Mapping[str, Any] | None, str | None, Mapping[str, Any] | None]:
    """(text config, where from, whole config) of the target when reachable without a network:
    given, or a local dir named by our manifest or the speculators verifier. The whole config
    (for a manifest: its target block) is what `sglang_rule` reads."""
    def text_of(cfg: Mapping[str, Any]) -> dict[str, Any]:
        text = dict(text_config(cfg))
        text.setdefault("vocab_size", cfg.get("vocab_size"))
        return text

    def from_path(path: Path, source: str) -> tuple[Mapping[str, Any], str, Mapping[str, Any]] | None:
        cfg_file = path if path.suffix == ".json" else path / "config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
            return text_of(cfg), f"{source} ({cfg_file})", cfg
        return None

    if isinstance(target_config, Mapping):
        return text_of(target_config), "argument", target_config
    if target_config is not None:
        found = from_path(Path(target_config), "argument")
        if found is None:
            raise ExportError(f"target config {target_config}: no such config.json")
        return found
    manifest = d / "manifest.json"
    if manifest.is_file():
        target = json.loads(manifest.read_text()).get("target") or {}
        if isinstance(target.get("num_hidden_layers"), int):
            return target, "manifest.json", target
    if fmt == "speculators":
        name = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        if name and (found := from_path(Path(name), "speculators_config.verifier.name_or_path")):
            return found
    return None, None, None


def _is_int_list(ids: Any) -> bool:
    return isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)


def _sglang_fix(top: Any, rule: SglangRule, num_layers: int | None) -> str:
    """What eagle_config should hold for top-level ids `top`, as advice."""
    if not _is_int_list(top):
        return "fix the top-level ids first"
    try:
        return f"write eagle_config = {sglang_layer_ids(top, rule, num_layers=num_layers)}"
    except ExportError as e:
        return str(e)


def _check_layer_ids(
    config: Mapping[str, Any], fmt: str, num_layers: int | None, facts: dict[str, Any], rule: SglangRule
) -> list[CheckResult]:
    """The layer-id fields against what each engine reads (module docstring, "Layer ids"): vLLM
    captures the top-level ids, SGLang what `rule` makes of the eagle_config ids; both capture in
    layer order, so the two lists must agree as sets."""
    out: list[CheckResult] = []
    top = config.get("eagle_aux_hidden_state_layer_ids")
    default = engine_default_aux_layer_ids(num_layers) if num_layers is not None else None
    facts["aux_layer_ids (vLLM, input-to-layer)"] = top
    if fmt == "speculators":
        if top is None:
            out.append(_warn("layer_ids.implicit", "no eagle_aux_hidden_state_layer_ids: vLLM and speculators use the "
                             f"default [2, L//2, L-3]{f' = {default}' if default else ''}; right only if the "
                             "drafter was trained on those"))
        else:
            out += _check_aux_ids(top, num_layers, field_name="eagle_aux_hidden_state_layer_ids")
        return out

    eagle_config = config.get("eagle_config") or {}
    sg = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, Mapping) else None
    facts["eagle_config ids (SGLang)"] = sg
    if isinstance(eagle_config, Mapping) and eagle_config.get("use_aux_hidden_state") is False:
        out.append(_nogo("layer_ids.no_aux", "eagle_config.use_aux_hidden_state is false: vLLM skips fc and feeds "
                         "one hidden state, not EAGLE-3's three"))
    if top is not None:
        out += _check_aux_ids(top, num_layers, field_name="eagle_aux_hidden_state_layer_ids")
    if sg is not None and not _is_int_list(sg):
        out.append(_nogo("layer_ids.type", "eagle_config.eagle_aux_hidden_state_layer_ids must be a list of ints, "
                         f"got {sg!r}"))
        return out
    captured = None
    if sg is not None:
        captured = sglang_captured_ids(sg, rule, num_layers)
        facts["SGLang layer-id rule"] = rule.describe()
        facts["SGLang captures (input-to-layer)"] = captured
        if not rule.known:
            why = ("no target config is reachable" if rule.source == _NO_TARGET else
                   f"specops does not know which rule SGLang applies to {rule.source}")
            out.append(_warn("layer_ids.sglang_rule", f"SGLang layer-id rule assumed to be the llama rule (every "
                             f"eagle_config id + 1): {why}; pass the target config to check against its rule",
                             source=rule.source))
    if top is not None and captured is not None:
        if _is_int_list(top) and sorted(captured) == sorted(top):
            facts["layer id relation"] = "SGLang captures the top-level ids from eagle_config"
        else:
            shifted = _is_int_list(top) and any(sorted(captured) == sorted(t + k for t in top) for k in (1, -1))
            where = "each one layer off" if shifted else "other layers"
            out.append(_nogo("layer_ids.offset" if shifted else "layer_ids.disagree",
                             f"eagle_config ids {sg}: SGLang captures input-to-layer {captured} ({rule.describe()}), "
                             f"vLLM the top-level {top}: {where}; {_sglang_fix(top, rule, num_layers)}"))
    elif top is not None:
        if default is not None and top == default:
            out.append(_warn("layer_ids.sglang_default", f"no eagle_config ids: SGLang captures its default {default}, "
                             "which matches the top-level ids; write eagle_config to be explicit"))
        elif default is not None:
            out.append(_nogo("layer_ids.sglang_missing", f"no eagle_config ids: SGLang captures its default {default}, "
                             f"not the top-level {top}; {_sglang_fix(top, rule, num_layers)}"))
        else:
            out.append(_warn("layer_ids.sglang_missing", "no eagle_config ids: SGLang captures its default "
                             "[2, L//2, L-3]; target config unreachable, cannot compare"))
    elif captured is not None:
        out.append(_nogo("layer_ids.vllm_missing", f"only eagle_config ids {sg}: vLLM reads top-level "
                         "eagle_aux_hidden_state_layer_ids and otherwise uses its default, and versions that fall "
                         "back to eagle_config take those ids as input-to-layer ids unchanged; write top-level = "
                         f"{sorted(captured)} (what SGLang captures)"))
        out += _check_aux_ids(captured, num_layers, field_name="the ids SGLang captures from eagle_config")
    else:
        out.append(_warn("layer_ids.implicit", "no layer id fields: vLLM and SGLang both use the default "
                         f"[2, L//2, L-3]{f' = {default}' if default else ''}; right only if the drafter was trained "
                         "on those"))
    return out


def export_format(config: Mapping[str, Any], names: set[str]) -> str | None:
    """"vllm" or "speculators" for a dir with that config.json and those tensor names, else None. A
    speculators dir counts when its type is one whose weights are EAGLE-3's layer (eagle3, and
    peagle, which vLLM also serves as a chain); another type (dflash) is another family's."""
    fmt = _detect_format(config, names)
    if fmt == "speculators" and config.get("speculators_model_type") not in SPECULATORS_ARCHS:
        return None
    return None if fmt == "unknown" else fmt


NOT_AN_EXPORT = "neither EAGLE-3 architecture nor speculators_model_type in config.json, no midlayer.* weights"


def check_export(report: CheckReport, d: Path, config: Mapping[str, Any], ckpt: _Checkpoint,
                 target_config: Mapping[str, Any] | str | Path | None, *, extra_names: frozenset[str] = frozenset(),
                 speculators_type: str = "eagle3") -> None:
    """Check a drafter dir in format report.format, ours or third-party, for what vLLM, SGLang and
    speculators need; adds to report.problems and report.facts. config: its config.json; ckpt: its
    tensors (read on demand).

    `target_config`: the target's config dict, or a local model dir / config.json path, used to
    range-check layer ids and compare sizes; without it, our manifest.json or a local speculators
    verifier path is used when present. Nothing is fetched.

    For a family built on EAGLE-3's dirs (P-EAGLE): `extra_names`, tensors of the file it checks
    itself (left out here); `speculators_type`, the speculators_model_type and algorithm expected.
    """
    problems, facts = report.problems, report.facts
    fmt = report.format

    # -- config fields
    if fmt == "speculators":
        layer_cfg = config.get("transformer_layer_config")
        problems += _check_speculators_config(config, speculators_type)
        if not isinstance(layer_cfg, Mapping):
            return
    else:
        layer_cfg = config
    mla = is_mla_export(config, set(ckpt.meta))
    if fmt != "speculators":
        problems += _check_mla_config(config) if mla else _check_vllm_config(config)
    facts["layer"] = "mla" if mla else "llama"
    facts["architectures"] = config.get("architectures")
    for key, label in (("norm_before_residual", "norm_before_residual"), ("draft_vocab_size", "draft_vocab_size")):
        if key not in config:
            why = ("vLLM's llama_eagle3 defaults it to False, vLLM's speculators adapter to True: must be explicit"
                   if key == "norm_before_residual" else
                   "SGLang then loads lm_head from the target and vLLM sizes lm_head to the full vocab")
            problems.append(_nogo(f"config.{label}", f"config has no {label}; {why}"))
    facts["norm_before_residual"] = config.get("norm_before_residual")

    target, source, target_whole = _target_layers(d, config, fmt, target_config)
    num_layers = target.get("num_hidden_layers") if target else None
    facts["target"] = {"num_hidden_layers": num_layers, "source": source} if target else "unreachable"

    # -- dims
    dims = None
    try:
        hidden, heads = int(layer_cfg["hidden_size"]), int(layer_cfg["num_attention_heads"])
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        dims = _Dims(
            hidden=hidden, heads=heads,
            kv_heads=int(layer_cfg.get("num_key_value_heads") or heads),
            head_dim=int(layer_cfg.get("head_dim") or hidden // heads),
            intermediate=int(layer_cfg["intermediate_size"]),
            target_hidden=int(config.get("target_hidden_size") or hidden),
            n_aux=len(ids) if isinstance(ids, list) and ids else 3,
            draft_vocab=int(config.get("draft_vocab_size") or layer_cfg["vocab_size"]),
            target_vocab=int(layer_cfg["vocab_size"]),
            mla=_mla_dims(layer_cfg) if mla else None,
        )
    except (KeyError, TypeError, ValueError) as e:
        problems.append(_nogo("config.sizes", f"cannot size the drafter from config.json: {e!r}"))
    if dims is not None:
        facts["sizes"] = {"hidden": dims.hidden, "target_hidden": dims.target_hidden, "draft_vocab": dims.draft_vocab,
                          "target_vocab": dims.target_vocab}
        if target:
            for key, ours in (("hidden_size", dims.target_hidden), ("vocab_size", dims.target_vocab)):
                if isinstance(target.get(key), int) and target[key] != ours:
                    problems.append(_nogo(f"target.{key}", f"drafter expects target {key} {ours}, "
                                          f"target has {target[key]}"))

    # -- tensors
    names = _our_names(fmt, set(ckpt.meta) - extra_names)
    shown = {ours: n for n, ours in names.items()}
    meta = {ours: ckpt.meta[n] for n, ours in names.items()}
    if fmt == "vllm" and any(n.startswith("layers.0.") for n in names):
        problems.append(_nogo("keys.layers0", "decoder weights are named layers.0.*: vLLM reads them, SGLang's "
                              "LlamaForCausalLMEagle3 reads only midlayer.* and silently drops them"))
    need_embed = dims is not None and dims.hidden != dims.target_hidden
    tensor_problems = _check_tensors(meta, dims, shown=shown, need_embed=need_embed, need_vocab=False)
    problems += tensor_problems
    if dims is not None and "d2t" not in meta and dims.draft_vocab < dims.target_vocab:
        problems.append(_nogo("vocab.d2t_missing", f"no d2t with draft vocab {dims.draft_vocab} < target vocab "
                              f"{dims.target_vocab}: vLLM maps draft id i to target id i, SGLang has no hot tokens"))
    if "t2d" not in meta:
        problems.append(_warn("vocab.t2d_missing", "no t2d: vLLM and SGLang skip it, but specops and speculators "
                              "training read it"))
    if dims is not None and "d2t" in meta and "t2d" in meta:
        problems += _check_vocab(ckpt.load(shown["d2t"]), ckpt.load(shown["t2d"]), dims.draft_vocab, dims.target_vocab)
    facts["embed_tokens"] = "included" if EMBED_KEY in meta else "shared from the target by the engine"
    dtypes: dict[str, int] = {}
    for ours, (_, dt) in meta.items():
        dtypes[_dtype_name(dt)] = dtypes.get(_dtype_name(dt), 0) + 1
    facts["dtypes"] = dtypes
    for ours, (_, dt) in sorted(meta.items()):
        if dt is not None and dt.is_floating_point and not bool(torch.isfinite(ckpt.load(shown[ours])).all()):
            problems.append(_nogo(f"values.{shown[ours]}", f"{shown[ours]} has non-finite values"))

    problems += _check_layer_ids(config, fmt, num_layers, facts, sglang_rule(target_whole))


def _check_vllm_config(config: Mapping[str, Any]) -> list[CheckResult]:
    out = []
    archs = config.get("architectures") or []
    if VLLM_ARCH not in archs:
        if any(a.startswith("Eagle3") or a.endswith("Eagle3") for a in archs):
            out.append(_warn("config.architectures", f"architectures {archs}: vLLM accepts it, SGLang registers only "
                             f"{VLLM_ARCH}"))
        else:
            out.append(_nogo("config.architectures", f"architectures {archs} is not {[VLLM_ARCH]}"))
    if config.get("model_type") != "llama":
        out.append(_warn("config.model_type", f"model_type {config.get('model_type')!r}: the EAGLE-3 Llama drafter "
                         "config is read as 'llama'"))
    return out + _layer_count_and_tie(config, "SGLang then uses the [vocab, H] embedding as lm_head instead of "
                                      "the [draft_vocab, H] lm_head")


def _check_mla_config(config: Mapping[str, Any]) -> list[CheckResult]:
    """What vLLM 0.32 needs of an MLA EAGLE-3 dir's config.json (deepseek_eagle3.py, the
    speculative config). SGLang's EAGLE-3 loader is Llama's: such a dir is vLLM's only."""
    out = []
    archs = config.get("architectures") or []
    if archs != [MLA_VLLM_ARCH]:
        out.append(_nogo("config.architectures", f"architectures {archs} is not {[MLA_VLLM_ARCH]}: vLLM builds the "
                         "MLA layer from that class only"))
    if config.get("model_type") != MLA_MODEL_TYPE:
        why = (": vLLM rewrites a deepseek_v3 draft config into its MTP model (Eagle3DeepSeekMTPModel, not "
               "served)" if config.get("model_type") == "deepseek_v3" else "")
        out.append(_nogo("config.model_type", f"model_type {config.get('model_type')!r} is not {MLA_MODEL_TYPE!r}"
                         f"{why}"))
    if not config.get("q_lora_rank"):
        out.append(_nogo("config.q_lora_rank", f"q_lora_rank {config.get('q_lora_rank')!r}: vLLM 0.32 loads "
                         "q_a_proj and kv_a_proj_with_mqa as one fused projection, absent without a q_lora_rank"))
    return out + _layer_count_and_tie(config, "the [draft_vocab, H] lm_head would be the embedding")


def _layer_count_and_tie(config: Mapping[str, Any], tie_cost: str) -> list[CheckResult]:
    """One decoder layer (the midlayer, the only one checked) and an untied lm_head; `tie_cost` says
    what a tied one breaks."""
    out = []
    if config.get("num_hidden_layers", 1) != 1:
        out.append(_warn("config.num_hidden_layers", f"num_hidden_layers {config.get('num_hidden_layers')}: only the "
                         "first (midlayer) decoder layer is checked"))
    if config.get("tie_word_embeddings") is True:
        out.append(_nogo("config.tie_word_embeddings", f"tie_word_embeddings is true: {tie_cost}"))
    return out


def _check_verifier_path(name: Any) -> list[CheckResult]:
    """`vllm serve <speculators dir>` loads the verifier from speculators_config.verifier.name_or_path:
    it must be a model directory there (or a repository id, which needs a hub this project never
    uses); a served name such as "smollm2" fails with "Invalid repository ID or local directory"."""
    if not isinstance(name, str) or not name:
        return [_nogo("config.verifier", f"speculators_config.verifier.name_or_path {name!r} is not a path")]
    path = Path(name)
    if (path / "config.json").is_file():
        return []
    if path.is_absolute() or path.exists():
        return [_warn("config.verifier", f"speculators_config.verifier.name_or_path {name!r} is not a model "
                      "directory on this machine: `vllm serve` of this export loads the verifier from there")]
    if name.count("/") == 1 and all(name.split("/")):
        return [_warn("config.verifier", f"speculators_config.verifier.name_or_path {name!r} is a repository id, "
                      "not a local directory: serving it needs the model hub")]
    return [_nogo("config.verifier", f"speculators_config.verifier.name_or_path {name!r} is neither a model "
                  "directory nor a repository id: `vllm serve` of this export fails (\"Invalid repository ID "
                  "or local directory\"); export with the target's model directory")]


def _check_speculators_config(config: Mapping[str, Any], kind: str = "eagle3", *,
                              arch: str | None = None) -> list[CheckResult]:
    """The structure vLLM's SpeculatorsConfig.validate_speculators_config and speculators' pydantic
    models require. `arch`: the architecture speculators writes for `kind` (default SPECULATORS_ARCHS[kind])."""
    out = []
    arch = arch or SPECULATORS_ARCHS[kind]
    if config.get("speculators_model_type") != kind:
        out.append(_nogo("config.speculators_model_type", f"speculators_model_type "
                         f"{config.get('speculators_model_type')!r} is not {kind!r}"))
    if config.get("architectures") != [arch]:
        out.append(_warn("config.architectures", f"architectures {config.get('architectures')} is not "
                         f"{[arch]} (speculators' {kind} config default)"))
    if not isinstance(config.get("transformer_layer_config"), Mapping):
        out.append(_nogo("config.transformer_layer_config", "transformer_layer_config must be a dict"))
    elif config["transformer_layer_config"].get("tie_word_embeddings") is True:
        out.append(_nogo("config.tie_word_embeddings", "transformer_layer_config.tie_word_embeddings is true"))
    sc = config.get("speculators_config")
    try:
        methods = sc["proposal_methods"]
        types = [m["proposal_type"] for m in methods]
        k = methods[0]["speculative_tokens"]
        verifier = sc["verifier"]
        _ = verifier["name_or_path"], verifier["architectures"]
        if sc.get("algorithm") != kind:
            out.append(_nogo("config.speculators_config", f"speculators_config.algorithm {sc.get('algorithm')!r} "
                             f"is not {kind!r}"))
        if sc.get("default_proposal_method") not in types:
            out.append(_nogo("config.speculators_config", f"default_proposal_method "
                             f"{sc.get('default_proposal_method')!r} is not one of {types}"))
        if not isinstance(k, int) or k < 1:
            out.append(_nogo("config.speculators_config", f"speculative_tokens {k!r} must be an int >= 1"))
        out += _check_verifier_path(verifier["name_or_path"])
    except (KeyError, IndexError, TypeError) as e:
        out.append(_nogo("config.speculators_config", "speculators_config needs algorithm, proposal_methods "
                         f"[{{proposal_type, speculative_tokens}}], default_proposal_method, verifier "
                         f"{{name_or_path, architectures}}: missing {e!r}"))
    return out
