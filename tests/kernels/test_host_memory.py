"""kernels/host_memory.py: large CPU tensors zeroed on huge pages where the OS grants them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from kvserve.kernels import host_memory


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)  # type: ignore[union-attr]
    except OSError:
        return None


def _huge_kib_of(t: torch.Tensor) -> int:
    """AnonHugePages (kB) of the mappings that hold t (madvise splits a mapping at the
    advised range)."""
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    total, inside = 0, False
    with open(f"/proc/{os.getpid()}/smaps") as f:
        for line in f:
            head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                inside = int(head.group(1), 16) < end and start < int(head.group(2), 16)
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_zeros_is_torch_zeros(dtype):
    shape = (2, 700, 16, 3, 64)  # 8.6 MB in float32: past MIN_BYTES
    t = host_memory.zeros(shape, dtype, "cpu")
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.float().any()
    small = host_memory.zeros((3, 5), dtype, "cpu")  # below MIN_BYTES: plain zeros
    assert small.shape == (3, 5) and not small.float().any()


_ADVISED_AND_PLAIN = """
import torch
from kvserve.kernels import host_memory
from tests.kernels.test_host_memory import _huge_kib_of
size = 64 << 20
plain = torch.zeros(size // 4, dtype=torch.float32)
advised = host_memory.zeros((size // 4,), torch.float32, "cpu")
print(_huge_kib_of(advised), _huge_kib_of(plain))
"""


@pytest.mark.skipif(_thp_mode() != "madvise", reason="THP is not in madvise mode here")
def test_large_tensor_gets_huge_pages_where_madvise_asks():
    # In madvise mode a region gets huge pages only when asked: the advice is what gives them.
    # A fresh process: in a long-lived one (a pytest worker), the plain tensor can land on a
    # range an earlier test's tensor advised and the allocator kept.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", _ADVISED_AND_PLAIN],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    advised_kib, plain_kib = map(int, done.stdout.split())
    assert advised_kib >= 16 << 10  # most of its 64 MB (compaction may leave some)
    assert plain_kib == 0
