"""Streamed chat replies assembled the way OpenAI clients do it (content and tool calls)."""

from __future__ import annotations

import openai


class _Message:
    def __init__(self, content, tool_calls):
        self.content, self.tool_calls = content, tool_calls


def collect_stream(chunks):
    """A streamed choice as OpenAI clients assemble it: content, and tool calls from their
    deltas (the first carries id and name, the rest append arguments)."""
    content, calls, finish_reason = None, {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        if delta.content:
            content = (content or "") + delta.content
        for part in delta.tool_calls or []:
            if part.index not in calls:
                assert part.id and part.type == "function" and part.function.name
                calls[part.index] = openai.types.chat.ChatCompletionMessageToolCall(
                    id=part.id,
                    type="function",
                    function={"name": part.function.name, "arguments": ""},
                )
            calls[part.index].function.arguments += part.function.arguments or ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return _Message(content, [calls[i] for i in sorted(calls)]), finish_reason
