"""RMSNorm, plain and with a fused residual add."""

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(x, residual, weight, eps):
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


rms_norm = rms_norm_ref  # replaced by the Triton kernel
fused_add_rms_norm = fused_add_rms_norm_ref
