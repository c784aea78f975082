"""Text conventions shared by generate, build, train and eval: the `<think>` block and greedy loops.

No torch here: generate, the health checks and the report import it.

* Reasoning travels inline as `<think>\\n{reasoning}\\n</think>\\n\\n{content}` (the form the
  target's chat template renders); `split_think` takes it apart, `wrap_reasoning` puts it back.
* A greedy loop is a generated token whose n tokens ending at it already occurred earlier in the
  same generated turn (`repeating_tokens`); build counts, masks or drops them, train can mask them
  at load time, and generate's canary reports their share.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ThinkSplit(NamedTuple):
    reasoning: str | None  # None: the text held no think block
    content: str


def split_think(text: str) -> ThinkSplit:
    """Split inline `<think>…</think>` reasoning out of generated text.

    * `<think>R</think>C` -> (R, C), newlines around R and before C dropped;
    * `R</think>C` (a template that opens the block in the prompt) -> (R, C);
    * `<think>R` never closed (cut off by max_tokens) -> (R, "");
    * anything else -> (None, text), unchanged.
    """
    if THINK_CLOSE in text:
        head, _, tail = text.partition(THINK_CLOSE)
        head = head.split(THINK_OPEN, 1)[1] if THINK_OPEN in head else head
        return ThinkSplit(head.strip("\n"), tail.lstrip("\n"))
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        return ThinkSplit(stripped[len(THINK_OPEN):].strip("\n"), "")
    return ThinkSplit(None, text)


def wrap_reasoning(reasoning: str, content: str | None) -> str:
    """The training text of a turn with reasoning: the inverse of `split_think`."""
    return f"{THINK_OPEN}\n{reasoning.strip(chr(10))}\n{THINK_CLOSE}\n\n{(content or '').lstrip(chr(10))}"


def has_think_tags(text: str | None) -> bool:
    return bool(text) and (THINK_OPEN in text or THINK_CLOSE in text)


def repeating_tokens(ids: np.ndarray, mask: np.ndarray, n: int) -> np.ndarray:
    """bool [T]: loss tokens (mask 1) whose n tokens ending at them occurred earlier in the same
    run of loss tokens (one generated turn). The first occurrence of a loop stays False; every
    later copy is True, so masking them keeps the text once. O(T) set lookups of n-token keys."""
    out = np.zeros(len(ids), dtype=bool)
    m = np.concatenate(([0], mask.astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(m))  # run starts and stops, alternating
    for start, stop in zip(edges[::2], edges[1::2]):
        seen: set[bytes] = set()
        run = np.ascontiguousarray(ids[start:stop])
        for i in range(n - 1, len(run)):
            key = run[i - n + 1:i + 1].tobytes()
            if key in seen:
                out[start + i] = True
            else:
                seen.add(key)
    return out


def count_repeating(tokens: Any, n: int) -> int:
    """How many of one generated turn's tokens repeat an n-token window of it (repeating_tokens
    over a turn with no prompt)."""
    ids = np.asarray(tokens, dtype=np.int64)
    return int(repeating_tokens(ids, np.ones(len(ids), dtype=np.uint8), n).sum())
