"""Llama 4 text beyond the family-wide comparisons of test_model_families.py (which run the
tiny "llama4" kind of tests/support/hf_models.py: prefill, a chunk beside another prompt,
decodes, greedy tokens): each Llama 4 switch changes the logits (so that agreement with HF
tests it), TP = 2, and the multimodal checkpoint's text tower.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.services.worker.layers.rotary_embedding import get_rope
from kvserve.services.worker.models import load_model
from kvserve.services.worker.models.llama4 import Llama4ForCausalLM
from kvserve.services.worker.parallel_check import verify_parallel_sizes
from tests.support.hf_models import LLAMA4_CHUNK_SIZE, VOCAB_SIZE, make_tiny_family_model
from tests.support.model_steps import (
    ATOL,
    assert_tensor_parallel_2_matches_hf,
    bind_kv_caches,
    hf_logits,
    random_tokens,
    run_step,
)
from tests.support.models import random_hf_model

NUM_BLOCKS = 16


@pytest.fixture(scope="module")
def llama4_checkpoint(tmp_path_factory):
    hf_model = make_tiny_family_model("llama4")
    model_dir = str(tmp_path_factory.mktemp("tiny-llama4"))
    hf_model.save_pretrained(model_dir)
    return model_dir, hf_model


def _ours(model_dir: str):
    model, hf_config = load_model(model_dir, torch.float32, "cpu")
    bind_kv_caches(model, num_blocks=NUM_BLOCKS)
    return model, hf_config


def test_layers_take_the_config_switches(llama4_checkpoint):
    model, _ = _ours(llama4_checkpoint[0])
    rope_layer, nope_layer = (layer.self_attn for layer in model.model.layers)
    assert rope_layer.attn.attention_chunk_size == LLAMA4_CHUNK_SIZE
    assert rope_layer.rotary_emb is not None and rope_layer.q_norm is not None
    assert rope_layer.query_scale is None
    assert nope_layer.attn.attention_chunk_size is None and nope_layer.rotary_emb is None
    assert nope_layer.q_norm is None and nope_layer.query_scale is not None
    positions = torch.tensor([0, 2, 3, 7, 15])  # floor_scale 4: steps 0, 0, 1, 2, 4
    expected = 1 + 0.5 * torch.log1p(torch.tensor([0.0, 0.0, 1.0, 2.0, 4.0]))
    torch.testing.assert_close(nope_layer.query_scale(positions), expected)
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert type(model.model.layers[1].mlp).__name__ == "Llama4MoE"


@pytest.mark.parametrize("switch", ["chunks", "temperature", "qk_norm", "pair_layout"])
def test_each_switch_changes_the_logits(llama4_checkpoint, switch):
    # Our model matches HF over 16 tokens (chunks of 6 at 0, 6, 12); with one switch turned
    # off it no longer does, past the first chunk or at once.
    model_dir, hf_model = llama4_checkpoint
    model, _ = _ours(model_dir)
    tokens = random_tokens(16, VOCAB_SIZE, seed=7)
    expected = hf_logits(hf_model, tokens)
    (logits,) = run_step(model, [(tokens, 0, [1, 2, 3, 4])])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    rope_layer, nope_layer = (layer.self_attn for layer in model.model.layers)
    if switch == "chunks":
        rope_layer.attn.attention_chunk_size = None
    elif switch == "temperature":
        nope_layer.query_scale = None
    elif switch == "qk_norm":
        rope_layer.q_norm = rope_layer.k_norm = None
    else:  # q/k rows in HF's (even, odd) pair order, rotated as halves
        q_size, kv_size = rope_layer.q_size, rope_layer.kv_size
        weight = rope_layer.qkv_proj.weight.data
        for start, rows, heads in ((0, q_size, 4), (q_size, kv_size, 2)):
            block = weight[start : start + rows].reshape(heads, 2, 8, -1)
            weight[start : start + rows] = block.transpose(1, 2).reshape(rows, -1)
    (changed,) = run_step(model, [(tokens, 0, [5, 6, 7, 8])])
    first = LLAMA4_CHUNK_SIZE if switch == "chunks" else 0
    torch.testing.assert_close(changed[:first], expected[:first], atol=ATOL, rtol=0)
    assert not torch.allclose(changed[first:], expected[first:], atol=1e-2)


def test_chunks_beside_decodes_in_one_step_match_hf(llama4_checkpoint):
    # A prefill chunk that starts mid attention-chunk (position 7) and crosses into the next
    # (12) shares its steps with another request's decodes, as chunked prefill schedules them.
    model_dir, hf_model = llama4_checkpoint
    model, _ = _ours(model_dir)
    a, b = random_tokens(15, VOCAB_SIZE, seed=11), random_tokens(12, VOCAB_SIZE, seed=12)
    a_blocks, b_blocks = [9, 2, 14, 5], [7, 0, 11]
    a_first, b_first = run_step(model, [(a[:7], 0, a_blocks), (b[:9], 0, b_blocks)])
    b_second, a_chunk = run_step(model, [(b[9:10], 9, b_blocks), (a[7:13], 7, a_blocks)])
    a_rest, b_rest = [], []
    for offset in range(2):
        a_logits, b_logits = run_step(
            model, [(a[13 + offset : 14 + offset], 13 + offset, a_blocks),
                    (b[10 + offset : 11 + offset], 10 + offset, b_blocks)]
        )  # fmt: skip
        a_rest.append(a_logits)
        b_rest.append(b_logits)
    got_a = torch.cat([a_first, a_chunk, *a_rest])
    got_b = torch.cat([b_first, b_second, *b_rest])
    torch.testing.assert_close(got_a, hf_logits(hf_model, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_b, hf_logits(hf_model, b), atol=ATOL, rtol=0)


def test_tensor_parallel_2_matches_hf(llama4_checkpoint, tmp_path):
    # Heads, the dense MLP's and the shared expert's columns and each expert's intermediate
    # dim split over two gloo ranks.
    model_dir, hf_model = llama4_checkpoint
    tokens_a, tokens_b = random_tokens(15, VOCAB_SIZE, seed=5), random_tokens(4, VOCAB_SIZE, 6)
    requests = [(tokens_a, 0, [0, 1, 2, 3]), (tokens_b, 0, [4])]
    assert_tensor_parallel_2_matches_hf(tmp_path, model_dir, hf_model, requests, NUM_BLOCKS)


def test_tensor_parallel_size_must_divide_the_dense_mlp(llama4_checkpoint):
    config = llama4_checkpoint[1].config
    config_copy = type(config)(**{**config.to_dict(), "intermediate_size_mlp": 90})
    with pytest.raises(ValueError, match="intermediate_size_mlp=90"):
        verify_parallel_sizes(config_copy, 4, 1)


def test_multimodal_checkpoint_serves_its_text_tower(tmp_path):
    # Llama4ForConditionalGeneration's language_model.* weights; the vision tower is skipped
    # and the engine gets the text config.
    import transformers as tf

    text = make_tiny_family_model("llama4").config.to_dict()
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
    fields = dict(text_config=text, vision_config=vision)
    hf_model = random_hf_model(tf.Llama4Config, tf.Llama4ForConditionalGeneration, fields, 3)
    hf_model.save_pretrained(tmp_path)
    model, hf_config = _ours(str(tmp_path))
    assert type(model).__name__ == "Llama4ForConditionalGeneration"
    assert hf_config.model_type == "llama4_text" and hf_config.vocab_size == VOCAB_SIZE
    tokens = random_tokens(13, VOCAB_SIZE, seed=8)
    (logits,) = run_step(model, [(tokens[:9], 0, [3, 4, 5, 6])])
    (rest,) = run_step(model, [(tokens[9:], 9, [3, 4, 5, 6])])
    torch.testing.assert_close(
        torch.cat([logits, rest]), hf_logits(hf_model, tokens), atol=ATOL, rtol=0
    )


def test_the_native_decode_stack_says_what_it_does_not_cover(llama4_checkpoint):
    # The C decode stack has no chunks, NoPE or L2 norms: it stays off and says which, and
    # decode steps run the modules (the comparisons above).
    from kvserve.services.worker.models.native_decode import bind_decode_stack

    model, _ = _ours(llama4_checkpoint[0])
    rope_layer, nope_layer = (layer.self_attn for layer in model.model.layers)
    assert "per-head q/k norms" in bind_decode_stack(model, torch.float32, 8)
    rope_layer.q_norm = rope_layer.k_norm = None
    assert "chunked local attention" in bind_decode_stack(model, torch.float32, 8)
    rope_layer.attn.attention_chunk_size = None
    assert "layers without RoPE" in bind_decode_stack(model, torch.float32, 8)
    nope_layer.rotary_emb = rope_layer.rotary_emb
    assert "per-position query scale" in bind_decode_stack(model, torch.float32, 8)
    assert model.model.decode_stack is None


def test_scout_rope_scaling_matches_hf():
    # Llama 4 Scout's llama3 scaling has low_freq_factor == high_freq_factor (no blend band:
    # a 0 / 0 that must not leak NaN); head_dim 128, theta 5e5, original context 8192.
    import transformers as tf
    from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 16.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    }
    config = tf.Llama4TextConfig(
        hidden_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        num_hidden_layers=4,
        max_position_embeddings=16384,
        rope_parameters=rope,
    )
    theirs = Llama4TextRotaryEmbedding(config).inv_freq
    params = Llama4ForCausalLM.rope_parameters(config, 0)
    assert params is not None and Llama4ForCausalLM.rope_parameters(config, 3) is None
    ours = get_rope(128, 16384, params).cos_sin_cache
    positions = torch.tensor([1.0, 1000.0, 9000.0, 16383.0])
    angles = positions[:, None] * theirs[None, :]
    torch.testing.assert_close(ours[positions.long(), :64], angles.cos(), atol=1e-4, rtol=0)
    torch.testing.assert_close(ours[positions.long(), 64:], angles.sin(), atol=1e-4, rtol=0)
    assert not ours.isnan().any()
