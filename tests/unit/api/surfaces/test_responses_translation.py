"""The Responses API's translation to the chat path and its response store
(services/api/surfaces/responses.py), without a server: the e2e test drives the whole route."""

from __future__ import annotations

import msgspec
import pytest

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.surfaces.responses import ResponseStore, input_messages, to_chat_request
from kvserve.services.api.surfaces.responses_protocol import ResponseObject, ResponsesRequest


def request(**fields) -> ResponsesRequest:
    return msgspec.convert({"model": "m"} | fields, ResponsesRequest)


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "two"}],
        },
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "g", "arguments": '{"a": 1}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]
    assert input_messages("Hello") == [{"role": "user", "content": "Hello"}]


def test_the_chat_request_carries_instructions_tools_and_the_format():
    chat, conversation = to_chat_request(
        request(
            input="Hi",
            instructions="Be brief.",
            max_output_tokens=7,
            tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            tool_choice={"type": "function", "name": "f"},
            text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        ),
        [{"role": "user", "content": "Before"}, {"role": "assistant", "content": "Yes"}],
    )
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user"]
    assert chat.max_tokens == 7 and chat.tools[0].function.name == "f"
    assert chat.response_format.type == "json_schema"
    # The instructions are this turn's only: a follow-up's history leaves them out.
    assert [m["role"] for m in conversation] == ["user", "assistant", "user"]


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input_file"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "call_id"),
        ({"tools": [{"type": "file_search"}]}, "file_search"),
        ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        ({"text": {"format": "json"}}, "text.format"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
    ],
)
def test_what_it_cannot_honour_is_a_400_naming_it(fields, named):
    with pytest.raises(APIError) as info:
        to_chat_request(request(**fields), [])
    assert info.value.status_code == 400 and named in info.value.message


def test_an_unknown_field_is_refused_not_dropped():
    with pytest.raises(msgspec.ValidationError, match="max_tokenz"):
        msgspec.json.decode(b'{"input": "x", "max_tokenz": 1}', type=ResponsesRequest)


def _response(response_id: str) -> ResponseObject:
    return ResponseObject(
        id=response_id, created_at=0, status="completed", model="m", output=[], usage=None,
        instructions=None, tools=[], tool_choice="auto", parallel_tool_calls=True,
        temperature=None, top_p=None, max_output_tokens=None, previous_response_id=None,
        text={}, metadata={}, store=True,
    )  # fmt: skip


def test_the_store_keeps_the_newest_within_its_size_and_ttl():
    now = [0.0]
    store = ResponseStore(size=2, ttl=10.0, clock=lambda: now[0])
    for name in ("a", "b", "c"):
        store.put(_response(name), [{"role": "user", "content": name}])
    with pytest.raises(APIError) as info:
        store.get("a")  # the oldest went when the third came
    assert info.value.status_code == 404 and "--responses-store-size 2" in info.value.message
    assert store.get("b").conversation == [{"role": "user", "content": "b"}]
    now[0] = 10.0
    with pytest.raises(APIError):
        store.get("c")  # expired
    nothing = ResponseStore(size=0, ttl=10.0)
    nothing.put(_response("d"), [])
    with pytest.raises(APIError):
        nothing.get("d")
