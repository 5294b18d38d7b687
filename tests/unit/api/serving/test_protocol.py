"""Request decoding, response shapes and the no-torch rule of the api modules."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import msgspec
import pytest

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.protocol import (
    UNSET,
    ChatCompletionRequest,
    UsageInfo,
    decode_request,
)
from kvserve.services.api.surfaces.openai_protocol import (
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionStreamResponse,
    DeltaMessage,
)
from tests.support import REPO_ROOT


def decode(body: dict, request_type=CompletionRequest):
    return decode_request(json.dumps(body).encode(), request_type)


@pytest.mark.parametrize(
    "prompt",
    [
        "hello",
        ["a", "b"],
        [1, 2, 3],
        [[1, 2], [3]],
    ],
)
def test_completion_prompt_forms_decode(prompt):
    assert decode({"prompt": prompt}).prompt == prompt


def test_defaults_leave_sampling_params_defaults_alone():
    request = decode({"prompt": "x"})
    assert request.max_tokens is None and request.logprobs is None and not request.echo
    # Only what the client set is passed on, so SamplingParams' own defaults apply.
    assert request.sampling_kwargs() == {
        "n": 1,
        "ignore_eos": False,
        "min_tokens": 0,
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
    }
    set_fields = decode({"prompt": "x", "temperature": 0, "stop": "END", "top_k": 5})
    kwargs = set_fields.sampling_kwargs()
    assert (kwargs["temperature"], kwargs["stop"], kwargs["top_k"]) == (0, "END", 5)
    assert not set_fields.include_usage
    assert decode({"prompt": "x", "stream_options": {"include_usage": True}}).include_usage


def test_unknown_fields_are_ignored_like_vllm():
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("kvserve.services.api.serving.protocol")
    logger.addHandler(handler)
    try:
        request = decode({"prompt": "x", "no_such_field": 1, "another_one": {"a": 2}})
        decode({"prompt": "x"})
    finally:
        logger.removeHandler(handler)
    assert request.prompt == "x"
    assert [r.getMessage() for r in records] == [
        "The following fields were present in the request but ignored: "
        "['another_one', 'no_such_field']"
    ]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "n": 1.5}, "n"),
        ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ],
)
def test_wrong_types_name_the_field(body, param):
    with pytest.raises(APIError) as info:
        decode(body)
    assert (info.value.status_code, info.value.param) == (400, param)


def test_missing_and_malformed_bodies():
    with pytest.raises(APIError) as info:
        decode({"max_tokens": 3})
    assert info.value.status_code == 400 and "prompt" in info.value.message
    with pytest.raises(APIError) as info:
        decode_request(b"{oops", CompletionRequest)
    assert info.value.status_code == 400 and "not valid JSON" in info.value.message


def test_chat_request_decodes_text_parts():
    request = decode(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": None},
            ],
            "logprobs": True,
            "top_logprobs": 2,
            "max_completion_tokens": 9,
        },
        ChatCompletionRequest,
    )
    assert [m.role for m in request.messages] == ["system", "user", "assistant"]
    assert request.messages[1].content[0].text == "hi"
    assert (request.logprobs, request.top_logprobs, request.max_completion_tokens) == (True, 2, 9)


def test_error_body_has_openai_shape():
    body = msgspec.to_builtins(
        APIError(404, "The model `x` does not exist.", param="model").to_body()
    )
    assert body == {
        "error": {
            "message": "The model `x` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def test_stream_chunks_carry_usage_only_when_asked():
    choice = CompletionChoice(0, "hi", None, None)
    without = msgspec.to_builtins(
        CompletionStreamResponse(id="c", created=1, model="m", choices=[choice])
    )
    assert "usage" not in without
    assert without["choices"] == [
        {"index": 0, "text": "hi", "logprobs": None, "finish_reason": None, "stop_reason": None}
    ]
    null_usage = msgspec.to_builtins(
        CompletionStreamResponse(id="c", created=1, model="m", choices=[choice], usage=None)
    )
    assert null_usage["usage"] is None
    last = msgspec.to_builtins(
        CompletionStreamResponse(id="c", created=1, model="m", choices=[], usage=UsageInfo.of(3, 4))
    )
    assert last["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert UNSET is msgspec.UNSET


def test_chat_delta_leaves_out_unset_fields():
    first = ChatStreamChoice(0, DeltaMessage("assistant", ""), None, None)
    later = ChatStreamChoice(0, DeltaMessage(content="lo"), None, "stop")
    chunk = msgspec.to_builtins(
        ChatCompletionStreamResponse(id="c", created=1, model="m", choices=[first, later])
    )
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunk["choices"][1]["delta"] == {"content": "lo"}
    assert chunk["choices"][1]["finish_reason"] == "stop"


def test_api_modules_do_not_import_torch():
    # The test-only InprocEngineClient too: the HTTP tests' server imports it, and it may
    # load torch only when it builds its engine.
    code = (
        "import sys\n"
        "import kvserve.services.api.server, kvserve.services.api.serving.protocol\n"
        "import kvserve.services.api.observability.metrics\n"
        "import kvserve.services.api.surfaces.completions\n"
        "import kvserve.services.api.surfaces.chat\n"
        "assert 'torch' not in sys.modules, 'the api imported torch'\n"
        "from tests.support.inproc_client import InprocEngineClient\n"
        "assert 'torch' not in sys.modules, 'inproc_client imports torch at import time'\n"
    )
    # From the repository root, where `tests` is importable.
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert result.returncode == 0, result.stderr
