"""gpt-oss's harmony output as an OpenAI chat choice: analysis → reasoning, commentary
`to=functions.NAME` → tool calls, final (and commentary preambles) → content; whole
(`result`) or as stream deltas (`update`), the same interface as the other formats'
ChoiceParser (services/api/surfaces/choice_output.py).

A call that never closed, whose arguments are not a JSON object, or that names a function
the request did not offer comes back as content; with tool_choice "none" every call does.
"""

from __future__ import annotations

import json

from kvserve.services.api.harmony.stream import HarmonyEvent, HarmonyStream
from kvserve.services.api.parsers.tool_calls import new_tool_call_id
from kvserve.services.api.serving.protocol import (
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)

_NAMESPACE = "functions."


class HarmonyOutput:
    """One choice of a harmony-speaking model.

    Args:
        choice: the resolved tool_choice ("auto" or "none": the other choices prefill the
            call's header and read the arguments as text).
        tools: the request's tools (a call to another function is content).
        parallel: parallel_tool_calls; False keeps the first call only.
    """

    def __init__(self, choice: str, tools: list[ChatTool] | None, parallel: bool = True):
        self.calls_allowed = choice != "none"
        self.tool_names = {tool.function.name for tool in tools or ()}
        self.max_calls = None if parallel else 1
        self.stream = HarmonyStream()
        self.num_calls = 0

    def result(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, tool calls) of a whole output."""
        reasoning, content, deltas = self._apply(HarmonyStream().parse(text))
        calls = [_whole_call(delta) for delta in deltas]
        return reasoning or None, content or None, calls

    def update(self, delta: str, finished: bool) -> tuple[str, str | None, list[DeltaToolCall]]:
        """(reasoning, content, tool-call deltas) the next text delta adds."""
        reasoning, content, deltas = self._apply(self.stream.feed(delta, finished))
        return reasoning, content or None, deltas

    def _apply(self, events: list[HarmonyEvent]) -> tuple[str, str, list[DeltaToolCall]]:
        reasoning, content, deltas = "", "", []
        for event in events:
            if event.kind == "reasoning":
                reasoning += event.text
            elif event.kind == "call" and self._takes(event):
                deltas.append(self._call_delta(event))
            elif event.kind != "call" or not self._dropped(event):
                content += event.text
        return reasoning, content, deltas

    def _takes(self, event: HarmonyEvent) -> bool:
        """Whether a closed call becomes a tool call (else its arguments are content)."""
        name = event.name.removeprefix(_NAMESPACE)
        if not (self.calls_allowed and event.name.startswith(_NAMESPACE)):
            return False
        if name not in self.tool_names or not _is_json_object(event.text):
            return False
        return self.max_calls is None or self.num_calls < self.max_calls

    def _dropped(self, event: HarmonyEvent) -> bool:
        """A well-formed call past the parallel_tool_calls=False limit is dropped, not text."""
        return (
            self.max_calls is not None
            and self.num_calls >= self.max_calls
            and (_is_json_object(event.text))
        )

    def _call_delta(self, event: HarmonyEvent) -> DeltaToolCall:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        function = DeltaFunctionCall(
            name=event.name.removeprefix(_NAMESPACE), arguments=event.text.strip()
        )
        return DeltaToolCall(index, new_tool_call_id(), "function", function)

    def finish_reason(self, engine_reason: str | None, num_calls: int) -> str | None:
        """tool_calls when the output stopped (at <|call|>) with calls in it."""
        return "tool_calls" if engine_reason == "stop" and num_calls else engine_reason


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _whole_call(delta: DeltaToolCall) -> ToolCall:
    """A call this class sent whole as one delta, as the non-streamed tool call."""
    function = delta.function
    assert function is not None, "_call_delta always names the function"
    arguments = FunctionCall(name=function.name or "", arguments=function.arguments or "")
    return ToolCall(id=delta.id or new_tool_call_id(), function=arguments)
