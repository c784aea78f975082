"""The DFlash family: its block attention against a dense reference, the objective against the
drafting rule at every anchor, the static form against the selecting one, training with resume on
the tiny target, and the eval loop with a DFlash drafter (exports and their check:
tests/test_dflash_export.py; served by vLLM: tests/test_serve_dflash.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specops.config import TrainSection, load_config
from specops.drafter.batch import Teacher, teacher_targets
from specops.drafter.checkpoint import load_drafter
from specops.drafter.families import FAMILIES, family_named, family_of
from specops.drafter.families.dflash import DFLASH
from specops.drafter.families.dflash.drafting import DFlashRunner
from specops.drafter.families.dflash.model import DFlashConfig, DFlashDrafter, _rotate_half
from specops.drafter.families.dflash.objective import dflash_forward, dflash_forward_static
from specops.drafter.train import run_train
from specops.errors import ConfigError

from train_builders import BASE, _packed_batch, metrics, seed_campaign

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny matmuls, a shared 2-core box

K = 3  # mask slots a block in the unit tests


def dflash_debug(seed: int = 0, **kw) -> DFlashDrafter:
    """A tiny DFlash drafter (DFlashConfig.debug, aux ids [1, 2, 3] unless kw names others) with a
    random d2t and its norms away from 1 (a skipped one shows)."""
    torch.manual_seed(seed)
    cfg = DFlashConfig.debug(**{"aux_layer_ids": [1, 2, 3], "block_size": K + 1, **kw})
    d = DFlashDrafter(cfg).eval()
    with torch.no_grad():
        ids = torch.randperm(cfg.target_vocab_size, generator=torch.Generator().manual_seed(seed))
        d.set_vocab(ids[: cfg.draft_vocab_size].sort().values - torch.arange(cfg.draft_vocab_size))
        for n, p in d.named_parameters():  # norms away from 1, so a skipped one shows
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return d


def reference_block(d: DFlashDrafter, aux: torch.Tensor, ctx_pos: torch.Tensor, ids: torch.Tensor,
                    pos: torch.Tensor) -> torch.Tensor:
    """The math of vLLM's DFlash round written out densely, one block: aux [S, n_aux, H_t] at ctx_pos
    [S], block ids / pos [L] -> logits [L, Vd]. Per layer: context K/V from hidden_norm(fc(aux)),
    block q/k/v from input_layernorm(h), one SDPA over [context | block] with no mask."""
    c = d.config
    cn = d.hidden_norm(d.fc(aux.flatten(-2)))  # [S, H]
    h = d.embed_tokens(ids)  # [L, H]
    cos_c, sin_c = d.rope(ctx_pos[None])
    cos_b, sin_b = d.rope(pos[None])
    rot = lambda x, cos, sin: x * cos[0, :, None] + _rotate_half(x) * sin[0, :, None]  # noqa: E731
    for layer in d.layers:
        a = layer.self_attn
        kc = rot(a.k_norm(a.k_proj(cn).view(-1, c.num_key_value_heads, c.head_dim)), cos_c, sin_c)
        vc = a.v_proj(cn).view(-1, c.num_key_value_heads, c.head_dim)
        x = layer.input_layernorm(h)
        q = rot(a.q_norm(a.q_proj(x).view(-1, c.num_attention_heads, c.head_dim)), cos_b, sin_b)
        kb = rot(a.k_norm(a.k_proj(x).view(-1, c.num_key_value_heads, c.head_dim)), cos_b, sin_b)
        vb = a.v_proj(x).view(-1, c.num_key_value_heads, c.head_dim)
        keys, vals = torch.cat([kc, kb]), torch.cat([vc, vb])  # [S+L, nkv, d]
        rep = c.num_attention_heads // c.num_key_value_heads
        o = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1).repeat_interleave(rep, 0),
                                           vals.transpose(0, 1).repeat_interleave(rep, 0))  # [nh, L, d]
        h = h + a.o_proj(o.transpose(0, 1).reshape(len(ids), -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return d.lm_head(d.norm(h))


def _head(d, batch):
    from specops.target.inprocess import TargetHead

    g = torch.Generator().manual_seed(5)
    H, V = batch.final.shape[-1], d.config.target_vocab_size
    return TargetHead({"vocab_size": V, "hidden_size": H}, torch.rand(H, generator=g) + 0.5, 1e-6,
                      torch.randn(V, H, generator=g), 3 * torch.randn(V, H, generator=g))


def _teacher(d, batch):
    return Teacher(_head(d, batch), d.d2t, final_prenorm=True, device=torch.device("cpu"), dtype=torch.float32)


def test_config_and_registry_know_dflash():
    assert "dflash" in FAMILIES and family_named("dflash") is DFLASH
    d = dflash_debug()
    assert family_of(d) is DFLASH
    with pytest.raises(ConfigError, match="dflash_layers"):
        TrainSection(drafter="dflash", dflash_layers=0)
    cfg = DFLASH.new_config({"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "num_hidden_layers": 6, "eos_token_id": 2}, 48, [1, 2, 3],
                            DFLASH.resolve_train(TrainSection(drafter="dflash", ttt_steps=5, dflash_layers=2),
                                                 {"vocab_size": 96, "eos_token_id": 2}, lambda: None))
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.mask_token_id) == (2, 6, 2)


def test_objective_blocks_equal_the_dense_reference_at_every_anchor():
    """Slot j of the block anchored at t (the objective, all anchors in one forward) = the dense
    reference of vLLM's round at P = t: context aux_0..aux_{t-1} of t's document, block
    [x_t, mask x K] at t..t+K."""
    d = dflash_debug(1)
    batch, rows = _packed_batch(H=d.config.target_hidden_size)
    teacher = _teacher(d, batch)
    captured = {}
    logits_of = d.compute_logits

    def keep(h):  # the objective's per-slot logits, kept for the comparison
        out = logits_of(h)
        captured.setdefault("all", []).append(out.detach())
        return out

    d.compute_logits = keep
    with torch.no_grad():
        dflash_forward_static(d, teacher, batch, steps=K, decay=0.8)
    del d.compute_logits
    B, T = batch.input_ids.shape
    got = torch.stack(captured["all"]).view(K, B, T, -1)  # [K, B, T, Vd]
    checked = 0
    for r, lens in enumerate(rows):
        a = 0
        for n in lens:
            for t in range(1, n):
                aux = batch.aux[r, a:a + t]
                ids = torch.cat([batch.input_ids[r, a + t:a + t + 1], d.mask_ids(K)])
                with torch.no_grad():
                    ref = reference_block(d, aux, torch.arange(t), ids, torch.arange(t, t + K + 1))
                for j in range(1, K + 1):
                    torch.testing.assert_close(got[j - 1, r, a + t], ref[j], rtol=1e-4, atol=1e-4)
                checked += 1
            a += n
    assert checked == sum(n - 1 for lens in rows for n in lens)


def test_static_form_equals_the_selecting_form_with_gradients():
    d = dflash_debug(2).train()
    batch, _ = _packed_batch(H=d.config.target_hidden_size)
    teacher = _teacher(d, batch)
    targets = teacher_targets(teacher, batch)
    a = dflash_forward(d, batch, targets.p, targets.argmax, targets.row_of, steps=K, decay=0.8)
    a.loss.backward()
    ga = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    d.zero_grad()
    b = dflash_forward_static(d, teacher, batch, steps=K, decay=0.8)
    b.loss.backward()
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(a.count, b.count) and torch.equal(a.correct, b.correct)
    assert a.count.tolist()[0] > 0 and a.count.tolist() == sorted(a.count.tolist(), reverse=True)
    for n, g in ga.items():
        torch.testing.assert_close(dict(d.named_parameters())[n].grad, g, rtol=1e-4, atol=1e-7)
    assert ga["layers.1.self_attn.k_norm.weight"].abs().sum() > 0  # the context keys' norm trains
    c = DFLASH.objective(d, TrainSection(drafter="dflash", ttt_steps=K, loss_decay=0.8))(batch, targets)
    torch.testing.assert_close(c.loss, a.loss)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_runner_rounds_equal_the_dense_reference(temperature):
    """The eval loop's runner over rounds of m pending slots = the dense reference at each round's
    bonus position (drafts; at T > 0 the distributions q)."""
    d = dflash_debug(3)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 96, (30,), generator=g)
    aux = torch.randn(30, 3, d.config.target_hidden_size, generator=g)
    runner = DFlashRunner(d)
    runner.reset(64)
    n0, k = 6, 4
    runner.prefill(seq[None, :n0], aux[None, :n0])
    P, checked = n0 - 1, 0  # the runner holds context 0..n0-2; x_{n0} is the first bonus token
    gen = torch.Generator().manual_seed(1) if temperature > 0 else None
    for m in (1, 3, 2, 5, 1):  # the pending slots of a round: x_{P-m+1}..x_P, aux at P-m..P-1
        P += m
        drafts, q = runner.draft(seq[None, P - m + 1:P + 1], aux[None, P - m:P], P - m, k, temperature=temperature,
                                 gen=gen)
        assert len(runner) == P
        with torch.no_grad():
            ref = reference_block(d, aux[:P], torch.arange(P), torch.cat([seq[P:P + 1], d.mask_ids(k)]),
                                  torch.arange(P, P + k + 1))[1:]
        if temperature > 0:
            torch.testing.assert_close(q, torch.softmax(ref.float() / temperature, -1), rtol=1e-4, atol=1e-6)
        else:
            assert torch.equal(drafts, d.draft_to_target(ref.argmax(-1)))
        checked += 1
    assert checked == 5
    with pytest.raises(ValueError, match="context positions"):
        runner.draft(seq[None, :1], aux[None, :1], 3, k, temperature=0.0, gen=None)
    with pytest.raises(ConfigError, match="batch_size = 1"):
        DFLASH.drafter_runner(d, "static", rows=4)


def test_serve_argv_is_vllm_dflash_and_sglang_is_refused():
    argv = DFLASH.serve_argv("vllm", Path("/x/export"), 5, as_model=False)
    assert argv[0] == "--speculative-config"
    assert json.loads(argv[1]) == {"method": "dflash", "model": "/x/export", "num_speculative_tokens": 5}
    with pytest.raises(ConfigError, match="vLLM only"):
        DFLASH.serve_argv("sglang", Path("/x/export"), 5, as_model=False)


DFLASH_TRAIN = {**BASE, "drafter": "dflash", "dflash_layers": 2, "batch_tokens": 256, "eval_every": 20,
                "checkpoint_every": 10, "total_steps": 20, "optimizer": "adamw", "lr": 1e-2}


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """A DFlash campaign trained 20 steps on the tiny target, and one stopped at 10 and resumed."""
    root = tmp_path_factory.mktemp("dflash")
    ref = seed_campaign(tiny, root, DFLASH_TRAIN, name="ref")
    summary = run_train(load_config(root / "ref.toml"), ref)
    run = seed_campaign(tiny, root, DFLASH_TRAIN, name="run")
    cfg = load_config(root / "run.toml")
    first = run_train(cfg, run, max_steps=10)
    second = run_train(cfg, run)
    return {"root": root, "ref": ref, "run": run, "summary": summary, "first": first, "second": second,
            "tiny": tiny}


def test_training_decreases_the_loss_and_checkpoints_resume(trained):
    ref, run, summary = trained["ref"], trained["run"], trained["summary"]
    rows = metrics(ref.root)
    assert summary["finished"] and len(rows) == 20
    assert sum(r["loss"] for r in rows[-3:]) < 0.8 * sum(r["loss"] for r in rows[:3]), [r["loss"] for r in rows]
    ck = Path(summary["checkpoint"])
    config = json.loads((ck / "drafter_config.json").read_text())
    assert config["family"] == "dflash" and config["num_hidden_layers"] == 2 and config["block_size"] == 4
    d = load_drafter(ck)
    assert type(d) is DFlashDrafter and len(d.layers) == 2
    manifest = json.loads((ref.root / "drafter" / "manifest.json").read_text())["train"]
    assert manifest["family"] == "dflash" and manifest["conventions"]["dflash_target_layer_ids"] == [
        i - 1 for i in config["aux_layer_ids"]]
    val = [json.loads(x) for x in (ref.root / "drafter" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in val if r["split"] == "val"]
    assert val and 1.0 <= val[-1]["tau"] <= 1 + 3 and math.isfinite(val[-1]["tau"])
    assert not trained["first"]["finished"] and trained["second"]["finished"]
    a, b = metrics(ref.root), metrics(run.root)
    assert [r["step"] for r in b] == list(range(1, 21))
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5, abs=1e-7), ra["step"]
    wa = load_file(str(ck / "model.safetensors"))
    wb = load_file(str(Path(trained["second"]["checkpoint"]) / "model.safetensors"))
    for n in wa:
        torch.testing.assert_close(wb[n], wa[n], rtol=1e-5, atol=1e-6)


def test_the_eval_loop_runs_a_trained_dflash_drafter_token_identical_at_t0(trained):
    """speculative_generate with the DFlash rule: at T = 0 the tokens are the target's greedy ones
    whatever the drafts, and the trained drafter is accepted more often than never."""
    from specops.evaluate.loop import TargetRunner, speculative_generate, target_generate
    from specops.target.inprocess import load_target

    d = load_drafter(Path(trained["summary"]["checkpoint"])).eval()
    runner = TargetRunner(load_target(trained["tiny"]["target"], "float32", "cpu"), d.config.aux_layer_ids)
    accepted = 0
    for ids, mask in trained["tiny"]["val"][:2]:
        prompt = ids[: int((mask == 0).sum())].tolist()  # the random prompt; the target's answer follows
        spec = speculative_generate(runner, d, prompt, k=3, max_new_tokens=24)
        base = target_generate(runner, prompt, max_new_tokens=24)
        assert spec.tokens == base.tokens
        accepted += sum(spec.accepted)
    assert accepted > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_of_the_objective_equal_eager_and_the_runner_matches_the_reference():
    """On CUDA: DFlash's static objective through GraphedMicroStep (bf16 autocast) replayed as graphs
    = run eagerly (outputs and accumulated gradients); the runner's drafts on CUDA = the dense
    reference round's."""
    from specops.drafter.graphs import GraphedMicroStep
    from specops.target.inprocess import TargetHead

    from test_train_graphs import _assert_same_steps, _graph_inputs

    dev = torch.device("cuda")
    batches = _graph_inputs(dev) * 3  # each shape: warm-up, capture + replay, replay

    def run(use_graphs):
        d = dflash_debug(6, aux_layer_ids=[1, 2, 3]).train().to(dev)
        head = TargetHead({}, torch.rand(32) + 0.5, 1e-6, torch.randn(96, 32), 3 * torch.randn(96, 32))
        teacher = Teacher(head, d.d2t, final_prenorm=True, device=dev, dtype=torch.bfloat16)
        params = [p for p in d.parameters() if p.requires_grad]
        fn = DFLASH.static_objective(d, teacher, TrainSection(drafter="dflash", ttt_steps=K, loss_decay=0.8))
        micro = GraphedMicroStep(fn, params, dev, loss_scale=0.5, use_graphs=use_graphs,
                                 autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False))
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
        return outs, grads, micro.summary()

    torch.manual_seed(0)
    graphs = run(True)
    torch.manual_seed(0)
    eager = run(False)
    assert graphs[2]["on"] and graphs[2]["captured"] == 3 and graphs[2]["replays"] == 9, graphs[2]
    _assert_same_steps(graphs, eager)

    d = dflash_debug(7).to(dev)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 96, (30,), generator=g).to(dev)
    aux = torch.randn(30, 3, d.config.target_hidden_size, generator=g).to(dev)
    runner = DFLASH.drafter_runner(d, "auto")
    runner.reset(64)
    runner.prefill(seq[None, :6], aux[None, :6])
    P = 5
    for m in (1, 3, 2):
        P += m
        drafts, _ = runner.draft(seq[None, P - m + 1:P + 1], aux[None, P - m:P], P - m, 4, temperature=0.0, gen=None)
        with torch.no_grad():
            ref = reference_block(d, aux[:P], torch.arange(P, device=dev), torch.cat([seq[P:P + 1], d.mask_ids(4)]),
                                  torch.arange(P, P + 5, device=dev))[1:]
        assert torch.equal(drafts, d.draft_to_target(ref.argmax(-1)))


def test_the_export_phase_writes_the_checkpoints_family(trained):
    """`specops export` on the DFlash campaign: both formats, each read back as DFlash's."""
    from specops.drafter.export import check_export, run_export

    cfg = load_config(trained["root"] / "ref.toml")
    out = run_export(cfg, trained["ref"])
    for fmt in ("vllm", "speculators"):
        report = check_export(out["exports"][fmt])
        assert report.ok and report.family is DFLASH and report.format == fmt, report.render()
        assert report.render().splitlines()[0].endswith(f"dflash {fmt} drafter dir: OK")
    config = json.loads((Path(out["exports"]["vllm"]) / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    back = DFLASH.drafter_from_export(Path(out["exports"]["vllm"]), target_num_hidden_layers=6,
                                      target_embed=load_drafter(Path(trained["summary"]["checkpoint"])).embed_tokens.weight)
    assert type(back) is DFlashDrafter and back.config.num_hidden_layers == 2
