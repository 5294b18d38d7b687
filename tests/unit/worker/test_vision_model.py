"""Images in the prompt, engine level: a tiny random Qwen2.5-VL (vision tower tiny too) in a
real EngineCore (Scheduler + ModelRunner, uni executor), against HF transformers' generate
with the same pixels, in float32: greedy tokens and their logprobs; chunked prefill that cuts
through an image; an encoder budget smaller than an image and one image per step; the same
image again hitting the prefix cache, a different image with the same token ids not.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.services.api.serving.multimodal import load_image_processor
from kvserve.services.scheduler.engine.engine_core import EngineCore
from kvserve.shared.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvserve.shared.messages import EngineCoreRequest, ImageInput
from kvserve.shared.sampling_params import SamplingParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.vlm_models import (
    IMAGE_TOKEN_ID,
    MAX_TOKENS,
    chat_prompt,
    hf_greedy,
    random_image,
    save_tiny_vlm,
)

NUM_LOGPROBS = 4


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("tiny_vlm"))
    hf_model = save_tiny_vlm(model_dir)
    return model_dir, hf_model, load_image_processor(model_dir)


def make_engine(model_dir: str, tp: int = 1, pp: int = 1, **scheduler) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model=model_dir),
        cache=CacheConfig(kv_cache_memory_bytes=16 << 20),
        scheduler=SchedulerConfig(**scheduler),
        parallel=ParallelConfig(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            distributed_executor_backend="mp" if tp * pp > 1 else "uni",
        ),
    )
    return EngineCore(config, model_dir)


def run(engine: EngineCore, requests: dict[str, tuple[list[int], list[ImageInput]]]):
    """{request id: (tokens, logprob rows, num_cached_tokens)} of greedy runs, all at once."""
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=NUM_LOGPROBS
    )
    for req_id, (prompt, mm) in requests.items():
        engine.add_request(EngineCoreRequest(req_id, prompt, params, mm_inputs=mm))
    results: dict[str, list] = {r: [[], [], None] for r in requests}
    while engine.has_work():
        for out in engine.step().outputs:
            assert out.error is None, out.error
            result = results[out.request_id]
            result[0] += out.new_token_ids
            if out.new_logprobs is not None:
                result[1] += list(zip(out.new_logprobs.token_ids, out.new_logprobs.logprobs))
            if result[2] is None:
                result[2] = out.num_cached_tokens
    assert_no_leaked_blocks(engine.scheduler)
    assert engine.scheduler.encoder.num_cached_tokens == 0
    return results


def assert_matches_hf(result, hf_tokens, hf_logprobs) -> None:
    tokens, rows, _ = result
    assert tokens == hf_tokens
    for step, (ids, values) in enumerate(rows):
        expected = hf_logprobs[step, ids]
        torch.testing.assert_close(torch.tensor(values), expected, atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def prompts(vlm):
    """Two one-image prompts of the same length (different pixels) and a two-image one."""
    model_dir, _, processor = vlm
    one = chat_prompt(model_dir, 1, "What is in it?")
    two = chat_prompt(model_dir, 2, "Which differs?")
    image_a = random_image(112, 168, seed=1)  # 8 x 12 patches: 24 tokens
    image_b = random_image(112, 168, seed=2)
    image_c = random_image(140, 112, seed=3)  # 10 x 8 patches: 20 tokens
    return {
        "a": processor.expand(one, [image_a]),
        "b": processor.expand(one, [image_b]),
        "ac": processor.expand(two, [image_a, image_c]),
    }


@pytest.fixture(scope="module")
def hf_reference(vlm, prompts):
    hf_model = vlm[1]
    return {name: hf_greedy(hf_model, *prompt) for name, prompt in prompts.items()}


def test_prompt_expansion(prompts):
    prompt, mm = prompts["ac"]
    assert [(m.offset, m.length, m.grid_thw) for m in mm] == [
        (mm[0].offset, 24, [1, 8, 12]),
        (mm[0].offset + 24 + 2, 20, [1, 10, 8]),
    ]
    for m in mm:
        assert prompt[m.offset - 1] != IMAGE_TOKEN_ID
        assert prompt[m.offset : m.end] == [IMAGE_TOKEN_ID] * m.length
    assert prompts["a"][1][0].mm_hash != prompts["b"][1][0].mm_hash
    assert prompts["a"][1][0].mm_hash == mm[0].mm_hash


def test_greedy_and_logprobs_match_hf(vlm, prompts, hf_reference):
    engine = make_engine(vlm[0])
    try:
        results = run(engine, prompts)  # three requests batched together
    finally:
        engine.shutdown()
    for name, result in results.items():
        assert_matches_hf(result, *hf_reference[name])


def test_chunked_prefill_cuts_through_images(vlm, prompts, hf_reference):
    # 16-token steps: chunks end inside the images; an encoder budget of 20 tokens runs the
    # 24-token image alone in its step and the two-image prompt's images in two steps.
    engine = make_engine(vlm[0], max_num_batched_tokens=16, max_num_encoder_input_tokens=20)
    try:
        results = run(engine, {"ac": prompts["ac"], "b": prompts["b"]})
    finally:
        engine.shutdown()
    assert engine.scheduler.encoder.num_cached_tokens == 0
    for name, result in results.items():
        assert_matches_hf(result, *hf_reference[name])


def test_prefix_cache_keys_on_the_image(vlm, prompts, hf_reference):
    engine = make_engine(vlm[0], max_num_batched_tokens=512)
    try:
        first = run(engine, {"a1": prompts["a"]})["a1"]
        again = run(engine, {"a2": prompts["a"]})["a2"]
        other = run(engine, {"b1": prompts["b"]})["b1"]
    finally:
        engine.shutdown()
    prompt, (image,) = prompts["a"]
    block = 16
    assert first[2] == 0
    # The same image: every full block but the one holding the last prompt token.
    assert again[2] == (len(prompt) - 1) // block * block
    # Another image, equal token ids: only the blocks before its first image token.
    assert other[2] == image.offset // block * block
    assert_matches_hf(again, *hf_reference["a"])
    assert_matches_hf(other, *hf_reference["b"])


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_tensor_and_pipeline_parallel_2_match_hf(vlm, prompts, hf_reference, tp, pp):
    # Every rank runs the whole vision encoder; the decoder splits as Qwen2 does (each
    # pipeline stage gets the step's M-RoPE positions; only the first places embeddings).
    engine = make_engine(vlm[0], tp=tp, pp=pp, max_num_batched_tokens=16)
    try:
        results = run(engine, {"ac": prompts["ac"], "b": prompts["b"]})
    finally:
        engine.shutdown()
    for name, result in results.items():
        assert_matches_hf(result, *hf_reference[name])
