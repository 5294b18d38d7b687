"""An fp8 KV cache (--kv-cache-dtype) under a whole model: the default model's teacher-forced
next-token choices with fp8 K/V against the same model's float K/V (chunked prefill and
decodes, so every step reads K/V written by earlier ones), the checkpoint's K/V scales loaded
onto the layers, the KV budget at one byte an element, and MLA refused."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.services.worker.kv_scales import check_layers_take, resolve_kv_cache_dtype
from kvserve.services.worker.layers.attention import Attention, kv_cache_bytes_per_block
from kvserve.services.worker.models import load_model
from tests.support.model_steps import run_step

# English prose: teacher forcing on text the model predicts well (random tokens give flat,
# tie-prone distributions where top-1 flips on noise).
TEXT = (
    "The river starts high in the mountains, where snow melts in the spring and runs down "
    "through narrow valleys. Farmers along its banks have grown wheat and barley for "
    "centuries, and the old stone bridges still carry carts to the market towns. In the "
    "summer, children swim in the shallow pools while their parents sell fruit and bread in "
    "the square. The town council meets every Tuesday to discuss the roads, the school and the "
    "price of water. Last year they voted to build a new library next to the church, and the "
    "work began in the autumn. Most people agree that the library will be good for the town, "
    "although some worry about the cost. The builders expect to finish before the winter, when "
    "the first students from the village school will come to read and study there. Travellers "
    "who visit the region often say that the food is simple but very good, and that the people "
    "are kind and patient with strangers who do not speak the local language."
)
BLOCK_SIZE = 16
# Prefill chunks (the later ones behind a cached context), then one token a step.
CHUNKS = (40, 72, 44)
NUM_DECODES = 8


def _bind(model: torch.nn.Module, kv_dtype: torch.dtype, num_blocks: int) -> None:
    for module in model.modules():
        if isinstance(module, Attention):
            module.kv_cache = module.kv_cache_spec().allocate(
                num_blocks, BLOCK_SIZE, kv_dtype, "cpu"
            )


def _teacher_forced_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log-softmax [len - 1, vocab] of every position, over chunks then decodes."""
    block_ids = list(range(-(-len(token_ids) // BLOCK_SIZE)))
    logits, done = [], 0
    steps = [*CHUNKS, *[1] * (len(token_ids) - sum(CHUNKS))]
    for length in steps:
        (step,) = run_step(model, [(token_ids[done : done + length], done, block_ids)], BLOCK_SIZE)
        logits.append(step)
        done += length
    return torch.cat(logits)[:-1].log_softmax(dim=-1)


@pytest.fixture(scope="module")
def token_ids(default_model_dir) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model_dir).encode(TEXT)
    assert len(ids) >= sum(CHUNKS) + NUM_DECODES
    return ids[: sum(CHUNKS) + NUM_DECODES]


@pytest.mark.slow
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_default_model_fp8_kv_agrees_with_float_kv(default_model_dir, token_ids, model_dtype):
    model, _ = load_model(default_model_dir, model_dtype, "cpu")
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    _bind(model, model_dtype, num_blocks)
    reference = _teacher_forced_logprobs(model, token_ids)
    targets = torch.tensor(token_ids[1:])
    # fp8 = e4m3 (e5m2's 2 mantissa bits agree less: bench/fp8_kv_cache.py reports both).
    _bind(model, torch.float8_e4m3fn, num_blocks)
    logprobs = _teacher_forced_logprobs(model, token_ids)
    # A position agrees when the fp8 run's choice is a top-1 of the reference: a bfloat16
    # model's logits (widened from bfloat16) often tie exactly, and argmax's pick among tied
    # tokens is arbitrary (on a Zen 4 with AVX512-BF16, 8 of 26 "flips" over a longer text
    # were exact ties).
    chosen = reference.gather(1, logprobs.argmax(-1, keepdim=True))[:, 0]
    agreement = (chosen == reference.max(-1).values).float().mean().item()
    delta = (logprobs - reference).gather(1, targets[:, None]).abs().mean().item()
    assert agreement >= 0.95 and delta < 0.1, (agreement, delta)


def test_checkpoint_scales_load_onto_the_layers(tiny_checkpoint, tmp_path):
    model_dir, _ = tiny_checkpoint("llama")
    folder = tmp_path / "scaled"
    shutil.copytree(model_dir, folder)
    weights = load_file(os.path.join(folder, "model.safetensors"))
    # vLLM's three spellings: k_scale / v_scale, ModelOpt's k_proj.k_scale, the old kv_scale.
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    weights["model.layers.0.self_attn.v_proj.v_scale"] = torch.tensor([0.5])
    weights["model.layers.1.self_attn.kv_scale"] = torch.tensor(2.0)
    save_file(weights, os.path.join(folder, "model.safetensors"))
    model, _ = load_model(str(folder), torch.float32, "cpu")
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert [(layer.k_scale, layer.v_scale) for layer in layers] == [(0.25, 0.5), (2.0, 2.0)]


def test_scales_of_more_than_one_element_are_refused(tiny_checkpoint, tmp_path):
    model_dir, _ = tiny_checkpoint("llama")
    folder = tmp_path / "per-head"
    shutil.copytree(model_dir, folder)
    weights = load_file(os.path.join(folder, "model.safetensors"))
    weights["model.layers.0.self_attn.k_scale"] = torch.ones(2)
    save_file(weights, os.path.join(folder, "model.safetensors"))
    with pytest.raises(ValueError, match="self_attn.k_scale has 2 elements"):
        load_model(str(folder), torch.float32, "cpu")


def test_kv_dtype_resolution_and_budget():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    with pytest.raises(ValueError, match="'int4' is not one of"):
        resolve_kv_cache_dtype("int4", torch.float32)
    layers = [Attention(4, 16, 0.25, 2) for _ in range(3)]
    per_block = {
        dtype: kv_cache_bytes_per_block(layers, BLOCK_SIZE, dtype)
        for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
    }
    assert per_block[torch.float8_e4m3fn] == 3 * 2 * BLOCK_SIZE * 2 * 16  # one byte a value
    assert 2 * per_block[torch.float8_e4m3fn] == per_block[torch.bfloat16]
    assert 4 * per_block[torch.float8_e4m3fn] == per_block[torch.float32]


def test_mla_latent_cache_refuses_fp8():
    from kvserve.services.worker.layers.mla_attention import MLAAttention

    layers = [MLAAttention(4, 32, 16, 8, 16, 0.2)]
    check_layers_take(torch.bfloat16, layers)
    with pytest.raises(ValueError, match="MLAAttention .multi-head latent attention"):
        check_layers_take(torch.float8_e4m3fn, layers)


def test_native_decode_stack_declines_an_fp8_cache(tiny_checkpoint):
    from kvserve.services.worker.models.native_decode import bind_decode_stack

    model, _ = load_model(tiny_checkpoint("llama")[0], torch.float32, "cpu")
    _bind(model, torch.float8_e4m3fn, 4)
    status = bind_decode_stack(model, torch.float32, 8)
    assert "torch.float8_e4m3fn KV cache (--kv-cache-dtype)" in status, status
