"""Item 8 (full suite): `specops extract` SIGKILLed at several seeded random points, resumed each
time, ends byte-identical to an uninterrupted extraction, and no finished shard is ever rewritten.

The single-kill versions run in the default suite: tests/test_extract.py::
test_kill9_mid_extraction_then_resume_is_byte_identical and tests/test_train.py::
test_kill9_and_sigterm_then_resume_replay_the_same_loss_curve.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time

import pytest

from .helpers import PYTHON, cli_env, make_extract_campaign, make_tiny_llama, shard_state

pytestmark = [pytest.mark.reliability, pytest.mark.reliability_full, pytest.mark.slow]


def test_extract_killed_at_random_points_is_byte_identical(tmp_path, rel, figures):
    fig = figures("8", "extract SIGKILLed at random points, resumed: byte-identical shards")
    rng = random.Random(rel.seed)
    kills = rel.pick(3, 6)
    model = make_tiny_llama(tmp_path / "model")
    ref, lengths = make_extract_campaign(tmp_path / "ref", model, n_samples=600, shard_tokens=500)
    run, _ = make_extract_campaign(tmp_path / "run", model, n_samples=600, shard_tokens=500)
    cmd = [PYTHON, "-m", "specops", "extract"]
    r = subprocess.run([*cmd, str(ref.root), "--split", "train"], env=cli_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ref_state = shard_state(ref.root / "features" / "train")
    n_shards = len(ref_state["finished"])
    feats = run.root / "features" / "train"
    log = tmp_path / "run.log"
    trials = []
    seen: dict[str, tuple[str, int]] = {}
    for k in range(kills):
        before = shard_state(feats) if feats.is_dir() else {"finished": {}}
        with open(log, "ab") as out:
            p = subprocess.Popen([*cmd, str(run.root), "--split", "train"], env=cli_env(), stdout=out,
                                 stderr=subprocess.STDOUT)
        try:
            # Wait for one more finished shard (or start-up, for the first kill), then a random delay.
            target = len(before["finished"]) + (0 if k == 0 else 1)
            deadline = time.monotonic() + 300
            while p.poll() is None and time.monotonic() < deadline:
                if feats.is_dir() and len(list(feats.glob("shard-*.safetensors"))) >= target:
                    break
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.2))
            assert p.poll() is None, f"extract finished before kill {k}: {log.read_text()[-2000:]}"
            p.send_signal(signal.SIGKILL)
            assert p.wait(timeout=60) == -signal.SIGKILL
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        state = shard_state(feats) if feats.is_dir() else {"finished": {}, "orphans": [], "temps": []}
        assert state["orphans"] == [], state
        for name, v in seen.items():
            assert state["finished"].get(name) == v, f"{name} was rewritten after kill {k}"
        seen.update(state["finished"])
        trials.append({"kill": k, "finished_shards": len(state["finished"]), "temps": state["temps"]})
        fig.faults_injected += 1
    p = subprocess.run([*cmd, str(run.root), "--split", "train"], env=cli_env(), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    final = shard_state(feats)
    same = {k: v[0] for k, v in final["finished"].items()} == {k: v[0] for k, v in ref_state["finished"].items()}
    fig.trials = kills
    fig.records_expected = n_shards
    fig.records_lost = len(set(ref_state["finished"]) - set(final["finished"]))
    fig.records_duplicated = 0
    fig.details = {"shards": n_shards, "samples": len(lengths["train"]), "kills": trials,
                   "byte_identical": same, "leftover_temp_files": final["temps"]}
    assert same, "resumed shards differ from the uninterrupted run"
    assert all(final["finished"][n] == v for n, v in seen.items()), "a finished shard was rewritten"
    assert not [t for t in final["temps"] if t.endswith(".tmp")]
    fig.finish()
