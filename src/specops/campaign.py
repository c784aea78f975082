"""The campaign directory: the single source of truth for every phase.

    campaign/
      campaign.toml     the resolved config, copied in at first use
      manifest.json     phase states (pending | running | done | failed) with timestamps
      run/              lock (flock), pid, heartbeat.json, runner.log
      generate/<dataset>/records.jsonl failed.jsonl quarantine.jsonl stats.json
      drafter/          the first family of train.drafter: checkpoints/, metrics.jsonl, manifest.json, export/
      eval/             its evaluation, and the report of every family
      drafters/<family>/  each further family: the same files as drafter/, and its own eval/

Small files are replaced atomically (write to a temp file in the same directory, fsync, rename),
so a reader never sees a torn manifest, stats or heartbeat file.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import hashlib
import json
import os
import shlex
import socket
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from . import __version__
from .config import Config, drafter_families, dump_toml
from .errors import CampaignLocked, ConfigError

PHASES = ("generate", "build", "extract", "train", "export", "eval")
# The phases each drafter family of a campaign runs on its own (the ones before them are shared).
DRAFTER_PHASES = ("train", "export", "eval")
# The dataset keys that decide what its records hold: changing one needs a reset of those records.
_DATASET_IDENTITY = ("source", "path", "format", "turns", "system_prompt", "tools")


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def atomic_write_bytes(path: Path, data: bytes, *, fsync: bool = True) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave a temp file behind (e.g. on ENOSPC)
        raise
    if fsync:
        fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any, *, fsync: bool = True) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, ensure_ascii=False) + "\n").encode(), fsync=fsync)


def read_json(path: Path, default: Any = None) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return default


def fsync_file(path: Path) -> None:
    """fsync one file (or directory) by path; errors propagate: a checkpoint or split that cannot
    be made durable must not be published."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    """Hex sha256 of a file's bytes, read into one reused buffer (no fresh bytes object per block).

    16 MiB: freeing a smaller buffer leaves glibc's mmap threshold lower, which slows the CPU
    path's forwards (fp8 temporaries) afterwards.
    """
    h = hashlib.sha256()
    buf = memoryview(bytearray(chunk))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(buf[:n])  # hashlib drops the GIL for large blocks
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Best effort fsync of a directory entry list (after a rename into it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class DrafterHome:
    """Where one drafter family of a campaign lives, and the manifest keys of its phases.

    The first family of train.drafter is the campaign's drafter: drafter/ and eval/, manifest phases
    "train", "export", "eval" (the layout of a one-family campaign, so every campaign written before
    several families existed reads as it was). A further family lives at drafters/<family>/ (its
    checkpoints, metrics, manifest, export/ and eval/ there) under phases "train:<family>" and so on.
    """

    family: str
    dir: Path  # checkpoints/, metrics.jsonl, manifest.json, export/<format>/
    eval_dir: Path  # summary.json, <dataset>.json, served.json (and, for the first family, the report)
    first: bool

    def key(self, phase: str) -> str:
        assert phase in DRAFTER_PHASES, phase
        return phase if self.first else f"{phase}:{self.family}"


def split_key(key: str) -> tuple[str, str | None]:
    """A manifest phase key -> (phase, family); family None for the shared keys and the first family."""
    phase, _, family = key.partition(":")
    return phase, family or None


def drafter_home(root: Path, first: str, family: str | None = None) -> DrafterHome:
    """The home of `family` (default: `first`, the first family of train.drafter) under `root`."""
    family = family or first
    if family == first:
        return DrafterHome(family, root / "drafter", root / "eval", True)
    return DrafterHome(family, root / "drafters" / family, root / "drafters" / family / "eval", False)


class Campaign:
    """Paths and manifest of one campaign directory."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).resolve()

    # ---------------------------------------------------------------- layout
    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    @property
    def config_path(self) -> Path:
        return self.root / "campaign.toml"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def heartbeat_path(self) -> Path:
        return self.run_dir / "heartbeat.json"

    @property
    def pid_path(self) -> Path:
        return self.run_dir / "pid"

    @property
    def lock_path(self) -> Path:
        return self.run_dir / "lock"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "runner.log"

    def phase_dir(self, phase: str) -> Path:
        assert phase in PHASES, phase
        return self.root / ("drafter" if phase in ("train", "export") else phase)

    def dataset_dir(self, dataset: str) -> Path:
        return self.root / "generate" / dataset

    def drafter_home(self, cfg: Config, family: str | None = None) -> DrafterHome:
        """The home of `family` (default: the first of train.drafter, the campaign's drafter). A family
        train.drafter does not list (`specops train --drafter X`) lives beside the others."""
        return drafter_home(self.root, cfg.train.families[0], family)

    def drafter_homes(self, cfg: Config) -> list[DrafterHome]:
        """Every family of train.drafter, the first one first."""
        return [self.drafter_home(cfg, f) for f in cfg.train.families]

    def evaluated_homes(self) -> list[DrafterHome]:
        """The drafter homes that hold an eval summary, in the order of the campaign's train.drafter,
        then any other family evaluated here (e.g. `specops train --drafter X` + `eval --family X`)."""
        cfg = (self.read_manifest() or {}).get("config") or {}
        fams = drafter_families((cfg.get("train") or {}).get("drafter"))
        others = sorted(p.name for p in (self.root / "drafters").iterdir()) if (self.root / "drafters").is_dir() else []
        homes = [drafter_home(self.root, fams[0], f) for f in dict.fromkeys([*fams, *others])]
        return [h for h in homes if (h.eval_dir / "summary.json").is_file() or (h.eval_dir / "served.json").is_file()]

    # ---------------------------------------------------------------- create / open
    @classmethod
    def create_or_open(cls, cfg: Config) -> "Campaign":
        """Open the config's campaign directory, creating it on first use.

        The resolved config is copied in once. A rerun with a different config for the same
        campaign is refused where it would change what was already generated: a dataset whose
        generate/<name>/ exists keeps the source it was made with, also across a config that left it
        out for a while, so a resume never mixes two campaigns in one journal. Once
        `specops reset generate [--dataset NAME]` has archived that directory, the change is taken.
        """
        camp = cls(cfg.campaign_dir())
        camp.root.mkdir(parents=True, exist_ok=True)
        camp.run_dir.mkdir(exist_ok=True)
        resolved = cfg.to_dict()
        sources = {d["name"]: {k: d.get(k) for k in _DATASET_IDENTITY} for d in resolved.get("datasets", [])}
        manifest = camp.read_manifest()
        if manifest is None:
            atomic_write_bytes(camp.config_path, dump_toml(resolved).encode())
            manifest = {
                "specops_version": __version__,
                "created": now_iso(),
                "config": resolved,
                "phases": {p: {"state": "pending"} for p in PHASES},
                "events": [],
                "dataset_sources": sources,
            }
            camp.write_manifest(manifest)
        else:
            # Last recorded identity per dataset name, datasets since dropped from the config included.
            old = dict(manifest.get("dataset_sources") or {})
            old.update({d["name"]: {k: d.get(k) for k in _DATASET_IDENTITY}
                        for d in manifest.get("config", {}).get("datasets", [])})
            for name, now in sources.items():
                prev = old.get(name)
                if prev is None or not camp.dataset_dir(name).exists():
                    continue
                for k in _DATASET_IDENTITY:
                    if prev.get(k) != now[k]:
                        raise ConfigError(
                            f"datasets '{name}'.{k}: differs from the campaign's recorded config "
                            f"({prev.get(k)!r} -> {now[k]!r}); the existing records were made with the old "
                            f"value. Use a new campaign directory or "
                            f"`specops reset generate {shlex.quote(str(camp.root))} --dataset {name}`."
                        )
            known = {**old, **sources}
            if manifest.get("config") != resolved or manifest.get("dataset_sources") != known:
                manifest["config"] = resolved
                manifest["dataset_sources"] = known
                atomic_write_bytes(camp.config_path, dump_toml(resolved).encode())
                camp.write_manifest(manifest)
        return camp

    # ---------------------------------------------------------------- manifest
    def read_manifest(self) -> dict[str, Any] | None:
        return read_json(self.manifest_path)

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        atomic_write_json(self.manifest_path, manifest)

    def set_phase(self, phase: str, state: str, **extra: Any) -> None:
        assert state in ("pending", "running", "done", "failed"), state
        m = self.read_manifest() or {"phases": {}}
        entry = m.setdefault("phases", {}).setdefault(phase, {})
        entry["state"] = state
        entry[f"{state}_at"] = now_iso()
        entry.update(extra)
        self.write_manifest(m)

    def add_event(self, kind: str, **fields: Any) -> None:
        """Append an audit event (e.g. a skipped preflight) to the manifest."""
        m = self.read_manifest() or {}
        m.setdefault("events", []).append({"at": now_iso(), "kind": kind, **fields})
        self.write_manifest(m)


class RunLock:
    """Exclusive campaign lock: flock on run/lock plus run/pid for humans and `status`.

    flock is released by the kernel when the holder dies, so a stale lock from a dead pid never
    blocks a rerun; the pid file is only informational and is rewritten by the new holder.
    """

    def __init__(self, campaign: Campaign, purpose: str):
        self.campaign = campaign
        self.purpose = purpose
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        self.campaign.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.campaign.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder = read_json(self.campaign.pid_path, {}) or {}
            who = f"pid {holder.get('pid', '?')} ({holder.get('purpose', '?')}, since {holder.get('started', '?')})"
            raise CampaignLocked(
                f"campaign {self.campaign.root} is in use by {who}; "
                f"wait for it, or stop it with `specops stop {self.campaign.root}`"
            ) from None
        self._fd = fd
        atomic_write_json(
            self.campaign.pid_path,
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "purpose": self.purpose,
                "started": now_iso(),
                "started_unix": time.time(),
            },
        )
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            holder = read_json(self.campaign.pid_path, {}) or {}
            if holder.get("pid") == os.getpid():
                self.campaign.pid_path.unlink(missing_ok=True)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def lock_holder(campaign: Campaign) -> dict[str, Any] | None:
    """Who holds the lock now (pid info), or None. Probes flock, never greps process names."""
    try:
        fd = os.open(campaign.lock_path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        info = read_json(campaign.pid_path, {}) or {}
        info["alive"] = bool(info.get("pid")) and pid_alive(int(info["pid"]))
        return info
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
