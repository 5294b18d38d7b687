"""The test session's $KVSERVE_CACHE_DIR: the user's converted models and built CPU kernels,
and a private copy of their CPU GEMM plans.

The suite's engines time no GEMM paths (tests/conftest.py sets KVSERVE_CPU_GEMM_MEASURE=0);
a test that turns the timing on keeps what it measures in the copy, so the user's own cache
never gets a plan measured under a test run's load.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Shared with the user's cache: converting a model or building a kernel gives the same files
# however busy the machine is.
SHARED_SUBDIRS = ("models", "kernels")
GEMM_SUBDIR = "gemm"


def make_session_cache_dir(user_cache_dir: str) -> str:
    """A temporary cache folder: links to user_cache_dir's models and kernels, a copy of its
    GEMM plans; removed at exit.

    Args:
        user_cache_dir: the cache the session would otherwise use ($KVSERVE_CACHE_DIR or
            ~/.cache/kvserve).
    """
    session_dir = tempfile.mkdtemp(prefix="kvserve-test-cache-")
    atexit.register(shutil.rmtree, session_dir, True)
    for name in SHARED_SUBDIRS:
        target = os.path.join(user_cache_dir, name)
        os.makedirs(target, exist_ok=True)
        os.symlink(target, os.path.join(session_dir, name))
    plans = os.path.join(user_cache_dir, GEMM_SUBDIR)
    if os.path.isdir(plans):
        shutil.copytree(plans, os.path.join(session_dir, GEMM_SUBDIR))
    return session_dir
