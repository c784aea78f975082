"""The graph-ready training step (train.cuda_graphs): the static unroll (`ttt_forward_static`: no host
sync, no data-dependent shape) equals the selecting unroll (`teacher_targets` + `ttt_forward`) in
loss, per-step sums, hits, counts and every gradient; padded rows change nothing; a whole training
run in that mode gives the eager run's loss curve; and, on CUDA, graph replays equal eager steps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specops.config import load_config
from specops.drafter.graphs import GraphedMicroStep
from specops.drafter.model import DrafterConfig, Eagle3Drafter
from specops.drafter.batch import Teacher, teacher_targets
from specops.drafter.losses import linear_soft_ce
from specops.drafter.families.eagle3.objective import ttt_forward, ttt_forward_static
from specops.drafter.train import Sample, bucketed, collate, make_batches, run_train
from specops.target.inprocess import TargetHead

from train_builders import BASE, _packed_batch, metrics, seed_campaign

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _setup(dtype=torch.float64, seed=1, batch_seed=3):
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(DrafterConfig.debug()).to(dtype)
    head = TargetHead({}, torch.rand(32) + 0.5, 1e-6, torch.randn(96, 32), 3 * torch.randn(96, 32))
    teacher = Teacher(head, drafter.d2t, final_prenorm=True, device=torch.device("cpu"), dtype=dtype)
    batch, _ = _packed_batch(seed=batch_seed)  # two documents in a row, and a row ending in padding
    batch = dataclasses.replace(batch, aux=batch.aux.to(dtype), final=batch.final.to(dtype))
    return drafter, teacher, batch


def _run(drafter, fn):
    drafter.zero_grad(set_to_none=True)
    out = fn()
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fused", ["on", "off"])
def test_static_unroll_equals_the_selecting_unroll(monkeypatch, fused):
    """Loss, per-step CE sums, hits, counts and every parameter gradient: the same in fp64, with the
    fused lm_head + CE (the CUDA default) and the separate form."""
    from specops.drafter.model import KERNELS

    monkeypatch.setattr(KERNELS, "fused_loss", fused)
    drafter, teacher, batch = _setup()
    K = 5
    dyn, g_dyn = _run(drafter, lambda: ttt_forward(drafter, batch, teacher_targets(teacher, batch), steps=K, decay=0.8))
    sta, g_sta = _run(drafter, lambda: ttt_forward_static(drafter, teacher, batch, steps=K, decay=0.8))
    # the separate form's CE runs in fp32 even on fp64 logits (its scale applies in another order): fp32 tolerances
    tol = dict(rtol=1e-9, atol=1e-12) if fused == "on" else dict(rtol=1e-5, atol=1e-7)
    tol["check_dtype"] = False
    torch.testing.assert_close(sta.loss, dyn.loss, **tol)
    torch.testing.assert_close(sta.ce_sum, dyn.ce_sum, **tol)
    assert sta.correct.tolist() == dyn.correct.tolist()
    assert sta.count.tolist() == dyn.count.tolist() and min(dyn.count.tolist()) > 0
    assert g_sta.keys() == g_dyn.keys() and {"fc.weight", "lm_head.weight"} <= g_sta.keys()
    for n in g_dyn:
        torch.testing.assert_close(g_sta[n], g_dyn[n], msg=n, **tol)


def test_static_unroll_ignores_padded_rows_and_tails():
    """The same documents collated tight and padded to a multiple of 16 (collate pad_to), plus a row
    that is all padding: the same loss, counts and gradients (padding never counts nor leaks)."""
    g = torch.Generator().manual_seed(5)
    H = 32
    samples = []
    for n in (9, 13, 6):
        samples.append(Sample(torch.randint(0, 96, (n,), generator=g), torch.rand(n, generator=g) > 0.3,
                              torch.randn(n, 3, H, generator=g, dtype=torch.float64),
                              torch.randn(n, H, generator=g, dtype=torch.float64)))
    drafter, teacher, _ = _setup()
    tight = collate([[s] for s in samples])
    padded = collate([[s] for s in samples], pad_to=16)
    assert tight.input_ids.shape == (3, 13) and padded.input_ids.shape == (3, 16)
    assert (padded.doc[:, 13:] == -1).all() and padded.n_tokens == tight.n_tokens == 28
    a, ga = _run(drafter, lambda: ttt_forward_static(drafter, teacher, tight, steps=4, decay=0.8))
    b, gb = _run(drafter, lambda: ttt_forward_static(drafter, teacher, padded, steps=4, decay=0.8))
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-9, atol=1e-12)
    assert a.count.tolist() == b.count.tolist() and a.correct.tolist() == b.correct.tolist()
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-9, atol=1e-12, msg=n)


def test_linear_soft_ce_valid_rows_equal_the_selected_rows():
    """linear_soft_ce over all rows with `valid` (and a 0-d tensor scale) equals it over the valid rows
    alone: values and the gradients of h and the weight (masked rows get exactly zero)."""
    g = torch.Generator().manual_seed(2)
    n, H, V = 10, 8, 12
    h = torch.randn(n, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    p_all = torch.softmax(torch.randn(n, V, generator=g, dtype=torch.float64), -1)
    rows = torch.randperm(n, generator=g)
    tgt = p_all[rows].argmax(-1)
    valid = torch.rand(n, generator=g) > 0.4
    idx = valid.nonzero().squeeze(1)
    scale = 0.37
    sel = linear_soft_ce(h[idx], w, p_all, rows[idx], tgt[idx], scale)
    gh_sel, gw_sel = torch.autograd.grad(sel[0], (h, w))
    full = linear_soft_ce(h, w, p_all, rows, tgt, torch.tensor(scale, dtype=torch.float64), valid)
    gh, gw = torch.autograd.grad(full[0], (h, w))
    for x, y in zip(full, sel):
        torch.testing.assert_close(x, y, check_dtype=False)
    torch.testing.assert_close(gh, gh_sel)
    torch.testing.assert_close(gw, gw_sel)
    assert (gh[~valid] == 0).all()


def test_bucketed_plans_fit_the_padded_budget():
    lengths = [5, 130, 129, 300, 64, 65, 700, 1]
    assert bucketed(lengths, 64) == [64, 192, 192, 320, 64, 128, 704, 64]
    assert bucketed(lengths, 1) == lengths
    for b in make_batches(bucketed(lengths, 64), 800, seed=1):
        assert len(b) * max(bucketed(lengths, 64)[i] for i in b) <= 800 or len(b) == 1


def _fp32_loss_bound(cfg: dict) -> float:
    """The relative gap between two fp32 evaluations of one step's loss that sum its terms in another
    order: at most n u for n nonnegative terms (u = 2^-24), n = batch_tokens x ttt_steps token CEs.
    Both runs update the weights in fp32 (AdamW, Muon with an fp32 Newton-Schulz step), so the
    round-off gap between their weights stays of that order too; a bf16 step would re-round the
    update to 2^-8 wherever the two gradients straddle a bf16 rounding boundary, and the curves part
    by far more than any bound on a CPU's fp32 sums."""
    return cfg["batch_tokens"] * cfg["ttt_steps"] * 2.0**-24


def _eager_and_static_runs(tiny, tmp_path, common: dict, static_extra: dict, min_steps: int):
    """Train the same campaign with the selecting step (cuda_graphs off) and the static one (on; on
    the CPU it runs eagerly); both curves must match step by step, within fp32 round-off of the loss
    (_fp32_loss_bound). Returns both summaries."""
    common = {**common, "muon_ns_dtype": "float32"}
    eager = seed_campaign(tiny, tmp_path, {**common, "cuda_graphs": False}, name="eager")
    static = seed_campaign(tiny, tmp_path, {**common, "cuda_graphs": True, **static_extra}, name="static")
    s_e = run_train(load_config(tmp_path / "eager.toml"), eager)
    s_s = run_train(load_config(tmp_path / "static.toml"), static)
    a, b = metrics(eager.root), metrics(static.root)
    assert len(a) == len(b) == s_e["total_steps"] >= min_steps
    rel = _fp32_loss_bound(common)
    for ra, rb in zip(a, b):
        assert ra["tokens"] == rb["tokens"]
        assert rb["loss"] == pytest.approx(ra["loss"], rel=rel, abs=0), ra["step"]
    return s_e, s_s


def test_cuda_graphs_mode_on_the_cpu_trains_like_the_eager_step(tiny, tmp_path):
    """train.cuda_graphs on the CPU runs the static step eagerly (no capture): with graph_bucket 1
    (the same batch plan) the loss curve and final weights match the default step's; with a real
    bucket it trains (loss falls) on rows padded to the bucket, and the manifest tells how it ran."""
    common = {**BASE, "epochs": 4, "batch_tokens": 96, "checkpoint_every": 1000, "eval_every": 1000}
    bucket = seed_campaign(tiny, tmp_path, {**common, "cuda_graphs": True, "graph_bucket": 16}, name="bucket")
    s_e, s_s = _eager_and_static_runs(tiny, tmp_path, common, {"graph_bucket": 1}, 8)
    wa = load_file(str(Path(s_e["checkpoint"]) / "model.safetensors"))
    wb = load_file(str(Path(s_s["checkpoint"]) / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-3, atol=1e-5, msg=k)
    assert "cuda_graphs" not in s_e
    assert s_s["cuda_graphs"] == {"on": False, "requested": False, "captured": 0, "replays": 0,
                                  "eager_steps": s_s["total_steps"], "capture_s": 0.0, "disabled": None}
    s_b = run_train(load_config(tmp_path / "bucket.toml"), bucket)
    m = metrics(bucket.root)
    assert s_b["finished"] and m[-1]["loss"] < 0.8 * m[0]["loss"]


def _graph_inputs(device, seed=0, lens=((9, 13, 6), (12, 4, 15, 2), (7, 8, 3), (9, 13, 6))):
    """Host batches (pinned) of three shapes after padding to 8: [3, 16], [4, 16], [3, 8], [3, 16] again."""
    g = torch.Generator().manual_seed(seed)
    H = 32
    out = []
    for ls in lens:
        samples = [Sample(torch.randint(0, 96, (n,), generator=g), torch.rand(n, generator=g) > 0.3,
                          torch.randn(n, 3, H, generator=g).bfloat16(), torch.randn(n, H, generator=g).bfloat16())
                   for n in ls]
        out.append(collate([[s] for s in samples], pin=True, pad_to=8))
    return out


def _gpu_run(use_graphs: bool, batches: list, sync_in_capture: bool = False):
    """The micro-batches through a fresh GraphedMicroStep on CUDA (two micro-batches per optimizer
    step: .grad zeroed in place every second one): (outputs, gradients per step, summary). With
    sync_in_capture the forward makes a host sync whenever it is being captured, which a capture
    cannot hold."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.debug()).to(dev)
    head = TargetHead({}, torch.rand(32) + 0.5, 1e-6, torch.randn(96, 32), 3 * torch.randn(96, 32))
    teacher = Teacher(head, drafter.d2t, final_prenorm=True, device=dev, dtype=torch.bfloat16)
    params = [p for p in drafter.parameters() if p.requires_grad]

    def fn(b):
        out = ttt_forward_static(drafter, teacher, b, steps=4, decay=0.8)
        if sync_in_capture and torch.cuda.is_current_stream_capturing():
            out.count.sum().item()
        return out

    micro = GraphedMicroStep(fn, params, dev, loss_scale=0.5, use_graphs=use_graphs,
                             autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False))
    ptrs = [p.grad.data_ptr() for p in params]
    outs, grads = [], []
    for i, hb in enumerate(batches):
        if i % 2 == 0:
            for p in params:
                p.grad.zero_()
        o = micro.step(hb)
        outs.append([t.clone() for t in (o.loss, o.ce_sum, o.correct, o.count)])
        if i % 2 == 1:
            grads.append([p.grad.clone() for p in params])
    torch.cuda.synchronize()
    if not sync_in_capture:
        assert [p.grad.data_ptr() for p in params] == ptrs
    return outs, grads, micro.summary()


def _assert_same_steps(r1, r2) -> None:
    for a, b in zip(r1[0], r2[0]):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=2e-3, atol=2e-3)
    for a, b in zip(r1[1], r2[1]):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_equal_eager_steps():
    """On CUDA (bf16 autocast): the same sequence of micro-batches through GraphedMicroStep with graphs
    (eager warm-up, capture, replays) and without gives the same outputs and accumulated gradients;
    shapes were captured and replayed, and the .grad tensors stayed where they were."""
    batches = _graph_inputs(torch.device("cuda")) * 3  # each shape: warm-up, capture + replay, replay
    graphs, eager = _gpu_run(True, batches), _gpu_run(False, batches)
    s1, s2 = graphs[2], eager[2]
    assert s1["on"] and s1["captured"] == 3 and s1["replays"] == 12 - 3 and s1["eager_steps"] == 3, s1
    assert s2["eager_steps"] == 12 and s2["captured"] == 0
    _assert_same_steps(graphs, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_failed_capture_turns_graphs_off_and_the_steps_stay_right(caplog):
    """A forward that cannot be captured (a host sync while capturing): the capture fails once, graphs
    go off for the run with a warning naming why, and every step, the one whose capture failed
    included, equals the eager run's."""
    batches = _graph_inputs(torch.device("cuda")) * 2
    with caplog.at_level("WARNING", logger="specops.train"):
        failed = _gpu_run(True, batches, sync_in_capture=True)
    s = failed[2]
    assert s["requested"] and not s["on"] and s["disabled"] and s["captured"] == 0 and s["replays"] == 0, s
    assert s["eager_steps"] == len(batches)
    assert "CUDA graphs off for this run" in caplog.text
    _assert_same_steps(failed, _gpu_run(False, batches))


# ---------------------------------------------------------------- packed rows (train.pack_rows)

def test_pack_batches_place_every_sample_once_in_rows_that_fit():
    import random

    from specops.drafter.train import pack_batches

    rng = random.Random(4)
    lengths = [rng.randint(3, 200) for _ in range(1300)]
    b0 = pack_batches(lengths, 256, 4, seed=1, epoch=0)
    assert pack_batches(lengths, 256, 4, seed=1, epoch=0) == b0  # deterministic
    assert pack_batches(lengths, 256, 4, seed=1, epoch=1) != b0  # reshuffled per epoch
    assert all(len(b) == 4 for b in b0)  # one shape: the last batch is filled with empty rows
    rows = [r for b in b0 for r in b]
    assert sorted(i for r in rows for i in r) == list(range(1300))  # each sample exactly once
    assert all(sum(lengths[i] for i in r) <= 256 for r in rows)
    used = sum(lengths) / (256 * sum(1 for r in rows if r))
    assert used > 0.9, used  # first-fit decreasing wastes little
    # rows mix lengths (make_batches' rows are length-sorted within chunks)
    spread = [max(lengths[i] for i in r) - min(lengths[i] for i in r) for r in rows if len(r) > 1]
    assert sum(spread) / len(spread) > 50
    with pytest.raises(Exception, match="train.pack_rows = 150 is shorter than"):
        pack_batches(lengths, 150, 4, seed=1)


def test_packed_rows_train_and_the_graph_step_matches_the_eager_one(tiny, tmp_path):
    """train.pack_rows: batches of a fixed [rows, pack_rows] holding several documents per row; the
    static (graph-ready) step on the CPU follows the selecting step's loss curve on the same plan;
    the loss falls; a sample longer than pack_rows is refused before training."""
    longest = max(int(x[0].numel()) for x in tiny["train"])
    common = {**BASE, "epochs": 4, "batch_tokens": 128, "pack_rows": 64, "checkpoint_every": 1000,
              "eval_every": 1000}
    assert longest <= 64
    s_e, s_s = _eager_and_static_runs(tiny, tmp_path, common, {}, 6)
    a = metrics(tmp_path / "eager")
    assert a[-1]["loss"] < 0.8 * a[0]["loss"]
    assert s_s["cuda_graphs"]["eager_steps"] == s_s["total_steps"]
    short = seed_campaign(tiny, tmp_path, {**common, "pack_rows": longest - 1}, name="short")
    with pytest.raises(Exception, match="train.pack_rows"):
        run_train(load_config(tmp_path / "short.toml"), short)
