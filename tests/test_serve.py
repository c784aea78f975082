"""`specops serve` before anything starts: the vLLM and SGLang command lines, busy GPUs, bad drafters,
the served-eval config. The real vLLM starting, passing every tier and stopping: test_serve_drafter.py."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.vllm


def test_serve_refuses_busy_gpu_before_launch(tmp_path):
    """GPU 3 busy on an 8-GPU host (a recorded description): serve refuses without starting anything."""
    from pathlib import Path

    from specops.checks.gpu import RecordedSource
    from specops.config import config_from_dict
    from specops.errors import SpecopsError
    from specops.serve import check_gpus_free

    fixture = Path(__file__).parent / "fixtures" / "gpus" / "h200x8_gpu3_busy.json"
    cfg = config_from_dict({"serve": {"tensor_parallel_size": 8, "python": "/nonexistent/python"},
                            "datasets": [{"name": "x", "source": "gsm8k"}]})
    with pytest.raises(SpecopsError, match="refusing to start the server: .*GPU 3"):
        check_gpus_free(cfg, RecordedSource(fixture))
    cfg.serve.tensor_parallel_size = 4
    cfg.serve.gpus = [0, 1, 2, 4]  # steer around the busy GPU: allowed
    check_gpus_free(cfg, RecordedSource(fixture))


def test_server_argv_for_vllm_and_sglang(tmp_path):
    from pathlib import Path

    from specops.config import config_from_dict
    from specops.serve import server_argv

    def argv(engine):
        cfg = config_from_dict({"target": {"served_name": "kimi-k2"},
                                "serve": {"engine": engine, "python": "py", "port": 8001, "tensor_parallel_size": 8,
                                          "data_parallel_size": 2, "max_model_len": 32768,
                                          "reasoning_parser": "kimi", "tool_call_parser": "kimi_k2",
                                          "extra_args": ["--x"]},
                                "datasets": [{"name": "x", "source": "gsm8k"}]})
        return server_argv(cfg, Path("/m"))

    assert argv("vllm") == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m",
                            "--served-model-name", "kimi-k2", "--host", "127.0.0.1", "--port", "8001",
                            "--tensor-parallel-size", "8", "--data-parallel-size", "2", "--max-model-len", "32768",
                            "--reasoning-parser", "kimi", "--enable-auto-tool-choice", "--tool-call-parser",
                            "kimi_k2", "--x"]
    assert argv("sglang") == ["py", "-m", "sglang.launch_server", "--model-path", "/m",
                              "--served-model-name", "kimi-k2", "--host", "127.0.0.1", "--port", "8001",
                              "--tp-size", "8", "--dp-size", "2", "--context-length", "32768",
                              "--reasoning-parser", "kimi", "--tool-call-parser", "kimi_k2", "--x"]


# ------------------------------------------------------------------------------ serving a drafter


@pytest.fixture(scope="module")
def tiny_exports(tmp_path_factory):
    """A tiny Llama target and a random drafter for it, exported in both formats into a campaign's
    drafter/export/ (speculators: 5 speculative tokens, the verifier the target's directory)."""
    import json

    from builders import AUX, debug_drafter, make_target

    from specops.drafter.families.eagle3.export import export_speculators, export_vllm

    root = tmp_path_factory.mktemp("drafter")
    target = make_target(root / "target")
    hf = json.loads((target / "config.json").read_text())
    d = debug_drafter(96)
    kw = dict(target_config=hf, aux_layer_ids=AUX, target_name_or_path=str(target))
    exports = root / "camp" / "drafter" / "export"
    export_vllm(d.state_dict(), d.config.to_dict(), exports / "vllm", **kw)
    export_speculators(d.state_dict(), d.config.to_dict(), exports / "speculators", speculative_tokens=5, **kw)
    return {"root": root, "target": target, "exports": exports, "drafter": d}


def drafter_cfg(tiny_exports, engine="vllm", **serve):
    from specops.config import config_from_dict

    return config_from_dict({"campaign": {"name": "c", "dir": str(tiny_exports["root"] / "camp")},
                             "target": {"model": str(tiny_exports["target"]), "served_name": "t"},
                             "serve": {"engine": engine, "python": "py", "port": 8001, "gpus": [], **serve},
                             "datasets": [{"name": "x", "source": "gsm8k"}]})


def test_server_argv_with_a_drafter(tiny_exports):
    import json

    from specops.serve import resolve_drafter, server_argv

    target, exports = tiny_exports["target"], tiny_exports["exports"]
    head = ["py", "-m", "vllm.entrypoints.openai.api_server", "--model"]
    tail = ["--served-model-name", "t", "--host", "127.0.0.1", "--port", "8001", "--tensor-parallel-size", "1"]
    # the campaign's vLLM-format export, k = eval.k (7) by default
    argv = server_argv(drafter_cfg(tiny_exports, drafter="export"), target)
    assert argv[:-2] == head + [str(target)] + tail and argv[-2] == "--speculative-config"
    assert argv[-1] == '{"method":"eagle3","model":"%s","num_speculative_tokens":7}' % (exports / "vllm")
    cfg = drafter_cfg(tiny_exports, drafter=str(exports / "vllm"), num_speculative_tokens=3, extra_args=["--x"])
    assert json.loads(server_argv(cfg, target)[-2]) == {"method": "eagle3", "model": str(exports / "vllm"),
                                                        "num_speculative_tokens": 3}
    assert server_argv(cfg, target)[-1] == "--x"  # extra_args stay last
    # the speculators export is served as the model; k from the export unless [serve] sets it
    spec = drafter_cfg(tiny_exports, drafter="export:speculators")
    d = resolve_drafter(spec, target)
    assert (d.format, d.k, d.as_model, d.path) == ("speculators", 5, True, exports / "speculators")
    assert server_argv(spec, target) == head + [str(exports / "speculators")] + tail + [
        "--speculative-config", '{"num_speculative_tokens":5}']
    spec.serve.num_speculative_tokens = 2
    assert server_argv(spec, target)[-1] == '{"num_speculative_tokens":2}'


def test_sglang_argv_with_a_drafter(tiny_exports):
    from specops.errors import ConfigError
    from specops.serve import server_argv

    target, exports = tiny_exports["target"], tiny_exports["exports"]
    argv = server_argv(drafter_cfg(tiny_exports, "sglang", drafter="export", num_speculative_tokens=4), target)
    assert argv[:5] == ["py", "-m", "sglang.launch_server", "--model-path", str(target)]
    assert argv[-10:] == ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(exports / "vllm"),
                          "--speculative-num-steps", "4", "--speculative-eagle-topk", "1",
                          "--speculative-num-draft-tokens", "5"]
    with pytest.raises(ConfigError, match="SGLang's EAGLE-3 loader reads midlayer.* .* serve the vLLM-format export"):
        server_argv(drafter_cfg(tiny_exports, "sglang", drafter="export:speculators"), target)


def test_bad_drafters_are_refused_before_anything_starts(tiny_exports, tmp_path):
    import json
    import shutil

    from builders import make_target

    from specops.campaign import Campaign
    from specops.config import config_from_dict
    from specops.errors import ConfigError
    from specops.serve import server_argv, start

    target, exports = tiny_exports["target"], tiny_exports["exports"]
    with pytest.raises(ConfigError, match=r"serve.drafter: .*export:foo.*expected one of export, export:vllm"):
        drafter_cfg(tiny_exports, drafter="export:foo")
    with pytest.raises(ConfigError, match="serve.num_speculative_tokens: must be > 0"):
        drafter_cfg(tiny_exports, drafter="export", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match=r"no drafter directory at .*missing"):
        server_argv(drafter_cfg(tiny_exports, drafter=str(tmp_path / "missing")), target)
    empty = config_from_dict({"campaign": {"name": "c", "dir": str(tmp_path / "fresh")},
                              "target": {"model": str(target)}, "serve": {"drafter": "export"},
                              "datasets": [{"name": "x", "source": "gsm8k"}]})
    with pytest.raises(ConfigError, match=r"drafter/export/vllm; run `specops export` first"):
        server_argv(empty, target)
    with pytest.raises(ConfigError, match="extra_args has --speculative-config .* give the drafter once"):
        server_argv(drafter_cfg(tiny_exports, drafter="export", extra_args=["--speculative-config", "{}"]), target)

    # another target (a wider vocab): the export's check names the mismatch
    other = make_target(tmp_path / "other", vocab=128)
    cfg = drafter_cfg(tiny_exports, drafter="export")
    cfg.target.model = str(other)
    with pytest.raises(ConfigError, match=r"fails its check against the target .*other.*vocab_size 96, target has 128"):
        server_argv(cfg, other)
    # a broken file: d2t maps two draft ids to one target id
    broken = tmp_path / "broken"
    shutil.copytree(exports / "vllm", broken)
    from safetensors.torch import load_file, save_file

    t = load_file(str(broken / "model.safetensors"))
    t["d2t"][1] = t["d2t"][0] - 1
    save_file(t, str(broken / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"\[vocab.d2t_duplicates\]"):
        server_argv(drafter_cfg(tiny_exports, drafter=str(broken)), target)
    # a speculators export naming another verifier: vLLM would serve that model
    spec = tmp_path / "spec"
    shutil.copytree(exports / "speculators", spec)
    c = json.loads((spec / "config.json").read_text())
    c["speculators_config"]["verifier"]["name_or_path"] = str(other)
    (spec / "config.json").write_text(json.dumps(c))
    with pytest.raises(ConfigError, match=r"names the verifier .*other.*not the target's model directory"):
        server_argv(drafter_cfg(tiny_exports, drafter=str(spec)), target)

    # start() refuses before launching: no log, no record, no process
    cfg = drafter_cfg(tiny_exports, drafter=str(broken), python="/nonexistent/python")
    camp = Campaign.create_or_open(cfg)
    with pytest.raises(ConfigError, match="d2t_duplicates"):
        start(cfg, camp)
    assert not list(camp.run_dir.glob("serve-*"))


def test_cpu_openmp_preload(tmp_path):
    from specops.serve import cpu_openmp_preload

    env = tmp_path / "venv"
    (env / "bin").mkdir(parents=True)
    py = str(env / "bin" / "python")
    assert cpu_openmp_preload(py, {}) is None  # no libiomp5 in that environment
    (env / "lib").mkdir()
    (env / "lib" / "libiomp5.so").write_bytes(b"")
    lib = str(env / "lib" / "libiomp5.so")
    assert cpu_openmp_preload(py, {}) == lib
    assert cpu_openmp_preload(py, {"LD_PRELOAD": "/x/libtcmalloc.so"}) == f"{lib}:/x/libtcmalloc.so"
    for runtime in ("/opt/libiomp5.so", "/t/libgomp.so.1", "/l/libomp.so"):  # an OpenMP already chosen
        assert cpu_openmp_preload(py, {"LD_PRELOAD": runtime}) is None


def test_the_per_request_metrics_flag_only_where_the_servers_vllm_has_it(tiny_exports, tmp_path):
    """vLLM reports each request's accepted drafts per step with --per-request-spec-decode-metrics
    detailed (what the interop check compares); a vLLM without the flag would refuse to start."""
    from specops.serve import PER_REQUEST_METRICS_FLAG, server_argv, vllm_has_flag

    env = tmp_path / "env"
    arg_utils = env / "lib" / "python3.11" / "site-packages" / "vllm" / "engine" / "arg_utils.py"
    arg_utils.parent.mkdir(parents=True)
    arg_utils.write_text('parser.add_argument("--speculative-config")\n')
    py = str(env / "bin" / "python")
    assert not vllm_has_flag(py, PER_REQUEST_METRICS_FLAG)
    argv = server_argv(drafter_cfg(tiny_exports, drafter="export", python=py), tiny_exports["target"])
    assert PER_REQUEST_METRICS_FLAG not in argv
    arg_utils.write_text(f'parser.add_argument("{PER_REQUEST_METRICS_FLAG}")\n')
    assert vllm_has_flag(py, PER_REQUEST_METRICS_FLAG)
    argv = server_argv(drafter_cfg(tiny_exports, drafter="export", python=py), tiny_exports["target"])
    assert argv[argv.index(PER_REQUEST_METRICS_FLAG) + 1] == "detailed"
    # the target alone (the served eval's baseline): no drafter flags at all
    argv = server_argv(drafter_cfg(tiny_exports, drafter="export", python=py), tiny_exports["target"],
                       with_drafter=False)
    assert "--speculative-config" not in argv and PER_REQUEST_METRICS_FLAG not in argv


def test_eval_served_settings_are_checked(tmp_path):
    from specops.config import config_from_dict
    from specops.errors import ConfigError

    base = {"campaign": {"name": "c", "dir": str(tmp_path)}, "target": {"model": "smollm2"},
            "datasets": [{"name": "x", "source": "gsm8k"}]}
    for bad, why in (({"server_url": "http://h:1/"}, "ending in /v1"), ({"served_concurrency": 0}, ">= 1"),
                     ({"interop_tolerance": 1.5}, "[0, 1)")):
        with pytest.raises(ConfigError, match=re.escape(why)):
            config_from_dict({**base, "eval": bad})
    cfg = config_from_dict({**base, "eval": {"served": True, "server_url": "http://127.0.0.1:8000/v1"}})
    assert cfg.eval.interop and cfg.eval.served_concurrency == 8


# ------------------------------------------------------------------------------ engine conventions


def _deepseek_dir(path, **keys):
    """A DeepSeek-V3 config.json (no weights): what server_argv and the checks read."""
    import json

    from tiny_targets import deepseek_config

    path.mkdir(parents=True, exist_ok=True)
    c = deepseek_config().to_dict()
    for k in ("scoring_func", "topk_method"):
        c.pop(k, None)
    c.update({k: v for k, v in keys.items() if v is not None})
    (path / "config.json").write_text(json.dumps(c))
    return path


def test_mla_targets_get_the_torch_rotary_on_cpu_vllm_only(tmp_path):
    import json

    from builders import make_llama

    from specops.config import config_from_dict
    from specops.serve import server_argv

    ds = _deepseek_dir(tmp_path / "ds", scoring_func="sigmoid", topk_method="noaux_tc")
    llama = make_llama(tmp_path / "llama")

    def argv(model, engine="vllm", gpus=(), extra=()):
        cfg = config_from_dict({"serve": {"engine": engine, "python": "py", "gpus": list(gpus),
                                          "extra_args": list(extra)},
                                "datasets": [{"name": "x", "source": "gsm8k"}]})
        return server_argv(cfg, model)

    cpu = argv(ds)
    assert json.loads(cpu[cpu.index("--compilation-config") + 1]) == {"custom_ops": ["-rotary_embedding"]}
    assert "--compilation-config" not in argv(ds, gpus=[0])  # GPUs: vLLM's CUDA rotary kernel is right
    assert "--compilation-config" not in argv(ds, engine="sglang")
    assert "--compilation-config" not in argv(llama)  # no MLA: its 3-D [tokens, heads, 64] query never occurs
    own = argv(ds, extra=["--compilation-config", '{"level":0}'])
    assert own.count("--compilation-config") == 1 and own[-1] == '{"level":0}'  # the user's own setting wins


def test_deepseek_configs_whose_routing_the_engines_read_otherwise_are_refused(tmp_path):
    from specops.campaign import Campaign
    from specops.config import config_from_dict
    from specops.errors import ConfigError
    from specops.preflight import _engine_config_check
    from specops.serve import start
    from specops.target.conventions import engine_config_problems

    assert engine_config_problems({"model_type": "llama", "num_hidden_layers": 2}) == []
    good = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    assert engine_config_problems(good) == []
    assert engine_config_problems({"text_config": good, "model_type": "llava"}) == []
    missing = engine_config_problems({"model_type": "deepseek_v3", "num_hidden_layers": 2})
    assert len(missing) == 2 and "names no scoring_func" in missing[0] and "'softmax'" in missing[0]
    assert "names no topk_method" in missing[1] and "noaux_tc" in missing[1]
    wrapped = engine_config_problems({"model_type": "llava", "text_config": {**good, "scoring_func": "softmax"}})
    assert wrapped and "has scoring_func = 'softmax'" in wrapped[0]
    # preflight: a no-go row for the family, none for other targets
    (row,) = _engine_config_check({"model_type": "deepseek_v3", "num_hidden_layers": 2})
    assert row.status == "nogo" and "scoring_func" in row.message
    (row,) = _engine_config_check(good)
    assert row.status == "go"
    assert _engine_config_check({"model_type": "llama", "num_hidden_layers": 2}) == []
    # serve: refused before anything starts
    ds = _deepseek_dir(tmp_path / "ds", topk_method="noaux_tc")
    cfg = config_from_dict({"campaign": {"name": "c", "dir": str(tmp_path / "camp")}, "target": {"model": str(ds)},
                            "serve": {"python": "/nonexistent/python", "gpus": []},
                            "datasets": [{"name": "x", "source": "gsm8k"}]})
    with pytest.raises(ConfigError, match=r"names no scoring_func"):
        start(cfg, Campaign.create_or_open(cfg))
    assert not list((tmp_path / "camp").rglob("serve-*.log"))
