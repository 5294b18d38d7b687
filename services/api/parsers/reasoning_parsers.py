"""Reasoning parsers (--reasoning-parser): the model's thinking split from its answer.

A thinking model writes its reasoning between tags before the answer. A parser names the tags
and decides, from the request, whether the reply starts inside them; `ReasoningSplitter` then
cuts one reply's text (whole, or delta by delta while it streams) into reasoning and content:

    deepseek_r1   DeepSeek-R1 and its distills: every reply starts thinking (the template
                  opens <think> in the prompt; a <think> the model repeats is dropped); the
                  reasoning ends at </think>. A reply cut before </think> is all reasoning.
    qwen3         Qwen3: the same tags; the reply starts thinking unless the request turned
                  thinking off (chat_template_kwargs {"enable_thinking": false}, which makes the
                  template close an empty think block in the prompt).

    deepseek_v3   DeepSeek V3.1/V3.2: the same tags, thinking only when the request asks
                  (chat_template_kwargs {"thinking": true}).            reasoning/deepseek_v3.py
    glm45         GLM-4.5/4.6: <think>...</think> when the reply opens it (off with
                  enable_thinking false).                               reasoning/glm45.py
    kimi_k2       Kimi K2 (Thinking): thinking unless turned off; a tool-call section also
                  ends it.                                              reasoning/kimi_k2.py
    mistral       Magistral: [THINK]...[/THINK] when the reply opens it.  reasoning/mistral.py
    openai_gptoss gpt-oss: the harmony analysis channel (parsed by token ids, in
                  services/api/harmony/; not a tag splitter).

The end tag, tokenized, is what the engine watches (SamplingParams.reasoning_end_token_ids):
structured outputs constrain what follows it, and a thinking budget forces it. Tool calls are
parsed from the content only.

How to add one: a `ReasoningParser` subclass with its tags and `starts_thinking`, in a file
of its own under reasoning/, registered in reasoning_registry.py under its --reasoning-parser
name (and in shared/config.py's REASONING_PARSER_NAMES).
"""

from __future__ import annotations

from typing import Any, ClassVar


class ReasoningParser:
    """One family's thinking markup."""

    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # The reply thinks only when it opens with the start tag (the model writes it): a reply
    # that does not is all content.
    requires_start: ClassVar[bool] = False
    # Markers that end the thinking too, kept in the content (a tool-call section).
    implicit_ends: ClassVar[tuple[str, ...]] = ()
    # The tags are special tokens, kept in the text only when the detokenizer keeps them.
    needs_special_tokens: ClassVar[bool] = False

    def starts_thinking(self, chat_template_kwargs: dict[str, Any]) -> bool:
        """Whether a reply to a request templated with these kwargs begins thinking."""
        return True


class DeepSeekR1ReasoningParser(ReasoningParser):
    pass


class Qwen3ReasoningParser(ReasoningParser):
    def starts_thinking(self, chat_template_kwargs: dict[str, Any]) -> bool:
        return chat_template_kwargs.get("enable_thinking") is not False


class ReasoningSplitter:
    """One reply's text as (reasoning, content), fed whole or delta by delta.

    While a tag may still be completing, its first characters are held back (a delta ending
    in "</thi" sends nothing of that yet), so the streamed pieces always add up to the whole
    split.
    """

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.thinking = True
        self.at_start = True  # nothing of the reasoning seen yet: a leading start tag drops
        self.after_end = False  # the newlines right after the end tag drop too
        self._held = ""

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of this delta; `final`: the reply ended, flush what is held."""
        text = self._held + delta
        self._held = ""
        if not self.thinking:
            return "", self._content(text)
        if self.at_start:
            stripped, start = text.lstrip(), self.parser.start
            if not final and (not stripped or (start.startswith(stripped) and stripped != start)):
                self._held = text  # blank so far, or perhaps a start tag on its way
                return "", ""
            self.at_start = False
            if stripped.startswith(start):
                text = stripped[len(start) :]
            elif self.parser.requires_start:
                self.thinking = False
                return "", text
        return self._thinking(text, final)

    def _thinking(self, text: str, final: bool) -> tuple[str, str]:
        end = self.parser.end
        cut = text.find(end)
        implicit = [i for i in (text.find(m) for m in self.parser.implicit_ends) if i >= 0]
        if implicit and (cut < 0 or min(implicit) < cut):
            self.thinking = False  # the marker begins the content
            return text[: min(implicit)], text[min(implicit) :]
        if cut >= 0:
            self.thinking, self.after_end = False, True
            return text[:cut], self._content(text[cut + len(end) :])
        if not final:
            keep = max(_partial_suffix(text, tag) for tag in (end, *self.parser.implicit_ends))
            if keep:
                text, self._held = text[:-keep], text[-keep:]
        return text, ""

    def _content(self, text: str) -> str:
        if self.after_end:
            text = text.lstrip("\n")
            self.after_end = not text
        return text

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole reply: (reasoning or None, content or None)."""
        reasoning, content = self.feed(text, final=True)
        return reasoning or None, content or None


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0: none)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
