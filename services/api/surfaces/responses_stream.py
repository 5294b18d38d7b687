"""The Responses stream's events (responses.py streams them): numbered server-sent events, and
the output items they build from the chat's deltas.

    a reasoning item   response.output_item.added, response.reasoning_text.delta...,
                       response.reasoning_text.done, response.output_item.done
    a message          response.output_item.added, response.content_part.added,
                       response.output_text.delta..., response.output_text.done,
                       response.content_part.done, response.output_item.done
    a function call    response.output_item.added, response.function_call_arguments.delta...,
                       response.function_call_arguments.done, response.output_item.done

An item of another kind closes the open ones before it (a message closes the reasoning and
the calls, a call the reasoning and the message); the last step closes all.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import msgspec

from kvserve.services.api.serving.protocol import DeltaToolCall
from kvserve.services.api.surfaces.chat import ChatDelta
from kvserve.services.api.surfaces.responses_protocol import (
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class EventWriter:
    """Server-sent events of the Responses stream, numbered in order."""

    def __init__(self):
        self.sequence_number = 0

    def send(self, event_type: str, /, **fields: Any) -> bytes:
        body = {"type": event_type, "sequence_number": self.sequence_number} | fields
        self.sequence_number += 1
        data = msgspec.json.encode(body)
        return b"event: " + event_type.encode() + b"\ndata: " + data + b"\n\n"


class OutputWriter:
    """The output items of one Responses stream, and the events that build them.

    Each event is encoded as it is made, so an item's state at that moment is what it
    carries (an item is announced before its text grows).

    Args:
        events: the stream's numbered events.
        output: the response's output items, which this appends to and updates.
    """

    def __init__(self, events: EventWriter, output: list[OutputItem]):
        self.events = events
        self.output = output
        self.call_by_index: dict[int, int] = {}  # the parser's call index -> output index

    def step_events(self, step: ChatDelta) -> Iterator[bytes]:
        """The events of one step of the chat: its reasoning, text and tool-call pieces."""
        if step.reasoning:
            yield from self._reasoning_events(step.reasoning)
        if step.content:
            yield from self._text_events(step.content)
        for call in step.tool_deltas:
            yield from self._call_events(call)

    def finish_events(self) -> Iterator[bytes]:
        """Close every open item; with nothing said, one empty message, as a whole response
        has."""
        yield from self._close_reasoning() + self._close_text() + self._close_calls()
        if any(isinstance(item, MessageItem | FunctionCallItem) for item in self.output):
            return
        item = MessageItem(new_id("msg"), [OutputText("")])
        index = len(self.output)
        yield self.events.send("response.output_item.added", output_index=index, item=item)
        self.output.append(item)
        yield self.events.send("response.output_item.done", output_index=index, item=item)

    def _reasoning_events(self, reasoning: str) -> Iterator[bytes]:
        output, events = self.output, self.events
        item = output[-1] if output else None
        if not isinstance(item, ReasoningItem):
            item = ReasoningItem(new_id("rs"), [ReasoningText("")], status="in_progress")
            output.append(item)
            yield events.send(
                "response.output_item.added",
                output_index=len(output) - 1,
                item=msgspec.structs.replace(item, content=[]),
            )
        item.content[0].text += reasoning
        yield events.send(
            "response.reasoning_text.delta",
            item_id=item.id,
            output_index=len(output) - 1,
            content_index=0,
            delta=reasoning,
        )

    def _text_events(self, content: str) -> Iterator[bytes]:
        output, events = self.output, self.events
        item = output[-1] if output else None
        if not isinstance(item, MessageItem) or item.status == "completed":
            yield from self._close_reasoning() + self._close_calls()
            item = MessageItem(new_id("msg"), [], status="in_progress")
            output.append(item)
            index = len(output) - 1
            yield events.send("response.output_item.added", output_index=index, item=item)
            item.content.append(OutputText(""))
            yield events.send(
                "response.content_part.added",
                item_id=item.id,
                output_index=index,
                content_index=0,
                part=OutputText(""),
            )
        item.content[0].text += content
        yield events.send(
            "response.output_text.delta",
            item_id=item.id,
            output_index=len(output) - 1,
            content_index=0,
            delta=content,
            logprobs=[],
        )

    def _call_events(self, call: DeltaToolCall) -> Iterator[bytes]:
        output, events = self.output, self.events
        function = call.function
        if call.index not in self.call_by_index:  # a new call
            yield from self._close_reasoning() + self._close_text()
            name = function.name if function is not None and function.name else ""
            added = FunctionCallItem(
                new_id("fc"), call.id or new_id("call"), name, "", "in_progress"
            )
            output.append(added)
            self.call_by_index[call.index] = len(output) - 1
            yield events.send(
                "response.output_item.added",
                output_index=len(output) - 1,
                item=msgspec.structs.replace(added),
            )
        index = self.call_by_index[call.index]
        item = output[index]
        assert isinstance(item, FunctionCallItem)
        if function is not None and function.arguments:
            item.arguments += function.arguments
            yield events.send(
                "response.function_call_arguments.delta",
                item_id=item.id,
                output_index=index,
                delta=function.arguments,
            )

    def _close_reasoning(self) -> list[bytes]:
        output, events = self.output, self.events
        item = output[-1] if output else None
        if not isinstance(item, ReasoningItem) or item.status == "completed":
            return []
        item.status = "completed"
        index = len(output) - 1
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        text = item.content[0].text
        return [
            events.send("response.reasoning_text.done", **where, text=text),
            events.send("response.output_item.done", output_index=index, item=item),
        ]

    def _close_text(self) -> list[bytes]:
        output, events = self.output, self.events
        item = output[-1] if output else None
        if not isinstance(item, MessageItem) or item.status == "completed":
            return []
        item.status = "completed"
        index, part = len(output) - 1, item.content[0]
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        return [
            events.send("response.output_text.done", **where, text=part.text, logprobs=[]),
            events.send("response.content_part.done", **where, part=part),
            events.send("response.output_item.done", output_index=index, item=item),
        ]

    def _close_calls(self) -> list[bytes]:
        sent = []
        for index in self.call_by_index.values():
            item = self.output[index]
            assert isinstance(item, FunctionCallItem)
            if item.status == "completed":
                continue
            item.status = "completed"
            where = {"item_id": item.id, "output_index": index}
            sent += [
                self.events.send(
                    "response.function_call_arguments.done",
                    **where,
                    name=item.name,
                    arguments=item.arguments,
                ),
                self.events.send("response.output_item.done", output_index=index, item=item),
            ]
        return sent
