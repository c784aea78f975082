"""The static-cache target runner (evaluate/fast_target.py) against the HF one (specdec.TargetRunner).

Numerics: logits and aux states of prefill, one-token decode and (k+1)-token verify at any cache
length, after rollbacks, through cache growth, for Llama / Qwen3 (q/k norms) / Mistral with a
sliding window shorter than the sequence. Behaviour: at T = 0 the speculative loop on the static
runner emits the target's greedy decoding (a cache-free recompute), token for token the HF
runner's results. Selection (eval.target_runner), the CUDA-graph guards (exercised on CPU through
test doubles) and the eval summary. One test runs the bundled SmolLM2; one (gpu) runs CUDA graphs.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from specops.drafter.model import DrafterConfig, Eagle3Drafter
from specops.errors import ConfigError, SpecopsError
from specops.evaluate.fast_target import StaticTargetRunner, make_target_runner, runner_info
from specops.evaluate.loop import TargetRunner, speculative_generate, target_generate

from builders import AUX, HIDDEN, chat_target_and_drafter, debug_drafter, greedy_reference, load, make_target, rand_ids



pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _assert_same(a: tuple, b: tuple, what: str, tol: float = 1e-4) -> None:
    (la, xa), (lb, xb) = a, b
    assert la.dtype == lb.dtype == torch.float32 and la.shape == lb.shape, (what, la.shape, lb.shape)
    torch.testing.assert_close(la, lb, rtol=tol, atol=tol, msg=lambda m: f"{what} logits: {m}")
    if xb is None:
        assert xa is None, what
    else:
        assert xa.dtype == xb.dtype and xa.shape == xb.shape, (what, xa.shape, xb.shape)
        torch.testing.assert_close(xa, xb, rtol=tol, atol=tol, msg=lambda m: f"{what} aux: {m}")


def compare_runners(hf, st, vocab: int, n_prompt: int, seed: int = 0, tol: float = 1e-4) -> None:
    """The same call sequence on both runners (prefill, decode, verifies at offsets, rollbacks)."""
    ids = torch.tensor([rand_ids(vocab, n_prompt + 40, seed)])
    ch, cs = hf.new_cache(), st.new_cache(n_prompt + 24)
    both = lambda x, start, **kw: (hf.forward(x, ch, start, **kw), st.forward(x, cs, start, **kw))  # noqa: E731
    assert_same = lambda a, b, what: _assert_same(a, b, what, tol)  # noqa: E731
    n = n_prompt
    assert_same(*both(ids[:, :n], 0, aux=True, last_only=True), "prefill")
    assert cs.get_seq_length() == ch.get_seq_length() == n
    assert_same(*both(ids[:, n:n + 1], n, aux=False), "decode")
    assert_same(*both(ids[:, n + 1:n + 5], n + 1, aux=True), "verify k=3")
    for r in (hf, st):  # reject the last three: positions n+2..n+4 rolled back
        r.crop(ch if r is hf else cs, n + 2)
    assert cs.get_seq_length() == n + 2
    assert_same(*both(ids[:, n + 10:n + 15], n + 2, aux=True), "verify after a rollback")
    for r in (hf, st):  # deep into the prompt
        r.crop(ch if r is hf else cs, n - 3)
    assert_same(*both(ids[:, 7:15], n - 3, aux=True), "verify k=7 after a deep rollback")
    assert_same(*both(ids[:, 20:21], n + 5, aux=True), "decode with aux")
    assert_same(*both(ids[:, 21:24], n + 6, aux=False, last_only=True), "last_only")
    for r in (hf, st):
        r.crop(ch if r is hf else cs, 4)
    assert_same(*both(ids[:, :36], 4, aux=True), "a long chunk at start > 0 (the unfolded, masked path)")


# ---------------------------------------------------------------- numerics


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_target(tmp_path_factory.mktemp("tiny") / "target")
    target = load(path)
    return {"path": path, "target": target, "hf": TargetRunner(target, AUX)}


@pytest.fixture(scope="module")
def arch_targets(tmp_path_factory):
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = load(make_target(tmp_path_factory.mktemp(arch) / "t", arch, layers=4, seed=5))
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral-sliding"])
@pytest.mark.parametrize("n_prompt", [5, 45])  # 45 > the folded-GQA limit: the prefill's other attention path
def test_static_runner_matches_hf_runner(arch_targets, arch, n_prompt):
    target = arch_targets(arch)
    aux = [0, 2, 4]  # the embedding output, a middle layer's input and the final norm's input (L = 4)
    hf, st = TargetRunner(target, aux), StaticTargetRunner(target, aux)
    assert not st.use_graphs  # CPU: the static cache without graphs
    compare_runners(hf, st, 96, n_prompt, seed=n_prompt)


def test_cache_grows_and_keeps_its_contents(tiny):
    """A cache smaller than the generation: reallocated twice mid-way, same numerics and tokens."""
    target, hf = tiny["target"], tiny["hf"]
    st = StaticTargetRunner(target, AUX, min_capacity=16)
    cs = st.new_cache()
    assert st.capacity == 16
    ids = torch.tensor([rand_ids(96, 60, 9)])
    ch = hf.new_cache()
    _assert_same(hf.forward(ids[:, :10], ch, 0, aux=True), st.forward(ids[:, :10], cs, 0, aux=True), "prefill")
    for s in range(10, 60, 5):  # 12 -> 32 -> 64 positions
        _assert_same(hf.forward(ids[:, s:s + 5], ch, s, aux=True), st.forward(ids[:, s:s + 5], cs, s, aux=True),
                    f"verify at {s}")
    assert st.capacity == 64 and cs.get_seq_length() == 60
    prompt = rand_ids(96, 7, 2)
    st2 = StaticTargetRunner(target, AUX, min_capacity=8)
    assert target_generate(st2, prompt, max_new_tokens=40).tokens == greedy_reference(target.model, prompt, 40)


def test_cache_misuse_is_refused(tiny):
    st = StaticTargetRunner(tiny["target"], AUX)
    old = st.new_cache(32)
    st.forward(torch.tensor([[1, 2, 3]]), old, 0, aux=False)
    with pytest.raises(SpecopsError, match="start 5 != the cache's length 3"):
        st.forward(torch.tensor([[4]]), old, 5, aux=False)
    with pytest.raises(AssertionError, match="crop to 4 of a cache holding 3"):
        st.crop(old, 4)
    st.new_cache(32)  # one live cache per runner: the old handle now points at reused memory
    with pytest.raises(SpecopsError, match="no longer live"):
        st.forward(torch.tensor([[4]]), old, 3, aux=False)


# ---------------------------------------------------------------- the loop at T = 0


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_spec_on_static_runner_is_the_target_greedy_decoding(tiny, k):
    target, hf = tiny["target"], tiny["hf"]
    st = StaticTargetRunner(target, AUX)
    d = debug_drafter(96)
    ps = [rand_ids(96, n, seed=n) for n in (1, 6, 11)]
    for p in ps:
        ref = greedy_reference(target.model, p, 30)
        spec_s = speculative_generate(st, d, p, k=k, max_new_tokens=30)
        base_s = target_generate(st, p, max_new_tokens=30)
        spec_h = speculative_generate(hf, d, p, k=k, max_new_tokens=30)
        assert base_s.tokens == ref and spec_s.tokens == ref, (k, p)
        assert spec_s.tokens == spec_h.tokens and spec_s.accepted == spec_h.accepted  # same aux -> same drafts


def test_oracle_drafts_are_accepted_on_the_static_runner(tiny):
    """Drafts that are the target's own continuation: every draft accepted (aux and rollbacks line up
    in a loop that accepts everything, and in one that accepts a drafter trained for nothing)."""
    from specops.drafter.model import DraftOut

    target = tiny["target"]
    p = rand_ids(96, 5, 1)
    seq = p + greedy_reference(target.model, p, 40)

    class Oracle(Eagle3Drafter):
        def forward(self, input_ids, hidden, positions, *, attn_mask=None, past_kv=None, return_logits=True):
            B, T = input_ids.shape
            h = torch.zeros(B, T, self.config.hidden_size)
            for t, pos in enumerate(positions[0].tolist()):
                h[0, t, 0] = seq[pos + 2] if pos + 2 < len(seq) else 0
            kv = torch.zeros(B, self.config.num_key_value_heads, T, self.config.head_dim)
            return DraftOut(h, self.compute_logits(h) if return_logits else None, (kv, kv))

        def compute_logits(self, hidden):
            return torch.nn.functional.one_hot(hidden[..., 0].long(), self.config.draft_vocab_size).float() * 50

    d = Oracle(DrafterConfig.debug(target_vocab_size=96, draft_vocab_size=96, aux_layer_ids=AUX,
                                   target_hidden_size=HIDDEN, target_num_hidden_layers=8)).eval()
    r = speculative_generate(StaticTargetRunner(target, AUX), d, p, k=4, max_new_tokens=26)
    assert r.tokens == seq[5:31] and r.accepted == [4] * 5


# ---------------------------------------------------------------- selection, config, summary


def test_selection(tiny, tmp_path):
    target = tiny["target"]
    assert isinstance(make_target_runner(target, AUX, "auto"), TargetRunner)  # CPU: hf
    assert isinstance(make_target_runner(target, AUX, "hf"), TargetRunner)
    st = make_target_runner(target, AUX, "static")
    assert isinstance(st, StaticTargetRunner) and not st.use_graphs
    assert runner_info(st) == {"target_runner": "static", "cuda_graphs": False}
    assert runner_info(make_target_runner(target, AUX, "hf")) == {"target_runner": "hf", "cuda_graphs": False}
    with pytest.raises(ConfigError, match="eval.target_runner: expected one of"):
        make_target_runner(target, AUX, "fast")
    gemma = load(make_target(tmp_path / "gemma", "gemma", layers=8))
    with pytest.raises(ConfigError, match="eval.target_runner = 'static'.*model_type 'gemma'"):
        make_target_runner(gemma, AUX, "static")
    with pytest.raises(ConfigError, match="model_type 'gemma'"):
        StaticTargetRunner(gemma, AUX)
    assert isinstance(make_target_runner(gemma, AUX, "auto"), TargetRunner)


def test_config_field():
    from specops.config import config_from_dict

    base = {"datasets": [{"name": "a", "source": "spec_bench"}]}
    assert config_from_dict(base).eval.target_runner == "auto"
    assert config_from_dict({**base, "eval": {"target_runner": "static"}}).eval.target_runner == "static"
    with pytest.raises(ConfigError, match="eval.target_runner: expected one of 'auto', 'hf', 'static', got 'fast'"):
        config_from_dict({**base, "eval": {"target_runner": "fast"}})


def test_run_eval_static_runner_recorded_and_lossless(tmp_path):
    from specops.campaign import Campaign
    from specops.config import load_config
    from specops.evaluate.specdec import run_eval

    model, export = chat_target_and_drafter(tmp_path)
    toml = tmp_path / "c.toml"
    toml.write_text(f"""
[campaign]
name = "c"
dir = "{tmp_path / 'camp'}"
[target]
model = "{model}"
[[datasets]]
name = "g"
source = "gsm8k"
limit = 2
[eval]
datasets = ["humaneval"]
limit_per_dataset = 2
k = 3
max_new_tokens = 6
device = "cpu"
target_runner = "static"
""")
    cfg = load_config(toml)
    summary = run_eval(cfg, Campaign.create_or_open(cfg), drafter_dir=export)
    assert summary["target_runner"] == "static" and summary["cuda_graphs"] is False
    assert summary["overall"]["identical_to_baseline"] == 1.0 and summary["overall"]["turns"] == 2


# ---------------------------------------------------------------- CUDA-graph guards (test doubles on CPU)


def graphed_runner(target, monkeypatch, capture):
    st = StaticTargetRunner(target, AUX)
    st.use_graphs = True  # force the graph path on CPU; `_capture` is the double
    monkeypatch.setattr(st, "_capture", capture)
    return st


def test_a_failing_capture_falls_back_to_eager_with_a_warning(tiny, monkeypatch, caplog):
    def boom(*a, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")

    st = graphed_runner(tiny["target"], monkeypatch, boom)
    p = rand_ids(96, 6, 3)
    with caplog.at_level(logging.WARNING, logger="specops.eval"):
        r = target_generate(st, p, max_new_tokens=12)
    assert r.tokens == greedy_reference(tiny["target"].model, p, 12)
    assert not st.use_graphs and st.graph_fallbacks == 1
    assert "CUDA graph capture failed" in caplog.text and "stream is capturing" in caplog.text
    assert runner_info(st)["cuda_graphs"] is False


def test_a_replay_that_differs_from_eager_is_caught(tiny, monkeypatch, caplog):
    """A graph whose replay produces something else (here: nothing, stale zeros) is never used."""

    class Dud:
        def replay(self):
            """Leaves the static outputs as they were: a replay that computed nothing."""

    def dud(T, kv_len, aux):
        st._in_buffers(T)  # the static inputs exist, as after a real capture
        return Dud(), torch.zeros(T, 96), (torch.zeros(T, 3, HIDDEN) if aux else None)

    st = graphed_runner(tiny["target"], monkeypatch, dud)
    d = debug_drafter(96)
    p = rand_ids(96, 9, 4)
    with caplog.at_level(logging.WARNING, logger="specops.eval"):
        r = speculative_generate(st, d, p, k=3, max_new_tokens=16)
    assert r.tokens == greedy_reference(tiny["target"].model, p, 16)
    assert not st.use_graphs and "differs from the eager forward" in caplog.text


# ---------------------------------------------------------------- the real SmolLM2


def smollm2_ids(tok, q: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_smollm2_static_runner(capsys):
    from tiny_targets import smollm2_random_drafter

    md, tok, d = smollm2_random_drafter()
    target = load(md)
    aux = d.config.aux_layer_ids + [target.num_hidden_layers]
    compare_runners(TargetRunner(target, aux), StaticTargetRunner(target, aux), target.vocab_size, 30)
    hf, st = TargetRunner(target, d.config.aux_layer_ids), StaticTargetRunner(target, d.config.aux_layer_ids)
    ids = smollm2_ids(tok, "What is the capital of France?")
    spec = speculative_generate(st, d, ids, k=3, max_new_tokens=24)
    base = target_generate(hf, ids, max_new_tokens=24)
    assert spec.tokens == base.tokens == target_generate(st, ids, max_new_tokens=24).tokens
    times = {}
    for name, r in (("hf", hf), ("static", st)):
        target_generate(r, ids, max_new_tokens=8)
        t0 = time.perf_counter()
        target_generate(r, ids, max_new_tokens=64)
        times[name] = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\nSmolLM2 CPU target_generate 64 tokens: hf {times['hf']:.2f} s, static {times['static']:.2f} s")


# ---------------------------------------------------------------- CUDA graphs (the lent H200)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_match_eager_and_greedy_is_lossless(tmp_path):
    """fp32 tiny Llama on CUDA: the graphed runner equals the eager static runner and the HF runner
    (logits, aux, tokens), captures T = 1 and T = k+1 graphs in two KV buckets (256, 512) and again
    after the cache grows, and the speculative loop at T = 0 emits the target's greedy decoding."""
    target = load(make_target(tmp_path / "t"), "cuda")
    hf = TargetRunner(target, AUX)
    eager = StaticTargetRunner(target, AUX, cuda_graphs=False)
    graphed = StaticTargetRunner(target, AUX)
    assert graphed.use_graphs and not eager.use_graphs
    compare_runners(hf, graphed, 96, 40, tol=2e-3)  # CUDA fp32 kernels differ in summation order
    compare_runners(eager, graphed, 96, 7, seed=1, tol=2e-3)
    d = debug_drafter(96).cuda()
    k = 3
    for n, new in ((5, 40), (200, 120)):  # the second crosses the 256 -> 512 KV bucket
        p = rand_ids(96, n, n)
        ref = greedy_reference(target.model, p, new)
        spec_g = speculative_generate(graphed, d, p, k=k, max_new_tokens=new)
        spec_e = speculative_generate(eager, d, p, k=k, max_new_tokens=new)
        base_g = target_generate(graphed, p, max_new_tokens=new)
        assert base_g.tokens == ref and spec_g.tokens == ref, n
        assert spec_e.tokens == ref and spec_e.accepted == spec_g.accepted, n
    assert graphed.use_graphs and graphed.graph_fallbacks == 0
    keys = set(graphed._graphs)
    assert {(1, 256, False), (1, 512, False), (k + 1, 256, True), (k + 1, 512, True)} <= keys, keys
    # A longer prompt grows the cache (512 -> 1024): every graph is dropped with its pool and the
    # next captures go to a fresh pool (reusing the old handle tripped the allocator's assert).
    assert graphed.capacity == 512
    p = rand_ids(96, 600, 7)
    ref = greedy_reference(target.model, p, 40)
    assert speculative_generate(graphed, d, p, k=k, max_new_tokens=40).tokens == ref
    assert target_generate(graphed, p, max_new_tokens=40).tokens == ref
    assert graphed.capacity == 1024 and graphed.graph_fallbacks == 0 and graphed.use_graphs
    assert {(1, 1024, False), (k + 1, 1024, True)} <= set(graphed._graphs), set(graphed._graphs)
    assert runner_info(graphed) == {"target_runner": "static", "cuda_graphs": True}
    assert isinstance(make_target_runner(target, AUX, "auto"), StaticTargetRunner)  # auto on CUDA: static
    # bf16: every graph passes its first-replay check (no fallback to eager)
    from specops.target.inprocess import load_target

    bf = StaticTargetRunner(load_target(tmp_path / "t", "bfloat16", "cuda"), AUX)
    p = rand_ids(96, 30, 1)
    speculative_generate(bf, debug_drafter(96).cuda().bfloat16(), p, k=k, max_new_tokens=40)
    target_generate(bf, p, max_new_tokens=40)
    assert bf.use_graphs and bf.graph_fallbacks == 0 and {(1, 256, False), (k + 1, 256, True)} <= set(bf._graphs)
