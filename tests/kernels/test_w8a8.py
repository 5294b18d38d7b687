"""kernels/w8a8.py: per-token int8 quantization, the int8 GEMM with its scale epilogue and the
fused AMX-INT8 kernel, against the torch reference (exact integer products in float64), and
quant_linear's measured choice among the three W8A8 kernels."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import w8a8
from kvserve.kernels.quant import QuantizedTensor, quant_linear, quantize_int8

pytestmark = pytest.mark.skipif(not w8a8.available(), reason="no C compiler / torch._int_mm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_per_token_matches_the_reference(dtype):
    x = (torch.randn(37, 600) * torch.linspace(0.01, 10, 37)[:, None]).to(dtype)
    x[3] = 0  # an all-zero row: scale 0, zeros
    q, s = w8a8.quantize_per_token(x)
    xf = x.float()
    want_s = xf.abs().amax(1) / 127
    torch.testing.assert_close(s, want_s, atol=0, rtol=1e-6)
    want_q = torch.round(xf / torch.where(want_s > 0, want_s, 1)[:, None]).clamp(-127, 127)
    # x * (127 / amax) against x / (amax / 127): a tie may round the other way
    assert (q.float() - want_q).abs().max().item() <= 1
    assert (q.float() != want_q).float().mean().item() < 0.01
    assert q[3].abs().sum().item() == 0 and s[3].item() == 0


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_intmm_matches_the_reference(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    n, k = 96, 160
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, generator=gen) * 0.01 + 1e-3
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    got = w8a8.linear_torch_int_mm(x, weight, scales, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    want = w8a8.linear_ref(x, weight, scales, bias)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)


needs_amx = pytest.mark.skipif(not w8a8.amx_available(), reason="no AMX-INT8 on this CPU")


@needs_amx
@pytest.mark.parametrize(("n", "k"), [(96, 160), (50, 70), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_amx_matches_the_reference(n, k, rows, dtype):
    """The fused AMX kernel: N and K not multiples of the tiles (padded), every row-block
    case (one / two 16-row tiles, a partial last one). Its int32 sums are exact: on the same
    per-token int8 rows (quantize_per_token, tested above against torch's rounding) it equals
    the float64 product to the output's rounding, and the torch._int_mm path bit for bit."""
    gen = torch.Generator().manual_seed(rows * 7 + n)
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, generator=gen) * 0.01 + 1e-3
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    x[rows // 2] = 0  # an all-zero row: scale 0, the bias alone
    got = w8a8.linear_amx(x, weight, scales, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    q, sx = w8a8.quantize_per_token(x)
    exact = (q.double() @ weight.double().t()) * sx.double()[:, None] * scales.double()
    want = exact + bias.double()
    tol = 1e-6 if dtype == torch.float32 else 4e-3  # the output's rounding
    for y, ref in ((got, want), (w8a8.linear_amx(x, weight, scales), exact)):
        err = (y.double() - ref).abs()
        assert (err <= tol * ref.abs() + 1e-6 * ref.abs().max()).all(), err.max().item()
    assert torch.equal(got[rows // 2].float(), bias.to(dtype).float())
    assert torch.equal(got, w8a8.linear_torch_int_mm(x, weight, scales, bias))
    # and the per-token scheme's numbers (quantization ties may round the other way)
    ref = w8a8.linear_ref(x, weight, scales, bias)
    torch.testing.assert_close(got.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=0)


@needs_amx
def test_linear_amx_takes_no_rows():
    weight = torch.randint(-127, 128, (40, 64), dtype=torch.int8)
    y = w8a8.linear_amx(torch.empty(0, 64, dtype=torch.bfloat16), weight, torch.ones(40))
    assert y.shape == (0, 40) and y.dtype == torch.bfloat16


@needs_amx
def test_amx_weight_is_packed_once_per_weight():
    weight = torch.randint(-127, 128, (64, 128), dtype=torch.int8)
    other = torch.randint(-127, 128, (64, 128), dtype=torch.int8)
    packed = w8a8.packed_for_amx(weight)
    assert w8a8.packed_for_amx(weight) is packed
    assert w8a8.packed_for_amx(weight.view(torch.uint8).view(torch.int8)) is packed
    assert w8a8.packed_for_amx(other) is not packed


@pytest.mark.parametrize("kernel", [None, "kvq", "intmm", "amx"])
def test_quant_linear_runs_each_w8a8_kernel(kernel, monkeypatch):
    """quant_linear on a W8A8 weight: forced to each kernel, and the measured plan (whose
    rungs name only kernels this machine has), each against the reference."""
    if kernel == "amx" and not w8a8.amx_available():
        pytest.skip("no AMX-INT8 on this CPU")
    if kernel is None:
        monkeypatch.delenv("KVSERVE_W8A8_KERNEL", raising=False)
    else:
        monkeypatch.setenv("KVSERVE_W8A8_KERNEL", kernel)
    gen = torch.Generator().manual_seed(3)
    i8 = quantize_int8(torch.randn(96, 192, generator=gen))
    qt = QuantizedTensor("W8A8", i8.shape, i8.data, i8.scales)
    for rows in (1, 20, 70):
        x = torch.randn(rows, 192, generator=gen).bfloat16()
        got = quant_linear(x, qt).float()
        want = w8a8.linear_ref(x, i8.data.view(torch.int8), i8.scales)
        # kvq quantizes activations in blocks of 32, not per token: its own rounding
        tol = 3e-2 if kernel in (None, "kvq") else 8e-3
        torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)
    if kernel is None:
        plan = w8a8._plans[(96, 192, torch.bfloat16)]
        allowed = {"kvq", "intmm"} | ({"amx"} if w8a8.amx_available() else set())
        assert len(plan) == len(w8a8.ROW_LADDER) and set(plan) <= allowed


def test_forcing_an_unknown_kernel_is_refused(monkeypatch):
    monkeypatch.setenv("KVSERVE_W8A8_KERNEL", "onednn")
    with pytest.raises(ValueError, match="KVSERVE_W8A8_KERNEL must be one of"):
        w8a8.forced()


@needs_amx
@pytest.mark.parametrize(("n", "k"), [(96, 160), (50, 70), (1000, 576)])
def test_linear_amx_bf16_matches_float_and_gives_each_row_alone(n, k):
    """The LM head's AMX-BF16 linear (the native decode stack's): float32 sums of bfloat16
    products, rounded once to bfloat16; N and K not multiples of the tiles; a row's result
    bit for bit the same whatever number of rows shares the call (1 to 33 and beyond)."""
    gen = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    x = torch.randn(40, k, generator=gen).to(torch.bfloat16)
    full = w8a8.linear_amx_bf16(x, weight)
    assert full.dtype == torch.bfloat16 and full.shape == (40, n)
    want = x.double() @ weight.double().t()
    err = (full.double() - want).abs()
    assert (err <= 2**-8 * want.abs() + 1e-5).all(), err.max().item()  # bfloat16's rounding
    for rows in (1, 15, 16, 17, 32, 33):
        assert torch.equal(w8a8.linear_amx_bf16(x[:rows], weight), full[:rows]), rows
    assert w8a8.linear_amx_bf16(x[:0], weight).shape == (0, n)
    assert w8a8.packed_for_amx_bf16(weight) is w8a8.packed_for_amx_bf16(weight)
