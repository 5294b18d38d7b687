"""RMSNorm, plain and with a fused residual add.

Both ops normalize in float32 and round to the activation dtype once, at the end. The fused op
first rounds `x + residual` to the activation dtype (that sum is the new residual stream) and
normalizes the rounded value, so the Triton kernel and the reference see the same numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kernels._triton import HAS_TRITON, next_power_of_2, require_triton, tl, triton

if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        residual_ptr,
        weight_ptr,
        out_ptr,
        residual_out_ptr,
        x_row_stride,
        residual_row_stride,
        hidden_size,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        # One program per token row; the whole row fits in one block.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_SIZE)
        mask = cols < hidden_size
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            residual = tl.load(
                residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0
            ).to(tl.float32)
            # Round the sum like the reference's `x + residual` before normalizing it.
            summed = (x + residual).to(residual_out_ptr.dtype.element_ty)
            tl.store(residual_out_ptr + row * hidden_size + cols, summed, mask=mask)
            x = summed.to(tl.float32)
        mean_square = tl.sum(x * x, axis=0) / hidden_size
        inv_rms = 1.0 / tl.sqrt(mean_square + eps)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = x * inv_rms * weight
        tl.store(out_ptr + row * hidden_size + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, H], last dim contiguous: {x.shape}"
    num_tokens, hidden_size = x.shape
    assert weight.shape == (hidden_size,) and weight.is_contiguous(), weight.shape
    out = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)
    residual_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1, residual.shape
        residual_out = torch.empty_like(out)
    if num_tokens == 0:
        return out, residual_out
    block_size = next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        residual_out if residual_out is not None else out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        hidden_size,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_SIZE=block_size,
        num_warps=min(max(block_size // 256, 1), 8),
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm. x: [T, H] (rows may be strided, last dim contiguous); weight: [H]."""
    require_triton("rms_norm")
    out, _ = _launch_rms_norm(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton residual add + RMSNorm; returns (normed, x + residual), inputs untouched."""
    require_triton("fused_add_rms_norm")
    out, residual_out = _launch_rms_norm(x, residual, weight, eps)
    assert residual_out is not None  # a residual in is a residual out
    return out, residual_out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch RMSNorm: one fused CPU kernel in float32, one cast back."""
    # .float() is a no-op for float32 inputs, so the fp32 engine pays for nothing extra.
    out = F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    return out.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch residual add + RMSNorm; returns (rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual
