"""The batched tau loop (evaluate/batched.py, eval.batch_size > 1) against the batch-1 loop.

On CPU in fp32: every row's tokens and per-step acceptance equal the batch-1 loop's
(specdec.speculative_generate on the static runners) for prompts of many lengths, more prompts than
rows (rows refilled), an eos mid-turn, second turns admitted on the same row, caches grown mid-run;
the row-wise acceptance rule equals specdec.accept at T = 0 and emits tokens distributed as the
target at T > 0; through run_eval on MT-bench (both turns) the rows equal a batch-1 run's.
"""

from __future__ import annotations

import json

import pytest
import torch

from specops.config import config_from_dict
from specops.errors import ConfigError
from specops.evaluate.batched import BatchedLoop, accept_rows, run_batched
from specops.drafter.families.eagle3.drafting import StaticDrafterRunner
from specops.evaluate.fast_target import StaticTargetRunner
from specops.evaluate.loop import accept, speculative_generate

from builders import chat_target_and_drafter, debug_drafter, greedy_reference, load, make_target, rand_ids

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

VOCAB = 16  # small: a random drafter gets drafts accepted now and then (draft vocab 8)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    target = load(make_target(tmp_path_factory.mktemp("small") / "t", vocab=VOCAB, sharp=6.0, seed=3))
    return target, debug_drafter(VOCAB, seed=1)


def batch1(target, d, prompt, *, k, n, eos=frozenset()):
    return speculative_generate(StaticTargetRunner(target, d.config.aux_layer_ids), d, prompt, k=k, max_new_tokens=n,
                                eos_ids=eos, drafter_runner=StaticDrafterRunner(d))


def drive(loop, convs):
    """run_batched over conversations given as lists of prompts (each later prompt = the earlier
    prompt + that turn's tokens + the listed ids) -> per conversation, its turns' (tokens, accepted)."""
    got = {i: [] for i in range(len(convs))}

    class C:
        def __init__(self, i):
            self.i, self.turn, self.prompt = i, 0, list(convs[i][0])

    def on_turn(c, t):
        got[c.i].append((t.prompt_tokens, list(t.generated), list(t.accepted)))
        c.turn += 1
        if c.turn == len(convs[c.i]):
            return None
        c.prompt = c.prompt + t.generated + list(convs[c.i][c.turn])
        return c.prompt

    figures = run_batched(loop, (C(i) for i in range(len(convs))), lambda c: c.prompt, on_turn)
    return got, figures


@pytest.mark.parametrize("k", [1, 3])
def test_batched_greedy_equals_batch1(small, k):
    target, d = small
    lengths = [1, 5, 9, 13, 40, 3, 22]  # 40 > 32: the long-prompt prefill path
    convs = [[rand_ids(VOCAB, n, seed=n)] for n in lengths]
    convs[1].append([3, 4])  # second turns, admitted on the same row after a step
    convs[4].append([7])
    loop = BatchedLoop(target, d, rows=3, k=k, max_new_tokens=18, temperature=0.0,
                       eos_ids=frozenset(), gen=None, min_capacity=8)
    got, figures = drive(loop, convs)
    assert loop.tr.capacity >= 64  # grown mid-run, every row kept
    n_acc = 0
    for i, conv in enumerate(convs):
        prompt = list(conv[0])
        assert len(got[i]) == len(conv)
        for turn, (n_prompt, toks, acc) in enumerate(got[i]):
            ref = batch1(target, d, prompt, k=k, n=18)
            assert n_prompt == len(prompt)
            assert toks[:18] == ref.tokens == greedy_reference(target.model, prompt, 18), (i, turn)
            assert acc == ref.accepted, (i, turn)
            n_acc += sum(acc)
            if turn + 1 < len(conv):
                prompt = prompt + toks + list(conv[turn + 1])
    assert n_acc > 0, "no draft accepted anywhere: the comparison would not cover acceptance"
    assert figures["turns"] == sum(len(c) for c in convs) and figures["rows"] == 3


def test_batched_eos_ends_a_turn_like_batch1(small):
    target, d = small
    prompts = [rand_ids(VOCAB, n, seed=40 + n) for n in (4, 7, 11)]
    eos = frozenset({greedy_reference(target.model, prompts[0], 9)[6]})
    loop = BatchedLoop(target, d, rows=2, k=3, max_new_tokens=24, temperature=0.0, eos_ids=eos, gen=None)
    got, _ = drive(loop, [[p] for p in prompts])
    for i, p in enumerate(prompts):
        ref = batch1(target, d, p, k=3, n=24, eos=eos)
        toks, acc = got[i][0][1], got[i][0][2]
        assert acc == ref.accepted
        from specops.evaluate.loop import finish_tokens as _finish

        assert _finish(toks, 24, eos)[0] == ref.tokens
    assert len(got[0][0][1]) < 24  # the eos ended the first turn early


def test_accept_rows_greedy_matches_accept():
    g = torch.Generator().manual_seed(0)
    B, k, V = 12, 4, 10
    logits = torch.randn(B, k + 1, V, generator=g)
    best = logits.argmax(-1)
    drafts = torch.randint(0, V, (B, k), generator=g)
    for b in range(B):  # matching prefixes of every length 0..k
        n = b % (k + 1)
        drafts[b, :n] = best[b, :n]
    a, nxt = accept_rows(drafts, logits, None, None, temperature=0.0, gen=None)
    for b in range(B):
        ra, rn = accept(drafts[b], logits[b], None, None, temperature=0.0, gen=None)
        assert (int(a[b]), int(nxt[b])) == (ra, int(rn))
    assert sorted(set(a.tolist())) == list(range(k + 1))


def test_accept_rows_sampling_emits_the_target_distribution():
    """Speculative sampling, row-wise: over many rows with the same p and q, the first emitted token
    (d_1 if accepted, else the residual sample) and the second (given two emitted) follow p."""
    g = torch.Generator().manual_seed(1)
    B, k, V, Vd = 60000, 2, 6, 4
    d2t = torch.tensor([0, 1, 2, 2])  # draft ids -> target ids 0, 2, 4, 5
    logits = (torch.randn(k + 1, V, generator=g) * 1.5).expand(B, k + 1, V).contiguous()
    q = torch.softmax(torch.randn(k, Vd, generator=g) * 1.5, -1)
    draws = torch.stack([torch.multinomial(q[j], B, replacement=True, generator=g) for j in range(k)], 1)  # [B, k]
    drafts = draws + d2t[draws]
    # the target's row 1 is conditioned on d_1: give it the same distribution whatever d_1 is
    a, nxt = accept_rows(drafts, logits, q.expand(B, k, Vd), d2t, temperature=1.0, gen=torch.Generator().manual_seed(2))
    p = torch.softmax(logits[0], -1)
    first = torch.where(a >= 1, drafts[:, 0], nxt)
    freq = torch.bincount(first, minlength=V).double() / B
    sigma = (p[0].double() * (1 - p[0].double()) / B).sqrt()
    assert ((freq - p[0].double()).abs() <= 5 * sigma + 1e-4).all(), (freq, p[0])
    second = torch.where(a >= 2, drafts[:, 1], nxt)[a >= 1]
    freq2 = torch.bincount(second, minlength=V).double() / second.numel()
    sigma2 = (p[1].double() * (1 - p[1].double()) / second.numel()).sqrt()
    assert ((freq2 - p[1].double()).abs() <= 5 * sigma2 + 1e-4).all(), (freq2, p[1])
    assert 0 < float((a == 0).double().mean()) < 1 and bool((a == k).any())


def test_batched_sampling_is_reproducible_and_valid(small):
    target, d = small
    convs = [[rand_ids(VOCAB, n, seed=70 + n)] for n in (3, 8, 12, 5)]

    def go():
        loop = BatchedLoop(target, d, rows=3, k=3, max_new_tokens=15, temperature=1.0, eos_ids=frozenset(),
                           gen=torch.Generator().manual_seed(9))
        return drive(loop, convs)[0]

    a, b = go(), go()
    assert a == b
    for turns in a.values():
        (_, toks, acc), = turns
        assert len(toks) >= 15 and all(0 <= t < VOCAB for t in toks)
        assert sum(x + 1 for x in acc) == len(toks) - 1  # the prefill's token + a + 1 per step


def test_config_batch_size():
    base = {"datasets": [{"name": "a", "source": "spec_bench"}]}
    assert config_from_dict(base).eval.batch_size == 1
    ok = config_from_dict({**base, "eval": {"batch_size": 64, "baseline": False}})
    assert ok.eval.batch_size == 64
    for ev, msg in (({"batch_size": 8}, "set eval.baseline = false"),
                    ({"batch_size": 8, "baseline": False, "workers": 2}, "set eval.workers = 1"),
                    ({"batch_size": 8, "baseline": False, "target_runner": "hf"}, "must be 'auto' or 'static'"),
                    ({"batch_size": 0}, "must be >= 1"), ({"batch_size": 2.5}, "expected an integer")):
        with pytest.raises(ConfigError, match=msg):
            config_from_dict({**base, "eval": ev})


def test_run_eval_batched_rows_equal_batch1(tmp_path):
    """MT-bench's two turns (turn 2 sees the model's own turn 1) through run_eval: batch_size 2 gives
    the rows, tokens and acceptance of batch_size 1, and says why there is no speedup."""
    from specops.campaign import Campaign
    from specops.config import load_config
    from specops.evaluate.batched import BATCHED_NA
    from specops.evaluate.specdec import run_eval

    model, export = chat_target_and_drafter(tmp_path)
    rows = {}
    for bs in (1, 2):
        toml = tmp_path / f"c{bs}.toml"
        toml.write_text(f"""
[campaign]
name = "c{bs}"
dir = "{tmp_path / f'camp{bs}'}"
[target]
model = "{model}"
[[datasets]]
name = "g"
source = "gsm8k"
limit = 2
[eval]
datasets = ["mtbench"]
limit_per_dataset = 3
k = 3
max_new_tokens = 7
device = "cpu"
target_runner = "static"
baseline = false
batch_size = {bs}
""")
        cfg = load_config(toml)
        summary = run_eval(cfg, Campaign.create_or_open(cfg), drafter_dir=export)
        rows[bs] = json.loads((tmp_path / f"camp{bs}" / "eval" / "mtbench.json").read_text())["rows"]
        assert summary["overall"]["turns"] == 6
    key = lambda r: (r["id"], r["turn"], r["prompt_tokens"], r["spec"]["tokens"], r["spec"]["accepted"], r["answer"])  # noqa: E731
    assert [key(r) for r in rows[1]] == [key(r) for r in rows[2]]
    assert summary["speedup_unavailable"] == BATCHED_NA and summary["batch_size"] == 2
    assert summary["target_runner"] == "batched" and summary["batched"]["turns"] == 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_on_cuda_equals_the_graphed_batch1_loop(tmp_path):
    """fp32 on CUDA: the batched loop's rows (index_put writes, per-row masks) equal the batch-1 loop
    on the CUDA-graph runners, token for token and step for step."""
    target = load(make_target(tmp_path / "t", vocab=VOCAB, sharp=6.0, seed=3), "cuda")
    d = debug_drafter(VOCAB, seed=1).cuda()
    convs = [[rand_ids(VOCAB, n, seed=n)] for n in (1, 5, 9, 40, 13, 300)]
    loop = BatchedLoop(target, d, rows=4, k=3, max_new_tokens=40, temperature=0.0, eos_ids=frozenset(), gen=None)
    got, _ = drive(loop, convs)
    st, sd = StaticTargetRunner(target, d.config.aux_layer_ids), StaticDrafterRunner(d)
    assert st.use_graphs and sd.use_graphs
    for i, conv in enumerate(convs):
        ref = speculative_generate(st, d, conv[0], k=3, max_new_tokens=40, drafter_runner=sd)
        assert got[i][0][1][:40] == ref.tokens and got[i][0][2] == ref.accepted, i


def test_cli_override_sets_a_tau_only_batch():
    from specops.evaluate.specdec import with_workers

    cfg = config_from_dict({"datasets": [{"name": "a", "source": "spec_bench"}], "eval": {"workers": 4}})
    assert cfg.eval.baseline and cfg.eval.workers == 4
    b = with_workers(cfg, None, 32)
    assert (b.eval.batch_size, b.eval.baseline, b.eval.workers) == (32, False, 1)
    assert with_workers(cfg, None, None) is cfg and with_workers(cfg, 2).eval.workers == 2
    with pytest.raises(ConfigError, match="set eval.workers = 1"):
        with_workers(cfg, 3, 32).eval  # noqa: B018 - an explicit --workers 3 with a batch is refused
