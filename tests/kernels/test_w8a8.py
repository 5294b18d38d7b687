"""kernels/w8a8.py: per-token int8 quantization and the int8 GEMM with its scale epilogue,
against the torch reference (exact integer products in float64)."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import w8a8

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
    got = w8a8.linear_intmm(x, weight, scales, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    want = w8a8.linear_ref(x, weight, scales, bias)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)


def test_forcing_an_unknown_kernel_is_refused(monkeypatch):
    monkeypatch.setenv("KVSERVE_W8A8_KERNEL", "amx")
    with pytest.raises(ValueError, match="KVSERVE_W8A8_KERNEL must be one of"):
        w8a8.forced()
