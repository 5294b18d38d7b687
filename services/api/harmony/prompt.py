"""A chat request's harmony prompt as token ids of the model's own tokenizer, and the ids
the engine must know: <|call|> and <|return|> stop generation (an assistant action ends
there), and `<|channel|>final<|message|>` ends the thinking (structured outputs constrain
what follows it; a thinking budget forces it)."""

from __future__ import annotations

from typing import Any

from kvserve.services.api.harmony.render import render_conversation
from kvserve.services.api.serving.protocol import ChatCompletionRequest
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)

SPECIAL_TOKENS = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)
FINAL_HEADER = "<|channel|>final<|message|>"


class HarmonyPrompt:
    """Renders and tokenizes harmony conversations with the model's tokenizer.

    Args:
        tokenizer: the model's Hugging Face tokenizer (gpt-oss's holds the special tokens).
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
        missing = [t for t, i in ids.items() if i is None or i == tokenizer.unk_token_id]
        if missing:
            logger.warning(
                "harmony: the tokenizer lacks %s; those markers are tokenized as text",
                ", ".join(missing),
            )
        self.stop_token_ids = [
            ids[t] for t in ("<|return|>", "<|call|>") if t not in missing and ids[t] is not None
        ]
        self.final_header_ids = self.encode(FINAL_HEADER)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def token_ids(
        self, request: ChatCompletionRequest, messages: list[dict[str, Any]], tool_choice: str
    ) -> list[int]:
        """The prompt: the conversation, then for a required or named tool_choice the
        header of the call the grammar then writes the arguments of.

        Raises:
            ValueError: a reasoning_effort harmony does not know.
        """
        for message, chat_message in zip(messages, request.messages, strict=True):
            thought = chat_message.reasoning or chat_message.reasoning_content
            if thought:
                message["reasoning"] = thought
        tools = None
        if request.tools and tool_choice != "none":
            tools = [{"function": _function_dict(t.function)} for t in request.tools]
        text = render_conversation(
            messages, tools, request.reasoning_effort, prefill_for(tool_choice)
        )
        return self.encode(text)


def prefill_for(tool_choice: str) -> str:
    """The assistant header a constrained tool_choice starts from: a named function's call
    (the grammar writes its arguments), or the commentary channel for "required" (the
    grammar writes the calls array)."""
    if tool_choice in ("auto", "none"):
        return ""
    if tool_choice == "required":
        return "<|channel|>commentary<|message|>"
    return f"<|channel|>commentary to=functions.{tool_choice} <|constrain|>json<|message|>"


def _function_dict(function: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": function.name, "parameters": function.parameters}
    if function.description:
        entry["description"] = function.description
    return entry
