"""gpt-oss's output split by harmony channel, whole or delta by delta.

The prompt ends with `<|start|>assistant`, so the output opens with the first message's
header; each message is `header<|message|>body` closed by <|end|> (another message follows
after <|start|>), <|call|> (a tool call: generation stops) or <|return|> (the final answer:
generation stops):

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city":"Paris"}<|call|>

The text is the detokenized output with the special tokens kept, so each marker is the one
token the model wrote. A marker that may still be completing at the end of a delta is held
back, so streamed pieces always add up to the whole parse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
CHANNEL, CALL, RETURN = "<|channel|>", "<|call|>", "<|return|>"
# What closes a message body: its end, and (a message cut short) the next header's markers.
_CLOSERS = (END, CALL, RETURN, START, CHANNEL)
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


@dataclass(slots=True)
class HarmonyEvent:
    """One piece of the output: `kind` is "reasoning", "content" or "call" (text: the
    call's arguments, name: its recipient, "functions.f" → f; a call is whole)."""

    kind: str
    text: str
    name: str = ""


@dataclass(slots=True)
class _Header:
    channel: str
    recipient: str

    @property
    def kind(self) -> str:
        if self.recipient:
            return "call"
        return "reasoning" if self.channel == "analysis" else "content"


def parse_header(header: str) -> _Header:
    """channel and recipient of a message header (role, to=..., <|constrain|> in any order)."""
    channel = _CHANNEL_NAME.search(header)
    recipient = _RECIPIENT.search(header)
    return _Header(channel.group(1) if channel else "", recipient.group(1) if recipient else "")


class HarmonyStream:
    """The channels of one output, fed as text deltas (`feed`), or whole (`parse`)."""

    def __init__(self) -> None:
        self.buffer = ""
        self.header: _Header | None = None  # None: reading a header
        self.call_body = ""  # a tool call's arguments so far (sent whole when it closes)
        self.done = False  # <|call|> or <|return|> seen: the rest is not the answer

    def parse(self, text: str) -> list[HarmonyEvent]:
        return self.feed(text, final=True)

    def feed(self, delta: str, final: bool) -> list[HarmonyEvent]:
        """The events `delta` completes; `final`: the output ended (flush what is held)."""
        self.buffer += delta
        events: list[HarmonyEvent] = []
        while self.buffer and not self.done:
            progressed = (
                self._header_step(final) if self.header is None else self._body_step(events, final)
            )
            if not progressed:
                break
        if final:
            self._close_open(events)
        return [e for e in events if e.text or e.kind == "call"]

    def _header_step(self, final: bool) -> bool:
        cut = self.buffer.find(MESSAGE)
        if cut < 0:
            return False  # the header is not complete yet (or the output was cut in it)
        self.header = parse_header(self.buffer[:cut])
        self.buffer = self.buffer[cut + len(MESSAGE) :]
        return True

    def _body_step(self, events: list[HarmonyEvent], final: bool) -> bool:
        assert self.header is not None
        found = [(i, m) for m in _CLOSERS if (i := self.buffer.find(m)) >= 0]
        if not found:
            keep = 0 if final else _partial_marker(self.buffer)
            self._emit(events, self.buffer[: len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep :]
            return False
        cut, marker = min(found)
        self._emit(events, self.buffer[:cut])
        self._close(events, marker in (END, CALL, RETURN))
        # After <|end|> a new message's header follows; <|start|>/<|channel|> begin one.
        self.buffer = self.buffer[cut + len(marker) if marker == END else cut :]
        self.done = marker in (CALL, RETURN)
        return True

    def _emit(self, events: list[HarmonyEvent], text: str) -> None:
        assert self.header is not None
        if self.header.kind == "call":
            self.call_body += text
        elif text:
            events.append(HarmonyEvent(self.header.kind, text))

    def _close(self, events: list[HarmonyEvent], closed: bool) -> None:
        """The message ends; a call is sent whole (as content when it never closed)."""
        assert self.header is not None
        if self.header.kind == "call":
            kind = "call" if closed else "content"
            events.append(HarmonyEvent(kind, self.call_body, self.header.recipient))
        self.header, self.call_body = None, ""

    def _close_open(self, events: list[HarmonyEvent]) -> None:
        """The output ended inside a message (cut off): a call cut short is content; a header
        cut short is dropped, but text with no harmony markup at all (a model that ignored
        the format) is content, never lost."""
        if self.header is not None:
            self._close(events, closed=False)
        elif self.buffer and not self.done and "<|" not in self.buffer:
            events.append(HarmonyEvent("content", self.buffer))
        self.buffer = ""


def _partial_marker(text: str) -> int:
    """Characters at the end of text that may begin a closing marker."""
    start = text.rfind("<", max(0, len(text) - 12))
    if start < 0:
        return 0
    tail = text[start:]
    return len(tail) if any(m.startswith(tail) for m in _CLOSERS) else 0
