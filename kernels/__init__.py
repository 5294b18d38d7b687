"""Kernels: one dispatch point.

Each op has a torch reference (`*_ref`, used on CPU) and a Triton kernel (used on CUDA). Callers
import the op names below and never pick an implementation themselves.
"""

from kvserve.kernels.dispatch import (
    fused_add_rms_norm,
    linear,
    paged_attention,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    write_kv_cache,
)

__all__ = [
    "fused_add_rms_norm",
    "linear",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv_cache",
]
