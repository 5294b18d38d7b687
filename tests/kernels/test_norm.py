"""RMSNorm: the reference against the formula, the Triton kernel against the reference."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import norm
from tests.support.kernels import DEVICE, assert_close

EPS = 1e-6


def _rms_norm_formula(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * weight.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_ref_matches_formula(dtype):
    x = (torch.randn(7, 576) * 3).to(dtype)
    weight = torch.randn(576).to(dtype)
    out = norm.rms_norm_ref(x, weight, EPS)
    assert_close(out, _rms_norm_formula(x, weight), dtype)


def test_fused_add_rms_norm_ref_matches_formula():
    x, residual, weight = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = norm.fused_add_rms_norm_ref(x, residual, weight, EPS)
    assert_close(new_residual, x_before + residual_before, torch.float32)
    assert_close(out, _rms_norm_formula(x_before + residual_before, weight), torch.float32)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,hidden_size", [(1, 64), (5, 96), (3, 576)])
def test_rms_norm_triton_matches_ref(dtype, num_tokens, hidden_size):
    # Rows strided inside a wider buffer, as when x is a slice of a bigger activation.
    x = torch.randn(num_tokens, hidden_size + 32).to(DEVICE, dtype)[:, :hidden_size]
    weight = torch.randn(hidden_size).to(DEVICE, dtype)
    assert_close(norm.rms_norm(x, weight, EPS), norm.rms_norm_ref(x, weight, EPS), dtype)


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_triton_matches_ref(dtype):
    x = torch.randn(4, 96).to(DEVICE, dtype)
    residual = torch.randn(4, 96).to(DEVICE, dtype)
    weight = torch.randn(96).to(DEVICE, dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = norm.fused_add_rms_norm(x, residual, weight, EPS)
    ref_out, ref_residual = norm.fused_add_rms_norm_ref(x, residual, weight, EPS)
    assert_close(new_residual, ref_residual, dtype)
    assert_close(out, ref_out, dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.usefixtures("triton_kernels")
def test_rms_norm_triton_empty_batch():
    out = norm.rms_norm(torch.empty(0, 64, device=DEVICE), torch.ones(64, device=DEVICE), EPS)
    assert out.shape == (0, 64)
