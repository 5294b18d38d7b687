"""SiLU-and-mul (the gated MLP activation): x = [gate | up] -> silu(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kernels._triton import HAS_TRITON, next_power_of_2, require_triton, tl, triton

_MAX_BLOCK_SIZE = 1024

if HAS_TRITON:

    @triton.jit
    def _silu_and_mul_kernel(
        x_ptr, out_ptr, x_row_stride, intermediate_size, BLOCK_SIZE: tl.constexpr
    ):
        # Grid: (token, column block). Gate and up of a column sit intermediate_size apart.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = cols < intermediate_size
        gate_ptrs = x_ptr + row * x_row_stride + cols
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptrs + intermediate_size, mask=mask, other=0.0).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
        tl.store(
            out_ptr + row * intermediate_size + cols, out.to(out_ptr.dtype.element_ty), mask=mask
        )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton SiLU-and-mul. x: [T, 2 * I] (last dim contiguous); returns [T, I]."""
    require_triton("silu_and_mul")
    assert x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, 2*I], got {x.shape}"
    num_tokens, double_size = x.shape
    assert double_size % 2 == 0, f"last dim must be even (gate | up), got {double_size}"
    intermediate_size = double_size // 2
    out = torch.empty((num_tokens, intermediate_size), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block_size = min(next_power_of_2(intermediate_size), _MAX_BLOCK_SIZE)
    grid = (num_tokens, triton.cdiv(intermediate_size, block_size))
    _silu_and_mul_kernel[grid](x, out, x.stride(0), intermediate_size, BLOCK_SIZE=block_size)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch SiLU-and-mul. x: [T, 2 * I]; returns [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    # In place on silu's fresh output: saves one [T, I] allocation per layer.
    return F.silu(gate).mul_(up)
