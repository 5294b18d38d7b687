"""Tool calling for chat: `tools` and `tool_choice` in, OpenAI tool calls out.

    tool_choice   the model's output                     constrained by
    none          text                                   -
    auto          text, maybe with calls (--tool-call-parser reads them)   -
    required      [{"name": ..., "parameters": {...}}, ...]    a JSON schema over the tools
    named f       f's arguments                          f's parameters schema

`required` and a named function are enforced by a grammar (structured outputs), so their
arguments always parse and match the function's schema. `ToolCallOutput` turns a choice's
text into content and tool calls, whole (`result`) or as stream deltas (`update`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from kvserve.services.api.parsers.tool_base import ToolParser
from kvserve.services.api.parsers.tool_registry import TOOL_PARSERS
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.protocol import (
    ChatCompletionRequest,
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from kvserve.shared.api_config import FrontendConfig
from kvserve.shared.structured_outputs import StructuredOutputsParams

_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def tool_schemas(tools: list[ChatTool] | None) -> dict[str, dict[str, Any]] | None:
    """name → parameters schema of the request's functions (None: no tools given)."""
    if tools is None:
        return None
    return {tool.function.name: tool.function.parameters or _NO_PARAMETERS for tool in tools}


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def resolve_tool_choice(request: ChatCompletionRequest, frontend: FrontendConfig) -> str:
    """ "none", "auto", "required", or the name of the function the model must call.

    Raises:
        APIError: a choice without tools, an unknown function, or "auto" on a server
            started without --enable-auto-tool-choice.
    """
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none"):
            raise APIError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
        return "none"
    if choice is None:
        choice = "auto"
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {tool.function.name for tool in request.tools}:
            raise APIError(
                400,
                f"tool_choice names function {name!r}, which `tools` does not define",
                "tool_choice",
            )
        return name
    if choice == "auto" and not (frontend.enable_auto_tool_choice and frontend.tool_call_parser):
        raise APIError(
            400,
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
            'set (or send tool_choice "none", "required" or a named function)',
            "tool_choice",
        )
    if choice not in ("none", "auto", "required"):
        raise APIError(
            400,
            f'tool_choice {choice!r} is not one of "none", "auto", "required" or a named function',
            "tool_choice",
        )
    return choice


def tools_for_template(request: ChatCompletionRequest, choice: str, frontend: FrontendConfig):
    """The tools as the chat template takes them (OpenAI's dicts), or None."""
    if not request.tools or (choice == "none" and frontend.exclude_tools_when_tool_choice_none):
        return None
    return [_without_nulls(msgspec.to_builtins(tool)) for tool in request.tools]


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


def tool_constraint(request: ChatCompletionRequest, choice: str) -> StructuredOutputsParams | None:
    """The grammar that enforces `required` or a named function; None for none and auto."""
    tools = request.tools or []
    if choice in ("none", "auto"):
        return None
    if choice != "required":
        tool = next(t for t in tools if t.function.name == choice)
        return StructuredOutputsParams(json=tool.function.parameters or _NO_PARAMETERS)
    return StructuredOutputsParams(json=required_calls_schema(tools, request.parallel_tool_calls))


def required_calls_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """A JSON array of {"name": one of the tools, "parameters": its arguments}, at least one
    (exactly one without parallel tool calls). Each tool's $defs move to the top, where
    its "#/$defs/..." references point."""
    defs: dict[str, Any] = {}
    branches = []
    for tool in tools:
        parameters = dict(tool.function.parameters or _NO_PARAMETERS)
        for key in ("$defs", "definitions"):
            for name, definition in parameters.pop(key, {}).items():
                if defs.setdefault(key, {}).setdefault(name, definition) != definition:
                    raise APIError(
                        400, f"tools define {key} {name!r} twice, differently", param="tools"
                    )
        branches.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    return schema | defs


class _ArrayScanner:
    """Finds the complete elements of a growing JSON array text, one pass over each char."""

    def __init__(self):
        self.position = 0
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.element_start: int | None = None

    def feed(self, text: str) -> list[str]:
        elements = []
        for index in range(self.position, len(text)):
            char = text[index]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                continue
            if char == '"':
                self.in_string = True
            elif char in "[{":
                self.depth += 1
                if self.depth == 2 and self.element_start is None:
                    self.element_start = index
            elif char in "]}":
                self.depth -= 1
                if self.depth == 1 and self.element_start is not None:
                    elements.append(text[self.element_start : index + 1])
                    self.element_start = None
        self.position = len(text)
        return elements


class ToolCallOutput:
    """One choice's text as content and tool calls.

    Args:
        choice: the resolved tool_choice.
        parser_name: --tool-call-parser (for "auto").
        parallel: parallel_tool_calls; False keeps an "auto" output's first call only (the
            grammar of "required" allows one call then).
        tools: the request's tools: an "auto" call naming another function is content, and
            their schemas type the values of formats that write them bare (qwen3_coder).
    """

    def __init__(
        self,
        choice: str,
        parser_name: str | None = None,
        parallel: bool = True,
        tools: list[ChatTool] | None = None,
    ):
        self.choice = choice
        self.max_calls = None if parallel else 1
        self.parser: ToolParser | None = None
        if choice == "auto":
            assert parser_name is not None, "resolve_tool_choice checked the parser is set"
            self.parser = TOOL_PARSERS[parser_name](tool_schemas(tools))
        self.text = ""
        self.num_sent_chars = 0  # content streamed so far
        self.num_calls = 0
        self.in_calls = False
        self.named_id: str | None = None
        self.scanner = _ArrayScanner()

    @property
    def uses_tools(self) -> bool:
        return self.choice != "none"

    def result(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a whole output."""
        if self.choice == "none":
            return text, []
        if self.choice == "required":
            parsed = [self._required_call(e) for e in _ArrayScanner().feed(text)]
            return None, [c for c in parsed if c is not None]
        if self.parser is None:  # a named function: the text is its arguments
            return None, [
                ToolCall(
                    id=new_tool_call_id(), function=FunctionCall(name=self.choice, arguments=text)
                )
            ]
        extracted = self.parser.extract(text)
        calls = [
            ToolCall(id=new_tool_call_id(), function=FunctionCall(name=name, arguments=arguments))
            for name, arguments in extracted.calls[: self.max_calls]
        ]
        return extracted.content, calls

    def update(self, delta: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        """(content delta, tool-call deltas) for the stream, given the next text delta."""
        self.text += delta
        if self.choice == "none":
            return delta or None, []
        if self.choice == "required":
            calls = [self._required_call(e) for e in self.scanner.feed(self.text)]
            return None, [self._whole_delta(c) for c in calls if c is not None]
        if self.parser is None:
            return None, self._named_delta(delta)
        return self._auto_update(finished)

    def _named_delta(self, delta: str) -> list[DeltaToolCall]:
        if self.named_id is None:
            self.named_id = new_tool_call_id()
            self.num_calls = 1
            function = DeltaFunctionCall(name=self.choice, arguments=delta)
            return [DeltaToolCall(0, self.named_id, "function", function)]
        if not delta:
            return []
        return [DeltaToolCall(0, function=DeltaFunctionCall(arguments=delta))]

    def _auto_update(self, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        parser = self.parser
        assert parser is not None
        if not self.in_calls and parser.start_index(self.text) is not None:
            self.in_calls = True
        calls: list[DeltaToolCall] = []
        if not self.in_calls:
            # Trailing whitespace waits too: before a call it would not be content.
            held = 0 if finished else parser.holdback(self.text)
            content_end = (
                len(self.text[: len(self.text) - held].rstrip()) if not finished else len(self.text)
            )
        else:
            content_end = parser.start_index(self.text) or 0
            if not self.text[:content_end].strip():
                content_end = self.num_sent_chars
            if finished:
                extracted = parser.extract(self.text)
                if not extracted.calls:
                    content_end = len(self.text)  # not calls after all: all of it is content
                for name, arguments in extracted.calls[: self.max_calls]:
                    call = ToolCall(
                        id=new_tool_call_id(), function=FunctionCall(name=name, arguments=arguments)
                    )
                    calls.append(self._whole_delta(call))
        content = self.text[self.num_sent_chars : content_end]
        self.num_sent_chars = max(self.num_sent_chars, content_end)
        return content or None, calls

    def _required_call(self, element: str) -> ToolCall | None:
        try:
            call = json.loads(element)
        except ValueError:
            return None  # the grammar makes this impossible; a cut-off output ends early
        arguments = json.dumps(call.get("parameters", {}), ensure_ascii=False)
        return ToolCall(
            id=new_tool_call_id(), function=FunctionCall(name=call["name"], arguments=arguments)
        )

    def _whole_delta(self, call: ToolCall) -> DeltaToolCall:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        function = DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments)
        return DeltaToolCall(index, call.id, "function", function)

    def finish_reason(self, engine_reason: str | None, num_calls: int) -> str | None:
        """OpenAI's tool_calls when the output ended normally with calls in it, but "stop"
        for a named tool_choice, as OpenAI and vLLM answer it."""
        named = self.choice not in ("auto", "required", "none")
        if engine_reason == "stop" and num_calls and not named:
            return "tool_calls"
        return engine_reason
