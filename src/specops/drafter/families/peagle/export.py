"""The P-EAGLE export formats: EAGLE-3's dirs (`eagle3/export.py`) plus `mask_hidden` and the mask
token id; their check.

What vLLM 0.32 reads (`vllm/model_executor/models/llama_eagle3.py`, `Eagle3LlamaForCausalLM`):
with `parallel_drafting` on, a buffer `mask_hidden` [1, fc_input_size = n_aux * H_t] filled by
`load_weights` from a tensor named `mask_hidden` (`loaded_weight.view(1, -1)`: any shape of that
many elements), and a ValueError when the weights have none. With parallel drafting off the tensor
is skipped with a warning, so the same dir serves as a plain EAGLE-3 chain. The mask token id
comes from the draft config (`llm_base_proposer.py` `_init_parallel_drafting_params`, in order):
`dflash_config.mask_token_id`, `mask_token_id`, `dspark_noise_token_id`, `pard_token`,
`ptd_token_id`; none of them: a ValueError at start.

* vllm format: EAGLE-3's (`LlamaForCausalLMEagle3`, `midlayer.*`) + `mask_hidden` [1, n_aux * H_t]
  + `mask_token_id` in config.json; served with `{"method": "eagle3", "parallel_drafting": true}`.
* speculators format: `speculators_model_type: "peagle"` (speculators `models/peagle/config.py`
  PEagleSpeculatorConfig: `mask_token_id` top level, architectures ["PEagleSpeculator"]) + the
  tensor `mask_hidden`. vLLM's `update_peagle` (transformers_utils/configs/speculators/algos.py)
  maps it to `PeagleLlamaForCausalLM` (= Eagle3LlamaForCausalLM), `pard_token = mask_token_id`
  (a KeyError when absent) and `norm_before_residual` default False;
  `SpeculatorsConfig.build_vllm_speculative_config` turns it into method eagle3 +
  parallel_drafting, so `vllm serve <dir>` drafts in parallel by itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from ....checks.result import CheckResult
from ...formats import ExportError, _Checkpoint, _detect_format
from ..base import CheckReport
from ..eagle3.export import Extra, check_export as eagle3_check_export, export_speculators, export_vllm

__all__ = ["MASK_KEY", "MASK_TOKEN_KEYS", "NOT_AN_EXPORT", "check_export", "export_format", "export_peagle",
           "mask_token_id_of"]

MASK_KEY = "mask_hidden"  # the tensor's name in both formats (vLLM and speculators)
# The config fields vLLM takes the mask token id from, in its order (module docstring).
MASK_TOKEN_KEYS = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")
EXPORT_FORMAT = "specops-peagle-export-v1"
NOT_AN_EXPORT = "no speculators_model_type 'peagle', no mask_hidden tensor or mask_token_id beside EAGLE-3 weights"


def _nogo(name: str, message: str, **data: Any) -> CheckResult:
    return CheckResult(name, "nogo", message, data)


def mask_token_id_of(config: Mapping[str, Any], fmt: str) -> tuple[Any, str | None]:
    """(the mask token id vLLM would use, the field it comes from) of a config.json in format `fmt`;
    (None, None) when it names none. speculators: only `mask_token_id` (vLLM's update_peagle reads it)."""
    if fmt == "speculators":
        return (config["mask_token_id"], "mask_token_id") if "mask_token_id" in config else (None, None)
    dflash = config.get("dflash_config")
    if isinstance(dflash, Mapping) and "mask_token_id" in dflash:
        return dflash["mask_token_id"], "dflash_config.mask_token_id"
    for key in MASK_TOKEN_KEYS:
        if config.get(key) is not None:
            return config[key], key
    return None, None


def export_format(config: Mapping[str, Any], names: set[str]) -> str | None:
    """"speculators" for speculators_model_type "peagle"; "vllm" for an EAGLE-3 vLLM dir with
    mask_hidden or a mask token field; else None."""
    kind = config.get("speculators_model_type")
    if kind is not None:
        return "speculators" if kind == "peagle" else None
    if _detect_format(config, names) == "vllm" and (MASK_KEY in names or mask_token_id_of(config, "vllm")[0] is not None):
        return "vllm"
    return None


def check_export(report: CheckReport, d: Path, config: Mapping[str, Any], ckpt: _Checkpoint,
                 target_config: Mapping[str, Any] | str | Path | None) -> None:
    """Everything EAGLE-3's check asks of the dir (`eagle3/export.py` check_export, speculators type
    "peagle"), then the mask token id (present where vLLM reads it, an int in [0, target vocab)) and
    mask_hidden (present; n_aux * H_t elements in one row, n_aux = the aux layer count, H_t the
    target's hidden size; floating point, finite)."""
    fmt = report.format
    eagle3_check_export(report, d, config, ckpt, target_config, extra_names=frozenset({MASK_KEY}),
                        speculators_type="peagle")
    problems, facts = report.problems, report.facts
    layer = config.get("transformer_layer_config") if fmt == "speculators" else config
    layer = layer if isinstance(layer, Mapping) else {}

    # -- the mask token id
    token, field = mask_token_id_of(config, fmt)
    facts["mask_token_id"] = token if field is None else f"{token} ({field})"
    vocab = layer.get("vocab_size")
    if field is None:
        where = ("top-level mask_token_id (vLLM's update_peagle reads it: a KeyError without it)"
                 if fmt == "speculators" else f"any of {', '.join(MASK_TOKEN_KEYS)}")
        problems.append(_nogo("config.mask_token_id", f"no mask token id in config.json: {where}; vLLM refuses "
                              "parallel drafting without one (\"the draft model config must have ... "
                              "`mask_token_id` ... specified in its config.json\")"))
    elif isinstance(token, bool) or not isinstance(token, int):
        problems.append(_nogo("config.mask_token_id", f"{field} {token!r} is not an integer token id"))
    elif isinstance(vocab, int) and not 0 <= token < vocab:
        problems.append(_nogo("config.mask_token_id", f"{field} {token} is outside the target vocab [0, {vocab}): "
                              "the mask slots' embedding lookup would read past the table"))

    # -- mask_hidden
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    n_aux = len(ids) if isinstance(ids, list) and ids else 3
    try:
        t_hidden = int(config.get("target_hidden_size") or layer["hidden_size"])
    except (KeyError, TypeError, ValueError):
        t_hidden = None  # reported by the EAGLE-3 check (config.sizes)
    if MASK_KEY not in ckpt.meta:
        problems.append(_nogo("keys.mask_hidden", "no mask_hidden tensor: vLLM fails to load a parallel-drafting "
                              "drafter without it (\"mask_hidden not found in weights\")"))
        return
    shape, dtype = ckpt.meta[MASK_KEY]
    facts["mask_hidden"] = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
    if t_hidden is not None:
        want = n_aux * t_hidden
        numel = 1
        for s in shape:
            numel *= s
        if numel != want or any(s != 1 for s in shape[:-1]):
            problems.append(_nogo("shape.mask_hidden", f"mask_hidden has shape {list(shape)}, expected [1, {want}] "
                                  f"({n_aux} aux states x the target's hidden size {t_hidden}): vLLM copies it into "
                                  f"its [1, {want}] buffer (fc's input)", shape=list(shape), expected=[1, want]))
    if dtype is None or not dtype.is_floating_point:
        problems.append(_nogo("dtype.mask_hidden", f"mask_hidden is {dtype}, must be a floating-point dtype"))
    elif not bool(torch.isfinite(ckpt.load(MASK_KEY)).all()):
        problems.append(_nogo("values.mask_hidden", "mask_hidden has non-finite values"))


def export_peagle(fmt: str, state_dict: Mapping[str, torch.Tensor], drafter_config: Mapping[str, Any],
                  out_dir: Path, *, target_config: Mapping[str, Any], target_name_or_path: str,
                  speculative_tokens: int, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a P-EAGLE drafter (its state_dict and config dict) in `fmt` ("vllm" | "speculators"):
    EAGLE-3's export of the same weights plus mask_hidden and mask_token_id, checked by
    `check_export` before it lands. Raises ExportError naming what is wrong."""
    sd = dict(state_dict)
    mask = sd.pop(MASK_KEY, None)
    aux = [int(i) for i in drafter_config["aux_layer_ids"]]
    t_hidden = int(drafter_config.get("target_hidden_size") or drafter_config["hidden_size"])
    want = len(aux) * t_hidden
    token = drafter_config.get("mask_token_id")
    problems = []
    if mask is None:
        problems.append("the drafter has no mask_hidden")
    elif mask.numel() != want or not bool(torch.isfinite(mask).all()):
        problems.append(f"mask_hidden has shape {list(mask.shape)} (expected [1, {want}]) or non-finite values")
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < int(drafter_config["target_vocab_size"]):
        problems.append(f"mask_token_id {token!r} is not a token id of the target vocab")
    if problems:
        raise ExportError("refusing to export the P-EAGLE drafter: " + "; ".join(problems))
    extra = Extra(tensors={MASK_KEY: mask.reshape(1, want)}, config={"mask_token_id": token},
                  manifest={"format": EXPORT_FORMAT, "family": "peagle", "mask_token_id": token,
                            "serve": "vLLM: parallel_drafting = true (speculators format: implied)"},
                  speculators_type="peagle", check=check_export)
    kw = dict(target_config=target_config, aux_layer_ids=aux, target_name_or_path=target_name_or_path,
              dtype=dtype, extra=extra)
    if fmt == "vllm":
        return export_vllm(sd, drafter_config, out_dir, **kw)
    if fmt == "speculators":
        return export_speculators(sd, drafter_config, out_dir, speculative_tokens=speculative_tokens, **kw)
    raise ValueError(f"P-EAGLE has no export format {fmt!r} (vllm, speculators)")
