"""Phase progress (specops/progress.py): a live bar on a real pseudo-terminal, plain lines without
escape sequences on a pipe, the plain line's throttle, a counter when the total is unknown, and a
real `specops extract` on a tiny campaign under a pty."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from specops import progress as P
from specops.progress import current, phase_progress

SRC = Path(__file__).resolve().parents[1] / "src"
ESC = "\x1b["
BAR = "[━╸╺]+"  # rich's bar: done, a half cell, to do
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # CSI sequences (colours, cursor moves)
PLAIN_LINE = re.compile(r"train: \d+/40 steps \(\d+\.\d%\), [\d.]+ steps/s, ETA \S+, elapsed \S+; loss 2\.346")

# A phase in miniature: 40 steps over ~1.2 s, a ROUTINE line every 10 steps (the bar stands in for
# them on a terminal), one ordinary log line, a print to stdout; every record also goes to a file.
SCRIPT = """
import logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
fh = logging.FileHandler(sys.argv[1])
fh.setFormatter(logging.Formatter("%(message)s"))
logging.getLogger().addHandler(fh)
from specops.progress import ROUTINE, phase_progress
log = logging.getLogger("specops.train")
with phase_progress("train", 40, "steps", logger=log, every_s=0.3) as bar:
    print("bar live:", bar.live, flush=True)
    for i in range(40):
        time.sleep(0.03)
        bar.advance(1, loss=2.3456, tok_s=12345.6)
        if i % 10 == 9:
            log.info("step %d/40 routine line", i + 1, extra=ROUTINE)
        if i == 20:
            log.info("an ordinary line")
print("after the bar", file=sys.stderr)
"""


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop(P.ENV, None)
    env["TERM"] = "xterm-256color"
    # rich takes COLUMNS / LINES over the terminal's own size: the pty's 120 columns must win
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    env.update(extra)
    return env


def run_on_pty(argv: list[str], env: dict[str, str], timeout: float = 60.0) -> tuple[int, str, str]:
    """Run argv with stderr on a pseudo-terminal (120 columns) and stdout on a pipe; returns
    (exit code, what the terminal received, stdout)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every slave end is closed
                break
            if not chunk:
                break
            out += chunk
        else:
            proc.kill()
            pytest.fail(f"{argv} still running after {timeout}s: {bytes(out[-2000:])!r}")
        stdout = proc.stdout.read().decode()
        return proc.wait(timeout=30), out.decode(errors="replace"), stdout
    finally:
        os.close(master)
        proc.stdout.close()


def records(logger_name: str) -> tuple[logging.Logger, list[logging.LogRecord]]:
    got: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record)

    lg = logging.getLogger(logger_name)
    lg.handlers[:] = [Keep()]
    lg.setLevel(logging.INFO)
    lg.propagate = False
    return lg, got


# ----------------------------------------------------------------------------- terminal vs pipe


def test_a_terminal_gets_a_live_bar_with_rate_and_eta(tmp_path):
    logfile = tmp_path / "phase.log"
    rc, term, stdout = run_on_pty([sys.executable, "-c", SCRIPT, str(logfile)], child_env())
    assert rc == 0, term
    assert stdout == "bar live: True\n"  # stdout is a pipe here: left alone, not drawn into the terminal
    assert ESC in term and "\x1b[?25l" in term and "\x1b[?25h" in term  # rich's redraws; the cursor is given back
    assert "━" in term  # the bar
    text = ANSI.sub("", term)
    assert re.search(rf"train {BAR} \d+/40 steps  [\d.]+ steps/s  ETA \d+s  loss 2\.346  tok/s 12\.3k", text), term
    assert "40/40 steps" in term
    # Log lines still show (above the bar); the ROUTINE ones and the plain progress lines do not.
    assert "an ordinary line" in term and "after the bar" in term
    assert "routine line" not in term and not PLAIN_LINE.search(term) and "finished at" not in term
    # A file handler keeps every record, the plain progress lines included.
    text = logfile.read_text()
    assert text.count("routine line") == 4 and "an ordinary line" in text
    assert PLAIN_LINE.search(text), text
    assert re.search(r"^train: finished at 40/40 steps after \d+s \([\d.]+ steps/s\); loss 2\.346, tok/s 12\.3k$",
                     text, re.M), text


def test_a_pipe_gets_plain_lines_only(tmp_path):
    logfile = tmp_path / "phase.log"
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(logfile)], capture_output=True, text=True,
                         env=child_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    err = out.stderr
    assert out.stdout == "bar live: False\n"
    assert "\x1b" not in err and "\r" not in err and "━" not in err
    lines = err.splitlines()
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO ", ln) for ln in lines[:-1]), err
    assert lines[-1] == "after the bar"
    assert sum("routine line" in ln for ln in lines) == 4 and any("an ordinary line" in ln for ln in lines)
    plain = [ln for ln in lines if PLAIN_LINE.search(ln)]
    assert 1 <= len(plain) <= 6, err  # ~1.2 s at most one per 0.3 s
    assert sum("train: finished at 40/40 steps after" in ln for ln in lines) == 1


@pytest.mark.parametrize("env", [{P.ENV: "plain"}, {"TERM": "dumb"}])
def test_a_terminal_gets_plain_lines_when_told_to(tmp_path, env):
    rc, term, stdout = run_on_pty([sys.executable, "-c", SCRIPT, str(tmp_path / "log")], child_env(**env))
    assert rc == 0 and stdout == "bar live: False\n"
    assert ESC not in term and "━" not in term
    assert "routine line" in term and PLAIN_LINE.search(term) and "train: finished at 40/40" in term


def test_another_ranks_terminal_keeps_its_routine_lines_off_the_bar(tmp_path):
    """enabled=False (a rank other than 0 under torchrun, sharing rank 0's terminal): nothing drawn,
    no progress line, and its ROUTINE lines stay off the terminal; other lines still show."""
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, format='%(message)s', stream=sys.stderr)\n"
        "from specops.progress import ROUTINE, phase_progress\n"
        "log = logging.getLogger('specops.extract')\n"
        "with phase_progress('extract', 10, 'tok', logger=log, every_s=0, enabled=False) as bar:\n"
        "    bar.advance(10)\n"
        "    log.info('shard-01 finished', extra=ROUTINE)\n"
        "    log.warning('a warning')\n"
        "log.info('after, routine again', extra=ROUTINE)\n"
    )
    rc, term, _ = run_on_pty([sys.executable, "-c", script], child_env())
    assert rc == 0, term
    assert ESC not in term and "extract:" not in term and "shard-01" not in term
    assert "a warning" in term and "after, routine again" in term


def test_wants_bar_reads_the_stream_and_the_environment(monkeypatch):
    master, slave = pty.openpty()
    try:
        with open(slave, "w", closefd=False) as tty, open(os.devnull, "w") as null:
            monkeypatch.delenv(P.ENV, raising=False)
            monkeypatch.setenv("TERM", "xterm")
            assert P.wants_bar(tty) and not P.wants_bar(null)
            assert not P.wants_bar(tty, force_tty=False) and P.wants_bar(null, force_tty=True)
            monkeypatch.setenv(P.ENV, "plain")
            assert not P.wants_bar(tty)
            monkeypatch.setenv(P.ENV, "bar")
            assert P.wants_bar(null)
            monkeypatch.delenv(P.ENV)
            monkeypatch.setenv("TERM", "dumb")
            assert not P.wants_bar(tty)
    finally:
        os.close(master)
        os.close(slave)


# ----------------------------------------------------------------------------- plain lines


def test_the_plain_line_throttle_holds(tmp_path):
    lg, got = records("specops.test-throttle")
    every = 0.25
    with phase_progress("train", 10_000, "steps", logger=lg, every_s=every, stream=open(os.devnull, "w"),
                        force_tty=False) as bar:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.3:
            bar.advance(1)  # far more updates than lines
            time.sleep(0.001)
    periodic = [r for r in got if r.getMessage().startswith("train: ") and "ETA" in r.getMessage()]
    ends = [r for r in got if "finished at" in r.getMessage() or "ended at" in r.getMessage()]
    assert len(ends) == 1 and ends[0] is got[-1] and "ended at" in ends[0].getMessage()
    assert 3 <= len(periodic) <= 1.3 / every + 1, [r.getMessage() for r in got]
    gaps = [b.created - a.created for a, b in zip(periodic, periodic[1:])]
    assert min(gaps) >= every - 0.01, gaps
    assert all(getattr(r, "specops_routine", False) for r in got)  # a live bar would stand in for them
    first = periodic[0].getMessage()
    done = int(re.match(r"train: (\d+)/10k steps", first).group(1))
    rate = float(re.search(r", ([\d.]+) steps/s", first).group(1))
    assert done > 10 and 0.3 * done / every < rate < 3 * done / every, first


def test_no_line_before_the_interval_and_every_s_none_leaves_only_the_end_line():
    lg, got = records("specops.test-quiet")
    with phase_progress("generate", 5, "samples", logger=lg, every_s=None, force_tty=False) as bar:
        for _ in range(5):
            bar.advance()
    assert len(got) == 1 and got[0].getMessage().startswith("generate: finished at 5/5 samples after ")
    got.clear()
    with phase_progress("train", 5, "steps", logger=lg, every_s=60, force_tty=False) as bar:
        bar.advance(2)
    assert len(got) == 1 and got[0].getMessage().startswith("train: ended at 2/5 steps")


def test_an_unknown_total_degrades_to_a_counter(tmp_path):
    lg, got = records("specops.test-counter")
    with phase_progress("extract", None, "tok", logger=lg, every_s=0.05, force_tty=False) as bar:
        for _ in range(4):
            time.sleep(0.06)
            bar.advance(12_000)
    msgs = [r.getMessage() for r in got]
    assert any(re.fullmatch(r"extract: \d+k? tok, [\d.]+k? tok/s, elapsed \d+s", m) for m in msgs), msgs
    assert not any("%" in m or "ETA" in m for m in msgs)
    assert msgs[-1].startswith("extract: ended at 48k tok after")
    # The bar (forced, onto a file) draws a counter and no bar, then a bar once a total is known.
    out = tmp_path / "bar.txt"
    with open(out, "w") as f, phase_progress("extract", None, "tok", logger=lg, stream=f, force_tty=True) as bar:
        assert bar.live
        bar.advance(5000)
        bar._progress.refresh()
        before = out.read_text()
        bar.update(total=20_000)
        bar._progress.refresh()
    assert "5000 tok" in before and "━" not in before and "ETA" not in before and "elapsed" in before
    after = out.read_text()[len(before):]
    assert "━" in after and "5000/20k tok" in after and "ETA" in after


def test_a_resumed_phase_does_not_count_what_was_done_before_as_speed():
    lg, got = records("specops.test-resume")
    bar = phase_progress("train", 1000, "steps", logger=lg, done=900, force_tty=False, every_s=None).start()
    time.sleep(0.2)
    bar.update(910)
    r = bar.rate()
    bar.stop()
    assert r is not None and 10 / 0.5 < r < 10 / 0.15, r  # 10 steps in ~0.2 s, not 910
    assert "finished" not in got[-1].getMessage() and "ended at 910/1000 steps" in got[-1].getMessage()


def test_a_failure_ends_with_a_stopped_line_and_figures_persist():
    lg, got = records("specops.test-stop")
    with pytest.raises(KeyboardInterrupt):
        with phase_progress("eval", 4, "turns", logger=lg, every_s=None, force_tty=False) as bar:
            bar.tally("tau", 5, 2)
            bar.advance()
            bar.tally("tau", 1, 2)  # pooled: (5 + 1) / (2 + 2)
            bar.advance(tok_s=None)
            bar.update(loss=1.5)
            raise KeyboardInterrupt
    assert got[-1].getMessage().startswith("eval: stopped at 2/4 turns after ")
    assert got[-1].getMessage().endswith("; tau 1.500, loss 1.500")


def test_a_disabled_progress_logs_nothing_and_current_finds_the_open_one():
    lg, got = records("specops.test-rank")
    with phase_progress("extract", 10, "tok", logger=lg, enabled=False, force_tty=False, every_s=0) as bar:
        bar.advance(10)
        assert current("extract") is not bar and not current("extract").enabled
    assert got == []
    with phase_progress("eval", 3, "turns", logger=lg, force_tty=False, every_s=None) as bar:
        assert current("eval") is bar
        current("eval").advance(3)
    assert not current("eval").enabled and "finished at 3/3 turns" in got[-1].getMessage()
    current("eval").advance(1)  # no open progress: nothing happens


def test_only_one_bar_shows_at_a_time(tmp_path):
    lg, got = records("specops.test-nested")
    with open(tmp_path / "t", "w") as f:
        with phase_progress("train", 2, "steps", logger=lg, stream=f, force_tty=True) as outer:
            with phase_progress("eval", 2, "turns", logger=lg, stream=f, force_tty=True, every_s=None) as inner:
                assert outer.live and not inner.live
                inner.advance(2)
        with phase_progress("eval", 2, "turns", logger=lg, stream=f, force_tty=True) as again:
            assert again.live


def test_formats():
    assert [P.fmt_count(n) for n in (12, 9999, 12_345, 1_234_567, 2.5e9)] == ["12", "9999", "12.3k", "1.23M", "2.5G"]
    assert [P.fmt_rate(r) for r in (None, 3.14159, 31.4159, 314.159, 31_415.9)] == ["-", "3.14", "31.4", "314", "31.4k"]
    assert [P.fmt_duration(s) for s in (None, 0.4, 37, 275, 7380)] == ["-", "0s", "37s", "4m35s", "2h03m"]
    assert P.fmt_figure("tok_s", 12345.6) == "tok/s 12.3k" and P.fmt_figure("loss", 2.34567) == "loss 2.346"
    assert [P.fmt_figure("tau", v) for v in (1.0, 1000.0, 0.0012345, 7)] == [
        "tau 1.000", "tau 1000", "tau 0.001234", "tau 7"]


# ----------------------------------------------------------------------------- a real phase on a pty


def test_specops_extract_on_a_terminal_shows_the_bar(tmp_path):
    """`specops extract` on a tiny random Llama and a 4-shard build: the terminal shows the bar with
    the plan's tokens, rate and ETA; the per-shard lines stay off it; stdout's JSON summary is whole."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from specops.campaign import Campaign
    from specops.config import config_from_dict

    torch.manual_seed(0)
    model_dir = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                 tie_word_embeddings=False)).save_pretrained(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "q0", "prompt": "hi"}\n')
    cfg = config_from_dict({
        "campaign": {"name": "c", "dir": str(tmp_path / "c")},
        "target": {"model": str(model_dir), "dtype": "float32"},
        "datasets": [{"name": "d", "path": str(prompts)}],
        "extract": {"shard_tokens": 300, "token_budget": 128, "device": "cpu"},
    })  # fmt: skip
    camp = Campaign.create_or_open(cfg)
    build = camp.root / "build"
    build.mkdir()
    lengths = {"train": [70] * 14, "val": [50] * 4}  # train: 4 shards of <= 300 tokens; val: 1
    for split, lens in lengths.items():
        n = sum(lens)
        offsets = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
        save_file({"input_ids": torch.randint(0, 256, (n,), dtype=torch.int32),
                   "loss_mask": torch.ones(n, dtype=torch.uint8), "offsets": offsets},
                  str(build / f"{split}.safetensors"))
        (build / f"{split}.ids.jsonl").write_text("".join(
            json.dumps({"id": f"d/{split}{i}", "dataset": "d", "n_tokens": k, "n_trainable": k}) + "\n"
            for i, k in enumerate(lens)))
    env = child_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    rc, term, stdout = run_on_pty([sys.executable, "-m", "specops", "extract", str(camp.root), "--json"], env,
                                  timeout=120)
    assert rc == 0, term
    assert time.monotonic() - t0 < 60
    total = sum(map(sum, lengths.values()))  # 1180 tokens in the plan
    assert ESC in term and "━" in term, term
    assert re.search(rf"extract {BAR} {total}/{total} tok  [\d.k]+ tok/s  ETA 0s", ANSI.sub("", term)), term
    assert not re.search(r"shard-\d\d-\d{5}\.safetensors: \d+ samples", term), term  # the ROUTINE lines
    summary = json.loads(stdout)
    assert summary["splits"]["train"]["written"] == 4 and summary["splits"]["val"]["written"] == 1


def test_specops_generate_on_a_terminal_shows_one_bar_over_the_campaign(tmp_path):
    """`specops generate` against a loopback server, two datasets: one bar over both totals with the
    sample rate; with --no-progress the same terminal gets plain lines only."""
    from specops.config import config_from_dict, dump_toml
    from specops.testing.fake_server import start_fake_server

    for name, n in (("a", 7), ("b", 5)):
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps({"id": f"{name}{i}", "prompt": f"question {i}?"}) + "\n" for i in range(n)))
    env = child_env()
    with start_fake_server(tmp_path / "srv", model="fake-model") as srv:
        for run, extra in (("bar", []), ("plain", ["--no-progress"])):
            cfg = config_from_dict({
                "campaign": {"name": run, "dir": str(tmp_path / run)},
                "target": {"served_name": "fake-model"},
                "engine": {"kind": "openai", "endpoints": [srv.url]},
                "generate": {"max_tokens": 8, "heartbeat_interval_s": 0.2, "canary_samples": 0},
                "datasets": [{"name": "a", "path": str(tmp_path / "a.jsonl")},
                             {"name": "b", "path": str(tmp_path / "b.jsonl")}],
            })  # fmt: skip
            toml = tmp_path / f"{run}.toml"
            toml.write_text(dump_toml(cfg.to_dict()))
            rc, term, stdout = run_on_pty([sys.executable, "-m", "specops", "generate", str(toml), *extra], env)
            assert rc == 0, term
            if run == "bar":
                assert ESC in term and re.search(rf"generate {BAR} 12/12 samples  [\d.]+ samples/s  ETA 0s",
                                                 ANSI.sub("", term)), term
            else:
                assert ESC not in term and "━" not in term, term
