"""Tool-call parsers for tool_choice "auto": find the tool calls in a model's free text.

One parser per way models write calls, named as vLLM names them (--tool-call-parser); the
three oldest sit here, every other family in its own file under tools/:

    hermes           text <tool_call>{"name": "f", "arguments": {...}}</tool_call> ...
    llama3_json      [<|python_tag|>]{"name": "f", "parameters": {...}}; {...}
    pythonic         [f(a=1, b="x"), g()]
    llama4_pythonic  [<|python_start|>][f(a=1)][<|python_end|>]          tools/llama4.py
    mistral          [TOOL_CALLS]f[ARGS]{...} or [TOOL_CALLS][{...}]      tools/mistral.py
    qwen3_coder      <tool_call><function=f><parameter=a>1</parameter>... tools/qwen3_coder.py
                     (alias qwen3_xml)
    deepseek_v3      <｜tool▁calls▁begin｜>...<｜tool▁sep｜>f ```json   tools/deepseek.py
    deepseek_v31     <｜tool▁calls▁begin｜>...f<｜tool▁sep｜>{...}      tools/deepseek.py
    kimi_k2          <|tool_calls_section_begin|>...functions.f:0...      tools/kimi_k2.py
    glm45            <tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>   tools/glm45.py
    openai           gpt-oss's harmony (parsed by token ids: services/api/harmony/)

The base class and its helpers are in tool_base.py, the registry in tool_registry.py.
"""

from __future__ import annotations

import ast
import json
import re

from kvserve.services.api.parsers.tool_base import (
    ExtractedToolCalls,
    ToolParser,
    call_of,
    content_of,
)


class HermesToolParser(ToolParser):
    marker = "<tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def _extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(self.marker)
        if start < 0:
            return ExtractedToolCalls(content_of(text))
        calls = [
            call_of(json.loads(body), ("arguments", "parameters"))
            for body in self._CALL.findall(text[start:])
            if body.strip()
        ]
        if not calls:
            raise ValueError("empty tool call")
        return ExtractedToolCalls(content_of(text[:start]), calls)


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
            return ExtractedToolCalls(content_of(text))
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            obj, end = decoder.raw_decode(body, position)
            calls.append(call_of(obj, ("parameters", "arguments")))
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
            return ExtractedToolCalls(content_of(text))
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
