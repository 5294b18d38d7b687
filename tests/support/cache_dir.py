"""The test session's $KVSERVE_CACHE_DIR: the user's converted models and built CPU kernels,
and a private copy of their CPU GEMM plans.

The suite's engines time no GEMM paths (tests/conftest.py sets KVSERVE_CPU_GEMM_MEASURE=0);
a test that turns the timing on keeps what it measures in the copy, so the user's own cache
never gets a plan measured under a test run's load.

The session also notes whether the user's cache held the default model's conversion when it
began (DEFAULT_MODEL_CONVERTED_HERE): where it did not, as on a clean CI machine, the folder
every engine serves is this checkout's own conversion, and the test of the conversion
(tests/unit/worker/conftest.py's smollm2_dir) reads it instead of converting again.
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
# "1" when the user's cache held no conversion of the default model as the session began (set
# once by tests/conftest.py, inherited by pytest-xdist's workers), else "0".
DEFAULT_MODEL_CONVERTED_HERE = "KVSERVE_TEST_DEFAULT_MODEL_CONVERTED_HERE"


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


def default_model_converted(user_cache_dir: str) -> bool:
    """Whether user_cache_dir holds the installed default model's GGUF converted (the folder
    `resolve_model(None)` would return without converting); False without the model."""
    from kvserve.services.worker.model_loader import converted_dir_name, default_gguf_path

    try:
        name = converted_dir_name(default_gguf_path())
    except ValueError:  # not installed: the tests that need it say so
        return False
    return os.path.isdir(os.path.join(user_cache_dir, "models", name))
