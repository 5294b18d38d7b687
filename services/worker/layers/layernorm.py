"""RMSNorm, with the residual add fused in when a residual is passed."""

from __future__ import annotations

import torch
from torch import nn

from kvserve import kernels
from kvserve.services.worker.layers.linear import set_weight_loader


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


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, y = x / rms(x) * (1 + weight): the checkpoint stores weight - 1.

    The 1 is added once at load time (in float32, then stored in the model dtype: in bfloat16
    that rounds 1 + weight where HF rounds weight), so the forward is RMSNorm's kernels.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        set_weight_loader(self.weight, self.weight_loader)

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param.shape != loaded_weight.shape:
            raise ValueError(
                f"checkpoint tensor shape {tuple(loaded_weight.shape)} does not match "
                f"parameter shape {tuple(param.shape)}"
            )
        param.data.copy_(loaded_weight.float() + 1.0)
