"""The W4G Triton kernel (kernels/int4.py) against the exact dequantization: through Triton's
interpreter on CPU (tests/kernels/conftest.py), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import int4
from kvserve.services.worker.quant_formats.int4 import pack_w4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize(("group", "act_order"), [(32, True), (128, False)])
def test_triton_matmul_matches_the_exact_dequantization(group, act_order):
    torch.manual_seed(group)
    n, k = 40, 256
    q = torch.randint(0, 16, (n, k))
    scales = torch.rand(n, k // group).to(torch.bfloat16) * 0.05
    zeros = torch.randint(0, 16, (n, k // group))
    g_idx = (torch.arange(k) // group)[torch.randperm(k)] if act_order else None
    qt = pack_w4(q, scales, zeros, group, g_idx)
    w = qt.dequantize()
    qt = qt.to(DEVICE)
    x = torch.randn(17, k, device=DEVICE)
    bias = torch.randn(n, device=DEVICE)
    got = int4.w4_linear_triton(x, qt, bias)
    expected = F.linear(x.double(), w.double().to(DEVICE), bias.double())
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)
