"""Turn a speculators 0.9.0 training checkpoint into a specops export dir (vLLM layout) for `specops eval`.

    python bench/quality/speculators_to_eval.py CKPT OUT_DIR [--target DIR] [--campaign DIR] [--verify]

CKPT: a checkpoint dir written by `speculators train` (`<save-path>/<epoch>/`: config.json +
model.safetensors), or the save path itself (then `checkpoint_best`, else the highest epoch).

Why not point `eval.drafter` at the checkpoint directly: specops reads speculators dirs, but this
checkpoint's `transformer_layer_config` is what transformers 5 writes (`PretrainedConfig.to_diff_dict`):
RoPE sits in `rope_parameters`, with no top-level `rope_theta`, and specops' export reader
(drafter/formats.py `drafter_config_from_export`) would fall back to rope_theta 10000 (a
different RoPE than the one trained, silently). Here the config is rebuilt through the
transformers config class (every default filled in, rope_parameters -> rope_theta/rope_scaling),
and specops' own `export_vllm` writes and re-checks the result.

Pure mapping, checked conventions:
* weights: `layers.0.*` -> `midlayer.*`; fc, norm, lm_head, d2t, t2d as they are; embed_tokens
  dropped when it is the target's (hidden sizes equal: the engines share the target's). Any other
  tensor (input_norm from --norm-before-fc, fc_norm.*) is refused: neither specops' drafter nor
  vLLM's llama_eagle3 has it.
* norm_before_fc, fc_norm, norm_output must be false (train with --no-norm-before-fc
  --no-norm-output): specops and vLLM's llama_eagle3 feed the pre-norm hidden back and apply no
  input norm; norm_before_residual is copied as trained (written explicitly).
* aux layer ids: `eagle_aux_hidden_state_layer_ids` is in vLLM's input-to-layer convention, as are
  ours (features/index.json `aux_layer_ids`, HF hidden_states index): copied with no offset; with
  --campaign they must equal the features' ids.
* d2t/t2d: target = i + d2t[i] in both; with --campaign they must equal build/vocab.safetensors.
* attention: layer_types must be full_attention (train with --full-attention-indices 0); a
  sliding-window layer is refused unless --allow-sliding-window (then it only matches our full
  attention while contexts stay within the window).
--verify (needs speculators importable): loads the checkpoint with speculators' own
Eagle3DraftModel and compares its per-TTT-step logits (steps 0 and 1, teacher-forced ids, its
own TTT attention) with specops' Eagle3Drafter loaded from the written export, same inputs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

from specops.drafter.export import check_export  # noqa: E402
from specops.drafter.families.eagle3.export import export_vllm  # noqa: E402
from specops.drafter.model import rope_from_hf  # noqa: E402

ALLOWED_EXTRA = ("embed_tokens.weight",)
# fp32 on both sides from the same bf16 weights: only summation order differs. A wrong RoPE theta
# or norm_before_residual moves tiny random drafters by > 1e-4 (checked), trained ones by far more.
VERIFY_TOL = 2e-5


def find_checkpoint(path: Path) -> Path:
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    best = path / "checkpoint_best"
    if (best / "model.safetensors").is_file():
        return best.resolve()
    epochs = sorted((int(p.name), p) for p in path.iterdir() if p.is_dir() and p.name.isdigit()
                    and (p / "model.safetensors").is_file()) if path.is_dir() else []
    if not epochs:
        raise SystemExit(f"{path}: no speculators checkpoint (config.json + model.safetensors)")
    return epochs[-1][1]


def layer_config(tlc: dict[str, Any]) -> dict[str, Any]:
    """transformer_layer_config as written (a diff) -> every field, via the transformers class."""
    from transformers import AutoConfig

    tlc = dict(tlc)
    model_type = tlc.pop("model_type", "llama")
    if model_type != "llama":
        raise SystemExit(f"transformer_layer_config.model_type {model_type!r}: specops' drafter is a Llama layer")
    tlc.pop("transformers_version", None)
    full = AutoConfig.for_model(model_type, **tlc)
    return full.to_dict()


def convert(ckpt: Path, out: Path, *, target: Path | None, campaign: Path | None, allow_sliding: bool) -> dict[str, Any]:
    from safetensors.torch import load_file

    cfg = json.loads((ckpt / "config.json").read_text())
    if cfg.get("speculators_model_type") != "eagle3":
        raise SystemExit(f"{ckpt}: speculators_model_type {cfg.get('speculators_model_type')!r}, expected eagle3")
    bad = [k for k in ("norm_before_fc", "fc_norm", "norm_output") if cfg.get(k)]
    if bad:
        raise SystemExit(f"{ckpt}: trained with {', '.join(bad)} = true; specops' drafter and vLLM's llama_eagle3 have "
                         "no such norms (train with --no-norm-before-fc --no-norm-output)")
    if "norm_before_residual" not in cfg:
        raise SystemExit(f"{ckpt}: config has no norm_before_residual")
    lc = layer_config(cfg["transformer_layer_config"])
    if int(lc["num_hidden_layers"]) != 1:
        raise SystemExit(f"{ckpt}: {lc['num_hidden_layers']} draft layers; specops' drafter has one")
    kinds = lc.get("layer_types") or ["full_attention"]
    if any(k != "full_attention" for k in kinds):
        msg = (f"{ckpt}: layer_types {kinds} (sliding_window {lc.get('sliding_window')}); specops evaluates full "
               "attention (train with --full-attention-indices 0)")
        if not allow_sliding:
            raise SystemExit(msg + "; --allow-sliding-window to convert anyway")
        print("warning: " + msg, file=sys.stderr)
    theta, scaling = rope_from_hf(lc)

    # target
    vname = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    tdir = target or (Path(vname) if vname else None)
    if tdir is None or not (tdir / "config.json").is_file():
        raise SystemExit(f"target config not found (verifier {vname!r}); pass --target DIR")
    target_config = json.loads((tdir / "config.json").read_text())
    tcfg = target_config.get("text_config") or target_config
    L = int(tcfg["num_hidden_layers"])

    aux = cfg.get("eagle_aux_hidden_state_layer_ids") or [2, L // 2, L - 3]
    aux = [int(i) for i in aux]

    sd_raw = load_file(str(ckpt / "model.safetensors"))
    sd: dict[str, torch.Tensor] = {}
    unknown = []
    for k, v in sd_raw.items():
        if k.startswith("layers.0."):
            sd["midlayer." + k.removeprefix("layers.0.")] = v
        elif k in ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", *ALLOWED_EXTRA):
            sd[k] = v
        else:
            unknown.append(k)
    if unknown:
        raise SystemExit(f"{ckpt}: tensors with no place in specops' drafter: {unknown}")
    if "d2t" not in sd or "t2d" not in sd:
        raise SystemExit(f"{ckpt}: no d2t/t2d (a full-vocab drafter is not what this comparison trains)")
    sd["d2t"], sd["t2d"] = sd["d2t"].long(), sd["t2d"].bool()

    checks: dict[str, Any] = {}
    if campaign is not None:
        from safetensors.torch import load_file as lf

        v = lf(str(campaign / "build" / "vocab.safetensors"))
        checks["d2t_equals_build"] = bool(torch.equal(v["d2t"].long(), sd["d2t"]))
        checks["t2d_equals_build"] = bool(torch.equal(v["t2d"].bool(), sd["t2d"]))
        fi = json.loads((campaign / "features" / "train" / "index.json").read_text())
        checks["aux_ids_equal_features"] = [int(i) for i in fi["aux_layer_ids"]] == aux
        if not all(checks.values()):
            raise SystemExit(f"{ckpt}: does not match campaign {campaign}: {checks}")

    dcfg = {
        "hidden_size": int(lc["hidden_size"]),
        "intermediate_size": int(lc["intermediate_size"]),
        "num_attention_heads": int(lc["num_attention_heads"]),
        "num_key_value_heads": int(lc.get("num_key_value_heads") or lc["num_attention_heads"]),
        "head_dim": int(lc.get("head_dim") or int(lc["hidden_size"]) // int(lc["num_attention_heads"])),
        "hidden_act": lc.get("hidden_act", "silu"),
        "rms_norm_eps": float(lc["rms_norm_eps"]),
        "max_position_embeddings": int(lc["max_position_embeddings"]),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "draft_vocab_size": int(cfg["draft_vocab_size"]),
        "norm_before_residual": bool(cfg["norm_before_residual"]),
        "aux_layer_ids": aux,
    }
    if lc.get("attention_bias") or lc.get("mlp_bias"):
        raise SystemExit(f"{ckpt}: attention/mlp bias; specops' drafter has none")
    path = export_vllm(sd, dcfg, out, target_config=target_config, aux_layer_ids=aux,
                       target_name_or_path=str(tdir), dtype=torch.bfloat16)
    manifest_path = path / "manifest.json"
    m = json.loads(manifest_path.read_text())
    m["converted_from"] = {"speculators_checkpoint": str(ckpt), "speculators_version": cfg.get("speculators_version"),
                           "checks": checks, "layer_types": kinds, "rope_parameters": lc.get("rope_parameters")}
    manifest_path.write_text(json.dumps(m, indent=2) + "\n")
    return {"export": str(path), "drafter_config": dcfg, "checks": checks, "target": str(tdir)}


# ------------------------------------------------------------------ --verify

@torch.no_grad()
def verify(ckpt: Path, export_dir: Path, target: Path, *, T: int = 64, seed: int = 0) -> dict[str, float]:
    """Max |logit difference| per TTT step between speculators' model (its checkpoint) and ours (the export)."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from specops.drafter.formats import load_exported
    from specops.drafter.formats import drafter_config_from_export  # read-only use
    from specops.drafter.model import Eagle3Drafter

    config = Eagle3SpeculatorConfig.from_pretrained(str(ckpt))
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001 (CPU has no flex backward; same math)
    theirs = Eagle3DraftModel.from_pretrained(str(ckpt), config=config, verifier=str(target)).float().eval()

    sd, ecfg = load_exported(export_dir)
    L = json.loads((target / "config.json").read_text())
    L = int((L.get("text_config") or L)["num_hidden_layers"])
    ours = Eagle3Drafter(drafter_config_from_export(ecfg, L))
    sd = dict(sd)
    sd.setdefault("embed_tokens.weight", theirs.embed_tokens.weight.detach().float())
    ours.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    ours.float().eval()

    g = torch.Generator().manual_seed(seed)
    H = ours.config.target_hidden_size
    V = ours.config.target_vocab_size
    aux = torch.randn(1, T, 3 * H, generator=g)
    ids = torch.randint(0, V, (1, T), generator=g)
    pos = torch.arange(T).unsqueeze(0) + 1  # speculators' shifted positions; RoPE is relative anyway
    doc = torch.zeros(1, T, dtype=torch.long)

    captured: list[torch.Tensor] = []
    h = theirs.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach().float()))
    theirs(hidden_states=aux, input_ids=ids, document_ids=doc, position_ids=pos, ttt_steps=2)
    h.remove()

    # ours, TTT the same way: step 1 gets teacher-forced ids shifted by one, our step-0 output as
    # hidden, position +1, keys = step-0 keys (causal) + its own step-1 key (diagonal).
    o0 = ours(ids, ours.fuse(aux), pos)
    ids1 = torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=1)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = torch.cat([causal, torch.eye(T, dtype=torch.bool)], dim=1)[None, None]
    o1 = ours(ids1, o0.hidden, pos + 1, attn_mask=mask, past_kv=[o0.kv])
    return {"step0_max_abs_diff": float((captured[0] - o0.logits).abs().max()),
            "step1_max_abs_diff": float((captured[1] - o1.logits).abs().max()),
            "logit_scale": float(o0.logits.abs().max()),
            "step0_argmax_equal": bool(torch.equal(captured[0].argmax(-1), o0.logits.argmax(-1))),
            "step1_argmax_equal": bool(torch.equal(captured[1].argmax(-1), o1.logits.argmax(-1)))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, help="<save-path>/<epoch> or the save path")
    ap.add_argument("out", type=Path, help="export dir to write (eval.drafter = this)")
    ap.add_argument("--target", type=Path, help="target model dir (default: the checkpoint's verifier path)")
    ap.add_argument("--campaign", type=Path, help="campaign dir: check d2t/t2d and aux ids against it")
    ap.add_argument("--allow-sliding-window", action="store_true")
    ap.add_argument("--verify", action="store_true", help="compare logits with speculators' own model (needs it)")
    a = ap.parse_args(argv)
    ckpt = find_checkpoint(a.checkpoint.resolve())
    res = convert(ckpt, a.out.resolve(), target=a.target, campaign=a.campaign, allow_sliding=a.allow_sliding_window)
    print(f"{ckpt} -> {res['export']}")
    print(json.dumps({k: res["drafter_config"][k] for k in ("aux_layer_ids", "norm_before_residual", "rope_theta",
                                                             "rope_scaling", "draft_vocab_size")}))
    if res["checks"]:
        print(f"checks against the campaign: {res['checks']}")
    report = check_export(res["export"], target_config=res["target"])
    print(report.render())
    if a.verify:
        v = verify(ckpt, Path(res["export"]), Path(res["target"]))
        print(f"verify (speculators model vs specops drafter, fp32): {json.dumps(v)}")
        if max(v["step0_max_abs_diff"], v["step1_max_abs_diff"]) > VERIFY_TOL * max(1.0, v["logit_scale"]):
            print("VERIFY FAILED", file=sys.stderr)
            return 1
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
