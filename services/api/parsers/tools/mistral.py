"""Mistral's tool calls (--tool-call-parser mistral), after the [TOOL_CALLS] control token.

Two generations of the format, both read:

    tokenizer v11+ (Mistral Small 3.2, Magistral, Devstral), one marker per call:
        [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}
      (some write the call's id too: [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{...})
    older tokenizers (Mistral 7B v0.3, Nemo, Small 3.1), one JSON array:
        [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

[TOOL_CALLS], [ARGS] and [CALL_ID] are special tokens, kept in the text for this parser.
"""

from __future__ import annotations

import json

from kvserve.services.api.parsers.tool_base import (
    ExtractedToolCalls,
    ToolParser,
    arguments_json,
    call_of,
    content_of,
)

_ARGS = "[ARGS]"
_CALL_ID = "[CALL_ID]"


class MistralToolParser(ToolParser):
    marker = "[TOOL_CALLS]"
    needs_special_tokens = True

    def _extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(self.marker)
        if start < 0:
            return ExtractedToolCalls(content_of(text))
        body = text[start + len(self.marker) :]
        if body.lstrip().startswith(("[", "{")):
            calls = _json_calls(body.strip())
        else:
            calls = [_named_call(part) for part in body.split(self.marker)]
        if not calls:
            raise ValueError("no tool call after [TOOL_CALLS]")
        return ExtractedToolCalls(content_of(text[:start]), calls)


def _named_call(part: str) -> tuple[str, str]:
    """One v11 call: name[ARGS]{...} (or name[CALL_ID]id[ARGS]{...})."""
    head, separator, arguments = part.partition(_ARGS)
    if not separator:
        raise ValueError("a [TOOL_CALLS] call without [ARGS]")
    name = head.partition(_CALL_ID)[0].strip()
    if not name:
        raise ValueError("a tool call needs a name")
    return name, arguments_json(arguments.strip())


def _json_calls(body: str) -> list[tuple[str, str]]:
    """The older JSON form: an array of calls (or one object), nothing after it."""
    parsed, end = json.JSONDecoder().raw_decode(body)
    if body[end:].strip():
        raise ValueError("text after the tool-call array")
    calls = parsed if isinstance(parsed, list) else [parsed]
    return [call_of(call, ("arguments", "parameters")) for call in calls]
