"""RMSNorm, with the residual add fused in when a residual is passed."""

from __future__ import annotations

import torch
from torch import nn

from kvserve import kernels


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight.

    Args:
        hidden_size: size of the normalized last dim.
        eps: added to the mean square before the square root.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H]. Without residual returns y; with it returns (rms_norm(x + residual),
        x + residual), the second being the next layer's residual."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
