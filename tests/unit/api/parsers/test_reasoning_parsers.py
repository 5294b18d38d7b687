"""Reasoning parsers (services/api/parsers/reasoning_parsers.py): the whole split, and the streamed
pieces adding up to it whatever the delta boundaries (tags cut anywhere)."""

from __future__ import annotations

import pytest

from kvserve.services.api.parsers.reasoning_parsers import ReasoningSplitter
from kvserve.services.api.parsers.reasoning_registry import REASONING_PARSERS, get_reasoning_parser
from kvserve.shared.parser_names import REASONING_PARSER_NAMES

R1 = get_reasoning_parser("deepseek_r1")

CASES = [
    ("Let me think.</think>\n\nThe answer is 4.", ("Let me think.", "The answer is 4.")),
    ("<think>\nhm, 2+2</think>4", ("\nhm, 2+2", "4")),
    ("  <think>a</think>b", ("a", "b")),
    ("still thinking when cut", ("still thinking when cut", None)),
    ("</think>just the answer", (None, "just the answer")),
    ("<thinking> is not the tag</think>x", ("<thinking> is not the tag", "x")),
    ("a < b and c </ d</think>\n", ("a < b and c </ d", None)),
]


@pytest.mark.parametrize("text, expected", CASES)
def test_a_whole_reply_splits_at_the_end_tag(text, expected):
    assert ReasoningSplitter(R1).split(text) == expected


@pytest.mark.parametrize("text, expected", CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_streamed_deltas_add_up_to_the_whole_split(text, expected, size):
    splitter = ReasoningSplitter(R1)
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    reasoning, content = "", ""
    for i, piece in enumerate(pieces):
        r, c = splitter.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    assert (reasoning or None, content or None) == expected


def test_qwen3_thinks_unless_the_request_turns_it_off():
    qwen3 = get_reasoning_parser("qwen3")
    assert qwen3.starts_thinking({}) and qwen3.starts_thinking({"enable_thinking": True})
    assert not qwen3.starts_thinking({"enable_thinking": False})
    assert R1.starts_thinking({"enable_thinking": False})  # R1 always thinks
    # The flag's choices (shared/config.py) are the registered parsers.
    names = set(REASONING_PARSERS) | {"openai_gptoss"}  # harmony's: services/api/harmony/
    assert names == set(REASONING_PARSER_NAMES) >= {"deepseek_r1", "qwen3"}
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")
