"""Builders for the training tests (imported as a plain module: pytest puts tests/ on sys.path): a
tiny random Llama target with a sharp next-token distribution, its own greedy continuations, and
feature shards + build/ written in the DESIGN formats from its `output_hidden_states` (no extract,
no hub); a campaign seeded with them; a packed two-row batch. The `tiny` fixture is in conftest.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from specops.campaign import Campaign
from specops.config import load_config
from specops.drafter.batch import Batch
from specops.target import default_aux_layer_ids

VOCAB, DRAFT_VOCAB = 128, 80
BASE = {"ttt_steps": 3, "lr": 3e-3, "warmup_steps": 5, "log_every": 1, "max_grad_norm": 1.0, "seed": 7}


def make_target(path: Path, *, sharp: float = 30.0, tied: bool = False) -> Path:
    """A 6-layer random Llama with a sharpened lm_head (peaked next-token distributions)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=tied, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharp)
        model.model.norm.weight.uniform_(0.5, 1.5)  # a norm that matters for the teacher
    model.save_pretrained(path)
    return path


def load_target(path: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def target_states(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aux [n, 3, H] (the default input-to-layer ids = HF hidden_states indices), final [n, H] pre-norm, logits."""
    cap = {}
    hook = model.model.norm.register_forward_hook(lambda mod, inp, out: cap.update(pre=inp[0].clone()))
    out = model(ids[None], output_hidden_states=True)
    hook.remove()
    L = model.config.num_hidden_layers
    aux = torch.stack([out.hidden_states[i][0] for i in default_aux_layer_ids(L)], dim=1)
    return aux, cap["pre"][0], out.logits[0]


@torch.no_grad()
def greedy_sequences(model, n: int, *, seed: int, prompt_len=(3, 7), gen_len=(18, 30)) -> list:
    """(input_ids, loss_mask): a random prompt, then the target's own greedy continuation (mask 1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(*prompt_len, (1,), generator=g))
        m = int(torch.randint(*gen_len, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (p,), generator=g)
        for _ in range(m):
            nxt = model(ids[None]).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt[None]])
        out.append((ids, torch.cat([torch.zeros(p, dtype=torch.uint8), torch.ones(m, dtype=torch.uint8)])))
    return out


def write_features(model, seqs, split_dir: Path, *, dtype: str = "bfloat16", per_shard: int = 5) -> None:
    """features/<split>/ exactly as DESIGN fixes it (shards + index.json, written last)."""
    split_dir.mkdir(parents=True, exist_ok=True)
    shards = []
    for k, a in enumerate(range(0, len(seqs), per_shard)):
        part = seqs[a:a + per_shard]
        auxs, finals = zip(*[target_states(model, ids)[:2] for ids, _ in part])
        aux, final = torch.cat(auxs), torch.cat(finals)
        t = {
            "input_ids": torch.cat([ids for ids, _ in part]).to(torch.int32),
            "loss_mask": torch.cat([m for _, m in part]),
            "offsets": torch.tensor([0] + [len(ids) for ids, _ in part]).cumsum(0),
            "sample_index": torch.arange(a, a + len(part)),
        }
        if dtype == "float8_e4m3fn":
            t["aux_scale"] = aux.abs().amax(-1).clamp_min(1e-12) / 448
            t["final_scale"] = final.abs().amax(-1).clamp_min(1e-12) / 448
            t["aux"] = (aux / t["aux_scale"][..., None]).to(torch.float8_e4m3fn)
            t["final"] = (final / t["final_scale"][..., None]).to(torch.float8_e4m3fn)
        else:
            t["aux"], t["final"] = aux.to(torch.bfloat16), final.to(torch.bfloat16)
        name = f"shard-0-{k}.safetensors"
        save_file(t, str(split_dir / name))
        shards.append({"name": name, "n_samples": len(part), "n_tokens": int(t["input_ids"].numel()),
                       "sha256": hashlib.sha256((split_dir / name).read_bytes()).hexdigest()})
    L = model.config.num_hidden_layers
    (split_dir / "index.json").write_text(json.dumps({
        "format": "specops-features-v1", "aux_layer_ids": default_aux_layer_ids(L),
        "aux_layer_convention": "input-to-layer (= HF hidden_states index)", "final": "pre-norm",
        "hidden_size": model.config.hidden_size, "num_hidden_layers": L, "dtype": dtype,
        "split": split_dir.name, "shards": shards, "complete": True}))


def write_build(seqs_by_split: dict, build: Path) -> None:
    build.mkdir(parents=True, exist_ok=True)
    counts = torch.zeros(VOCAB, dtype=torch.long)
    for ids, m in seqs_by_split["train"]:
        counts += torch.bincount(ids[m.bool()], minlength=VOCAB)
    ids = torch.sort(torch.argsort(counts, descending=True, stable=True)[:DRAFT_VOCAB]).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    save_file({"d2t": ids - torch.arange(DRAFT_VOCAB), "t2d": t2d}, str(build / "vocab.safetensors"))
    for split, seqs in seqs_by_split.items():
        save_file({"input_ids": torch.cat([i for i, _ in seqs]).to(torch.int32),
                   "loss_mask": torch.cat([m for _, m in seqs]),
                   "offsets": torch.tensor([0] + [len(i) for i, _ in seqs]).cumsum(0)},
                  str(build / f"{split}.safetensors"))


def make_campaign(root: Path, target: Path, train: dict, *, name: str = "c") -> Path:
    """campaign.toml + directory; returns the campaign dir."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "prompts.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    camp = root / name
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in train.items())
    cfg = root / f"{name}.toml"
    cfg.write_text(f'[campaign]\nname = "{name}"\ndir = "{camp}"\n[target]\nmodel = "{target}"\n'
                   f'[train]\n{lines}\n[[datasets]]\nname = "ds"\npath = "{root / "prompts.jsonl"}"\n')
    Campaign.create_or_open(load_config(cfg))
    return camp


def seed_campaign(tiny, root: Path, train_cfg: dict, name: str = "c", parts=("features", "build")) -> Campaign:
    camp = make_campaign(root, tiny["target"], train_cfg, name=name)
    for p in parts:
        shutil.copytree(tiny["data"] / p, camp / p)
    return Campaign(camp)


def metrics(camp: Path, split: str = "train") -> list[dict]:
    rows = [json.loads(line) for line in (Path(camp) / "drafter" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == split]


def _packed_batch(H=32, seed=0):
    """Two rows: [doc 7 | doc 5] and [doc 9 | 3 padding]; random aux/final/loss_mask."""
    g = torch.Generator().manual_seed(seed)
    rows = [[7, 5], [9]]
    T = 12
    B = len(rows)
    ids = torch.randint(0, 96, (B, T), generator=g)
    lm = torch.rand(B, T, generator=g) > 0.3
    doc = torch.full((B, T), -1)
    pos = torch.zeros(B, T, dtype=torch.long)
    end = torch.zeros(B, T, dtype=torch.long)
    for r, lens in enumerate(rows):
        a = 0
        for d, n in enumerate(lens):
            doc[r, a:a + n], pos[r, a:a + n], end[r, a:a + n] = d, torch.arange(n), a + n
            a += n
    aux = torch.randn(B, T, 3, H, generator=g)
    final = torch.randn(B, T, H, generator=g)
    return Batch(ids, lm, doc, pos, end, aux, final, int((doc >= 0).sum())), rows
