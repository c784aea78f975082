"""The target held in this process: loaded with transformers on one device, hooks for EAGLE-3's
hidden states, and the final norm + lm_head read straight from the weight files.

`TargetModel.forward_features` is the one computation of features: extract stores it
(features.to_storage), online training feeds it to the drafter, and the evaluator's runners
reproduce it with a KV cache. Memory: the whole model on `device` (bf16: 2 bytes a parameter).
"""

from __future__ import annotations

import collections
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch
from torch import nn

from ..errors import InputError, SpecopsError
from ..models import resolve_device, resolve_dtype
from .conventions import TextShape, aux_layer_ids_problem, default_aux_layer_ids, text_config, text_field

log = logging.getLogger("specops.target")

# Decoder stacks (embed_tokens, layers, norm) inside the HF wrappers, most specific first:
# multimodal ForConditionalGeneration (transformers 5: model.language_model; 4.x: language_model.model),
# then plain ForCausalLM (model).
_DECODER_PATHS = ("model.language_model", "language_model.model", "language_model", "model")




@dataclass(eq=False)
class TargetModel(TextShape):
    """A loaded target with the pieces EAGLE-3 needs; `decoder` is the text stack inside `model`."""

    model: nn.Module  # the HF model as loaded (ForCausalLM or a multimodal wrapper)
    decoder: nn.Module  # embed_tokens, layers, norm; its forward runs the text stack without lm_head
    lm_head: nn.Module
    config: Any  # the text config
    model_dir: Path
    device: torch.device
    dtype: torch.dtype

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])

    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    @property
    def norm(self) -> nn.Module:
        return self.decoder.norm

    @property
    def embed_tokens(self) -> nn.Module:
        return self.decoder.embed_tokens

    def forward_features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        layer_ids: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, T] -> (aux [B, T, len(layer_ids), H], final [B, T, H]), model dtype, on device.

        attention_mask None: rows are unpadded or RIGHT-padded; positions are 0..T-1 and the
        causal mask alone keeps real tokens exact. attention_mask [B, T] (1 = real token): any
        padding side; positions count real tokens only. Values at padded positions are garbage.
        Runs under the caller's grad mode (see `compute_features`).
        """
        L, H = self.num_hidden_layers, self.hidden_size
        ids = list(default_aux_layer_ids(L) if layer_ids is None else layer_ids)
        problem = aux_layer_ids_problem(ids, L)
        if problem:
            raise ValueError(problem)
        input_ids = input_ids.to(self.device, torch.long)
        B, T = input_ids.shape
        aux = torch.empty(B, T, len(ids), H, dtype=self.dtype, device=self.device)
        final = torch.empty(B, T, H, dtype=self.dtype, device=self.device)

        # One pre-hook per module; layer id L is the norm's input, the same tensor as `final`.
        targets: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        for j, i in enumerate(ids):
            targets[i].append(aux[:, :, j])
        targets[L].append(final)
        fired = collections.Counter()

        def make_hook(i: int, dests: list[torch.Tensor]):
            def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                h = args[0] if args else kwargs["hidden_states"]
                if h.shape != (B, T, H):
                    raise SpecopsError(
                        f"{type(module).__name__} (input to layer {i}) got a hidden state of shape "
                        f"{tuple(h.shape)}, expected {(B, T, H)}: unsupported decoder structure"
                    )
                for d in dests:
                    d.copy_(h)  # copy at once: the layer may reuse or free its input
                fired[i] += 1

            return hook

        handles = []
        try:
            for i, dests in targets.items():
                module = self.norm if i == L else self.layers[i]
                handles.append(module.register_forward_pre_hook(make_hook(i, dests), with_kwargs=True))
            kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": False}
            if attention_mask is not None:
                mask = attention_mask.to(self.device, torch.long)
                kwargs["attention_mask"] = mask
                kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp_(min=0)
            self.decoder(**kwargs)
        finally:
            for h in handles:
                h.remove()
        if any(fired[i] != 1 for i in targets):
            raise SpecopsError(
                f"{type(self.decoder).__name__}: hooks fired {dict(fired)} times for layers {sorted(targets)} "
                "(expected once each): unsupported decoder structure"
            )
        return aux, final


def _get_path(root: nn.Module, path: str) -> nn.Module | None:
    m: Any = root
    for part in path.split("."):
        m = getattr(m, part, None)
        if m is None:
            return None
    return m if isinstance(m, nn.Module) else None


def find_decoder(model: nn.Module, num_hidden_layers: int) -> nn.Module:
    """The module holding `embed_tokens`, `layers` (>= L of them) and `norm` inside an HF model."""

    def is_decoder(m: nn.Module | None) -> bool:
        return (
            m is not None
            and isinstance(getattr(m, "layers", None), nn.ModuleList)
            and len(m.layers) >= num_hidden_layers
            and isinstance(getattr(m, "embed_tokens", None), nn.Module)
            and isinstance(getattr(m, "norm", None), nn.Module)
        )

    for path in _DECODER_PATHS:
        m = _get_path(model, path)
        if is_decoder(m):
            return m
    found = [name for name, m in model.named_modules() if is_decoder(m)]
    if len(found) == 1:
        return model.get_submodule(found[0])
    raise SpecopsError(
        f"{type(model).__name__}: cannot find the text decoder (a module with embed_tokens, "
        f"{num_hidden_layers} layers and norm); candidates: {found or 'none'}"
    )


def load_target(
    model_dir: str | os.PathLike[str], dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
    *, trust_remote_code: bool = False,
) -> TargetModel:
    """Load a causal LM, or a multimodal wrapper whose language model sits under `text_config`.

    dtype "auto": bf16 on CUDA, fp32 on CPU. Weights go straight to `device` (no CPU staging copy).
    trust_remote_code: run the model directory's own classes (target/hf.py).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from .hf import load_config, load_model

    model_dir = Path(model_dir)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    config = load_config(model_dir, trust_remote_code=trust_remote_code)
    # The auto mappings are keyed by config class: plain LMs (and some wrappers, e.g. Gemma3) are
    # causal LMs; Llava/Mistral3/Qwen-VL-style wrappers are image-text-to-text models; a model
    # class of the directory's own is found through its auto_map.
    own = getattr(config, "auto_map", None) or {}
    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        if type(config) in auto._model_mapping or (trust_remote_code and auto.__name__ in own):
            break
    else:
        raise SpecopsError(
            f"{model_dir}: model type {config.model_type!r} is neither a causal LM nor an "
            "image-text-to-text model transformers knows"
        )
    model = load_model(auto, model_dir, trust_remote_code=trust_remote_code, dtype=dt, device_map={"": str(dev)})
    model.eval().requires_grad_(False)
    text_cfg = text_config(config)
    decoder = find_decoder(model, int(text_cfg.num_hidden_layers))
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise SpecopsError(f"{type(model).__name__}: no lm_head (output embeddings)")
    return TargetModel(
        model=model,
        decoder=decoder,
        lm_head=lm_head,
        config=getattr(decoder, "config", text_cfg),
        model_dir=model_dir,
        device=dev,
        dtype=dt,
    )


def compute_features(
    target: TargetModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    layer_ids: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """Online features: {"aux": [B, T, 3, H], "final": [B, T, H] (pre-norm)} in the model's dtype.

    The computation `run_extract` stores (then casts/quantizes with `to_storage`). no_grad rather
    than inference_mode, so a trainer can feed the results into autograd.
    """
    with torch.no_grad():
        aux, final = target.forward_features(input_ids, attention_mask, layer_ids)
    return {"aux": aux, "final": final}


# ---------------------------------------------------------------- the target's head (teacher)


class TargetHead(NamedTuple):
    config: dict[str, Any]  # the target's config.json (the text config when nested)
    norm_weight: torch.Tensor  # [H] final norm
    rms_norm_eps: float
    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H] (the embedding when tied)


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from the index when sharded."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        wm = json.loads(index.read_text())["weight_map"]
        return {k: model_dir / v for k, v in wm.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise InputError(f"{model_dir}: no *.safetensors weights (the teacher needs the target's norm and lm_head)")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            out.update({k: f for k in h.keys()})
    return out


def _pick(names: list[str], suffix: str) -> str | None:
    # Language-model tensors only: multimodal checkpoints also carry vision towers and MTP heads.
    skip = ("vision", "visual", "audio", "mtp", "image", "projector")
    cands = [n for n in names if (n == suffix or n.endswith("." + suffix)) and ".layers." not in n
             and not any(s in n for s in skip)]
    return min(cands, key=len) if cands else None


def load_target_head(model_dir: str | os.PathLike[str]) -> TargetHead:
    """Read only the final norm, embedding and lm_head tensors of an HF model directory."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    cfg_all = json.loads((model_dir / "config.json").read_text())
    cfg = text_config(cfg_all)
    files = _weight_files(model_dir)
    names = list(files)
    norm, embed, head = _pick(names, "norm.weight"), _pick(names, "embed_tokens.weight"), _pick(names, "lm_head.weight")
    if norm is None or embed is None:
        raise InputError(f"{model_dir}: cannot find the final norm / embed_tokens weights in {len(names)} tensors")
    tied = bool(text_field(cfg_all, "tie_word_embeddings", False))
    if head is None and not tied:
        log.warning("%s: no lm_head.weight and tie_word_embeddings is not set; using the embedding", model_dir)
    head = head or embed

    def get(name: str) -> torch.Tensor:
        with safe_open(str(files[name]), "pt") as h:
            return h.get_tensor(name)

    e = get(embed)
    return TargetHead(cfg, get(norm).float(), float(cfg.get("rms_norm_eps", 1e-6)), e,
                      e if head == embed else get(head))
