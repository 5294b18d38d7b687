"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

import pytest


@pytest.fixture(scope="package", autouse=True)
def gemm_plans_kept_under_load():
    """In-process engines keep the GEMM plan they measure even on contended cores.

    A test run always contends for the cores, so without this each engine of the default
    model measured its plan again (tens of seconds on a loaded two-core machine). The plan is
    kept in the session's own cache folder (tests/support/cache_dir.py), never the user's,
    and both paths compute the same layers: only speed depends on the choice. The servers
    the tests start reuse it (same shapes and thread count). tests/kernels/test_gemm.py
    checks the contention rule itself, outside this package.
    """
    from kvserve.kernels import gemm

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gemm, "CONTENDED_SHARE", 1.0)
        yield


@pytest.fixture(scope="module", autouse=True)
def memory_returned_after_each_module():
    """After a module, hand freed memory back to the OS (glibc's malloc_trim).

    Engines of the default model free a few hundred MiB of weights each, and glibc may keep
    freed heap memory in the process: the test process reached 5.8 GB RSS over the e2e
    modules (what of it was freed heap is not measured yet).
    """
    yield
    gc.collect()
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
