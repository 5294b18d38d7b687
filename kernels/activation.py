"""SiLU-and-mul (the gated MLP activation)."""

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


silu_and_mul = silu_and_mul_ref  # replaced by the Triton kernel
