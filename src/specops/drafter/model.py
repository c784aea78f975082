"""The EAGLE-3 drafter: architecture only (its family, with objective, drafting and export: families/eagle3/).

One Llama decoder layer whose attention reads [embed(token) normed, fused hidden normed] (2H),
a fusion `fc` (3·H_target -> H) of three target hidden states, a final `norm` and an `lm_head`
over a reduced draft vocabulary. Parameter names are the vLLM export names (DESIGN.md, "File
formats"), so a state_dict is written as-is.

Layer order matched against vLLM `vllm/model_executor/models/llama_eagle3.py`:
`LlamaDecoderLayer.forward` (the `layer_idx == 0` branch with `_norm_after_residual` /
`_norm_before_residual`), `LlamaModel.forward` (which ends with `self.norm(hidden_states, residual)`
returning `(normed, prenorm)`), `Eagle3LlamaForCausalLM.combine_hidden_states` (fc on the
concatenated aux states) and `compute_logits` (lm_head on the normed output, draft ids mapped to
target ids with `d2t`). vLLM's fused `RMSNorm(x, residual)` returns `(norm(x + residual), x + residual)`;
unrolled, one drafter step is:

    e  = input_layernorm(embed_tokens(token))                 [.., H]
    g  = fused hidden (step 0: fc(cat(aux_0, aux_1, aux_2)); later: the previous step's `h`)
    residual = g                     (norm_before_residual: residual = hidden_norm(g))
    x  = cat(e, hidden_norm(g))                                [.., 2H]
    h  = residual + o_proj(attn(q_proj(x), k_proj(x), v_proj(x)))   (RoPE on q, k)
    h  = h + mlp(post_attention_layernorm(h))                  -> returned, pre-norm
    logits = lm_head(norm(h))                                  [.., draft_vocab]

vLLM feeds the pre-norm `h` (its `hidden_prenorm`) to the next draft step, and so does training.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..target import default_aux_layer_ids, text_config

# Masked attention on CUDA: the memory-efficient kernel (flash takes no mask; math is the last
# resort). Left to itself, torch picks cuDNN's, which builds a plan for every new (batch, length)
# shape -- ~20 ms of host time per call on an H200 -- and training batches change shape at almost
# every step. train.sdpa_cudnn = true keeps torch's choice (bench/train_gpu.py --vary-len measures both).
_MASKED_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


@dataclass
class KernelOptions:
    """How training computes (never what): the train section's kernel keys, set for the process by
    the trainer (`set_kernel_options`) before its first step. Every form computes the same loss and
    gradients up to rounding; tests pin each pair.

    ttt_attention: "block" (step 0's keys once + a per-slot dot product for the diagonal blocks,
        `ttt_attention`) or "dense" ([T, (k+1)T] masks through SDPA: the reference form).
    fused_loss: lm_head + soft CE as one autograd node per TTT step (`losses.linear_soft_ce`);
        "auto" = on CUDA.
    compile_loss / compile_layer: torch.compile the soft CE kernels / the drafter layer's
        elementwise regions; "auto" = on CUDA. compile_layer defaults to off: its dynamic-shape
        graphs recompile as real batches change shape.
    sdpa_cudnn: let SDPA pick cuDNN for masked attention (it plans per new shape; off forces the
        memory-efficient kernel).
    """

    ttt_attention: str = "block"
    fused_loss: str = "auto"
    compile_loss: str = "auto"
    compile_layer: str = "off"
    sdpa_cudnn: bool = False


KERNELS = KernelOptions()


def set_kernel_options(**options: Any) -> KernelOptions:
    """Set the process's kernel options (unknown names raise); returns the previous ones."""
    previous = dataclasses.replace(KERNELS)
    for name, value in options.items():
        if not hasattr(KERNELS, name):
            raise TypeError(f"unknown kernel option {name!r}")
        setattr(KERNELS, name, value)
    return previous


def switch_on(mode: str, device: torch.device) -> bool:
    """An "auto" | "on" | "off" switch for one device: auto = on CUDA."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


class CompiledOrEager:
    """Small functions run through torch.compile (dynamic shapes, one compile each per process) or
    eagerly, by one of the kernel options ("auto": compile on CUDA, "on": also on CPU, "off":
    never); `mode`, when set, overrides it. A compile or call that raises turns compiling off for
    the process with a warning, and the eager function computes that call (the same math)."""

    def __init__(self, option: str, what: str) -> None:
        self.option = option
        self.mode: str | None = None
        self.what = what
        self.failed = False
        self.compiled: dict[Any, Any] = {}

    def use(self, t: torch.Tensor) -> bool:
        return not self.failed and switch_on(self.mode or getattr(KERNELS, self.option), t.device)

    def run(self, fn: Any, *args: Any) -> Any:
        """fn(*args), compiled when `use` says so for the first tensor argument."""
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is None or not self.use(first):
            return fn(*args)
        try:
            if fn not in self.compiled:
                self.compiled[fn] = torch.compile(fn, dynamic=True)
            return self.compiled[fn](*args)
        except Exception as e:  # noqa: BLE001 - compiled or not, the math is the same
            self.failed = True
            import logging

            logging.getLogger("specops.train").warning(
                "train: the compiled %s failed (%s: %s); the eager %s runs from now on", self.what,
                type(e).__name__, str(e).splitlines()[0] if str(e) else "", self.what)
            return fn(*args)


class _LayerRegions(CompiledOrEager):
    """The drafter layer's elementwise-heavy parts in training's unroll, fused by torch.compile.

    A SmolLM2-sized training step on an H200 issues ~1,950 kernel launches and spends more host
    time than device time: per TTT step the three
    RMSNorms (fp32 statistics), RoPE, the concat, SiLU-gate and residual adds are each several small
    kernels forward and more backward. Two regions around the attention core (`_mid_pre`: norms,
    concat, q/k/v projections and RoPE; `_mid_post`: o_proj, residuals, the MLP) are compiled with
    dynamic shapes; the attention core stays eager (its form changes with the step).
    train.compile_layer (KernelOptions): off by default; on real features of many shapes its
    dynamic-shape graphs can recompile far more often than on synthetic batches.
    """

    def __init__(self) -> None:
        super().__init__("compile_layer", "drafter layer")


LAYER_REGIONS = _LayerRegions()

# Parameter and buffer names of the drafter, exactly as DESIGN.md fixes them. A test asserts the
# module's state_dict keys equal this tuple; the vLLM export maps nothing (vLLM reads these names).
STATE_DICT_KEYS = (
    "embed_tokens.weight",
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)


# train.drafter_layer's values past "auto" (config.DRAFTER_LAYERS lists the same, torch-free).
DRAFTER_LAYERS = ("llama", "mla")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    v = cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)
    return default if v is None else v


def rope_from_hf(cfg: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from an HF config of transformers 4 (`rope_theta`,
    `rope_scaling`) or 5 (`rope_parameters` holding both)."""
    params = _get(cfg, "rope_parameters")
    theta = _get(cfg, "rope_theta")
    scaling = _get(cfg, "rope_scaling")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", params.get("type", "default")) != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if isinstance(scaling, dict):
        scaling = dict(scaling)
        scaling.pop("rope_theta", None)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if kind == "default" else {"rope_type": kind, **scaling}
    return float(theta if theta is not None else 10000.0), scaling or None


@dataclass(kw_only=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # passed through to the export's config.json
    max_position_embeddings: int = 4096
    target_hidden_size: int | None = None  # width of each aux state; default hidden_size
    norm_before_residual: bool = False
    hidden_act: str = "silu"
    target_num_hidden_layers: int | None = None  # recorded for export (SGLang's output-of-layer ids)
    # The decoder layer's attention (train.drafter_layer): "llama" (GQA q/k/v_proj, this module) or
    # "mla" (DeepSeek's multi-head latent attention, drafter/mla.py), whose sizes are the fields
    # below (None for "llama"). With "mla", head_dim is the query/key head width
    # qk_nope_head_dim + qk_rope_head_dim, num_key_value_heads = num_attention_heads, and RoPE turns
    # the qk_rope_head_dim channels only.
    layer: str = "llama"
    q_lora_rank: int | None = None  # None: a full-rank q_proj (vLLM 0.32's loader needs a rank, export.py)
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.layer not in DRAFTER_LAYERS:
            raise ValueError(f"layer {self.layer!r}: expected one of {', '.join(DRAFTER_LAYERS)}")
        mla = {k: getattr(self, k) for k in MLA_FIELDS if k != "q_lora_rank"}
        if self.layer == "mla":
            missing = [k for k, v in mla.items() if not v]
            if missing:
                raise ValueError(f"an MLA layer needs {', '.join(missing)}")
            if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
                raise ValueError(f"MLA head_dim {self.head_dim} != qk_nope_head_dim + qk_rope_head_dim "
                                 f"({self.qk_nope_head_dim} + {self.qk_rope_head_dim})")
            if self.num_key_value_heads != self.num_attention_heads:
                raise ValueError("MLA has one key/value head per query head: num_key_value_heads must equal "
                                 "num_attention_heads")
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even (RoPE turns pairs)")
        elif any(v is not None for v in (*mla.values(), self.q_lora_rank)):
            raise ValueError(f"MLA sizes ({', '.join(MLA_FIELDS)}) are given for a {self.layer!r} layer")
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} exceeds the target vocab {self.target_vocab_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"EAGLE-3 fuses exactly 3 aux layers, got {self.aux_layer_ids}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r}: the drafter layer is Llama (silu)")

    @classmethod
    def from_target(
        cls,
        hf_config: Any,
        draft_vocab_size: int,
        aux_layer_ids: list[int] | None = None,
        *,
        layer: str = "llama",
        **overrides: Any,
    ) -> "DrafterConfig":
        """The drafter layer takes the target's shapes (EAGLE-3 convention). `hf_config` is an HF
        config object or its dict; a nested `text_config` is used when present. layer="mla": the
        target's MLA sizes (kv_lora_rank, q_lora_rank, the q/k/v head dims); a target without a
        q_lora_rank gives the drafter one of hidden_size (vLLM 0.32 loads only the low-rank query)."""
        c = text_config(hf_config)
        hidden = int(_get(c, "hidden_size"))
        heads = int(_get(c, "num_attention_heads"))
        layers = int(_get(c, "num_hidden_layers"))
        theta, scaling = rope_from_hf(c)
        kw: dict[str, Any] = dict(
            hidden_size=hidden,
            intermediate_size=int(_get(c, "intermediate_size")),
            num_attention_heads=heads,
            num_key_value_heads=int(_get(c, "num_key_value_heads", heads)),
            head_dim=int(_get(c, "head_dim", hidden // heads)),
            rms_norm_eps=float(_get(c, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(_get(c, "max_position_embeddings", 4096)),
            target_vocab_size=int(_get(c, "vocab_size")),
            draft_vocab_size=int(draft_vocab_size),
            aux_layer_ids=list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(layers),
            target_hidden_size=hidden,
            target_num_hidden_layers=layers,
        )
        if layer == "mla":
            nope, rot = int(_get(c, "qk_nope_head_dim")), int(_get(c, "qk_rope_head_dim"))
            kw.update(layer="mla", q_lora_rank=int(_get(c, "q_lora_rank", hidden)), kv_lora_rank=int(_get(c, "kv_lora_rank")),
                      qk_nope_head_dim=nope, qk_rope_head_dim=rot, v_head_dim=int(_get(c, "v_head_dim")),
                      head_dim=nope + rot, num_key_value_heads=heads)
        kw.update(overrides)
        return cls(**kw)

    @property
    def rope_dim(self) -> int:
        """The channels RoPE turns per head: all of head_dim (Llama) or qk_rope_head_dim (MLA)."""
        return int(self.qk_rope_head_dim) if self.layer == "mla" else self.head_dim

    @classmethod
    def debug(cls, **overrides: Any) -> "DrafterConfig":
        """A tiny drafter for CPU unit tests (GQA 4:2, head_dim != H/heads to catch shape slips)."""
        kw: dict[str, Any] = dict(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            target_vocab_size=96,
            draft_vocab_size=48,
            aux_layer_ids=[2, 3, 3],
            max_position_embeddings=256,
            target_num_hidden_layers=6,
        )
        kw.update(overrides)
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 (as HF/vLLM Llama), result back in the input dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rope_inv_freq(cfg: DrafterConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rope_dim/2] and the cos/sin scale (1.0 except yarn/longrope)."""
    d = cfg.rope_dim
    base = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    kind = (cfg.rope_scaling or {}).get("rope_type", (cfg.rope_scaling or {}).get("type", "default"))
    if kind in ("default", "dynamic"):  # dynamic NTK equals default up to max_position_embeddings
        return base, 1.0
    # Scaled variants: reuse transformers' definitions (the same formulas vLLM's get_rope implements).
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_scaling type {kind!r} is not supported")
    params = {**(cfg.rope_scaling or {}), "rope_type": kind, "rope_theta": cfg.rope_theta}
    params.pop("type", None)
    orig = params.get("original_max_position_embeddings")
    hf = LlamaConfig(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        head_dim=d,
        max_position_embeddings=max(cfg.max_position_embeddings, orig or 0),
        rope_parameters=params,
    )
    inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](hf, torch.device("cpu"))
    return inv_freq.float(), float(scale)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    """GQA attention whose q/k/v read the 2H input. Names match vLLM's (q/k/v/o_proj, no bias)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.d = nh, nkv, d
        self.q_proj = nn.Linear(2 * h, nh * d, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        past_kv: list[tuple[torch.Tensor, torch.Tensor]],
        ttt: bool = False,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """ttt=True (training's unroll): attn_mask is the step-0 block [B, 1, T, T] only and past_kv
        holds steps 0..k-1 in order; see ttt_attention. Otherwise attn_mask covers cat(past, own)."""
        q, k, v = self.qkv(x, cos, sin)
        kv = (k, v)
        return self.o_proj(self.core(q, kv, attn_mask, past_kv, ttt)), kv

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B, nh, T, d], k and v [B, nkv, T, d], RoPE applied to q and k."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.d).transpose(1, 2)  # [B, nh, T, d]
        k = self.k_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)  # [B, nkv, T, d]
        v = self.v_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)
        cos, sin = cos.to(q.dtype)[:, None], sin.to(q.dtype)[:, None]  # [B, 1, T, d]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def core(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], attn_mask: torch.Tensor | None,
             past_kv: list[tuple[torch.Tensor, torch.Tensor]], ttt: bool = False) -> torch.Tensor:
        """The attention itself: [B, T, nh * d], before o_proj."""
        B, _, T, _ = q.shape
        k, v = kv
        if ttt and past_kv:
            out = ttt_attention(q, past_kv[0], past_kv[1:] + [kv], attn_mask)
            return out.transpose(1, 2).reshape(B, T, -1)  # [B, T, nh * value width]
        keys = torch.cat([pk.to(k.dtype) for pk, _ in past_kv] + [k], dim=2) if past_kv else k
        vals = torch.cat([pv.to(v.dtype) for _, pv in past_kv] + [v], dim=2) if past_kv else v
        S = keys.shape[2]
        if attn_mask is None and S > T:
            # KV-cache semantics: query i sees every past key and current keys <= i.
            attn_mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        if self.nh != self.nkv:  # expand KV heads; memory-efficient SDPA kernels do not take GQA + masks
            keys = keys.repeat_interleave(self.nh // self.nkv, dim=1)
            vals = vals.repeat_interleave(self.nh // self.nkv, dim=1)
        if attn_mask is not None and q.is_cuda and not KERNELS.sdpa_cudnn:
            with sdpa_kernel(_MASKED_BACKENDS):
                out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=attn_mask)
        else:
            out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=attn_mask, is_causal=attn_mask is None)
        return out.transpose(1, 2).reshape(B, T, -1)  # [B, T, nh * value width]


PROBE_PAD = 8  # extra head channels for ttt_attention's probe key (hi, lo, zeros): keeps head dims % 8


class TTTBlock(NamedTuple):
    """Step 0's keys and values as every later TTT step's attention reads them (`ttt_block`)."""
    keys: torch.Tensor  # [B, nh, Tk, d + PROBE_PAD]: the block, the probe key, masked zero keys
    vals: torch.Tensor  # [B, nh, Tk, dv + PROBE_PAD] (dv: the value width, d but for MLA)
    mask: torch.Tensor  # bool [B or 1, 1, T, Tk]
    T: int


def ttt_block(block: tuple[torch.Tensor, torch.Tensor], mask0: torch.Tensor, nh: int) -> TTTBlock:
    """The part of `ttt_attention` that is the same at every step k >= 1: step 0's (k, v) [B, nkv, T, d]
    padded with the probe channels, the probe key, zero keys up to a multiple of 16 (the
    memory-efficient kernel wants the mask's rows aligned; torch would otherwise pad a copy of it on
    every call), GQA-expanded, and its mask. Built once per unroll, it saves each later step ~17
    kernels forward and the matching backward (one node for the unroll instead of one per step)."""
    k0, v0 = block
    B, nkv, T, d = k0.shape
    dv = v0.shape[-1]
    dt = k0.dtype
    rep = nh // nkv
    probe_k = torch.zeros(B, nkv, 1, d + PROBE_PAD, dtype=dt, device=k0.device)
    probe_k[..., d:d + 2] = 1.0
    probe_v = torch.zeros(B, nkv, 1, dv + PROBE_PAD, dtype=dt, device=k0.device)
    probe_v[..., dv] = 1.0
    Tk = (T + 1 + 15) // 16 * 16
    pad = k0.new_zeros(B, nkv, T, PROBE_PAD)
    keys = torch.cat([torch.cat([k0, pad], -1), probe_k, k0.new_zeros(B, nkv, Tk - T - 1, d + PROBE_PAD)], 2)
    vals = torch.cat([torch.cat([v0, pad], -1), probe_v, k0.new_zeros(B, nkv, Tk - T - 1, dv + PROBE_PAD)], 2)
    if rep > 1:
        keys = keys.repeat_interleave(rep, dim=1)
        vals = vals.repeat_interleave(rep, dim=1)
    mask = torch.zeros(*mask0.shape[:-1], Tk, dtype=torch.bool, device=k0.device)
    mask[..., :T] = mask0
    mask[..., T] = True  # the probe: every query sees it
    return TTTBlock(keys, vals, mask, T)


def ttt_attention(q: torch.Tensor, block: tuple[torch.Tensor, torch.Tensor] | TTTBlock,
                  diag: list[tuple[torch.Tensor, torch.Tensor]], mask0: torch.Tensor | None) -> torch.Tensor:
    """Attention of TTT step k >= 1 without the empty blocks.

    q [B, nh, T, d]; block = step 0's (k, v) [B, nkv, T, d], or those prepared once by `ttt_block`
    (then mask0 is not read); diag = steps 1..k's (k, v), own step last; mask0 bool [B or 1, 1, T, T],
    the step-0 block (same document, causal). Query t of step k sees step 0's keys under mask0 plus
    one key per later step, each at its own slot t: the dense form (a [T, (k+1)·T] mask of which k
    diagonal blocks hold one entry per row) does ~(k+1)x the score work of this one, and its masks
    grow with k.

    The k diagonal scores s_j = q_t·k_j,t (scaled) are exact per-slot dot products. Their softmax
    mass enters one masked SDPA over the block through a probe key: q gains channels holding
    m_t = logsumexp_j s_j (over scale, split hi + lo so that bf16 keeps it to ~16 bits), the probe
    key has ones there and zeros elsewhere, the block's keys zeros there. The probe's weight in that
    softmax is then exactly sum_j exp(s_j) / Z, its value (1 in one extra channel) reads it out as
    alpha_t, and the block's part comes out already scaled by (1 - alpha_t). So
        out = SDPA(...)[:d] + alpha_t · sum_j softmax(s)_j v_j,t
    equals softmax over all visible keys, gradients included (plain differentiable ops).
    """
    B, nh, T, d = q.shape
    dt = q.dtype
    if not isinstance(block, TTTBlock):
        block = ttt_block((block[0].to(dt), block[1].to(dt)), mask0, nh)
    nkv, dv = diag[0][0].shape[1], diag[0][1].shape[-1]  # dv: the value width (d but for MLA)
    rep = nh // nkv
    scale = 1.0 / math.sqrt(d)
    # Per-slot products as batched matmuls (no [.., T, d] intermediate per step j), in fp32 even
    # under autocast: the scores feed a softmax, as inside SDPA.
    with torch.autocast(q.device.type, enabled=False):
        qg = q.view(B, nkv, rep, T, d).float()
        kd = torch.stack([kj for kj, _ in diag], 2).float()  # [B, nkv, k, T, d]
        vd = torch.stack([vj for _, vj in diag], 2).float()
        s = torch.einsum("bgrtd,bgjtd->bgrtj", qg, kd) * scale  # [B, nkv, rep, T, k]
        m = torch.logsumexp(s, -1)  # [B, nkv, rep, T]
        w = torch.softmax(s, -1)
        wv = torch.einsum("bgrtj,bgjtd->bgrtd", w, vd)  # [B, nkv, rep, T, dv]
    mq = (m / scale).reshape(B, nh, T, 1)
    hi = mq.to(dt)
    lo = (mq - hi.float()).to(dt)
    q2 = torch.cat([q, hi, lo, q.new_zeros(B, nh, T, PROBE_PAD - 2)], -1)
    keys, vals = block.keys.to(dt), block.vals.to(dt)  # no-ops but where the block came in another dtype
    if q.is_cuda and not KERNELS.sdpa_cudnn:
        with sdpa_kernel(_MASKED_BACKENDS):
            out = F.scaled_dot_product_attention(q2, keys, vals, attn_mask=block.mask, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q2, keys, vals, attn_mask=block.mask, scale=scale)
    alpha = out[..., dv:dv + 1].float()
    return (out[..., :dv].float() + alpha * wv.reshape(B, nh, T, dv)).to(dt)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The decoder layer; `attention` builds its self_attn from the config (Llama's `Attention`, or
    drafter/mla.py's `MLAAttention`): a module with qkv(x, cos, sin), core(...) and o_proj."""

    def __init__(self, cfg: DrafterConfig, attention: type[nn.Module] | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = (attention or Attention)(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds, hidden, cos, sin, attn_mask, past_kv, ttt=False):
        # training's unroll may compile the two regions around the attention core (_LayerRegions)
        run = LAYER_REGIONS.run if ttt else (lambda fn, *args: fn(*args))
        q, k, v, residual = run(_mid_pre, self, embeds, hidden, cos, sin)
        o = self.self_attn.core(q, (k, v), attn_mask, past_kv, ttt)
        return run(_mid_post, self, o, residual), (k, v)


def _mid_pre(layer: MidLayer, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """MidLayer up to the attention core: (q, k, v, residual)."""
    e = layer.input_layernorm(embeds)
    g = layer.hidden_norm(hidden)
    residual = g if layer.norm_before_residual else hidden
    x = torch.cat([e.to(g.dtype), g], dim=-1)  # [B, T, 2H]
    q, k, v = layer.self_attn.qkv(x, cos, sin)
    return q, k, v, residual


def _mid_post(layer: MidLayer, o: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """MidLayer after the attention core: o_proj, residual, MLP."""
    h = residual + layer.self_attn.o_proj(o)
    return h + layer.mlp(layer.post_attention_layernorm(h))


class DraftOut(NamedTuple):
    hidden: torch.Tensor  # [B, T, H] pre-norm; the next step's hidden input
    logits: torch.Tensor | None  # [B, T, draft_vocab]
    kv: tuple[torch.Tensor, torch.Tensor]  # this call's (k, v), [B, nkv, T, head_dim], k after RoPE


def register_vocab_and_rope(module: nn.Module, cfg: DrafterConfig) -> None:
    """The buffers every drafter model keeps: d2t int64 [draft_vocab] and t2d bool [target_vocab]
    (the identity vocab until set_vocab: draft id i is target id i), RoPE's inv_freq [head_dim/2]
    (not saved) and its cos/sin scale."""
    module.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
    t2d = torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
    t2d[: cfg.draft_vocab_size] = True
    module.register_buffer("t2d", t2d)
    inv_freq, scale = _rope_inv_freq(cfg)
    module.register_buffer("inv_freq", inv_freq, persistent=False)
    module.rope_scale = scale


class Eagle3Drafter(nn.Module):
    # the layer's attention (MidLayer); drafter/mla.py's Eagle3MLADrafter sets MLAAttention
    attention_cls: type[nn.Module] = Attention
    layer = "llama"  # the DrafterConfig.layer this class builds

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        if cfg.layer != self.layer:
            raise ValueError(f"{type(self).__name__} builds a {self.layer!r} layer, the config says {cfg.layer!r}")
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, H)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, H, bias=False)
        self.midlayer = MidLayer(cfg, self.attention_cls)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        register_vocab_and_rope(self, cfg)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    # ---------------------------------------------------------------- vocab and target init
    @torch.no_grad()
    def set_vocab(self, d2t: torch.Tensor) -> None:
        """d2t int64 [draft_vocab]: target_id = i + d2t[i]. t2d is derived from it."""
        d2t = torch.as_tensor(d2t, dtype=torch.int64)
        if d2t.shape != self.d2t.shape:
            raise ValueError(f"d2t has shape {tuple(d2t.shape)}, expected {tuple(self.d2t.shape)}")
        ids = torch.arange(d2t.numel()) + d2t
        if ids.min() < 0 or ids.max() >= self.config.target_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError("d2t maps draft ids outside the target vocab or onto the same target id twice")
        self.d2t.copy_(d2t)
        self.t2d.zero_()
        self.t2d[ids.to(self.t2d.device)] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        # index_select, not d2t[draft_ids]: a 0-d index would be a select on a Python int (a host
        # sync, which also breaks CUDA-graph capture of the eval loop's drafter chain)
        return draft_ids + self.d2t.index_select(0, draft_ids.reshape(-1)).view(draft_ids.shape)

    @torch.no_grad()
    def init_from_target(
        self,
        target_embed_weight: torch.Tensor,
        target_lm_head_weight: torch.Tensor,
        d2t: torch.Tensor | None = None,
        *,
        freeze_embeddings: bool = True,
    ) -> None:
        """Copy the target's embedding (frozen by default) and start lm_head from the target's
        lm_head rows of the draft vocab. Both [target_vocab, H]."""
        if d2t is not None:
            self.set_vocab(d2t)
        want = (self.config.target_vocab_size, self.config.hidden_size)
        for name, w in (("embed", target_embed_weight), ("lm_head", target_lm_head_weight)):
            if tuple(w.shape) != want:
                raise ValueError(f"target {name} has shape {tuple(w.shape)}, expected {want}")
        self.embed_tokens.weight.copy_(target_embed_weight.to(self.embed_tokens.weight))
        self.embed_tokens.weight.requires_grad_(not freeze_embeddings)
        rows = (torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t).cpu()
        self.lm_head.weight.copy_(target_lm_head_weight.cpu()[rows].to(self.lm_head.weight))

    # ---------------------------------------------------------------- forward
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., 3, H_target] (aux_layer_ids order) or [..., 3·H_target] -> fused [..., H]."""
        if aux.dim() >= 2 and aux.shape[-2] == 3 and aux.shape[-1] == self.config.target_hidden_size:
            aux = aux.flatten(-2)
        if not torch.is_autocast_enabled(aux.device.type):
            aux = aux.to(self.fc.weight.dtype)
        return self.fc(aux)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, rope_dim] in fp32 for integer positions [B, T]."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # [B, T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.rope_scale, emb.sin() * self.rope_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] pre-norm -> [..., draft_vocab]."""
        return self.lm_head(self.norm(hidden))

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor | None,
        *,
        attn_mask: torch.Tensor | None = None,
        past_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        return_logits: bool = True,
        ttt: bool = False,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> DraftOut:
        """One drafter step.

        input_ids [B, T] target-vocab ids; hidden [B, T, H] (fused aux states or the previous
        step's output); positions [B, T]. attn_mask bool [B or 1, 1, T, S] over keys
        cat(past_kv..., this call's keys) (True = attend); None means causal with every past key
        visible. Returns the pre-norm hidden, logits (unless return_logits=False) and this call's kv.
        ttt=True: training's unroll, where past_kv = the kv of steps 0..k-1 of the same slots and
        attn_mask = the step-0 block only (ttt_attention). rope: (cos, sin) of the positions computed
        already (training's unroll computes every step's at once); positions may then be None.
        """
        embeds = self.embed_tokens(input_ids)
        if rope is None:
            if positions is None:
                raise ValueError("Eagle3Drafter.forward: positions or rope is required")
            rope = self.rope(positions)
        cos, sin = rope
        h, kv = self.midlayer(embeds, hidden, cos, sin, attn_mask, list(past_kv or ()), ttt)
        return DraftOut(h, self.compute_logits(h) if return_logits else None, kv)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


__all__ = [
    "STATE_DICT_KEYS",
    "DrafterConfig",
    "DraftOut",
    "Eagle3Drafter",
    "rope_from_hf",
    "count_parameters",
]
