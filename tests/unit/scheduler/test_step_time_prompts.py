"""The step-time model's prompt terms (step_time.py): a prompt chunk's attention priced as
prompt work by the model's keys per token, so the late chunks of a long prompt are sized to
the TPOT target on the real Scheduler; and one jump off the fast path a step, however many
prompt chunks it holds."""

from __future__ import annotations

import random

import msgspec
import pytest

from kvserve.services.scheduler.core.features import SchedulerFeatures
from kvserve.services.scheduler.core.latency_targets import TPOT_HEADROOM
from kvserve.services.scheduler.core.scheduler import Scheduler
from kvserve.services.scheduler.core.step_time import (
    StepShape,
    StepTimeModel,
    attended,
    shape_of,
)
from kvserve.shared.config import CacheConfig, SchedulerConfig
from tests.support.scheduler import create_request, step

# A machine like the 2-core CPU's, one thread (bench/slo_sitting/part_b_steps.py): per step,
# per prompt token (or KEYS_PER_TOKEN keys a prompt chunk attends), per decode row, per
# decode key, and the jump off the decode-only fast path once a step holds a prompt chunk.
KEYS_PER_TOKEN = 3069.0  # SmolLM2-135M's linear FLOPs a token / attention FLOPs a key
STEP_S, TOKEN_S, ROW_S, DECODE_KEY_S, JUMP_S = 0.030, 0.0026, 0.0035, 1e-8, 0.090
NOW = 1000.0


def _true_seconds(shape: StepShape) -> float:
    prompt_work = shape.num_prefill_tokens + shape.num_prefill_context / KEYS_PER_TOKEN
    decode_keys = shape.num_context_tokens - shape.num_prefill_context
    return (
        STEP_S
        + TOKEN_S * prompt_work
        + ROW_S * shape.num_decode_rows
        + DECODE_KEY_S * decode_keys
        + JUMP_S * (shape.num_prefill_chunks > 0)
    )


def _chunk(num_tokens: int, num_computed: int, num_decodes: int = 0) -> StepShape:
    """A step of one prompt chunk beside `num_decodes` decodes (each after 600 tokens)."""
    prompt_keys = attended(num_tokens, num_computed)
    decode_keys = num_decodes * attended(1, 600)
    return StepShape(
        num_prefill_tokens=num_tokens,
        num_decode_rows=num_decodes,
        num_context_tokens=prompt_keys + decode_keys,
        num_prefill_chunks=1,
        num_prefill_context=prompt_keys,
    )


def _chat_steps(rng: random.Random) -> list[StepShape]:
    """What an engine sees while short chats run: decode steps, and the chats' own prompts
    (one to four of 128 tokens, part (b)'s, from nothing computed) alone or beside decodes."""
    shapes = []
    for _ in range(300):
        num_decodes = rng.randint(1, 8)
        if rng.random() < 0.2:
            num_chats = rng.randint(1, 4)
            keys = num_chats * attended(128, 0)
            decode_keys = num_decodes * attended(1, 600) if rng.random() < 0.5 else 0
            shapes.append(
                StepShape(
                    128 * num_chats,
                    num_decodes if decode_keys else 0,
                    keys + decode_keys,
                    0,
                    num_chats,
                    keys,
                )
            )
        else:
            decode_keys = num_decodes * attended(1, rng.randint(128, 1024))
            shapes.append(StepShape(num_decode_rows=num_decodes, num_context_tokens=decode_keys))
    return shapes


@pytest.mark.parametrize("num_computed", [2048, 6000])
def test_a_late_chunk_of_a_long_prompt_is_predicted_from_short_prompts_alone(num_computed):
    """Short prompts never pin a per-key cost; the model's keys per token carries their
    learned per-token cost to a long prompt's chunks (2,048 tokens after 6,000 cost 3.3x
    the same chunk from nothing on this machine)."""
    priced, unpriced = StepTimeModel(prompt_keys_per_token=KEYS_PER_TOKEN), StepTimeModel()
    rng = random.Random(0)
    for shape in _chat_steps(rng):
        seconds = _true_seconds(shape) * rng.uniform(0.97, 1.03)  # a quiet machine's noise
        priced.record(shape, seconds)
        unpriced.record(shape, seconds)
    late = _chunk(2048, num_computed)
    assert priced.predict(late) == pytest.approx(_true_seconds(late), rel=0.1)
    # Without it the keys' term is what the chats' decodes taught: a fraction of the time.
    assert unpriced.predict(late) < 0.75 * _true_seconds(late)


def test_a_step_of_several_prompt_chunks_counts_one_jump():
    """The chats' first step holds four prompts: the fast path is left once, so the jump
    it teaches is the one a later single chunk beside the decodes pays."""
    shape = _chunk(128, 0)
    four = StepShape(
        num_prefill_tokens=512,
        num_context_tokens=4 * shape.num_context_tokens,
        num_prefill_chunks=4,
        num_prefill_context=4 * shape.num_context_tokens,
    )
    assert four.features()[5] == shape.features()[5] == 1.0
    model, rng = StepTimeModel(prompt_keys_per_token=KEYS_PER_TOKEN), random.Random(1)
    for _ in range(200):
        num_chunks = rng.randint(1, 4)
        num_tokens = rng.randint(16, 256)
        keys = num_chunks * attended(num_tokens, 0)
        several = StepShape(num_chunks * num_tokens, rng.randint(0, 4), keys, 0, num_chunks, keys)
        model.record(several, _true_seconds(several))
    one = _chunk(32, 0, num_decodes=4)
    assert model.predict(one) == pytest.approx(_true_seconds(one), rel=0.05)


def _scheduler(keys_per_token: float) -> Scheduler:
    """The real Scheduler, its step-time model holding this machine's costs (in its own
    features: the prompt keys priced by `keys_per_token`, or in the context term at the
    decodes' rate), its clock at NOW."""
    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16)
    features = SchedulerFeatures(prompt_keys_per_token=keys_per_token)
    scheduler = Scheduler(config, CacheConfig(block_size=16), 2000, 16384, features=features)
    scheduler.latency.clock = lambda: NOW
    scheduler.latency.model.coefficients = [
        STEP_S,
        TOKEN_S * 1e3,
        ROW_S * 1e2,
        DECODE_KEY_S * 1e6,
        0.0,
        JUMP_S,
    ]
    return scheduler


def test_a_long_prompts_chunks_beside_targeted_decodes_keep_the_tpot_target():
    """Four chats with a 300 ms TPOT target decode while an 8,000-token document (no target)
    prefills beside them: every step, its late chunks included, takes at most the per-step
    limit on this machine (with the prompt keys in the context term at the decodes' rate
    the chunks stayed ~51 tokens whatever the prefix, and the last ones ran 0.6 s, 2.2x
    the limit)."""
    target_s = 0.300
    scheduler = _scheduler(KEYS_PER_TOKEN)
    for i in range(4):
        chat = create_request(f"chat{i}", 64, max_tokens=2000)
        scheduler.add_request(msgspec.structs.replace(chat, slo_tpot_ms=target_s * 1e3))
    step(scheduler)  # the chats' prompts; they decode from now on
    scheduler.add_request(create_request("document", 8000, max_tokens=1, arrival_time=NOW))
    computed = num_chunks = 0
    while computed < 8000:
        scheduler_output, _ = step(scheduler)
        chunk = scheduler_output.num_scheduled_tokens.get("document", 0)
        assert len(scheduler_output.num_scheduled_tokens) >= 4  # every decode is in it
        seconds = _true_seconds(shape_of(scheduler_output))
        assert seconds <= target_s * TPOT_HEADROOM + 1e-9, (computed, chunk, seconds)
        computed += chunk
        num_chunks += bool(chunk)
    assert num_chunks > 10  # cut into chunks that fit
