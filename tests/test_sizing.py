"""checks/sizing.py: the campaign's sizes on paper, the table docs/DESIGN.md shows, and the figures
checked by hand."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from specops.checks.sizing import KIMI_CAMPAIGN, campaign_sizes, figures, markdown_table

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "DESIGN.md"
# Figures the page quotes from outside the code: the original 10K-sample run's measured feature size.
QUOTED = {"828 GB"}
# Computed figures in the page's text: sizes, times, rates, token and parameter counts, ratios.
FIGURE = re.compile(r"\b\d[\d,]*(?:\.\d+)?(?: (?:TB|GB|kB|h|min|s)\b|K tok/s|[MBx]\b)(?!-)")  # not "8B-shaped"


def _section() -> str:
    text = DESIGN.read_text()
    start = text.index("## Sizes on paper: 88,088 prompts on 8 GPUs")
    return text[start:text.index("\n## ", start + 1)]


def test_design_shows_the_table_the_code_renders():
    assert markdown_table() in _section()


def test_every_figure_in_the_section_comes_from_the_code():
    known = set(figures(campaign_sizes()).values()) | QUOTED
    quoted = FIGURE.findall(_section())
    assert len(quoted) > 40  # the table and the bullets, not an empty match
    assert [q for q in quoted if q not in known] == []


def test_figures_by_hand():
    s = campaign_sizes()
    H = 7168
    # the original run: 10K samples x 2,888 tokens, 4 vectors per token, fp8 + one fp32 scale each
    assert s["extract"]["reference_fp8_bytes"] == 10_000 * 2_888 * (4 * (H + 4) + 5) == 828_653_840_000
    # 88,088 samples x (512 prompt + 3,000 completion) tokens, all kept by max_length 8,192
    tokens = 88_088 * 3_512
    assert s["tokens"]["mean"] == tokens == 309_365_056
    assert s["extract"]["bf16"]["bytes"] == tokens * (4 * H * 2 + 5) == 17_741_776_596_544  # 17.7 TB
    assert s["extract"]["fp8"]["bytes"] == tokens * (4 * (H + 4) + 5) == 8_876_611_551_808  # 8.9 TB
    # the bound: every completion at 8,192 tokens, cut at max_length 8,192
    assert s["extract"]["fp8"]["bound_bytes"] == 88_088 * 8192 * (4 * (H + 4) + 5)
    # generate: 264.264M completion tokens at 150 x 90 tok/s
    assert s["generate"]["time_s"][150] == pytest.approx(88_088 * 3_000 / 13_500)
    assert s["generate"]["time_s"][150] / 3600 == pytest.approx(5.438, abs=1e-3)
    # MLA: (kv_lora_rank 512 + rope 64) x 61 layers x 2 bytes per token
    assert s["target"]["cache_bytes_per_token"] == 576 * 61 * 2 == 70_272
    # active: everything but the routed experts (11.72B) + 8 of 384 experts' share of 1,014.69B
    routed = 1_014_686_023_680
    assert s["target"]["active_params"] == 1_026_408_232_448 - routed + routed * 8 // 384 == 32_861_500_928
    assert s["target"]["weight_bytes"] == 530_787_429_376 and not s["target"]["fits_one_gpu"]
    # drafter: fc 3H^2, attention 7H^2 (no GQA), MLP 3 x H x 18432, 4 norms, lm_head H x 32000
    params = 3 * H * H + 7 * H * H + 3 * H * 18432 + 4 * H + H * 32000
    assert s["train"]["params"] == params == 1_139_568_640
    assert s["train"]["bytes"] == params * (12 * 3 + 2)  # three fp32 checkpoints with Adam + a bf16 export
    assert s["train"]["state_bytes"] == params * 16 + 163840 * H * 4


def test_a_changed_input_changes_the_table():
    base = markdown_table()
    slower = markdown_table(campaign_sizes(replace(KIMI_CAMPAIGN, stream_tokens_per_s=45.0)))
    assert slower != base and "| generate | 10.9 h at c = 150, 51.0 h at c = 32 |" in slower
    assert slower not in _section()
    longer = markdown_table(campaign_sizes(replace(KIMI_CAMPAIGN, completion_tokens=6_000)))
    assert "8.9 TB fp8" in base and "8.9 TB fp8" not in longer  # 88,088 x 6,512 tokens: 16.5 TB
    assert "16.5 TB fp8" in longer
    # a target one GPU holds: extract and eval run in process
    roomy = markdown_table(campaign_sizes(replace(KIMI_CAMPAIGN, gpu_memory_bytes=600_000_000_000)))
    assert "in process refused" in base and "in process refused" not in roomy
    assert "| eval | <= 99 min | - | in process: 530.8 GB of weights on one GPU (600.0 GB) |" in roomy
