"""extract.mode = "served" with serve.engine = "sglang" (target/served_sglang.py) against a scripted
server on 127.0.0.1 that answers /generate the way SGLang 0.5.23 does (served_sglang.py's module
docstring gives the sources). The server is configured from the argv `specops serve --features`
builds for SGLang: `--return-aux-hidden-state-layer-ids` ids k are captured, as by SGLang's DFLASH
hook, at layer index k + 1, the residual stream entering that layer; index L, the last layer's output
before the norm, is captured at the final norm as SGLang's gpt_oss.py does. The rows come from a tiny
random-weight GPT-OSS in this process (transformers' GptOssForCausalLM from a config: 8 layers of
sliding and full attention with sinks, 4 experts, 2 per token), with the prefill's T rows of K x H
floats in meta_info.hidden_states. GPT-OSS is a family SGLang 0.5.23 gives the final state for; a
Llama target and a DeepSeek-V3 one, which it does not, are refused up front.

Checked: fp32 features equal in-process ones (measured bit-identical: the same fp32 forward, floats
that JSON carries exactly), and the whole extract equals the offline extract (measured within 2.5e-5
relative, as offline's padded batches change the fp32 sums; bounded as the vLLM test bounds it). The
control of ids one layer off fails (0.5-0.75 relative), and a server without
hidden states, a token count or id the server saw that differs from what was sent, or rows of one
prefill chunk only, each give their own clear error. The extract plan's kill and resume are
engine-independent (test_served_extract.py covers them on vLLM)."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest
import torch

from builders import hf_reference, make_llama, write_build
from tiny_targets import VOCAB, deepseek_config, randomize_norms
from specops.campaign import Campaign
from specops.config import config_from_dict
from specops.errors import ConfigError, SpecopsError
from specops.extract import run_extract
from specops.features import compare_splits
from specops.serve import server_argv
from specops.target.conventions import read_text_config
from specops.target.inprocess import compute_features, load_target
from specops.target.served_sglang import ServedSglangTarget, sglang_family_problem, sglang_features_argv

pytestmark = pytest.mark.usefixtures("one_thread")

AUX = [2, 4, 5]  # the tiny GPT-OSS's default ids (8 layers)
L = 8
FLAGS = ["--enable-return-aux-hidden-states", "--speculative-algorithm", "DFLASH",
         "--return-aux-hidden-state-layer-ids", "1", "3", "4", "7", "--disable-radix-cache",
         "--chunked-prefill-size", "-1"]
LENGTHS = {"train": [37, 120, 64, 9, 150, 80, 33, 1, 96, 21], "val": [50, 70, 12]}
TOLERANCE = 2.0**-7  # per-vector relative, stored in bf16 (features.compare_splits)
# SGLang's refusal of return_hidden_states on a server started without the flags (tokenizer_manager.py)
NOT_CONFIGURED = ("The server is not configured to return hidden states. Please set `--return-hidden-states-mode "
                  "last`, `--return-hidden-states-mode full`, or the legacy `--enable-return-hidden-states` flag.")
# specops' refusal of a family whose final state SGLang does not capture (served_sglang.py)
NO_FINAL_STATE = (r"SGLang 0\.5\.23 captures no pre-norm final state .* for a '{}' target: .*"
                  r"serve\.engine = \"vllm\", extract_hidden_states\), which runs Llama and DeepSeek-V3 \(MLA\)")


def make_gpt_oss(path: Path) -> Path:
    """A tiny random-weight GPT-OSS (8 layers, alternating sliding and full attention), saved to `path`."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
        max_position_embeddings=1024, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32},
    )  # fmt: skip
    model = GptOssForCausalLM(cfg).eval()
    randomize_norms(model)
    model.save_pretrained(path)
    return path


def config(root: Path, model_dir: Path, *, mode: str = "served", urls: list[str] | None = None,
           aux: list[int] = AUX, **extract):
    root.mkdir(parents=True, exist_ok=True)
    prompts = root.parent / f"{root.name}-prompts.jsonl"
    prompts.write_text('{"id": "q0", "prompt": "hi"}\n')
    x = {"mode": mode, "aux_layer_ids": aux, "shard_tokens": 200, "token_budget": 160, "served_concurrency": 3,
         **({"server_urls": urls} if urls else {}), **extract}
    return config_from_dict({"campaign": {"name": root.name, "dir": str(root)}, "target": {"model": str(model_dir)},
                             "serve": {"engine": "sglang", "python": "py", "port": 30000, "gpus": []},
                             "datasets": [{"name": "d", "path": str(prompts)}], "extract": x})


class ScriptedSglang:
    """SGLang's /generate for `argv`'s capture flags, the states from the model in `model_dir`.

    fault: None, or "plain" (started without the flags: SGLang's 400), "no_states" (200 without
    meta_info.hidden_states), "other_id" (the last token the server holds is not the one sent),
    "dropped" (the server holds one token less), "chunked" (the rows of the last prefill chunk only)."""

    def __init__(self, model_dir: Path, argv: list[str], fault: str | None = None):
        from transformers import GptOssForCausalLM

        i = argv.index("--return-aux-hidden-state-layer-ids") + 1
        ids = []
        while i < len(argv) and not argv[i].startswith("--"):
            ids.append(int(argv[i]))
            i += 1
        self.capture = sorted(k + 1 for k in ids)  # DFLASH's hook: layer output k = the input to layer k + 1
        self.model = GptOssForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.fault, self.hits, self.lock = fault, 0, threading.Lock()

    def generate(self, body: dict) -> tuple[int, dict]:
        with self.lock:
            self.hits += 1
        if self.fault == "plain" and body.get("return_hidden_states"):
            return 400, {"error": {"message": NOT_CONFIGURED}}
        assert body["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0}, body
        held = list(body["input_ids"])
        if self.fault == "dropped":
            held = held[1:]
        if self.fault == "other_id":
            held[-1] = (held[-1] + 1) % self.model.config.vocab_size
        with self.lock:
            hs, post, pre = hf_reference(self.model, torch.tensor(held), self.model.model)
        rows = torch.cat([hs[i] if i < L else pre for i in self.capture], -1)  # [T, K x H], layer order
        if self.fault == "chunked":
            rows = rows[-max(1, len(held) // 3):]
        start = body.get("logprob_start_len", -1)
        meta = {"id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": len(held),
                "completion_tokens": 1, "cached_tokens": 0,
                "hidden_states": [rows.tolist()]}
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = [[None if p == 0 else -1.0, t, None] for p, t in
                                            enumerate(held) if p >= start]
        if self.fault == "no_states":
            del meta["hidden_states"]
        return 200, {"text": "", "output_ids": [int(post[-1].argmax())], "meta_info": meta}


@pytest.fixture
def sglang_server():
    """A factory: (model_dir, argv, fault) -> (the server's OpenAI base URL, its ScriptedSglang)."""
    servers = []

    def start(model_dir: Path, argv: list[str], fault: str | None = None):
        script = ScriptedSglang(model_dir, argv, fault)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, out = (script.generate(body) if self.path == "/generate"
                               else (404, {"detail": "Not Found"}))
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}/v1", script

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory) -> Path:
    return make_gpt_oss(tmp_path_factory.mktemp("sglang") / "gpt-oss")


def features_argv(cfg, model_dir: Path, aux: list[int] = AUX) -> list[str]:
    return server_argv(cfg, model_dir, features=(aux, L, Path("/unused")))


def target(url: str, model_dir: Path, aux: list[int] = AUX) -> ServedSglangTarget:
    return ServedSglangTarget([url], model="gpt-oss", config=read_text_config(model_dir), model_dir=model_dir,
                              layer_ids=aux, concurrency=2, attempts=2)


def rows(n: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (k,), generator=g) for k in (41, 17, 3)[:n]]


def test_server_argv_for_sglang_features_has_the_capture_flags(tmp_path, gpt_oss_dir):
    cfg = config(tmp_path / "c", gpt_oss_dir)
    cfg.serve.extra_args = ["--x"]
    argv = features_argv(cfg, gpt_oss_dir)
    assert argv[:3] == ["py", "-m", "sglang.launch_server"] and argv[argv.index("--model-path") + 1] == str(gpt_oss_dir)
    assert argv[-len(FLAGS) - 1:] == [*FLAGS, "--x"]  # specops ids [2, 4, 5] + L = 8 as layer outputs 1 3 4 7
    assert "--speculative-config" not in argv and "--kv-transfer-config" not in argv
    # an aux id equal to L is the final state itself: SGLang is asked for each layer once
    argv = features_argv(cfg, gpt_oss_dir, [2, 5, 8])
    i = argv.index("--return-aux-hidden-state-layer-ids")
    assert argv[i + 1:i + 5] == ["1", "4", "7", "--disable-radix-cache"]
    with pytest.raises(ConfigError, match="cannot capture aux layer id 0"):
        features_argv(cfg, gpt_oss_dir, [0, 2, 5])


def test_served_sglang_features_equal_in_process_fp32(tmp_path, gpt_oss_dir, sglang_server):
    local = load_target(gpt_oss_dir, torch.float32, "cpu")
    cfg = config(tmp_path / "c", gpt_oss_dir)
    for aux in (AUX, [5, 2, 4], [2, 5, 8]):  # the configured order, and an aux id that is the final state
        url, script = sglang_server(gpt_oss_dir, features_argv(cfg, gpt_oss_dir, aux))
        t = target(url, gpt_oss_dir, aux)
        rs = rows()
        T = max(len(r) for r in rs) + 2
        f = t.rows_features([rs[0], None, rs[1], rs[2]], T)
        t.close()
        assert f["aux"].shape == (4, T, 3, 64) and f["final"].shape == (4, T, 64)
        assert script.hits == 3 and not f["aux"][1].any() and not f["final"][1].any()  # None: not sent, zero
        for b, r in zip((0, 2, 3), rs):
            ref = compute_features(local, r[None], layer_ids=aux)
            n = len(r)
            torch.testing.assert_close(f["aux"][b, :n], ref["aux"][0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(f["final"][b, :n], ref["final"][0], rtol=1e-5, atol=1e-5)
            assert not f["aux"][b, n:].any()  # right padding stays zero


def test_served_sglang_extract_equals_offline_and_the_shifted_ids_do_not(tmp_path, gpt_oss_dir, sglang_server):
    served_cfg = config(tmp_path / "served", gpt_oss_dir)
    url, script = sglang_server(gpt_oss_dir, features_argv(served_cfg, gpt_oss_dir))
    served_cfg.extract.server_urls = [url]
    Campaign.create_or_open(served_cfg)
    write_build(tmp_path / "served" / "build", LENGTHS)
    offline_cfg = config(tmp_path / "offline", gpt_oss_dir, mode="offline")
    Campaign.create_or_open(offline_cfg)
    write_build(tmp_path / "offline" / "build", LENGTHS)
    s = run_extract(served_cfg, Campaign(served_cfg.campaign_dir()))
    run_extract(offline_cfg, Campaign(offline_cfg.campaign_dir()))
    assert s["splits"]["train"]["tokens_written"] == sum(LENGTHS["train"])
    assert script.hits == sum(len(v) for v in LENGTHS.values())  # one request per sample
    index = json.loads((tmp_path / "served" / "features" / "train" / "index.json").read_text())
    assert index["plan"]["source"] == "served:sglang" and index["aux_layer_ids"] == AUX
    for split in ("train", "val"):
        c = compare_splits(tmp_path / "served" / "features" / split, tmp_path / "offline" / "features" / split)
        assert c["samples"] == len(LENGTHS[split]) and c["tokens"] == sum(LENGTHS[split])
        assert max(c["max_rel"].values()) < TOLERANCE and max(c["mean_rel"].values()) < TOLERANCE / 8, c
    # the control: a server asked for the specops ids themselves (no -1) captures one layer later
    argv = features_argv(served_cfg, gpt_oss_dir)
    i = argv.index("--return-aux-hidden-state-layer-ids")
    argv[i + 1:i + 4] = [str(k) for k in AUX]  # 2 4 5 (7, the final state, as before)
    url, _ = sglang_server(gpt_oss_dir, argv)
    t = target(url, gpt_oss_dir)
    r = rows(1)[0]
    f = t.rows_features([r], len(r))
    t.close()
    ref = compute_features(load_target(gpt_oss_dir, torch.float32, "cpu"), r[None], layer_ids=AUX)
    rel = ((f["aux"][0] - ref["aux"][0]).norm(dim=-1) / ref["aux"][0].norm(dim=-1)).amax(0)  # per aux id
    assert rel.min() > 0.1, rel
    torch.testing.assert_close(f["final"][0], ref["final"][0], rtol=1e-5, atol=1e-5)  # the same layer in both


@pytest.mark.parametrize("fault, message", [
    ("plain", r"refused a 41-token request \(HTTP 400: The server is not configured to return hidden states\. .*"
              r"--enable-return-aux-hidden-states --speculative-algorithm DFLASH"),
    ("no_states", r"answered /generate without meta_info\.hidden_states; is it started with "
                  r"--enable-return-aux-hidden-states"),
    ("other_id", r"the server saw other token ids than sent \(the last 1: "),
    ("dropped", r"the server saw other token ids than sent \(40 vs 41 tokens\)"),
    ("chunked", r"hidden_states \(13, 256\), expected \(41, 256\) .*a chunked prefill keeps only its last chunk"),
])
def test_a_bad_answer_fails_with_its_reason(tmp_path, gpt_oss_dir, sglang_server, fault, message):
    cfg = config(tmp_path / "c", gpt_oss_dir)
    url, script = sglang_server(gpt_oss_dir, features_argv(cfg, gpt_oss_dir), fault)
    t = target(url, gpt_oss_dir)
    with pytest.raises(SpecopsError, match=message):
        t.rows_features([rows(1)[0]], 41)
    t.close()
    assert script.hits == 1  # a refusal or a wrong answer is not asked again


def test_sglang_served_extract_config_is_checked_up_front(tmp_path, gpt_oss_dir):
    for name, extract, message in [
        ("dir", {"served_dir": str(tmp_path / "d"), "server_urls": ["http://127.0.0.1:9/v1"]},
         "extract.served_dir: SGLang returns the states in each /generate response"),
        ("id0", {"aux_layer_ids": [0, 2, 5], "server_urls": ["http://127.0.0.1:9/v1"]},
         r"extract\.aux_layer_ids: SGLang cannot capture aux layer id 0 \(the embeddings\) of \[0, 2, 5\]"),
    ]:
        cfg = config(tmp_path / name, gpt_oss_dir, **extract)
        camp = Campaign.create_or_open(cfg)
        with pytest.raises(ConfigError, match=message):
            run_extract(cfg, camp)
    with pytest.raises(SpecopsError, match="cannot capture aux layer id 0"):
        target("http://127.0.0.1:9/v1", gpt_oss_dir, [0, 2, 5])


def test_a_family_without_the_final_state_is_refused_up_front(tmp_path):
    """SGLang 0.5.23's Llama and DeepSeek-V3/Kimi-K2.5 models capture inside the layer loop only: the
    run, `specops serve --features` and the target itself refuse them before any server starts. The
    check reads config.json alone (the DeepSeek-V3 directory has no weights)."""
    llama = make_llama(tmp_path / "llama")
    ds = tmp_path / "ds"
    deepseek_config().save_pretrained(ds)
    assert not list(ds.glob("*.safetensors"))
    for model_dir, model_type in ((llama, "llama"), (ds, "deepseek_v3")):
        message = NO_FINAL_STATE.format(model_type)
        cfg = config(tmp_path / f"c-{model_type}", model_dir, urls=["http://127.0.0.1:9/v1"])
        camp = Campaign.create_or_open(cfg)
        with pytest.raises(ConfigError, match=r'serve\.engine = "sglang": ' + message):
            run_extract(cfg, camp)
        with pytest.raises(ConfigError, match=message):
            features_argv(cfg, model_dir)
        with pytest.raises(ConfigError, match=message):
            target("http://127.0.0.1:9/v1", model_dir)
    # the text config decides: a wrapper around a Llama is refused, one around a GPT-OSS is not
    wrapped = {"model_type": "llava", "text_config": json.loads((llama / "config.json").read_text())}
    assert sglang_family_problem(wrapped)
    wrapped["text_config"]["model_type"] = "gpt_oss"
    assert sglang_family_problem(wrapped) is None
    assert sglang_features_argv(AUX, L, wrapped) == FLAGS
