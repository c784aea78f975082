"""`specops serve` with the real vLLM: follows the load, passes every tier, stops leaving nothing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from specops.serverproc import free_port

pytestmark = pytest.mark.vllm


def test_serve_real_vllm_start_health_stop(tmp_path, shared_data, vllm_python):
    py = vllm_python
    port = free_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[campaign]\nname = "s"\ndir = "{tmp_path / "camp"}"\n[target]\nmodel = "smollm2"\n'
        f'[serve]\nengine = "vllm"\npython = "{py}"\nport = {port}\ngpus = []\n'
        f'extra_args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]\n'
        f'[[datasets]]\nname = "x"\nsource = "spec_bench"\npath = "{shared_data / "spec_bench"}"\n'
    )
    up = subprocess.run([sys.executable, "-m", "specops", "serve", str(cfg), "--detach"],
                        capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stderr[-3000:]
    assert f"ready in" in up.stdout and f"http://127.0.0.1:{port}/v1" in up.stdout
    assert "s] " in up.stderr  # load progress lines with the elapsed time
    try:
        health = subprocess.run([sys.executable, "-m", "specops", "health", str(cfg), "--url",
                                 f"http://127.0.0.1:{port}/v1", "--window", "0.5"],
                                capture_output=True, text=True, timeout=120)
        assert health.returncode == 0, health.stdout + health.stderr
    finally:
        down = subprocess.run([sys.executable, "-m", "specops", "serve", str(cfg), "--stop"],
                              capture_output=True, text=True, timeout=120)
    assert down.returncode == 0 and "stopped server group" in down.stdout, down.stdout + down.stderr
    import json

    pgid = json.loads((tmp_path / "camp" / "run" / f"serve-{port}.json").read_text())["pgid"]
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a new server would; TIME_WAIT is fine
    s.bind(("127.0.0.1", port))  # nothing listens there any more
    s.close()


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
