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

from kvserve.services.api.parsers.tool_base import MarkedCallsParser, typed_value

_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderToolParser(MarkedCallsParser):
    marker = "<tool_call>"
    call_begin = "<tool_call>"
    # One <function=NAME> per call, nothing else around it.
    call_pattern = re.compile(
        r"<tool_call>\s*<function=(?P<name>[^>\n]+)>(?P<arguments>.*?)</function>\s*</tool_call>",
        re.DOTALL,
    )

    def call_from(self, name: str, body: str) -> tuple[str, str]:
        properties = self.parameters_of(name)
        arguments = {}
        for key, raw in _PARAMETER.findall(body):
            key = key.strip()
            arguments[key] = typed_value(_strip_newline(raw), properties.get(key))
        return name, json.dumps(arguments, ensure_ascii=False)


def _strip_newline(raw: str) -> str:
    """The template puts the value on its own line: one newline either side is markup."""
    return raw.removeprefix("\n").removesuffix("\n")
