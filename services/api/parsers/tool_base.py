"""What every tool-call parser shares: the result type, the base class, and the helpers that
turn a family's markup into (name, arguments JSON) pairs.

A parser reads a whole output (`extract`) and, for streaming, says where tool calls begin in
a growing text (`start_index`) and how much of its end may still turn into the start of one
(`holdback`). Text that does not parse as calls (truncated, malformed, or naming a function
the request did not offer) stays content, as in vLLM: never an error.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(slots=True)
class ExtractedToolCalls:
    """content: the text that is not a tool call (None when there is none);
    calls: (function name, arguments as JSON text) in order."""

    content: str | None
    calls: list[tuple[str, str]] = field(default_factory=list)


def content_of(text: str) -> str | None:
    return text if text.strip() else None


def call_of(obj: Any, arguments_keys: tuple[str, ...]) -> tuple[str, str]:
    """(name, arguments JSON) of one {"name": ..., "arguments"|"parameters": ...} object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call needs a name")
    arguments: object = next((obj[k] for k in arguments_keys if k in obj), {})
    return obj["name"], arguments_json(arguments)


def arguments_json(arguments: object) -> str:
    """Arguments as JSON object text: a JSON string is checked, anything else dumped."""
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return json.dumps(arguments, ensure_ascii=False)


def longest_marker_prefix(text: str, marker: str) -> int:
    """Length of the longest end of text that begins `marker` (scanning only from where the
    marker's first character occurs: this runs once per streamed token)."""
    index = text.find(marker[0], max(0, len(text) - len(marker) + 1))
    while index >= 0:
        if marker.startswith(text[index:]):
            return len(text) - index
        index = text.find(marker[0], index + 1)
    return 0


def typed_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A parameter written as bare text (Qwen3-Coder's, GLM-4.5's), typed by its JSON schema:
    strings stay text; numbers, booleans, null, objects and arrays are read as JSON (or as a
    Python literal); a value that does not read stays text, as vLLM keeps it."""
    kinds = _schema_types(schema)
    if not kinds or kinds <= {"string"}:
        return raw
    try:
        value = json.loads(raw)
    except ValueError:
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            return raw
    if "integer" in kinds and isinstance(value, float) and value.is_integer():
        value = int(value)
    return value


def _schema_types(schema: dict[str, Any] | None) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind} if isinstance(kind, str) else set()
    if "enum" in schema and not kinds:
        kinds = {"string" if isinstance(v, str) else "number" for v in schema["enum"]}
    for branch in schema.get("anyOf", []) + schema.get("oneOf", []):
        kinds |= _schema_types(branch)
    return kinds


class ToolParser:
    """Base: tool calls start at `marker`; anchored parsers only at the start of the text.

    Args:
        tools: the request's functions, name → parameters JSON schema; a call naming any
            other function makes the output content. None: any name is taken.
    """

    marker: ClassVar[str] = ""
    anchored: ClassVar[bool] = False
    # The family writes its markers as special tokens, which the text keeps only when the
    # detokenizer does not skip them (vLLM's parsers set skip_special_tokens=False too).
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: dict[str, dict[str, Any]] | None = None):
        self.tools = tools

    def extract(self, text: str) -> ExtractedToolCalls:
        try:
            extracted = self._extract(text)
        except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
            return ExtractedToolCalls(content_of(text))  # not calls after all: plain text
        if self.tools is not None and any(name not in self.tools for name, _ in extracted.calls):
            return ExtractedToolCalls(content_of(text))  # a function the request never offered
        return extracted

    def _extract(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def parameters_of(self, name: str) -> dict[str, Any]:
        """The properties schema of function `name` ({} when unknown)."""
        parameters = (self.tools or {}).get(name) or {}
        return parameters.get("properties") or {}

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
            return longest_marker_prefix(text, self.marker)
        stripped = text.lstrip()
        if not stripped or any(m.startswith(stripped) for m in self.start_markers):
            return len(text)  # undecided: the first characters are what tells
        return 0


class MarkedCallsParser(ToolParser):
    """A family whose calls follow a section marker, each call matched by `call_pattern`
    (a regex with groups `name` and `arguments`); every opened call must close, or the
    output is content (a truncated call is never half-taken)."""

    call_begin: ClassVar[str] = ""
    call_pattern: ClassVar[Any] = None

    def _extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(self.marker)
        if start < 0:
            return ExtractedToolCalls(content_of(text))
        section = text[start:]
        matches = list(self.call_pattern.finditer(section))
        if not matches or len(matches) != section.count(self.call_begin):
            raise ValueError("a tool call is open or malformed")
        calls = [self.call_from(m.group("name").strip(), m.group("arguments")) for m in matches]
        return ExtractedToolCalls(content_of(text[:start]), calls)

    def call_from(self, name: str, arguments: str) -> tuple[str, str]:
        if not name:
            raise ValueError("a tool call needs a name")
        return name, arguments_json(arguments.strip())
