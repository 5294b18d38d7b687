"""SiLU-and-mul: the reference against the formula, the Triton kernel against the reference."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import activation
from tests.support.kernels import DEVICE, assert_close


def test_silu_and_mul_ref_matches_formula():
    x = torch.randn(6, 2 * 40, dtype=torch.float64)
    gate, up = x[:, :40], x[:, 40:]
    expected = gate / (1 + torch.exp(-gate)) * up
    out = activation.silu_and_mul_ref(x.float())
    assert out.shape == (6, 40)
    assert_close(out, expected, torch.float32)


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,intermediate_size", [(1, 16), (3, 40), (2, 1536)])
def test_silu_and_mul_triton_matches_ref(dtype, num_tokens, intermediate_size):
    # Rows strided inside a wider buffer (a slice of a fused gate_up output).
    x = torch.randn(num_tokens, 2 * intermediate_size + 8).to(DEVICE, dtype)
    x = x[:, : 2 * intermediate_size]
    out = activation.silu_and_mul(x)
    assert out.shape == (num_tokens, intermediate_size)
    assert_close(out, activation.silu_and_mul_ref(x), dtype)
