"""Drafter checkpoints: drafter/checkpoints/step-<n>/ (DESIGN "drafter/").

A checkpoint is complete when every file of CKPT_FILES is present and state.json says so; it is
written under a temp name, fsync'd and renamed, so a kill leaves either the old set or the new one.
train writes and resumes them; export and eval read the drafter back with `load_drafter`.
drafter_config.json is the drafter's config plus "family", the drafter family that reads it
(`families.FAMILIES`; absent in checkpoints written before train could build another: EAGLE-3).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..campaign import fsync_file, now_iso, read_json
from ..errors import ConfigError
from .families import checkpoint_family, family_of
from .optim import OptimizerSet

CKPT_FILES = ("model.safetensors", "drafter_config.json", "optimizer.pt", "rng.pt", "state.json")


def checkpoints_dir(drafter_dir: Path) -> Path:
    return Path(drafter_dir) / "checkpoints"


def list_checkpoints(drafter_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (renamed into place, every file present), oldest first."""
    root = checkpoints_dir(drafter_dir)
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if not p.name.startswith("step-") or not p.is_dir():
                continue
            try:
                step = int(p.name[5:])
            except ValueError:
                continue
            if all((p / f).is_file() for f in CKPT_FILES) and (read_json(p / "state.json") or {}).get("complete"):
                out.append((step, p))
    return sorted(out)


def latest_checkpoint(drafter_dir: Path) -> Path | None:
    cks = list_checkpoints(drafter_dir)
    return cks[-1][1] if cks else None


def load_drafter(ckpt_dir: str | os.PathLike[str], device: str | torch.device = "cpu") -> nn.Module:
    """A drafter from a checkpoint directory (its config travels with it)."""
    from safetensors.torch import load_file

    ckpt_dir = Path(ckpt_dir)
    config = json.loads((ckpt_dir / "drafter_config.json").read_text())
    model = checkpoint_family(config, f"{ckpt_dir}/drafter_config.json").drafter_from_config(config)
    model.load_state_dict(load_file(str(ckpt_dir / "model.safetensors")), strict=True)
    return model.to(device)


def save_checkpoint(drafter_dir: Path, step: int, drafter: nn.Module, optimizer, scheduler,
                    state: dict[str, Any], keep: int) -> Path:
    """Write step-<n>/ under a temp name, fsync, rename; then prune to the newest `keep`."""
    from safetensors.torch import save_file

    root = checkpoints_dir(drafter_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    sd = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(sd, str(tmp / "model.safetensors"))
    config = {"family": family_of(drafter).name, **drafter.config.to_dict()}
    (tmp / "drafter_config.json").write_text(json.dumps(config, indent=1) + "\n")
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({**state, "step": step, "complete": True, "saved": now_iso()}, indent=1))
    for f in CKPT_FILES:
        fsync_file(tmp / f)
    if final.exists():  # a rerun reached the same step again (e.g. after resuming from an older one)
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_file(root)
    for _, old in list_checkpoints(drafter_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, drafter: nn.Module, optimizer, scheduler) -> dict[str, Any]:
    from safetensors.torch import load_file

    saved = checkpoint_family(json.loads((path / "drafter_config.json").read_text()), f"{path}/drafter_config.json")
    if saved is not family_of(drafter):
        raise ConfigError(f"{path} holds a {saved.name} drafter and this run trains {family_of(drafter).name} "
                          f"(train.drafter): resume with train.drafter = {saved.name!r}, or train into a new campaign")
    device = next(drafter.parameters()).device
    sd = load_file(str(path / "model.safetensors"), device=str(device))
    drafter.load_state_dict(sd, strict=True)
    opt = torch.load(path / "optimizer.pt", map_location=device, weights_only=True)
    if "optimizers" in opt["optimizer"] and not isinstance(optimizer, OptimizerSet):
        raise ConfigError(f"{path}: the checkpoint's optimizer state holds {sorted(opt['optimizer']['optimizers'])}, "
                          "this run has one AdamW: resume with the train.optimizer it was trained with")
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    rng = torch.load(path / "rng.pt", weights_only=True)
    py = rng["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return json.loads((path / "state.json").read_text())
