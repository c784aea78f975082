"""What each phase's output was made from, and whether it still matches.

Every phase has one small function below that lists, from the resolved config, the settings that
shape its output, the upstream phases whose outputs it reads, and a digest of its own output
(None when the output is missing). When `specops run` finishes a phase it records that in the
phase's manifest entry as `made_from` = {settings, inputs (the upstream output digests), output}.

train, export and eval run once per drafter family of train.drafter: the first family's keys are
the bare phase names, another family's "train:<family>" and so on (`keys`), each with its
`DrafterHome` (campaign.py); a family's three keys are a chain of their own after the shared
phases, so one family's change never makes another stale.

A done phase is then
- stale when an earlier phase is stale or not done, its output is missing, a setting it lists
  differs from the recorded value, or an upstream output digest differs from the recorded one;
- unrecorded when it has no `made_from` (a manifest written without it, e.g. by an older specops,
  or a phase finished by its own command after a reset): taken as current, and recorded the next
  time `specops run` passes it;
- current otherwise.

Digests read only small files (build/manifest.json, features/*/index.json, a checkpoint's
state.json, the exports' manifest.json, eval/summary.json; of generate's records.jsonl its size
and last 64 KiB), so `specops status` can assess a large campaign in milliseconds, and a copied or
moved campaign directory keeps its digests (no mtimes).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .campaign import DRAFTER_PHASES, PHASES, Campaign, DrafterHome, drafter_home, now_iso, split_key
from .config import FAMILY_TRAIN_KEYS, drafter_families

_ABSENT = "<unset>"  # a key with no value (a dataset entry that is not there, a required field)
_UNKNOWN = object()  # a recorded key this version's config does not have: cannot matter any more


@dataclass
class Made:
    settings: dict[str, Any]  # "section.key" (or "datasets.<name>.key") -> resolved value
    inputs: tuple[str, ...]  # upstream phases whose outputs this phase reads
    output: str | None  # digest of this phase's output as it is on disk; None = missing
    missing: str = ""  # what is missing when output is None (for the reason)


@dataclass
class Verdict:
    verdict: str  # current | stale | unrecorded
    reasons: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)  # setting keys that differ from the record

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reasons": self.reasons}


# ---------------------------------------------------------------- settings from the resolved config


@functools.lru_cache(maxsize=1)
def _defaults() -> tuple[dict[str, Any], dict[str, Any]]:
    """Each config field's default ("section.key" -> value), and DatasetSection's (key -> value)."""
    from . import config as C

    def default(f: dataclasses.Field) -> Any:
        if f.default is not dataclasses.MISSING:
            return _jsonable(f.default)
        if f.default_factory is not dataclasses.MISSING:
            return _jsonable(f.default_factory())
        return _ABSENT

    hints = typing.get_type_hints(C.Config)
    flat: dict[str, Any] = {}
    for sec in dataclasses.fields(C.Config):
        if sec.name in ("source_path", "datasets"):
            continue
        for f in dataclasses.fields(hints[sec.name]):
            flat[f"{sec.name}.{f.name}"] = default(f)
    return flat, {f.name: default(f) for f in dataclasses.fields(C.DatasetSection)}


def _jsonable(v: Any) -> Any:
    return json.loads(json.dumps(v))


def _default_for(key: str) -> Any:
    flat, ds = _defaults()
    if key.startswith("datasets."):
        return ds.get(key.rsplit(".", 1)[1], _UNKNOWN)
    return flat.get(key, _UNKNOWN)


def pick(c: dict[str, Any], *names: str, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """Flat settings from the resolved config dict `c`: a name is a whole section ("train"), one
    key ("target.model") or "datasets" (every entry, keyed by its name). Keys the dict leaves out
    (None values are not written) take their default. `drop`: fnmatch patterns of keys that change
    only speed, logging or where things run, not the output."""
    flat, ds_defaults = _defaults()
    out: dict[str, Any] = {}
    for name in names:
        if name == "datasets":
            for d in c.get("datasets") or []:
                for k in {**ds_defaults, **d}:
                    out[f"datasets.{d['name']}.{k}"] = d.get(k, ds_defaults.get(k))
        elif "." in name:
            sec, k = name.split(".", 1)
            out[name] = (c.get(sec) or {}).get(k, flat.get(name))
        else:
            body = c.get(name) or {}
            for key in [x for x in flat if x.startswith(name + ".")] + [f"{name}.{k}" for k in body]:
                out[key] = body.get(key.split(".", 1)[1], flat.get(key))
    return {k: v for k, v in out.items() if not any(fnmatch.fnmatchcase(k, p) for p in drop)}


def _seed(c: dict[str, Any], section: str) -> int:
    s = (c.get(section) or {}).get("seed")
    return s if s is not None else (c.get("campaign") or {}).get("seed", 0)


# ---------------------------------------------------------------- digests of outputs


def _sha(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except (FileNotFoundError, NotADirectoryError):
        return None


def _tail(path: Path, n: int = 1 << 16) -> str | None:
    """Size and last `n` bytes of an append-only file: changes when anything is added or rewritten."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - n))
            return f"{size}:{hashlib.sha256(f.read()).hexdigest()[:16]}"
    except (FileNotFoundError, NotADirectoryError):
        return None


def _join(parts: dict[str, str | None]) -> tuple[str | None, str]:
    """One digest over named parts; (None, the missing ones) when any part is missing."""
    missing = [k for k, v in parts.items() if v is None]
    if missing:
        return None, ", ".join(missing)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16], ""


def _latest_checkpoint(home: Path) -> Path | None:
    # <home>/checkpoints/step-<n>/ whose state.json says complete (what training resumes from)
    best: tuple[int, Path] | None = None
    ck = home / "checkpoints"
    for p in ck.glob("step-*") if ck.is_dir() else ():
        try:
            step = int(p.name[5:])
            state = json.loads((p / "state.json").read_bytes())
        except (ValueError, OSError, json.JSONDecodeError):
            continue
        if state.get("complete") and (p / "model.safetensors").is_file() and (best is None or step > best[0]):
            best = (step, p)
    return best[1] if best else None


# ---------------------------------------------------------------- one function per phase


def _generate(c: dict[str, Any], root: Path, home: None = None) -> Made:
    local = (c.get("engine") or {}).get("kind", "local") == "local"
    settings = pick(c, "target.model", "target.served_name", "target.tokenizer", "generate", "datasets",
                    drop=("generate.concurrency", "generate.ordering", "generate.fsync_interval_s",
                          "generate.heartbeat_interval_s", "generate.canary_samples",
                          "generate.expect_truncation", "datasets.*.concurrency"))
    if local:  # the local engine runs the target in this dtype; a server's own dtype is its business
        settings.update(pick(c, "target.dtype", "target.trust_remote_code"))
    out, missing = _join({f"generate/{d['name']}/records.jsonl": _tail(root / "generate" / d["name"] / "records.jsonl")
                          for d in c.get("datasets") or []})
    return Made(settings, (), out, missing)


def _build(c: dict[str, Any], root: Path, home: None = None) -> Made:
    settings = pick(c, "build", "target.model", "target.tokenizer", "target.trust_remote_code")
    settings["build.seed"] = _seed(c, "build")
    out, missing = _join({"build/manifest.json": _sha(root / "build" / "manifest.json")})
    return Made(settings, ("generate",), out, missing)


def _extract(c: dict[str, Any], root: Path, home: None = None) -> Made:
    if (c.get("extract") or {}).get("mode") == "online":  # nothing written: training computes features
        return Made(pick(c, "extract.mode"), ("build",), "online")
    settings = pick(c, "extract", "target.model", "target.dtype", "target.trust_remote_code",
                    drop=("extract.device", "extract.server_urls", "extract.served_dir", "extract.served_concurrency"))
    parts = {"features/train/index.json": _sha(root / "features" / "train" / "index.json")}
    if (root / "features" / "val").is_dir():
        parts["features/val/index.json"] = _sha(root / "features" / "val" / "index.json")
    out, missing = _join(parts)
    return Made(settings, ("build",), out, missing)


def _train(c: dict[str, Any], root: Path, home: DrafterHome) -> Made:
    # One family's drafter: train.drafter is that family's name (the list's other names do not shape
    # it), and the keys only other families read are left out, so they never retrain this one.
    others = {k for ks in FAMILY_TRAIN_KEYS.values() for k in ks} - set(FAMILY_TRAIN_KEYS.get(home.family, ()))
    settings = pick(c, "train", "target.model", "target.dtype", "target.trust_remote_code",
                    drop=("train.log_every", "train.eval_every", "train.checkpoint_every", "train.keep_checkpoints",
                          "train.prefetch", "train.device", "train.cuda_graphs", "train.graph_bucket",
                          *(f"train.{k}" for k in others)))
    settings["train.drafter"] = home.family
    settings["train.seed"] = _seed(c, "train")
    if settings.get("train.mask_repetition"):
        settings.update(pick(c, "build.repetition_ngram"))
    if settings.get("train.mode") == "online":
        settings.update(pick(c, "extract.aux_layer_ids"))
    ck = _latest_checkpoint(home.dir)
    out = None if ck is None else f"{ck.name}:{_sha(ck / 'state.json')}"
    rel = home.dir.relative_to(root)
    return Made(settings, ("build", "extract"), out, "" if ck else f"a complete checkpoint under {rel}/checkpoints")


def _export(c: dict[str, Any], root: Path, home: DrafterHome) -> Made:
    settings = pick(c, "train.ttt_steps", "target.model", "target.served_name")
    rel = home.dir.relative_to(root)
    out, missing = _join({f"{rel}/export/{f}/manifest.json": _sha(home.dir / "export" / f / "manifest.json")
                          for f in ("vllm", "speculators")})
    return Made(settings, (home.key("train"),), out, missing)


def _eval(c: dict[str, Any], root: Path, home: DrafterHome) -> Made:
    # eval reads the newer of the family's latest checkpoint and its exports (or eval.drafter)
    settings = pick(c, "eval", "target", "generate.system_prompt")
    rel = home.eval_dir.relative_to(root)
    out, missing = _join({f"{rel}/summary.json": _sha(home.eval_dir / "summary.json")})
    return Made(settings, (home.key("train"), home.key("export")), out, missing)


SPECS: dict[str, Callable[[dict[str, Any], Path, Any], Made]] = {
    "generate": _generate, "build": _build, "extract": _extract, "train": _train, "export": _export, "eval": _eval,
}
assert tuple(SPECS) == PHASES


def home_of(c: dict[str, Any], root: Path, key: str) -> DrafterHome | None:
    """The drafter home a phase key belongs to ("train", "eval:dflash"); None for a shared phase."""
    phase, family = split_key(key)
    if phase not in DRAFTER_PHASES:
        return None
    return drafter_home(root, drafter_families((c.get("train") or {}).get("drafter"))[0], family)


def made(key: str, c: dict[str, Any], root: Path) -> Made:
    """What the output of phase key `key` is made from, against the resolved config dict `c`."""
    return SPECS[split_key(key)[0]](c, root, home_of(c, root, key))


def keys(c: dict[str, Any]) -> list[str]:
    """Every phase key of a campaign in order: the shared phases, then train, export, eval of each
    family of train.drafter (the first family's keys are the bare phase names)."""
    fams = drafter_families((c.get("train") or {}).get("drafter"))
    out = [p for p in PHASES if p not in DRAFTER_PHASES]
    for f in fams:
        out += [p if f == fams[0] else f"{p}:{f}" for p in DRAFTER_PHASES]
    return out


def outputs(c: dict[str, Any], root: Path, key: str) -> list[str]:
    """The paths (relative to the campaign root) a phase key's output occupies (reset.outputs_of)."""
    from .reset import outputs_of

    return outputs_of(home_of(c, root, key), root, split_key(key)[0])


# ---------------------------------------------------------------- assess, record, replace


def _fmt(v: Any) -> str:
    s = "unset" if v is _ABSENT or v is None else json.dumps(v, ensure_ascii=False)
    return s if len(s) <= 40 else s[:37] + "..."


def _changed(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        d = _default_for(k)
        if d is _UNKNOWN and k not in new:
            continue
        if old.get(k, d) != new.get(k, d):
            out.append(k)
    return out


def _describe(keys: list[str], old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out, whole = [], set()
    for k in keys:  # a dataset entry added or dropped is one reason, not one per key
        if k.startswith("datasets.") and k.endswith(".name"):
            name = k[len("datasets."):-len(".name")]
            if k not in old or k not in new:
                whole.add(name)
                out.append(f"dataset {name} {'added' if k not in old else 'removed'}")
    for k in keys:
        if k.startswith("datasets.") and k[len("datasets."):].rsplit(".", 1)[0] in whole:
            continue
        d = _default_for(k)
        out.append(f"{k}: {_fmt(old.get(k, d))} -> {_fmt(new.get(k, d))}")
    return out if len(out) <= 4 else out[:3] + [f"{len(out) - 3} more settings"]


def assess(root: Path, manifest: dict[str, Any], config: dict[str, Any] | None = None) -> dict[str, Verdict]:
    """A verdict for every done phase key (contract.keys), against `config` (a resolved config dict;
    default: the campaign's own). Phases not done have none: they run anyway. The shared phases
    are one chain; each drafter family's train, export, eval a chain of its own after them, so a
    stale family never makes another one stale."""
    c = _jsonable(config if config is not None else manifest.get("config") or {})
    phases = manifest.get("phases") or {}
    out: dict[str, Verdict] = {}

    def judge(key: str, blocked: str | None) -> str | None:
        """The verdict of `key` into out; returns the chain's first stale or not-done key."""
        entry = phases.get(key) or {}
        if entry.get("state") != "done":
            return blocked or f"{key} is {entry.get('state') or 'pending'}"
        m = made(key, c, root)
        rec = entry.get("made_from")
        v = Verdict("current" if rec else "unrecorded")
        if rec:
            v.changed = _changed(rec.get("settings") or {}, m.settings)
            v.reasons += _describe(v.changed, rec.get("settings") or {}, m.settings)
        if m.output is None:
            v.reasons.append(f"output missing ({m.missing})")
        if rec:
            for u in m.inputs if not blocked else ():  # a stale upstream already explains its output
                was, now = (rec.get("inputs") or {}).get(u), made(u, c, root).output
                if was != now:
                    v.reasons.append(f"input {u} {'missing' if now is None else 'changed'} since it was made")
        if blocked:
            v.reasons.append(f"upstream {blocked}")
        if v.reasons:
            v.verdict = "stale"
            blocked = blocked or f"{key} is stale"
        out[key] = v
        return blocked

    shared: str | None = None
    chain = keys(c)
    for key in [k for k in chain if split_key(k)[0] not in DRAFTER_PHASES]:
        shared = judge(key, shared)
    blocked = shared
    for i, key in enumerate(k for k in chain if split_key(k)[0] in DRAFTER_PHASES):
        if i % len(DRAFTER_PHASES) == 0:  # a family's train starts its own chain after the shared phases
            blocked = shared
        blocked = judge(key, blocked)
    return out


def record(campaign: Campaign, phase: str) -> dict[str, Any]:
    """Write what the output of phase key `phase` (done, on disk now) was made from into its
    manifest entry."""
    m = campaign.read_manifest() or {}
    c = _jsonable(m.get("config") or {})
    mf = made(phase, c, campaign.root)
    rec = {"settings": mf.settings, "inputs": {u: made(u, c, campaign.root).output for u in mf.inputs},
           "output": mf.output, "recorded_at": now_iso()}
    m.setdefault("phases", {}).setdefault(phase, {})["made_from"] = rec
    campaign.write_manifest(m)
    return rec


def replace(campaign: Campaign, phase: str, reason: str, changed: list[str] | None = None) -> dict[str, Any] | None:
    """Before `phase` runs again: move its outputs under archive/ (as `specops reset` does), keep
    the manifest entry that described them beside them (phase-entry.json), and start its entry
    afresh as pending. None (nothing done) for a phase that is not done and has no outputs yet.

    `changed`: the setting keys behind a stale verdict (None: rerun from scratch). generate's
    datasets are journaled apart, so there only the datasets whose own keys changed are set aside
    (and every one when a shared key did); the rerun resumes the rest and redoes a missing one."""
    from .campaign import atomic_write_json
    from .reset import archive_outputs

    m = campaign.read_manifest() or {}
    paths = outputs(_jsonable(m.get("config") or {}), campaign.root, phase)
    if phase == "generate" and changed is not None and all(k.startswith("datasets.") for k in changed):
        paths = sorted({"generate/" + k[len("datasets."):].rsplit(".", 1)[0] for k in changed})
    old = (m.get("phases") or {}).get(phase) or {}
    if old.get("state") != "done" and not any((campaign.root / p).exists() for p in paths):
        return None
    stamp, dest, moved = archive_outputs(campaign, phase.replace(":", "-"), paths)
    if moved:
        atomic_write_json(dest / "phase-entry.json", old)
    rel = str(dest.relative_to(campaign.root)) if moved else None
    m = campaign.read_manifest() or {}
    m.setdefault("phases", {})[phase] = {"state": "pending", "pending_at": now_iso(),
                                          "replaced": {"reason": reason, "archived_to": rel, "moved": moved}}
    m.setdefault("events", []).append({"at": stamp, "kind": "rerun", "phase": phase, "reason": reason,
                                       "archived_to": rel, "moved": moved})
    campaign.write_manifest(m)
    return {"archived_to": rel, "moved": moved}
