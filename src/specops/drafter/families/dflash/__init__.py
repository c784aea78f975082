"""DFlash (block drafting, arXiv 2602.06036): Qwen3-shaped decoder layers that draft a block of k
tokens in one forward, the block's queries attending to context keys made from the target's states.

Its parts: the model `model.py` (`DFlashDrafter`, `DFlashConfig`), the objective `objective.py`
(every slot an anchor, all blocks in one forward), the drafting rule `drafting.py` (one block per
round over a context cache), the export formats and their check `export.py`. It reads the same aux
layers as EAGLE-3 (the campaign's features serve every family); the embedding and the draft-vocab
lm_head start as the target's. Served by vLLM as `method: dflash` (`DFlashDraftModel`); SGLang has no
DFlash worker that specops drives, and serve refuses it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ....errors import ConfigError, InputError
from ...batch import Batch, Teacher
from ..base import CheckReport, ObjectiveOut
from ..eagle3 import Eagle3
from ..peagle import PEAGLE
from .drafting import DFlashRunner, make_dflash_runner
from .export import (NOT_AN_EXPORT, check_export, drafter_config_from_dflash_export, export_dflash, export_format,
                     load_dflash_export)
from .model import DFlashConfig, DFlashDrafter
from .objective import DFlashModule, dflash_forward_static


class DFlash(Eagle3):
    """EAGLE-3's target start, vocab map, layer choice and chain-rule tau; its own model, objective,
    drafting rule, export and serve flags."""

    name = "dflash"
    model_cls = DFlashDrafter
    config_cls = DFlashConfig
    export_formats = ("vllm", "speculators")
    not_an_export = NOT_AN_EXPORT

    # ---------------------------------------------------------------- model
    def resolve_train(self, train: Any, target_config: Mapping[str, Any], tokenizer: Callable[[], Any | None]) -> Any:
        return PEAGLE.resolve_train(train, target_config, tokenizer)  # the same mask token rule

    def new_config(self, target_config: Any, draft_vocab_size: int, layer_ids: list[int], train: Any) -> DFlashConfig:
        if train.mask_token_id is None:
            raise InputError("DFlash: train.mask_token_id is unresolved (resolve_train runs first)")
        return DFlashConfig.from_target(target_config, draft_vocab_size, layer_ids,
                                        mask_token_id=int(train.mask_token_id),
                                        num_hidden_layers=int(train.dflash_layers),
                                        block_size=int(train.ttt_steps) + 1)

    # ---------------------------------------------------------------- training
    def objective(self, drafter: DFlashDrafter, train: Any) -> DFlashModule:
        return DFlashModule(drafter, train.ttt_steps, train.loss_decay)

    def static_objective(self, drafter: DFlashDrafter, teacher: Teacher, train: Any) -> Callable[[Batch], ObjectiveOut]:
        steps, decay = train.ttt_steps, train.loss_decay
        return lambda batch: dflash_forward_static(drafter, teacher, batch, steps=steps, decay=decay)

    # simulated_tau: EAGLE-3's chain (draft j counts when drafts 1..j-1 did); slot j's accuracy is
    # measured with the true tokens before it in the context, as TTT's step j.

    def conventions(self, config: DFlashConfig, train: Any) -> dict[str, Any]:
        out = super().conventions(config, train)
        out.update({
            "family": self.name,
            "mask_token_id": config.mask_token_id,
            "layers": config.num_hidden_layers,
            "block_size": config.block_size,
            "alignment": "anchor t: context aux[0..t-1] at positions 0..t-1 (keys of hidden_norm(fc(aux))); "
                         "block slot 0 x[t] at t, slot j mask_token_id at t+j predicts x[t+j] "
                         "(teacher from final[t+j-1])",
            "attention": "block queries see the context keys before the anchor and the whole block (non-causal)",
            "dflash_target_layer_ids": [i - 1 for i in config.aux_layer_ids],
        })
        out.pop("ttt_attention", None)
        return out

    # ---------------------------------------------------------------- evaluation
    def drafter_runner(self, drafter: DFlashDrafter, kind: str = "auto", *, cuda_graphs: bool = True, rows: int = 1,
                       min_capacity: int = 512) -> DFlashRunner:
        return make_dflash_runner(drafter, kind, rows=rows)

    # ---------------------------------------------------------------- export
    def export(self, fmt: str, drafter: DFlashDrafter, out_dir: Path, *, target_config: Mapping[str, Any],
               target_name_or_path: str, speculative_tokens: int) -> Path:
        if fmt not in self.export_formats:
            raise ValueError(f"DFlash has no export format {fmt!r} ({', '.join(self.export_formats)})")
        return export_dflash(fmt, drafter.state_dict(), drafter.config.to_dict(), out_dir,
                             target_config=target_config, target_name_or_path=target_name_or_path,
                             speculative_tokens=speculative_tokens)

    def export_format(self, config: Mapping[str, Any], names: set[str]) -> str | None:
        return export_format(config, names)

    def check_export(self, report: CheckReport, directory: Path, config: Mapping[str, Any], weights: Any,
                     target_config: Mapping[str, Any] | str | Path | None) -> None:
        check_export(report, directory, config, weights, target_config)

    def drafter_from_export(self, directory: Path, *, target_num_hidden_layers: int,
                            target_embed: torch.Tensor) -> DFlashDrafter:
        sd, config = load_dflash_export(directory)  # either format; d2t/t2d filled in for a full vocab
        drafter = DFlashDrafter(DFlashConfig(**drafter_config_from_dflash_export(config, target_num_hidden_layers)))
        return self._load_export_weights(drafter, sd, directory, target_embed)

    # ---------------------------------------------------------------- serve
    def serve_argv(self, engine: str, path: Path, k: int, *, as_model: bool) -> list[str]:
        if engine == "sglang":
            raise ConfigError(f"serve.drafter: {path} is a DFlash drafter, which specops serves with vLLM only "
                              "(serve.engine = \"vllm\")")
        spec: dict[str, Any] = {"num_speculative_tokens": k}
        if not as_model:  # a speculators dir names its method itself
            spec = {"method": "dflash", "model": str(path), **spec}
        return ["--speculative-config", json.dumps(spec, separators=(",", ":"))]


DFLASH = DFlash()

__all__ = ["DFLASH", "DFlash"]
