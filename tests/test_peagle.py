"""The P-EAGLE family (drafter/families/peagle/): its config keys, objective, drafting rule, training,
checkpoints and exports, on tiny random-weight models built from a config (no hub, no server).

The objective's alignment and attention are pinned by the one-forward drafting rule itself: for
every slot t of a packed batch, the drafter run once over the slots 0..t of t's document and K-1
mask slots (what vLLM's parallel drafting computes at anchor t) gives the objective's per-depth
logits at t, to rounding.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specops.config import DRAFTER_FAMILIES, TrainSection, load_config
from specops.drafter.batch import Teacher, teacher_targets
from specops.drafter.checkpoint import load_drafter
from specops.drafter.export import check_export
from specops.drafter.families import FAMILIES, family_of, open_export
from specops.drafter.families.eagle3.drafting import EagerDrafterRunner
from specops.drafter.families.eagle3.objective import ttt_forward, ttt_forward_static
from specops.drafter.families.peagle import PEAGLE, resolve_mask_token_id
from specops.drafter.families.peagle.drafting import EagerParallelRunner, StaticParallelRunner
from specops.drafter.families.peagle.model import PEagleConfig, PEagleDrafter
from specops.drafter.families.peagle.objective import mask_later_inputs
from specops.drafter.model import DrafterConfig, Eagle3Drafter, set_kernel_options
from specops.drafter.train import run_train
from specops.errors import ConfigError, InputError

from train_builders import BASE, _packed_batch, metrics, seed_campaign

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny matmuls, a shared 2-core box

K = 4  # depths scored / drafts per round in the unit tests


def peagle_debug(seed: int = 0, **kw) -> PEagleDrafter:
    torch.manual_seed(seed)
    cfg = PEagleConfig.debug(aux_layer_ids=[1, 2, 3], **kw)
    d = PEagleDrafter(cfg).eval()
    with torch.no_grad():  # a random d2t: draft id i is not target id i
        ids = torch.randperm(cfg.target_vocab_size, generator=torch.Generator().manual_seed(seed))
        d.set_vocab(ids[: cfg.draft_vocab_size].sort().values - torch.arange(cfg.draft_vocab_size))
        for n, p in d.named_parameters():  # norms away from 1, so a skipped one shows
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return d


# ---------------------------------------------------------------- config


def test_train_drafter_names_a_family_and_mask_token_id_is_checked():
    assert set(DRAFTER_FAMILIES) == set(FAMILIES)  # config's own list is the registry's
    assert TrainSection().drafter == "eagle3" and TrainSection().mask_token_id is None
    assert TrainSection(drafter="peagle", mask_token_id=7).mask_token_id == 7
    with pytest.raises(ConfigError, match=r"train.drafter: unknown drafter family 'pegle' \(did you mean 'peagle'"):
        TrainSection(drafter="pegle")
    with pytest.raises(ConfigError, match="EAGLE-3 drafts from its own tokens and has no mask token"):
        TrainSection(mask_token_id=3)
    with pytest.raises(ConfigError, match="train.mask_token_id: must be a token id >= 0"):
        TrainSection(drafter="peagle", mask_token_id=-1)
    with pytest.raises(ValueError, match=r"mask_token_id 96 is outside the target vocab \[0, 96\)"):
        PEagleConfig.debug(aux_layer_ids=[1, 2, 3], mask_token_id=96)


def test_mask_token_default_follows_speculators_resolution():
    class Tok:
        def __init__(self, n, **ids):
            self.n, self.mask_token_id, self.pad_token_id, self.eos_token_id, self.unk_token_id = n, None, None, None, None
            self.__dict__.update(ids)

        def __len__(self):
            return self.n

    cfg = {"vocab_size": 100, "pad_token_id": None, "eos_token_id": [9, 10]}
    assert resolve_mask_token_id(cfg, Tok(100, mask_token_id=4))[0] == 4
    assert resolve_mask_token_id(cfg, Tok(97, pad_token_id=2)) == (97, "the first embedding row past the "
                                                                      "tokenizer's 97 tokens")
    assert resolve_mask_token_id(cfg, Tok(100, pad_token_id=2, eos_token_id=3))[0] == 2
    assert resolve_mask_token_id(cfg, Tok(100, eos_token_id=3))[0] == 3
    assert resolve_mask_token_id(cfg, None) == (9, "the target config's eos_token_id")
    with pytest.raises(InputError, match="set train.mask_token_id"):
        resolve_mask_token_id({"vocab_size": 100}, None)
    tc = TrainSection(drafter="peagle", mask_token_id=100)
    with pytest.raises(InputError, match=r"train.mask_token_id: 100 is not a token id of the target \(vocab 100\)"):
        PEAGLE.resolve_train(tc, cfg, lambda: None)
    assert PEAGLE.resolve_train(dataclasses.replace(tc, mask_token_id=None), cfg, lambda: None).mask_token_id == 9


# ---------------------------------------------------------------- objective and drafting rule


@pytest.mark.parametrize("attention", ["block", "dense"])
def test_objective_depths_equal_the_one_forward_drafting_rule(attention):
    """Depth j's logits at slot t (the objective) = the drafter run once over t's document prefix
    (slots 0..t: token x_{s+1}, fc(aux_s), position s) and K-1 mask slots (positions t+1..), read
    at index t + j: the drafting rule's forward, i.e. vLLM's parallel-drafting pass at anchor t."""
    d = peagle_debug(1)
    batch, rows = _packed_batch(H=d.config.target_hidden_size)
    prev = set_kernel_options(ttt_attention=attention)
    try:
        with torch.no_grad():
            out = ttt_forward(d, batch, _targets(d, batch)[0], steps=K, decay=0.8, return_logits=True,
                              later_inputs=mask_later_inputs(d)(batch))
    finally:
        set_kernel_options(**dataclasses.asdict(prev))
    checked = 0
    for r, lens in enumerate(rows):
        a = 0
        for n in lens:
            for t in range(n - 1):  # slots whose token x_{t+1} is in the document
                ids = batch.input_ids[r, a + 1:a + t + 2][None]  # [1, t+1]
                aux = batch.aux[r, a:a + t + 1][None]
                mids, mh = d.mask_inputs(1, K - 1)
                with torch.no_grad():
                    ref = d(torch.cat([ids, mids], 1), torch.cat([d.fuse(aux), mh], 1),
                            torch.arange(t + K)[None]).logits[0, t:]  # [K, Vd]
                for j in range(K):
                    torch.testing.assert_close(out.logits[j][r, a + t], ref[j], rtol=1e-4, atol=1e-4)
                checked += 1
            a += n
    assert checked == sum(n - 1 for lens in rows for n in lens)


def _targets(d, batch):
    from specops.target.inprocess import TargetHead

    g = torch.Generator().manual_seed(5)
    H, V = batch.final.shape[-1], d.config.target_vocab_size
    head = TargetHead({"vocab_size": V, "hidden_size": H}, torch.rand(H, generator=g) + 0.5, 1e-6,
                      torch.randn(V, H, generator=g), 3 * torch.randn(V, H, generator=g))
    return teacher_targets(Teacher(head, d.d2t, final_prenorm=True, device=torch.device("cpu"),
                                   dtype=torch.float32), batch), head


def test_objective_static_form_equals_the_selecting_form_with_gradients():
    """The CUDA-graph form (every slot scored, masked sums) = the selecting form: loss, per-depth
    counts, hits, and the gradient of mask_hidden (the mask slots' only own parameter)."""
    d = peagle_debug(2).train()
    batch, _ = _packed_batch(H=d.config.target_hidden_size)
    targets, head = _targets(d, batch)
    teacher = Teacher(head, d.d2t, final_prenorm=True, device=torch.device("cpu"), dtype=torch.float32)
    a = ttt_forward(d, batch, targets, steps=K, decay=0.8, later_inputs=mask_later_inputs(d)(batch))
    a.loss.backward()
    ga = d.mask_hidden.grad.clone()
    d.zero_grad()
    b = ttt_forward_static(d, teacher, batch, steps=K, decay=0.8, later_inputs=mask_later_inputs(d)(batch))
    b.loss.backward()
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(a.count, b.count) and torch.equal(a.correct, b.correct)
    torch.testing.assert_close(d.mask_hidden.grad, ga, rtol=1e-4, atol=1e-7)
    assert ga.abs().sum() > 0
    # the module the trainer runs (PEAGLE.objective) is the same loss
    c = PEAGLE.objective(d, TrainSection(drafter="peagle", ttt_steps=K, loss_decay=0.8))(batch, targets)
    torch.testing.assert_close(c.loss, a.loss)
    # and it is not EAGLE-3's: depths >= 1 read the mask inputs, not the chain
    e = ttt_forward(d, batch, targets, steps=K, decay=0.8)
    assert torch.equal(e.ce_sum[0], a.ce_sum[0]) and not torch.allclose(e.ce_sum[1:], a.ce_sum[1:])


def _rounds(runner, d, seq, aux, k, plan, temperature=0.0, seed=0):
    """Drive `runner` as the eval loop does: prefill seq[:n0], then rounds of m pending slots."""
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    n0 = plan[0]
    runner.reset(64)
    runner.prefill(seq[None, :n0], aux[None, :n0])
    P, out = n0, []
    for m in plan[1:]:
        s = P - 1  # pending slots start..: token x_{s+1}, aux_s
        drafts, q = runner.draft(seq[None, s + 1:s + 1 + m], aux[None, s:s + m], s, k, temperature=temperature,
                                 gen=gen)
        out.append((drafts, q))
        assert len(runner) == s + m
        P += m
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_runner_equals_the_eager_reference(temperature):
    d = peagle_debug(3)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, d.config.target_vocab_size, (40,), generator=g)
    aux = torch.randn(40, 3, d.config.target_hidden_size, generator=g)
    plan = [6, 1, 3, 2, 4, 1]
    eager = _rounds(EagerParallelRunner(d), d, seq, aux, K, plan, temperature)
    static = _rounds(StaticParallelRunner(d, cuda_graphs=False, min_capacity=8), d, seq, aux, K, plan, temperature)
    for (de, qe), (ds, qs) in zip(eager, static):
        assert de.shape == (K,) and torch.equal(de, ds)
        assert (qe is None) == (qs is None) == (temperature == 0)
        if qe is not None:
            assert qe.shape == (K, d.config.draft_vocab_size)
            torch.testing.assert_close(qs, qe, rtol=1e-5, atol=1e-6)
    # the eager rule differs from EAGLE-3's chain on the same weights (drafts 2..k)
    chain = _rounds(EagerDrafterRunner(d), d, seq, aux, K, plan)
    assert any(not torch.equal(c[0][1:], e[0][1:]) for c, e in zip(chain, eager))


def test_draft_rows_equals_one_row_at_a_time():
    """The batched loop's call (rows of different pending counts, one call) = each row drafted alone."""
    d = peagle_debug(4)
    g = torch.Generator().manual_seed(1)
    B, S, k = 3, K + 1, K
    seqs = torch.randint(0, d.config.target_vocab_size, (B, 30), generator=g)
    auxs = torch.randn(B, 30, 3, d.config.target_hidden_size, generator=g)
    prompt = [7, 11, 9]
    m = torch.tensor([1, 3, 5])
    batched = StaticParallelRunner(d, cuda_graphs=False, min_capacity=64, rows=B)
    batched.reset(64)
    tok = torch.zeros(B, S, dtype=torch.long)
    ax = torch.zeros(B, S, 3, d.config.target_hidden_size)
    P = torch.tensor(prompt) - 1 + m  # row b holds prompt-1 slots, then m pending
    for b in range(B):
        batched.prefill_row(b, seqs[b:b + 1, :prompt[b]], auxs[b:b + 1, :prompt[b]])
        s = prompt[b] - 1
        tok[b, : m[b]] = seqs[b, s + 1:s + 1 + m[b]]
        ax[b, : m[b]] = auxs[b, s:s + m[b]]
    kv_len = int(P.max()) + k + 1
    drafts, q = batched.draft_rows(tok, ax, P, m, k, kv_len, temperature=0.0, gen=None)
    assert drafts.shape == (B, k) and q is None
    for b in range(B):
        alone = _rounds(EagerParallelRunner(d), d, seqs[b], auxs[b], k, [prompt[b], int(m[b])])
        assert torch.equal(drafts[b], alone[0][0]), b


def test_batched_loop_equals_the_batch1_loop(trained):
    """eval.batch_size > 1 with a P-EAGLE drafter: every row's tokens and per-step acceptance are the
    batch-1 loop's (its eager runner), rows refilled; the trained tiny drafter on its own prompts."""
    from specops.evaluate.batched import BatchedLoop
    from specops.evaluate.loop import TargetRunner, speculative_generate
    from specops.target.inprocess import load_target

    from test_batched_eval import drive

    target = load_target(trained["tiny"]["target"], "float32", "cpu")
    d = load_drafter(Path(trained["summary"]["checkpoint"])).eval()
    prompts = [ids[: int((m == 0).sum())].tolist() for ids, m in trained["tiny"]["train"][:5]]
    loop = BatchedLoop(target, d, rows=2, k=3, max_new_tokens=12, temperature=0.0, eos_ids=frozenset(), gen=None,
                       min_capacity=8)
    assert isinstance(loop.dr, StaticParallelRunner)
    got, _ = drive(loop, [[p] for p in prompts])
    accepted = 0
    for i, p in enumerate(prompts):
        ref = speculative_generate(TargetRunner(target, d.config.aux_layer_ids), d, p, k=3, max_new_tokens=12)
        _, toks, acc = got[i][0]
        assert toks[:12] == ref.tokens and acc == ref.accepted, i
        accepted += sum(acc)
    assert accepted > 0, "no draft accepted: the comparison would not cover acceptance"


def test_family_of_and_runners_pick_peagle_and_serve_argv():
    d = peagle_debug()
    assert family_of(d) is PEAGLE and family_of(Eagle3Drafter(DrafterConfig.debug())) is FAMILIES["eagle3"]
    assert isinstance(PEAGLE.drafter_runner(d, "eager"), EagerParallelRunner)
    assert isinstance(PEAGLE.drafter_runner(d, "auto"), EagerParallelRunner)  # CPU
    assert isinstance(PEAGLE.drafter_runner(d, "static"), StaticParallelRunner)
    assert isinstance(PEAGLE.drafter_runner(d, rows=4), StaticParallelRunner)
    argv = PEAGLE.serve_argv("vllm", Path("/x/p"), 3, as_model=False)
    assert json.loads(argv[1]) == {"method": "eagle3", "model": "/x/p", "num_speculative_tokens": 3,
                                   "parallel_drafting": True}
    assert json.loads(PEAGLE.serve_argv("vllm", Path("/x/p"), 3, as_model=True)[1]) == {
        "num_speculative_tokens": 3, "parallel_drafting": True}
    with pytest.raises(ConfigError, match="P-EAGLE drafter, which SGLang does not serve"):
        PEAGLE.serve_argv("sglang", Path("/x/p"), 3, as_model=False)
    assert PEAGLE.simulated_tau([0.5, 0.5]) == pytest.approx(1.75)  # a chain


# ---------------------------------------------------------------- training, checkpoints, exports

PEAGLE_TRAIN = {**BASE, "drafter": "peagle", "batch_tokens": 256, "eval_every": 20, "checkpoint_every": 10,
                "total_steps": 20, "optimizer": "adamw"}


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """A P-EAGLE campaign trained 20 steps on the tiny target (train_builders), and a second one
    stopped at step 10 and resumed to 20."""
    root = tmp_path_factory.mktemp("peagle")
    ref = seed_campaign(tiny, root, PEAGLE_TRAIN, name="ref")
    summary = run_train(load_config(root / "ref.toml"), ref)
    run = seed_campaign(tiny, root, PEAGLE_TRAIN, name="run")
    cfg = load_config(root / "run.toml")
    first = run_train(cfg, run, max_steps=10)
    second = run_train(cfg, run)
    return {"root": root, "ref": ref, "run": run, "summary": summary, "first": first, "second": second,
            "cfg": cfg, "tiny": tiny}


def test_training_decreases_the_loss_and_checkpoints_resume(trained):
    ref, run, summary = trained["ref"], trained["run"], trained["summary"]
    rows = metrics(ref.root)
    assert summary["finished"] and len(rows) == 20
    assert sum(r["loss"] for r in rows[-3:]) < 0.8 * sum(r["loss"] for r in rows[:3]), [r["loss"] for r in rows]
    ck = Path(summary["checkpoint"])
    config = json.loads((ck / "drafter_config.json").read_text())
    assert config["family"] == "peagle" and config["mask_token_id"] == 2  # no tokenizer: config.json's eos
    d = load_drafter(ck)
    assert type(d) is PEagleDrafter and d.mask_hidden.shape == (1, 3 * 64)
    manifest = json.loads((ref.root / "drafter" / "manifest.json").read_text())["train"]
    assert manifest["family"] == "peagle" and manifest["conventions"]["mask_token_id"] == 2
    assert "depth j >= 1" in manifest["conventions"]["alignment"]
    # stopped at 10, resumed: the same curve and weights as the straight run
    assert not trained["first"]["finished"] and trained["second"]["finished"]
    a, b = metrics(ref.root), metrics(run.root)
    assert [r["step"] for r in b] == list(range(1, 21))
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5, abs=1e-7), ra["step"]
    wa = load_file(str(ck / "model.safetensors"))
    wb = load_file(str(Path(trained["second"]["checkpoint"]) / "model.safetensors"))
    for n in wa:
        torch.testing.assert_close(wb[n], wa[n], rtol=1e-5, atol=1e-6)
    start = torch.load(ck / "optimizer.pt", weights_only=True)  # mask_hidden trained (its AdamW state moved)
    assert start is not None and not torch.equal(wa["mask_hidden"], PEagleDrafter(d.config).mask_hidden)


def test_resume_refuses_another_family_and_old_checkpoints_read_as_eagle3(trained, tmp_path):
    run, cfg = trained["run"], trained["cfg"]
    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, drafter="eagle3", mask_token_id=None,
                                                               total_steps=30))
    with pytest.raises(ConfigError, match=r"holds a peagle drafter and this run trains eagle3 \(train.drafter\)"):
        run_train(other, run)
    # a checkpoint written before drafter_config.json named its family: EAGLE-3
    old = tmp_path / "old"
    old.mkdir()
    e = Eagle3Drafter(DrafterConfig.debug())
    save_file({k: v.contiguous() for k, v in e.state_dict().items()}, str(old / "model.safetensors"))
    (old / "drafter_config.json").write_text(json.dumps(e.config.to_dict()))
    assert type(load_drafter(old)) is Eagle3Drafter
    (old / "drafter_config.json").write_text(json.dumps({**e.config.to_dict(), "family": "medusa"}))
    with pytest.raises(ConfigError, match="drafter_config.json family: unknown drafter family 'medusa'"):
        load_drafter(old)


@pytest.fixture(scope="module")
def exports(trained):
    from specops.drafter.families.peagle.export import export_peagle

    d = load_drafter(Path(trained["summary"]["checkpoint"]))
    target = trained["tiny"]["target"]
    hf = json.loads((target / "config.json").read_text())
    out = {"drafter": d, "hf": hf, "target": target}
    for fmt in ("vllm", "speculators"):
        out[fmt] = export_peagle(fmt, d.state_dict(), d.config.to_dict(), trained["root"] / f"export-{fmt}",
                                 target_config=hf, target_name_or_path=str(target), speculative_tokens=K,
                                 dtype=torch.float32)
    return out


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_export_passes_its_check_and_round_trips(exports, fmt):
    d, path = exports["drafter"], exports[fmt]
    report = check_export(path, target_config=exports["target"])
    assert report.ok and report.family is PEAGLE and report.format == fmt, report.render()
    assert not report.problems, report.render()
    config = json.loads((path / "config.json").read_text())
    assert config["mask_token_id"] == 2
    if fmt == "speculators":
        assert config["speculators_model_type"] == "peagle" and config["speculators_config"]["algorithm"] == "peagle"
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert load_file(str(path / "model.safetensors"))["mask_hidden"].shape == (1, 3 * 64)
    back = PEAGLE.drafter_from_export(path, target_num_hidden_layers=6,
                                      target_embed=d.embed_tokens.weight)
    assert type(back) is PEagleDrafter and back.config.mask_token_id == 2
    ref = d.state_dict()
    for n, t in back.state_dict().items():
        assert torch.equal(t, ref[n]), n
    # the same weights but mask_hidden, exported by EAGLE-3: its dir, not P-EAGLE's
    e3 = Eagle3Drafter(DrafterConfig.from_dict(d.config.to_dict()))
    e3.load_state_dict({n: t for n, t in ref.items() if n != "mask_hidden"})
    e3_dir = FAMILIES["eagle3"].export(fmt, e3, path.parent / f"e3-{fmt}", target_config=exports["hf"],
                                       target_name_or_path=str(exports["target"]), speculative_tokens=K)
    report, _, _ = open_export(e3_dir)
    assert report.family is FAMILIES["eagle3"] and report.format == fmt


def test_the_export_phase_writes_the_checkpoints_family(trained):
    """`specops export` on the P-EAGLE campaign: both formats, each read back as P-EAGLE's."""
    from specops.drafter.export import run_export

    out = run_export(load_config(trained["root"] / "ref.toml"), trained["ref"])
    for fmt in ("vllm", "speculators"):
        report = check_export(out["exports"][fmt])
        assert report.ok and report.family is PEAGLE and report.format == fmt, report.render()
        assert report.render().splitlines()[0].endswith(f"peagle {fmt} drafter dir: OK")
        assert report.to_json()["family"] == "peagle"


def _corrupt(src: Path, dst: Path, *, tensors=None, config=None) -> Path:
    shutil.copytree(src, dst)
    if tensors is not None:
        sd = load_file(str(dst / "model.safetensors"))
        tensors(sd)
        save_file(sd, str(dst / "model.safetensors"))
    if config is not None:
        c = json.loads((dst / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_a_corrupted_export_fails_its_check_naming_the_problem(exports, tmp_path, fmt):
    src, tgt = exports[fmt], exports["target"]

    def nogo(path):
        report = check_export(path, target_config=tgt)
        assert not report.ok and report.family is PEAGLE, report.render()
        return {p.name: p.message for p in report.problems if p.status == "nogo"}

    wrong = _corrupt(src, tmp_path / "shape", tensors=lambda sd: sd.update(mask_hidden=sd["mask_hidden"][:, :64]))
    assert "expected [1, 192] (3 aux states x the target's hidden size 64)" in nogo(wrong)["shape.mask_hidden"]
    gone = _corrupt(src, tmp_path / "token", config=lambda c: c.pop("mask_token_id"))
    assert "no mask token id in config.json" in nogo(gone)["config.mask_token_id"]
    far = _corrupt(src, tmp_path / "far", config=lambda c: c.update(mask_token_id=128))
    assert "outside the target vocab [0, 128)" in nogo(far)["config.mask_token_id"]
    nan = _corrupt(src, tmp_path / "nan", tensors=lambda sd: sd["mask_hidden"].__setitem__((0, 3), float("nan")))
    assert "non-finite" in nogo(nan)["values.mask_hidden"]
    if fmt == "vllm":  # mask_token_id alone still names the dir P-EAGLE's: the missing tensor is named
        nomask = _corrupt(src, tmp_path / "nomask", tensors=lambda sd: sd.pop("mask_hidden"))
        assert "no mask_hidden tensor" in nogo(nomask)["keys.mask_hidden"]


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_of_the_objective_and_the_drafting_rule_equal_eager():
    """On CUDA: P-EAGLE's static objective through GraphedMicroStep (bf16 autocast) replayed as graphs
    = run eagerly (outputs and accumulated gradients, mask_hidden's included); the static runner's
    one-call rule captured as a graph = the eager runner's drafts."""
    from specops.drafter.graphs import GraphedMicroStep
    from specops.target.inprocess import TargetHead

    from test_train_graphs import _assert_same_steps, _graph_inputs

    dev = torch.device("cuda")
    batches = _graph_inputs(dev) * 3  # each shape: warm-up, capture + replay, replay

    def run(use_graphs):
        d = peagle_debug(6).train().to(dev)
        head = TargetHead({}, torch.rand(32) + 0.5, 1e-6, torch.randn(96, 32), 3 * torch.randn(96, 32))
        teacher = Teacher(head, d.d2t, final_prenorm=True, device=dev, dtype=torch.bfloat16)
        params = [p for p in d.parameters() if p.requires_grad]
        fn = PEAGLE.static_objective(d, teacher, TrainSection(drafter="peagle", ttt_steps=K, loss_decay=0.8))
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

    d = peagle_debug(7).to(dev)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, d.config.target_vocab_size, (40,), generator=g)
    aux = torch.randn(40, 3, d.config.target_hidden_size, generator=g)
    plan = [6, 1, 3, 1, 3, 2]
    static = StaticParallelRunner(d, cuda_graphs=True, min_capacity=64)
    got = _rounds(static, d, seq.to(dev), aux.to(dev), K, plan)
    want = _rounds(EagerParallelRunner(d), d, seq.to(dev), aux.to(dev), K, plan)
    assert static.use_graphs and static.graph_fallbacks == 0 and len(static._graphs) >= 2
    for (a, _), (b, _) in zip(got, want):
        assert torch.equal(a, b)
