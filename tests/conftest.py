"""Fixtures shared by every test folder (helper functions live in tests/support)."""

from __future__ import annotations

import os

import pytest

# Two cores: keep torch from oversubscribing them when tests spawn processes.
os.environ.setdefault("OMP_NUM_THREADS", "2")

# Triton reads TRITON_INTERPRET when first imported, so it is set here, before any test module
# can import it: without a GPU the Triton kernel tests run in Triton's interpreter.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A tcp:// socket needs the deployment's keys (shared/transport_security.py): one keypair for
# the session, which the processes tests start inherit. Tests of the rules set their own.
if not os.environ.get("KVSERVE_TRANSPORT_KEYS"):
    import atexit  # noqa: E402
    import shutil  # noqa: E402
    import tempfile  # noqa: E402

    from kvserve.shared.transport_security import generate_keys  # noqa: E402

    _transport_keys_dir = tempfile.mkdtemp(prefix="kvserve-test-keys-")
    generate_keys(_transport_keys_dir)
    os.environ["KVSERVE_TRANSPORT_KEYS"] = _transport_keys_dir
    atexit.register(shutil.rmtree, _transport_keys_dir, True)

# The session's cache folder (tests/support/cache_dir.py): the user's models and kernels, a
# private copy of their GEMM plans. Set once, inherited by every process the tests start
# (and by pytest-xdist's workers, which see the marker and keep it).
if not os.environ.get("KVSERVE_TEST_SESSION_CACHE"):
    from kvserve.shared.env import CACHE_DIR  # noqa: E402
    from tests.support.cache_dir import make_session_cache_dir  # noqa: E402

    os.environ["KVSERVE_CACHE_DIR"] = make_session_cache_dir(CACHE_DIR.get())
    os.environ["KVSERVE_TEST_SESSION_CACHE"] = os.environ["KVSERVE_CACHE_DIR"]


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The embedded SmolLM2-135M-Instruct, converted once into the cache folder."""
    from kvserve.services.worker.model_loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama folder (tests.support.models.build_tiny_llama), written once; the
    process tests serve it, since it starts in seconds."""
    from tests.support.models import build_tiny_llama

    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


_TRIM_GROWTH_BYTES = 512 << 20
_rss_after_trim = 0


@pytest.hookimpl(trylast=True)  # after the test's fixtures are torn down
def pytest_runtest_teardown(item, nextitem) -> None:
    """Hand freed memory back to the OS once this process has grown by 512 MiB since it last
    did: an engine's weights and KV cache, freed by a test or its module's fixtures, otherwise
    stay in glibc's fragmented heap (~1 GiB an engine), counted in the suite's peak."""
    global _rss_after_trim
    import psutil

    process = psutil.Process()
    if process.memory_info().rss - _rss_after_trim < _TRIM_GROWTH_BYTES:
        return
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
    _rss_after_trim = process.memory_info().rss
