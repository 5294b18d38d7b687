"""A chat conversation rendered as harmony text, as gpt-oss's chat template renders it:

    <|start|>system<|message|>You are ChatGPT, ...\\nReasoning: medium\\n\\n# Valid channels:
        analysis, commentary, final. ...<|end|>
    <|start|>developer<|message|># Instructions\\n\\n{system prompt}\\n\\n# Tools\\n\\n
        ## functions\\n\\nnamespace functions {...}<|end|>            (with instructions or tools)
    <|start|>user<|message|>...<|end|>
    <|start|>assistant<|channel|>analysis<|message|>{chain of thought}<|end|>   (see below)
    <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{..}<|call|>
    <|start|>functions.f to=assistant<|channel|>commentary<|message|>{result}<|end|>
    <|start|>assistant<|channel|>final<|message|>...<|end|>
    <|start|>assistant                                              (the generation prompt)

History rules (harmony's): an assistant turn's chain of thought (its `reasoning` or
`reasoning_content`) is dropped once a final answer follows it, and kept while the turn is
still calling tools.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from kvserve.services.api.harmony.typescript import functions_namespace

IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
REASONING_EFFORTS = ("low", "medium", "high")


def render_conversation(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    reasoning_effort: str | None,
    prefill: str = "",
) -> str:
    """The prompt text for `messages` (OpenAI chat dicts, tool-call arguments as objects or
    text), ending with the assistant's generation prompt and `prefill`.

    Raises:
        ValueError: a reasoning_effort harmony does not know.
    """
    effort = reasoning_effort or "medium"
    if effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort {effort!r} is not one of {REASONING_EFFORTS}")
    instructions = [m for m in messages if m["role"] in ("system", "developer")]
    parts = [_system(effort, bool(tools))]
    developer = _developer(instructions, tools)
    if developer:
        parts.append(developer)
    conversation = [m for m in messages if m["role"] not in ("system", "developer")]
    keep_thoughts = _thoughts_kept(conversation)
    call_names: dict[str, str] = {}
    for index, message in enumerate(conversation):
        parts.append(_message(message, index in keep_thoughts, call_names))
    return "".join(parts) + "<|start|>assistant" + prefill


def _system(effort: str, has_tools: bool) -> str:
    lines = [
        IDENTITY,
        f"Knowledge cutoff: {KNOWLEDGE_CUTOFF}",
        f"Current date: {datetime.datetime.now(datetime.UTC).date().isoformat()}",
        "",
        f"Reasoning: {effort}",
        "",
        "# Valid channels: analysis, commentary, final. "
        "Channel must be included for every message.",
    ]
    if has_tools:
        lines.append("Calls to these tools must go to the commentary channel: 'functions'.")
    return _block("system", "\n".join(lines))


def _developer(instructions: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    sections = []
    text = "\n\n".join(_text(m.get("content")) for m in instructions if _text(m.get("content")))
    if text:
        sections.append(f"# Instructions\n\n{text}")
    if tools:
        sections.append(f"# Tools\n\n{functions_namespace(tools)}")
    return _block("developer", "\n\n".join(sections)) if sections else ""


def _thoughts_kept(conversation: list[dict[str, Any]]) -> set[int]:
    """Indices of the assistant messages whose chain of thought renders: those with no
    final answer (an assistant message with content and no calls) at or after them."""
    kept: set[int] = set()
    answered = False
    for index in range(len(conversation) - 1, -1, -1):
        message = conversation[index]
        if message["role"] != "assistant":
            continue
        if _text(message.get("content")) and not message.get("tool_calls"):
            answered = True  # a final answer: its own thought goes too
        if not answered:
            kept.add(index)
    return kept


def _message(message: dict[str, Any], keep_thought: bool, call_names: dict[str, str]) -> str:
    role = message["role"]
    if role == "assistant":
        return _assistant(message, keep_thought, call_names)
    if role == "tool":
        name = call_names.get(message.get("tool_call_id") or "") or message.get("name") or ""
        header = f"functions.{name} to=assistant<|channel|>commentary"
        return _block(header, _text(message.get("content")))
    return _block(role, _text(message.get("content")))


def _assistant(message: dict[str, Any], keep_thought: bool, call_names: dict[str, str]) -> str:
    parts = []
    thought = message.get("reasoning") or message.get("reasoning_content")
    if thought and keep_thought:
        parts.append(_block("assistant<|channel|>analysis", thought))
    calls = message.get("tool_calls") or []
    content = _text(message.get("content"))
    if content:
        channel = "commentary" if calls else "final"  # text beside calls: a preamble
        parts.append(_block(f"assistant<|channel|>{channel}", content))
    for call in calls:
        function = call.get("function") or {}
        name = function.get("name", "")
        call_names[call.get("id") or ""] = name
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments if arguments is not None else {})
        header = f"assistant<|channel|>commentary to=functions.{name} <|constrain|>json"
        parts.append(f"<|start|>{header}<|message|>{arguments}<|call|>")
    return "".join(parts)


def _block(header: str, body: str) -> str:
    return f"<|start|>{header}<|message|>{body}<|end|>"


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return str(content)
