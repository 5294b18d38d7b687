"""Our Llama-family forward over the paged KV cache against HF transformers (fp32)."""

from __future__ import annotations

import pytest
import torch

from kvserve.services.worker.layers.attention import Attention
from kvserve.services.worker.models import load_model
from tests.support.model_steps import (
    ATOL,
    BLOCK_SIZE,
    NUM_BLOCKS,
    assert_tensor_parallel_2_matches_hf,
    bind_kv_caches,
    hf_logits,
    random_tokens,
    run_step,
)

TINY_KINDS = ("llama", "llama3_rope", "qwen2")  # see tests/support/models.make_tiny_hf_model


@pytest.fixture
def tiny(tiny_checkpoint, request):
    """(our model with bound KV caches, the HF model) of one tiny checkpoint kind."""
    model_dir, hf_model = tiny_checkpoint(request.param)
    model, _ = load_model(model_dir, torch.float32, "cpu")
    bind_kv_caches(model)
    return model, hf_model


@pytest.mark.parametrize("tiny", TINY_KINDS, indirect=True)
def test_single_prefill_matches_hf(tiny):
    model, hf_model = tiny
    tokens = random_tokens(7, 96, seed=0)
    (logits,) = run_step(model, [(tokens, 0, [5, 2])])
    torch.testing.assert_close(logits, hf_logits(hf_model, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("tiny", TINY_KINDS, indirect=True)
def test_two_prefills_in_one_call_match_hf(tiny):
    model, hf_model = tiny
    tokens_a, tokens_b = random_tokens(5, 96, seed=1), random_tokens(9, 96, seed=2)
    logits_a, logits_b = run_step(model, [(tokens_a, 0, [3, 1]), (tokens_b, 0, [0, 4, 2])])
    torch.testing.assert_close(logits_a, hf_logits(hf_model, tokens_a), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits_b, hf_logits(hf_model, tokens_b), atol=ATOL, rtol=0)


@pytest.mark.parametrize("tiny", TINY_KINDS, indirect=True)
def test_decode_after_prefill_matches_hf(tiny):
    model, hf_model = tiny
    tokens = random_tokens(10, 96, seed=3)
    block_ids = [7, 3, 9]
    expected = hf_logits(hf_model, tokens)
    (prefill,) = run_step(model, [(tokens[:5], 0, block_ids)])
    torch.testing.assert_close(prefill, expected[:5], atol=ATOL, rtol=0)
    for pos in range(5, len(tokens)):
        (decode,) = run_step(model, [([tokens[pos]], pos, block_ids)])
        torch.testing.assert_close(decode[0], expected[pos], atol=ATOL, rtol=0)


@pytest.mark.parametrize("tiny", ["llama"], indirect=True)
def test_decode_beside_chunked_prefill_matches_hf(tiny):
    # Step 1: A's prompt + B's first chunk; step 2: A decodes, B's second chunk; step 3: both
    # decode. Every token's logits must equal HF's at its position.
    model, hf_model = tiny
    tokens_a, tokens_b = random_tokens(8, 96, seed=4), random_tokens(9, 96, seed=5)
    blocks_a, blocks_b = [1, 6], [8, 2, 10]
    expected_a, expected_b = hf_logits(hf_model, tokens_a), hf_logits(hf_model, tokens_b)
    got_a1, got_b1 = run_step(model, [(tokens_a[:6], 0, blocks_a), (tokens_b[:3], 0, blocks_b)])
    got_a2, got_b2 = run_step(model, [(tokens_a[6:7], 6, blocks_a), (tokens_b[3:8], 3, blocks_b)])
    got_a3, got_b3 = run_step(model, [(tokens_a[7:8], 7, blocks_a), (tokens_b[8:9], 8, blocks_b)])
    torch.testing.assert_close(torch.cat([got_a1, got_a2, got_a3]), expected_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([got_b1, got_b2, got_b3]), expected_b, atol=ATOL, rtol=0)


def test_attention_without_kv_cache_matches_hf(tiny_checkpoint):
    # The runner's memory-profile pass runs prompts before any cache is bound.
    model_dir, hf_model = tiny_checkpoint("llama")
    model, _ = load_model(model_dir, torch.float32, "cpu")
    tokens_a, tokens_b = random_tokens(6, 96, seed=6), random_tokens(3, 96, seed=7)
    logits_a, logits_b = run_step(model, [(tokens_a, 0, [0, 0]), (tokens_b, 0, [0])])
    torch.testing.assert_close(logits_a, hf_logits(hf_model, tokens_a), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits_b, hf_logits(hf_model, tokens_b), atol=ATOL, rtol=0)


def test_fused_and_tied_parameters(tiny_checkpoint):
    model_dir, hf_model = tiny_checkpoint("qwen2")
    model, hf_config = load_model(model_dir, torch.float32, "cpu")
    assert hf_config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    attn, hf_attn = model.model.layers[1].self_attn, hf_model.model.layers[1].self_attn
    torch.testing.assert_close(
        attn.qkv_proj.bias,
        torch.cat([hf_attn.q_proj.bias, hf_attn.k_proj.bias, hf_attn.v_proj.bias]),
        atol=0,
        rtol=0,
    )
    assert attn.o_proj.bias is None
    hf_mlp = hf_model.model.layers[1].mlp
    torch.testing.assert_close(
        model.model.layers[1].mlp.gate_up_proj.weight,
        torch.cat([hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight]),
        atol=0,
        rtol=0,
    )


def test_load_weights_rejects_unknown_and_missing_tensors(tiny_checkpoint):
    from kvserve.services.worker.models import iterate_safetensors

    model_dir, _ = tiny_checkpoint("llama")
    model, _ = load_model(model_dir, torch.float32, "cpu")
    weights = list(iterate_safetensors(model_dir))
    with pytest.raises(ValueError, match="matches no parameter"):
        model.load_weights(weights + [("model.layers.0.mlp.fc9.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="lacks 1 parameters"):
        model.load_weights([(n, w) for n, w in weights if n != "model.norm.weight"])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])


def test_bfloat16_model_keeps_float32_rope_and_logits(tiny_checkpoint):
    model_dir, hf_model = tiny_checkpoint("llama")
    model, _ = load_model(model_dir, torch.bfloat16, "cpu")
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32
    for module in model.modules():
        if isinstance(module, Attention):
            module.kv_cache = torch.zeros(
                2,
                NUM_BLOCKS,
                BLOCK_SIZE,
                module.num_kv_heads,
                module.head_size,
                dtype=torch.bfloat16,
            )
    tokens = random_tokens(6, 96, seed=8)
    (logits,) = run_step(model, [(tokens, 0, [4, 5])])
    expected = hf_logits(hf_model, tokens)
    assert (logits - expected).abs().max() < 0.05 * expected.abs().max()


def test_tensor_parallel_2_matches_hf(tiny_checkpoint, tmp_path):
    # Two gloo ranks each hold half of every layer; the all-reduced result must equal HF.
    model_dir, hf_model = tiny_checkpoint("qwen2")
    tokens_a, tokens_b = random_tokens(5, 96, seed=9), random_tokens(7, 96, seed=10)
    requests = [(tokens_a, 0, [0, 1]), (tokens_b, 0, [2, 3])]
    assert_tensor_parallel_2_matches_hf(tmp_path, model_dir, hf_model, requests)


@pytest.mark.slow
def test_default_model_matches_hf_greedy(default_model_dir):
    # The folder every engine serves (the session's cache), not smollm2_dir's fresh
    # conversion: test_model_loader.py tests the conversion, and under pytest-xdist it may
    # run in another worker, which would convert the GGUF (~16 CPU s) a second time.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_dict=True,
    )["input_ids"]
    model, _ = load_model(default_model_dir, torch.float32, "cpu")
    bind_kv_caches(model, num_blocks=8, block_size=16)
    hf_model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    block_ids = [3, 1, 6, 0]
    (logits,) = run_step(model, [(prompt_ids, 0, block_ids)], block_size=16)
    torch.testing.assert_close(logits, hf_logits(hf_model, prompt_ids), atol=1e-3, rtol=0)
    # Greedy decode through the paged cache equals HF's greedy generate, token for token.
    token_ids = list(prompt_ids) + [int(logits[-1].argmax())]
    for _ in range(7):
        (step,) = run_step(model, [(token_ids[-1:], len(token_ids) - 1, block_ids)], block_size=16)
        token_ids.append(int(step[0].argmax()))
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False)[
            0
        ].tolist()
    assert token_ids == expected, tokenizer.decode(token_ids[len(prompt_ids) :])
