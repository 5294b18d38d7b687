"""Fixtures of the end-to-end tests."""

from __future__ import annotations

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
