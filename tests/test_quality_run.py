"""bench/quality/run.py's recipe sweep: variant names, the variant list a scale gives, and the checks
on its keys (the GPU experiment itself runs on the H200; `run.py all --scale smoke` on a CPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quality():
    spec = importlib.util.spec_from_file_location("quality_run", REPO / "bench" / "quality" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["quality_run"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_variant_names_are_stable_and_path_safe(quality):
    assert quality.variant_name({"lr": 2e-3}) == "lr-0.002"
    assert quality.variant_name({"lr": 1.5e-3, "batch_tokens": 8192}) == "lr-0.0015_batch_tokens-8192"
    v = {"lr": 3e-3, "fused_loss": "on", "timeout_s": 200, "name": "x"}
    assert quality.variant_name(v) == "lr-0.003_fused_loss-on"  # the time cap is not part of it
    name = quality.variant_name({"lr": 1e-3, "loss_decay": 0.6, "batch_tokens": 4096})
    assert name == "lr-0.001_batch_tokens-4096_loss_decay-0.6" and "/" not in name


def test_sweep_variants_drop_the_main_recipe_and_repeats(quality):
    s = {"lr": 1e-3, "lr_sweep": (1e-3, 2e-3), "sweep": ({"lr": 2e-3}, {"lr": 1e-3, "batch_tokens": 4096})}
    got = quality.sweep_variants(s)
    assert [v["name"] for v in got] == ["lr-0.002", "lr-0.001_batch_tokens-4096"]
    assert got[1]["batch_tokens"] == 4096 and isinstance(got[0]["lr"], float)
    with pytest.raises(SystemExit, match="unknown key"):
        quality.sweep_variants({"lr": 1e-3, "sweep": ({"lr": 1e-3, "epochs": 3},)})  # the epoch budget is fixed


def test_every_scale_gives_valid_variants(quality):
    from specops.config import TrainSection

    for name, scale in quality.SCALES.items():
        s = {"lr_sweep": (), "sweep": (), **scale}
        TrainSection(**quality.main_train(s))  # the main run's overrides are valid train.* keys
        for v in quality.sweep_variants(s):
            assert set(v) - {"name"} <= quality.SWEEP_KEYS, (name, v)
            assert isinstance(v["lr"], float), (name, v)  # the winner's lr is reported, whoever wins
    h200 = quality.SCALES["h200"]
    # the anchor at our main run's tokens per step, 2,048 (the best on val of the sweep): one recipe
    assert h200["anchor_total_seq_len"] is None and h200["batch_tokens"] == 2048
    assert quality.anchor_seq_len(h200) == 2048
    assert quality.anchor_seq_len({**h200, "anchor_total_seq_len": 8192}) == 8192


def _train_config(tmp_path, train):
    """train.* overrides through the config's own checks (keys, types, literal values)."""
    from specops.config import config_from_dict

    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "d.jsonl").write_text('{"prompt": "x"}\n')
    return config_from_dict({"campaign": {"name": "q", "dir": str(tmp_path / "camp")},
                             "target": {"model": str(tmp_path / "model")}, "train": train,
                             "datasets": [{"name": "d", "path": str(tmp_path / "d.jsonl")}]}).train


def test_kernel_switches_are_train_keys_of_a_variant(quality, tmp_path):
    """A variant sets the trainer's kernel keys like any other train.* key: they name it, land in its
    train section and pass the config's checks; the smoke scale's variant turns the compiled loss off."""
    from specops.config import ConfigError

    got = quality.sweep_variants({"lr": 1e-3, "sweep": ({"fused_loss": "on", "compile_layer": "auto",
                                                         "ttt_attention": "dense", "sdpa_cudnn": True},)})
    assert [v["name"] for v in got] == ["lr-0.001_compile_layer-auto_fused_loss-on_sdpa_cudnn-True_ttt_attention-dense"]
    train = {k: x for k, x in got[0].items() if k not in quality._NOT_TRAIN}
    tc = _train_config(tmp_path, train)
    assert (tc.fused_loss, tc.compile_layer, tc.ttt_attention, tc.sdpa_cudnn) == ("on", "auto", "dense", True)
    smoke = quality.sweep_variants(quality.SCALES["smoke"])
    assert [v.get("compile_loss") for v in smoke] == [None, "off"]  # its lr_sweep entry, then its sweep entry
    smoke_train = {k: x for k, x in smoke[1].items() if k not in quality._NOT_TRAIN}
    assert _train_config(tmp_path, smoke_train).compile_loss == "off"
    with pytest.raises(ConfigError, match="fused_loss"):
        _train_config(tmp_path, {"fused_loss": "1"})  # the config's values, not the old switch's digits
    with pytest.raises(SystemExit, match="unknown key"):
        quality.sweep_variants({"lr": 1e-3, "sweep": ({"env": {"X": "1"}},)})  # no environment side channel


def test_the_training_fallback_is_recorded_and_valid(quality, tmp_path):
    """phase_ours's fallback forms are valid train.* values, and what it records in the work dir is what
    the sweep and a rerun apply (train_fallback); a work dir without one applies nothing."""
    assert quality.train_fallback(tmp_path) == {}
    tc = _train_config(tmp_path, quality.TRAIN_FALLBACK)
    assert (tc.ttt_attention, tc.fused_loss, tc.compile_loss, tc.compile_layer) == ("dense", "off", "off", "off")
    quality.write_result(tmp_path, "ours-train-fallback", {"error": "x", "train": quality.TRAIN_FALLBACK})
    assert quality.train_fallback(tmp_path) == quality.TRAIN_FALLBACK


def test_a_variant_without_its_own_lr_carries_the_main_one(quality):
    """A variant that sets no lr takes the main run's, so a winner always has one to report (no
    KeyError 'lr')."""
    got = quality.sweep_variants({"lr": 1e-3, "sweep": ({"freeze_lm_head": True},)})
    assert got == [{"lr": 1e-3, "freeze_lm_head": True, "name": "lr-0.001_freeze_lm_head-True"}]


def test_variant_entries_equal_to_the_main_run_change_nothing(quality):
    s = {"lr": 1e-3, "batch_tokens": 4096, "warmup": 30, "train": {"optimizer": "muon", "freeze_lm_head": True},
         "sweep": ({"optimizer": "muon"}, {"freeze_lm_head": True, "batch_tokens": 2048},
                   {"optimizer": "adamw", "warmup_steps": 30}, {"batch_tokens": 4096, "timeout_s": 100})}
    got = quality.sweep_variants(s)
    # the first and last repeat the main run; the others keep only what differs from it
    assert [v["name"] for v in got] == ["lr-0.001_batch_tokens-2048", "lr-0.001_optimizer-adamw"]
    with pytest.raises(SystemExit, match="not allowed"):
        quality.main_train({"train": {"lr": 2e-3}})  # the main lr has its own scale entry
    with pytest.raises(SystemExit, match="not allowed"):
        quality.main_train({"train": {"epochs": 3}})


def test_h200_main_run_is_the_anchors_recipe_and_the_variants_probe_it(quality):
    """speculators' recipe (Muon, frozen lm_head, linear schedule to 0, clip 1.0, weight decay 0.1)
    in our trainer scores above AdamW + cosine on val (simulated tau 4.07 vs 2.60), so it is the main
    run, at 2,048 tokens/step, the best on val of the tokens-per-step sweep (docs/results.md). The
    variants try the loss without greedy loops, twice the lr and the loss on the prompt on top of it,
    half the tokens per step again, the anchor's 8,192 tokens/step, each half of the recipe alone
    (the frozen head with AdamW + cosine, Muon with a trained head), equal TTT step weights and row
    packing. Every variant writes a train section the trainer accepts."""
    from specops.config import TrainSection

    h200 = {"train": {}, **quality.SCALES["h200"]}
    assert quality.main_train(h200) == quality.SPECULATORS_RECIPE
    assert (h200["batch_tokens"], h200["warmup"], h200["lr"]) == (2048, 60, 1e-3)
    main = {"lr": h200["lr"], "warmup_steps": h200["warmup"], "batch_tokens": h200["batch_tokens"],
            **quality.SPECULATORS_RECIPE}
    got = quality.sweep_variants(h200)
    trains = [{**main, **{k: v for k, v in x.items() if k not in quality._NOT_TRAIN}} for x in got]
    assert [t.get("mask_repetition") for t in trains] == [True] + [None] * 8
    trains = trains[1:]
    assert [t["batch_tokens"] for t in trains] == [2048, 2048, 1024, 8192, 2048, 2048, 2048, 2048]
    assert [t["lr"] for t in trains] == [2e-3] + [1e-3] * 7
    assert [t.get("loss_on_prompt") for t in trains] == [None, True] + [None] * 6
    assert [t["warmup_steps"] for t in trains] == [60, 60, 120, 12, 50, 60, 60, 60]
    assert (trains[4]["optimizer"], trains[4]["freeze_lm_head"], trains[4]["lr_schedule"]) == ("adamw", True, "cosine")
    assert (trains[5]["optimizer"], trains[5]["freeze_lm_head"]) == ("muon", False)
    assert [t.get("loss_decay") for t in trains] == [None] * 6 + [1.0, None]
    assert trains[7]["pack_rows"] == 2048
    assert h200["sweep_by"] == "sim_tau_head"
    for t in trains:
        assert TrainSection(**t).cuda_graphs == "auto"
    assert all(len(x["name"]) < 200 and "/" not in x["name"] for x in got)  # a file name each


def test_collect_reports_the_rate_at_the_anchors_tokens_per_step(quality, tmp_path):
    """Real result files of the quality run (its lr-sweep.json and anchor.json, read below): the
    chosen drafter trained at 2,048 tokens per step, the anchor at 8,192; the like-for-like ratio is
    the 8,192 variant's rate over the anchor's."""
    res = REPO / "bench" / "results" / "h200-2026-12-04c" / "results"
    (tmp_path / "results").mkdir()
    for name in ("lr-sweep", "anchor"):
        (tmp_path / "results" / f"{name}.json").write_bytes((res / f"{name}.json").read_bytes())
    train = quality.phase_collect(tmp_path)["train"]
    assert train["anchor_tokens_per_step"] == 8192
    assert train["ours_same_batch"] == "lr-0.001_batch_tokens-8192_warmup_steps-12"
    assert train["ratio_same_batch"] == pytest.approx(130078.2 / 78124.67, rel=1e-6)
    assert train["ours_chosen"] == "lr-0.001_batch_tokens-2048_warmup_steps-60"
    assert train["ratio_chosen"] == pytest.approx(79128.6 / 78124.67, rel=1e-6)
    # without a run at the anchor's batch the like-for-like figure is absent, never a stand-in
    sweep = quality.read_result(tmp_path, "lr-sweep")
    del sweep["runs"]["lr-0.001_batch_tokens-8192_warmup_steps-12"]
    quality.write_result(tmp_path, "lr-sweep", sweep)
    train = quality.phase_collect(tmp_path)["train"]
    assert train["ours_same_batch"] is None and "ratio_same_batch" not in train


def test_the_sweep_chooses_by_the_eval_window_when_every_run_has_it(quality):
    runs = {"main": {"sim_tau": 4.0, "sim_tau_head": 2.5, "main": True},
            "loops-masked": {"sim_tau": 3.9, "sim_tau_head": 2.7},
            "skipped": {"skipped": "sweep_start_by_s"},
            "tie": {"sim_tau": 3.0, "sim_tau_head": 2.7}}
    best, by = quality.choose_run(runs, "sim_tau_head")
    assert (best, by) == (runs["loops-masked"], "sim_tau_head")  # the earlier of two equal heads
    assert quality.choose_run(runs, None) == (runs["main"], "sim_tau")
    runs["old"] = {"sim_tau": 4.5}  # a run without the head figures: everyone is judged by sim_tau
    assert quality.choose_run(runs, "sim_tau_head") == (runs["old"], "sim_tau")


def _anchor_work(quality, tmp_path, monkeypatch):
    """A work dir whose anchor has trained (anchor-train.json, a saved checkpoint) and a recorder in
    place of run.py's command runner: [the script or verb of each command run]."""
    ran = []

    def sh(cmd, logfile, **kw):
        ran.append(Path(str(cmd[1])).name if str(cmd[1]).endswith(".py") else " ".join(map(str, cmd[3:5])))
        return 1.0

    monkeypatch.setattr(quality, "sh", sh)
    monkeypatch.setattr(quality, "_WARM", None)
    import specops.models

    monkeypatch.setattr(specops.models, "resolve_model_dir", lambda model: tmp_path / "target")
    (tmp_path / "results").mkdir()
    (tmp_path / "anchor" / "run" / "checkpoints" / "epoch_0").mkdir(parents=True)
    trained = {"convert_s": 4.0, "train_wall_s": 480.0, "timed_out": False, "tokens_per_step": 2048,
               "epochs_saved": ["epoch_0"], "summary": {"speculators": {"tokens_per_s": 25790.0},
                                                        "args": ["--total-seq-len", "2048"]}}
    quality.write_result(tmp_path, "anchor-train", trained)
    return ran, trained


def test_a_trained_anchor_is_converted_again_never_trained_again(quality, tmp_path, monkeypatch):
    """anchor-train.json is written as soon as the anchor's training ends; a rerun of the anchor phase
    (its conversion or export check failed) converts the saved checkpoint and checks it, and trains
    nothing: the first convert consumed the features."""
    ran, trained = _anchor_work(quality, tmp_path, monkeypatch)
    called = []
    quality.phase_anchor(tmp_path, quality.SCALES["h200"], "smollm2", on_trained=lambda: called.append(1))
    assert ran == ["speculators_to_eval.py", "export --check"] and called == [1]
    anchor = quality.read_result(tmp_path, "anchor")
    assert anchor["done"] and anchor["summary"] == trained["summary"] and anchor["to_eval_s"] == 1.0
    quality.phase_anchor(tmp_path, quality.SCALES["h200"], "smollm2")  # done: nothing runs
    assert len(ran) == 2


def test_an_anchor_without_its_checkpoint_trains_again(quality, tmp_path, monkeypatch):
    ran, _ = _anchor_work(quality, tmp_path, monkeypatch)
    import shutil

    shutil.rmtree(tmp_path / "anchor" / "run" / "checkpoints")
    quality.phase_anchor(tmp_path, quality.SCALES["h200"], "smollm2")
    assert ran == ["speculators_convert.py", "speculators_train.py", "speculators_to_eval.py", "export --check"]
    again = quality.read_result(tmp_path, "anchor-train")
    assert again["train_wall_s"] == 1.0 and again["tokens_per_step"] == 2048 and again["summary"] is None


def test_collect_takes_the_anchors_rate_before_its_conversion(quality, tmp_path, monkeypatch):
    """The anchor trained (anchor-train.json) and its conversion failed (no anchor.json): its rate is
    still collected, and the main run at the same 2,048 tokens per step is the like-for-like one."""
    _anchor_work(quality, tmp_path, monkeypatch)
    quality.write_result(tmp_path, "lr-sweep", {"chosen": "lr-0.001", "runs": {
        "lr-0.001": {"main": True, "batch_tokens": 2048, "train_tokens_per_s": 72342.0, "sim_tau": 4.3}}})
    train = quality.phase_collect(tmp_path)["train"]
    assert train["anchor_tokens_per_s"] == 25790.0 and train["anchor_tokens_per_step"] == 2048
    assert train["ours_same_batch"] == "lr-0.001" and train["ratio_same_batch"] == pytest.approx(72342 / 25790)


def test_main_only_leaves_no_variant(quality):
    """`--main-only`: the h200 scale's nine variants are gone, whatever --set gave the sweep; the other
    overrides hold."""
    assert len(quality.sweep_variants(quality.scale_settings("h200"))) == 9
    s = quality.scale_settings("h200", ["anchor_timeout_s=600", "sweep=({'lr': 3e-3},)"], main_only=True)
    assert quality.sweep_variants(s) == [] and s["anchor_timeout_s"] == 600
    assert quality.sweep_variants(quality.scale_settings("h200", ["sweep=({'lr': 3e-3},)"]))[0]["lr"] == 3e-3
    with pytest.raises(ValueError, match="no_such_key"):
        quality.scale_settings("h200", ["no_such_key=1"])
