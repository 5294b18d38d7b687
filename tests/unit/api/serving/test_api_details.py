"""The API details vLLM's clients rely on, piece by piece: cached tokens, request ids, the
logprobs limit, token ids as names, prompt logprobs, request logs.

The whole flow over HTTP is tests/e2e/test_api_details.py.
"""

from __future__ import annotations

import logging

import msgspec
import pytest
from starlette.requests import Request

from kvserve.services.api.engine_client.client import EngineClient
from kvserve.services.api.observability.request_logger import RequestLogger
from kvserve.services.api.serving.base import OpenAIServing, prompt_logprobs_body
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.output_processor import OutputProcessor
from kvserve.services.api.serving.outputs import Logprob
from kvserve.services.api.serving.protocol import UsageInfo, decode_request
from kvserve.services.api.serving.tokenizer import TokenizerInfo
from kvserve.services.api.serving.validation import check_prompt_logprobs
from kvserve.services.api.surfaces.openai_protocol import CompletionRequest
from kvserve.shared.api_config import FrontendConfig
from kvserve.shared.messages import EngineCoreOutput, FinishReason
from kvserve.shared.sampling_params import SamplingParams, logprobs_over_limit


@pytest.fixture(scope="module")
def tokenizer_info(tiny_llama_dir) -> TokenizerInfo:
    return TokenizerInfo(tiny_llama_dir)


def make_serving(tokenizer_info, max_logprobs: int = 20, **frontend) -> OpenAIServing:
    client = EngineClient(tokenizer_info, 256, "tiny", max_logprobs=max_logprobs)
    return OpenAIServing(client, "tiny", FrontendConfig(**frontend))


def http_request(headers: dict[str, str] | None = None) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw})


def completion(**fields) -> CompletionRequest:
    return decode_request(msgspec.json.encode({"prompt": "hi"} | fields), CompletionRequest)


# --------------------------------------------------------------------------- cached tokens


def test_request_output_keeps_the_first_outputs_cached_tokens():
    processor = OutputProcessor(tokenizer=None)
    processor.add_request("r", None, [1, 2, 3], SamplingParams(max_tokens=3))
    counts = []
    for num_cached, finish in ((32, None), (0, None), (0, FinishReason.LENGTH)):
        out = EngineCoreOutput("r", [7], finish_reason=finish, num_cached_tokens=num_cached)
        [result], _ = processor.process_outputs([out])
        counts.append(result.num_cached_tokens)
    assert counts == [32, 32, 32]


def test_n_children_report_the_best_hit():
    # The children share the prompt; those after the first hit its blocks (vLLM's
    # non-streamed output reports the last child to finish, which is such a one).
    processor = OutputProcessor(tokenizer=None)
    child_ids = processor.add_request("r", None, [1] * 40, SamplingParams(n=3, max_tokens=1))
    hits = dict(zip(child_ids, (0, 32, 32)))
    outs = [
        EngineCoreOutput(cid, [7], finish_reason=FinishReason.LENGTH, num_cached_tokens=hit)
        for cid, hit in hits.items()
    ]
    [result], _ = processor.process_outputs(outs)
    assert result.finished and result.num_cached_tokens == 32


def test_usage_has_prompt_tokens_details_only_with_the_flag():
    without = msgspec.to_builtins(UsageInfo.of(5, 2))
    assert "prompt_tokens_details" not in without
    cold = msgspec.to_builtins(UsageInfo.of(5, 2, 0))
    assert cold == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_serving_usage_sums_cached_tokens_over_prompts(tokenizer_info):
    from kvserve.services.api.serving.outputs import CompletionOutput, RequestOutput

    def final(num_cached: int) -> RequestOutput:
        completion_output = CompletionOutput(0, "x", [1], finish_reason="length")
        return RequestOutput("r", None, [1] * 20, [completion_output], True, None, num_cached)

    off = make_serving(tokenizer_info).usage([final(16), final(0)])
    assert off.prompt_tokens_details is msgspec.UNSET
    on = make_serving(tokenizer_info, enable_prompt_tokens_details=True)
    usage = on.usage([final(16), final(0)])
    assert (usage.prompt_tokens, usage.completion_tokens) == (40, 2)
    assert usage.prompt_tokens_details.cached_tokens == 16


# --------------------------------------------------------------------------- request ids


def test_request_id_comes_from_the_header_then_the_body(tokenizer_info):
    serving = make_serving(tokenizer_info)
    raw = http_request({"X-Request-Id": "trace-42"})
    response_id, engine_id = serving.request_ids(raw, completion(request_id="body-1"), "cmpl-")
    assert response_id == "cmpl-trace-42"
    # A client's id may repeat: the engine's id is made unique, the response's is not.
    assert engine_id.startswith("cmpl-trace-42-") and engine_id != response_id
    assert serving.request_ids(raw, completion(), "cmpl-")[1] != engine_id
    assert raw.state.request_id == "trace-42"  # what the X-Request-Id header echoes

    from_body = http_request()
    assert serving.request_ids(from_body, completion(request_id="body-1"), "chatcmpl-")[0] == (
        "chatcmpl-body-1"
    )
    fresh = http_request()
    response_id, engine_id = serving.request_ids(fresh, completion(), "cmpl-")
    assert response_id == engine_id == "cmpl-" + fresh.state.request_id
    assert len(fresh.state.request_id) == 32


# --------------------------------------------------------------------------- logprobs


def test_logprobs_limit_is_the_configured_one(tokenizer_info):
    serving = make_serving(tokenizer_info, max_logprobs=3)
    assert serving.make_sampling_params(completion(), 1, 4, "prompt", logprobs=3).logprobs == 3
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(APIError) as info:
            serving.make_sampling_params(completion(), 1, 4, "prompt", **{field: 4})
        assert info.value.status_code == 400 and info.value.param == field
        assert "greater than max allowed: 3" in info.value.message
    # No hard-coded 20 any more: the limit is whatever the engine allows.
    assert logprobs_over_limit(SamplingParams(logprobs=50), 64) is None
    with pytest.raises(ValueError, match="non-negative"):
        SamplingParams(prompt_logprobs=-1)


def test_tokens_as_ids_request_field_wins_over_the_flag(tokenizer_info):
    on = make_serving(tokenizer_info, return_tokens_as_token_ids=True)
    off = make_serving(tokenizer_info)
    assert on.tokens_as_ids(completion()) and not off.tokens_as_ids(completion())
    assert not on.tokens_as_ids(completion(return_tokens_as_token_ids=False))
    assert off.tokens_as_ids(completion(return_tokens_as_token_ids=True))
    assert off.token_text(65, Logprob(-1.0, 1, "b"), as_token_id=True) == "token_id:65"
    assert off.token_text(65, Logprob(-1.0, 1, "b")) == "b"


def test_prompt_logprobs_body_has_vllms_shape():
    body = prompt_logprobs_body(
        [None, {5: Logprob(float("-inf"), 900, "x"), 6: Logprob(-0.5, 1, "y")}]
    )
    encoded = msgspec.json.decode(msgspec.json.encode(body))
    assert encoded == [
        None,
        {
            "5": {"logprob": -9999.0, "rank": 900, "decoded_token": "x"},
            "6": {"logprob": -0.5, "rank": 1, "decoded_token": "y"},
        },
    ]
    assert prompt_logprobs_body(None) is None


def test_stream_with_prompt_logprobs_is_refused():
    check_prompt_logprobs(completion(prompt_logprobs=2))
    check_prompt_logprobs(completion(prompt_logprobs=0, stream=True))  # vLLM's `> 0`
    with pytest.raises(APIError) as info:
        check_prompt_logprobs(completion(prompt_logprobs=1, stream=True))
    assert info.value.param == "prompt_logprobs"


# --------------------------------------------------------------------------- request logs


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_request_log_truncates_prompt_and_token_ids():
    handler = _Records()
    log = logging.getLogger("kvserve.services.api.observability.request_logger")
    log.addHandler(handler)
    try:
        RequestLogger(max_log_len=4).log_inputs(
            "cmpl-x", "abcdefgh", list(range(10)), SamplingParams(max_tokens=2)
        )
        RequestLogger().log_inputs("cmpl-y", None, [1, 2], SamplingParams(max_tokens=2))
    finally:
        log.removeHandler(handler)
    truncated, whole = handler.messages
    assert truncated.startswith("Received request cmpl-x: prompt: 'abcd', params: ")
    assert "max_tokens=2" in truncated and truncated.endswith("prompt_token_ids: [0, 1, 2, 3].")
    assert "prompt: None" in whole and whole.endswith("prompt_token_ids: [1, 2].")
