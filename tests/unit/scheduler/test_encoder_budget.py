"""The encoder budget (services/scheduler/core/encoder_budget.py) in a real Scheduler: a chunk
ends before an image the encoder cannot run in its step, an image larger than the budget
runs alone, outputs are freed once their tokens are computed or the request is preempted;
block hashes of blocks holding an image's tokens are keyed by the image's hash."""

from __future__ import annotations

import msgspec

from kvserve.services.scheduler.core.request import Request, make_block_hasher
from kvserve.services.scheduler.core.scheduler import Scheduler
from kvserve.services.scheduler.core.step_plan import StepPlan
from kvserve.shared.config import CacheConfig, SchedulerConfig
from kvserve.shared.hashing import get_hash_fn
from kvserve.shared.messages import ImageInput
from tests.support.scheduler import create_request, step, submit

IMAGE_TOKEN = 9


def image(offset: int, length: int, mm_hash: str = "a") -> ImageInput:
    return ImageInput(b"", "float32", [0], [1, 2, 2 * length], offset, length, mm_hash)


def prompt_with_images(*images: ImageInput, num_tokens: int = 60) -> list[int]:
    tokens = list(range(100, 100 + num_tokens))
    for m in images:
        tokens[m.offset : m.end] = [IMAGE_TOKEN] * m.length
    return tokens


def request_with_images(images: tuple[ImageInput, ...], max_tokens: int):
    request = create_request(
        "r", prompt_token_ids=prompt_with_images(*images), max_tokens=max_tokens
    )
    return msgspec.structs.replace(request, mm_inputs=list(images))


def scheduler(max_num_batched_tokens: int, encoder_tokens: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_encoder_input_tokens=encoder_tokens,
        ),
        CacheConfig(block_size=16),
        num_blocks=100,
        max_model_len=1024,
    )


def test_a_chunk_ends_before_an_image_over_the_budget():
    images = (image(10, 24), image(40, 12))
    s = scheduler(64, 24)
    submit(s, request_with_images(images, max_tokens=2))
    out, _ = step(s)
    assert out.scheduled_encoder_inputs == {"r": [0]}
    assert out.num_scheduled_tokens == {"r": 40}  # up to the second image
    assert s.encoder.num_cached_tokens == 0  # image 0's tokens are all computed
    out, _ = step(s)
    assert out.scheduled_encoder_inputs == {"r": [1]}
    assert out.num_scheduled_tokens == {"r": 20}
    assert s.encoder.cached == {"r": set()}


def test_an_image_larger_than_the_budget_runs_alone_and_chunks_cut_through_it():
    images = (image(10, 24), image(40, 12))
    s = scheduler(16, 8)
    submit(s, request_with_images(images, max_tokens=2))
    plans = []
    while s.requests["r"].num_computed_tokens < 60:
        out, _ = step(s)
        plans.append((out.num_scheduled_tokens["r"], out.scheduled_encoder_inputs))
    # 16-token chunks; image 0 (24 > 8) runs alone in the first step and stays cached
    # through the chunk that ends inside it; image 1 (12 > 8) alone too.
    assert plans == [(16, {"r": [0]}), (16, {}), (8, {}), (16, {"r": [1]}), (4, {})]
    assert s.encoder.num_cached_tokens == 0


def test_preemption_and_finish_free_the_outputs():
    s = scheduler(16, 64)
    images = (image(4, 24),)
    submit(s, request_with_images(images, max_tokens=1))
    step(s)
    assert s.encoder.num_cached_tokens == 24  # the chunk ends inside the image
    s._preempt(s.requests["r"], StepPlan(token_budget=0))
    assert s.encoder.num_cached_tokens == 0 and "r" not in s.encoder.cached
    out, _ = step(s)  # recomputed from the start: the image is encoded again
    assert out.scheduled_encoder_inputs == {"r": [0]}
    while s.has_unfinished_requests():
        step(s)
    assert s.encoder.num_cached_tokens == 0 and not s.encoder.cached


def test_blocks_holding_an_image_are_keyed_by_its_hash():
    hasher = make_block_hasher(16, get_hash_fn("sha256"))
    tokens = prompt_with_images(image(20, 8), num_tokens=64)

    def hashes(mm_hash: str) -> list[bytes]:
        params = create_request("x").sampling_params
        request = Request(
            "r", tokens, params, block_hasher=hasher, mm_inputs=[image(20, 8, mm_hash)]
        )
        return request.block_hashes

    a, again, b = hashes("a"), hashes("a"), hashes("b")
    assert a == again
    assert a[0] == b[0]  # tokens 0..15: before the image
    assert a[1] != b[1] and a[2] != b[2] and a[3] != b[3]  # the image's block, and after


def test_images_that_cannot_be_placed_are_refused():
    s = scheduler(64, 64)
    good = request_with_images((image(10, 24),), max_tokens=1)
    cases = {
        "past": [image(50, 24)],
        "overlap": [image(10, 24), image(20, 4)],
        "bytes": [msgspec.structs.replace(image(10, 24), pixel_values=b"xyz")],
    }
    for name, images in cases.items():
        submit(s, msgspec.structs.replace(good, request_id=name, mm_inputs=images))
    _, outputs = step(s)
    errors = {out.request_id: out.error for out in outputs}
    assert "past the prompt" in errors["past"] and "out of order" in errors["overlap"]
    assert "do not match dtype" in errors["bytes"]
