"""The DFlash export formats: vLLM's (`DFlashDraftModel`, a Qwen3 config with `dflash_config`) and
speculators' (`speculators_model_type: "dflash"`); their check.

What vLLM 0.32 reads:

* Architecture "DFlashDraftModel" is registered to `DFlashQwen3ForCausalLM`
  (model_executor/models/registry.py, qwen3_dflash.py); served as `{"method": "dflash"}`, which
  wraps the config in EAGLEConfig (a name starting with "DFlash" is kept) and turns parallel drafting
  on (config/speculative.py).
* Config: a Qwen3 config whose num_hidden_layers is the draft's; vocab_size the target's (embedding
  rows, the logits scattered back over it), draft_vocab_size (lm_head rows; absent: vocab_size),
  target_hidden_size (fc input = number of layer ids x it); `dflash_config.mask_token_id`, the input
  id of the mask slots (read first by the model and by the proposer, `llm_base_proposer.py`
  `_init_parallel_drafting_params`), and `dflash_config.target_layer_ids`. block_size is not read
  by vLLM for DFlash (the serving command's num_speculative_tokens is the block's mask slots); it is
  written as the DFlash checkpoints and speculators' converter keep it.
* Layer ids. DFlash's target_layer_ids are output-of-layer ids: vLLM captures `[t + 1 for t in
  them]` (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config, and
  gpu_model_runner._get_eagle3_aux_layers_from_config), i.e. specops' aux_layer_ids, input-to-layer
  ids. A top-level eagle_aux_hidden_state_layer_ids wins over them in both readers, and an
  eagle_config dict wins in the second (even without ids: then the target's default layers), so
  the export writes neither. The target appends a state once per layer, in layer order
  (models/interfaces.py _maybe_add_hidden_state), so the ids must be distinct and increasing to meet
  fc's column blocks in the order they were trained; id t = -1 (input 0, the embedding output) is no
  layer's output, and DeepSeek-family targets add a None residual there (deepseek_v2.py); t >= L is
  never captured and fc gets fewer features than it expects ("DFlash drafter expects ... features").
* Attention, per layer (qwen3_dflash.py `_dflash_layer_causal`, `_resolve_layer_attention`):
  causal = `is_causal` if set, else `dflash_config.causal` if set, else layer_types[i] ==
  "sliding_attention"; sliding when layer_types says so or `dflash_config.use_swa`. The export
  writes layer_types all "full_attention", use_sliding_window false, sliding_window null and
  dflash_config.causal false: every layer full attention, non-causal within the block, as the
  drafter computes it (model.py); `is_neox_style` true, the RoPE layout it was trained with.
* Weights (`DFlashQwen3ForCausalLM.load_weights`): names as the drafter's state_dict (model.py);
  every name but lm_head.* gets "model."; q/k/v and gate/up are stacked; `d2t` becomes
  draft_id_to_target_id, a parameter only when draft_vocab_size != the target's vocab (with equal
  vocabs the name is unknown and the loader fails: no d2t is written then, the map being the
  identity); `t2d` is skipped; a name containing "mask_hidden" fails an assert; unknown names fail
  AutoWeightsLoader; missing ones stay uninitialised (load_weights returns no set to check).
  embed_tokens absent: has_own_embed_tokens stays False and the proposer
  (v1/spec_decode/llm_base_proposer.py `_maybe_share_embeddings`) gives the drafter the target's
  embedding when the widths match, and keeps its own, uninitialised, when they differ. lm_head
  absent: `_maybe_share_lm_head` gives it the target's [vocab, H] head.
* speculators format: vLLM's `update_dflash` (transformers_utils/configs/speculators/algos.py) takes
  transformer_layer_config as the model config and sets architectures ["DFlashDraftModel"],
  draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids =
  aux_hidden_state_layer_ids (input-to-layer; a KeyError without it) and dflash_config =
  {mask_token_id (a KeyError without it), target_layer_ids = ids - 1, sample_from_anchor,
  causal = not sliding_window_non_causal (absent: not causal)}. speculators' own
  DFlashSpeculatorConfig (models/dflash/config.py) writes architectures ["DFlashSpeculator"] and
  block_size, and defaults sliding_window_non_causal to False, which vLLM reads as causal on every
  layer: the export writes it true. Tensor names are the vLLM format's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ....checks.result import CheckResult
from ....errors import InputError
from ....target import AUX_CONVENTION
from ...formats import _DROPPED_SUFFIXES, EMBED_KEY, ExportError, _Checkpoint, drafter_config_from_export
from ..base import CheckReport
from ..eagle3.export import (
    _check_speculators_config,
    _check_vocab,
    _draft_fields,
    _dtype_name,
    _manifest,
    _nogo,
    _raise_if_nogo,
    _target_int,
    _target_layers,
    _warn,
    _write_dir,
)
from ..peagle.export import MASK_KEY, mask_token_id_of

__all__ = ["EXPORT_FORMATS", "LAYER_IDS_FIELD", "MASK_TOKEN_FIELD", "NOT_AN_EXPORT", "SPECULATORS_ARCH",
           "SPECULATORS_LAYER_IDS_FIELD", "VLLM_ARCH", "check_export", "drafter_config_from_dflash_export",
           "export_dflash", "export_format", "load_dflash_export"]

VLLM_ARCH = "DFlashDraftModel"
SPECULATORS_TYPE = "dflash"
SPECULATORS_ARCH = "DFlashSpeculator"  # speculators models/dflash/config.py DFlashSpeculatorConfig default
EXPORT_FORMATS = ("vllm", "speculators")
EXPORT_FORMAT = "specops-dflash-export-v1"
MASK_TOKEN_FIELD = "mask_token_id"  # vllm: inside dflash_config; speculators: top level
LAYER_IDS_FIELD = "target_layer_ids"  # vllm, inside dflash_config: output-of-layer ids (aux ids - 1)
SPECULATORS_LAYER_IDS_FIELD = "aux_hidden_state_layer_ids"  # speculators: input-to-layer ids
NOT_AN_EXPORT = "no DFlashDraftModel architecture or dflash_config, no speculators_model_type 'dflash'"

_FULL = "full_attention"
_SLIDING = "sliding_attention"
_LAYER_PARAMS = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                 "mlp.down_proj")


@dataclass(frozen=True, slots=True)
class _Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int  # the draft's decoder layers
    n_aux: int
    target_hidden: int
    draft_vocab: int
    target_vocab: int

    @property
    def mapped(self) -> bool:
        """Whether the draft vocab is a subset, i.e. d2t ships (vLLM has no map otherwise)."""
        return self.draft_vocab < self.target_vocab

    def shapes(self) -> dict[str, tuple[int, ...]]:
        h, q, kv, d, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.head_dim, \
            self.intermediate
        layer = dict(zip(_LAYER_PARAMS, ((h,), (q, h), (kv, h), (kv, h), (h, q), (d,), (d,), (h,), (i, h), (i, h),
                                         (h, i))))
        return {
            EMBED_KEY: (self.target_vocab, h),
            "fc.weight": (h, self.n_aux * self.target_hidden),  # cat of n_aux target states -> H
            "hidden_norm.weight": (h,),
            **{f"layers.{n}.{p}.weight": s for n in range(self.layers) for p, s in layer.items()},
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab, h),
            "d2t": (self.draft_vocab,),
            "t2d": (self.target_vocab,),
        }


def _label(name: str) -> str:
    return name.removesuffix(".weight")  # "fc.weight" -> check "shape.fc"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---------------------------------------------------------------------------------------------
# Checks shared by export (before writing) and check_export (a written or third-party dir)


def _layer_id_problems(aux: Any, num_layers: int | None, *, field: str) -> list[CheckResult]:
    """Input-to-layer ids `aux` (DFlash target_layer_ids = aux - 1) against what vLLM captures
    (module docstring, "Layer ids"); `field` names where they came from."""
    def bad(message: str, **data: Any) -> list[CheckResult]:
        return [_nogo("config.target_layer_ids", f"{field} {aux!r}: {message}", **data)]

    if not isinstance(aux, list) or not aux or not all(_is_int(i) for i in aux):
        return bad("must be a non-empty list of ints")
    if len(set(aux)) != len(aux):
        return bad("repeats a layer: vLLM's target captures each layer once, so fc gets fewer states than ids")
    if aux != sorted(aux):
        return bad("not increasing: vLLM's target appends its states in layer order, so fc's column blocks "
                   "would meet other layers than they were trained on")
    ids = [i - 1 for i in aux]
    if ids[0] < 0:
        return bad(f"DFlash target_layer_id {ids[0]} (input-to-layer 0, the embedding output) is no layer's output; "
                   "DeepSeek-family targets add a None residual there")
    if num_layers is not None and ids[-1] >= num_layers:
        return bad(f"DFlash target_layer_ids {ids} reach past the last layer {num_layers - 1} of a {num_layers}-layer "
                   "target: vLLM never captures it and fc gets fewer features than it expects", num_layers=num_layers)
    return []


def _check_tensors(meta: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]], dims: _Dims | None, *,
                   need_embed: bool) -> list[CheckResult]:
    """Names, shapes and dtypes of the tensors (file names = the drafter's)."""
    out = []
    hidden = sorted(n for n in meta if MASK_KEY in n)
    if hidden:
        out.append(_nogo("keys.mask_hidden", f"{', '.join(hidden)}: vLLM's DFlash loader asserts that no "
                         "mask_hidden weight ships (its mask slots embed mask_token_id)"))
    if dims is None:
        return out  # config.sizes says why
    expected = dims.shapes()
    required = [n for n in expected if n not in (EMBED_KEY, "d2t", "t2d")]
    required += [EMBED_KEY] if need_embed else []
    required += ["d2t"] if dims.mapped else []
    missing = [n for n in required if n not in meta]
    if missing:
        why = (" (embed_tokens: the drafter's width differs from the target's, so vLLM keeps its own, which "
               "would stay uninitialised)" if EMBED_KEY in missing else "")
        out.append(_nogo("keys.missing", f"missing tensors vLLM would leave uninitialised: {', '.join(missing)}{why}",
                         missing=missing))
    unknown = sorted(n for n in meta if n not in expected and MASK_KEY not in n)
    if unknown:
        out.append(_nogo("keys.unknown", f"tensors the {dims.layers}-layer DFlash drafter has no place for (vLLM's "
                         f"loader fails on them): {', '.join(unknown)}", unknown=unknown))
    if not dims.mapped and "d2t" in meta:
        out.append(_nogo("keys.d2t", f"d2t with draft vocab = target vocab ({dims.draft_vocab}): vLLM then has no "
                         "draft_id_to_target_id and its loader fails on the name; leave d2t out (the identity)"))
    for name, (shape, dtype) in meta.items():
        if name in expected and tuple(shape) != expected[name]:
            out.append(_nogo(f"shape.{_label(name)}", f"{name} has shape {list(shape)}, config says "
                             f"{list(expected[name])}", shape=list(shape), expected=list(expected[name])))
        if name == "d2t" and dtype != torch.int64:
            out.append(_nogo("dtype.d2t", f"d2t is {_dtype_name(dtype)}, must be int64 (target id = i + d2t[i])"))
        elif name == "t2d" and dtype != torch.bool:
            out.append(_nogo("dtype.t2d", f"t2d is {_dtype_name(dtype)}, must be bool"))
        elif name not in ("d2t", "t2d") and (dtype is None or not dtype.is_floating_point):
            out.append(_nogo(f"dtype.{_label(name)}", f"{name} is {_dtype_name(dtype)}, must be floating point"))
    return out


def _vocab_problems(d2t: torch.Tensor, t2d: torch.Tensor | None, dims: _Dims) -> list[CheckResult]:
    """d2t maps every draft id to a distinct target id in range (and agrees with t2d when it ships)."""
    if t2d is None:  # vLLM skips t2d; specops derives it from d2t
        ids = torch.arange(d2t.numel()) + d2t.long()
        t2d = torch.zeros(dims.target_vocab, dtype=torch.bool)
        t2d[ids[(ids >= 0) & (ids < dims.target_vocab)]] = True
    return _check_vocab(d2t, t2d, dims.draft_vocab, dims.target_vocab)


def _value_problems(names: Any, load: Callable[[str], torch.Tensor]) -> list[CheckResult]:
    """Non-finite floating-point tensors; reads one tensor at a time."""
    out = []
    for name in sorted(names):
        t = load(name)
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            out.append(_nogo(f"values.{_label(name)}", f"{name} has non-finite values"))
    return out


def _attention_problems(layer: Mapping[str, Any], dflash: Mapping[str, Any], n_layers: int | None) -> list[CheckResult]:
    """What vLLM makes of the attention fields (module docstring, "Attention") against the drafter's
    full, non-causal attention."""
    out = []
    types = layer.get("layer_types")
    if types is not None and (not isinstance(types, list) or (n_layers is not None and len(types) != n_layers)):
        out.append(_nogo("config.attention", f"layer_types {types!r} is not one entry per draft layer ({n_layers})"))
        types = None
    causal = next((v for v in (layer.get("is_causal"), dflash.get("causal")) if v is not None), None)
    if causal is None:
        causal = bool(types) and _SLIDING in types
    sliding = bool(dflash.get("use_swa")) or bool(types and _SLIDING in types) or bool(layer.get("use_sliding_window"))
    if causal or sliding:
        out.append(_nogo("config.attention", f"vLLM would serve {'causal ' if causal else ''}"
                         f"{'sliding-window ' if sliding else ''}attention (is_causal {layer.get('is_causal')!r}, "
                         f"dflash_config.causal {dflash.get('causal')!r}, use_swa {dflash.get('use_swa')!r}, "
                         f"layer_types {types!r}, use_sliding_window {layer.get('use_sliding_window')!r}); "
                         "the DFlash drafter attends with full attention, non-causal within the block"))
    if layer.get("is_neox_style", True) is not True:
        out.append(_nogo("config.rope", "is_neox_style is not true: the drafter's RoPE is neox-style"))
    if dflash.get("sample_from_anchor"):
        out.append(_nogo("config.sample_from_anchor", "sample_from_anchor is true: vLLM refuses it for DFlash "
                         "(the anchor slot is the bonus token; only mask slots draft)"))
    if dflash.get("use_aux_hidden_state", layer.get("use_aux_hidden_state", True)) is False:
        out.append(_nogo("config.use_aux_hidden_state", "use_aux_hidden_state is false: vLLM skips fc"))
    for key, why in (("attention_sink_bias", "an attention sink bias"), ("attention_value_scale", "a value scale")):
        if dflash.get(key):
            out.append(_nogo("config.attention", f"dflash_config.{key} asks for {why}, which the drafter has not"))
    if layer.get("attention_bias"):
        out.append(_nogo("config.attention_bias", "attention_bias is true: the drafter's projections have no bias"))
    if layer.get("hidden_act", "silu") != "silu":
        out.append(_nogo("config.hidden_act", f"hidden_act {layer.get('hidden_act')!r}: vLLM's Qwen3 MLP runs "
                         "silu only"))
    return out


def _mask_token_problems(token: Any, field: str | None, vocab: Any, fmt: str) -> list[CheckResult]:
    if field is None:
        where = ("top-level mask_token_id (vLLM's update_dflash fails without it)" if fmt == "speculators" else
                 "dflash_config.mask_token_id (vLLM refuses parallel drafting without a mask token id)")
        return [_nogo("config.mask_token_id", f"no mask token id in config.json: {where}")]
    if not _is_int(token):
        return [_nogo("config.mask_token_id", f"{field} {token!r} is not an integer token id")]
    if _is_int(vocab) and not 0 <= token < vocab:
        return [_nogo("config.mask_token_id", f"{field} {token} is outside the target vocab [0, {vocab}): the mask "
                      "slots' embedding lookup would read past the table")]
    return []


# ---------------------------------------------------------------------------------------------
# Reading a dir


def export_format(config: Mapping[str, Any], names: set[str]) -> str | None:
    """"speculators" for speculators_model_type "dflash"; "vllm" for architectures ["DFlashDraftModel"]
    or a dflash_config beside no EAGLE-3 architecture or midlayer.* weights; else None."""
    kind = config.get("speculators_model_type")
    if kind is not None:
        return "speculators" if kind == SPECULATORS_TYPE else None
    archs = config.get("architectures") or []
    if VLLM_ARCH in archs:
        return "vllm"
    eagle3 = any("Eagle3" in a for a in archs) or any(n.startswith("midlayer.") for n in names)
    return "vllm" if isinstance(config.get("dflash_config"), Mapping) and not eagle3 else None


def _aux_ids(config: Mapping[str, Any], fmt: str) -> tuple[Any, str, list[CheckResult]]:
    """(the input-to-layer ids vLLM captures for this config, where from, disagreements among the
    fields it reads)."""
    if fmt == "speculators":
        return config.get(SPECULATORS_LAYER_IDS_FIELD), SPECULATORS_LAYER_IDS_FIELD, []
    dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), Mapping) else {}
    ids = dflash.get(LAYER_IDS_FIELD)
    from_ids = [i + 1 for i in ids] if isinstance(ids, list) and all(_is_int(i) for i in ids) else None
    top = config.get("eagle_aux_hidden_state_layer_ids")
    eagle = config.get("eagle_config")
    out = []
    if top:
        if from_ids is not None and from_ids != top:
            out.append(_nogo("config.target_layer_ids", f"eagle_aux_hidden_state_layer_ids {top} (which vLLM reads "
                             f"first) is not dflash_config.target_layer_ids {ids} + 1"))
        return top, "eagle_aux_hidden_state_layer_ids", out
    if isinstance(eagle, Mapping) and eagle.get("eagle_aux_hidden_state_layer_ids") != from_ids:
        out.append(_nogo("config.target_layer_ids", f"eagle_config: vLLM's gpu_model_runner takes its ids "
                         f"{eagle.get('eagle_aux_hidden_state_layer_ids')} (none: the target's default layers) over "
                         f"dflash_config.target_layer_ids {ids} + 1"))
    return (from_ids if from_ids is not None else ids), "dflash_config.target_layer_ids + 1", out


def load_dflash_export(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the DFlashDrafter state_dict, config.json) of an export in either format: the file's names
    are the drafter's; d2t/t2d filled in as the identity map when the draft vocab is the target's
    (no d2t ships then), t2d derived from d2t when absent; embed_tokens only when it ships."""
    d = Path(directory)
    config = json.loads((d / "config.json").read_text())
    ckpt = _Checkpoint(d)
    sd = {n: ckpt.load(n) for n in ckpt.meta}
    layer = config.get("transformer_layer_config") or config
    vocab = int(layer["vocab_size"])
    draft_vocab = int(config.get("draft_vocab_size") or vocab)
    d2t = sd.setdefault("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
    if "t2d" not in sd:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(draft_vocab) + d2t] = True
        sd["t2d"] = t2d
    return sd, config


def drafter_config_from_dflash_export(config: Mapping[str, Any], target_num_hidden_layers: int) -> dict[str, Any]:
    """DFlashConfig keyword arguments from an export's config.json, either format."""
    fmt = export_format(config, set())
    if fmt is None:
        raise InputError(f"not a DFlash export: {NOT_AN_EXPORT}")
    aux, field, _ = _aux_ids(config, fmt)
    token, token_field = mask_token_id_of(config, fmt)
    if not isinstance(aux, list) or token_field is None:
        raise InputError(f"DFlash export config has no layer ids ({field}) or no mask token id")
    layer = config.get("transformer_layer_config") or config
    kw = drafter_config_from_export({**config, "eagle_aux_hidden_state_layer_ids": aux},
                                    target_num_hidden_layers).to_dict()
    kw.update(num_hidden_layers=int(layer["num_hidden_layers"]), mask_token_id=int(token))
    dflash = config.get("dflash_config") or {}
    block = config.get("block_size", dflash.get("block_size") if isinstance(dflash, Mapping) else None)
    if block is not None:
        kw["block_size"] = int(block)
    return kw


def check_export(report: CheckReport, d: Path, config: Mapping[str, Any], ckpt: _Checkpoint,
                 target_config: Mapping[str, Any] | str | Path | None) -> None:
    """Check a DFlash dir in format report.format, ours or third-party, for what vLLM needs to serve
    the drafter's own math (module docstring); adds to report.problems and report.facts.

    `target_config`: the target's config dict, or a local model dir / config.json path; without it,
    our manifest.json (or a local speculators verifier path) when present. It range-checks the layer
    ids and compares the target's hidden size and vocab. Our manifest's aux_layer_ids must be the
    ids vLLM captures (a target_layer_ids list written unconverted is one layer off).
    """
    problems, facts = report.problems, report.facts
    fmt = report.format
    facts["format"] = fmt
    facts["architectures"] = config.get("architectures")
    if fmt == "speculators":
        problems += _check_speculators_config(config, SPECULATORS_TYPE, arch=SPECULATORS_ARCH)
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, Mapping):
            return
        # what update_dflash builds: dflash_config.causal = not sliding_window_non_causal (absent: True)
        dflash = {"causal": not config.get("sliding_window_non_causal", True),
                  "sample_from_anchor": config.get("sample_from_anchor", False)}
    else:
        layer = config
        dflash = config.get("dflash_config")
        if VLLM_ARCH not in (config.get("architectures") or []):
            problems.append(_nogo("config.architectures", f"architectures {config.get('architectures')} is not "
                                  f"{[VLLM_ARCH]}, the name vLLM registers to DFlashQwen3ForCausalLM"))
        if config.get("model_type") != "qwen3":
            problems.append(_warn("config.model_type", f"model_type {config.get('model_type')!r}: vLLM's DFlash "
                                  "drafter is Qwen3's layers, read from a 'qwen3' config"))
        if not isinstance(dflash, Mapping):
            problems.append(_nogo("config.dflash_config", f"dflash_config is {dflash!r}, not a dict: vLLM's DFlash "
                                  "reads mask_token_id and target_layer_ids from it"))
            dflash = {}
    if layer.get("tie_word_embeddings") is True and fmt == "vllm":
        problems.append(_warn("config.tie_word_embeddings", "tie_word_embeddings is true: the drafter's lm_head "
                              "[draft_vocab, H] is its own"))

    # -- mask token, block
    token, token_field = mask_token_id_of(config, fmt)
    facts["mask_token_id"] = token if token_field is None else f"{token} ({token_field})"
    problems += _mask_token_problems(token, token_field, layer.get("vocab_size"), fmt)
    block = config.get("block_size", dflash.get("block_size"))
    facts["block_size"] = block
    if block is None:
        problems.append(_warn("config.block_size", "no block_size: the mask slots the drafter was trained with are "
                              "unknown (vLLM drafts num_speculative_tokens of them)"))
    elif not _is_int(block) or block < 2:
        problems.append(_nogo("config.block_size", f"block_size {block!r} must be an int >= 2 (the bonus slot and "
                              "a mask slot)"))
    elif fmt == "speculators":
        k = ((config.get("speculators_config") or {}).get("proposal_methods") or [{}])[0].get("speculative_tokens")
        if _is_int(k) and k > block - 1:
            problems.append(_warn("config.speculative_tokens", f"speculative_tokens {k} > block_size - 1 = "
                                  f"{block - 1}: the slots past those were never trained"))

    # -- sizes and attention
    dims = None
    n_layers = layer.get("num_hidden_layers")
    aux, field, disagree = _aux_ids(config, fmt)
    problems += disagree
    try:
        hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        kv_heads = int(layer.get("num_key_value_heads") or heads)
        if heads % kv_heads or int(n_layers) < 1:
            raise ValueError(f"{heads} heads over {kv_heads} kv heads, {n_layers} layers")
        dims = _Dims(hidden=hidden, heads=heads, kv_heads=kv_heads,
                     head_dim=int(layer.get("head_dim") or hidden // heads),
                     intermediate=int(layer["intermediate_size"]), layers=int(n_layers),
                     n_aux=len(aux) if isinstance(aux, list) else 0,
                     target_hidden=int(config.get("target_hidden_size") or hidden),
                     draft_vocab=int(config.get("draft_vocab_size") or layer["vocab_size"]),
                     target_vocab=int(layer["vocab_size"]))
    except (KeyError, TypeError, ValueError) as e:
        problems.append(_nogo("config.sizes", f"cannot size the drafter from config.json: {e!r}"))
    facts["layers"] = n_layers
    problems += _attention_problems(layer, dflash, dims.layers if dims else None)

    # -- target and layer ids
    target, source, _ = _target_layers(d, config, fmt, target_config)
    num_layers = target.get("num_hidden_layers") if target else None
    facts["target"] = {"num_hidden_layers": num_layers, "source": source} if target else "unreachable"
    if dims is not None:
        facts["sizes"] = {"hidden": dims.hidden, "target_hidden": dims.target_hidden,
                          "draft_vocab": dims.draft_vocab, "target_vocab": dims.target_vocab}
        if dims.draft_vocab > dims.target_vocab:
            problems.append(_nogo("config.draft_vocab_size", f"draft_vocab_size {dims.draft_vocab} exceeds the "
                                  f"vocab {dims.target_vocab}"))
        for key, ours in (("hidden_size", dims.target_hidden), ("vocab_size", dims.target_vocab)):
            if target and _is_int(target.get(key)) and target[key] != ours:
                problems.append(_nogo(f"target.{key}", f"drafter expects target {key} {ours}, target has "
                                      f"{target[key]}"))
    facts["target_layer_ids (DFlash, output-of-layer)"] = (
        [i - 1 for i in aux] if isinstance(aux, list) and all(_is_int(i) for i in aux) else aux)
    facts["aux_layer_ids (input-to-layer, captured by vLLM)"] = aux
    if aux is None:
        problems.append(_nogo("config.target_layer_ids", f"no layer ids ({field}): "
                              + ("vLLM's update_dflash fails" if fmt == "speculators" else
                                 "vLLM would size fc from the draft's layer count and capture the target's "
                                 "default layers")))
    else:
        problems += _layer_id_problems(aux, num_layers, field=field)
    manifest = d / "manifest.json"
    trained = json.loads(manifest.read_text()).get("aux_layer_ids") if manifest.is_file() else None
    if isinstance(trained, list) and isinstance(aux, list) and aux != trained:
        off = "each one layer off" if any(aux == [t + k for t in trained] for k in (1, -1)) else "other layers"
        problems.append(_nogo("config.target_layer_ids", f"vLLM captures input-to-layer {aux} ({field}), the drafter "
                              f"was trained on {trained} (manifest.json): {off}; DFlash target_layer_ids are aux "
                              f"ids - 1 = {[t - 1 for t in trained]}",
                              trained=trained, served=aux))

    # -- tensors
    meta = dict(ckpt.meta)
    need_embed = dims is not None and dims.hidden != dims.target_hidden
    problems += _check_tensors(meta, dims, need_embed=need_embed)
    if dims is not None and dims.mapped and "d2t" in meta:
        problems += _vocab_problems(ckpt.load("d2t"), ckpt.load("t2d") if "t2d" in meta else None, dims)
    problems += _value_problems(meta, ckpt.load)
    if (d / "mask_embedding.pt").is_file():
        problems.append(_warn("files.mask_embedding", "mask_embedding.pt: vLLM replaces the mask token's embedding "
                              "with it, which the drafter does not"))
    facts["embed_tokens"] = "included" if EMBED_KEY in meta else "shared from the target by vLLM"
    dtypes: dict[str, int] = {}
    for _, dt in meta.values():
        dtypes[_dtype_name(dt)] = dtypes.get(_dtype_name(dt), 0) + 1
    facts["dtypes"] = dtypes


# ---------------------------------------------------------------------------------------------
# Export


def _qwen3_config(fields: Mapping[str, Any], dims: _Dims, dtype: torch.dtype) -> dict[str, Any]:
    """The Qwen3 config vLLM builds the draft's layers from (the speculators transformer_layer_config)."""
    return {
        "model_type": "qwen3",
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.layers,  # the draft's
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "hidden_act": fields["hidden_act"],
        "rms_norm_eps": fields["rms_norm_eps"],
        "rope_theta": fields["rope_theta"],
        "rope_scaling": fields["rope_scaling"],
        "max_position_embeddings": fields["max_position_embeddings"],
        "attention_bias": False,
        "vocab_size": dims.target_vocab,  # embedding rows; logits are scattered back over it
        "tie_word_embeddings": False,
        # every layer full attention, non-causal within the block (module docstring, "Attention")
        "layer_types": [_FULL] * dims.layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "is_neox_style": True,
        "torch_dtype": _dtype_name(dtype),
    }


def export_dflash(fmt: str, state_dict: Mapping[str, torch.Tensor], drafter_config: Mapping[str, Any],
                  out_dir: str | Path, *, target_config: Mapping[str, Any], target_name_or_path: str,
                  speculative_tokens: int, dtype: torch.dtype = torch.bfloat16,
                  embed_tokens: bool | None = None) -> Path:
    """Write a DFlash drafter (its state_dict, `DFlashConfig.to_dict()`) in `fmt` ("vllm" |
    "speculators"): config.json, model.safetensors (the drafter's names), manifest.json; validated
    first, written to a temp dir, read back by `check_export`, then renamed into place. Raises
    ExportError naming every problem.

    `speculative_tokens`: the default k the speculators config names (1 .. block_size - 1, the mask
    slots trained). `embed_tokens`: None writes the embedding only when the drafter's width differs
    from the target's (below); True when it was trained away from the target's.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"DFlash has no export format {fmt!r} ({', '.join(EXPORT_FORMATS)})")
    if not dtype.is_floating_point:
        raise ExportError(f"export dtype {dtype} is not floating-point")
    num_layers, t_hidden, t_vocab = (_target_int(target_config, k) for k in ("num_hidden_layers", "hidden_size",
                                                                           "vocab_size"))
    # hidden .. rope (raises ExportError); norm_before_residual is EAGLE-3's, not read here
    fields = _draft_fields({"norm_before_residual": False, **drafter_config}, target_config)
    aux = list(drafter_config.get("aux_layer_ids") or [])
    problems = _layer_id_problems(aux, num_layers, field="aux_layer_ids")
    for key, given in (("target_vocab_size", t_vocab), ("target_hidden_size", t_hidden),
                       ("target_num_hidden_layers", num_layers)):
        if drafter_config.get(key) is not None and drafter_config[key] != given:
            problems.append(_nogo(f"config.{key}", f"drafter_config.{key} {drafter_config[key]} != {given} from the "
                                  "target config"))
    layers, token, block = (drafter_config.get(k) for k in ("num_hidden_layers", "mask_token_id", "block_size"))
    if not _is_int(layers) or layers < 1:
        problems.append(_nogo("config.num_hidden_layers", f"num_hidden_layers {layers!r} must be an int >= 1"))
    problems += _mask_token_problems(token, MASK_TOKEN_FIELD, t_vocab, fmt)
    if not _is_int(block) or block < 2:
        problems.append(_nogo("config.block_size", f"block_size {block!r} must be an int >= 2"))
    elif not _is_int(speculative_tokens) or not 1 <= speculative_tokens <= block - 1:
        problems.append(_nogo("config.speculative_tokens", f"speculative_tokens {speculative_tokens!r} must be in "
                              f"[1, block_size - 1 = {block - 1}], the mask slots the drafter was trained on"))
    _raise_if_nogo(problems, "refusing to export the DFlash drafter")
    dims = _Dims(hidden=int(fields["hidden_size"]), heads=int(fields["num_attention_heads"]),
                 kv_heads=int(fields["num_key_value_heads"]), head_dim=int(fields["head_dim"]),
                 intermediate=int(fields["intermediate_size"]), layers=layers, n_aux=len(aux),
                 target_hidden=t_hidden, draft_vocab=int(fields["draft_vocab_size"]), target_vocab=t_vocab)
    if dims.draft_vocab > t_vocab:
        problems.append(_nogo("config.draft_vocab_size", f"draft_vocab_size {dims.draft_vocab} exceeds the target "
                              f"vocab {t_vocab}"))
    # embed_tokens: the drafter's is the target's, frozen (train.freeze_embeddings). Absent from the
    # file, vLLM shares the target's when the widths match (llm_base_proposer.py
    # _maybe_share_embeddings): the same table, so the [target_vocab, H] copy is left out; with
    # another width vLLM keeps its own, so it ships. EAGLE-3's rule (eagle3/export.py _prepare).
    # lm_head always ships: absent, vLLM would share the target's [target_vocab, H] head, which is
    # not the drafter's [draft_vocab, H] (with d2t its rows meet the wrong ids, or the shapes clash);
    # when it equals the target's, vLLM shares it itself.
    write_embed = embed_tokens if embed_tokens is not None else dims.hidden != dims.target_hidden
    kept = {k: v.detach().to("cpu") for k, v in state_dict.items() if not k.endswith(_DROPPED_SUFFIXES)}
    if not write_embed:
        kept.pop(EMBED_KEY, None)
    if not dims.mapped:  # the full vocab: vLLM has no map to load (module docstring, "Weights")
        d2t = kept.pop("d2t", None)
        kept.pop("t2d", None)
        if d2t is not None and bool(d2t.ne(0).any()):
            problems.append(_nogo("vocab.d2t", "d2t over the full target vocab is not the identity: vLLM maps draft "
                                  "id i to target id i"))
    problems += _check_tensors({k: (tuple(v.shape), v.dtype) for k, v in kept.items()}, dims, need_embed=write_embed)
    if dims.mapped and "d2t" in kept:
        problems += _vocab_problems(kept["d2t"], kept.get("t2d"), dims)
    problems += _value_problems(kept, kept.__getitem__)
    _raise_if_nogo(problems, "refusing to export the DFlash drafter")
    # clone: safetensors refuses tensors sharing storage
    tensors = {n: (t.to(dtype) if t.is_floating_point() else t).contiguous().clone() for n, t in kept.items()}

    layer = _qwen3_config(fields, dims, dtype)
    target_ids = [i - 1 for i in aux]  # output-of-layer: vLLM adds 1 back
    if fmt == "vllm":
        config = {
            "architectures": [VLLM_ARCH],
            **layer,
            "draft_vocab_size": dims.draft_vocab,
            "target_hidden_size": dims.target_hidden,
            "block_size": block,
            "num_target_layers": num_layers,
            "dflash_config": {MASK_TOKEN_FIELD: token, LAYER_IDS_FIELD: target_ids, "causal": False,
                              "sample_from_anchor": False},
        }
    else:
        # Field names: speculators models/dflash/config.py (DFlashSpeculatorConfig), config.py
        # (SpeculatorsConfig, VerifierConfig), proposals/greedy.py.
        config = {
            "architectures": [SPECULATORS_ARCH],
            "speculators_model_type": SPECULATORS_TYPE,
            "transformer_layer_config": layer,
            "draft_vocab_size": dims.draft_vocab,
            "target_hidden_size": dims.target_hidden,
            "block_size": block,
            SPECULATORS_LAYER_IDS_FIELD: aux,  # input-to-layer; vLLM's update_dflash subtracts 1
            MASK_TOKEN_FIELD: token,
            "sliding_window_non_causal": True,  # vLLM: dflash_config.causal = not this
            "sample_from_anchor": False,
            "speculators_config": {
                "algorithm": SPECULATORS_TYPE,
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": target_name_or_path,
                             "architectures": list(target_config.get("architectures") or [])},
            },
            "torch_dtype": _dtype_name(dtype),
        }
    manifest = _manifest(fmt, target_config=target_config, target_name_or_path=target_name_or_path,
                         aux_layer_ids=aux, tensors=tensors, write_embed=write_embed)
    for key in ("sglang_eagle_config_layer_ids", "sglang_layer_rule"):
        manifest.pop(key, None)
    manifest.update({"format": EXPORT_FORMAT, "family": "dflash", "aux_layer_convention": AUX_CONVENTION,
                     "dflash_target_layer_ids": target_ids, "mask_token_id": token, "num_hidden_layers": layers,
                     "block_size": block, "speculative_tokens": speculative_tokens,
                     "serve": 'vLLM: {"method": "dflash", "num_speculative_tokens": k <= block_size - 1} '
                              "(speculators format: method implied)"})
    return _write_dir(Path(out_dir), config, tensors, manifest, target_config, check_export)
