"""build: loss masks on the real SmolLM2 template, the draft vocabulary, and the build/ directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from specops import build as B
from specops.build import ChatRenderer, draft_vocab, length_histogram, render_and_mask, run_build, split_indices
from specops.campaign import Campaign
from specops.config import config_from_dict
from specops.errors import ConfigError

IM_START, IM_END, NL = 1, 2, 198
# "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n",
# the system turn SmolLM2's template adds when the conversation has none.
DEFAULT_SYSTEM = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                  19712, 8182, 2, 198]
USER_HI_THERE = [1, 4093, 198, 26843, 665, 2, 198]  # "<|im_start|>user\nHi there<|im_end|>\n"
ASSISTANT_HEADER = [1, 520, 9531, 198]  # "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from specops.models import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2")))


@pytest.fixture(scope="module")
def renderer(tok):
    return ChatRenderer(tok, [IM_END])


def record(messages, turns=None, **kw):
    """A record as the runner writes it; `turns` defaults to every assistant message, template path."""
    if turns is None:
        turns = [{"index": i, "finish_reason": "stop", "token_ids": None, "prompt_token_ids": None}
                 for i, m in enumerate(messages) if m["role"] == "assistant"]
    last = messages[turns[-1]["index"]]
    r = {"id": kw.pop("id", "ds/0"), "dataset": "ds", "messages": messages, "content": last.get("content"),
         "reasoning": last.get("reasoning"), "finish_reason": turns[-1]["finish_reason"],
         "usage": {"prompt_tokens": 10, "completion_tokens": 5}, "latency_s": 0.1, "endpoint": "local",
         "model": "smollm2", "reasoning_mode": "off", "sampling": {}, "turns": turns, "attempts": 1,
         "finished_unix": 1.0}
    r.update(kw)
    return r


def runs(ids, mask, value=1):
    """Contiguous runs of tokens whose mask == value, as lists of ids."""
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m == value:
            cur.append(i)
        elif cur:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def encode(tok, messages, gen):
    out = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True, return_dict=False)
    return list(out)


# ---------------------------------------------------------------- masks on the real template


def test_single_turn_token_by_token(tok, renderer):
    rec = record([{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}])
    ids, mask = render_and_mask(tok, rec)
    # "Hello" "!" <|im_end|> are generated; the "\n" the template writes after <|im_end|> is not.
    assert ids == DEFAULT_SYSTEM + USER_HI_THERE + ASSISTANT_HEADER + [19556, 17, IM_END, NL]
    assert mask == [0] * (len(ids) - 4) + [1, 1, 1, 0]
    assert ids == encode(tok, rec["messages"], gen=False)  # the sequence is exactly the template's rendering
    r = renderer.render(rec)
    assert (r.source, r.demoted_turns) == ("template", 0)


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_reasoning_is_wrapped_in_think_and_masked(tok, renderer, field):
    msgs = [{"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "\n\nHello!", field: "\nThe user greets me.\n"}]
    rec = record(msgs)
    r = renderer.render(rec)
    assert renderer.reasoning_field is None  # SmolLM2's template has no reasoning field
    masked = [i for i, m in zip(r.input_ids, r.loss_mask) if m]
    assert tok.decode(masked) == "<think>\nThe user greets me.\n</think>\n\nHello!<|im_end|>"
    assert runs(r.input_ids, r.loss_mask) == [masked]  # one contiguous span
    # everything unmasked is template: the prompt with its generation header, then the trailing "\n"
    prompt = encode(tok, msgs[:1], gen=True)
    assert r.input_ids[: len(prompt)] == prompt
    assert r.loss_mask[: len(prompt)] == [0] * len(prompt)
    assert r.input_ids[len(prompt) + len(masked):] == [NL]
    assert r.loss_mask[-1] == 0


def test_multi_turn_masks_both_assistant_spans(tok, renderer):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue.", "reasoning": "Any colour works."}]
    r = renderer.render(record(msgs))
    spans = [tok.decode(s) for s in runs(r.input_ids, r.loss_mask)]
    assert spans == ["Hello!<|im_end|>", "<think>\nAny colour works.\n</think>\n\nBlue.<|im_end|>"]
    context = [tok.decode(s) for s in runs(r.input_ids, r.loss_mask, 0)]
    assert context == [
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n",
        "\n",
    ]
    prepared = renderer.prepare(msgs)
    assert r.input_ids == encode(tok, prepared, gen=False)


def test_only_generated_turns_are_masked_and_length_end_is_context(tok, renderer):
    # turns="last": the first assistant message came from the dataset, only message 3 was generated,
    # and it was cut by max_tokens, so its <|im_end|> is the template's, not the target's.
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Original answer."},
            {"role": "user", "content": "Go on"}, {"role": "assistant", "content": "Going on and"}]
    turns = [{"index": 3, "finish_reason": "length", "token_ids": None, "prompt_token_ids": None}]
    r = renderer.render(record(msgs, turns))
    assert [tok.decode(s) for s in runs(r.input_ids, r.loss_mask)] == ["Going on and"]
    assert r.input_ids[-2:] == [IM_END, NL] and r.loss_mask[-2:] == [0, 0]


def test_token_ids_are_used_verbatim(tok, renderer):
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    prompt = encode(tok, msgs[:1], gen=True)
    # as vLLM returns them: the generated ids, ending with the EOS on "stop"
    gen = tok("Hello!", add_special_tokens=False)["input_ids"] + [IM_END]
    turns = [{"index": 1, "finish_reason": "stop", "token_ids": gen, "prompt_token_ids": prompt}]
    ids, mask = render_and_mask(tok, record(msgs, turns))
    assert ids == prompt + gen
    assert [i for i, m in zip(ids, mask) if m] == gen
    assert mask == [0] * len(prompt) + [1] * len(gen)

    # A tokenization the template would never produce ("H" + "ello!") proves nothing is re-tokenized.
    odd = [tok.convert_tokens_to_ids("H")] + tok("ello!", add_special_tokens=False)["input_ids"] + [IM_END]
    assert tok.decode(odd) == "Hello!<|im_end|>"
    turns[0]["token_ids"] = odd
    ids, mask = render_and_mask(tok, record(msgs, turns))
    assert [i for i, m in zip(ids, mask) if m] == odd
    assert renderer.render(record(msgs, turns)).source == "token_ids"


def test_token_ids_without_eos_get_the_end_of_turn(tok):
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    prompt = encode(tok, msgs[:1], gen=True)
    gen = tok("Hello!", add_special_tokens=False)["input_ids"]
    # the local engine reports "stop" ids without the eos it generated
    stop = [{"index": 1, "finish_reason": "stop", "token_ids": gen, "prompt_token_ids": prompt}]
    ids, mask = render_and_mask(tok, record(msgs, stop))
    assert ids == prompt + gen + [IM_END] and sum(mask) == len(gen) + 1
    # "length": the target never produced an end token; none is invented
    cut = [{"index": 1, "finish_reason": "length", "token_ids": gen, "prompt_token_ids": prompt}]
    ids, mask = render_and_mask(tok, record(msgs, cut))
    assert ids == prompt + gen and [i for i, m in zip(ids, mask) if m] == gen


def test_multi_turn_token_ids_are_spliced_into_the_template(tok):
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ciao."}]
    g1 = tok("Hello!", add_special_tokens=False)["input_ids"] + [IM_END]
    g2 = tok("Ciao.", add_special_tokens=False)["input_ids"] + [IM_END]
    turns = [{"index": 1, "finish_reason": "stop", "token_ids": g1, "prompt_token_ids": encode(tok, msgs[:1], True)},
             {"index": 3, "finish_reason": "stop", "token_ids": g2, "prompt_token_ids": encode(tok, msgs[:3], True)}]
    ids, mask = render_and_mask(tok, record(msgs, turns))
    assert runs(ids, mask) == [g1, g2]
    # with canonical ids the splice is exactly the template's rendering, minus its final "\n"
    assert ids == encode(tok, msgs, gen=False)[:-1]

    # turn 1 cut by max_tokens: its <|im_end|> comes from the template, unmasked
    g1_cut = tok("Hello", add_special_tokens=False)["input_ids"]
    turns[0].update(finish_reason="length", token_ids=g1_cut)
    ids, mask = render_and_mask(tok, record(msgs, turns))
    assert runs(ids, mask) == [g1_cut, g2]
    i = ids.index(g1_cut[-1])
    assert ids[i + 1: i + 3] == [IM_END, NL] and mask[i + 1: i + 3] == [0, 0]


# A Qwen3-like template: renders `reasoning_content`, but only for the last assistant message.
FIELD_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m.role + '\n' }}"
    "{%- if m.role == 'assistant' and m.reasoning_content and loop.last -%}"
    "{{ '<think>\n' + m.reasoning_content + '\n</think>\n\n' }}"
    "{%- endif -%}"
    "{{ m.content + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def test_template_reasoning_field_and_earlier_turns_demoted(tok):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok.name_or_path)
    t.chat_template = FIELD_TEMPLATE
    r = ChatRenderer(t, [IM_END])
    assert r.reasoning_field == "reasoning_content"
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning": "R1"},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ciao.", "reasoning": "R2"}]
    out = r.render(record(msgs))
    # Turn 1 renders with its reasoning only while it is the last message: it cannot be trained in
    # place, so it is context (as the template renders it with a later turn) and turn 2 is trained.
    assert out.demoted_turns == 1
    assert [t.decode(s) for s in runs(out.input_ids, out.loss_mask)] == ["<think>\nR2\n</think>\n\nCiao.<|im_end|>"]
    assert t.decode(out.input_ids) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nR2\n</think>\n\nCiao.<|im_end|>\n"
    )


def test_bad_token_ids_are_malformed(renderer):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    turns = [{"index": 1, "finish_reason": "stop", "token_ids": ["Hello"], "prompt_token_ids": [1, 2]}]
    with pytest.raises(B.MalformedRecord, match="token_ids"):
        renderer.render(record(msgs, turns))


def test_template_failure_is_a_template_error(tok, renderer):
    msgs = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                  "function": {"name": "f", "arguments": "{}"}}]}]
    with pytest.raises(B.TemplateError):  # SmolLM2's template concatenates content as a string
        renderer.render(record(msgs))


def test_content_checks():
    ok = record([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    assert B.content_problem(ok) is None
    empty = record([{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}])
    assert B.content_problem(empty) == "empty_content"
    tools = record([{"role": "user", "content": "q"},
                    {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}])
    assert B.content_problem(tools) is None
    stray = record([{"role": "user", "content": "q"}, {"role": "assistant", "content": "x</think> y"}])
    assert B.content_problem(stray) == "stray_think_marker"
    with pytest.raises(B.MalformedRecord):
        B.content_problem({"id": "ds/1", "content": "a"})  # no messages
    with pytest.raises(B.MalformedRecord):  # a turn that points at a user message
        B.content_problem(record([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                                 [{"index": 0, "finish_reason": "stop"}]))
    assert B.lacks_reasoning(ok) and not B.lacks_reasoning(
        record([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"}]))


# ---------------------------------------------------------------- draft vocabulary and helpers


def test_draft_vocab_properties():
    rng = np.random.default_rng(0)
    vocab, n = 1000, 100
    counts = np.zeros(vocab, dtype=np.int64)
    counts[rng.choice(vocab, 400, replace=False)] = rng.integers(1, 1000, 400)
    counts[[7, 500, 999]] = [5000, 6000, 7000]  # the most frequent
    d2t, t2d = draft_vocab(counts, n)
    assert d2t.dtype == np.int64 and d2t.shape == (n,)
    assert t2d.dtype == np.bool_ and t2d.shape == (vocab,) and int(t2d.sum()) == n
    target = np.arange(n) + d2t
    assert ((target >= 0) & (target < vocab)).all() and t2d[target].all()
    assert (np.diff(target) > 0).all()  # ascending by target id
    assert (np.flatnonzero(t2d) - np.arange(n) == d2t).all()  # t2d's positions round-trip to d2t
    assert t2d[[7, 500, 999]].all()
    # exactly the top n by count (ties to the lower id)
    top = sorted(range(vocab), key=lambda i: (-counts[i], i))[:n]
    assert sorted(top) == target.tolist()


def test_draft_vocab_ties_fill_and_cap():
    counts = np.zeros(20, dtype=np.int64)
    counts[[3, 9, 12]] = [4, 4, 9]
    d2t, t2d = draft_vocab(counts, 2)  # 12 first, then the 3-vs-9 tie goes to 3
    assert (np.arange(2) + d2t).tolist() == [3, 12]
    d2t, t2d = draft_vocab(counts, 5)  # only 3 seen: filled with the lowest unused ids 0, 1
    assert (np.arange(5) + d2t).tolist() == [0, 1, 3, 9, 12]
    d2t, t2d = draft_vocab(counts, 32000)  # capped by the target vocab
    assert d2t.shape == (20,) and (d2t == 0).all() and t2d.all()


def test_split_and_histogram():
    assert split_indices(1, 0.02, 0) == ([0], [])
    tr, va = split_indices(2, 0.02, 0)
    assert len(va) == 1 and sorted(tr + va) == [0, 1]
    tr, va = split_indices(100, 0.1, 5)
    assert len(va) == 10 and sorted(tr + va) == list(range(100))
    assert split_indices(100, 0.1, 5) == (tr, va) and split_indices(100, 0.1, 6) != (tr, va)
    assert split_indices(10, 0.0, 1)[1] == []
    assert length_histogram([1, 2, 3, 4, 5, 64, 65, 128]) == {"1": 1, "2": 1, "4": 2, "8": 1, "64": 1, "128": 2}


# ---------------------------------------------------------------- end to end


def _line(obj) -> str:
    return json.dumps(obj) + "\n"


def _qa(rid, user, answer, **kw):
    return record([{"role": "user", "content": user}, {"role": "assistant", "content": answer}], id=rid, **kw)


LONG_ANSWER = " ".join(f"word{i}" for i in range(60))
LONG_PROMPT = " ".join(f"topic{i}" for i in range(60))


def _write_campaign(tmp_path: Path, tok, *, truncation="truncate", seed=7, **build):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    cfg = config_from_dict({
        "campaign": {"dir": str(tmp_path / "camp"), "seed": 1},
        "datasets": [{"name": "alpha", "path": str(prompts)}, {"name": "beta", "path": str(prompts)}],
        "build": {"val_fraction": 0.25, "max_length": 64, "truncation": truncation, "draft_vocab_size": 50,
                  "seed": seed, **build},
    })
    camp = Campaign.create_or_open(cfg)
    prompt = encode(tok, [{"role": "user", "content": "Say hi"}], gen=True)
    gen = tok("Hi!", add_special_tokens=False)["input_ids"] + [IM_END]
    token_rec = record([{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi!"}],
                       [{"index": 1, "finish_reason": "stop", "token_ids": gen, "prompt_token_ids": prompt}],
                       id="alpha/a7", reasoning_mode="save")
    alpha = [
        _qa("alpha/a1", "What is 2+2?", "4.", reasoning_mode="save"),
        _qa("alpha/a2", "What is 2+2?", "4.", reasoning_mode="save"),  # duplicate of a1
        _qa("alpha/a3", "Say nothing", "", reasoning_mode="save"),  # empty content
        _qa("alpha/a4", "Think aloud", "<think>hmm</think> 5", reasoning_mode="save"),  # stray marker
        _qa("alpha/a5", "Count", "1 2 3 4", reasoning_mode="save",
            turns=[{"index": 1, "finish_reason": "length", "token_ids": None, "prompt_token_ids": None}]),
        _qa("alpha/a6", "Ramble", LONG_ANSWER, reasoning_mode="save"),  # over max_length
        token_rec,
        # the only alpha record with reasoning: 1 of 9 is under half, so alpha does not require it
        record([{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because.", "reasoning": "Hm."}],
               id="alpha/a9", reasoning_mode="save"),
    ]
    alpha_text = "".join(_line(r) for r in alpha[:3]) + "this is not json\n" + "".join(_line(r) for r in alpha[3:])
    alpha_text += '{"id": "alpha/a8", "dataset": "alp'  # torn last line
    beta = [
        _qa("beta/b1", "What is 2+2?", "4."),  # the same conversation as alpha/a1
        *(record([{"role": "user", "content": f"Capital of {country}?"},
                  {"role": "assistant", "content": city, "reasoning": why}], id=rid, reasoning_mode="save")
          for rid, country, city, why in (("beta/b2", "France", "Paris.", "Easy."),
                                          ("beta/b3", "Italy", "Rome.", "Known."),
                                          ("beta/b4", "Spain", "Madrid.", "Sure."))),
        _qa("beta/b5", "Capital of Peru?", "Lima.", reasoning_mode="save"),  # no reasoning, 3 of 6 have it
        _qa("beta/b6", LONG_PROMPT, "Ok.", reasoning_mode="save"),  # the prompt alone exceeds max_length
    ]
    for name, text in (("alpha", alpha_text), ("beta", "".join(_line(r) for r in beta))):
        d = camp.dataset_dir(name)
        d.mkdir(parents=True)
        (d / "records.jsonl").write_text(text)
    return cfg, camp, {r["id"]: r for r in alpha + beta}


def _read_split(build_dir: Path, name: str):
    t = load_file(str(build_dir / f"{name}.safetensors"))
    rows = [json.loads(line) for line in (build_dir / f"{name}.ids.jsonl").read_text().splitlines()]
    return t, rows


@pytest.mark.parametrize("truncation", ["truncate", "drop"])
def test_end_to_end(tmp_path, tok, truncation):
    cfg, camp, recs = _write_campaign(tmp_path, tok, truncation=truncation)
    m = run_build(cfg)
    out = camp.root / "build"
    assert sorted(p.name for p in out.iterdir()) == sorted(m["files"])
    assert json.loads((out / "manifest.json").read_text()) == m

    exp_excl = {"malformed": 1, "duplicate": 2, "empty_content": 1, "stray_think_marker": 1, "missing_reasoning": 1}
    if truncation == "truncate":
        exp_excl["no_trainable_tokens"] = 1  # b6: the first 64 tokens are all prompt
        kept = {"alpha/a1", "alpha/a5", "alpha/a6", "alpha/a7", "alpha/a9", "beta/b2", "beta/b3", "beta/b4"}
    else:
        exp_excl["too_long"] = 2  # a6 and b6
        kept = {"alpha/a1", "alpha/a5", "alpha/a7", "alpha/a9", "beta/b2", "beta/b3", "beta/b4"}
    assert {k: v for k, v in m["exclusions"].items() if v} == exp_excl and set(m["exclusions"]) == set(B.REASONS)
    c = m["counts"]
    assert (c["read"], c["kept"], c["excluded"]) == (15, len(kept), 15 - len(kept))
    assert c["val"] == max(1, round(0.25 * len(kept))) and c["train"] + c["val"] == len(kept)
    assert c["finish_length_kept"] == 1 and c["truncated"] == (1 if truncation == "truncate" else 0)
    assert m["truncation"]["policy"] == truncation
    da, db = m["datasets"]["alpha"], m["datasets"]["beta"]
    assert da["torn_last_line"] and m["inputs"][0]["torn_last_line"] and not db["torn_last_line"]
    assert m["inputs"][0]["bytes"] == (camp.dataset_dir("alpha") / "records.jsonl").stat().st_size
    assert not da["reasoning_required"] and db["reasoning_required"]  # alpha: 1 of 9 has reasoning; beta: 3 of 6
    assert (da["with_reasoning"], db["with_reasoning"]) == (1, 3)
    assert da["mask_source"]["token_ids"] == 1
    assert db["excluded"]["duplicate"] == 1 and da["excluded"]["duplicate"] == 1

    excluded = [json.loads(x) for x in (out / "excluded.jsonl").read_text().splitlines()]
    by_id = {e["id"]: e["reason"] for e in excluded}
    assert by_id["alpha/a2"] == by_id["beta/b1"] == "duplicate"
    assert by_id["alpha/a3"] == "empty_content" and by_id["alpha/a4"] == "stray_think_marker"
    assert by_id["beta/b5"] == "missing_reasoning" and by_id["alpha/line 4"] == "malformed"
    assert "alpha/a8" not in by_id  # a torn line is not a record

    seen = set()
    trainable = {}
    for name in ("train", "val"):
        t, rows = _read_split(out, name)
        ids, mask, off = t["input_ids"], t["loss_mask"], t["offsets"]
        assert (ids.dtype, mask.dtype, off.dtype) == (np.int32, np.uint8, np.int64)
        assert off.shape == (len(rows) + 1,) and off[0] == 0 and off[-1] == ids.shape[0] == mask.shape[0]
        assert (np.diff(off) == [r["n_tokens"] for r in rows]).all()
        assert m["tokens"][name] == {"samples": len(rows), "tokens": int(ids.shape[0]), "trainable": int(mask.sum())}
        for i, r in enumerate(rows):
            seg_ids, seg_mask = ids[off[i]:off[i + 1]], mask[off[i]:off[i + 1]]
            assert int(seg_mask.sum()) == r["n_trainable"] > 0 and r["n_tokens"] <= 64
            want_ids, want_mask = render_and_mask(tok, recs[r["id"]], eos_ids=[IM_END])
            assert seg_ids.tolist() == want_ids[:64] and seg_mask.tolist() == want_mask[:64]
            assert r["dataset"] == r["id"].split("/")[0]
            trainable[r["id"]] = seg_ids[seg_mask.astype(bool)]
        seen |= {r["id"] for r in rows}
        assert len(rows) == m["counts"][name]
    assert seen == kept

    vocab = load_file(str(out / "vocab.safetensors"))
    d2t, t2d = vocab["d2t"], vocab["t2d"]
    assert d2t.shape == (50,) and t2d.shape == (49152,) and int(t2d.sum()) == 50
    assert m["draft_vocab"]["draft_vocab_size"] == 50 and m["draft_vocab"]["target_vocab_size"] == 49152
    _, train_rows = _read_split(out, "train")
    train_tokens = np.concatenate([trainable[r["id"]] for r in train_rows])
    assert m["draft_vocab"]["coverage_train_pct"] == pytest.approx(100 * t2d[train_tokens].mean(), abs=1e-3)
    assert t2d[IM_END]  # every train sample ends a turn with it
    assert camp.read_manifest()["phases"]["build"]["state"] == "done"
    assert sum(m["length_histogram"]["train"].values()) == c["train"]


def test_rebuild_is_deterministic_and_archives_the_old_build(tmp_path, tok):
    cfg, camp, _ = _write_campaign(tmp_path, tok)
    stale = camp.root / "build.tmp.999999999"  # left by a build that was killed
    stale.mkdir()
    (stale / "train.safetensors").write_bytes(b"torn")
    m1 = run_build(cfg)
    assert not stale.exists() and m1["archived_previous"] is None
    first = {p.name: p.read_bytes() for p in (camp.root / "build").iterdir()}
    m2 = run_build(cfg)
    old = camp.root / m2["archived_previous"]
    assert old.name.startswith("build.old.") and {p.name: p.read_bytes() for p in old.iterdir()} == first
    new = camp.root / "build"
    for f in ("train.ids.jsonl", "val.ids.jsonl", "train.safetensors", "val.safetensors", "vocab.safetensors"):
        assert (new / f).read_bytes() == first[f]  # same records and seed: the same split, byte for byte

    cfg.build.seed = 8
    m3 = run_build(cfg)
    assert (new / "train.ids.jsonl").read_bytes() != first["train.ids.jsonl"]
    assert m3["counts"]["train"] == m1["counts"]["train"]
    assert len(list(camp.root.glob("build.old.*"))) == 2
    assert not list(camp.root.glob("build.tmp.*"))


def test_failed_build_leaves_the_previous_build_whole(tmp_path, tok, monkeypatch):
    cfg, camp, _ = _write_campaign(tmp_path, tok)
    run_build(cfg)
    before = {p.name: p.read_bytes() for p in (camp.root / "build").iterdir()}
    calls = []

    def fail_on_val(out, name, samples):
        calls.append(name)
        if name == "val":
            raise OSError("disk full")
        return real(out, name, samples)

    real = B._write_split
    monkeypatch.setattr(B, "_write_split", fail_on_val)
    with pytest.raises(OSError, match="disk full"):
        run_build(cfg)
    assert calls == ["train", "val"]
    assert {p.name: p.read_bytes() for p in (camp.root / "build").iterdir()} == before
    assert not list(camp.root.glob("build.tmp.*")) and not list(camp.root.glob("build.old.*"))
    phase = camp.read_manifest()["phases"]["build"]
    assert phase["state"] == "failed" and "disk full" in phase["error"]


@pytest.mark.parametrize("require", [False, True])
def test_require_reasoning_overrides(tmp_path, tok, require):
    cfg, camp, _ = _write_campaign(tmp_path, tok, require_reasoning=require)
    m = run_build(cfg)
    excluded = {json.loads(x)["id"] for x in (camp.root / "build" / "excluded.jsonl").read_text().splitlines()
                if json.loads(x)["reason"] == "missing_reasoning"}
    if require:
        # every surviving "save" record without reasoning; beta/b1 ("off") is then no longer a
        # duplicate, because alpha/a1 was excluded before it could claim the conversation
        assert excluded == {"alpha/a1", "alpha/a2", "alpha/a5", "alpha/a6", "alpha/a7", "beta/b5"}
        assert m["exclusions"]["duplicate"] == 0
    else:
        assert excluded == set() and m["exclusions"]["duplicate"] == 2
    assert m["datasets"]["alpha"]["reasoning_required"] is require
    assert m["datasets"]["beta"]["reasoning_required"] is require


def test_bad_build_config(tmp_path, tok):
    cfg, _, _ = _write_campaign(tmp_path, tok, val_fraction=1.0)
    with pytest.raises(ConfigError, match="build.val_fraction"):
        run_build(cfg)
    with pytest.raises(ConfigError, match="build.truncation"):
        config_from_dict({"datasets": [{"name": "a", "source": "gsm8k"}], "build": {"truncation": "cut"}})


def test_no_records_is_an_input_error(tmp_path):
    from specops.errors import InputError

    cfg = config_from_dict({"campaign": {"dir": str(tmp_path / "c")}, "datasets": [{"name": "a", "source": "gsm8k"}]})
    Campaign.create_or_open(cfg)
    with pytest.raises(InputError, match="generate"):
        run_build(cfg)
    assert os.path.isdir(tmp_path / "c")


# ---------------------------------------------------------------- greedy loops


def test_repeating_tokens_marks_later_copies_within_a_turn_only():
    from specops.text import repeating_tokens

    ids = np.array([9, 1, 2, 3, 1, 2, 3, 1, 2, 8, 1, 2, 3, 1], dtype=np.int32)
    mask = np.array([0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1], dtype=np.uint8)
    got = repeating_tokens(ids, mask, 3)
    # turn 1 (1..8): windows ending at 6, 7, 8 ((1,2,3), (2,3,1), (3,1,2)) were seen at 3, 4, 5;
    # turn 2 (10..13) starts afresh: its (1,2,3) at 12 is its first; (2,3,1) at 13 too
    assert np.flatnonzero(got).tolist() == [6, 7, 8]
    assert not repeating_tokens(ids, np.zeros_like(mask), 3).any()  # prompts are never counted
    assert repeating_tokens(ids, mask, 20).sum() == 0  # a window longer than any turn


def _loop_campaign(tmp_path: Path, tok, **build):
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    cfg = config_from_dict({
        "campaign": {"dir": str(tmp_path / "camp"), "seed": 1},
        "datasets": [{"name": "d", "path": str(prompts)}],
        "build": {"val_fraction": 0.0, "max_length": 256, "draft_vocab_size": 50, "repetition_ngram": 4, **build},
    })
    camp = Campaign.create_or_open(cfg)
    recs = [_qa("d/loop", "Count", "one two three " * 12 + "done."),
            _qa("d/plain", "Name a fruit", "A pear, ripe and sweet, picked this morning."),
            _qa("d/tail", "List", "red green blue cyan " + "stop now " * 2)]
    d = camp.dataset_dir("d")
    d.mkdir(parents=True)
    (d / "records.jsonl").write_text("".join(_line(r) for r in recs))
    return cfg, camp, {r["id"]: r for r in recs}


@pytest.mark.parametrize("policy", ["keep", "mask", "drop"])
def test_build_counts_masks_or_drops_greedy_loops(tmp_path, tok, policy, caplog):
    """A looping answer: counted in the manifest under every policy (a warning under keep); mask sets
    its later copies' loss_mask to 0 and keeps the ids; drop excludes it with reason "repetitive"."""
    from specops.text import repeating_tokens

    cfg, camp, recs = _loop_campaign(tmp_path, tok, repetition=policy)
    with caplog.at_level("WARNING", logger="specops.build"):
        m = run_build(cfg)
    rendered = {rid: render_and_mask(tok, r, eos_ids=[IM_END]) for rid, r in recs.items()}
    rep = {rid: repeating_tokens(np.array(i, dtype=np.int32), np.array(k, dtype=np.uint8), 4)
           for rid, (i, k) in rendered.items()}
    assert rep["d/loop"].sum() > 0.5 * sum(rendered["d/loop"][1]) and rep["d/plain"].sum() == 0
    r = m["repetition"]
    assert (r["policy"], r["ngram"], r["max_share"]) == (policy, 4, 0.3)
    kept = ["d/plain", "d/tail"] + ([] if policy == "drop" else ["d/loop"])
    assert r["loss_tokens"] == sum(sum(rendered[k][1]) for k in kept)
    assert r["repeating_tokens"] == sum(int(rep[k].sum()) for k in kept)
    assert r["samples_over_max_share"] == (0 if policy == "drop" else 1)
    assert r["dropped_samples"] == m["exclusions"]["repetitive"] == (1 if policy == "drop" else 0)
    assert ("repeat a 4-token window" in caplog.text) == (policy == "keep")
    t, rows = _read_split(camp.root / "build", "train")
    by_id = {row["id"]: i for i, row in enumerate(rows)}
    assert set(by_id) == set(kept)
    off = t["offsets"]
    for rid in kept:
        i = by_id[rid]
        ids, mask = t["input_ids"][off[i]:off[i + 1]], t["loss_mask"][off[i]:off[i + 1]]
        want_ids, want_mask = rendered[rid]
        assert ids.tolist() == want_ids  # the text is never changed
        want = np.array(want_mask, dtype=np.uint8)
        if policy == "mask":
            want[rep[rid]] = 0
        assert mask.tolist() == want.tolist()
    if policy == "mask":
        assert r["masked_tokens"] == r["repeating_tokens"] > 0
        assert m["tokens"]["train"]["trainable"] == r["loss_tokens"] - r["masked_tokens"]
    if policy == "drop":
        row = [json.loads(x) for x in (camp.root / "build" / "excluded.jsonl").read_text().splitlines()]
        assert row == [{"id": "d/loop", "dataset": "d", "reason": "repetitive",
                        "detail": f"{int(rep['d/loop'].sum())} of {sum(rendered['d/loop'][1])} loss tokens "
                                  "repeat a 4-token window of their turn"}]


def test_bad_repetition_settings_are_config_errors(tmp_path, tok):
    for i, (bad, match) in enumerate((({"repetition_ngram": 1}, "build.repetition_ngram"),
                                      ({"repetition_max_share": 0.0}, "build.repetition_max_share"),
                                      ({"repetition_max_share": 1.5}, "build.repetition_max_share"))):
        cfg, _, _ = _loop_campaign(tmp_path / f"c{i}", tok, **bad)
        with pytest.raises(ConfigError, match=match):
            run_build(cfg)
    with pytest.raises(ConfigError, match="build.repetition"):
        config_from_dict({"datasets": [{"name": "a", "source": "gsm8k"}], "build": {"repetition": "trim"}})


def test_build_line_reports_coverage_and_repetition(tmp_path, tok):
    from specops.cli import _build_line

    cfg, _, _ = _loop_campaign(tmp_path, tok, repetition="mask")
    m = run_build(cfg)
    line = _build_line(m)
    assert line.startswith("build done: read 3, kept 3")
    assert f"draft-vocab coverage {m['draft_vocab']['coverage_train_pct']:.1f}%" in line
    assert f"loss tokens repeating a 4-gram of their turn {100 * m['repetition']['share']:.1f}% (mask)" in line
