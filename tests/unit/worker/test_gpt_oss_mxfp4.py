"""gpt-oss with MXFP4 experts (the published checkpoints' layout): held as stored against the
float expansion of the same checkpoint, and the expansion against HF transformers.

The tiny checkpoint (tests/support/mxfp4.py) holds every expert as MXFP4 blocks + e8m0
exponents; the HF model beside it has those experts dequantized by transformers' own code, so
`quantization="none"` (our expansion) must give HF's logits, and the held path must give the
expansion's: at float32 rounding with KVSERVE_QUANT_ACTIVATIONS=float32 (the kernel expands
weight tiles), within activation-quantization error with the default int8 activations
(teacher-forced top-1 agreement and mean |delta logprob|, as the GGUF tests measure).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvserve.kernels.quant import QuantizedTensor
from kvserve.services.worker.layers.gpt_oss_moe import GptOssExperts
from kvserve.services.worker.models import load_model
from kvserve.services.worker.quantization import weight_bytes
from tests.support.hf_models import VOCAB_SIZE
from tests.support.model_steps import (
    ATOL,
    assert_tensor_parallel_2_matches_hf,
    bind_kv_caches,
    hf_logits,
    random_tokens,
    run_step,
)
from tests.support.mxfp4 import make_mxfp4_gpt_oss

NUM_BLOCKS = 24
# Measured on this checkpoint (12 sequences x 48 teacher-forced positions): int8 activations
# agree with the expansion's argmax on 97.4 % of positions, mean |delta logprob| 0.023 (0.9 is
# 11 binomial standard deviations below). A wrong nibble order, exponent bias or gate/up split
# gives near-chance agreement (1/128) and deltas of nats.
MIN_TOP1_AGREEMENT = 0.9
MAX_MEAN_ABS_DELTA = 0.05


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("gpt-oss-mxfp4"))
    hf_model = make_mxfp4_gpt_oss(model_dir)
    return model_dir, hf_model


def _ours(model_dir: str, quantization: str | None = None):
    model, _ = load_model(model_dir, torch.float32, "cpu", quantization)
    bind_kv_caches(model, num_blocks=NUM_BLOCKS)
    return model


def _steps(model, tokens: list[int], blocks: list[int]) -> torch.Tensor:
    """Logits of a 7-token prefill, a 5-token chunk, then decodes to the end of tokens."""
    (first,) = run_step(model, [(tokens[:7], 0, blocks)])
    (chunk,) = run_step(model, [(tokens[7:12], 7, blocks)])
    decodes = [run_step(model, [([tokens[p]], p, blocks)])[0] for p in range(12, len(tokens))]
    return torch.cat([first, chunk, *decodes])


def test_the_checkpoint_is_detected_and_its_experts_held_as_stored(mxfp4_checkpoint):
    model_dir, _ = mxfp4_checkpoint
    held, expanded = _ours(model_dir), _ours(model_dir, "none")
    named = _ours(model_dir, "mxfp4")  # what the checkpoint asks for, asked for by name
    assert all(
        m.quantized for m in named.modules() if isinstance(m, GptOssExperts)
    ) and weight_bytes(named) == weight_bytes(held)
    experts = [m for m in held.modules() if isinstance(m, GptOssExperts)]
    assert experts and all(e.quantized and e.w13_weight.dtype == torch.uint8 for e in experts)
    w13, w2 = experts[0].held_experts()[1]
    assert isinstance(w13, QuantizedTensor) and w13.qtype == "MXFP4" and w13.shape == (256, 64)
    assert w2.shape == (64, 128)
    float_experts = [m for m in expanded.modules() if isinstance(m, GptOssExperts)]
    assert not any(e.quantized for e in float_experts)
    # [gate ; up] rows of expert 1, held blocks expanded = the float expansion's rows
    torch.testing.assert_close(w13.dequantize(), float_experts[0].w13_weight[1], atol=0, rtol=0)
    torch.testing.assert_close(w2.dequantize(), float_experts[0].w2_weight[1], atol=0, rtol=0)
    # expert bytes: 17 per 32 weights against 128 in float32
    assert weight_bytes(held) < weight_bytes(expanded) * 0.6


def test_float_expansion_matches_hf(mxfp4_checkpoint):
    model_dir, hf_model = mxfp4_checkpoint
    tokens = random_tokens(16, VOCAB_SIZE, seed=1)
    got = _steps(_ours(model_dir, "none"), tokens, [7, 3, 9, 1])
    torch.testing.assert_close(got, hf_logits(hf_model, tokens), atol=ATOL, rtol=0)


def test_held_with_float32_activations_equals_the_expansion(mxfp4_checkpoint, monkeypatch):
    monkeypatch.setenv("KVSERVE_QUANT_ACTIVATIONS", "float32")
    model_dir, hf_model = mxfp4_checkpoint
    tokens = random_tokens(16, VOCAB_SIZE, seed=2)
    got = _steps(_ours(model_dir), tokens, [2, 11, 5, 8])
    torch.testing.assert_close(got, hf_logits(hf_model, tokens), atol=ATOL, rtol=0)


def test_held_int8_activations_agree_with_the_expansion_teacher_forced(mxfp4_checkpoint):
    model_dir, _ = mxfp4_checkpoint
    held, expanded = _ours(model_dir), _ours(model_dir, "none")
    agree, deltas = [], []
    for seed in range(12):
        # One prefill per sequence: every position scored at once (the C kernel takes up to
        # C_ROWS_MAX rows; each expert sees its share of the 48).
        tokens = random_tokens(48, VOCAB_SIZE, seed=10 + seed)
        blocks = list(range(12))
        ref = torch.log_softmax(run_step(expanded, [(tokens, 0, blocks)])[0], dim=-1)
        got = torch.log_softmax(run_step(held, [(tokens, 0, blocks)])[0], dim=-1)
        # teacher-forced on the expansion's greedy choice at each position
        choice = ref.argmax(dim=-1)
        agree.append(got.argmax(dim=-1) == choice)
        deltas.append((got.gather(1, choice[:, None]) - ref.gather(1, choice[:, None])).abs())
    agreement = torch.cat(agree).float().mean().item()
    delta = torch.cat(deltas).mean().item()
    assert agreement >= MIN_TOP1_AGREEMENT, (agreement, delta)
    assert delta <= MAX_MEAN_ABS_DELTA, (agreement, delta)


def test_tensor_parallel_2_holds_each_ranks_blocks(mxfp4_checkpoint, tmp_path, monkeypatch):
    # Each rank holds its 64 of the 128 intermediate rows (two 32-blocks of down_proj's
    # columns); float32 activations, so the held product equals HF's at float rounding.
    monkeypatch.setenv("KVSERVE_QUANT_ACTIVATIONS", "float32")
    model_dir, hf_model = mxfp4_checkpoint
    requests = [(random_tokens(11, VOCAB_SIZE, seed=5), 0, [0, 1, 2]),
                (random_tokens(4, VOCAB_SIZE, 6), 0, [3])]  # fmt: skip
    assert_tensor_parallel_2_matches_hf(tmp_path, model_dir, hf_model, requests, NUM_BLOCKS)


def test_mxfp4_refusals(mxfp4_checkpoint, family_float_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="quant_method mxfp4"):
        load_model(family_float_checkpoint, torch.float32, "cpu", "mxfp4")
    # blocks without their scales
    from safetensors.torch import load_file, save_file

    model_dir, _ = mxfp4_checkpoint
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(model_dir):
        if name.endswith(".json"):
            (broken / name).write_text(open(os.path.join(model_dir, name)).read())
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj: the checkpoint lacks its MXFP4 scales"):
        load_model(str(broken), torch.float32, "cpu")
    assert json.loads((broken / "config.json").read_text())["quantization_config"]


@pytest.fixture(scope="module")
def family_float_checkpoint(tmp_path_factory):
    from tests.support.hf_models import make_tiny_family_model

    model_dir = str(tmp_path_factory.mktemp("gpt-oss-float"))
    make_tiny_family_model("gpt_oss").save_pretrained(model_dir)
    return model_dir


def test_held_experts_refuse_an_intermediate_size_off_the_32_grid():
    # e.g. a TP size that cuts gpt-oss's 2880 = 90 blocks into halves of 45 blocks: fine; into
    # quarters: a block split, refused at build time, naming the sizes.
    from kvserve.services.worker.layers.linear import quantization_scope

    with quantization_scope("mxfp4"), pytest.raises(ValueError, match="multiples of 32"):
        GptOssExperts(4, 64, 80, 7.0, 1.702)
    with quantization_scope(None):
        assert not GptOssExperts(4, 64, 80, 7.0, 1.702).quantized
