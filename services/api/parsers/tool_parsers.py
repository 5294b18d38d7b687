"""Tool-call parsers for tool_choice "auto": find the tool calls in a model's free text.

One parser per way models write calls, named as vLLM names them (--tool-call-parser):

    hermes       text <tool_call>{"name": "f", "arguments": {...}}</tool_call> ...
    llama3_json  [<|python_tag|>]{"name": "f", "parameters": {...}}; {...}
    pythonic     [f(a=1, b="x"), g()]

A parser reads a whole output (`extract`) and, for streaming, says where tool calls begin
in a growing text (`start_index`) and how much of its end may still turn into the start of
one (`holdback`). Text that does not parse as calls stays content, as in vLLM.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field


@dataclass(slots=True)
class ExtractedToolCalls:
    """content: the text that is not a tool call (None when there is none);
    calls: (function name, arguments as JSON text) in order."""

    content: str | None
    calls: list[tuple[str, str]] = field(default_factory=list)


def _content(text: str) -> str | None:
    return text if text.strip() else None


def _call_of(obj, arguments_keys: tuple[str, ...]) -> tuple[str, str]:
    """(name, arguments JSON) of one {"name": ..., "arguments"|"parameters": ...} object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call needs a name")
    arguments: object = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(arguments, str):
        json.loads(arguments)  # must already be JSON text
        return obj["name"], arguments
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def _longest_marker_prefix(text: str, marker: str) -> int:
    """Length of the longest end of text that begins `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class ToolParser:
    """Base: tool calls start at `marker`; anchored parsers only at the start of the text."""

    marker = ""
    anchored = False

    def extract(self, text: str) -> ExtractedToolCalls:
        try:
            return self._extract(text)
        except (ValueError, SyntaxError, TypeError):
            return ExtractedToolCalls(_content(text))  # not calls after all: plain text

    def _extract(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def start_index(self, text: str) -> int | None:
        """Where tool calls begin in text, or None if they have not (yet)."""
        if not self.anchored:
            index = text.find(self.marker)
            return None if index < 0 else index
        stripped = text.lstrip()
        starts = any(stripped.startswith(m) for m in self.start_markers)
        return len(text) - len(stripped) if stripped and starts else None

    @property
    def start_markers(self) -> tuple[str, ...]:
        return (self.marker,)

    def holdback(self, text: str) -> int:
        """Characters at the end of text (before any call) that may still start a call."""
        if not self.anchored:
            return _longest_marker_prefix(text, self.marker)
        stripped = text.lstrip()
        if not stripped or any(m.startswith(stripped) for m in self.start_markers):
            return len(text)  # undecided: the first characters are what tells
        return 0


class HermesToolParser(ToolParser):
    marker = "<tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def _extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(self.marker)
        if start < 0:
            return ExtractedToolCalls(_content(text))
        calls = [
            _call_of(json.loads(body), ("arguments", "parameters"))
            for body in self._CALL.findall(text[start:])
            if body.strip()
        ]
        if not calls:
            raise ValueError("empty tool call")
        return ExtractedToolCalls(_content(text[:start]), calls)


class Llama3JsonToolParser(ToolParser):
    marker = "{"
    anchored = True
    _PYTHON_TAG = "<|python_tag|>"

    @property
    def start_markers(self) -> tuple[str, ...]:
        return (self._PYTHON_TAG, "{")

    def _extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip().removeprefix(self._PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return ExtractedToolCalls(_content(text))
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            obj, end = decoder.raw_decode(body, position)
            calls.append(_call_of(obj, ("parameters", "arguments")))
            position = end
            while position < len(body) and body[position] in " \t\r\n;":
                position += 1
        return ExtractedToolCalls(None, calls)


class PythonicToolParser(ToolParser):
    marker = "["
    anchored = True

    def _extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if not (body.startswith("[") and body.endswith("]")):
            return ExtractedToolCalls(_content(text))
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            raise ValueError("not a list of calls")
        calls = []
        for node in tree.elts:
            if (
                not isinstance(node, ast.Call)
                or node.args
                or any(k.arg is None for k in node.keywords)
            ):
                raise ValueError("tool calls take keyword arguments only")
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            calls.append((ast.unparse(node.func), json.dumps(arguments, ensure_ascii=False)))
        return ExtractedToolCalls(None, calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "pythonic": PythonicToolParser,
}
