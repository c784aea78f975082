"""What a drafter family provides, and what its callers hold.

A family is one kind of drafter: its model and config, the target layers it reads, its training
objective and simulated acceptance, its drafting rule in the evaluation loop, its export formats
with their check, and the flags that serve it. `train`, `export`, `eval` and `serve` reach all of it
through `DrafterFamily` (`families.family_of` and its siblings say which family a model, an export
or a checkpoint holds); what every family shares stays with those phases: the data pipeline and the
trainer loop (`drafter/train.py`), the batch and the teacher (`drafter/batch.py`), the loss kernels
(`drafter/losses.py`), checkpoints (`drafter/checkpoint.py`), the target runners and the acceptance
rule of the loop (`evaluate/`).
"""

from __future__ import annotations

import json
import pickle
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, NamedTuple, Protocol, Sequence

import torch
from torch import nn

from ...checks.result import CheckResult, worst
from ..batch import Batch, Teacher
from ..formats import ExportError, _Checkpoint


class ObjectiveOut(NamedTuple):
    """A family objective's result on one batch; K = draft positions it scores."""

    loss: torch.Tensor  # scalar, differentiable: what the trainer runs backward on
    ce_sum: torch.Tensor  # float32 [K], detached: soft CE summed over each position's counted slots
    correct: torch.Tensor  # int64 [K]: counted slots whose argmax is the teacher's
    count: torch.Tensor  # int64 [K]: counted slots per position (acc_k = correct_k / count_k)
    logits: list[torch.Tensor] | None  # per position [B, T, Vd] when asked for (tests), else None


class DrafterRunner(Protocol):
    """A family's drafting rule in the evaluation loop (`evaluate/loop.py`), one sequence (rows = 1).

    prefill(ids, aux): the prompt ids [1, n] and the target's states at them [n, n_aux, H_t]; the
        runner takes what its family drafts from (EAGLE-3: slots 0..n-2).
    draft(tokens, aux, start, k, temperature, gen): the tokens verified since the last call
        [1, m] with the target's states before each [1, m, n_aux, H_t], at positions start..;
        -> (k drafts as target ids int64 [k], at temperature > 0 the distributions they were
        sampled from over the draft vocab float32 [k, Vd], else None).
    len(runner): positions the runner holds.
    """

    name: str
    use_graphs: bool

    def __len__(self) -> int: ...

    def reset(self, max_len: int) -> None: ...

    def prefill(self, ids: torch.Tensor, aux: torch.Tensor) -> None: ...

    def draft(self, tokens: torch.Tensor, aux: torch.Tensor, start: int, k: int, *, temperature: float,
              gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def sample_token(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One draw per row of probs [..., V] -> int64 [...]: how drafts and the loop's tokens are sampled."""
    return torch.multinomial(probs, 1, generator=gen)[..., 0]


@dataclass(slots=True)
class CheckReport:
    """Verdict on one drafter dir. `problems` holds only warn/nogo results; `facts` the evidence
    (format, layer ids in both conventions, vocab sizes, dtypes); `family`, the family that reads
    the dir (None when none does)."""

    path: str
    format: str  # a format of `family` (EAGLE-3: "vllm" | "speculators"), or "unknown"
    problems: list[CheckResult] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    family: DrafterFamily | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return worst(self.problems) != "nogo"

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "family": self.family.name if self.family is not None else None,
                "format": self.format, "ok": self.ok,
                "problems": [p.to_json() for p in self.problems], "facts": self.facts}

    def render(self) -> str:
        n_nogo = sum(p.status == "nogo" for p in self.problems)
        head = "OK" if self.ok else f"FAIL ({n_nogo} blocking)"
        kind = f"{self.family.name} {self.format}" if self.family is not None else self.format
        lines = [f"{self.path}: {kind} drafter dir: {head}"]
        for p in self.problems:
            lines.append(f"  {p.status:<5} {p.name:<28} {p.message}")
        for k, v in self.facts.items():
            lines.append(f"  {k}: {v}")
        return "\n".join(lines)


def open_drafter_dir(directory: str | Path) -> tuple[CheckReport, dict[str, Any] | None, _Checkpoint | None]:
    """(a report of format "unknown", config.json, the weights read on demand) of a drafter dir;
    when either cannot be read, the report holds why and both are None."""
    d = Path(directory)
    report = CheckReport(path=str(d), format="unknown")

    def fail(name: str, message: str) -> tuple[CheckReport, None, None]:
        report.problems.append(CheckResult(name, "nogo", message, {}))
        return report, None, None

    if not (d / "config.json").is_file():
        return fail("config.missing", f"{d}/config.json does not exist")
    try:
        config = json.loads((d / "config.json").read_text())
    except json.JSONDecodeError as e:
        return fail("config.json", f"config.json is not JSON: {e}")
    try:
        weights = _Checkpoint(d)
    except ExportError as e:
        return fail("weights.missing", str(e))
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as e:
        return fail("weights.unreadable", f"cannot read the weights: {e!r}")
    return report, config, weights


class DrafterFamily(ABC):
    """One kind of drafter, as train, export, eval and serve use it (module docstring).

    `train` below is the campaign's train section (`config.TrainSection`): a family reads the keys
    that shape its model and objective from it.
    """

    name: ClassVar[str]  # "eagle3"
    not_an_export: ClassVar[str]  # the check's message for a dir in none of its export formats
    model_cls: ClassVar[type[nn.Module]]  # its drafter; `model.config` is an instance of config_cls
    config_cls: ClassVar[type]  # has to_dict(), and the target sizes target_vocab_size,
    # target_hidden_size, target_num_hidden_layers and the layer ids aux_layer_ids it reads
    export_formats: ClassVar[tuple[str, ...]]  # what `export` writes, the first the engines' own
    # The family this one extends, whose export check would also accept its dirs (P-EAGLE: "eagle3");
    # `families.family_of_export` then picks this one.
    refines: ClassVar[str | None] = None

    # ---------------------------------------------------------------- model
    @abstractmethod
    def feature_layer_ids(self, num_layers: int) -> list[int]:
        """The target layers (input-to-layer ids) a drafter of this family reads by default."""

    def resolve_train(self, train: Any, target_config: Mapping[str, Any], tokenizer: Callable[[], Any | None]) -> Any:
        """The train section with this family's target-dependent keys filled in and checked against
        the target (its HF config; `tokenizer()` loads the target's tokenizer, None when it has
        none), once, before new_config; raises InputError naming the key. Default: `train` as is."""
        return train

    @abstractmethod
    def new_config(self, target_config: Mapping[str, Any] | Any, draft_vocab_size: int, layer_ids: list[int],
                   train: Any) -> Any:
        """The drafter config for a target (its HF config), a draft vocab and the layers trained on."""

    @abstractmethod
    def new_drafter(self, config: Any, head: Any, d2t: torch.Tensor, t2d: torch.Tensor, train: Any) -> nn.Module:
        """A drafter to train, started from the target's head (`target.inprocess.TargetHead`) over the
        draft vocab d2t; raises InputError when t2d (build's) does not match d2t."""

    @abstractmethod
    def drafter_from_config(self, config: Mapping[str, Any]) -> nn.Module:
        """An untrained drafter of a checkpoint's config (drafter_config.json), to load weights into."""

    # ---------------------------------------------------------------- training
    @abstractmethod
    def objective(self, drafter: nn.Module, train: Any) -> nn.Module:
        """The training objective as a module: forward(batch: Batch, targets: batch.Targets) ->
        ObjectiveOut over train.ttt_steps draft positions (one forward per backward, as DDP wants)."""

    @abstractmethod
    def static_objective(self, drafter: nn.Module, teacher: Teacher, train: Any) -> Callable[[Batch], ObjectiveOut]:
        """The same loss, teacher included, with no host sync and no data-dependent shape: what the
        trainer captures as a CUDA graph (`drafter/graphs.py`)."""

    @abstractmethod
    def simulated_tau(self, acc: Sequence[float]) -> float:
        """Mean accepted tokens per target step from the per-position accuracy of the objective."""

    @abstractmethod
    def conventions(self, config: Any, train: Any) -> dict[str, Any]:
        """What training assumed (layer ids, alignment, vocab map): the train manifest's record."""

    # ---------------------------------------------------------------- evaluation
    @abstractmethod
    def drafter_runner(self, drafter: nn.Module, kind: str = "auto", *, cuda_graphs: bool = True, rows: int = 1,
                       min_capacity: int = 512) -> DrafterRunner:
        """The drafting rule for the evaluation loop; `kind` is eval.drafter_runner. rows > 1 (the
        batched loop, kind "static"): one sequence per row, driven by prefill_row(row, ids, aux) and
        draft_rows(tokens, aux, P, m, k, kv_len, temperature, gen) (EAGLE-3: `StaticDrafterRunner`)."""

    # ---------------------------------------------------------------- export
    def formats_of(self, drafter: nn.Module) -> tuple[str, ...]:
        """The formats `export` writes for this drafter by default (EAGLE-3 with an MLA layer: vLLM's
        only). Default: export_formats."""
        return self.export_formats

    @abstractmethod
    def export(self, fmt: str, drafter: nn.Module, out_dir: Path, *, target_config: Mapping[str, Any],
               target_name_or_path: str, speculative_tokens: int) -> Path:
        """Write `drafter` in format `fmt` (one of export_formats) to out_dir, checked before it lands."""

    @abstractmethod
    def export_format(self, config: Mapping[str, Any], names: set[str]) -> str | None:
        """Which of this family's formats a dir holds (its config.json, its tensor names), or None."""

    @abstractmethod
    def check_export(self, report: CheckReport, directory: Path, config: Mapping[str, Any], weights: _Checkpoint,
                     target_config: Mapping[str, Any] | str | Path | None) -> None:
        """Add to `report` what the engines need of a dir in format report.format and do not find
        (`open_drafter_dir` read config and weights; `target_config` as `drafter/export.py` check_export)."""

    @abstractmethod
    def drafter_from_export(self, directory: Path, *, target_num_hidden_layers: int,
                            target_embed: torch.Tensor) -> nn.Module:
        """A drafter from an export dir; an export without the embedding gets the target's."""

    # ---------------------------------------------------------------- serve
    @abstractmethod
    def serve_argv(self, engine: str, path: Path, k: int, *, as_model: bool) -> list[str]:
        """The flags that serve the drafter at `path` with k drafts per step on vLLM or SGLang;
        as_model: vLLM serves the dir itself as the model (a speculators-format export)."""
