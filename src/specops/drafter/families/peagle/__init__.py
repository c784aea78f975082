"""P-EAGLE (parallel EAGLE): the EAGLE-3 drafter drafting all k tokens of a round in one forward.

The layer, the aux states, the vocab map and the export layout are EAGLE-3's; what differs: the
model's learned `mask_hidden` and its `mask_token_id` (`model.py`), the objective's depths >= 1
(`objective.py`: mask inputs in TTT's unroll), the drafting rule (`drafting.py`: one call over the
pending slots and k-1 mask slots) and the exports' extra tensor and field with their check
(`export.py`). Served by vLLM as `method: eagle3` with `parallel_drafting: true`; SGLang has no
parallel drafting for EAGLE-3 drafters, and serve refuses it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ....errors import ConfigError, InputError
from ....target import text_config
from ...batch import Batch, Teacher
from ...formats import drafter_config_from_export, load_exported
from ..base import CheckReport, ObjectiveOut
from ..eagle3 import Eagle3
from ..eagle3.objective import TTTModule, ttt_forward_static
from .drafting import EagerParallelRunner, StaticParallelRunner, make_parallel_runner
from .export import MASK_KEY, NOT_AN_EXPORT, check_export, export_format, export_peagle, mask_token_id_of
from .model import PEagleConfig, PEagleDrafter
from .objective import mask_later_inputs


def resolve_mask_token_id(target_config: Mapping[str, Any], tokenizer: Any | None) -> tuple[int, str]:
    """(train.mask_token_id's default for a target, where it came from): speculators' resolution
    (config.TrainSection.mask_token_id)."""
    vocab = int(text_config(target_config)["vocab_size"])
    if tokenizer is not None:
        if getattr(tokenizer, "mask_token_id", None) is not None:
            return int(tokenizer.mask_token_id), "the tokenizer's mask token"
        if len(tokenizer) < vocab:
            return len(tokenizer), f"the first embedding row past the tokenizer's {len(tokenizer)} tokens"
        for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
            if getattr(tokenizer, name, None) is not None:
                return int(getattr(tokenizer, name)), f"the tokenizer's {name}"
    for key in ("pad_token_id", "eos_token_id"):
        v = target_config.get(key)
        v = v[0] if isinstance(v, list) and v else v
        if isinstance(v, int) and not isinstance(v, bool):
            return v, f"the target config's {key}"
    raise InputError("train.mask_token_id: the target has no tokenizer mask/pad/eos token and its config no "
                     "pad_token_id or eos_token_id; set train.mask_token_id to a token id below the target "
                     f"vocab ({vocab})")


class PEagle(Eagle3):
    name = "peagle"
    model_cls = PEagleDrafter
    config_cls = PEagleConfig
    export_formats = ("vllm", "speculators")
    not_an_export = NOT_AN_EXPORT
    refines = "eagle3"

    # ---------------------------------------------------------------- model
    def resolve_train(self, train: Any, target_config: Mapping[str, Any], tokenizer: Callable[[], Any | None]) -> Any:
        vocab = int(text_config(target_config)["vocab_size"])
        token = train.mask_token_id
        if token is None:
            token, _ = resolve_mask_token_id(target_config, tokenizer())
        if not 0 <= token < vocab:
            raise InputError(f"train.mask_token_id: {token} is not a token id of the target (vocab {vocab}); "
                             f"set it to an id in [0, {vocab})")
        return dataclasses.replace(train, mask_token_id=int(token))

    def new_config(self, target_config: Any, draft_vocab_size: int, layer_ids: list[int], train: Any) -> PEagleConfig:
        if train.mask_token_id is None:
            raise InputError("P-EAGLE: train.mask_token_id is unresolved (resolve_train runs first)")
        return PEagleConfig.from_target(target_config, draft_vocab_size, layer_ids,
                                        norm_before_residual=train.norm_before_residual,
                                        mask_token_id=int(train.mask_token_id))

    # ---------------------------------------------------------------- training
    def objective(self, drafter: PEagleDrafter, train: Any) -> TTTModule:
        return TTTModule(drafter, train.ttt_steps, train.loss_decay, later_inputs=mask_later_inputs(drafter))

    def static_objective(self, drafter: PEagleDrafter, teacher: Teacher, train: Any
                         ) -> Callable[[Batch], ObjectiveOut]:
        steps, decay, later = train.ttt_steps, train.loss_decay, mask_later_inputs(drafter)
        return lambda batch: ttt_forward_static(drafter, teacher, batch, steps=steps, decay=decay,
                                                later_inputs=later(batch))

    # simulated_tau: EAGLE-3's chain. The k drafts are verified as a chain (draft j counts only
    # when drafts 1..j-1 did), and depth j's accuracy is measured as TTT step j's, conditioned on
    # the tokens before its target being the document's.

    def conventions(self, config: PEagleConfig, train: Any) -> dict[str, Any]:
        out = super().conventions(config, train)
        out.update({
            "family": self.name,
            "mask_token_id": config.mask_token_id,
            "alignment": "depth 0, slot t: token x[t+1], position t, hidden fc(aux[t]); depth j >= 1 at anchor t: "
                         "token mask_token_id, position t+j, hidden fc(mask_hidden); depth j predicts x[t+2+j] "
                         "(teacher from final[t+1+j])",
            "ttt_attention": "depth-0 keys causal within the document + the keys of depths 1..j at the same anchor",
            "depths": "every slot at every depth 0..ttt_steps-1 (speculators samples a subset: COD)",
        })
        return out

    # ---------------------------------------------------------------- evaluation
    def drafter_runner(self, drafter: PEagleDrafter, kind: str = "auto", *, cuda_graphs: bool = True, rows: int = 1,
                       min_capacity: int = 512) -> EagerParallelRunner | StaticParallelRunner:
        if rows > 1:  # the batched loop: the static cache, one sequence per row (draft_rows)
            return StaticParallelRunner(drafter, cuda_graphs=cuda_graphs, min_capacity=min_capacity, rows=rows)
        return make_parallel_runner(drafter, kind, cuda_graphs=cuda_graphs)

    # ---------------------------------------------------------------- export
    def export(self, fmt: str, drafter: PEagleDrafter, out_dir: Path, *, target_config: Mapping[str, Any],
               target_name_or_path: str, speculative_tokens: int) -> Path:
        if fmt not in self.export_formats:
            raise ValueError(f"P-EAGLE has no export format {fmt!r} ({', '.join(self.export_formats)})")
        return export_peagle(fmt, drafter.state_dict(), drafter.config.to_dict(), out_dir, target_config=target_config,
                             target_name_or_path=target_name_or_path, speculative_tokens=speculative_tokens)

    def export_format(self, config: Mapping[str, Any], names: set[str]) -> str | None:
        return export_format(config, names)

    def check_export(self, report: CheckReport, directory: Path, config: Mapping[str, Any], weights: Any,
                     target_config: Mapping[str, Any] | str | Path | None) -> None:
        check_export(report, directory, config, weights, target_config)

    def drafter_from_export(self, directory: Path, *, target_num_hidden_layers: int,
                            target_embed: torch.Tensor) -> PEagleDrafter:
        sd, config = load_exported(directory)
        fmt = "speculators" if "speculators_model_type" in config else "vllm"
        token, field = mask_token_id_of(config, fmt)
        if field is None or MASK_KEY not in sd:
            raise InputError(f"{directory}: not a P-EAGLE export (no mask token id or no mask_hidden)")
        base = drafter_config_from_export(config, target_num_hidden_layers)
        drafter = PEagleDrafter(PEagleConfig(**base.to_dict(), mask_token_id=int(token)))
        sd = dict(sd)
        sd[MASK_KEY] = sd[MASK_KEY].reshape(drafter.mask_hidden.shape)
        return self._load_export_weights(drafter, sd, directory, target_embed)

    # ---------------------------------------------------------------- serve
    def serve_argv(self, engine: str, path: Path, k: int, *, as_model: bool) -> list[str]:
        if engine == "sglang":
            raise ConfigError(f"serve.drafter: {path} is a P-EAGLE drafter, which SGLang does not serve (its EAGLE3 "
                              "worker drafts a chain, one forward per token, and has no parallel drafting); serve "
                              "it with vLLM (serve.engine = \"vllm\")")
        # a speculators dir names method and parallel drafting itself; said again, explicitly
        spec: dict[str, Any] = {"num_speculative_tokens": k, "parallel_drafting": True}
        if not as_model:
            spec = {"method": "eagle3", "model": str(path), **spec}
        return ["--speculative-config", json.dumps(spec, separators=(",", ":"))]


PEAGLE = PEagle()

__all__ = ["PEAGLE", "PEagle", "resolve_mask_token_id"]
