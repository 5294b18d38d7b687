"""Parsing overhead per streamed token of every tool-call and reasoning parser (issue 48).

Each family's reference output (tests/unit/api/parsers/family_formats.py, harmony's from
tests/unit/api/harmony/test_harmony.py) is put after a long answer-like text (so the stream
is mostly content, as replies are), cut into token-sized pieces (markers whole, words,
spaces, punctuation) and fed delta by delta through the class the server streams with:
ToolCallOutput (tool_choice "auto"), ReasoningSplitter, HarmonyOutput. Reported: µs per
streamed piece, the best of --repeats runs.

    .venv/bin/python bench/parsers.py [--prefix-tokens 400] [--repeats 5]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvserve.services.api.harmony.output import HarmonyOutput  # noqa: E402
from kvserve.services.api.parsers.reasoning_parsers import ReasoningSplitter  # noqa: E402
from kvserve.services.api.parsers.reasoning_registry import get_reasoning_parser  # noqa: E402
from kvserve.services.api.parsers.tool_calls import ToolCallOutput  # noqa: E402
from kvserve.services.api.serving.protocol import ChatTool  # noqa: E402
from tests.unit.api.harmony.test_harmony import CALL_OUTPUT  # noqa: E402
from tests.unit.api.harmony.test_harmony import TOOLS as HARMONY_TOOLS  # noqa: E402
from tests.unit.api.parsers.family_formats import (  # noqa: E402
    REASONING_FORMATS,
    TOOL_FORMATS,
    TOOLS,
)

_PIECE = re.compile(r"<[|｜][^<>]*?[|｜]>|\[/?[A-Z_]+\]|<[a-z_/=]+>?|\w+|\s+|[^\w\s]")
CHAT_TOOLS = msgspec.convert(TOOLS, list[ChatTool])


def pieces_of(text: str) -> list[str]:
    pieces = _PIECE.findall(text)
    assert "".join(pieces) == text, "the pieces must add up to the text"
    return pieces


def answer(num_tokens: int) -> str:
    words = "the quick brown fox jumps over a lazy dog while it rains in Paris".split()
    return " ".join(words[i % len(words)] for i in range(num_tokens // 2)) + ". "


def time_stream(make, pieces: list[str], repeats: int) -> float:
    """Best µs per piece of feeding `pieces` to a fresh make() (its update/feed method)."""
    best = float("inf")
    for _ in range(repeats):
        consumer = make()
        start = time.perf_counter()
        for number, piece in enumerate(pieces):
            consumer(piece, number == len(pieces) - 1)
        best = min(best, (time.perf_counter() - start) / len(pieces))
    return best * 1e6


def rows(prefix: str, repeats: int):
    seen = set()
    for case in TOOL_FORMATS:
        if case.parser in seen:
            continue
        seen.add(case.parser)
        pieces = pieces_of(prefix + case.text)

        def make(parser=case.parser):
            return ToolCallOutput("auto", parser, tools=CHAT_TOOLS).update

        yield f"tool: {case.parser}", len(pieces), time_stream(make, pieces, repeats)
    seen_reasoning = set()
    for case in REASONING_FORMATS:
        if case.parser in seen_reasoning or not case.reasoning:
            continue
        seen_reasoning.add(case.parser)
        reasoning_parser = get_reasoning_parser(case.parser)
        start, rest = case.text.split(reasoning_parser.end, 1)
        pieces = pieces_of(start + prefix + reasoning_parser.end + rest)

        def make(parser=reasoning_parser):
            return ReasoningSplitter(parser).feed

        yield f"reasoning: {case.parser}", len(pieces), time_stream(make, pieces, repeats)
    analysis, rest = CALL_OUTPUT.split("<|end|>", 1)
    pieces = pieces_of(analysis + prefix + "<|end|>" + rest)
    yield (
        "harmony: openai + openai_gptoss",
        len(pieces),
        time_stream(lambda: HarmonyOutput("auto", HARMONY_TOOLS).update, pieces, repeats),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    prefix = answer(args.prefix_tokens)
    print("| parser | streamed pieces | µs / piece |")
    print("|---|---:|---:|")
    for name, num_pieces, micros in rows(prefix, args.repeats):
        print(f"| {name} | {num_pieces} | {micros:.1f} |")


if __name__ == "__main__":
    main()
