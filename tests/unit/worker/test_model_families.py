"""Every model family against HF transformers on tiny random weights, in float32: logits of
prefills, chunks and decodes through the paged cache, greedy tokens one for one, and TP = 2.

Prompts are longer than the sliding windows (5-7 tokens), so a window that is not applied, or
applied off by one, changes the logits; see tests/support/hf_models.py for the configs.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.services.worker.layers.attention import Attention
from kvserve.services.worker.models import load_model
from tests.support.hf_models import KINDS, VOCAB_SIZE, make_tiny_family_model
from tests.support.model_steps import (
    ATOL,
    assert_tensor_parallel_2_matches_hf,
    bind_kv_caches,
    hf_logits,
    random_tokens,
    run_step,
)
from tests.support.models import make_tiny_hf_model, saved_checkpoints

# The two Llama-file kinds whose HF comparison lives in test_model.py get greedy runs here.
GREEDY_KINDS = KINDS + ("llama3_rope", "qwen2")
NUM_BLOCKS = 16


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """kind -> (folder saved with save_pretrained, the HF model it holds), built once."""

    def make(kind: str):
        if kind in ("llama3_rope", "qwen2"):
            return make_tiny_hf_model(kind, vocab_size=VOCAB_SIZE)
        return make_tiny_family_model(kind)

    return saved_checkpoints(tmp_path_factory, make)


def _ours(model_dir: str):
    model, _ = load_model(model_dir, torch.float32, "cpu")
    bind_kv_caches(model, num_blocks=NUM_BLOCKS)
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_chunk_and_decodes_match_hf(family_checkpoint, kind):
    # A 7-token prefill, then a 5-token chunk starting mid-sequence (what a prefix-cache hit
    # or chunked prefill sends) beside another request's prompt, then decodes.
    model_dir, hf_model = family_checkpoint(kind)
    model = _ours(model_dir)
    tokens, other = random_tokens(16, VOCAB_SIZE, seed=1), random_tokens(9, VOCAB_SIZE, seed=2)
    blocks, other_blocks = [7, 3, 9, 1], [2, 11, 5]
    expected = hf_logits(hf_model, tokens)
    (first,) = run_step(model, [(tokens[:7], 0, blocks)])
    chunk, other_logits = run_step(model, [(tokens[7:12], 7, blocks), (other, 0, other_blocks)])
    decodes = [run_step(model, [([tokens[pos]], pos, blocks)])[0] for pos in range(12, 16)]
    got = torch.cat([first, chunk, *decodes])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(other_logits, hf_logits(hf_model, other), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", GREEDY_KINDS)
def test_greedy_tokens_equal_hf(family_checkpoint, kind):
    model_dir, hf_model = family_checkpoint(kind)
    model = _ours(model_dir)
    prompt = random_tokens(10, VOCAB_SIZE, seed=3)
    blocks = [4, 0, 8, 13, 6, 2, 10]
    num_new = 14
    ours = list(prompt)
    (logits,) = run_step(model, [(prompt, 0, blocks)])
    ours.append(int(logits[-1].argmax()))
    while len(ours) < len(prompt) + num_new:
        (logits,) = run_step(model, [(ours[-1:], len(ours) - 1, blocks)])
        ours.append(int(logits[0].argmax()))
    theirs = list(prompt)
    for _ in range(num_new):
        theirs.append(int(hf_logits(hf_model, theirs)[-1].argmax()))
    assert ours == theirs


def test_sliding_window_is_applied(family_checkpoint):
    # The same Mistral weights without the window would give other logits past position 5:
    # the comparison above is sensitive to the window.
    model_dir, hf_model = family_checkpoint("mistral")
    model = _ours(model_dir)
    for module in model.modules():
        if isinstance(module, Attention):
            assert module.sliding_window == hf_model.config.sliding_window
            module.sliding_window = None
    tokens = random_tokens(12, VOCAB_SIZE, seed=4)
    (logits,) = run_step(model, [(tokens, 0, [1, 2, 3])])
    expected = hf_logits(hf_model, tokens)
    torch.testing.assert_close(logits[:5], expected[:5], atol=ATOL, rtol=0)
    assert not torch.allclose(logits[6:], expected[6:], atol=1e-2)


def test_gemma_layers_alternate_windows_and_ropes(family_checkpoint):
    model_dir, _ = family_checkpoint("gemma3")
    model = _ours(model_dir)
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [7, None, 7]
    local, glob = (model.model.layers[i].self_attn.rotary_emb.cos_sin_cache for i in (0, 1))
    assert not torch.allclose(local, glob)


def test_phi3_fused_checkpoint_tensors_load_as_is(family_checkpoint):
    model_dir, hf_model = family_checkpoint("phi3")
    model = _ours(model_dir)
    attn = model.model.layers[0].self_attn
    assert torch.equal(attn.qkv_proj.weight, hf_model.model.layers[0].self_attn.qkv_proj.weight)
    mlp = model.model.layers[0].mlp
    assert torch.equal(mlp.gate_up_proj.weight, hf_model.model.layers[0].mlp.gate_up_proj.weight)


def test_gpt_oss_sinks_yarn_and_windows_are_applied(family_checkpoint):
    # The HF comparison above is sensitive to each gpt-oss change: without the sinks, or
    # with plain RoPE tables, the logits part from HF's; the windows alternate by layer.
    model_dir, hf_model = family_checkpoint("gpt_oss")
    model = _ours(model_dir)
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [hf_model.config.sliding_window, None, hf_model.config.sliding_window]
    tokens = random_tokens(12, VOCAB_SIZE, seed=4)
    expected = hf_logits(hf_model, tokens)
    (logits,) = run_step(model, [(tokens, 0, [1, 2, 3])])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    attns = [layer.self_attn.attn for layer in model.model.layers]
    sinks = [attn.sinks for attn in attns]
    for attn in attns:
        attn.sinks = None
    (no_sinks,) = run_step(model, [(tokens, 0, [1, 2, 3])])
    assert not torch.allclose(no_sinks, expected, atol=1e-2)
    for attn, sink in zip(attns, sinks):
        attn.sinks = sink
    for layer in model.model.layers:
        rotary = layer.self_attn.rotary_emb
        head_size = rotary.head_size
        inv_freq = 1.0 / 150000.0 ** (torch.arange(0, head_size, 2).float() / head_size)
        freqs = torch.outer(torch.arange(rotary.cos_sin_cache.shape[0]).float(), inv_freq)
        rotary.cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    (plain_rope,) = run_step(model, [(tokens, 0, [4, 5, 6])])
    assert not torch.allclose(plain_rope, expected, atol=1e-2)


@pytest.mark.parametrize("kind", ["gemma2", "mixtral", "deepseek_v2", "deepseek_v3", "gpt_oss"])
def test_tensor_parallel_2_matches_hf(family_checkpoint, tmp_path, kind):
    # Heads, MLP columns and each expert's intermediate dim split over two gloo ranks (MLA:
    # the heads split, every rank caches the same latent; gpt-oss: its sinks with the heads,
    # the experts' biases with their rows).
    model_dir, hf_model = family_checkpoint(kind)
    tokens_a, tokens_b = random_tokens(11, VOCAB_SIZE, seed=5), random_tokens(4, VOCAB_SIZE, 6)
    requests = [(tokens_a, 0, [0, 1, 2]), (tokens_b, 0, [3])]
    assert_tensor_parallel_2_matches_hf(tmp_path, model_dir, hf_model, requests, NUM_BLOCKS)
