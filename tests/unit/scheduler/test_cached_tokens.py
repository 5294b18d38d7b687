"""num_cached_tokens: the prefix-cache hit at the first schedule, in the first output only."""

from __future__ import annotations

import msgspec

from kvserve.shared.messages import EngineCoreOutput
from tests.support.kv import assert_no_leaked_blocks
from tests.support.scheduler import create_request, create_scheduler, step


def outputs_of(scheduler, max_steps: int = 100) -> dict[str, list[EngineCoreOutput]]:
    """Every output of every request, in order, until all have finished."""
    outputs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return outputs
        for out in step(scheduler)[1]:
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("requests still unfinished")


def test_first_output_carries_the_full_blocks_hit_and_later_ones_zero():
    scheduler = create_scheduler(block_size=16)
    # 64 tokens = 4 full blocks, but the last token is always recomputed: 3 blocks can hit.
    prompt = list(range(1000, 1064))
    scheduler.add_request(create_request("a", prompt_token_ids=prompt, max_tokens=3))
    first = outputs_of(scheduler)
    scheduler.add_request(create_request("b", prompt_token_ids=prompt, max_tokens=3))
    scheduler.add_request(create_request("c", prompt_token_ids=prompt[:47], max_tokens=3))
    second = outputs_of(scheduler)
    assert [out.num_cached_tokens for out in first["a"]] == [0, 0, 0]
    assert [out.num_cached_tokens for out in second["b"]] == [48, 0, 0]
    assert [out.num_cached_tokens for out in second["c"]] == [32, 0, 0]  # (47 - 1) // 16 * 16
    assert_no_leaked_blocks(scheduler)


def test_later_outputs_pay_no_bytes_for_it():
    scheduler = create_scheduler(block_size=16, log_stats=False)  # no events in the outputs
    prompt = list(range(2000, 2040))
    scheduler.add_request(create_request("a", prompt_token_ids=prompt, max_tokens=1))
    outputs_of(scheduler)
    scheduler.add_request(create_request("b", prompt_token_ids=prompt, max_tokens=2))
    first, last = outputs_of(scheduler)["b"]
    assert first.num_cached_tokens == 32
    without_field = EngineCoreOutput(
        last.request_id,
        last.new_token_ids,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
    )
    # The field is trailing and at its default: the encoding is as if it did not exist.
    assert msgspec.msgpack.encode(last) == msgspec.msgpack.encode(without_field)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(first), type=EngineCoreOutput)
    assert decoded.num_cached_tokens == 32
    assert_no_leaked_blocks(scheduler)


def test_a_preempted_request_reports_its_first_schedule_once():
    # 6 usable blocks of 4 tokens. "c" shares "a"'s prompt: 1 block hits at its first schedule
    # ((8 - 1) // 4 blocks); it is then preempted, and resumes with a different hit.
    scheduler = create_scheduler(block_size=4, num_blocks=7, max_model_len=24)
    prompt = list(range(300, 308))
    scheduler.add_request(
        create_request("a", prompt_token_ids=prompt, max_tokens=6, arrival_time=0.0)
    )
    scheduler.add_request(create_request("b", num_tokens=8, max_tokens=6, arrival_time=1.0))
    scheduler.add_request(
        create_request("c", prompt_token_ids=prompt, max_tokens=6, arrival_time=2.0)
    )
    outputs = outputs_of(scheduler)
    assert scheduler.num_preemptions_total >= 1
    assert [out.num_cached_tokens for out in outputs["c"]] == [4] + [0] * 5
    assert all(out.num_cached_tokens == 0 for out in outputs["a"] + outputs["b"])
    assert_no_leaked_blocks(scheduler)
