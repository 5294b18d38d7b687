"""DeepSeek's multi-head latent attention beyond the HF comparisons of test_model_families.py:
the cache it binds is the latent (one row of kv_lora_rank + qk_rope_head_dim per token, not
per-head K and V), the KV store moves blocks of that layout, the native decode stack
declines it, and configs it cannot serve are refused by name."""

from __future__ import annotations

import pytest
import torch

from kvserve.services.kv_store.blocks import (
    check_kv_caches,
    copy_blocks_to_slots,
    copy_slots_to_blocks,
    slots_view,
)
from kvserve.services.worker.layers.attention import (
    Attention,
    bind_kv_caches,
    kv_cache_bytes_per_block,
)
from kvserve.services.worker.layers.mla_attention import MLAAttention
from kvserve.services.worker.models import load_model
from kvserve.services.worker.models.native_decode import bind_decode_stack
from kvserve.shared.messages import KvFingerprint
from tests.support.hf_models import VOCAB_SIZE, make_tiny_family_model
from tests.support.model_steps import build_step, hf_logits, random_tokens, run_step
from tests.support.models import saved_checkpoints

NUM_BLOCKS, BLOCK_SIZE = 16, 16
LATENT_ROW = 32 + 8  # kv_lora_rank + qk_rope_head_dim of the tiny configs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return saved_checkpoints(tmp_path_factory, make_tiny_family_model)


def _bound(model_dir: str):
    model, hf_config = load_model(model_dir, torch.float32, "cpu")
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    caches = bind_kv_caches(layers, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    return model, hf_config, layers, caches


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_the_cache_is_one_latent_row_per_token(checkpoint, kind):
    model_dir, _ = checkpoint(kind)
    _, config, layers, caches = _bound(model_dir)
    assert len(layers) == config.num_hidden_layers
    assert all(isinstance(layer, MLAAttention) for layer in layers)
    assert {tuple(c.shape) for c in caches} == {(1, NUM_BLOCKS, BLOCK_SIZE, 1, LATENT_ROW)}
    per_block = kv_cache_bytes_per_block(layers, BLOCK_SIZE, torch.float32)
    assert per_block == config.num_hidden_layers * BLOCK_SIZE * LATENT_ROW * 4
    # The same model with full K and V per head: 4 heads x (24 + 16) per token, 4x more.
    full_row = config.num_attention_heads * (
        config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    )
    assert full_row == 4 * LATENT_ROW


def test_a_prefix_read_back_from_the_latent_cache_gives_hf_logits(checkpoint):
    # The first request writes 2 full blocks; a second one whose block table starts with
    # them (a prefix-cache hit) computes only its tail over the cached latent rows.
    model_dir, hf_model = checkpoint("deepseek_v3")
    model, _, _, caches = _bound(model_dir)
    tokens = random_tokens(40, VOCAB_SIZE, seed=7)
    run_step(model, [(tokens[:32], 0, [5, 2])], BLOCK_SIZE)
    written = [c[0, [5, 2]] for c in caches]
    (tail,) = run_step(model, [(tokens[32:], 32, [5, 2, 9])], BLOCK_SIZE)
    torch.testing.assert_close(tail, hf_logits(hf_model, tokens)[32:], atol=1e-4, rtol=0)
    assert all(torch.equal(c[0, [5, 2]], w) for c, w in zip(caches, written))
    assert all(c[0, 9, :8].abs().sum() > 0 and not c[0, 9, 8:].any() for c in caches)


@pytest.mark.parametrize("path", ["expanded", "absorbed"])
@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_both_attention_paths_give_hf_logits(checkpoint, kind, path):
    # The same steps with every prefill step forced down one path: two fresh prompts side by
    # side, then one continuing over 2 cached rows (the expanded path gathers them), then a
    # decode (always absorbed).
    model_dir, hf_model = checkpoint(kind)
    model, _, layers, _ = _bound(model_dir)
    for layer in layers:
        layer.expand_min_tokens_per_request = 0 if path == "expanded" else float("inf")
    first, other = random_tokens(33, VOCAB_SIZE, seed=11), random_tokens(12, VOCAB_SIZE, seed=12)
    steps = [
        [(first[:2], 0, [6, 1, 9]), (other, 0, [3])],
        [(first[2:32], 2, [6, 1, 9])],
        [(first[32:], 32, [6, 1, 9, 4])],
    ]
    logits = []
    for requests in steps:
        _, _, metadata = build_step(requests, BLOCK_SIZE)
        num_tokens = sum(len(tokens) for tokens, _, _ in requests)
        taken = "expanded" if layers[0].expands(metadata, num_tokens) else "absorbed"
        assert taken == (path if metadata.max_query_len > 1 else "absorbed")
        logits.append(run_step(model, requests, BLOCK_SIZE))
    got = torch.cat([logits[0][0], logits[1][0], logits[2][0]])
    torch.testing.assert_close(got, hf_logits(hf_model, first), atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[0][1], hf_logits(hf_model, other), atol=1e-4, rtol=0)


def test_long_fresh_prompts_expand_and_long_contexts_do_not(checkpoint):
    # The tiny layout's break-even: 32 new tokens a request (L (Dn + Dv) / (2 (L - Dn))).
    model_dir, _ = checkpoint("deepseek_v2")
    _, _, (layer, *_), _ = _bound(model_dir)
    assert layer.expand_min_tokens_per_request == 32
    fresh = build_step([(random_tokens(40, VOCAB_SIZE, 1), 0, [1, 2, 3])], BLOCK_SIZE)[2]
    assert layer.expands(fresh, 40)
    short = build_step([(random_tokens(20, VOCAB_SIZE, 1), 0, [1, 2])], BLOCK_SIZE)[2]
    assert not layer.expands(short, 20)
    # 40 new tokens behind 32 cached: expanding would recompute the cached rows' K and V.
    behind = build_step([(random_tokens(40, VOCAB_SIZE, 1), 32, [1, 2, 3, 4, 5])], BLOCK_SIZE)
    assert not layer.expands(behind[2], 40)


@pytest.mark.parametrize("path", ["expanded", "absorbed"])
def test_prompts_before_the_cache_is_bound_give_hf_logits(checkpoint, path):
    # The memory-profile run: no cache yet, each prompt attends over its own latent rows.
    model_dir, hf_model = checkpoint("deepseek_v2")
    model, _ = load_model(model_dir, torch.float32, "cpu")
    for layer in model.modules():
        if isinstance(layer, MLAAttention):
            layer.expand_min_tokens_per_request = 0 if path == "expanded" else float("inf")
    first, second = random_tokens(11, VOCAB_SIZE, seed=9), random_tokens(6, VOCAB_SIZE, seed=10)
    got = run_step(model, [(first, 0, [1, 2, 3]), (second, 0, [4, 5])])
    torch.testing.assert_close(got[0], hf_logits(hf_model, first), atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1], hf_logits(hf_model, second), atol=1e-4, rtol=0)


def test_v3_rope_on_halves_gives_hf_logits(tmp_path):
    # rope_interleave false: V3's RoPE on the two halves of the rope features, not on pairs.
    hf_model = make_tiny_family_model("deepseek_v3", rope_interleave=False)
    hf_model.save_pretrained(tmp_path)
    model, _, _, _ = _bound(str(tmp_path))
    tokens = random_tokens(14, VOCAB_SIZE, seed=13)
    (prefill,) = run_step(model, [(tokens[:10], 0, [2, 7])], BLOCK_SIZE)
    decodes = [run_step(model, [([tokens[p]], p, [2, 7])], BLOCK_SIZE)[0] for p in range(10, 14)]
    got = torch.cat([prefill, *decodes])
    torch.testing.assert_close(got, hf_logits(hf_model, tokens), atol=1e-4, rtol=0)


def test_the_kv_store_moves_latent_blocks(checkpoint):
    model_dir, _ = checkpoint("deepseek_v2")
    model, _, layers, caches = _bound(model_dir)
    run_step(model, [(random_tokens(40, VOCAB_SIZE, seed=8), 0, [3, 6, 1])], BLOCK_SIZE)
    fingerprint = KvFingerprint(
        model="tiny-mla",
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_layers=len(layers),
        num_kv_heads=1,
        head_size=LATENT_ROW,
        num_planes=1,
    )
    check_kv_caches(caches, fingerprint)
    assert fingerprint.block_bytes == kv_cache_bytes_per_block(layers, BLOCK_SIZE, torch.float32)
    with pytest.raises(ValueError, match=r"needs \[2, num_blocks"):
        check_kv_caches(caches, KvFingerprint(**{**_fields(fingerprint), "num_planes": 2}))
    view = slots_view(bytearray(4 * fingerprint.block_bytes), fingerprint, torch.float32)
    copy_blocks_to_slots(caches, [3, 6, 1], view, [0, 1, 3])
    loaded = [torch.zeros_like(c) for c in caches]
    copy_slots_to_blocks(view, [0, 1, 3], loaded, [8, 4, 12])
    for cache, copy in zip(caches, loaded):
        assert cache[0, 3].abs().sum() > 0
        assert torch.equal(copy[:, [8, 4, 12]], cache[:, [3, 6, 1]])


def _fields(fingerprint: KvFingerprint) -> dict:
    return {name: getattr(fingerprint, name) for name in fingerprint.__struct_fields__}


def test_the_native_decode_stack_declines_latent_attention(checkpoint):
    model_dir, _ = checkpoint("deepseek_v2")
    model, _, _, _ = _bound(model_dir)
    status = bind_decode_stack(model, torch.float32, max_requests=4)
    assert status.startswith("off") and "DeepseekV2Attention" in status, status
    assert model.model.decode_stack is None


def test_configs_it_cannot_serve_are_refused_by_name(tmp_path):
    from kvserve.services.worker.models.deepseek_v2 import DeepseekRotary, DeepseekV2Router

    with pytest.raises(ValueError, match="rope_type 'longrope'"):
        DeepseekRotary(8, 64, {"rope_type": "longrope", "rope_theta": 1e4}, interleave=True)
    config = make_tiny_family_model("deepseek_v2").config
    config.topk_method = "noaux_tc"
    with pytest.raises(ValueError, match="topk_method 'noaux_tc'"):
        DeepseekV2Router(config)
