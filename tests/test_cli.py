"""The command line (src/specops/cli.py), run as a real `python -m specops` subprocess.

Exit codes (cli.main, errors.py): 0 success; 2 a usage error (argparse) or any SpecopsError, printed
as one `Type: message` line on stderr with no traceback; 130 SIGINT/SIGTERM. The checking verbs
report through the code: status and export --check 2 on a problem; health and preflight 1 on a
warning, 2 on a failure; eval 1 on a no-go verdict.
Elsewhere: a bad value in campaign.toml (tests/test_config.py), the lock refusal and SIGTERM during
generate (tests/test_resume_kill.py), reset (tests/test_reset.py), status/stop on live runs
(tests/test_status_detach.py), export --check on real drafters (tests/test_train_targets.py).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import specops
from specops.campaign import Campaign
from specops.cli import build_parser
from specops.config import load_config

SRC = Path(specops.__file__).resolve().parents[1]  # the subprocess imports the same specops as this test


def _subparsers():
    p = build_parser()
    (action,) = [a for a in p._actions if a.dest == "verb"]
    helps = {c.dest: c.help for c in action._choices_actions}
    return action.choices, helps


SUBPARSERS, VERB_HELP = _subparsers()
VERBS = list(SUBPARSERS)
# Verbs that read a campaign.toml given as their first positional argument (reset: its second).
CONFIG_VERBS = {
    "generate": [], "build": [], "run": [], "serve": [], "preflight": [], "health": [], "export": [],
    "extract": [], "train": [], "eval": [], "reset": ["generate"], "status": [], "stop": [],
}


def cli_env() -> dict[str, str]:
    # COLUMNS: rich and argparse wrap at the terminal width; 200 keeps each message on one line.
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
            "COLUMNS": "200"}


def specops_cli(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specops", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=cli_env())


def assert_one_line_error(out: subprocess.CompletedProcess, line: str | re.Pattern, code: int = 2) -> None:
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == code, (out.returncode, out.stderr)
    assert out.stdout == "" and out.stderr.endswith("\n") and out.stderr.count("\n") == 1, out.stderr
    if isinstance(line, str):
        assert out.stderr == line + "\n"
    else:
        assert line.fullmatch(out.stderr.rstrip("\n")), out.stderr


# ---------------------------------------------------------------------------- help and usage


def test_the_parser_has_the_documented_verbs():
    assert set(VERBS) == {"preflight", "serve", "health", "generate", "status", "build", "extract", "train",
                          "export", "eval", "run", "stop", "reset"}
    assert set(CONFIG_VERBS) == set(VERBS)


def test_help_lists_every_verb_with_its_summary():
    out = specops_cli("--help")
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.startswith("usage: specops [-h] [--version] [-v] VERB ...\n")
    listed = re.findall(r"^ {4}(\w+) {2,}(.*)$", out.stdout, flags=re.M)
    assert [v for v, _ in listed] == VERBS
    for verb, first in listed:
        assert VERB_HELP[verb].startswith(first.strip()), (verb, first)


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_has_help(verb):
    out = specops_cli(verb, "--help")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.startswith(f"usage: specops {verb} [-h]")
    flat = " ".join(out.stdout.split())
    for action in SUBPARSERS[verb]._actions:
        for opt in action.option_strings or [action.metavar or action.dest]:
            assert opt in out.stdout, (verb, opt)
        if action.help:
            assert " ".join(action.help.split()) in flat, (verb, action.help)


def test_version():
    out = specops_cli("--version")
    assert (out.returncode, out.stdout, out.stderr) == (0, f"specops {specops.__version__}\n", "")


@pytest.mark.parametrize(
    "argv, usage, message",
    [
        (["bogus"], "usage: specops [-h] [--version] [-v] VERB ...",
         "specops: error: argument VERB: invalid choice: 'bogus' (choose from "
         + ", ".join(f"'{v}'" for v in VERBS) + ")"),
        ([], "usage: specops [-h] [--version] [-v] VERB ...",
         "specops: error: the following arguments are required: VERB"),
        (["status", "--bogus"], "usage: specops [-h] [--version] [-v] VERB ...",
         "specops: error: unrecognized arguments: --bogus"),
        (["generate"], "usage: specops generate [-h]",
         "specops generate: error: the following arguments are required: config"),
        (["extract", "c.toml", "--split", "dev"], "usage: specops extract [-h]",
         "specops extract: error: argument --split: invalid choice: 'dev' (choose from 'train', 'val', 'both')"),
        (["train", "c.toml", "--max-steps", "ten"], "usage: specops train [-h]",
         "specops train: error: argument --max-steps: invalid int value: 'ten'"),
    ],
    ids=["unknown-verb", "no-verb", "unknown-flag", "missing-arg", "bad-choice", "bad-int"],
)
def test_usage_errors_exit_2_with_usage_on_stderr(argv, usage, message):
    out = specops_cli(*argv)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith(usage) and out.stderr.rstrip("\n").endswith("\n" + message), out.stderr
    assert "Traceback" not in out.stderr


# ---------------------------------------------------------------------------- campaign.toml errors


# extract, train, eval and export import torch first (seconds each): the malformed case covers them.
@pytest.mark.parametrize("verb", sorted(set(CONFIG_VERBS) - {"status", "stop", "extract", "train", "eval", "export"}))
def test_a_missing_config_is_one_line_and_exit_2(verb, tmp_path):
    path = tmp_path / "nope.toml"
    out = specops_cli(verb, *CONFIG_VERBS[verb], str(path))
    assert_one_line_error(out, f"ConfigError: {path}: config file not found")


@pytest.mark.parametrize("verb", sorted(CONFIG_VERBS))
def test_malformed_toml_is_one_line_and_exit_2(verb, tmp_path):
    path = tmp_path / "campaign.toml"
    path.write_text('[campaign\nname = "x"\n')
    out = specops_cli(verb, *CONFIG_VERBS[verb], str(path))
    assert_one_line_error(out, re.compile(re.escape(f"ConfigError: {path}: not valid TOML: ") + r"\S.*"))


@pytest.mark.parametrize("verb", ["generate", "run", "preflight"])
def test_an_unknown_key_is_named_with_a_suggestion(verb, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"id": "q0", "prompt": "hi"}\n')
    path = tmp_path / "campaign.toml"
    path.write_text('[campaign]\nnmae = "x"\n[[datasets]]\nname = "ds"\npath = "p.jsonl"\n')
    out = specops_cli(verb, str(path))
    assert_one_line_error(out, "ConfigError: campaign.nmae: unknown key (did you mean 'name'?)")


def test_a_campaign_toml_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "campaign.toml"
    path.write_bytes(b'[campaign]\nname = "\xff\xfe"\n')
    out = specops_cli("run", str(path))
    assert_one_line_error(out, re.compile(re.escape(f"ConfigError: {path}: not ") + r"(UTF-8 text|valid TOML): .+"))


def test_a_changed_dataset_source_is_refused_and_the_suggested_reset_works(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text('{"id": "q0", "prompt": "hi"}\n')
    c1, c2 = tmp_path / "c1.toml", tmp_path / "c2.toml"
    for path, data in ((c1, "a.jsonl"), (c2, "b.jsonl")):
        path.write_text(f'[campaign]\ndir = "my camp"\n[[datasets]]\nname = "ds"\npath = "{data}"\n')
    camp = Campaign.create_or_open(load_config(c1))
    camp.dataset_dir("ds").mkdir(parents=True)
    (camp.dataset_dir("ds") / "records.jsonl").write_text('{"id": "q0"}\n')
    out = specops_cli("generate", str(c2))
    assert_one_line_error(out, re.compile(re.escape(
        f"ConfigError: datasets 'ds'.path: differs from the campaign's recorded config "
        f"('{tmp_path / 'a.jsonl'}' -> '{tmp_path / 'b.jsonl'}'); the existing records were made with the old "
        f"value. Use a new campaign directory or `") + r"(specops reset generate .+ --dataset ds)`\."))
    suggested = shlex.split(re.search(r"`(specops reset [^`]+)`", out.stderr).group(1))
    assert suggested[:3] == ["specops", "reset", "generate"] and Path(suggested[3]) == camp.root
    reset = specops_cli(*suggested[1:], cwd=Path("/"))  # as printed, from anywhere
    assert reset.returncode == 0 and reset.stdout.startswith("archived generate/ds to "), reset.stderr
    Campaign.create_or_open(load_config(c2))  # the new source is taken now
    assert camp.read_manifest()["config"]["datasets"][0]["path"] == str(tmp_path / "b.jsonl")


def test_export_without_a_campaign_or_check_says_what_to_give():
    assert_one_line_error(specops_cli("export"), "ConfigError: export: give a campaign.toml (or --check DIR)")


def test_health_without_a_target_says_what_to_give():
    assert_one_line_error(specops_cli("health"), "ConfigError: health: give a campaign.toml, or both --url and --model")


# ---------------------------------------------------------------------------- export --check


def safetensors(path: Path, names: list[str]) -> None:
    """A real safetensors file: 8-byte little-endian header size, JSON header, 4 float32 per tensor."""
    header = {n: {"dtype": "F32", "shape": [2, 2], "data_offsets": [16 * i, 16 * (i + 1)]} for i, n in enumerate(names)}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 16 * len(names))


def not_drafters(base: Path) -> dict[str, tuple[Path, str, str]]:
    """Directories that are not drafters -> (dir, problem name, start of its message). The missing and
    unreadable weights cases are checked in-process in tests/test_export.py."""
    out = {}
    empty = base / "empty"
    empty.mkdir(parents=True)
    out["no-config"] = (empty, "config.missing", f"{empty}/config.json does not exist")
    bad = base / "badjson"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    out["config-not-json"] = (bad, "config.json", "config.json is not JSON: ")
    llama = base / "llama"
    llama.mkdir()
    (llama / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 2}')
    safetensors(llama / "model.safetensors", ["model.embed_tokens.weight", "lm_head.weight"])
    out["a-target-model"] = (llama, "format", "neither EAGLE-3 architecture nor speculators_model_type")
    return out


def test_export_check_names_the_problem_of_each_non_drafter(tmp_path):
    cases = not_drafters(tmp_path)
    # Concurrent: each run imports torch (seconds of CPU), the checks themselves take milliseconds.
    procs = {label: subprocess.Popen([sys.executable, "-m", "specops", "export", "--check", str(d),
                                      *(["--json"] if label != "no-config" else [])],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
             for label, (d, _, _) in cases.items()}
    outs = {label: p.communicate(timeout=120) + (p.returncode,) for label, p in procs.items()}
    for label, (stdout, stderr, rc) in outs.items():
        d, name, message = cases[label]
        assert rc == 2 and stderr == "", (label, stderr)
        if label == "no-config":  # the human report: a verdict line, then one line per problem
            assert stdout.splitlines()[0] == f"{d}: unknown drafter dir: FAIL (1 blocking)"
            assert re.search(rf"^  nogo +{re.escape(name)} +{re.escape(message)}$", stdout, flags=re.M), stdout
            continue
        rep = json.loads(stdout)
        assert (rep["path"], rep["format"], rep["ok"]) == (str(d), "unknown", False), (label, rep)
        assert [(p["name"], p["status"]) for p in rep["problems"]] == [(name, "nogo")], (label, rep)
        assert rep["problems"][0]["message"].startswith(message), (label, rep)


def test_export_check_on_weights_with_a_corrupt_header_size(tmp_path):
    d = tmp_path / "corrupt"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaEagle3Model"]}')
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 62) + b"{}")
    out = specops_cli("export", "--check", str(d), "--json")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert [p["name"] for p in json.loads(out.stdout)["problems"]] == ["weights.unreadable"]


# ---------------------------------------------------------------------------- status, stop, signals


def test_status_json_on_a_directory_that_is_not_a_campaign(tmp_path):
    for args, cwd in (([str(tmp_path)], None), ([], tmp_path)):
        out = specops_cli("status", *args, "--json", cwd=cwd)
        assert out.returncode == 2 and out.stderr == "", out.stderr
        rep = json.loads(out.stdout)
        assert (rep["state"], rep["ok"]) == ("new", False)
        assert rep["problems"] == [f"no campaign at {tmp_path} (no manifest.json)"]


def test_status_on_a_directory_that_is_not_a_campaign_says_so(tmp_path):
    out = specops_cli("status", str(tmp_path))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"no campaign at {tmp_path} (no manifest.json)" in out.stdout


def test_status_of_a_new_campaign_is_readable_and_clean(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"id": "q0", "prompt": "hi"}\n')
    cfg = tmp_path / "c.toml"
    cfg.write_text('[campaign]\ndir = "camp"\n[[datasets]]\nname = "ds"\npath = "p.jsonl"\n')
    camp = Campaign.create_or_open(load_config(cfg))
    for target in (str(camp.root), str(cfg)):  # the directory, or the config that names it
        out = specops_cli("status", target, "--json")
        assert out.returncode == 0 and out.stderr == "", out.stderr
        rep = json.loads(out.stdout)
        assert (rep["campaign"], rep["ok"], rep["problems"]) == (str(camp.root), True, [])
    human = specops_cli("status", str(camp.root))
    assert human.returncode == 0 and human.stdout.startswith(f"{camp.root}\nstate: "), human.stdout


def test_stop_with_nothing_running(tmp_path):
    out = specops_cli("stop", str(tmp_path))
    assert (out.returncode, out.stdout, out.stderr) == (0, f"nothing running in {tmp_path}\n", "")


def sigterm_caught(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (bit 15 of SigCgt): cli.main installs one."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (signal.SIGTERM - 1) & 1)


def test_sigterm_exits_130_with_one_line(tmp_path):
    """`status --watch` loops until stopped; a SIGTERM once main() runs unwinds as an interrupt."""
    (tmp_path / "p.jsonl").write_text('{"id": "q0", "prompt": "hi"}\n')
    cfg = tmp_path / "c.toml"
    cfg.write_text('[campaign]\ndir = "camp"\n[[datasets]]\nname = "ds"\npath = "p.jsonl"\n')
    camp = Campaign.create_or_open(load_config(cfg))
    p = subprocess.Popen([sys.executable, "-m", "specops", "status", str(camp.root), "--watch", "--interval", "0.1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    try:
        deadline = time.monotonic() + 60
        while p.poll() is None and not sigterm_caught(p.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if p.poll() is not None or not sigterm_caught(p.pid):
            p.kill()
            raise AssertionError(f"no SIGTERM handler came up (exit {p.wait()}): {p.communicate()[1]}")
        time.sleep(0.3)  # into the watch loop
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert (p.returncode, err) == (130, "Interrupted\n")
    assert str(camp.root) in out  # the last view, printed as the live display closes


def test_sigterm_during_a_health_probe_exits_130_without_stray_tracebacks():
    """`specops health` against a server that accepts and never answers: SIGTERM while the request
    waits cancels it inside the event loop; the exit is 130 with one line, no task left unread."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "specops", "health", "--url", f"http://127.0.0.1:{port}/v1",
                          "--model", "m"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    conns = []
    try:
        srv.settimeout(60)
        conns.append(srv.accept()[0])  # the TCP tier connects and closes; the /health request then waits
        conns.append(srv.accept()[0])
        time.sleep(0.3)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        for c in conns:
            c.close()
        srv.close()
    assert p.returncode == 130, (p.returncode, err)
    assert "Traceback" not in err and "never retrieved" not in err, err
    assert err.strip().splitlines()[-1] == "Interrupted", err
