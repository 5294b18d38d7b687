"""GLM-4.5's tool calls (--tool-call-parser glm45), as its chat template writes them:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Beijing</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The template writes strings bare and everything else as JSON; the function's schema says
which (vLLM's glm45 parser reads them the same way).
"""

from __future__ import annotations

import json
import re

from kvserve.services.api.parsers.tool_base import MarkedCallsParser, typed_value

_ARGUMENT = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)


class Glm45ToolParser(MarkedCallsParser):
    marker = "<tool_call>"
    call_begin = "<tool_call>"
    call_pattern = re.compile(
        r"<tool_call>(?P<name>[^<\n]*)(?P<arguments>.*?)</tool_call>", re.DOTALL
    )

    def call_from(self, name: str, body: str) -> tuple[str, str]:
        if not name:
            raise ValueError("a tool call needs a name")
        properties = self.parameters_of(name)
        arguments, position = {}, 0
        for match in _ARGUMENT.finditer(body):
            if body[position : match.start()].strip():
                raise ValueError("text between a call's arguments")
            key = match.group(1).strip()
            arguments[key] = typed_value(match.group(2), properties.get(key))
            position = match.end()
        if body[position:].strip():
            raise ValueError("text after a call's arguments")
        return name, json.dumps(arguments, ensure_ascii=False)
