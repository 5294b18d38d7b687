"""A traced request's engine phases (services/scheduler/core/request_trace.py): timed by the
real scheduler, sent in the request's last output only, and nothing for untraced requests."""

from __future__ import annotations

import msgspec

from kvserve.shared.messages import EngineCoreRequest, EngineSpan
from kvserve.shared.sampling_params import SamplingParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.scheduler import create_request, create_scheduler, run_to_completion, step

CONTEXT = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


def traced(req_id: str, **kwargs) -> EngineCoreRequest:
    return msgspec.structs.replace(create_request(req_id, **kwargs), trace_context=CONTEXT)


def names(spans: list[EngineSpan]) -> list[str]:
    return [span.name for span in spans]


def test_a_chunked_prompt_has_one_prefill_span_per_chunk_then_one_decode_span():
    scheduler = create_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(traced("a", num_tokens=40, max_tokens=4))
    scheduler.add_request(create_request("b", num_tokens=5, max_tokens=4))
    outputs = []
    while scheduler.has_requests():
        outputs += step(scheduler)[1]
    (final,) = [out for out in outputs if out.request_id == "a" and out.finished]
    assert all(out.trace_spans is None for out in outputs if out is not final)
    spans = final.trace_spans
    assert names(spans) == ["engine.waiting"] + ["engine.prefill"] * 3 + ["engine.decode"]
    prefills = spans[1:4]
    assert [(s.attributes["position"], s.attributes["num_tokens"]) for s in prefills] == [
        (0, 16),
        (16, 16),
        (32, 8),
    ]
    # The last chunk samples the first token: three more tokens take three decode steps.
    assert spans[-1].attributes == {"num_steps": 3}
    for span in spans:
        assert span.start_ns <= span.end_ns
    for before, after in zip(spans, spans[1:]):
        assert before.end_ns <= after.start_ns
    assert scheduler.live.num_traced == 0
    assert_no_leaked_blocks(scheduler)


def test_a_preempted_request_waits_again_and_prefills_again():
    # Two blocks of 16 tokens for both: "b" is preempted when "a" needs a block more.
    scheduler = create_scheduler(block_size=16, num_blocks=4)
    scheduler.add_request(create_request("a", num_tokens=16, max_tokens=20))
    scheduler.add_request(traced("b", num_tokens=15, max_tokens=20))
    finals = run_to_completion(scheduler)
    assert scheduler.num_preemptions_total == 1
    spans = finals["b"].trace_spans
    waits = [s for s in spans if s.name == "engine.waiting"]
    assert [w.attributes for w in waits] == [{}, {"preempted": 1}]
    assert names(spans).count("engine.prefill") == 2  # before and after the preemption
    assert finals["a"].trace_spans is None
    assert_no_leaked_blocks(scheduler)


# The fields appended after trace_context: the latency targets, the prompt pins, the
# standing TTFT target.
LATER_FIELDS = ("slo_ttft_ms", "slo_tpot_ms", "pins", "standing_ttft_ms")


def test_trace_context_is_the_last_field_and_optional_on_the_wire():
    request = create_request("a", num_tokens=4)
    # Last but the fields added after it, so every other field keeps its place in the
    # array, and unset it is one nil byte; the array of a sender that predates it (one
    # element shorter, and without the later fields) still decodes.
    num_last = 1 + len(LATER_FIELDS)
    assert EngineCoreRequest.__struct_fields__[-num_last:] == ("trace_context", *LATER_FIELDS)
    array = msgspec.msgpack.decode(msgspec.msgpack.encode(request))
    assert array[-num_last] is None
    old = msgspec.msgpack.encode(array[:-num_last])
    assert msgspec.msgpack.decode(old, type=EngineCoreRequest) == request
    with_context = msgspec.structs.replace(request, trace_context=CONTEXT)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(with_context), type=EngineCoreRequest)
    assert decoded.trace_context == CONTEXT
    assert isinstance(decoded.sampling_params, SamplingParams)
