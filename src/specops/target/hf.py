"""The one gate through which specops loads a target's tokenizer, config or model with transformers.

A model directory may ship its own Python (`auto_map` in config.json or tokenizer_config.json
names `module.Class` files beside the weights; Kimi-K2's tiktoken tokenizer is one). transformers
runs that code only when asked to (`trust_remote_code`). specops passes the campaign's
`target.trust_remote_code` (default false) here and nowhere else, so the security scan
(tests/reliability/test_secrets.py) can hold every other `from_pretrained` to False; without the
setting a directory that needs its code is a ConfigError naming the files and the setting, never
transformers' interactive prompt.

Import cost: pure Python; transformers is imported by the loaders only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["remote_code", "load_tokenizer", "load_config", "load_model"]

# which auto_map entries each kind of load executes
_KEYS = {"tokenizer": ("AutoTokenizer",), "config": ("AutoConfig",),
         "model": ("AutoConfig", "AutoModelForCausalLM", "AutoModel", "AutoModelForImageTextToText")}


def _auto_map(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    m = data.get("auto_map") if isinstance(data, dict) else None
    return m if isinstance(m, dict) else {}


def remote_code(model_dir: str | os.PathLike[str], kind: str = "model") -> list[str]:
    """The `module.Class` references a load of `kind` ("tokenizer", "config", "model") of
    `model_dir` would execute, from config.json and tokenizer_config.json; [] when none."""
    d = Path(model_dir)
    if not d.is_dir():
        return []
    maps = [_auto_map(d / "config.json")]
    if kind == "tokenizer":
        maps.append(_auto_map(d / "tokenizer_config.json"))
    out: list[str] = []
    for m in maps:
        for key in _KEYS[kind]:
            v = m.get(key)
            for ref in (v if isinstance(v, list) else [v]):
                if isinstance(ref, str) and ref and ref not in out:
                    out.append(ref)
    return out


def _refuse(model_dir: Any, kind: str, refs: list[str]) -> ConfigError:
    files = sorted({r.split("--")[-1].rsplit(".", 1)[0] + ".py" for r in refs})
    return ConfigError(f"{model_dir}: its {kind} is code shipped with the model ({', '.join(refs)}; "
                       f"{', '.join(files)}); set target.trust_remote_code = true to run it")


def _load(kind: str, fn: Any, model_dir: Any, trust_remote_code: bool, **kw: Any) -> Any:
    refs = remote_code(model_dir, kind)
    if refs and not trust_remote_code:
        raise _refuse(model_dir, kind, refs)
    try:
        return fn(str(model_dir), trust_remote_code=bool(trust_remote_code), **kw)
    except ValueError as e:  # transformers found custom code this reader did not
        if "trust_remote_code" in str(e) and not trust_remote_code:
            raise _refuse(model_dir, kind, ["auto_map"]) from None
        raise


def load_tokenizer(model_dir: str | os.PathLike[str], *, trust_remote_code: bool = False, **kw: Any) -> Any:
    """AutoTokenizer.from_pretrained(model_dir) through the gate."""
    from transformers import AutoTokenizer

    return _load("tokenizer", AutoTokenizer.from_pretrained, model_dir, trust_remote_code, **kw)


def load_config(model_dir: str | os.PathLike[str], *, trust_remote_code: bool = False, **kw: Any) -> Any:
    """AutoConfig.from_pretrained(model_dir) through the gate."""
    from transformers import AutoConfig

    return _load("config", AutoConfig.from_pretrained, model_dir, trust_remote_code, **kw)


def load_model(auto_class: Any, model_dir: str | os.PathLike[str], *, trust_remote_code: bool = False,
               **kw: Any) -> Any:
    """auto_class.from_pretrained(model_dir, **kw) through the gate (an AutoModel* class)."""
    return _load("model", auto_class.from_pretrained, model_dir, trust_remote_code, **kw)
