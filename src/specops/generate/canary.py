"""Canary: a few prompts per dataset through the real engine before a campaign commits hours.

The canary runs the same runner on a scratch campaign (`<campaign>/canary/`, replaced each time)
with `generate.canary_samples` prompts per dataset, then checks the records: content came back,
reasoning was captured when reasoning mode is "save", no stray think markers are left in content,
not every sample was cut by max_tokens (when all are, whether they loop: a degenerate decode, not
long answers), and the model id is the one expected. Any finding stops
the campaign before the full run, with the evidence.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..campaign import Campaign
from ..config import Config
from ..errors import SpecopsError
from ..text import count_repeating, has_think_tags
from .types import Engine


class CanaryFailed(SpecopsError):
    """The canary found a problem that would spoil the whole campaign."""


@dataclass
class CanaryReport:
    datasets: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_records(name: str, records: list[dict[str, Any]], failed: list[dict[str, Any]], *,
                  reasoning_mode: str, expected_model: str | None, max_tokens: int,
                  expect_truncation: bool = False, quarantined: list[dict[str, Any]] | None = None) -> list[str]:
    """The canary's verdict on one dataset's records: a list of problems (empty = fine).
    `quarantined`: the quarantine.jsonl entries ({where, reason}) of the canary's read."""
    problems: list[str] = []
    if not records:
        if failed:
            return [f"{name}: every canary request failed (first error: {failed[0]['error']})"]
        if quarantined:
            q = quarantined[0]
            n = len(quarantined)
            read = "the one record it read was" if n == 1 else f"all {n} records it read were"
            return [f"{name}: no canary request was sent: {read} quarantined (first, {q['where']}: {q['reason']})"]
        return [f"{name}: the canary read no record, so no request was sent"]
    empty = [r["id"] for r in records if not (r.get("content") or "").strip() and not _has_tool_calls(r)]
    if empty:
        problems.append(f"{name}: {len(empty)}/{len(records)} samples came back with empty content ({empty[0]})")
    stray = [r["id"] for r in records if has_think_tags(r.get("content"))]
    if stray:
        problems.append(
            f"{name}: think markers left in content ({stray[0]}): the server splits no reasoning; start it with a "
            "reasoning parser (vLLM/SGLang --reasoning-parser) or set generate.reasoning = 'off'"
        )
    if reasoning_mode == "save" and not any(r.get("reasoning") for r in records):
        problems.append(
            f"{name}: reasoning mode is 'save' but none of {len(records)} samples carried reasoning "
            "(no `reasoning`/`reasoning_content` field): start the server with a reasoning parser, "
            "or set generate.reasoning = 'off' for a non-reasoning target"
        )
    cut = [r for r in records if r.get("finish_reason") == "length"]
    if len(cut) == len(records) and not expect_truncation:
        loops = [r["id"] for r in cut if loop_share(r) > LOOP_SHARE]
        if len(loops) == len(cut):
            problems.append(
                f"{name}: all {len(records)} samples hit max_tokens={max_tokens}, and every one loops (more than "
                f"{LOOP_SHARE:.0%} of its tokens repeat a {LOOP_NGRAM}-token window it already wrote, e.g. {loops[0]}): "
                "a degenerate decode, not long answers. Check the chat template and the sampling settings "
                "(temperature, repetition penalty) before raising max_tokens")
        else:
            problems.append(f"{name}: all {len(records)} samples hit max_tokens={max_tokens} (finish_reason 'length'); "
                            "raise max_tokens (or set generate.expect_truncation = true for a smoke run)")
    if expected_model:
        wrong = {r.get("model") for r in records} - {expected_model}
        if wrong:
            problems.append(f"{name}: responses came from model {sorted(map(str, wrong))}, expected '{expected_model}'")
    if failed:
        problems.append(f"{name}: {len(failed)} canary sample(s) failed: {failed[0]['error']}")
    return problems


# A sample "loops" when more than LOOP_SHARE of its generated tokens repeat a LOOP_NGRAM-token
# window it already wrote (the build's repetition measure, text.repeating_tokens).
LOOP_NGRAM, LOOP_SHARE = 16, 0.3


def loop_share(rec: dict[str, Any]) -> float:
    """Share of a record's generated tokens that repeat a LOOP_NGRAM window of their own turn: on
    the turns' token ids where the server returned them, else on the content's words."""
    seqs = [t["token_ids"] for t in rec.get("turns") or [] if isinstance(t, dict) and isinstance(t.get("token_ids"), list)]
    if not seqs:
        words = (rec.get("content") or "").split()
        seqs = [[hash(w) & 0x7FFFFFFF for w in words]]
    total = sum(len(x) for x in seqs)
    return sum(count_repeating(x, LOOP_NGRAM) for x in seqs) / total if total else 0.0


def _has_tool_calls(rec: dict[str, Any]) -> bool:
    return any(m.get("tool_calls") for m in rec.get("messages", []) if m.get("role") == "assistant")


def _read(path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


async def run_canary(cfg: Config, campaign: Campaign, engine: Engine) -> CanaryReport:
    from ..models import served_name
    from .runner import Runner

    n = cfg.generate.canary_samples
    root = campaign.root / "canary"
    shutil.rmtree(root, ignore_errors=True)  # scratch: our own files, remade each time
    ccfg = copy.deepcopy(cfg)
    ccfg.campaign.dir = str(root)
    for ds in ccfg.datasets:
        ds.limit = min(ds.limit or n, n)
    camp = Campaign(root)
    camp.run_dir.mkdir(parents=True, exist_ok=True)
    runner = Runner(ccfg, camp, engine, progress=False, manage_engine=False)
    summary = await runner.run()
    expected = served_name(cfg.target.model, cfg.target.served_name) if cfg.engine.kind == "openai" else None
    report = CanaryReport()
    for ds in ccfg.datasets:
        if summary.datasets[ds.name].get("empty_input"):
            # nothing to send: the runner warned about it, and the full run reports it again
            report.datasets[ds.name] = {"records": 0, "failed": 0, "problems": [], "empty_input": True}
            continue
        d = camp.dataset_dir(ds.name)
        recs, failed, quarantined = (_read(d / f) for f in ("records.jsonl", "failed.jsonl", "quarantine.jsonl"))
        probs = check_records(ds.name, recs, failed, reasoning_mode=cfg.generate.reasoning,
                              expected_model=expected, max_tokens=cfg.sampling_for(ds).max_tokens,
                              expect_truncation=cfg.generate.expect_truncation, quarantined=quarantined)
        report.datasets[ds.name] = {"records": len(recs), "failed": len(failed), "quarantined": len(quarantined),
                                    "problems": probs}
        report.problems.extend(probs)
    return report
