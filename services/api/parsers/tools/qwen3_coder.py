"""Qwen3-Coder's XML tool calls (--tool-call-parser qwen3_coder, alias qwen3_xml), as its
chat template writes them:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Every value is bare text; the function's JSON schema types it (days: integer → 3), as
vLLM's parser does.
"""

from __future__ import annotations

import json
import re

from kvserve.services.api.parsers.tool_base import (
    ExtractedToolCalls,
    ToolParser,
    content_of,
    typed_value,
)

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderToolParser(ToolParser):
    marker = "<tool_call>"

    def _extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(self.marker)
        if start < 0:
            return ExtractedToolCalls(content_of(text))
        section = text[start:]
        bodies = _CALL.findall(section)
        if not bodies or len(bodies) != section.count(self.marker):
            raise ValueError("a tool call is open or malformed")
        return ExtractedToolCalls(content_of(text[:start]), [self._call(b) for b in bodies])

    def _call(self, body: str) -> tuple[str, str]:
        function = _FUNCTION.fullmatch(body)
        if function is None:
            raise ValueError("a <tool_call> without one <function=...>")
        name = function.group(1).strip()
        properties = self.parameters_of(name)
        arguments = {}
        for key, raw in _PARAMETER.findall(function.group(2)):
            key = key.strip()
            arguments[key] = typed_value(_strip_newline(raw), properties.get(key))
        return name, json.dumps(arguments, ensure_ascii=False)


def _strip_newline(raw: str) -> str:
    """The template puts the value on its own line: one newline either side is markup."""
    return raw.removeprefix("\n").removesuffix("\n")
