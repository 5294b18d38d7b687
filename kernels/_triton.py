"""Optional Triton import, shared by the kernel modules.

CPU installs never need Triton: the torch references run there. Each kernel module defines its
`_foo_kernel` only `if HAS_TRITON`, and its `foo()` wrapper calls `require_triton` first, so a
missing Triton shows up as one clear error on the GPU path instead of an ImportError at start-up.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: `pip install kvserve[triton]` adds it
    triton = None
    tl = None

HAS_TRITON = triton is not None


def require_triton(op_name: str) -> None:
    """Raise an actionable error when a Triton kernel is called without Triton installed.

    Args:
        op_name: the op being launched, for the message.
    """
    if not HAS_TRITON:
        raise RuntimeError(
            f"{op_name}: the Triton kernel needs the `triton` package "
            "(pip install triton), or call the torch reference `*_ref` instead"
        )


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (tl.arange sizes must be powers of two)."""
    return 1 << max(n - 1, 0).bit_length()
