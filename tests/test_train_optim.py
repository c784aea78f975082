"""train.optimizer ("adamw" | "muon"), train.freeze_lm_head, train.lr_schedule and train.muon_ns_dtype:
which parameter each optimizer updates, the schedule's values, the Newton-Schulz step in fp32 and bf16
against the exact spectral map, a run that learns, and exact resume (drafter/optim.py)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from specops.config import load_config
from specops.drafter.model import DrafterConfig, Eagle3Drafter
from specops.drafter.optim import Muon, OptimizerSet, build_optimizer, lr_lambda, muon_ns_dtype, newton_schulz
from specops.drafter.train import run_train
from specops.errors import ConfigError

from train_builders import BASE, metrics, seed_campaign

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_lr_schedules_warm_up_then_decay_to_the_floor():
    cos, lin = lr_lambda(4, 24, 0.1, "cosine"), lr_lambda(4, 24, 0.1, "linear")
    for f in (cos, lin):
        assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
        assert f(4) == pytest.approx(1.0) and f(24) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert lin(14) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: linear
    assert cos(14) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos(9) > lin(9) and cos(19) < lin(19)  # cosine stays high longer, then falls faster
    with pytest.raises(ConfigError, match="train.lr_schedule"):
        lr_lambda(1, 2, 0.0, "step")


def test_defaults_are_the_speculators_recipe():
    """This recipe scores above AdamW on every weight + cosine on the real campaign's val split
    (simulated tau 4.07 vs 2.60), so a config that says nothing gets it; each part can be set back."""
    from specops.config import TrainSection

    t = TrainSection()
    assert (t.optimizer, t.freeze_lm_head, t.lr_schedule, t.min_lr_ratio) == ("muon", True, "linear", 0.0)
    assert (t.lr, t.max_grad_norm, t.weight_decay, t.pack_rows) == (1e-3, 1.0, 0.1, None)
    old = TrainSection(optimizer="adamw", freeze_lm_head=False, lr_schedule="cosine")
    assert (old.optimizer, old.freeze_lm_head, old.lr_schedule) == ("adamw", False, "cosine")


def _tc(**kw):
    base = dict(optimizer="adamw", lr=1e-3, weight_decay=0.1, warmup_steps=2, min_lr_ratio=0.0, lr_schedule="linear",
                muon_ns_dtype="auto")
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("freeze_head", [False, True])
def test_muon_takes_the_layer_matrices_and_adamw_the_rest(freeze_head):
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.debug())
    d.embed_tokens.weight.requires_grad_(False)
    d.lm_head.weight.requires_grad_(not freeze_head)
    opt, sched = build_optimizer(d, _tc(optimizer="muon"), fused=False, total_steps=10)
    assert isinstance(opt, OptimizerSet) and sorted(opt.parts) == ["adamw", "muon"]
    names = {id(p): n for n, p in d.named_parameters()}
    muon = sorted(names[id(p)] for g in opt.parts["muon"].param_groups for p in g["params"])
    adamw = sorted(names[id(p)] for g in opt.parts["adamw"].param_groups for p in g["params"])
    assert muon == sorted(n for n, p in d.named_parameters() if p.dim() == 2 and n not in
                          ("embed_tokens.weight", "lm_head.weight"))
    assert "fc.weight" in muon and "midlayer.mlp.down_proj.weight" in muon
    assert ("lm_head.weight" in adamw) == (not freeze_head) and "embed_tokens.weight" not in adamw
    assert all(n.endswith("norm.weight") for n in adamw if n != "lm_head.weight")
    # one step moves every trainable parameter and nothing frozen; the lr follows the warm-up
    before = {n: p.detach().clone() for n, p in d.named_parameters()}
    for p in d.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5e-3)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    for n, p in d.named_parameters():
        assert torch.equal(p, before[n]) == (not p.requires_grad), n
    assert torch.equal(d.lm_head.weight, before["lm_head.weight"]) == freeze_head


def test_muon_frozen_head_linear_run_learns_and_resumes_exactly(tiny, tmp_path):
    """The speculators-like recipe in our trainer (Muon, frozen lm_head, linear schedule to 0): the
    loss falls, lm_head stays the target's rows, and a run stopped at step 5 and resumed ends with the
    uninterrupted run's weights and loss curve. Resuming it as AdamW is refused, naming the key."""
    cfg = {**BASE, "epochs": 4, "batch_tokens": 96, "checkpoint_every": 1000, "eval_every": 1000,
           "optimizer": "muon", "freeze_lm_head": True, "lr_schedule": "linear", "min_lr_ratio": 0.0,
           "weight_decay": 0.1, "lr": 2e-2}
    whole = seed_campaign(tiny, tmp_path, cfg, name="whole")
    split = seed_campaign(tiny, tmp_path, cfg, name="split")
    s_whole = run_train(load_config(tmp_path / "whole.toml"), whole)
    m = metrics(whole.root)
    assert s_whole["finished"] and m[-1]["loss"] < 0.7 * m[0]["loss"]
    assert m[-1]["lr"] < m[len(m) // 2]["lr"] < m[5]["lr"] == pytest.approx(2e-2)  # after the 5 warm-up steps
    run_train(load_config(tmp_path / "split.toml"), split, max_steps=5)
    s_split = run_train(load_config(tmp_path / "split.toml"), split)
    assert s_split["resumed_from"] == 5 and s_split["step"] == s_whole["step"]
    a, b = metrics(whole.root), metrics(split.root)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    wa = load_file(str(Path(s_whole["checkpoint"]) / "model.safetensors"))
    wb = load_file(str(Path(s_split["checkpoint"]) / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    first = Eagle3Drafter(DrafterConfig.from_dict(__import__("json").loads(
        (Path(s_whole["checkpoint"]) / "drafter_config.json").read_text())))
    assert first.lm_head.weight.shape == wa["lm_head.weight"].shape
    # lm_head never moved: equal to the target's rows of the draft vocab (what init_from_target copies)
    from specops.target.inprocess import load_target_head
    head = load_target_head(tiny["target"])
    rows = torch.arange(wa["d2t"].numel()) + wa["d2t"]
    torch.testing.assert_close(wa["lm_head.weight"], head.lm_head[rows].to(wa["lm_head.weight"].dtype))

    # six epochs (steps left to run), resumed with the other optimizer: refused before any step
    text = (tmp_path / "split.toml").read_text().replace('"muon"', '"adamw"').replace("epochs = 4", "epochs = 6")
    (tmp_path / "split.toml").write_text(text)
    with pytest.raises(ConfigError, match="train.optimizer"):
        run_train(load_config(tmp_path / "split.toml"), split)
    assert metrics(split.root) == b  # nothing trained, nothing logged


def test_adamw_state_is_refused_by_a_muon_run():
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.debug())
    plain, _ = build_optimizer(d, _tc(), fused=False, total_steps=10)
    muon, _ = build_optimizer(d, _tc(optimizer="muon"), fused=False, total_steps=10)
    with pytest.raises(ConfigError, match="resume with the train.optimizer"):
        muon.load_state_dict(plain.state_dict())


# ---------------------------------------------------------------- train.muon_ns_dtype

NS = (3.4445, -4.7750, 2.0315)  # torch's (Keller Jordan's) quintic coefficients


def _exact_ns(g: torch.Tensor, steps: int) -> torch.Tensor:
    """What the iteration computes in exact arithmetic, in float64: g = U S V^T, each singular value
    s / ||g||_F mapped `steps` times by s -> a s + b s^3 + c s^5, U and V kept."""
    a, b, c = NS
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    s = s / s.norm()
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return u @ torch.diag(s) @ vh


def _ns_bound(dtype: torch.dtype, shape: tuple[int, int], steps: int) -> float:
    """A first-order bound on ||NS_dtype(g) - exact||_F / ||exact||_F: the input cast and the three
    GEMM outputs of each step are rounded to `dtype` (unit round-off u: 2^-8 for bf16, 2^-24 for fp32),
    and each GEMM accumulates its k <= max(shape) products in fp32 (at most k 2^-24). Summed as if
    nothing cancelled; the iteration damps rather than grows an error once the singular values near 1
    (|p'(1)| = |a + 3b + 5c| = 0.72)."""
    u = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}[dtype]
    return (3 * steps + 1) * (u + max(shape) * 2.0**-24)


@pytest.mark.parametrize("shape", [(48, 160), (160, 48)])  # wide, and tall (worked on transposed)
def test_newton_schulz_in_fp32_and_bf16_match_the_exact_map_within_their_round_off(shape):
    """fp32 (the CPU default) and bf16 (CUDA's, torch's own) give the same orthogonalisation: each
    within its dtype's round-off of the exact spectral map, so within bf16's of each other; the result
    keeps g's singular vectors with every singular value in the iteration's band around 1."""
    torch.manual_seed(0)
    g = torch.randn(*shape)
    before = g.clone()
    exact = _exact_ns(g, 5)
    sv = torch.linalg.svdvals(exact)
    assert sv.min() > 0.6 and sv.max() < 1.2  # orthogonal-ish: U S' V^T, S' near the identity
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        out[dtype] = newton_schulz(g, NS, 5, 1e-7, dtype)
        assert out[dtype].dtype == dtype and out[dtype].shape == g.shape
        err = ((out[dtype].double() - exact).norm() / exact.norm()).item()
        assert err < _ns_bound(dtype, shape, 5), (dtype, err)
    assert torch.equal(g, before)  # the gradient is left alone
    f32, bf16 = out[torch.float32].double(), out[torch.bfloat16].double()
    assert ((f32 - bf16).norm() / f32.norm()).item() < 2 * _ns_bound(torch.bfloat16, shape, 5)
    # the bounds tell maps apart: one step fewer, in fp32, lies outside even bf16's (0.34 against 0.063)
    fewer = newton_schulz(g, NS, 4, 1e-7, torch.float32).double()
    assert ((fewer - exact).norm() / exact.norm()).item() > 2 * _ns_bound(torch.bfloat16, shape, 5)


def test_muon_in_bf16_steps_exactly_like_torchs_and_fp32_close_to_it():
    """Our Muon with ns_dtype = bf16 is torch.optim.Muon bit for bit (momentum, Nesterov, weight decay,
    the match_rms_adamw lr scale, tall and wide matrices, three steps); with fp32 the parameters move
    by the same update up to bf16's round-off of it."""
    torch.manual_seed(0)
    shapes = [(24, 40), (40, 24), (16, 16)]
    init = [torch.randn(*s) * 0.1 for s in shapes]
    grads = [[torch.randn(*s) for s in shapes] for _ in range(3)]
    kw = dict(lr=2e-2, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw")

    def run(make):
        ps = [torch.nn.Parameter(w.clone()) for w in init]
        opt = make(ps)
        for gs in grads:
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
            opt.step()
        return [p.detach() for p in ps], opt

    ref, topt = run(lambda ps: torch.optim.Muon(ps, **kw))
    ours, oopt = run(lambda ps: Muon(ps, ns_dtype=torch.bfloat16, **kw))
    assert all(torch.equal(a, b) for a, b in zip(ref, ours))
    # same state layout: a checkpoint of one loads into the other
    assert oopt.state_dict()["param_groups"] == topt.state_dict()["param_groups"]
    f32, _ = run(lambda ps: Muon(ps, ns_dtype=torch.float32, **kw))
    for w0, a, b, s in zip(init, ref, f32, shapes):
        moved = (a - w0).norm().item()
        assert 0 < (a - b).norm().item() < 2 * _ns_bound(torch.bfloat16, s, 5) * moved


def test_muon_ns_dtype_auto_is_fp32_on_the_cpu_and_bf16_on_cuda():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert muon_ns_dtype("auto", cpu) == torch.float32 and muon_ns_dtype("auto", cuda) == torch.bfloat16
    assert muon_ns_dtype("bfloat16", cpu) == torch.bfloat16 and muon_ns_dtype("float32", cuda) == torch.float32
    with pytest.raises(ConfigError, match="train.muon_ns_dtype"):
        muon_ns_dtype("float16", cpu)
    d = Eagle3Drafter(DrafterConfig.debug())
    for choice, want in (("auto", torch.float32), ("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        opt, _ = build_optimizer(d, _tc(optimizer="muon", muon_ns_dtype=choice), fused=False, total_steps=10)
        assert isinstance(opt.parts["muon"], Muon) and opt.parts["muon"].ns_dtype == want


def test_muon_ns_dtype_is_a_checked_train_key(tmp_path):
    from train_builders import make_campaign

    (tmp_path / "t").mkdir()
    make_campaign(tmp_path, tmp_path / "t", {"muon_ns_dtype": "bfloat16"}, name="ok")
    assert load_config(tmp_path / "ok.toml").train.muon_ns_dtype == "bfloat16"
    bad = (tmp_path / "ok.toml").read_text().replace('"bfloat16"', '"float16"')
    (tmp_path / "bad.toml").write_text(bad)
    with pytest.raises(ConfigError, match="train.muon_ns_dtype"):
        load_config(tmp_path / "bad.toml")
