"""The build phase: generate/<dataset>/records.jsonl -> build/ (tokenized samples + draft vocab).

Per record: checks -> render with the target's chat template, marking the tokens the target
generated -> length policy -> (per dataset) the reasoning rule -> dedupe. Then a seeded shuffle, a
train/val split, the draft vocabulary from the train split's loss-masked tokens, and the files of
DESIGN "File formats / build/", written to `build.tmp.<pid>/` and renamed to `build/` (a previous
`build/` is archived as `build.old.<timestamp>/`, never deleted), so a killed build leaves no torn
output.

Loss mask (1 = a token the target generated; everything else, system/user/tool turns and the
template's headers, is 0):

* token ids (every generated turn has `token_ids`: vLLM `return_token_ids`, the local engine):
  the generated ids are used verbatim. Single turn: the turn's `prompt_token_ids` (what the
  server saw) + its `token_ids`. Several turns: the first turn's prompt ids, then for each later
  turn the template's tokens between the previous turn's end and this turn's generation prompt
  (found by rendering prefixes), then its ids. vLLM ids end with the EOS when
  `finish_reason == "stop"`; the local engine leaves it out, so a "stop" turn whose last id is not
  an end token gets the template's end-of-turn id appended (masked: the target generated it).
* rendered (otherwise): for each generated assistant message at index a,
  `pre = template(messages[:a], add_generation_prompt=True)` and `post = template(messages[:a+1])`;
  `post[len(pre):]` is the turn (content + the template's turn end). Masked: the turn up to and
  including its last end token (an eos id of the tokenizer / model config / generation config);
  the template's tokens after it (SmolLM2: the "\\n" after `<|im_end|>`) are not. When the turn
  stopped on "length", its end token is context (0): the target never produced it.
* reasoning: a template that renders a `reasoning_content` (or `reasoning`) field gets it there;
  otherwise the assistant content becomes `<think>\\n{reasoning}\\n</think>\\n\\n{content}` (DESIGN).
* a template that re-renders earlier turns once later ones follow (e.g. drops their reasoning)
  cannot hold every turn in one sequence: then only the later turn is trainable and the earlier
  ones are context as the template renders them (counted as `turns_demoted_to_context`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import orjson

from . import __version__
from .campaign import Campaign, RunLock, atomic_write_json, fsync_dir, fsync_file, now_iso
from .config import BuildSection, Config
from .errors import ConfigError, InputError, Interrupted
from .target import text_config
from .text import has_think_tags, repeating_tokens, wrap_reasoning

log = logging.getLogger("specops.build")

FORMAT = "specops-build-v1"
# Exclusion reasons, in the order they are checked (a record gets the first that applies).
REASONS = (
    "malformed",  # not a JSON object, no id, or turns that do not point at assistant messages
    "duplicate_id",  # an id seen earlier in the inputs
    "empty_content",  # a generated turn with neither content nor tool_calls
    "stray_think_marker",  # <think> / </think> left in a generated turn's content
    "template_error",  # the chat template cannot render the record
    "too_long",  # longer than max_length under truncation = "drop"
    "no_trainable_tokens",  # nothing masked (after truncation)
    "missing_reasoning",  # reasoning expected (see `reasoning_required`) but empty
    "repetitive",  # under repetition = "drop": more than repetition_max_share of loss tokens repeat
    "duplicate",  # the same rendered conversation as an earlier sample (dedupe)
)


class TemplateError(Exception):
    """The chat template cannot render this record: skip the record, keep the build."""


class MalformedRecord(Exception):
    """The record does not follow the records.jsonl format: skip the record, keep the build."""


# ---------------------------------------------------------------- rendering and masking


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _message_reasoning(msg: dict[str, Any]) -> str:
    r = msg.get("reasoning")
    if not r:
        r = msg.get("reasoning_content")
    return r if isinstance(r, str) else ""


def generated_turns(record: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """(index into messages, turn entry) for each assistant message the target generated."""
    msgs = record.get("messages")
    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
        raise MalformedRecord("messages: expected a list of objects")
    turns = record.get("turns")
    if not turns:  # older records: every assistant message was generated, the last with the record's fields
        idx = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
        if not idx:
            raise MalformedRecord("no assistant message")
        return [(i, {"finish_reason": record.get("finish_reason") if i == idx[-1] else "stop"}) for i in idx]
    out = []
    for t in turns:
        i = t.get("index") if isinstance(t, dict) else None
        if not isinstance(i, int) or not 0 <= i < len(msgs) or msgs[i].get("role") != "assistant":
            raise MalformedRecord(f"turns: index {i!r} is not an assistant message")
        out.append((i, t))
    if [i for i, _ in out] != sorted({i for i, _ in out}):
        raise MalformedRecord("turns: indices are not increasing")
    return out


class _Turn(NamedTuple):
    pre: list[int]  # template(messages[:a], add_generation_prompt=True)
    post: list[int]  # template(messages[:a+1])
    post_text: str
    span: list[int]  # the tail of `post` past `pre`: content + the template's turn end


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]
    source: str  # "token_ids" | "template"
    demoted_turns: int = 0  # generated turns left as context (see the module docstring)


class ChatRenderer:
    """Renders records with one tokenizer's chat template; probes the template once.

    `eos_ids`: the ids that end a generated turn, besides the tokenizer's own eos (pass the model
    config's and generation config's; Gemma-style templates end turns with a token that only the
    generation config lists).
    """

    _PROBE = "specops-reasoning-probe-51c7"

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int] = ()):
        if not getattr(tokenizer, "chat_template", None):
            raise InputError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat template")
        self.tok = tokenizer
        eos = {int(x) for x in eos_ids}
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_ids = frozenset(eos)
        self.reasoning_field = self._probe_reasoning_field()
        self.eot_id = self._probe_eot()
        # A generated turn that ends in one of these has its end token already.
        self.end_ids = self.eos_ids | {self.eot_id} | frozenset(int(x) for x in tokenizer.all_special_ids)

    # -------------------------------------------------------------- template calls
    def encode(self, messages: list[dict[str, Any]], *, generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        """(text, ids) of the template applied to `messages`; ids as apply_chat_template(tokenize=True)."""
        try:
            text = self.tok.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
            )
        except Exception as e:  # jinja errors, template `raise_exception`, None + str, ...
            raise TemplateError(f"{type(e).__name__}: {e}") from e
        if not isinstance(text, str):
            raise TemplateError(f"apply_chat_template returned {type(text).__name__}, expected str")
        return text, list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _probe_reasoning_field(self) -> str | None:
        for name in ("reasoning_content", "reasoning"):
            msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", name: self._PROBE}]
            try:
                text, _ = self.encode(msgs, generation_prompt=False)
            except TemplateError:
                continue
            if self._PROBE in text:
                return name
        return None

    def _probe_eot(self) -> int:
        # The end-of-turn id the template writes after an assistant message (SmolLM2: <|im_end|>).
        user = [{"role": "user", "content": "q"}]
        try:
            _, pre = self.encode(user, generation_prompt=True)
            _, post = self.encode(user + [{"role": "assistant", "content": "a"}], generation_prompt=False)
        except TemplateError:
            pre, post = [], []
        span = post[_common_prefix(pre, post):]
        k = self._last_eos(span)
        if k is not None:
            return span[k]
        if self.tok.eos_token_id is None:
            raise InputError("cannot tell the end-of-turn token: no eos in the template's turn nor the tokenizer")
        return int(self.tok.eos_token_id)

    def _last_eos(self, span: Sequence[int]) -> int | None:
        for k in range(len(span) - 1, -1, -1):
            if span[k] in self.eos_ids:
                return k
        return None

    def prepare(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages as the template gets them: reasoning in the template's field, or wrapped."""
        out = []
        for m in messages:
            m = dict(m)
            if m.get("role") == "assistant":
                r = _message_reasoning(m)
                m.pop("reasoning", None)
                m.pop("reasoning_content", None)
                if r.strip():
                    if self.reasoning_field:
                        m[self.reasoning_field] = r
                    else:
                        m["content"] = wrap_reasoning(r, m.get("content"))
            out.append(m)
        return out

    def _turn(self, msgs: list[dict[str, Any]], a: int, tools: Any) -> _Turn:
        """Render the assistant message at `a` alone after its context (see _Turn)."""
        pre_text, pre = self.encode(msgs[:a], generation_prompt=True, tools=tools)
        post_text, post = self.encode(msgs[: a + 1], generation_prompt=False, tools=tools)
        if not post_text.startswith(pre_text):
            raise TemplateError(f"message {a}: the rendered turn does not extend its generation prompt")
        # Normally post = pre + span; a merge across the boundary starts the span one token early.
        return _Turn(pre, post, post_text, post[_common_prefix(pre, post):])

    # -------------------------------------------------------------- records
    def render(self, record: dict[str, Any]) -> Rendered:
        turns = generated_turns(record)
        msgs = self.prepare(record["messages"])
        tools = record.get("tools")
        if all(isinstance(t.get("token_ids"), list) for _, t in turns):
            return self._render_token_ids(msgs, turns, tools)
        return self._render_template(msgs, turns, tools)

    def _render_template(self, msgs: list[dict[str, Any]], turns: list[tuple[int, dict[str, Any]]],
                         tools: Any) -> Rendered:
        ids: list[int] = []
        mask: list[int] = []
        masked_turns = demoted = 0
        for a, turn in turns:
            pre, post, _, span = self._turn(msgs, a, tools)
            start = len(post) - len(span)
            if pre[: len(ids)] != ids or start < len(ids):
                # The template renders the earlier turns differently now: restart as context.
                demoted += masked_turns
                masked_turns = 0
                ids, mask = [], []
            mask += [0] * (start - len(ids))
            ids = post[:start]
            k = self._last_eos(span)
            n_gen = len(span) if k is None else k + 1  # the template's tokens after the end token: 0
            span_mask = [1] * n_gen + [0] * (len(span) - n_gen)
            if k is not None and turn.get("finish_reason") == "length":
                span_mask[k] = 0  # cut off by max_tokens: the end token is template, not generated
            ids += span
            mask += span_mask
            masked_turns += 1
        return Rendered(ids, mask, "template", demoted)

    def _render_token_ids(self, msgs: list[dict[str, Any]], turns: list[tuple[int, dict[str, Any]]],
                          tools: Any) -> Rendered:
        ids: list[int] = []
        mask: list[int] = []
        masked_turns = demoted = 0
        prev: tuple[str, list[int], bool, list[int], list[int]] | None = None
        for j, (a, turn) in enumerate(turns):
            gen = _int_ids(turn["token_ids"], f"message {a}: token_ids")
            if turn.get("finish_reason") == "stop" and (not gen or gen[-1] not in self.end_ids):
                gen.append(self.eot_id)  # the local engine reports ids without the eos it generated
            ended = bool(gen) and gen[-1] in self.end_ids
            ctx: list[int] | None = None
            if prev is not None:
                p_text, p_ids, p_ended, p_eot, p_tail = prev
                pre_text, pre = self.encode(msgs[:a], generation_prompt=True, tools=tools)
                if pre_text.startswith(p_text) and pre[: len(p_ids)] == p_ids:
                    # previous turn's end token if it was cut off, the template's tokens after it,
                    # then the next user/tool messages and this turn's generation prompt
                    ctx = ([] if p_ended else p_eot) + p_tail + pre[len(p_ids):]
                else:
                    demoted += masked_turns
                    masked_turns = 0
                    ids, mask = [], []
            if ctx is None:
                p = turn.get("prompt_token_ids")
                if isinstance(p, list) and p:
                    ctx = _int_ids(p, f"message {a}: prompt_token_ids")
                else:
                    ctx = self.encode(msgs[:a], generation_prompt=True, tools=tools)[1]
            ids += ctx + gen
            mask += [0] * len(ctx) + [1] * len(gen)
            masked_turns += 1
            if j + 1 < len(turns):
                _, post, post_text, span = self._turn(msgs, a, tools)
                k = self._last_eos(span)
                eot, tail = ([], []) if k is None else ([span[k]], span[k + 1:])
                prev = (post_text, post, ended, eot, tail)
        return Rendered(ids, mask, "token_ids", demoted)


def _int_ids(xs: list[Any], what: str) -> list[int]:
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs):
        raise MalformedRecord(f"{what}: expected non-negative integers")
    return list(xs)


def render_and_mask(tokenizer: Any, record: dict[str, Any], *,
                    eos_ids: Iterable[int] = ()) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one record; see the module docstring for the rule."""
    r = ChatRenderer(tokenizer, eos_ids).render(record)
    return r.input_ids, r.loss_mask


# ---------------------------------------------------------------- record checks


def content_problem(record: dict[str, Any]) -> str | None:
    """The exclusion reason found in the generated turns' text, or None."""
    turns = generated_turns(record)  # validates messages and turns first
    msgs = record["messages"]
    for i, _ in turns:
        m = msgs[i]
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            return "malformed"
        if not (content or "").strip() and not m.get("tool_calls"):
            return "empty_content"
        if has_think_tags(content):
            return "stray_think_marker"
    return None


def lacks_reasoning(record: dict[str, Any]) -> bool:
    """A generated turn has no reasoning (the last turn may carry it on the record instead)."""
    msgs = record["messages"]
    turns = generated_turns(record)
    for n, (i, _) in enumerate(turns):
        r = _message_reasoning(msgs[i])
        if not r and n == len(turns) - 1 and isinstance(record.get("reasoning"), str):
            r = record["reasoning"]
        if not r.strip():
            return True
    return False


def has_reasoning(record: dict[str, Any]) -> bool:
    r = record.get("reasoning")
    if isinstance(r, str) and r.strip():
        return True
    msgs = record.get("messages") or []
    return any(m.get("role") == "assistant" and _message_reasoning(m).strip() for m in msgs if isinstance(m, dict))


# ---------------------------------------------------------------- pure helpers


def content_hash(input_ids: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(input_ids, dtype=np.int32).tobytes()).hexdigest()


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded shuffle of range(n) -> (train, val). At least one val sample when n >= 2 and
    val_fraction > 0; never all of them."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = 0
    if n >= 2 and val_fraction > 0:
        n_val = min(n - 1, max(1, round(val_fraction * n)))
    return order[n_val:], order[:n_val]


def draft_vocab(counts: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [N], t2d bool [V]) for the N = min(size, V) most frequent ids of `counts` [V].

    Ties go to the lower id; ids never seen fill the rest in ascending order (so N is exact).
    The draft ids are the chosen target ids in ascending order: target_id(i) = i + d2t[i].
    """
    counts = np.asarray(counts, dtype=np.int64)
    vocab = counts.shape[0]
    n = min(int(size), vocab)
    order = np.lexsort((np.arange(vocab), -counts))  # by count desc, then id asc
    chosen = np.sort(order[:n])
    d2t = (chosen - np.arange(n)).astype(np.int64)
    t2d = np.zeros(vocab, dtype=bool)
    t2d[chosen] = True
    return d2t, t2d


def length_histogram(lengths: Iterable[int]) -> dict[str, int]:
    """Samples per power-of-2 bucket; key = the bucket's inclusive upper bound (65..128 -> "128")."""
    c: Counter = Counter()
    for n in lengths:
        c[1 << max(0, (int(n) - 1).bit_length())] += 1
    return {str(k): c[k] for k in sorted(c)}


def read_records(path: Path, info: dict[str, Any]) -> Iterator[tuple[int, Any]]:
    """Yield (line number, parsed JSON or None if unparsable) for each complete line.

    Reads the size seen at open (a concurrent append is not half-read). A last line without a
    newline is a torn write: skipped and counted in info["torn_last_line"]. Never modifies the file.
    """
    size = path.stat().st_size
    info.update(bytes=size, lines=0, torn_last_line=False)
    with open(path, "rb") as f:
        rest = b""
        left = size
        lineno = 0
        while left > 0:
            buf = f.read(min(left, 1 << 22))
            if not buf:
                break
            left -= len(buf)
            lines = (rest + buf).split(b"\n")
            rest = lines.pop()
            for line in lines:
                lineno += 1
                if not line.strip():
                    continue
                try:
                    yield lineno, orjson.loads(line)
                except orjson.JSONDecodeError:
                    yield lineno, None
        if rest.strip():
            info["torn_last_line"] = True
    info["lines"] = lineno


# ---------------------------------------------------------------- the phase


@dataclass
class _Sample:
    id: str
    dataset: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    digest: str  # of the untruncated ids
    lacks_reasoning: bool
    save_mode: bool
    source: str  # "token_ids" | "template"
    demoted_turns: int
    truncated: bool  # cut to max_length
    finish_length: bool  # a turn stopped by max_tokens (kept, flagged)
    loss_tokens: int = 0  # before repetition masking
    repeating: int = 0  # loss tokens that repeat an n-gram of their turn (repeating_tokens)


@dataclass
class _DatasetStats:
    read: int = 0
    torn_last_line: bool = False
    with_reasoning: int = 0
    excluded: Counter = field(default_factory=Counter)
    kept: int = 0
    train: int = 0
    val: int = 0
    finish_length: int = 0  # kept samples with a turn stopped by max_tokens (flagged, kept)
    truncated: int = 0  # kept samples cut to max_length
    mask_source: Counter = field(default_factory=Counter)
    turns_demoted_to_context: int = 0
    reasoning_required: bool = False
    loss_tokens: int = 0  # kept samples' loss tokens before repetition masking
    repeating: int = 0  # of those, the ones repeating an n-gram of their turn
    over_max_share: int = 0  # kept samples whose repeating share exceeds repetition_max_share


# A build whose kept loss tokens repeat this much under repetition = "keep" gets a warning.
REPETITION_WARN_SHARE = 0.10


def check_build_section(b: BuildSection) -> None:
    if not 0 <= b.val_fraction < 1:
        raise ConfigError(f"build.val_fraction: must be in [0, 1), got {b.val_fraction}")
    if b.max_length < 1:
        raise ConfigError(f"build.max_length: must be > 0, got {b.max_length}")
    if b.draft_vocab_size < 1:
        raise ConfigError(f"build.draft_vocab_size: must be > 0, got {b.draft_vocab_size}")
    if b.repetition_ngram < 2:
        raise ConfigError(f"build.repetition_ngram: must be >= 2, got {b.repetition_ngram}")
    if not 0 < b.repetition_max_share <= 1:
        raise ConfigError(f"build.repetition_max_share: must be in (0, 1], got {b.repetition_max_share}")


def _target_info(cfg: Config) -> tuple[Path, Path, int, set[int]]:
    """(model dir, tokenizer dir, vocab_size, eos ids) of the target; reads config files only."""
    from .models import resolve_model_dir
    from .target.hf import load_config

    model_dir = resolve_model_dir(cfg.target.model)
    tok_dir = Path(cfg.target.tokenizer) if cfg.target.tokenizer else model_dir
    mcfg = load_config(model_dir, trust_remote_code=cfg.target.trust_remote_code)
    text_cfg = text_config(mcfg)
    vocab = getattr(text_cfg, "vocab_size", None)
    if not vocab:
        raise InputError(f"{model_dir}/config.json: no vocab_size")
    eos: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, int):
            eos.add(v)
        elif isinstance(v, (list, tuple)):
            eos.update(int(x) for x in v)

    add(getattr(text_cfg, "eos_token_id", None))
    add(getattr(mcfg, "eos_token_id", None))
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.is_file():
        add(json.loads(gen_cfg.read_text()).get("eos_token_id"))
    return model_dir, tok_dir, int(vocab), eos


def _dataset_names(cfg: Config, campaign: Campaign) -> list[str]:
    gen = campaign.root / "generate"
    names = [d.name for d in cfg.datasets if (gen / d.name / "records.jsonl").is_file()]
    names += sorted(p.parent.name for p in gen.glob("*/records.jsonl") if p.parent.name not in names)
    return names


def run_build(cfg: Config, campaign: Campaign | None = None, *, lock: bool = True) -> dict[str, Any]:
    """Build `cfg`'s campaign: records -> build/. Returns the manifest (also build/manifest.json).

    `lock=False` when the caller (`specops run`) already holds the campaign lock."""
    check_build_section(cfg.build)
    campaign = campaign or Campaign(cfg.campaign_dir())
    if not (campaign.root / "generate").is_dir():
        raise InputError(f"{campaign.root}: no generate/ directory; run `specops generate` first")
    with RunLock(campaign, "build") if lock else contextlib.nullcontext():
        campaign.set_phase("build", "running", pid=os.getpid())
        tmp = campaign.root / f"build.tmp.{os.getpid()}"
        try:
            manifest = _build(cfg, campaign, tmp)
        except KeyboardInterrupt:
            shutil.rmtree(tmp, ignore_errors=True)
            campaign.set_phase("build", "pending", interrupted_reason="interrupted")
            raise Interrupted("build interrupted; rerun it to build again") from None
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            campaign.set_phase("build", "failed", error=f"{type(e).__name__}: {e}")
            raise
        c = manifest["counts"]
        campaign.set_phase("build", "done", counts={k: c[k] for k in ("read", "kept", "train", "val", "excluded")},
                           archived=manifest.get("archived_previous"))
    return manifest


def _build(cfg: Config, campaign: Campaign, tmp: Path) -> dict[str, Any]:
    from .target.hf import load_tokenizer

    t0 = time.time()
    b = cfg.build
    seed = cfg.campaign.seed if b.seed is None else b.seed
    root = campaign.root
    for stale in root.glob("build.tmp.*"):  # we hold the lock: any other temp dir is a dead build's
        if stale.is_dir():
            shutil.rmtree(stale)
    names = _dataset_names(cfg, campaign)
    if not names:
        raise InputError(f"{root}: no generate/<dataset>/records.jsonl; run `specops generate` first")

    model_dir, tok_dir, vocab_size, eos = _target_info(cfg)
    tokenizer = load_tokenizer(tok_dir, trust_remote_code=cfg.target.trust_remote_code)
    renderer = ChatRenderer(tokenizer, eos)
    template = tokenizer.chat_template
    template_sha = hashlib.sha256(
        (template if isinstance(template, str) else json.dumps(template, sort_keys=True)).encode()
    ).hexdigest()

    tmp.mkdir(parents=True)
    excluded_f = open(tmp / "excluded.jsonl", "wb")
    stats: dict[str, _DatasetStats] = {}
    inputs: list[dict[str, Any]] = []
    kept: list[_Sample] = []
    seen_ids: set[str] = set()
    seen_digests: set[str] = set()

    def exclude(st: _DatasetStats, rid: str, ds: str, reason: str, detail: str | None = None) -> None:
        assert reason in REASONS, reason
        st.excluded[reason] += 1
        row: dict[str, Any] = {"id": rid, "dataset": ds, "reason": reason}
        if detail:
            row["detail"] = detail[:500]
        excluded_f.write(orjson.dumps(row) + b"\n")

    try:
        for ds in names:
            st = stats[ds] = _DatasetStats()
            path = campaign.dataset_dir(ds) / "records.jsonl"
            info: dict[str, Any] = {}
            cands: list[_Sample] = []
            for lineno, rec in read_records(path, info):
                rid = rec.get("id") if isinstance(rec, dict) else None
                if not isinstance(rid, str):
                    st.read += 1
                    exclude(st, f"{ds}/line {lineno}", ds, "malformed", "not a JSON object with a string id")
                    continue
                st.read += 1
                if rid in seen_ids:
                    exclude(st, rid, ds, "duplicate_id")
                    continue
                seen_ids.add(rid)
                try:
                    st.with_reasoning += has_reasoning(rec)
                    reason = content_problem(rec)
                    if reason:
                        exclude(st, rid, ds, reason)
                        continue
                    r = renderer.render(rec)
                    lacks = lacks_reasoning(rec)
                except MalformedRecord as e:
                    exclude(st, rid, ds, "malformed", str(e))
                    continue
                except TemplateError as e:
                    exclude(st, rid, ds, "template_error", str(e))
                    continue
                if r.input_ids and max(r.input_ids) >= vocab_size:
                    raise InputError(
                        f"{rid}: token id {max(r.input_ids)} >= the target's vocab_size {vocab_size}: "
                        f"tokenizer {tok_dir} does not match model {model_dir}"
                    )
                ids = np.asarray(r.input_ids, dtype=np.int32)
                mask = np.asarray(r.loss_mask, dtype=np.uint8)
                digest = content_hash(ids)
                truncated = len(ids) > b.max_length
                if truncated:
                    if b.truncation == "drop":
                        exclude(st, rid, ds, "too_long", f"{len(ids)} tokens > max_length {b.max_length}")
                        continue
                    ids, mask = ids[: b.max_length], mask[: b.max_length]
                if not mask.any():
                    exclude(st, rid, ds, "no_trainable_tokens")
                    continue
                finish_length = any(t.get("finish_reason") == "length" for _, t in generated_turns(rec))
                rep = repeating_tokens(ids, mask, b.repetition_ngram)
                n_loss, n_rep = int(mask.sum()), int(rep.sum())
                if b.repetition == "drop" and n_rep > b.repetition_max_share * n_loss:
                    exclude(st, rid, ds, "repetitive",
                            f"{n_rep} of {n_loss} loss tokens repeat a {b.repetition_ngram}-token window of their turn")
                    continue
                if b.repetition == "mask" and n_rep:
                    mask = np.where(rep, 0, mask).astype(np.uint8)
                cands.append(_Sample(rid, ds, ids, mask, digest, lacks, rec.get("reasoning_mode") == "save",
                                     r.source, r.demoted_turns, truncated, finish_length, n_loss, n_rep))
            st.torn_last_line = info["torn_last_line"]
            inputs.append({"dataset": ds, "path": str(path.relative_to(root)), "bytes": info["bytes"],
                           "lines": info["lines"], "torn_last_line": info["torn_last_line"]})
            if info["torn_last_line"]:
                log.warning("%s: skipped a torn last line (an interrupted write)", path)

            # Reasoning rule, known only once the whole dataset is read.
            if b.require_reasoning is None:
                st.reasoning_required = st.read > 0 and st.with_reasoning >= 0.5 * st.read
            else:
                st.reasoning_required = b.require_reasoning
            for s in cands:
                if st.reasoning_required and s.save_mode and s.lacks_reasoning:
                    exclude(st, s.id, ds, "missing_reasoning")
                elif b.dedupe and s.digest in seen_digests:
                    exclude(st, s.id, ds, "duplicate")
                else:
                    seen_digests.add(s.digest)
                    kept.append(s)
                    st.kept += 1
                    st.mask_source[s.source] += 1
                    st.turns_demoted_to_context += s.demoted_turns
                    st.truncated += s.truncated
                    st.finish_length += s.finish_length
                    st.loss_tokens += s.loss_tokens
                    st.repeating += s.repeating
                    st.over_max_share += s.repeating > b.repetition_max_share * s.loss_tokens
            log.info("build: %s: %d read, %d kept", ds, st.read, st.kept)
        excluded_f.flush()
        os.fsync(excluded_f.fileno())
    finally:
        excluded_f.close()

    train_idx, val_idx = split_indices(len(kept), b.val_fraction, seed)
    splits = {"train": [kept[i] for i in train_idx], "val": [kept[i] for i in val_idx]}
    for name, samples in splits.items():
        for s in samples:
            setattr(stats[s.dataset], name, getattr(stats[s.dataset], name) + 1)

    # Draft vocabulary: loss-masked token counts over the train split.
    counts = {}
    for name, samples in splits.items():
        c = np.zeros(vocab_size, dtype=np.int64)
        for s in samples:  # ids < vocab_size was checked per record
            c += np.bincount(s.input_ids[s.loss_mask.astype(bool)], minlength=vocab_size)
        counts[name] = c
    d2t, t2d = draft_vocab(counts["train"], b.draft_vocab_size)

    def coverage(c: np.ndarray) -> float | None:
        total = int(c.sum())
        return round(100.0 * int(c[t2d].sum()) / total, 4) if total else None

    tokens = {}
    for name, samples in splits.items():
        _write_split(tmp, name, samples)
        tokens[name] = {"samples": len(samples), "tokens": int(sum(len(s.input_ids) for s in samples)),
                        "trainable": int(counts[name].sum())}
    _save_safetensors(tmp / "vocab.safetensors", {"d2t": d2t, "t2d": t2d})

    excluded = Counter()
    for st in stats.values():
        excluded.update(st.excluded)
    loss_tokens = sum(st.loss_tokens for st in stats.values())
    repeating = sum(st.repeating for st in stats.values())
    repetition = {
        "policy": b.repetition, "ngram": b.repetition_ngram, "max_share": b.repetition_max_share,
        "definition": f"a loss token repeats when the {b.repetition_ngram} tokens ending at it occurred earlier "
                      "in the same generated turn (greedy loops); counted over kept samples before masking",
        "loss_tokens": loss_tokens, "repeating_tokens": repeating,
        "share": round(repeating / loss_tokens, 4) if loss_tokens else None,
        "samples_over_max_share": sum(st.over_max_share for st in stats.values()),
        "masked_tokens": repeating if b.repetition == "mask" else 0,
        "dropped_samples": excluded["repetitive"],
    }
    if b.repetition == "keep" and loss_tokens and repeating > REPETITION_WARN_SHARE * loss_tokens:
        log.warning("build: %.0f%% of the kept loss tokens repeat a %d-token window of their own turn (greedy "
                    "loops; %d samples above %.0f%%): training learns to copy them and its val accuracy overstates "
                    "acceptance. Consider build.repetition = \"mask\" or \"drop\", or generating with sampling",
                    100 * repeating / loss_tokens, b.repetition_ngram, repetition["samples_over_max_share"],
                    100 * b.repetition_max_share)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "specops_version": __version__,
        "created": now_iso(),
        "build_seconds": round(time.time() - t0, 2),
        "config": {**dataclasses.asdict(b), "seed": seed},
        "seed": seed,
        "inputs": inputs,
        "generate_phase": ((campaign.read_manifest() or {}).get("phases") or {}).get("generate", {}).get("state"),
        "tokenizer": {
            "dir": str(tok_dir),
            "model_dir": str(model_dir),
            "chat_template_sha256": template_sha,
            "eos_ids": sorted(renderer.eos_ids),
            "end_of_turn_id": renderer.eot_id,
            "reasoning": (f"template field {renderer.reasoning_field!r}" if renderer.reasoning_field
                          else "wrapped in content as <think>\\n{reasoning}\\n</think>\\n\\n{content}"),
        },
        "loss_mask": "1 = tokens the target generated: the assistant content (with reasoning) and its "
                     "end-of-turn token; prompts, system/user/tool turns and template headers are 0",
        "counts": {
            "read": sum(st.read for st in stats.values()),
            "kept": len(kept),
            "train": len(splits["train"]),
            "val": len(splits["val"]),
            "excluded": sum(excluded.values()),
            "duplicates": excluded["duplicate"] + excluded["duplicate_id"],
            "finish_length_kept": sum(st.finish_length for st in stats.values()),
            "truncated": sum(st.truncated for st in stats.values()),
        },
        "exclusions": {r: excluded[r] for r in REASONS},  # every reason, 0 included
        "reasoning_rule": (
            "records with reasoning_mode 'save' and an empty reasoning in a generated turn are excluded "
            + ("always" if b.require_reasoning is True else "never" if b.require_reasoning is False
               else "only in datasets where at least 50% of the records carry reasoning")
        ),
        "datasets": {
            ds: {
                "read": st.read,
                "kept": st.kept,
                "train": st.train,
                "val": st.val,
                "excluded": dict(st.excluded),
                "finish_length_kept": st.finish_length,
                "truncated": st.truncated,
                "repeating_share": round(st.repeating / st.loss_tokens, 4) if st.loss_tokens else None,
                "with_reasoning": st.with_reasoning,
                "reasoning_required": st.reasoning_required,
                "mask_source": dict(st.mask_source),
                "turns_demoted_to_context": st.turns_demoted_to_context,
                "torn_last_line": st.torn_last_line,
            }
            for ds, st in stats.items()
        },
        "tokens": tokens,
        "length_histogram": {
            "bucket": "inclusive upper bound, powers of 2; lengths after truncation",
            "train": length_histogram(len(s.input_ids) for s in splits["train"]),
            "val": length_histogram(len(s.input_ids) for s in splits["val"]),
        },
        "truncation": {"policy": b.truncation, "max_length": b.max_length,
                       "samples_truncated": sum(st.truncated for st in stats.values()),
                       "samples_dropped": excluded["too_long"]},
        "repetition": repetition,
        "draft_vocab": {
            "draft_vocab_size": int(d2t.shape[0]),
            "requested": b.draft_vocab_size,
            "target_vocab_size": vocab_size,
            "distinct_train_tokens": int((counts["train"] > 0).sum()),
            "coverage_train_pct": coverage(counts["train"]),
            "coverage_val_pct": coverage(counts["val"]),
        },
        "files": ["train.safetensors", "train.ids.jsonl", "val.safetensors", "val.ids.jsonl",
                  "vocab.safetensors", "excluded.jsonl", "manifest.json"],
    }
    _publish(root, tmp, manifest)
    return manifest


def _save_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata={"format": FORMAT})
    fsync_file(path)


def _write_split(out: Path, name: str, samples: list[_Sample]) -> None:
    """<name>.safetensors (input_ids int32 [N], loss_mask uint8 [N], offsets int64 [S+1]) and
    <name>.ids.jsonl (one line per sample, same order)."""
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s.input_ids) for s in samples], dtype=np.int64)
    if samples:
        input_ids = np.concatenate([s.input_ids for s in samples]).astype(np.int32, copy=False)
        loss_mask = np.concatenate([s.loss_mask for s in samples]).astype(np.uint8, copy=False)
    else:
        input_ids, loss_mask = np.zeros(0, np.int32), np.zeros(0, np.uint8)
    _save_safetensors(out / f"{name}.safetensors",
                      {"input_ids": input_ids, "loss_mask": loss_mask, "offsets": offsets})
    path = out / f"{name}.ids.jsonl"
    with open(path, "wb") as f:
        for s in samples:
            f.write(orjson.dumps({"id": s.id, "dataset": s.dataset, "n_tokens": int(len(s.input_ids)),
                                  "n_trainable": int(s.loss_mask.sum())}) + b"\n")
        f.flush()
        os.fsync(f.fileno())


def _publish(root: Path, tmp: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest into `tmp`, archive an existing build/ and rename `tmp` to build/.

    Each step is one rename: a crash leaves either the old build/ or the new one (or, between
    the two renames, none, with the old one archived and the new one complete in `tmp`).
    """
    final = root / "build"
    archive = None
    if final.exists():
        stamp = time.strftime("%Y%m%dT%H%M%S")
        archive = root / f"build.old.{stamp}"
        n = 1
        while archive.exists():
            archive = root / f"build.old.{stamp}.{n}"
            n += 1
    manifest["archived_previous"] = archive.name if archive else None
    atomic_write_json(tmp / "manifest.json", manifest)
    fsync_dir(tmp)
    if archive is not None:
        os.rename(final, archive)
    os.rename(tmp, final)
    fsync_dir(root)
