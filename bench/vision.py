"""Time to first token of one 448x448 image plus a short question, split into preprocessing
(the api's work), the vision encoder and the prefill (issue 29, "Images in the prompt").

Random-weight Qwen2.5-VL models built from a transformers config (tests/support/vlm_models.py):
`tiny` (2-layer 64-wide decoder, 2-block 32-wide vision tower) and `small` (4-layer 512-wide
decoder, 8-block 256-wide vision tower with window attention and two full-attention blocks).
A 448x448 image is a 32x32 grid of 14-pixel patches, 1024 patches merged 2x2 into 256 image
tokens; the prompt is those plus the chat template and the question (~270 tokens).

Per round, for each model:
- preprocessing: what the api does for a chat image_url part (services/api/serving/multimodal.py):
  base64 decode of a PNG data: URL, PIL decode, the HF image processor (resize, normalise,
  patchify), the placeholder expansion and the content hash;
- encoder and prefill: the first engine step of the request in a real EngineCore (uni
  executor, prefix caching on but a fresh image each round): encoder = the vision encoder's
  time in the worker (MultimodalRunner.encoder_seconds), prefill = the rest of that step
  (the decoder's forward over the prompt and the first token's sampling);
- TTFT = preprocessing + the first step (no HTTP, no queueing).
Medians over --rounds rounds (the first round, warm-up, dropped).

    .venv/bin/python bench/vision.py [--rounds 6] [--models tiny,small] [--save-result FILE]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import tempfile
import time

import numpy as np

from kvserve.services.api.serving.multimodal import (
    decode_image,
    load_image_bytes,
    load_image_processor,
)
from kvserve.services.scheduler.engine.engine_core import EngineCore
from kvserve.shared.config import CacheConfig, EngineConfig, ModelConfig
from kvserve.shared.messages import EngineCoreRequest
from kvserve.shared.sampling_params import SamplingParams
from tests.support.vlm_models import chat_prompt, save_tiny_vlm

QUESTION = "What is in this picture?"
SIDE = 448


def png_data_url(seed: int) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def measure(model_dir: str, rounds: int) -> dict:
    processor = load_image_processor(model_dir)
    assert processor is not None
    template = chat_prompt(model_dir, 1, QUESTION)
    config = EngineConfig(
        model=ModelConfig(model=model_dir), cache=CacheConfig(kv_cache_memory_bytes=64 << 20)
    )
    engine = EngineCore(config, model_dir)
    runner = engine.executor.worker.runner  # type: ignore[attr-defined]  (uni executor)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rows = []
    try:
        for i in range(rounds + 1):
            url = png_data_url(seed=i)  # a new image each round: no prefix-cache hit
            start = time.perf_counter()
            image = decode_image(load_image_bytes(url, None))
            prompt, mm = processor.expand(template, [image])
            preprocess = time.perf_counter() - start
            engine.add_request(EngineCoreRequest(f"r{i}", prompt, params, mm_inputs=mm))
            encoder_before = runner.multimodal.encoder_seconds
            start = time.perf_counter()
            outputs = engine.step()
            first_step = time.perf_counter() - start
            assert any(o.new_token_ids for o in outputs.outputs), "one step, one token"
            while engine.has_work():
                engine.step()
            encoder = runner.multimodal.encoder_seconds - encoder_before
            rows.append((preprocess, encoder, first_step - encoder, preprocess + first_step))
    finally:
        engine.shutdown()
    rows = rows[1:]  # warm-up dropped
    names = ("preprocess_ms", "encoder_ms", "prefill_ms", "ttft_ms")
    result = {n: 1e3 * statistics.median(r[k] for r in rows) for k, n in enumerate(names)}
    result.update(prompt_tokens=len(prompt), image_tokens=mm[0].length, rounds=len(rows))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--save-result", default=None)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for name in args.models.split(","):
            model_dir = f"{root}/{name}"
            save_tiny_vlm(model_dir, small=name == "small")
            results[name] = measure(model_dir, args.rounds)
    print("| model | prompt tokens (image) | preprocess ms | encoder ms | prefill ms | TTFT ms |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['prompt_tokens']} ({r['image_tokens']}) | {r['preprocess_ms']:.1f} | "
            f"{r['encoder_ms']:.1f} | {r['prefill_ms']:.1f} | {r['ttft_ms']:.1f} |"
        )
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
