"""Drafter training: TTT masks and alignment against a step-by-step reference, the teacher against
the real target, loss falls, overfit tau, kill -9 + resume replays the same curve, DDP == accumulation.

Every test builds a tiny random LlamaForCausalLM, saves it, and writes feature shards in the
DESIGN format from its own `output_hidden_states` (no extract.py, no hub).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specops.campaign import Campaign
from specops.config import load_config
from specops.target import default_aux_layer_ids
from specops.drafter.batch import Teacher, teacher_targets
from specops.drafter.losses import linear_soft_ce, soft_cross_entropy
from specops.drafter.model import KERNELS, DrafterConfig, Eagle3Drafter
from specops.drafter.families.eagle3.objective import ttt_forward, ttt_masks
from specops.drafter.train import FeatureSplit, make_batches, run_train
from specops.target.inprocess import TargetHead, load_target_head
from specops.drafter.checkpoint import load_drafter
from specops.measures import simulated_tau

from train_builders import (
    BASE,
    DRAFT_VOCAB,
    VOCAB,
    _packed_batch,
    make_campaign,
    make_target,
    metrics,
    seed_campaign,
    target_states,
    write_build,
    write_features,
)

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- fixtures: a tiny target and its features

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py





# ---------------------------------------------------------------- TTT against a step-by-step reference

def test_ttt_mask_pattern():
    # one row: document 0 = slots 0..2, document 1 = slots 3..4, padding at 5
    doc = torch.tensor([[0, 0, 0, 1, 1, -1]])
    m0, m1, m2 = (m[0, 0].int() for m in ttt_masks(doc, 3))
    assert m0.tolist() == [[1, 0, 0, 0, 0, 0],
                           [1, 1, 0, 0, 0, 0],
                           [1, 1, 1, 0, 0, 0],
                           [0, 0, 0, 1, 0, 0],
                           [0, 0, 0, 1, 1, 0],
                           [0, 0, 0, 0, 0, 1]]
    eye = torch.eye(6, dtype=torch.int)
    assert torch.equal(m1, torch.cat([m0, eye], 1))
    assert torch.equal(m2, torch.cat([m0, eye, eye], 1))


def debug_unroll(seed: int, batch_seed: int, dtype: torch.dtype = torch.float32):
    """A debug drafter, the packed batch of `_packed_batch(batch_seed)` and its teacher targets, in
    `dtype` (CPU): what the unroll tests and bench/ttt_ops.py run."""
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(DrafterConfig.debug()).to(dtype)
    head = TargetHead({}, torch.rand(32) + 0.5, 1e-6, torch.randn(96, 32), 3 * torch.randn(96, 32))
    teacher = Teacher(head, drafter.d2t, final_prenorm=True, device=torch.device("cpu"), dtype=dtype)
    batch, _ = _packed_batch(seed=batch_seed)
    if dtype != torch.float32:
        batch = dataclasses.replace(batch, aux=batch.aux.to(dtype), final=batch.final.to(dtype))
    return drafter, batch, teacher_targets(teacher, batch)


def _reference(drafter, teacher, batch, rows, K, decay):
    """Run each document alone, one position at a time, with an explicit KV list per step."""
    per_step_ce = [[] for _ in range(K)]
    correct = [0] * K
    logits_at = {}  # (k, row, slot) -> logits
    for r, lens in enumerate(rows):
        a = 0
        for n in lens:
            x = batch.input_ids[r, a:a + n]
            lm = batch.loss_mask[r, a:a + n]
            fused = drafter.fuse(batch.aux[r, a:a + n])
            t_logits = teacher.logits(batch.final[r, a:a + n])  # [n, Vd]: distribution after x_j
            kv = [[None] * n for _ in range(K)]
            h_prev = [None] * n
            for k in range(K):
                h_cur = [None] * n
                for t in range(n):
                    tok = x[t + 1 + k] if t + 1 + k < n else torch.tensor(0)
                    hid = fused[t] if k == 0 else h_prev[t]
                    # keys visible: step 0 at slots 0..t (slot t's own step-0 key when k > 0), then
                    # slot t's key of each step 1..k-1; the current step's own key is appended by forward
                    past = [kv[0][s] for s in range(t if k == 0 else t + 1)] + [kv[j][t] for j in range(1, k)]
                    out = drafter(tok.view(1, 1), hid.view(1, 1, -1), torch.tensor([[t + k]]), past_kv=past)
                    kv[k][t] = out.kv
                    h_cur[t] = out.hidden[0, 0]
                    logits_at[(k, r, a + t)] = out.logits[0, 0]
                    if t + 2 + k <= n - 1 and lm[t + 2 + k]:
                        p = torch.softmax(t_logits[t + 1 + k], -1)
                        per_step_ce[k].append(-(p * torch.log_softmax(out.logits[0, 0], -1)).sum())
                        correct[k] += int(out.logits[0, 0].argmax() == t_logits[t + 1 + k].argmax())
                h_prev = h_cur
            a += n
    loss = sum(decay ** k * torch.stack(c).mean() for k, c in enumerate(per_step_ce))
    return loss, [torch.stack(c).sum() for c in per_step_ce], [len(c) for c in per_step_ce], correct, logits_at


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_ttt_matches_step_by_step_reference(norm_before_residual):
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.debug(norm_before_residual=norm_before_residual))
    ids = torch.sort(torch.randperm(96)[:48]).values
    drafter.set_vocab(ids - torch.arange(48))
    head = TargetHead({}, torch.rand(32) + 0.5, 1e-6, torch.randn(96, 32), 3 * torch.randn(96, 32))
    teacher = Teacher(head, drafter.d2t, final_prenorm=True, device=torch.device("cpu"), dtype=torch.float32)
    batch, rows = _packed_batch()
    K, decay = 4, 0.8
    out = ttt_forward(drafter, batch, teacher_targets(teacher, batch), steps=K, decay=decay, return_logits=True)
    ref_loss, ref_ce, ref_n, ref_correct, ref_logits = _reference(drafter, teacher, batch, rows, K, decay)

    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.ce_sum, torch.stack(ref_ce), rtol=1e-5, atol=1e-5)
    assert out.count.tolist() == ref_n and min(ref_n) > 0
    assert out.correct.tolist() == ref_correct
    # logits wherever step k's input token is still inside the document (elsewhere the batched
    # version sees the next document's token, the reference a 0; neither is ever counted)
    compared = 0
    for (k, r, s), ref in ref_logits.items():
        if s + 1 + k < int(batch.doc_end[r, s]):
            torch.testing.assert_close(out.logits[k][r, s], ref, rtol=1e-5, atol=1e-5)
            compared += 1
    assert compared > 40
    # gradients flow through the unrolled hidden states into fc (step 0) and lm_head
    out.loss.backward()
    assert drafter.fc.weight.grad.abs().sum() > 0


def _dense_ttt_attention(q, block, diag, mask0):
    """The dense form: SDPA over [K_0 | K_1..K_k] under [mask0 | eye ... eye]."""
    import torch.nn.functional as F

    rep = q.shape[1] // block[0].shape[1]
    T = q.shape[2]
    keys = torch.cat([block[0]] + [k for k, _ in diag], 2).repeat_interleave(rep, 1)
    vals = torch.cat([block[1]] + [v for _, v in diag], 2).repeat_interleave(rep, 1)
    eye = torch.eye(T, dtype=torch.bool).expand(*mask0.shape[:2], T, T)
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=torch.cat([mask0] + [eye] * len(diag), -1))


@pytest.mark.parametrize("dtype,steps", [(torch.float32, 1), (torch.float32, 6), (torch.float64, 3), (torch.bfloat16, 6)])
def test_ttt_attention_equals_dense_with_gradients(dtype, steps):
    """model.ttt_attention (block-0 SDPA + a probe key for the diagonal) against the dense masked
    SDPA: outputs and the gradients of q, every key and every value."""
    from specops.drafter.model import ttt_attention

    g = torch.Generator().manual_seed(steps)
    B, nh, nkv, T, d = 2, 4, 2, 9, 16
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, -1, -1], [0, 0, 0, 0, 0, 0, 0, 0, 0]])
    mask0 = ttt_masks(doc, 1)[0]

    def leaf(*shape):  # large logits too, so the probe's hi/lo split matters in bf16
        return (3 * torch.randn(*shape, generator=g)).to(dtype).requires_grad_()

    q = leaf(B, nh, T, d)
    block = (leaf(B, nkv, T, d), leaf(B, nkv, T, d))
    diag = [(leaf(B, nkv, T, d), leaf(B, nkv, T, d)) for _ in range(steps)]
    leaves = [q, *block] + [t for kv in diag for t in kv]
    gout = torch.randn(B, nh, T, d, generator=g).to(dtype)
    results = []
    for fn in (ttt_attention, _dense_ttt_attention):
        out = fn(q, block, diag, mask0)
        grads = torch.autograd.grad(out, leaves, gout)
        results.append((out, grads))
    (o1, g1), (o2, g2) = results
    assert o1.dtype == dtype
    if dtype != torch.bfloat16:
        torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5)
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        return
    # bf16: both forms round differently; each must be as close to the float64 truth as the other
    # (within 1.5x + a small floor), for the output and every gradient
    exact = [x.detach().double().requires_grad_() for x in leaves]
    o64 = _dense_ttt_attention(exact[0], tuple(exact[1:3]), [tuple(exact[i:i + 2]) for i in range(3, len(exact), 2)],
                               mask0)
    g64 = torch.autograd.grad(o64, exact, gout.double())
    for new_t, dense_t, true_t in zip((o1, *g1), (o2, *g2), (o64, *g64)):
        err_new = (new_t.double() - true_t).abs().max().item()
        err_dense = (dense_t.double() - true_t).abs().max().item()
        assert err_new <= 1.5 * err_dense + 0.02 * true_t.abs().max().item(), (err_new, err_dense)


def test_ttt_attention_under_cpu_autocast_keeps_fp32_scores():
    """Under bf16 autocast (as in training) the diagonal scores stay fp32: the output matches the
    float64 truth as closely as the dense SDPA under the same autocast."""
    from specops.drafter.model import ttt_attention

    g = torch.Generator().manual_seed(7)
    B, nh, nkv, T, d = 1, 4, 2, 16, 16
    mask0 = ttt_masks(torch.zeros(B, T, dtype=torch.long), 1)[0]
    xs = [3 * torch.randn(B, n, T, d, generator=g, dtype=torch.float64) for n in [nh] + [nkv] * 8]
    truth = _dense_ttt_attention(xs[0], tuple(xs[1:3]), [tuple(xs[i:i + 2]) for i in range(3, 9, 2)], mask0)
    bf = [x.to(torch.bfloat16) for x in xs]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        new = ttt_attention(bf[0], tuple(bf[1:3]), [tuple(bf[i:i + 2]) for i in range(3, 9, 2)], mask0)
        dense = _dense_ttt_attention(bf[0], tuple(bf[1:3]), [tuple(bf[i:i + 2]) for i in range(3, 9, 2)], mask0)
    err_new = (new.double() - truth).abs().max().item()
    err_dense = (dense.double() - truth).abs().max().item()
    assert new.dtype == torch.bfloat16 and err_new <= 1.5 * err_dense + 0.02 * truth.abs().max().item()


def test_ttt_dense_fallback_matches_reference(monkeypatch):
    """train.ttt_attention = "dense" (the reference form) computes the same unroll."""

    drafter, batch, targets = debug_unroll(1, 3)
    fast = ttt_forward(drafter, batch, targets, steps=5, decay=0.8)
    monkeypatch.setattr(KERNELS, "ttt_attention", "dense")
    dense = ttt_forward(drafter, batch, targets, steps=5, decay=0.8)
    torch.testing.assert_close(fast.loss, dense.loss, rtol=1e-5, atol=1e-5)
    assert fast.correct.tolist() == dense.correct.tolist()


def test_compiled_loss_equals_eager(monkeypatch):
    """train.compile_loss = "on" on the CPU: the torch.compile'd forward/backward of the soft CE (the
    CUDA default) give the eager values and gradients, through varying row counts (dynamic shapes)."""
    import specops.drafter.losses as losses_mod

    kernels = losses_mod._LossKernels()
    kernels.mode = "on"
    monkeypatch.setattr(losses_mod, "LOSS_KERNELS", kernels)
    g = torch.Generator().manual_seed(0)
    p_all = torch.softmax(3 * torch.randn(40, 512, generator=g), -1)
    for n in (17, 33):
        logits = (4 * torch.randn(n, 512, generator=g)).requires_grad_()
        rows = torch.randint(0, 40, (n,), generator=g)
        gout = torch.rand(n, generator=g)
        ce = soft_cross_entropy(logits, p_all, rows)
        (grad,) = torch.autograd.grad(ce, logits, gout)
        ref = -(p_all[rows] * torch.log_softmax(logits, -1)).sum(-1)
        (ref_grad,) = torch.autograd.grad(ref, logits, gout)
        torch.testing.assert_close(ce, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert len(kernels.compiled) == 2 and not kernels.failed


@pytest.mark.parametrize("compiled", [False, True])
def test_linear_soft_ce_equals_autograd_reference(monkeypatch, compiled):
    """The fused lm_head + soft CE node (`linear_soft_ce`): loss, CE sum, argmax hits and the
    gradients of h and W equal plain autograd on logits = h W^T, under an upstream gradient != 1
    (eager, and torch.compile'd on the CPU as on CUDA), through varying row counts."""
    import specops.drafter.losses as losses_mod

    kernels = losses_mod._LossKernels()
    kernels.mode = "on" if compiled else "off"
    monkeypatch.setattr(losses_mod, "LOSS_KERNELS", kernels)
    g = torch.Generator().manual_seed(0)
    V, H = 300, 24
    p_all = torch.softmax(3 * torch.randn(40, V, generator=g, dtype=torch.float64), -1)
    for n in (17, 33, 0):
        h = torch.randn(n, H, generator=g, dtype=torch.float64, requires_grad=True)
        w = (0.5 * torch.randn(V, H, generator=g, dtype=torch.float64)).requires_grad_()
        rows = torch.randint(0, 40, (n,), generator=g)
        tgt = p_all[rows].argmax(-1)
        scale, gout = 0.37, 2.5
        loss, ce_sum, correct = linear_soft_ce(h, w, p_all, rows, tgt, scale)
        gh, gw = torch.autograd.grad(loss * gout, (h, w))
        logits = h @ w.T
        ref_ce = -(p_all[rows] * torch.log_softmax(logits, -1)).sum()
        rh, rw = torch.autograd.grad(ref_ce * scale * gout, (h, w))
        torch.testing.assert_close(ce_sum, ref_ce.detach())
        torch.testing.assert_close(loss, ref_ce.detach() * scale)
        assert int(correct) == int((logits.argmax(-1) == tgt).sum())
        torch.testing.assert_close(gh, rh)
        torch.testing.assert_close(gw, rw)
    assert not kernels.failed and (len(kernels.compiled) == 1) == compiled


def test_ttt_unroll_with_the_shared_block_equals_the_dense_unroll(monkeypatch):
    """The whole unroll with step 0's keys prepared once (ttt_block, the default) and every step's
    RoPE computed up front gives the dense masked unroll's loss, per-step CE sums, hits and every
    parameter gradient (fp64); and the up-front RoPE is each step's own."""

    drafter, batch, targets = debug_unroll(2, 5, torch.float64)
    monkeypatch.setattr(KERNELS, "fused_loss", "off")
    res = []
    for dense in (False, True):
        monkeypatch.setattr(KERNELS, "ttt_attention", "dense" if dense else "block")
        drafter.zero_grad(set_to_none=True)
        out = ttt_forward(drafter, batch, targets, steps=6, decay=0.8)
        out.loss.backward()
        res.append((out, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}))
    (o0, g0), (o1, g1) = res
    # the separate form's CE runs in fp32 even on fp64 logits: fp32 tolerances there
    torch.testing.assert_close(o0.loss, o1.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(o0.ce_sum, o1.ce_sum, rtol=1e-6, atol=1e-6)
    assert o0.correct.tolist() == o1.correct.tolist() and o0.count.tolist() == o1.count.tolist()
    assert g0.keys() == g1.keys() and "midlayer.self_attn.k_proj.weight" in g0
    for n in g0:
        torch.testing.assert_close(g0[n], g1[n], rtol=1e-5, atol=1e-8, msg=n)
    offs = torch.arange(6).view(6, 1, 1)
    cos_all, sin_all = drafter.rope(batch.pos[None] + offs)
    for k in range(6):
        cos, sin = drafter.rope(batch.pos + k)
        assert torch.equal(cos_all[k], cos) and torch.equal(sin_all[k], sin)


def test_fused_loss_switch_defaults_to_cuda_only(monkeypatch):
    """train.fused_loss: "auto" (the default) fuses on CUDA only, "on" everywhere, "off" nowhere."""
    import specops.drafter.losses as losses_mod

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    for mode, want in (("auto", (False, True)), ("on", (True, True)), ("off", (False, False))):
        monkeypatch.setattr(KERNELS, "fused_loss", mode)
        assert (losses_mod.fused_loss_on(cpu), losses_mod.fused_loss_on(cuda)) == want, mode


def test_ttt_forward_fused_loss_equals_separate(monkeypatch):
    """The TTT unroll with the fused lm_head + CE (the CUDA default) gives the loss, per-step CE sums,
    hits and every parameter gradient of the separate form (train.fused_loss = "off")."""
    import specops.drafter.losses as losses_mod

    drafter, batch, targets = debug_unroll(1, 3, torch.float64)
    outs, grads = [], []
    for fused in ("on", "off"):
        monkeypatch.setattr(KERNELS, "fused_loss", fused)
        assert losses_mod.fused_loss_on(torch.device("cpu")) == (fused == "on")
        drafter.zero_grad(set_to_none=True)
        out = ttt_forward(drafter, batch, targets, steps=5, decay=0.8)
        out.loss.backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None})
    # the separate form's CE runs in fp32 even on fp64 logits: fp32 tolerances
    tol = dict(rtol=1e-5, atol=1e-6, check_dtype=False)
    torch.testing.assert_close(outs[0].loss, outs[1].loss, **tol)
    torch.testing.assert_close(outs[0].ce_sum, outs[1].ce_sum, **tol)
    assert outs[0].correct.tolist() == outs[1].correct.tolist()
    assert grads[0].keys() == grads[1].keys() and "lm_head.weight" in grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], msg=n, **tol)


def test_compiled_layer_regions_equal_eager(monkeypatch):
    """train.compile_layer = "on" on the CPU: the TTT unroll with the drafter layer's
    two regions torch.compile'd gives the eager loss, hits and every parameter gradient, on two
    batches of different shapes (dynamic shapes: no failure, no fallback)."""
    import specops.drafter.model as model_mod

    torch.manual_seed(1)
    drafter = Eagle3Drafter(DrafterConfig.debug())
    head = TargetHead({}, torch.rand(32) + 0.5, 1e-6, torch.randn(96, 32), 3 * torch.randn(96, 32))
    teacher = Teacher(head, drafter.d2t, final_prenorm=True, device=torch.device("cpu"), dtype=torch.float32)
    full, _ = _packed_batch(seed=3)
    one_row = dataclasses.replace(full, **{f.name: getattr(full, f.name)[:1] for f in dataclasses.fields(full)
                                           if torch.is_tensor(getattr(full, f.name))}, n_tokens=12)
    for batch in (full, one_row):  # [2, 12], then [1, 12]
        targets = teacher_targets(teacher, batch)
        res = []
        for mode in ("off", "on"):
            regions = model_mod._LayerRegions()
            regions.mode = mode
            monkeypatch.setattr(model_mod, "LAYER_REGIONS", regions)
            drafter.zero_grad(set_to_none=True)
            out = ttt_forward(drafter, batch, targets, steps=4, decay=0.8)
            out.loss.backward()
            res.append((out, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}))
            assert not regions.failed and len(regions.compiled) == (2 if mode == "on" else 0)
        (o0, g0), (o1, g1) = res
        assert o0.count.sum() > 0
        torch.testing.assert_close(o1.loss, o0.loss, rtol=1e-5, atol=1e-6)
        assert o1.correct.tolist() == o0.correct.tolist()
        assert g0.keys() == g1.keys() and "midlayer.mlp.up_proj.weight" in g0
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_loss_and_layer_regions_equal_separate_eager(monkeypatch):
    """CUDA, bf16 autocast as in training: the default step (fused lm_head + CE, compiled layer
    regions, compiled loss) against the separate eager forms: same hits, loss and gradients within
    bf16 rounding (each path rounds its own intermediates)."""
    import specops.drafter.model as model_mod
    import specops.drafter.losses as losses_mod

    torch.manual_seed(1)
    dev = torch.device("cuda")
    drafter = Eagle3Drafter(DrafterConfig.debug()).to(dev)
    head = TargetHead({}, torch.rand(32) + 0.5, 1e-6, torch.randn(96, 32), 3 * torch.randn(96, 32))
    teacher = Teacher(head, drafter.d2t, final_prenorm=True, device=dev, dtype=torch.float32)
    batch = _packed_batch(seed=3)[0].to(dev)
    targets = teacher_targets(teacher, batch)
    res = []
    for new in (False, True):
        regions = model_mod._LayerRegions()
        regions.mode = "auto" if new else "off"
        kernels = losses_mod._LossKernels()
        kernels.mode = "auto" if new else "off"
        monkeypatch.setattr(model_mod, "LAYER_REGIONS", regions)
        monkeypatch.setattr(losses_mod, "LOSS_KERNELS", kernels)
        monkeypatch.setattr(KERNELS, "fused_loss", "on" if new else "off")
        drafter.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = ttt_forward(drafter, batch, targets, steps=4, decay=0.8)
        out.loss.backward()
        assert not regions.failed and not kernels.failed
        assert (len(regions.compiled), len(kernels.compiled)) == ((2, 1) if new else (0, 0))
        res.append((out, {n: p.grad.float().clone() for n, p in drafter.named_parameters() if p.grad is not None}))
    (o0, g0), (o1, g1) = res
    torch.testing.assert_close(o1.loss.float(), o0.loss.float(), rtol=2e-2, atol=2e-2)
    assert g0.keys() == g1.keys()
    for n in g0:
        scale = g0[n].abs().max().clamp_min(1e-6)
        assert (g1[n] - g0[n]).abs().max() / scale < 0.05, n


def test_compiled_loss_failure_falls_back_to_eager(monkeypatch, caplog):
    import specops.drafter.losses as losses_mod

    def broken(fn, **kw):
        def run(*a):
            raise RuntimeError("inductor: no working C++ compiler")
        return run

    kernels = losses_mod._LossKernels()
    kernels.mode = "on"
    monkeypatch.setattr(losses_mod, "LOSS_KERNELS", kernels)
    monkeypatch.setattr(torch, "compile", broken)
    logits = torch.randn(5, 16, requires_grad=True)
    p_all = torch.softmax(torch.randn(3, 16), -1)
    rows = torch.tensor([0, 1, 2, 1, 0])
    with caplog.at_level("WARNING", logger="specops.train"):
        ce = soft_cross_entropy(logits, p_all, rows)
    torch.testing.assert_close(ce, -(p_all[rows] * torch.log_softmax(logits, -1)).sum(-1))
    ce.sum().backward()  # the backward runs eagerly too
    assert kernels.failed and "compiled loss failed" in caplog.text and logits.grad is not None


def test_soft_cross_entropy_value_and_gradient():
    torch.manual_seed(0)
    logits = torch.randn(6, 10, dtype=torch.float64, requires_grad=True)
    p_all = torch.softmax(torch.randn(4, 10, dtype=torch.float64), -1)
    rows = torch.tensor([0, 3, 3, 1, 2, 0])
    w = torch.randn(6, dtype=torch.float64)
    (soft_cross_entropy(logits, p_all, rows) * w).sum().backward()
    ref = logits.detach().clone().requires_grad_(True)
    ce_ref = -(p_all[rows] * torch.log_softmax(ref, -1)).sum(-1)
    (ce_ref * w).sum().backward()
    torch.testing.assert_close(soft_cross_entropy(logits, p_all, rows), ce_ref)
    torch.testing.assert_close(logits.grad, ref.grad)


def test_teacher_equals_target_logits_on_draft_vocab(tiny, tmp_path):
    """Only norm + lm_head are read from the saved target; they reproduce its own logits."""
    model = tiny["model"]
    head = load_target_head(tiny["target"])
    assert head.embed.shape == (VOCAB, 64) and head.lm_head.shape == (VOCAB, 64)
    ids = torch.sort(torch.randperm(VOCAB)[:DRAFT_VOCAB]).values
    teacher = Teacher(head, ids - torch.arange(DRAFT_VOCAB), final_prenorm=True, device=torch.device("cpu"),
                      dtype=torch.float32)
    seq = tiny["train"][0][0]
    _, final, logits = target_states(model, seq)
    torch.testing.assert_close(teacher.logits(final), logits[:, ids], rtol=1e-5, atol=1e-4)
    # tied embeddings: lm_head falls back to embed_tokens
    tied = load_target_head(make_target(tmp_path / "tied", tied=True))
    assert torch.equal(tied.lm_head, tied.embed)


def test_feature_shards_bf16_and_fp8_read_back(tiny, tmp_path):
    model = tiny["model"]
    seqs = tiny["val"]
    write_features(model, seqs, tmp_path / "fp8", dtype="float8_e4m3fn", per_shard=3)
    bf16 = FeatureSplit(tiny["data"] / "features" / "val")
    fp8 = FeatureSplit(tmp_path / "fp8")
    assert len(bf16) == len(fp8) == len(seqs) and bf16.lengths == [len(i) for i, _ in seqs]
    for i in range(len(seqs)):
        a, b = bf16.get(i), fp8.get(i)
        aux, final, _ = target_states(model, seqs[i][0])
        assert torch.equal(a.input_ids, seqs[i][0]) and torch.equal(b.loss_mask, seqs[i][1].bool())
        torch.testing.assert_close(a.aux, aux, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(b.final, final, rtol=0.07, atol=0.07 * float(final.abs().max()))


def test_make_batches_budget_and_determinism():
    lengths = [5, 40, 12, 33, 7, 50, 21, 9, 64, 3] * 3
    b1 = make_batches(lengths, 100, seed=3, epoch=0)
    assert make_batches(lengths, 100, seed=3, epoch=0) == b1
    assert make_batches(lengths, 100, seed=3, epoch=1) != b1
    assert sorted(i for b in b1 for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 100 for b in b1)
    assert simulated_tau([1.0, 1.0, 1.0]) == 4.0 and simulated_tau([0.5, 0.5]) == 1.75


# ---------------------------------------------------------------- training runs



def test_heartbeat_carries_step_rate_and_eta_and_status_shows_them(tiny, tmp_path, monkeypatch):
    """Training heartbeats at least every HEARTBEAT_S of wall time whatever log_every is (here 0 s
    and log_every 1000: the time-based ones only), each with the step, steps/s, tokens/s and the ETA;
    `specops status` on a campaign whose lock is held shows `train: step s/N`, the rate and the ETA
    instead of generate's counters."""
    import specops.drafter.train as train_mod
    from specops.campaign import RunLock
    from specops.status import collect, render

    cfg = {**BASE, "total_steps": 6, "batch_tokens": 256, "log_every": 1000, "eval_every": 3,
           "checkpoint_every": 1000}
    camp = make_campaign(tmp_path, tiny["target"], cfg)
    write_features(tiny["model"], tiny["train"][:4], camp / "features" / "train")
    write_features(tiny["model"], tiny["val"], camp / "features" / "val")
    write_build({"train": tiny["train"][:4], "val": tiny["val"]}, camp / "build")
    c = Campaign(camp)
    beats = []
    real = train_mod._Trainer.heartbeat

    def record(self, step, state, tokens_per_s, steps_per_s=None):
        real(self, step, state, tokens_per_s, steps_per_s)
        beats.append(json.loads(c.heartbeat_path.read_text()))

    monkeypatch.setattr(train_mod, "HEARTBEAT_S", 0.0)
    monkeypatch.setattr(train_mod._Trainer, "heartbeat", record)
    run_train(load_config(camp.parent / "c.toml"), c)
    running = [b for b in beats if b["state"] == "running" and b["window"]["steps_per_s"]]
    assert [b["step"] for b in running] == list(range(1, 7)), beats
    for b in running:
        assert b["phase"] == "train" and b["total_steps"] == 6 and b["window"]["tokens_per_s"] > 0
        assert b["eta_s"] == pytest.approx((6 - b["step"]) / b["window"]["steps_per_s"], abs=0.1)
    assert beats[-1]["state"] == "finished"

    # status while "running": the heartbeat of step 2, the lock held by this process
    hb = dict(running[1], ts=time.time())
    c.heartbeat_path.write_text(json.dumps(hb))
    lock = RunLock(c, "train").acquire()
    try:
        rep = collect(camp)
    finally:
        lock.release()
    assert rep.state == "running" and rep.data["train"]["step"] == 2 and rep.data["remaining"] == 4
    assert rep.data["eta_s"] == pytest.approx(hb["eta_s"], abs=0.1)
    from rich.console import Console

    con = Console(width=200, record=True)
    con.print(render(rep))
    assert "train: step 2/6 (33%)" in con.export_text()
    # the beats after the val pass at step 3 (steps 4-6) carry it; status shows it under the step line
    assert [b["last_val"] is None for b in running] == [True, True, True, False, False, False]  # step 3 beats first
    val3 = next(r for r in metrics(camp, "val") if r["step"] == 3)
    assert running[3]["last_val"] == {"step": 3, "tau": val3["tau"], "tau_head": val3["tau_head"], "head_tokens": 256}
    c.heartbeat_path.write_text(json.dumps(dict(running[3], ts=time.time())))
    lock = RunLock(c, "train").acquire()
    try:
        rep = collect(camp)
    finally:
        lock.release()
    con = Console(width=200, record=True)
    con.print(render(rep))
    assert (f"val at step 3: simulated tau {val3['tau']:.3f}, over each turn's first 256 tokens "
            f"{val3['tau_head']:.3f}") in con.export_text()


def test_overfit_loss_falls_and_tau_near_k_plus_1(tiny, tmp_path):
    """4 sequences, train == val: the drafter memorises them; simulated tau -> K + 1 = 4."""
    cfg = {**BASE, "total_steps": 150, "batch_tokens": 256, "eval_every": 150, "checkpoint_every": 1000}
    camp = make_campaign(tmp_path, tiny["target"], cfg)
    model = tiny["model"]
    four = tiny["train"][:4]
    write_features(model, four, camp / "features" / "train")
    write_features(model, four, camp / "features" / "val")
    write_build({"train": four}, camp / "build")
    c = Campaign(camp)
    summary = run_train(load_config(camp.parent / "c.toml"), c)
    rows = metrics(camp)
    assert len(rows) == 150 and summary["finished"]
    first, last = sum(r["loss"] for r in rows[:5]) / 5, sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    val = metrics(camp, "val")[-1]
    assert val["tau"] > 0.8 * (3 + 1), val
    assert summary["val"]["tau"] == val["tau"]
    m = c.read_manifest()["phases"]["train"]
    assert m["state"] == "done" and m["tau"] == val["tau"]
    drafter_manifest = json.loads((camp / "drafter" / "manifest.json").read_text())["train"]
    assert drafter_manifest["conventions"]["aux_layer_ids"] == default_aux_layer_ids(6) == [2, 3, 5]
    # the final checkpoint loads on its own and carries the campaign's vocab
    ck = Path(summary["checkpoint"])
    assert ck.name == "step-150"
    d = load_drafter(ck)
    vocab = load_file(str(camp / "build" / "vocab.safetensors"))
    assert torch.equal(d.d2t, vocab["d2t"]) and torch.equal(d.t2d, vocab["t2d"])
    assert torch.equal(d.embed_tokens.weight, load_target_head(tiny["target"]).embed)  # frozen


def test_online_mode_with_features_fn_loss_falls(tiny, tmp_path):
    """mode = online: build/ token data + a features_fn computing aux/final in process."""
    cfg = {**BASE, "mode": "online", "total_steps": 30, "batch_tokens": 128, "eval_every": 30,
           "checkpoint_every": 1000}
    c = seed_campaign(tiny, tmp_path, cfg, parts=("build",))
    model = tiny["model"]
    calls = []

    def features_fn(batch: list[torch.Tensor]) -> dict:
        calls.append(len(batch))
        aux, final = zip(*[target_states(model, ids)[:2] for ids in batch])
        return {"aux": torch.cat(aux), "final": torch.cat(final)}

    summary = run_train(load_config(c.root.parent / "c.toml"), c, features_fn=features_fn)
    rows = metrics(c.root)
    assert summary["finished"] and calls and not (c.root / "features").exists()
    assert sum(r["loss"] for r in rows[-5:]) < 0.8 * sum(r["loss"] for r in rows[:5])
    assert metrics(c.root, "val")[-1]["tau"] > 1.0


def test_default_online_features_fn_is_the_target(tiny):
    """run_train's default for mode = online: the in-process target's forward, unpadded per sample."""
    from specops.drafter.train import target_features_fn

    fn = target_features_fn(tiny["target"], torch.device("cpu"))
    assert fn.aux_layer_ids == default_aux_layer_ids(6) == [2, 3, 5]
    seqs = [ids for ids, _ in tiny["val"][:3]]
    assert len({len(s) for s in seqs}) > 1  # right padding is exercised
    out = fn(seqs)
    for i, ids in enumerate(seqs):
        aux, final, _ = target_states(tiny["model"], ids)
        torch.testing.assert_close(out["aux"][i], aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["final"][i], final, rtol=1e-5, atol=1e-5)


RESUME = {**BASE, "total_steps": 100, "batch_tokens": 64, "grad_accum": 2, "checkpoint_every": 5,
          "eval_every": 40, "keep_checkpoints": 3}


def _train_proc(camp: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "specops", "train", str(camp)],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env)


def _wait_for(p: subprocess.Popen, path: Path, log: Path) -> None:
    deadline = time.time() + 120
    while not path.is_dir():
        assert p.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline
        time.sleep(0.002)


def test_kill9_and_sigterm_then_resume_replay_the_same_loss_curve(tiny, tmp_path):
    ref = seed_campaign(tiny, tmp_path, RESUME, name="ref")
    run = seed_campaign(tiny, tmp_path, RESUME, name="run")
    log = tmp_path / "run.log"
    p = _train_proc(ref.root, tmp_path / "ref.log")
    assert p.wait(timeout=120) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    ckdir = run.root / "drafter" / "checkpoints"

    # 1. SIGKILL right after the second checkpoint
    p = _train_proc(run.root, log)
    _wait_for(p, ckdir / "step-10", log)
    p.send_signal(signal.SIGKILL)
    p.wait()
    done = len(metrics(run.root))
    assert 10 <= done < 100, f"the kill landed after the run ended ({done} steps logged)"
    assert run.read_manifest()["phases"]["train"]["state"] == "running"  # a dead runner, as status sees it

    # 2. resume, then SIGTERM: the step in flight finishes, is checkpointed, exit 130
    p = _train_proc(run.root, log)
    _wait_for(p, ckdir / "step-40", log)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 130, log.read_text()[-3000:]
    assert re.search(r"resumed from .*step-(10|15|20)\b", log.read_text()), log.read_text()[-2000:]
    stopped = metrics(run.root)[-1]["step"]
    assert 40 <= stopped < 100 and (ckdir / f"step-{stopped}").is_dir()
    phase = run.read_manifest()["phases"]["train"]
    assert phase["state"] == "pending" and "rerun to resume" in phase["interrupted_reason"]

    # 3. resume to the end
    p = _train_proc(run.root, log)
    assert p.wait(timeout=120) == 0, log.read_text()[-3000:]
    assert f"resumed from {ckdir / f'step-{stopped}'}" in log.read_text()

    a, b = metrics(ref.root), metrics(run.root)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 101))
    for ra, rb in zip(a, b):
        assert ra["epoch"] == rb["epoch"] and ra["tokens"] == rb["tokens"]
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6, abs=1e-9), (ra["step"], ra["loss"], rb["loss"])
    va, vb = metrics(ref.root, "val"), metrics(run.root, "val")
    assert [r["step"] for r in va] == [r["step"] for r in vb] == [40, 80, 100]
    assert vb[-1]["tau"] == pytest.approx(va[-1]["tau"], rel=1e-6)
    wa = load_file(str(ref.root / "drafter" / "checkpoints" / "step-100" / "model.safetensors"))
    wb = load_file(str(ckdir / "step-100" / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6)
    assert sorted(p.name for p in ckdir.iterdir()) == ["step-100", "step-90", "step-95"]  # keep 3, no temp dirs
    assert run.read_manifest()["phases"]["train"]["state"] == "done"


def test_ddp_two_ranks_equals_one_rank_with_accumulation(tiny, tmp_path):
    """torchrun --nproc-per-node 2 (gloo) with grad_accum 1 sees the same micro-batches per step as
    one process with grad_accum 2; DDP's gradient mean == the accumulated mean."""
    common = {**BASE, "total_steps": 8, "batch_tokens": 64, "checkpoint_every": 4, "eval_every": 8}
    one = seed_campaign(tiny, tmp_path, {**common, "grad_accum": 2}, name="one")
    two = seed_campaign(tiny, tmp_path, {**common, "grad_accum": 1}, name="two")
    run_train(load_config(tmp_path / "one.toml"), one)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(29500 + os.getpid() % 1000), "-m", "specops", "train",
                        str(two.root)], capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    a, b = metrics(one.root), metrics(two.root)
    assert len(a) == len(b) == 8
    for ra, rb in zip(a, b):
        assert ra["tokens"] == rb["tokens"]
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5), ra["step"]
    assert metrics(two.root, "val")[-1]["tau"] == pytest.approx(metrics(one.root, "val")[-1]["tau"], rel=1e-4)
    assert sorted(p.name for p in (two.root / "drafter" / "checkpoints").iterdir()) == ["step-4", "step-8"]


def test_prefetch_thread_changes_nothing_but_speed(tiny, tmp_path, monkeypatch):
    """The read-ahead thread (default) and the inline loader train on the same batches in the same
    order: identical loss curves and final weights, across epoch ends and with grad_accum 2; and
    the prefetcher really served the batches (each loaded once, none inline)."""
    import specops.drafter.train as train_mod

    common = {**BASE, "epochs": 3, "batch_tokens": 96, "grad_accum": 2, "checkpoint_every": 1000, "eval_every": 1000}
    on = seed_campaign(tiny, tmp_path, {**common, "prefetch": True}, name="on")
    off = seed_campaign(tiny, tmp_path, {**common, "prefetch": False}, name="off")
    served, submitted = [], []
    real_get, real_want = train_mod._Prefetcher.get, train_mod._Prefetcher.want

    def get(self, key, idxs):
        served.append((key, key in self.pending))
        return real_get(self, key, idxs)

    def want(self, keys):
        before = set(self.pending)
        real_want(self, keys)
        submitted.extend(k for k in self.pending if k not in before)

    monkeypatch.setattr(train_mod._Prefetcher, "get", get)
    monkeypatch.setattr(train_mod._Prefetcher, "want", want)
    s_on = run_train(load_config(tmp_path / "on.toml"), on)
    monkeypatch.undo()
    s_off = run_train(load_config(tmp_path / "off.toml"), off)
    a, b = metrics(on.root), metrics(off.root)
    assert len(a) == len(b) == s_on["total_steps"] and s_on["total_steps"] >= 6
    assert len({r["epoch"] for r in a}) == 3  # the read-ahead crossed two epoch ends
    for ra, rb in zip(a, b):
        assert (ra["tokens"], ra["loss"], ra["acc"]) == (rb["tokens"], rb["loss"], rb["acc"]), ra["step"]
    assert len(served) == 2 * s_on["total_steps"] and all(hit for _, hit in served)
    assert sorted(submitted) == sorted(k for k, _ in served)  # each batch read once, none wasted
    wa = load_file(str(Path(s_on["checkpoint"]) / "model.safetensors"))
    wb = load_file(str(Path(s_off["checkpoint"]) / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_torch_load_is_weights_only():
    """Every torch.load in the package (checkpoints, third-party drafter dirs) refuses pickled code."""
    calls = {f"{p.name}: {c}" for p in (REPO / "src" / "specops").rglob("*.py")
             for c in re.findall(r"torch\.load\(([^)]*)\)", p.read_text())}
    assert len(calls) >= 3 and all("weights_only=True" in c for c in calls), calls


def test_ttt_ops_bench_runs_and_reports(tmp_path):
    """bench/ttt_ops.py: counts the unroll's dispatched ops (forward and backward) and times it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "r.json"
    bench = Path(__file__).resolve().parents[1] / "bench" / "ttt_ops.py"
    p = subprocess.run([sys.executable, str(bench), "--iters", "2", "--warmup", "0", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["ops"] == r["forward_ops"] + r["backward_ops"] and r["forward_ops"] > 100 and r["backward_ops"] > 100
    assert r["min_ms"] > 0 and r["loss"] > 0 and dict(r["top_ops"]).get("aten.mm", 0) > 0


AB_COMMON = {**BASE, "total_steps": 4, "batch_tokens": 96, "eval_every": 4, "checkpoint_every": 1000}


def train_ab(tiny, tmp_path: Path, switch: dict) -> tuple[Campaign, Campaign]:
    """The same short run twice, the second with `switch` on top: (default campaign, switched one)."""
    a = seed_campaign(tiny, tmp_path, AB_COMMON, name="a")
    b = seed_campaign(tiny, tmp_path, {**AB_COMMON, **switch}, name="b")
    run_train(load_config(tmp_path / "a.toml"), a)
    run_train(load_config(tmp_path / "b.toml"), b)
    return a, b


def test_loss_on_prompt_trains_on_every_token_and_validates_on_the_generated_ones(tiny, tmp_path):
    """train.loss_on_prompt: the train split's samples count every token (the prompt's too), so the
    same batches give another loss; the val pass still counts only the generated tokens, so its
    positions equal the default run's and val stays comparable across the two recipes."""
    from specops.drafter.train import FeatureSplit

    a, b = train_ab(tiny, tmp_path, {"loss_on_prompt": True})
    ta, tb = metrics(a.root), metrics(b.root)
    assert [r["tokens"] for r in ta] == [r["tokens"] for r in tb]  # the same batches
    assert ta[0]["loss"] != tb[0]["loss"]
    va, vb = metrics(a.root, "val")[-1], metrics(b.root, "val")[-1]
    assert va["positions"] == vb["positions"] and va["positions"][0] > 0
    # the graph-ready step (train.cuda_graphs; eager on a CPU) takes the same masks
    c = seed_campaign(tiny, tmp_path, {**AB_COMMON, "loss_on_prompt": True, "cuda_graphs": True}, name="c")
    run_train(load_config(tmp_path / "c.toml"), c)
    assert metrics(c.root, "val")[-1]["positions"] == va["positions"]
    split = FeatureSplit(b.root / "features" / "train")
    stored = split.get(0).loss_mask
    split.all_positions = True
    assert not stored.all() and split.get(0).loss_mask.all() and len(split) == len(FeatureSplit(a.root / "features" / "train"))


def test_init_norm_from_target_starts_the_drafter_readout_as_the_targets(tiny, tmp_path):
    """train.init_norm_from_target: the drafter's final norm starts at the target's final norm weight
    (the tiny target's is uniform in 0.5..1.5), so with the frozen lm_head its readout starts as the
    target's; by default it starts at ones. One step at lr 1e-9 leaves either where it began."""
    from specops.target.inprocess import load_target_head

    common = {**BASE, "lr": 1e-9, "total_steps": 1, "batch_tokens": 96, "eval_every": 1000, "checkpoint_every": 1000}
    want = load_target_head(tiny["target"]).norm_weight.float()
    assert not torch.allclose(want, torch.ones_like(want), atol=0.1)
    for name, init in (("plain", False), ("init", True)):
        camp = seed_campaign(tiny, tmp_path, {**common, "init_norm_from_target": init}, name=name)
        s = run_train(load_config(tmp_path / f"{name}.toml"), camp)
        w = load_file(str(Path(s["checkpoint"]) / "model.safetensors"))["norm.weight"].float()
        torch.testing.assert_close(w, want if init else torch.ones_like(want), atol=1e-6, rtol=0)


def test_a_run_of_few_optimizer_steps_is_warned_about(tiny, tmp_path, caplog):
    """Fewer than FEW_STEPS optimizer steps from epochs x batches (on real SmolLM2 data, 8,192
    tokens/step scores 0.98 val simulated tau below 2,048 for the same data and epochs) is said
    loudly and kept in the manifest; a run whose total_steps the user set is taken as meant."""
    common = {**BASE, "epochs": 1, "batch_tokens": 96, "eval_every": 1000, "checkpoint_every": 1000}
    camp = seed_campaign(tiny, tmp_path, common, name="few")
    with caplog.at_level("WARNING", logger="specops.train"):
        run_train(load_config(tmp_path / "few.toml"), camp)
    assert "few optimizer steps" in caplog.text and "train.batch_tokens" in caplog.text
    m = json.loads((Path(camp.root) / "drafter" / "manifest.json").read_text())["train"]
    assert len(m["warnings"]) == 1 and m["warnings"][0].startswith(f"few optimizer steps: {m['counts']['total_steps']} ")
    caplog.clear()
    camp = seed_campaign(tiny, tmp_path, {**common, "total_steps": 2}, name="set")
    with caplog.at_level("WARNING", logger="specops.train"):
        run_train(load_config(tmp_path / "set.toml"), camp)
    assert "few optimizer steps" not in caplog.text
    assert json.loads((Path(camp.root) / "drafter" / "manifest.json").read_text())["train"]["warnings"] == []


def test_turn_head_keeps_the_first_tokens_of_each_turn():
    from specops.drafter.train import turn_head

    m = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    assert turn_head(m, 2).int().tolist() == [0, 1, 1, 0, 0, 1, 1, 0, 1, 1, 0, 0]
    assert turn_head(m, 100).equal(m) and not turn_head(m, 0).any()
    assert turn_head(torch.ones(5, dtype=torch.bool), 3).int().tolist() == [1, 1, 1, 0, 0]


def test_val_reports_the_first_eval_tokens_of_each_turn_too(tiny, tmp_path):
    """Each val row also holds acc/tau/positions over the first eval.max_new_tokens tokens of every
    generated turn (what eval measures); with a window longer than any turn they equal the whole."""
    common = {**BASE, "total_steps": 2, "batch_tokens": 96, "eval_every": 2, "checkpoint_every": 1000}
    rows = {}
    for name, n in (("long", 10_000), ("short", 3)):
        camp = seed_campaign(tiny, tmp_path, common, name=name)
        cfg_path = tmp_path / f"{name}.toml"
        cfg_path.write_text(cfg_path.read_text() + f"[eval]\nmax_new_tokens = {n}\n")
        run_train(load_config(cfg_path), camp)
        rows[name] = metrics(camp.root, "val")[-1]
    long, short = rows["long"], rows["short"]
    assert long["head_tokens"] == 10_000 and short["head_tokens"] == 3
    assert long["acc_head"] == long["acc"] and long["positions_head"] == long["positions"]
    assert long["tau_head"] == long["tau"]
    # 4 val samples, one turn each: step k counts slots whose target x[t+2+k] lies in the first 3
    # tokens of the turn, so at most 3 per sample at step 0, and the whole-turn figures are unchanged
    assert short["positions"] == long["positions"] and short["acc"] == long["acc"]
    assert 0 < short["positions_head"][0] <= 3 * 4 < long["positions"][0]


def test_mask_repetition_trains_without_greedy_loops_and_validates_as_before(tiny, tmp_path):
    """train.mask_repetition: the training loss skips tokens repeating a build.repetition_ngram
    window of their turn (the tiny target's greedy sequences loop); val positions are unchanged."""
    import numpy as np

    from specops.text import repeating_tokens
    from specops.drafter.train import FeatureSplit, without_repeats

    a, b = train_ab(tiny, tmp_path, {"mask_repetition": True})
    ta, tb = metrics(a.root), metrics(b.root)
    assert [r["tokens"] for r in ta] == [r["tokens"] for r in tb] and ta[0]["loss"] != tb[0]["loss"]
    assert metrics(a.root, "val")[-1]["positions"] == metrics(b.root, "val")[-1]["positions"]
    split = FeatureSplit(a.root / "features" / "train")
    plain = [split.get(i) for i in range(len(split))]
    split.mask_fn = without_repeats(4)
    masked = [split.get(i) for i in range(len(split))]
    dropped = 0
    for p, q in zip(plain, masked):
        rep = repeating_tokens(p.input_ids.numpy().astype(np.int32), p.loss_mask.numpy().astype(np.uint8), 4)
        assert q.loss_mask.equal(p.loss_mask & ~torch.from_numpy(rep))
        dropped += int(rep.sum())
    assert dropped > 0  # the tiny model's greedy continuations do loop


def test_eval_on_val_the_loops_first_drafts_are_the_teacher_forced_ones(tiny, tmp_path):
    """bench/quality/eval_on_val.py on a trained tiny drafter: the evaluator's loop (k=3, T=0)
    accepts its first draft exactly where the drafter's teacher-forced step-0 prediction, over the
    tokens the loop generated, is right at the round starts; the offset buckets cover every
    recorded response token."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("eval_on_val", Path(__file__).parents[1] / "bench" / "quality" / "eval_on_val.py")
    eov = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(eov)
    camp = seed_campaign(tiny, tmp_path, {**BASE, "total_steps": 40, "batch_tokens": 256, "eval_every": 1000,
                                          "checkpoint_every": 1000})
    s = run_train(load_config(tmp_path / "c.toml"), camp)
    out = tmp_path / "eov.json"
    assert eov.main(["--campaign", str(camp.root), "--model", str(tiny["target"]), "--drafter", s["checkpoint"],
                     "--samples", "4", "--k", "3", "--new-tokens", "24", "--bucket", "8", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    loop, tf = r["loop"], r["teacher_forced_step0_on_loop_tokens"]
    assert r["samples"] == 4 and loop["target_steps"] == tf["rounds"] > 0
    assert loop["position_accepted"][0] == round(tf["round_starts"] * tf["rounds"])  # the same count
    assert loop["acceptance_per_position"][0] == pytest.approx(tf["round_starts"])
    # every generated token but each turn's first (the target's own pick after the prompt, never drafted)
    assert tf["tokens"] == loop["generated_tokens"] - r["samples"]
    responses = sum(int(m.sum()) for _, m in tiny["val"])
    assert sum(b["tokens"] for b in r["teacher_forced_step0_by_response_offset"].values()) == responses
    assert set(r["teacher_forced_step0_by_response_offset"]) <= {"0-7", "8-15", "16-23", "24-31"}
