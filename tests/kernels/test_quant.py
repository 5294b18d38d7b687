"""Weights held quantized (kernels/quant.py): every format against its dequantized reference.

The reference weight is the `gguf` package's own dequantization of blocks it (or, for Q4_K,
our numpy quantizer) wrote, so the block layouts are checked against an implementation that
is not ours; for MXFP4, transformers' gpt-oss dequantization (`convert_moe_packed_tensors`)
of random checkpoint-layout blocks and exponents. The C kernel quantizes activations to int8
blocks of 32 (as llama.cpp does): it is compared with x quantized the same way, computed
here independently, times the reference weight, at float32 tolerance; the float paths
(prefill, torch fallback, Triton) with x itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import quant
from kvserve.services.worker.gguf import quantize_q4_k
from tests.support.kernels import DEVICE

gguf = pytest.importorskip("gguf")
needs_c = pytest.mark.skipif(not quant.c_available(), reason="no C compiler: no C kernels")

FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "MXFP4", "I8"]


def make_mxfp4_weight(n: int, k: int, seed: int = 0):
    """(QuantizedTensor, its float32 reference [n, k]) from random bytes in gpt-oss's
    checkpoint layout: blocks [n, k/32, 16], exponents [n, k/32] around 2^-4."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(119, 126, (n, k // 32), dtype=torch.uint8, generator=gen)
    # transformers dequantizes [experts, n, k/32, 16] to [experts, k, n].
    ref = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0].t()
    data = quant.mxfp4_from_checkpoint(blocks, scales)
    return quant.QuantizedTensor("MXFP4", (n, k), data), ref.contiguous()


def make_weight(qtype: str, n: int, k: int, seed: int = 0):
    """(QuantizedTensor, its float32 reference [n, k])."""
    if qtype == "MXFP4":
        return make_mxfp4_weight(n, k, seed)
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[:, : k // 7] += 0.03  # blocks with a nonzero mean exercise Q4_1/Q4_K's mins
    if qtype == "I8":
        qt = quant.quantize_int8(torch.from_numpy(w))
        ref = qt.data.view(torch.int8).float() * qt.scales[:, None]
        return qt, ref
    gtype = gguf.GGMLQuantizationType[qtype]
    data = quantize_q4_k(w) if qtype == "Q4_K" else gguf.quants.quantize(w, gtype)
    ref = torch.from_numpy(gguf.quants.dequantize(data, gtype).reshape(n, k).copy())
    return quant.QuantizedTensor(qtype, (n, k), torch.from_numpy(np.ascontiguousarray(data))), ref


def shape_of(qtype: str, odd: bool) -> tuple[int, int]:
    if qtype == "Q4_K":
        return (37, 512) if odd else (64, 256)
    return (67, 96) if odd else (64, 576)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x after int8 quantization in blocks of 32: scale amax / 127, q = round(x * (1 / scale))
    half to even, in float32 as the kernel does (x / scale rounds differently now and then)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round(blocks * inv)
    return (q * scale).reshape(x.shape)


def block_offsets(qt: quant.QuantizedTensor) -> torch.Tensor:
    """The additive part of each weight (Q4_1's m, Q4_K's -dmin * m_j; zero otherwise): the
    dequantization of the blocks with their 4-bit values zeroed. The C kernel multiplies it
    by the exact float sum of x's block, as the float weight would."""
    if qt.qtype not in ("Q4_1", "Q4_K"):
        return torch.zeros(qt.shape)
    _, elems, nbytes = quant.QTYPES[qt.qtype]
    blocks = qt.data.numpy().reshape(qt.shape[0], -1, nbytes).copy()
    blocks[..., 4 if qt.qtype == "Q4_1" else 16 :] = 0
    gtype = gguf.GGMLQuantizationType[qt.qtype]
    return torch.from_numpy(gguf.quants.dequantize(blocks.reshape(qt.shape[0], -1), gtype).copy())


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("odd", [False, True])
def test_dequantization_matches_the_gguf_package(qtype, odd):
    qt, ref = make_weight(qtype, *shape_of(qtype, odd))
    torch.testing.assert_close(quant.dequantize_ref(qt), ref, atol=0, rtol=0)
    if quant.c_available():
        torch.testing.assert_close(quant.dequantize_rows(qt, None), ref, atol=0, rtol=0)


@needs_c
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("odd", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 200])
def test_c_matmul_matches_dequantized_reference(qtype, odd, rows):
    n, k = shape_of(qtype, odd)
    qt, ref = make_weight(qtype, n, k, seed=rows)
    x = torch.randn(rows, k)
    bias = torch.randn(n)
    got = quant.quant_linear(x, qt, bias)
    if rows <= quant.C_ROWS_MAX:  # the integer kernel: x is quantized to int8 blocks...
        offset = block_offsets(qt).double()  # ...except against Q4_1/Q4_K's block minimums
        scaled = F.linear(quantized_activations(x).double(), ref.double() - offset)
        expected = scaled + F.linear(x.double(), offset, bias.double())
    else:  # dequantized weight chunks and a float GEMM
        expected = F.linear(x.double(), ref.double(), bias.double())
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)
    # and within activation-quantization error of the exact float product
    exact = F.linear(x.double(), ref.double(), bias.double())
    assert (got.double() - exact).abs().max() <= 0.02 * exact.abs().max()


@needs_c
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_c_matmul_with_float32_activations_matches_the_float_product(qtype, rows, monkeypatch):
    monkeypatch.setenv("KVSERVE_QUANT_ACTIVATIONS", "float32")
    qt, ref = make_weight(qtype, *shape_of(qtype, True), seed=rows)
    x = torch.randn(rows, qt.shape[1])
    got = quant.quant_linear(x, qt)
    torch.testing.assert_close(
        got.double(), F.linear(x.double(), ref.double()), atol=1e-5, rtol=1e-5
    )


@needs_c
def test_c_matmul_writes_into_a_strided_output_and_reads_strided_rows():
    qt, ref = make_weight("Q4_1", 40, 64)
    wide = torch.randn(5, 70)
    x = wide[:, 3:67]  # rows of a wider buffer
    out = torch.full((5, 100), float("nan"))
    quant.quant_linear(x, qt, None, out=out[:, 10:50])
    offset = block_offsets(qt)
    expected = F.linear(quantized_activations(x.contiguous()), ref - offset) + F.linear(x, offset)
    torch.testing.assert_close(out[:, 10:50], expected, atol=1e-4, rtol=1e-4)
    assert out[:, :10].isnan().all() and out[:, 50:].isnan().all()


@pytest.mark.parametrize("qtype", FORMATS)
def test_torch_fallback_matches_dequantized_reference(qtype):
    qt, ref = make_weight(qtype, *shape_of(qtype, True))
    x = torch.randn(3, qt.shape[1])
    torch.testing.assert_close(quant.quant_linear_ref(x, qt), F.linear(x, ref))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_embedding_lookup_dequantizes_only_the_rows(qtype):
    qt, ref = make_weight(qtype, 50, 64)
    ids = torch.tensor([[0, 49, 7], [7, 3, 3]])
    torch.testing.assert_close(quant.quant_embedding(ids, qt), ref[ids], atol=0, rtol=0)
    torch.testing.assert_close(quant._lookup_ref(qt, ids.reshape(-1)), ref[ids.reshape(-1)])


def test_splits_by_rows_and_by_block_aligned_columns():
    qt, ref = make_weight("Q4_1", 8, 128)
    torch.testing.assert_close(qt.narrow(0, 2, 3).dequantize(), ref[2:5], atol=0, rtol=0)
    torch.testing.assert_close(qt.narrow(1, 64, 64).dequantize(), ref[:, 64:], atol=0, rtol=0)
    with pytest.raises(ValueError, match="blocks hold 32 input features"):
        qt.narrow(1, 48, 80)
    k_qt, k_ref = make_weight("Q4_K", 4, 512)
    torch.testing.assert_close(k_qt.narrow(1, 256, 256).dequantize(), k_ref[:, 256:])
    with pytest.raises(ValueError, match="256"):
        k_qt.narrow(1, 0, 128)


def test_mxfp4_quantizer_round_trip_and_checkpoint_layout_checks():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(3, 8, 128) * 0.05  # [experts, out, in]
    blocks, scales = quant.quantize_mxfp4(w)
    assert blocks.shape == (3, 8, 4, 16) and scales.shape == (3, 8, 4)
    back = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    # e2m1 steps: at most a quarter of the block's power of two off (eighth of amax) per value
    rel_rms = ((back - w) ** 2).mean().sqrt() / w.std()
    assert rel_rms < 0.15, rel_rms
    # values that are e2m1 numbers times a power of two round-trip exactly
    exact = torch.tensor([0.0, 0.5, -1.0, 1.5, 2.0, -3.0, 4.0, 6.0] * 4).reshape(1, 32) / 8
    packed = quant.mxfp4_from_checkpoint(*quant.quantize_mxfp4(exact))
    back_exact = quant.dequantize_ref(quant.QuantizedTensor("MXFP4", (1, 32), packed))
    torch.testing.assert_close(back_exact, exact, atol=0, rtol=0)
    with pytest.raises(ValueError, match="do not match scales"):
        quant.mxfp4_from_checkpoint(blocks, scales[..., :3])


def test_q4_k_quantizer_round_trip_error_is_that_of_a_4_bit_format():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 1024)).astype(np.float32)
    back = gguf.quants.dequantize(quantize_q4_k(w), gguf.GGMLQuantizationType.Q4_K)
    rel_rms = np.sqrt(((back.reshape(w.shape) - w) ** 2).mean()) / w.std()
    # uniform 4-bit steps over a 32-value range give ~0.07; broken packing gives > 0.5
    assert rel_rms < 0.1, rel_rms


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("rows", [1, 17])
def test_triton_matmul_matches_dequantized_reference(qtype, rows):
    qt, ref = make_weight(qtype, *shape_of(qtype, True), seed=rows)
    qt = qt.to(DEVICE)
    x = torch.randn(rows, qt.shape[1], device=DEVICE)
    bias = torch.randn(qt.shape[0], device=DEVICE)
    got = quant.quant_linear_triton(x, qt, bias)
    expected = F.linear(x.double(), ref.double().to(DEVICE), bias.double())
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)
