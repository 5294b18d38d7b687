"""Llama 4 text through the offline engine (`kvserve.LLM`) beyond the family-wide runs of
test_model_families.py (one process and TP = 2): pipeline parallelism (stage 0 holds the
chunked dense layer, stage 1 the NoPE MoE layer), and the multimodal checkpoint served
text-only (the engine reads its text_config). Greedy tokens equal HF transformers' (full
forward each step, float32); the second round comes from the prefix cache.
"""

from __future__ import annotations

import pytest

from tests.support.family_llm import MAX_MODEL_LEN, generate_twice
from tests.support.hf_models import PROMPTS, hf_greedy, make_tiny_family_model
from tests.support.models import random_hf_model


@pytest.mark.slow  # two worker processes: ~30 s
def test_pipeline_parallel_2_equals_hf(tmp_path, default_model_dir):
    hf_model = make_tiny_family_model("llama4", max_position_embeddings=MAX_MODEL_LEN)
    hf_model.save_pretrained(tmp_path)
    first, second, cached = generate_twice(
        str(tmp_path), default_model_dir, pipeline_parallel_size=2
    )
    assert first == [hf_greedy(hf_model, prompt) for prompt in PROMPTS]
    assert second == first
    assert all(n >= 16 for n in cached), cached


def test_multimodal_checkpoint_generates_text_like_hf(tmp_path, default_model_dir):
    import transformers as tf

    text = make_tiny_family_model("llama4", max_position_embeddings=MAX_MODEL_LEN).config
    vision = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vision_output_dim=32,
        image_size=28,
        patch_size=14,
        projector_input_dim=32,
        projector_output_dim=32,
    )
    fields = dict(text_config=text.to_dict(), vision_config=vision)
    hf_model = random_hf_model(tf.Llama4Config, tf.Llama4ForConditionalGeneration, fields, 4)
    hf_model.save_pretrained(tmp_path)
    first, second, _ = generate_twice(str(tmp_path), default_model_dir)
    assert first == [hf_greedy(hf_model, prompt) for prompt in PROMPTS]
    assert second == first
