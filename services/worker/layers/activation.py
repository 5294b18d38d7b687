"""The gated MLP activations: act(gate) * up over a fused [gate | up] input."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels


class SiluAndMul(nn.Module):
    """[T, 2 * I] = [gate | up] -> silu(gate) * up, [T, I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(x)


class GeluAndMul(nn.Module):
    """[T, 2 * I] = [gate | up] -> gelu(gate) * up, [T, I] (Gemma's GeGLU).

    Args:
        approximate: "tanh" (HF's gelu_pytorch_tanh) or "none" (exact erf gelu).
    """

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "silu": SiluAndMul,
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
    "gelu_new": lambda: GeluAndMul("tanh"),
    "gelu": lambda: GeluAndMul("none"),
}


def get_act_and_mul(name: str) -> nn.Module:
    """The gated activation of a HF `hidden_act` name (silu, gelu, gelu_pytorch_tanh)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]()
