"""EAGLE-3 (Li et al. 2025): one decoder layer over [embed(token), fc(three target states)],
trained with training-time test, drafting a chain of k tokens with one forward each.

The layer is Llama's, or for an MLA target (DeepSeek-V3, Kimi-K2) DeepSeek's multi-head latent
attention in place of Llama's (train.drafter_layer; `drafter/mla.py`, `Eagle3MLADrafter`): the
objective and the drafting rule are the same, the export is vLLM's `Eagle3DeepseekV3ForCausalLM`
only (speculators 0.9 defines no MLA EAGLE-3 layer), and the eval loop drafts with the eager runner.

Its parts: the model `drafter/model.py` (`Eagle3Drafter`, `DrafterConfig`), the objective
`objective.py`, the drafting rule `drafting.py`, the export formats and their check `export.py`
(file layouts: `drafter/formats.py`). Served by vLLM as `method: eagle3` and by SGLang as `EAGLE3`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ....errors import ConfigError, InputError
from ....measures import simulated_tau
from ....target import AUX_CONVENTION, default_aux_layer_ids
from ....target.conventions import is_mla
from ...batch import Batch, Teacher
from ...formats import ExportError, drafter_config_from_export, load_exported
from ...mla import Eagle3MLADrafter
from ...model import DrafterConfig, Eagle3Drafter
from ..base import CheckReport, DrafterFamily, ObjectiveOut
from .drafting import EagerDrafterRunner, StaticDrafterRunner, make_drafter_runner
from .export import NOT_AN_EXPORT, check_export, export_format, export_speculators, export_vllm
from .objective import TTTModule, ttt_forward_static


class Eagle3(DrafterFamily):
    name = "eagle3"
    model_cls = Eagle3Drafter
    config_cls = DrafterConfig
    export_formats = ("vllm", "speculators")
    not_an_export = NOT_AN_EXPORT

    # ---------------------------------------------------------------- model
    def model_for(self, config: DrafterConfig) -> type[Eagle3Drafter]:
        """The model class of a config: EAGLE-3's with the MLA layer for layer "mla", else model_cls
        (a family built on EAGLE-3's layer, P-EAGLE, keeps its own)."""
        return Eagle3MLADrafter if config.layer == "mla" else self.model_cls

    def feature_layer_ids(self, num_layers: int) -> list[int]:
        return default_aux_layer_ids(num_layers)

    def resolve_train(self, train: Any, target_config: Mapping[str, Any], tokenizer: Callable[[], Any | None]) -> Any:
        """train.drafter_layer "auto" -> "mla" for an MLA target, else "llama"; "mla" on a target
        without MLA is refused."""
        mla = is_mla(target_config)
        layer = getattr(train, "drafter_layer", "auto")
        if layer == "mla" and not mla:
            raise ConfigError("train.drafter_layer = \"mla\": the target's config has no multi-head latent "
                              "attention (no kv_lora_rank); use \"llama\" or \"auto\"")
        if layer == "auto":
            layer = "mla" if mla else "llama"
        return dataclasses.replace(train, drafter_layer=layer)

    def new_config(self, target_config: Any, draft_vocab_size: int, layer_ids: list[int], train: Any) -> DrafterConfig:
        layer = getattr(train, "drafter_layer", "llama")
        if layer not in ("llama", "mla"):
            raise InputError(f"EAGLE-3: train.drafter_layer {layer!r} is unresolved (resolve_train runs first)")
        return DrafterConfig.from_target(target_config, draft_vocab_size, layer_ids, layer=layer,
                                         norm_before_residual=train.norm_before_residual)

    def new_drafter(self, config: DrafterConfig, head: Any, d2t: torch.Tensor, t2d: torch.Tensor,
                    train: Any) -> Eagle3Drafter:
        drafter = self.model_for(config)(config)
        drafter.init_from_target(head.embed, head.lm_head, d2t, freeze_embeddings=train.freeze_embeddings)
        if train.freeze_lm_head:  # keep the target's own readout of the draft vocab (speculators does)
            drafter.lm_head.weight.requires_grad_(False)
        if train.init_norm_from_target:  # the drafter's readout starts as the target's: norm, then lm_head
            with torch.no_grad():
                drafter.norm.weight.copy_(head.norm_weight.to(drafter.norm.weight))
        if not torch.equal(drafter.t2d, t2d):
            raise InputError("build/vocab.safetensors: t2d does not match d2t")
        return drafter

    def drafter_from_config(self, config: Mapping[str, Any]) -> Eagle3Drafter:
        cfg = self.config_cls.from_dict(dict(config))  # "family" and unknown keys: dropped
        return self.model_for(cfg)(cfg)

    # ---------------------------------------------------------------- training
    def objective(self, drafter: Eagle3Drafter, train: Any) -> TTTModule:
        return TTTModule(drafter, train.ttt_steps, train.loss_decay)

    def static_objective(self, drafter: Eagle3Drafter, teacher: Teacher, train: Any
                         ) -> Callable[[Batch], ObjectiveOut]:
        steps, decay = train.ttt_steps, train.loss_decay
        return lambda batch: ttt_forward_static(drafter, teacher, batch, steps=steps, decay=decay)

    def simulated_tau(self, acc: Sequence[float]) -> float:
        return simulated_tau(acc)  # a chain: draft k counts only when drafts 1..k-1 did

    def conventions(self, config: DrafterConfig, train: Any) -> dict[str, Any]:
        return {
            "family": self.name,
            "aux_layer_ids": config.aux_layer_ids,
            "aux_layer_convention": AUX_CONVENTION,
            "final": "pre-norm; teacher = target lm_head(target norm(final)) restricted to the draft vocab",
            "alignment": "step k, slot t: token x[t+1+k], position t+k, hidden fc(aux[t]) (k=0) or the "
                         "drafter's step k-1 output; predicts x[t+2+k] (teacher from final[t+1+k])",
            "ttt_attention": "step-0 keys causal within the document + the diagonal of steps 1..k",
            "d2t": "target_id = i + d2t[i]",
            "ttt_steps": train.ttt_steps, "loss_decay": train.loss_decay,
        }

    # ---------------------------------------------------------------- evaluation
    def drafter_runner(self, drafter: Eagle3Drafter, kind: str = "auto", *, cuda_graphs: bool = True, rows: int = 1,
                       min_capacity: int = 512) -> EagerDrafterRunner | StaticDrafterRunner:
        if drafter.config.layer == "mla":
            # The static runner inlines the Llama layer's projections; the MLA layer drafts through its
            # own forward on the growing K/V (one sequence at a time).
            if rows > 1 or kind == "static":
                raise ConfigError("an MLA EAGLE-3 drafter drafts with the eager runner only: set "
                                  "eval.drafter_runner = \"eager\" (or \"auto\") and eval.batch_size = 1"
                                  if rows > 1 else "an MLA EAGLE-3 drafter drafts with the eager runner only: "
                                  "set eval.drafter_runner = \"eager\" or \"auto\"")
            return EagerDrafterRunner(drafter)
        if rows > 1:  # the batched loop: the static cache, one sequence per row
            return StaticDrafterRunner(drafter, cuda_graphs=cuda_graphs, min_capacity=min_capacity, rows=rows)
        return make_drafter_runner(drafter, kind, cuda_graphs=cuda_graphs)

    # ---------------------------------------------------------------- export
    def formats_of(self, drafter: Eagle3Drafter) -> tuple[str, ...]:
        return ("vllm",) if drafter.config.layer == "mla" else self.export_formats

    def export(self, fmt: str, drafter: Eagle3Drafter, out_dir: Path, *, target_config: Mapping[str, Any],
               target_name_or_path: str, speculative_tokens: int) -> Path:
        dcfg = drafter.config.to_dict()
        if drafter.config.layer == "mla" and fmt == "speculators":
            raise ExportError("an MLA EAGLE-3 drafter has no speculators format: speculators 0.9 defines EAGLE-3 "
                              "layers for llama and qwen3 only; export the vLLM format (--format vllm)")
        kw = dict(target_config=target_config, aux_layer_ids=list(dcfg["aux_layer_ids"]),
                  target_name_or_path=target_name_or_path)
        if fmt == "vllm":
            return export_vllm(drafter.state_dict(), dcfg, out_dir, **kw)
        if fmt == "speculators":
            return export_speculators(drafter.state_dict(), dcfg, out_dir, speculative_tokens=speculative_tokens, **kw)
        raise ValueError(f"EAGLE-3 has no export format {fmt!r} ({', '.join(self.export_formats)})")

    def export_format(self, config: Mapping[str, Any], names: set[str]) -> str | None:
        return export_format(config, names)

    def check_export(self, report: CheckReport, directory: Path, config: Mapping[str, Any], weights: Any,
                     target_config: Mapping[str, Any] | str | Path | None) -> None:
        check_export(report, directory, config, weights, target_config)

    def drafter_from_export(self, directory: Path, *, target_num_hidden_layers: int,
                            target_embed: torch.Tensor) -> Eagle3Drafter:
        sd, config = load_exported(directory)
        cfg = drafter_config_from_export(config, target_num_hidden_layers)
        drafter = self.model_for(cfg)(cfg)
        return self._load_export_weights(drafter, dict(sd), directory, target_embed)

    @staticmethod
    def _load_export_weights(drafter: Eagle3Drafter, sd: dict[str, torch.Tensor], directory: Path,
                             target_embed: torch.Tensor) -> Eagle3Drafter:
        """An export's tensors (our names) into `drafter`; the target's embedding when it has none."""
        if "embed_tokens.weight" not in sd:  # engines share the target's embedding; so do we
            sd["embed_tokens.weight"] = target_embed.detach().float().cpu()
        missing, unexpected = drafter.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise InputError(f"{directory}: drafter weights do not match its config: missing {missing}, "
                             f"unexpected {unexpected}")
        return drafter

    # ---------------------------------------------------------------- serve
    def serve_argv(self, engine: str, path: Path, k: int, *, as_model: bool) -> list[str]:
        if engine == "sglang":  # a chain of k drafts: k steps, top-1, k + 1 tokens per verify
            return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(path),
                    "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                    "--speculative-num-draft-tokens", str(k + 1)]
        spec: dict[str, Any] = {"num_speculative_tokens": k}
        if not as_model:  # a speculators dir names its method itself
            spec = {"method": "eagle3", "model": str(path), **spec}
        return ["--speculative-config", json.dumps(spec, separators=(",", ":"))]


EAGLE3 = Eagle3()

__all__ = ["EAGLE3", "Eagle3"]
