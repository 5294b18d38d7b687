"""A chat request's messages as the chat template takes them, and the images they carry
(surfaces/chat.py templates and submits them)."""

from __future__ import annotations

import json
from typing import Any

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.protocol import ChatMessage


def image_urls_of(messages: list[ChatMessage]) -> list[str]:
    """The URLs of the conversation's `image_url` parts, in prompt order."""
    urls = []
    for message in messages:
        if isinstance(message.content, list):
            for part in message.content:
                if part.type == "image_url":
                    if part.image_url is None:
                        raise APIError(400, "an image_url part needs image_url.url", "messages")
                    urls.append(part.image_url.url)
    return urls


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template takes them; text parts are joined with newlines, and
    tool-call arguments are objects (what templates render with `tojson`), as in vLLM. A
    message with images keeps its parts as a list ({"type": "image"} for each image), which
    a vision model's template renders as its image placeholder."""
    conversation = []
    for message in messages:
        content: Any = message.content
        if isinstance(content, list):
            if any(
                part.type not in ("text", "image_url")
                or (part.type == "text" and part.text is None)
                for part in content
            ):
                raise APIError(
                    400,
                    "only text and image_url content parts are supported "
                    "({'type': 'text', 'text': ...}, {'type': 'image_url', 'image_url': ...})",
                    param="messages",
                )
            if any(part.type == "image_url" for part in content):
                content = [
                    {"type": "image"}
                    if part.type == "image_url"
                    else {"type": "text", "text": part.text}
                    for part in content
                ]
            else:
                content = "\n".join(part.text or "" for part in content)  # no None: checked
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": call.type,
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments_object(call.function.arguments),
                    },
                }
                for call in message.tool_calls
            ]
        conversation.append(entry)
    return conversation


def _arguments_object(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: the template gets the text
