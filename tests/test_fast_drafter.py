"""The EAGLE-3 static-cache drafter runner (drafter/families/eagle3/drafting.py) against the eager one.

On CPU in fp32: the same drafts (and at T > 0 the same samples and distributions) over a sequence
of rounds with every pending length 1..k+1, after the cache grows, through the speculative loop
end to end (greedy output = the target's greedy decoding, same acceptance), plus selection and
config. On the lent GPU (gpu): the chain replayed as CUDA graphs equals the eager chain.
"""

from __future__ import annotations

import pytest
import torch

from specops.config import EvalSection
from specops.errors import ConfigError, SpecopsError
from specops.drafter.families.eagle3.drafting import EagerDrafterRunner, StaticDrafterRunner, make_drafter_runner
from specops.drafter.families import EAGLE3, family_of
from specops.evaluate.fast_target import StaticTargetRunner
from specops.evaluate.loop import speculative_generate

from builders import AUX, HIDDEN, debug_drafter, greedy_reference, load, make_target, rand_ids

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _rounds(drafter, runners, *, k: int, temperature: float, n_prompt: int = 9, seed: int = 0):
    """Drive every runner through the same prefill and draft calls: each round a pending length m
    in 1..k+1 (as acceptance would give) with fresh random aux. Returns the drafts (and q) per runner."""
    g = torch.Generator().manual_seed(seed)
    V, Ht = drafter.config.target_vocab_size, drafter.config.target_hidden_size
    ids = torch.randint(0, V, (1, n_prompt + 1), generator=g)  # prefill: slots 0..n_prompt-1
    prompt_aux = torch.randn(1, n_prompt + 1, 3, Ht, generator=g)
    out = {id(r): [] for r in runners}
    for r in runners:
        r.reset(n_prompt + 4 * (k + 1) + k + 1)
        r.prefill(ids, prompt_aux)
    start = n_prompt
    for rnd, m in enumerate([1, k + 1, 2, 1, k, 3][: 6]):
        m = min(m, k + 1)
        tok = torch.randint(0, V, (1, m), generator=g)
        aux = torch.randn(1, m, 3, Ht, generator=g)
        for r in runners:
            gen = torch.Generator().manual_seed(100 + rnd) if temperature > 0 else None
            drafts, q = r.draft(tok, aux, start, k, temperature=temperature, gen=gen)
            out[id(r)].append((drafts, q))
            assert len(r) == start + m
        start += m
    return [out[id(r)] for r in runners]


@pytest.mark.parametrize("k", [1, 3, 7])
def test_static_chain_equals_eager_greedy(k):
    d = debug_drafter(96)
    eager, static = EagerDrafterRunner(d), StaticDrafterRunner(d)
    a, b = _rounds(d, [eager, static], k=k, temperature=0.0)
    for (da, qa), (db, qb) in zip(a, b):
        assert qa is None and qb is None
        assert da.tolist() == db.tolist()
        assert da.dtype == torch.int64 and da.shape == (k,)


def test_static_chain_equals_eager_sampling():
    d = debug_drafter(96, seed=2)
    eager, static = EagerDrafterRunner(d), StaticDrafterRunner(d)
    a, b = _rounds(d, [eager, static], k=4, temperature=1.0, seed=5)
    for (da, qa), (db, qb) in zip(a, b):
        assert da.tolist() == db.tolist()
        torch.testing.assert_close(qa, qb, rtol=1e-5, atol=1e-6)
        assert qa.shape == (4, d.config.draft_vocab_size)


def test_cache_growth_keeps_the_prefix():
    """A runner whose buffer starts at 8 positions grows (several times) mid-sequence and still
    drafts as the eager one."""
    d = debug_drafter(96, seed=1)
    eager, small = EagerDrafterRunner(d), StaticDrafterRunner(d, min_capacity=8)
    small._ensure_capacity(8)
    a, b = _rounds(d, [eager, small], k=5, temperature=0.0, n_prompt=6)
    assert [x[0].tolist() for x in a] == [x[0].tolist() for x in b]
    assert small.capacity >= 32


def test_static_runner_refuses_a_wrong_start():
    d = debug_drafter(96)
    r = StaticDrafterRunner(d)
    r.reset(64)
    r.prefill(torch.tensor([[0, 1, 2, 3]]), torch.randn(1, 4, 3, HIDDEN))  # slots 0..2
    with pytest.raises(SpecopsError, match="start 5 != the cache's length 3"):
        r.draft(torch.tensor([[4]]), torch.randn(1, 1, 3, HIDDEN), 5, 2, temperature=0.0, gen=None)


class _WrongGraph:
    def replay(self):
        """Writes nothing into the static outputs: what a stale or broken capture replays."""


@pytest.mark.parametrize("failure", ["capture raises", "replay differs"])
def test_graph_failure_falls_back_to_the_eager_chain(failure, caplog):
    """The CUDA-graph guards, exercised on CPU with test doubles: a capture that raises, or a first
    replay whose drafts differ from the eager chain, turns graphs off with a warning; the drafts
    of that call and later ones come from the eager chain."""
    d = debug_drafter(96, seed=3)
    ref = EagerDrafterRunner(d)
    r = StaticDrafterRunner(d)
    r.use_graphs = True  # as if on CUDA

    def capture(m, k, kv_len):
        if failure == "capture raises":
            raise RuntimeError("operation not permitted when stream is capturing")
        return _WrongGraph(), torch.full((k,), 95, dtype=torch.long)

    r._capture = capture
    with caplog.at_level("WARNING", logger="specops.eval"):
        a, b = _rounds(d, [ref, r], k=3, temperature=0.0)
    assert [x[0].tolist() for x in a] == [x[0].tolist() for x in b]
    assert not r.use_graphs and r.graph_fallbacks == 1 and not r._graphs
    assert "drafter runs eagerly" in caplog.text


def test_speculative_loop_with_the_static_drafter_is_lossless(tmp_path):
    """T = 0 on the static target runner: the static drafter runner gives the target's greedy
    decoding and the same acceptance as the eager drafter."""
    target = load(make_target(tmp_path / "t"))
    st = StaticTargetRunner(target, AUX)
    d = debug_drafter(96)
    for n in (1, 7, 13):
        p = rand_ids(96, n, seed=n)
        ref = greedy_reference(target.model, p, 28)
        fast = speculative_generate(st, d, p, k=4, max_new_tokens=28, drafter_runner=StaticDrafterRunner(d))
        slow = speculative_generate(st, d, p, k=4, max_new_tokens=28)
        assert fast.tokens == ref and slow.tokens == ref
        assert fast.accepted == slow.accepted


def test_selection_and_config():
    d = debug_drafter(96)
    assert isinstance(make_drafter_runner(d, "auto"), EagerDrafterRunner)  # CPU
    assert isinstance(make_drafter_runner(d, "eager"), EagerDrafterRunner)
    r = make_drafter_runner(d, "static")
    assert isinstance(r, StaticDrafterRunner) and not r.use_graphs  # no graphs off CUDA
    with pytest.raises(ConfigError, match="eval.drafter_runner"):
        make_drafter_runner(d, "graph")
    assert EvalSection().drafter_runner == "auto"
    assert family_of(d) is EAGLE3  # what the evaluator asks for a runner
    assert isinstance(EAGLE3.drafter_runner(d, "auto"), EagerDrafterRunner)
    rows = EAGLE3.drafter_runner(d, "static", cuda_graphs=False, rows=3, min_capacity=8)
    assert isinstance(rows, StaticDrafterRunner) and rows.rows == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_chain_equals_eager_and_loop_is_lossless(tmp_path):
    """fp32 on CUDA: the graphed chain drafts as the eager static chain and the eager runner, for
    every pending length and across the 256 -> 512 bucket; the loop stays the target's greedy
    decoding; no fallback."""
    d = debug_drafter(96).cuda()
    graphed = StaticDrafterRunner(d)
    plain = StaticDrafterRunner(d, cuda_graphs=False)
    eager = EagerDrafterRunner(d)
    assert graphed.use_graphs and not plain.use_graphs
    for n_prompt in (9, 250):
        a, b, c = _rounds(d, [eager, plain, graphed], k=4, temperature=0.0, n_prompt=n_prompt)
        assert [x[0].tolist() for x in b] == [x[0].tolist() for x in c]
        assert [x[0].tolist() for x in a] == [x[0].tolist() for x in c]
    assert graphed.use_graphs and graphed.graph_fallbacks == 0
    assert {kv for (_, _, kv) in graphed._graphs} == {256, 512}
    target = load(make_target(tmp_path / "t"), "cuda")
    st = StaticTargetRunner(target, AUX)
    p = rand_ids(96, 11, 3)
    ref = greedy_reference(target.model, p, 60)
    assert speculative_generate(st, d, p, k=4, max_new_tokens=60, drafter_runner=graphed).tokens == ref
    assert graphed.graph_fallbacks == 0


def test_drafter_step_bench_runs_and_checks_drafts(tmp_path):
    """bench/drafter_step.py on the CPU (random SmolLM2-shaped drafter): both runners time their
    rounds and draft the same tokens."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(repo / "bench" / "drafter_step.py"), "--k", "2", "--rounds", "12",
                        "--prompt", "20", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["same_drafts_as_eager"] == {"eager": True, "static": True}
    assert res["ms_per_draft_token"]["eager"] > 0 and res["ms_per_draft_token"]["static"] > 0


def test_greedy_chain_makes_no_host_sync():
    """The chain a CUDA graph captures must not read a device value on the host: no `.item()`
    (aten._local_scalar_dense) anywhere in it. One such read (d2t indexed with a 0-d tensor is a
    select on a Python int) makes every capture fail and fall back to eager."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            return func(*args, **(kwargs or {}))

    d = debug_drafter(96)
    r = StaticDrafterRunner(d)
    r.reset(64)
    r.prefill(torch.randint(0, 96, (1, 10)), torch.randn(1, 10, 3, d.config.target_hidden_size))  # slots 0..8
    tok, aux, pos0 = r._in_buffers(3)
    tok.copy_(torch.randint(0, 96, (1, 3)))
    aux.copy_(torch.randn_like(aux))
    pos0.fill_(9)
    with torch.no_grad(), Record() as rec:
        r._chain(tok, aux, pos0, 5, r._bucket(9 + 3 + 5))
    assert not [op for op in rec.ops if "_local_scalar_dense" in op or "aten.item" in op], sorted(rec.ops)
