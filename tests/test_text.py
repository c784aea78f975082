"""The one `<think>` splitter and the greedy-loop measure (specops.text)."""

import numpy as np

from specops.text import ThinkSplit, count_repeating, has_think_tags, repeating_tokens, split_think, wrap_reasoning


def test_split_think_cases():
    assert split_think("<think>\nhmm\n</think>\n\nAnswer.") == ThinkSplit("hmm", "Answer.")
    assert split_think("hmm</think>Answer.") == ("hmm", "Answer.")  # the template opened the block
    assert split_think("<think>still thinking") == ("still thinking", "")  # cut off before it closed
    assert split_think(" plain text ") == (None, " plain text ")
    assert split_think("").reasoning is None


def test_split_think_inverts_wrap_reasoning():
    for reasoning, content in [("a\nb", "c"), ("x", ""), ("  indented", "  code")]:
        text = wrap_reasoning(reasoning, content)
        assert text.startswith("<think>\n") and "\n</think>\n\n" in text
        assert split_think(text) == (reasoning, content)


def test_has_think_tags():
    assert has_think_tags("a </think> b") and has_think_tags("<think>")
    assert not has_think_tags("") and not has_think_tags(None) and not has_think_tags("think")


def test_repeating_tokens_counts_later_copies_within_a_turn_only():
    # two turns (mask runs); the 3-gram (1, 2, 3) repeats inside turn one, and again in turn two
    ids = np.array([9, 1, 2, 3, 1, 2, 3, 9, 1, 2, 3], dtype=np.int32)
    mask = np.array([0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1], dtype=np.uint8)
    rep = repeating_tokens(ids, mask, 3)
    assert rep.tolist() == [False] * 6 + [True] + [False] * 4
    assert count_repeating([5, 6, 5, 6, 5, 6], 2) == 3
    assert count_repeating([], 4) == 0
