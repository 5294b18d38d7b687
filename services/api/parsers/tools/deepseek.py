"""DeepSeek's tool calls, after <｜tool▁calls▁begin｜>, as their chat templates write them:

deepseek_v3 (V3, V3-0324, R1-0528):
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Tokyo"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
deepseek_v31 (V3.1, V3.2):
        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Tokyo"}
        <｜tool▁call▁end｜><｜tool▁calls▁end｜>      (one line: cut here to fit the page)
"""

from __future__ import annotations

import re

from kvserve.services.api.parsers.tool_base import MarkedCallsParser

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"


class DeepSeekV3ToolParser(MarkedCallsParser):
    marker = CALLS_BEGIN
    call_begin = CALL_BEGIN
    call_pattern = re.compile(
        r"<｜tool▁call▁begin｜>[^<]*?<｜tool▁sep｜>(?P<name>[^\n<]*)\n```(?:json)?\n"
        r"(?P<arguments>.*?)\n```\s*<｜tool▁call▁end｜>",
        re.DOTALL,
    )


class DeepSeekV31ToolParser(MarkedCallsParser):
    marker = CALLS_BEGIN
    call_begin = CALL_BEGIN
    call_pattern = re.compile(
        r"<｜tool▁call▁begin｜>(?P<name>[^<]*?)<｜tool▁sep｜>(?P<arguments>.*?)<｜tool▁call▁end｜>",
        re.DOTALL,
    )
