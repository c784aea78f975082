"""Builders shared by several test files (imported as a plain module: pytest puts tests/ on sys.path):
tiny Llama targets with a build/ written from random token ids (extract), and tiny targets with a
drafter for the evaluator's runners. Models come from configs with random weights, never a hub."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specops.campaign import Campaign
from specops.config import config_from_dict
from specops.drafter.model import DrafterConfig, Eagle3Drafter

from tiny_targets import LAYERS as L  # 8: default aux ids [2, 4, 5], all distinct
from tiny_targets import VOCAB, randomize_norms


AUX = [2, 4, 5]


def make_llama(path: Path, hidden: int = 64, layers: int = L) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    randomize_norms(model)
    model.save_pretrained(path)
    return path


def write_build(build: Path, lengths: dict[str, list[int]], seed: int = 0, ids: tuple[int, int] = (0, VOCAB)) -> None:
    """build/<split>.safetensors + <split>.ids.jsonl in the fixed format (DESIGN, File formats);
    token ids drawn uniformly from range(*ids)."""
    build.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for split, lens in lengths.items():
        n = sum(lens)
        offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
        save_file(
            {
                "input_ids": torch.randint(*ids, (n,), generator=g, dtype=torch.int32),
                "loss_mask": (torch.rand(n, generator=g) > 0.3).to(torch.uint8),
                "offsets": offsets,
            },
            str(build / f"{split}.safetensors"),
        )
        with open(build / f"{split}.ids.jsonl", "w") as f:
            for i, k in enumerate(lens):
                f.write(json.dumps({"id": f"d/{split}{i}", "dataset": "d", "n_tokens": k, "n_trainable": k}) + "\n")


def random_lengths(n: int, seed: int, lo: int = 1, hi: int = 120) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


LENGTHS = {
    # 300 > token_budget (runs alone), 400 > shard_tokens (a shard of its own)
    "train": random_lengths(30, 1) + [300] + random_lengths(10, 2) + [400] + random_lengths(5, 3),
    "val": random_lengths(7, 4),
}


def make_campaign(root: Path, model_dir: Path, lengths=LENGTHS, **extract) -> tuple:
    root.mkdir(parents=True, exist_ok=True)
    prompts = root.parent / f"{root.name}-prompts.jsonl"
    prompts.write_text('{"id": "q0", "prompt": "hi"}\n')
    extract = {"shard_tokens": 600, "token_budget": 256, **extract}
    cfg = config_from_dict({
        "campaign": {"name": root.name, "dir": str(root)},
        "target": {"model": str(model_dir)},
        "datasets": [{"name": "d", "path": str(prompts)}],
        "extract": extract,
    })  # fmt: skip
    camp = Campaign.create_or_open(cfg)
    write_build(camp.root / "build", lengths)
    return cfg, camp


def build_split(camp: Campaign, split: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(camp.root / "build" / f"{split}.safetensors"))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digest(path: Path, unit: int = 64 << 20) -> str:
    """A shard's recorded digest, computed independently of extract.shard_digest: sha256 over the
    concatenated sha256 digests of the file's consecutive `unit`-byte pieces."""
    data = path.read_bytes()
    pieces = [data[i:i + unit] for i in range(0, len(data), unit)] or [b""]
    return hashlib.sha256(b"".join(hashlib.sha256(x).digest() for x in pieces)).hexdigest()


def hf_reference(model, ids: torch.Tensor, decoder) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(HF hidden_states [L+1, T, H], HF hidden_states[-1], pre-norm final from a norm-less forward).

    The pre-norm reference uses no hooks: the decoder's norm is swapped for Identity, so its
    last_hidden_state is the last layer's output.
    """
    with torch.no_grad():
        hs = model(ids[None].long(), output_hidden_states=True).hidden_states
        norm = decoder.norm
        decoder.norm = torch.nn.Identity()
        try:
            pre = decoder(input_ids=ids[None].long()).last_hidden_state[0]
        finally:
            decoder.norm = norm
    return torch.stack([h[0] for h in hs]), hs[-1][0], pre


def check_against_hf(stored, build, model, decoder, aux_ids, every: int = 1) -> None:
    offs = build["offsets"].tolist()
    assert sorted(stored) == list(range(len(offs) - 1))
    lengths = [offs[i + 1] - offs[i] for i in range(len(offs) - 1)]
    longest = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:2]  # the budget/shard edge cases
    for i, rec in stored.items():
        assert torch.equal(rec["input_ids"], build["input_ids"][offs[i] : offs[i + 1]])
        assert torch.equal(rec["loss_mask"], build["loss_mask"][offs[i] : offs[i + 1]])
        if i % every and i not in longest:
            continue
        ids = build["input_ids"][offs[i] : offs[i + 1]]
        hs, post, pre = hf_reference(model, ids, decoder)
        assert rec["aux"].dtype == torch.bfloat16 and rec["aux"].shape == (len(ids), 3, hs.shape[-1])
        for j, layer in enumerate(aux_ids):
            torch.testing.assert_close(rec["aux"][:, j], hs[layer].to(torch.bfloat16))
        torch.testing.assert_close(rec["final"], pre.to(torch.bfloat16))
        # HF's hidden_states[-1] is post-norm: the norm of our final, and not our final.
        with torch.no_grad():
            torch.testing.assert_close(decoder.norm(rec["final"].float()), post, rtol=2e-2, atol=2e-2)
        assert not torch.allclose(rec["final"].float(), post, rtol=0.1, atol=0.1)


def shard_files(d: Path) -> dict[str, str]:
    return {q.name: sha256(q) for q in sorted(d.glob("shard-*.safetensors"))}


HIDDEN = 96


def tiny_config(arch: str, vocab: int = 96, layers: int = 8):
    from transformers import GemmaConfig, LlamaConfig, MistralConfig, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                  tie_word_embeddings=False)  # 3 query heads per kv head, as SmolLM2
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":  # q_norm / k_norm, explicit head_dim
        return Qwen3Config(head_dim=24, **common)
    if arch == "mistral-sliding":  # a window shorter than the sequences below
        return MistralConfig(sliding_window=12, **common)
    if arch == "gemma":  # not a supported model type
        return GemmaConfig(head_dim=16, **common)
    raise ValueError(arch)


def make_target(path: Path, arch: str = "llama", *, vocab: int = 96, layers: int = 8, sharp: float = 10.0,
                seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, vocab, layers), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharp)  # peaked next-token distributions: no argmax near-ties
        for name, p in model.named_parameters():  # norm weights != 1: a skipped norm would show
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    model.save_pretrained(path)
    return path


def load(path: Path, device: str = "cpu"):
    from specops.target.inprocess import load_target

    return load_target(path, "float32", device)


def debug_drafter(vocab: int, *, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.debug(target_vocab_size=vocab, draft_vocab_size=vocab // 2, aux_layer_ids=AUX,
                              target_hidden_size=HIDDEN, target_num_hidden_layers=8)
    d = Eagle3Drafter(cfg).eval()
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[: vocab // 2].sort().values
    d.set_vocab(ids - torch.arange(vocab // 2))
    return d


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """The target's greedy continuation by full recompute (no cache)."""
    ids = list(prompt)
    dev = next(model.parameters()).device
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids], device=dev)).logits[0, -1].argmax()))
    return ids[len(prompt):]


def rand_ids(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def chat_target_and_drafter(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny target with SmolLM2's vocab and chat template, and a random drafter export for it."""
    from transformers import AutoTokenizer

    from specops.drafter.families.eagle3.export import export_vllm
    from specops.models import resolve_model_dir

    model = make_target(tmp_path / "chat", vocab=49152, seed=4)
    AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2"))).save_pretrained(model)
    torch.manual_seed(0)
    hf = json.loads((model / "config.json").read_text())
    d = Eagle3Drafter(DrafterConfig.from_target(hf, 32000))
    export = export_vllm(d.state_dict(), d.config.to_dict(), tmp_path / "vllm", target_config=hf,
                         aux_layer_ids=d.config.aux_layer_ids, target_name_or_path=str(model))
    return model, export



def chat_llama(path: Path, *, layers: int = 8, hidden: int = 64, seed: int = 0) -> Path:
    """A random-weight Llama with the bundled SmolLM2 tokenizer (and its chat template) at `path`:
    a target the whole chain runs on in seconds (local engine, CPU, fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from specops.models import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2")))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def pipeline_config(tmp_path: Path, target: Path, **extra):
    """A campaign config for `specops run` on a `chat_llama` target: 10 ShareGPT first turns, short
    answers, 3 training steps. `extra` updates sections: {"eval": {...}}."""
    data = {
        "campaign": {"name": "pipe", "dir": str(tmp_path / "camp")},
        "target": {"model": str(target), "dtype": "float32"},
        "engine": {"kind": "local", "batch_size": 4, "max_model_len": 512},
        "generate": {"max_tokens": 24, "reasoning": "off", "expect_truncation": True, "canary_samples": 1,
                     "turns": "first"},
        "build": {"draft_vocab_size": 256, "max_length": 256},
        "train": {"ttt_steps": 2, "batch_tokens": 512, "warmup_steps": 1, "total_steps": 3, "log_every": 1,
                  "eval_every": 3, "checkpoint_every": 3},
        "datasets": [{"name": "sg", "source": "sharegpt", "limit": 10}],
    }
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(data.get(k), dict):
            data[k] = {**data[k], **v}
        else:
            data[k] = v
    return config_from_dict(data)
