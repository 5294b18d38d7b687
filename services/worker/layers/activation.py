"""The gated MLP activation."""

from __future__ import annotations

import torch
from torch import nn

from kvserve import kernels


class SiluAndMul(nn.Module):
    """[T, 2 * I] = [gate | up] -> silu(gate) * up, [T, I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(x)
