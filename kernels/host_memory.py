"""Large host tensors on transparent huge pages (Linux), for memory read in scattered pieces.

The paged KV cache is read block by block through block tables: a decode step at
concurrency 32 reads every request's blocks of every layer, hundreds of MB in 12 KB pieces
scattered over a cache of GBs. On 4 KB pages each piece spans three or four pages, each a
TLB miss and a stop for the hardware prefetchers; on 2 MB pages those mostly go (the decode
attention kernel ran 1.1-1.2x faster on them, bench/RESULTS.md issue 51). torch allocates
with posix_memalign and leaves the kernel's THP policy as it is, which on most distributions
is `madvise`: a region gets huge pages only if asked before its pages are first touched.
`zeros` asks (madvise MADV_HUGEPAGE over the tensor's 2 MB-aligned interior) and only then
zeroes it. Where THP is `never`, the call is refused or a no-op and the tensor is the same.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
HUGE_PAGE = 2 << 20
# Below this a tensor gains nothing worth a syscall (and holds no 2 MB-aligned page).
MIN_BYTES = 8 * HUGE_PAGE


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages over t's storage (2 MB-aligned interior); True when the kernel took
    the advice. Pages already touched keep their size: call it before writing t."""
    nbytes = t.untyped_storage().nbytes()
    madvise = _madvise()
    if t.device.type != "cpu" or nbytes < MIN_BYTES or madvise is None:
        return False
    start = t.untyped_storage().data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = (start + nbytes) // HUGE_PAGE * HUGE_PAGE
    return last > first and madvise(first, last - first, MADV_HUGEPAGE) == 0


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros(shape), on huge pages where it is a large CPU tensor and the OS grants
    them."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t.zero_()
