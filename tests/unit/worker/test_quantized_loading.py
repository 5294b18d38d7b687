"""Loading weights held quantized: the GGUF blocks read from the file, int8 at load, the
detection rule, the fused and tensor-parallel layers, and the clear errors."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels.quant import QuantizedTensor, quantize_int8
from kvserve.services.worker.gguf import iterate_gguf_tensors, requantize_gguf
from kvserve.services.worker.layers.linear import (
    LinearBase,
    QKVParallelLinear,
    RowParallelLinear,
    quantization_scope,
)
from kvserve.services.worker.model_loader import resolve_model
from kvserve.services.worker.models import load_model
from kvserve.services.worker.quantization import (
    QuantizedVocabEmbedding,
    checkpoint_quantization,
    weight_bytes,
)
from tests.support.distributed import init_two_ranks, leave_two_ranks, run_two_ranks

gguf = pytest.importorskip("gguf")


def _q(qtype: str, w: torch.Tensor) -> QuantizedTensor:
    data = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
    return QuantizedTensor(qtype, tuple(w.shape), torch.from_numpy(np.ascontiguousarray(data)))


@pytest.fixture
def float32_activations(monkeypatch):
    """The C kernel without activation rounding: layer outputs comparable at 1e-4."""
    monkeypatch.setenv("KVSERVE_QUANT_ACTIVATIONS", "float32")


@pytest.fixture(scope="module")
def tiny_q4_1(tiny_gguf, tmp_path_factory):
    """The tiny Q8_0 llama GGUF re-quantized to Q4_1 (embedding kept Q8_0)."""
    src, _ = tiny_gguf(True)
    dst = str(tmp_path_factory.mktemp("requant") / "tiny-q4_1.gguf")
    written = requantize_gguf(src, dst, "Q4_1", keep=("token_embd.weight",))
    assert written["blk.0.attn_q.weight"] == "Q4_1" and written["token_embd.weight"] == "Q8_0"
    return dst


@pytest.mark.usefixtures("float32_activations")
def test_gguf_blocks_load_into_every_layer_and_match_the_float_expansion(tiny_q4_1, tmp_path):
    model_dir = resolve_model(tiny_q4_1, cache_dir=str(tmp_path))
    ref, _ = load_model(model_dir, torch.float32, "cpu")
    held, _ = load_model(model_dir, torch.float32, "cpu", "gguf", tiny_q4_1)
    ref_modules, held_modules = dict(ref.named_modules()), dict(held.named_modules())
    linears = [n for n, m in held_modules.items() if isinstance(m, LinearBase)]
    assert linears and all(held_modules[n].is_quantized for n in linears)
    torch.manual_seed(0)
    for name in linears:
        a, b = ref_modules[name], held_modules[name]
        x = torch.randn(5, a.input_size)
        # qkv_proj included: rows unpermuted like the float path's
        torch.testing.assert_close(b(x), a(x), atol=1e-4, rtol=1e-4, msg=name)
    embed = held.model.embed_tokens
    assert isinstance(embed, QuantizedVocabEmbedding) and embed.blocks.qtype == "Q8_0"
    ids = torch.arange(embed.num_embeddings)
    torch.testing.assert_close(embed(ids), ref.model.embed_tokens(ids), atol=0, rtol=0)
    assert weight_bytes(held) < weight_bytes(ref) / 3


def test_gguf_stream_keeps_blocks_and_unpermutes_whole_rows(tiny_q4_1):
    floats = dict(iterate_gguf_tensors(tiny_q4_1))
    kept = dict(iterate_gguf_tensors(tiny_q4_1, keep_quantized=True))
    assert set(floats) == set(kept)
    for name, tensor in kept.items():
        if isinstance(tensor, QuantizedTensor):
            torch.testing.assert_close(tensor.dequantize(), floats[name], atol=0, rtol=0)
        else:
            assert tensor.dim() == 1  # only the norms stay float
    assert isinstance(kept["model.layers.0.self_attn.q_proj.weight"], QuantizedTensor)


def test_int8_quantizes_a_float_checkpoint_per_output_channel(tiny_checkpoint):
    model_dir, _ = tiny_checkpoint("llama")
    ref, _ = load_model(model_dir, torch.float32, "cpu")
    held, _ = load_model(model_dir, torch.float32, "cpu", "int8")
    ref_modules = dict(ref.named_modules())
    for name, module in held.named_modules():
        if isinstance(module, LinearBase):
            ((_, part),) = module.quant_parts
            assert part.qtype == "I8" and module.weight.numel() == 0
            weight = ref_modules[name].weight
            torch.testing.assert_close(
                part.dequantize(), weight, atol=weight.abs().max() / 254, rtol=0
            )
            x = torch.randn(4, module.input_size)
            y, y_ref = module(x), ref_modules[name](x)
            assert (y - y_ref).abs().max() <= 0.02 * y_ref.abs().max(), name


def test_a_config_quantization_config_is_detected_or_refused(tiny_checkpoint, tmp_path):
    model_dir, _ = tiny_checkpoint("llama")
    assert checkpoint_quantization(model_dir) is None
    folder = str(tmp_path / "ckpt")
    shutil.copytree(model_dir, folder)
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "int8"}
    with open(config_path, "w") as f:
        json.dump(config, f)
    assert checkpoint_quantization(folder) == "int8"
    held, _ = load_model(folder, torch.float32, "cpu")  # detected without --quantization
    assert all(m.is_quantized for m in held.modules() if isinstance(m, LinearBase))
    with pytest.raises(ValueError, match="conflicts"):
        load_model(folder, torch.float32, "cpu", "gguf")
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes'.*supported: \\['awq'"):
        checkpoint_quantization(folder)


def test_gguf_quantization_needs_a_gguf_file(tiny_checkpoint):
    model_dir, _ = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="must be a .gguf file"):
        load_model(model_dir, torch.float32, "cpu", "gguf", model_dir)


@pytest.mark.usefixtures("float32_activations")
def test_fused_qkv_holds_shards_of_different_types():
    torch.manual_seed(0)
    q, k, v = torch.randn(64, 64), torch.randn(32, 64), torch.randn(32, 64)
    with quantization_scope("gguf"):
        layer = QKVParallelLinear(64, 16, 4, 2)
    layer.weight.weight_loader(layer.weight, _q("Q4_1", q), "q")
    layer.weight.weight_loader(layer.weight, v, "v")  # a type without a kernel: kept float
    layer.weight.weight_loader(layer.weight, _q("Q8_0", k), "k")
    layer.process_weights_after_loading()
    assert [type(p).__name__ for _, p in layer.quant_parts] == [
        "QuantizedTensor",
        "QuantizedTensor",
        "Tensor",
    ]
    x = torch.randn(3, 64)
    dense = torch.cat([_q("Q4_1", q).dequantize(), _q("Q8_0", k).dequantize(), v])
    torch.testing.assert_close(layer(x), F.linear(x, dense), atol=1e-4, rtol=1e-4)


def test_missing_rows_are_an_error():
    with quantization_scope("gguf"):
        layer = QKVParallelLinear(64, 16, 4, 2)
    layer.weight.weight_loader(layer.weight, _q("Q4_1", torch.randn(64, 64)), "q")
    with pytest.raises(ValueError, match="rows 64..96 missing"):
        layer.weight.weight_loader(layer.weight, _q("Q4_1", torch.randn(32, 64)), "v")
        layer.process_weights_after_loading()


def _tp_worker(rank: int, store_path: str, out_path: str) -> None:
    from kvserve.services.worker.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
    )

    os.environ["KVSERVE_QUANT_ACTIVATIONS"] = "float32"
    init_two_ranks(rank, store_path, tp=2, pp=1)
    try:
        torch.manual_seed(0)  # both ranks draw the same full weights and inputs
        results = {}
        x = torch.randn(5, 128)
        with quantization_scope("gguf"):
            w = _q("Q4_1", torch.randn(6, 128))
            row = RowParallelLinear(128, 6, bias=True)  # 64 input features per rank: 2 blocks
            bias = torch.randn(6)
            row.weight.weight_loader(row.weight, w)
            row.bias.weight_loader(row.bias, bias)
            row.process_weights_after_loading()
            local_x = x[:, rank * 64 : (rank + 1) * 64]
            results["row"] = (row(local_x), F.linear(x, w.dequantize(), bias))

            w = _q("Q8_0", torch.randn(8, 128))
            col = ColumnParallelLinear(128, 8)
            col.weight.weight_loader(col.weight, w)
            col.process_weights_after_loading()
            results["column"] = (col(x), F.linear(x, w.dequantize())[:, rank * 4 : rank * 4 + 4])

            gate, up = _q("Q4_0", torch.randn(4, 128)), _q("Q4_0", torch.randn(4, 128))
            merged = MergedColumnParallelLinear(128, [4, 4])
            merged.weight.weight_loader(merged.weight, gate, 0)
            merged.weight.weight_loader(merged.weight, up, 1)
            merged.process_weights_after_loading()
            local = torch.cat(
                [
                    gate.dequantize()[rank * 2 : rank * 2 + 2],
                    up.dequantize()[rank * 2 : rank * 2 + 2],
                ]
            )
            results["merged"] = (merged(x), F.linear(x, local))

            table = _q("Q8_0", torch.randn(10, 64))
            embed = QuantizedVocabEmbedding(10, 64)
            embed.weight.weight_loader(embed.weight, table)
            ids = torch.tensor([0, 9, 4, 5, 1, 8])
            results["embedding"] = (embed(ids), F.embedding(ids, table.dequantize()))

            odd = RowParallelLinear(96, 4)  # 48 input features per rank: not 32-blocks
            try:
                odd.weight.weight_loader(odd.weight, _q("Q4_1", torch.randn(4, 96)))
                results["odd_error"] = ""
            except ValueError as exc:
                results["odd_error"] = str(exc)
        torch.save(results, f"{out_path}.{rank}")
    finally:
        leave_two_ranks()


def test_tp2_splits_blocks_by_rows_and_block_aligned_columns(tmp_path):
    out_path = str(tmp_path / "results")
    run_two_ranks(_tp_worker, (str(tmp_path / "store"), out_path))
    for rank in range(2):
        results = torch.load(f"{out_path}.{rank}")
        assert "cannot split Q4_1 weight columns" in results.pop("odd_error")
        assert set(results) == {"row", "column", "merged", "embedding"}
        for name, (got, expected) in results.items():
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4, msg=f"{name} {rank}")


def test_int8_per_channel_round_trip():
    w = torch.randn(7, 40)
    qt = quantize_int8(w)
    assert qt.data.shape == (7, 40) and qt.scales.shape == (7,)
    err = (qt.dequantize() - w).abs().amax(dim=1)
    assert torch.all(err <= w.abs().amax(dim=1) / 254 + 1e-7)
