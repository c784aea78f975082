"""Disk forecast: how many bytes the planned phases will write, before they start.

The functions take plain numbers so later phases can re-forecast with measured values (e.g. the
real mean tokens per sample once generate is done); `forecast_campaign(cfg)` fills them from what
the config knows now. Every forecast is an upper bound: completions are assumed to run to
max_tokens. Units are bytes; messages print decimal GB (1e9).

Constants (stated, not measured per campaign):

* records.jsonl (DESIGN "File formats"): text is JSON-escaped UTF-8, ~4.5 bytes/token (~4
  characters per token for English and code, plus escapes); token ids in a compact JSON list
  (orjson) are ~6 bytes/token (5 digits for a 100K+ vocabulary plus a comma). A record holds the
  prompt as text and as `prompt_token_ids`, and the completion as ids and twice as text (the
  generated message in `messages`, and the top-level `content`/`reasoning`), plus ~512 bytes of id,
  usage, sampling, timings and endpoint: prompt × 10.5 + completion × 15 + 512 bytes.
* build/: int32 `input_ids` + uint8 `loss_mask` = 5 bytes/token (+ 8-byte offsets and a ~128-byte
  ids.jsonl line per sample); samples are cut at build.max_length tokens.
* features/: per token (n_aux + 1) hidden vectors (3 auxiliary layers `aux` + the `final` state)
  of hidden × dtype bytes (bf16 2; fp8 1 plus one fp32 scale per vector), plus the shard's own
  int32 ids and uint8 loss mask (5 bytes/token).
* drafter/: each kept checkpoint holds fp32 weights and Adam's two fp32 moments = 12 bytes per
  drafter parameter, plus one bf16 export (2 bytes per parameter).

Worked example (the test checks it): 10K samples × 2,888 tokens = 28.88M tokens on a 7168-wide
target, 4 vectors per token:
  bf16: 28.88e6 × (4 × 7168 × 2 + 5)      = 1.656e12 bytes ≈ 1.66 TB
  fp8:  28.88e6 × (4 × (7168 + 4) + 5)    = 0.829e12 bytes ≈ 829 GB
so the often-quoted ~828 GB for that run is the fp8 size (bf16 reaches it at ~1.44K tokens per
sample). The same formula gives speculators' published ~1.6 TB for 50K Llama-3.1-8B samples of
~1024 tokens in bf16 (50e3 × 1024 × (4 × 4096 × 2 + 5) = 1.68e12).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from ..config import Config
from ..target import text_config

TEXT_BYTES_PER_TOKEN = 4.5
TOKEN_ID_BYTES_PER_TOKEN = 6.0
RECORD_OVERHEAD_BYTES = 512
BUILD_BYTES_PER_TOKEN = 5  # int32 id + uint8 loss mask
BUILD_BYTES_PER_SAMPLE = 8 + 128  # int64 offset + one ids.jsonl line
FEATURE_TOKEN_BYTES = 5  # the shard's own int32 id + uint8 loss mask
DEFAULT_MAX_LENGTH = 2048  # build.max_length default: samples are cut there
DEFAULT_PROMPT_TOKENS = 512  # per sample, when nothing better is known
DEFAULT_AUX_LAYERS = 3  # EAGLE-3: input to layers [2, L//2, L-3]; plus the final hidden state
DEFAULT_DRAFT_VOCAB = 32000
DEFAULT_CHECKPOINTS_KEPT = 3
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights + Adam exp_avg + exp_avg_sq
EXPORT_BYTES_PER_PARAM = 2  # bf16 export for vLLM/SGLang
FP8_SCALE_BYTES = 4  # one fp32 scale per token per stored vector

FeatureDtype = Literal["bf16", "fp16", "fp32", "fp8"]
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


def records_bytes(samples: int, prompt_tokens: float, completion_tokens: float, *, token_ids: bool = True) -> int:
    """generate/<dataset>/records.jsonl for `samples` records of the given mean token counts."""
    ids = TOKEN_ID_BYTES_PER_TOKEN if token_ids else 0.0
    per_record = (prompt_tokens * (TEXT_BYTES_PER_TOKEN + ids)
                  + completion_tokens * (2 * TEXT_BYTES_PER_TOKEN + ids) + RECORD_OVERHEAD_BYTES)
    return int(samples * per_record)


def build_bytes(tokens: float, samples: int = 0) -> int:
    """build/: the tokenized training set (ids, loss mask, offsets, ids.jsonl)."""
    return int(tokens * BUILD_BYTES_PER_TOKEN + samples * BUILD_BYTES_PER_SAMPLE)


def feature_bytes(tokens: float, hidden: int, *, n_aux: int = DEFAULT_AUX_LAYERS, dtype: FeatureDtype = "bf16") -> int:
    """features/: tokens × ((n_aux + 1) × hidden × dtype bytes (+ fp8 scales) + ids and mask)."""
    per_vector = hidden * _DTYPE_BYTES[dtype] + (FP8_SCALE_BYTES if dtype == "fp8" else 0)
    return int(tokens * ((n_aux + 1) * per_vector + FEATURE_TOKEN_BYTES))


def drafter_params(
    hidden: int,
    intermediate: int | None = None,
    draft_vocab: int = DEFAULT_DRAFT_VOCAB,
    *,
    kv_dim: int | None = None,
) -> int:
    """Trainable parameters of an EAGLE-3 drafter with one decoder layer.

    fc 3H->H; attention q/k/v read the 2H concat [embed, fused hidden], o H->H; a gated MLP of
    3·H·I; four RMSNorms; lm_head H->draft_vocab. The embedding is the target's, frozen, not saved.
    kv_dim defaults to H (no GQA), an upper bound.
    """
    h = hidden
    i = intermediate if intermediate else 4 * h
    kv = kv_dim if kv_dim else h
    fc = 3 * h * h
    attn = 2 * h * h + 2 * (2 * h * kv) + h * h
    mlp = 3 * h * i
    return fc + attn + mlp + 4 * h + h * draft_vocab


def checkpoint_bytes(params: int, *, kept: int = DEFAULT_CHECKPOINTS_KEPT) -> int:
    """drafter/: `kept` training checkpoints (weights + Adam moments, fp32) plus one bf16 export."""
    return params * (CHECKPOINT_BYTES_PER_PARAM * kept + EXPORT_BYTES_PER_PARAM)


# ============================================================================ from a config


def _read_model_config(cfg: Config) -> Mapping[str, Any] | None:
    path = Path(cfg.target.model) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _dataset_samples(ds: Any) -> int | None:
    if ds.limit is not None:
        return int(ds.limit)
    try:
        from ..sources import open_source

        return int(open_source(ds).count())
    except Exception:  # noqa: BLE001 - an unreadable source is the config check's business
        return None


def forecast_inputs(cfg: Config, model_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the forecast is based on: samples and token bounds per dataset, the target's shape."""
    datasets = []
    for ds in cfg.datasets:
        datasets.append({
            "name": ds.name,
            "samples": _dataset_samples(ds),
            "prompt_tokens": DEFAULT_PROMPT_TOKENS,
            "completion_tokens": cfg.sampling_for(ds).max_tokens,
        })
    mc = model_config if model_config is not None else _read_model_config(cfg)
    tc = text_config(mc) if mc else {}
    # The build/extract sections are read with defaults so a config without them still forecasts.
    build, extract = getattr(cfg, "build", None), getattr(cfg, "extract", None)
    aux_ids = getattr(extract, "aux_layer_ids", None)
    draft_vocab = getattr(build, "draft_vocab_size", DEFAULT_DRAFT_VOCAB)
    return {
        "datasets": datasets,
        "hidden_size": tc.get("hidden_size"),
        "intermediate_size": tc.get("intermediate_size"),
        "vocab_size": tc.get("vocab_size"),
        "num_hidden_layers": tc.get("num_hidden_layers"),
        "token_ids": cfg.engine.return_token_ids or cfg.engine.kind == "local",
        "max_length": getattr(build, "max_length", DEFAULT_MAX_LENGTH),
        "n_aux": len(aux_ids) if aux_ids else DEFAULT_AUX_LAYERS,
        "feature_dtype": "fp8" if getattr(extract, "dtype", "bfloat16") == "float8_e4m3fn" else "bf16",
        "features_offline": getattr(extract, "mode", "offline") == "offline",
        "draft_vocab": min(draft_vocab, int(tc.get("vocab_size") or draft_vocab)),
        "drafters": len(cfg.train.families) if getattr(cfg, "train", None) is not None else 1,
    }


def forecast_campaign(
    cfg: Config,
    *,
    phases: list[str] | tuple[str, ...] = ("generate", "build", "extract", "train"),
    model_config: Mapping[str, Any] | None = None,
) -> dict[str, int]:
    """Bytes each planned phase will write, for the phases that can be forecast now.

    `model_config` is the target's parsed config.json (preflight passes the one the model check
    read); by default it is read from target.model.
    """
    return forecast_from_inputs(forecast_inputs(cfg, model_config), phases)


def forecast_from_inputs(inp: Mapping[str, Any], phases: list[str] | tuple[str, ...]) -> dict[str, int]:
    """The forecast for `forecast_inputs(...)`. A phase is left out when its inputs are unknown (a
    dataset whose size cannot be counted; no hidden_size for extract/train)."""
    known = [d for d in inp["datasets"] if d["samples"] is not None]
    all_known = len(known) == len(inp["datasets"])
    samples = sum(d["samples"] for d in known)
    # build keeps at most max_length tokens of a sample; extract reads what build kept.
    tokens = sum(d["samples"] * min(d["prompt_tokens"] + d["completion_tokens"], inp["max_length"]) for d in known)
    hidden = inp["hidden_size"]
    out: dict[str, int] = {}
    if "generate" in phases and all_known:
        out["generate"] = sum(
            records_bytes(d["samples"], d["prompt_tokens"], d["completion_tokens"], token_ids=inp["token_ids"])
            for d in known
        )
    if "build" in phases and all_known:
        out["build"] = build_bytes(tokens, samples)
    if "extract" in phases and all_known and hidden:
        feats = feature_bytes(tokens, int(hidden), n_aux=inp["n_aux"], dtype=inp["feature_dtype"])
        out["extract"] = feats if inp["features_offline"] else 0  # online: training computes them
    if "train" in phases and hidden:
        # one EAGLE-3-sized drafter per family of train.drafter (a one-layer DFlash is the same size)
        one = checkpoint_bytes(drafter_params(int(hidden), inp["intermediate_size"], inp["draft_vocab"]))
        out["train"] = one * int(inp.get("drafters") or 1)
    return out
