"""Fixtures shared by every test folder (helper functions live in tests/support)."""

from __future__ import annotations

import os

import pytest

# Keep torch from oversubscribing the cores: their count split between pytest-xdist's workers
# (`make test` runs two on two cores: one thread each), inherited by the processes tests start.
# An OMP_NUM_THREADS the user set wins; the one pytest-xdist's controller set for itself (its
# workers inherit its environment) does not.
_user_threads = os.environ.setdefault(
    "KVSERVE_TEST_USER_OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "")
)
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ["OMP_NUM_THREADS"] = _user_threads or str(
    max(1, len(os.sched_getaffinity(0)) // _workers)
)

# The engines tests start take every step of up to KVSERVE_NATIVE_DECODE_ROWS requests on the
# native decode stack, and route prefill attention by the fixed defaults, rather than by what
# a start-up timing finds faster (the product default): which path a step takes then does not
# depend on the machine or its load. tests/unit/worker/test_decode_stack.py and
# tests/kernels/test_cpu_attention.py turn the timings on.
os.environ.setdefault("KVSERVE_NATIVE_DECODE_MEASURE", "0")
os.environ.setdefault("KVSERVE_PREFILL_ROUTE_MEASURE", "0")
# Nor do they time each linear layer's GEMM paths (a dozen CPU seconds a model, more under a
# test run's load, which also decides what the timing picks): every shape runs torch's path.
# tests/e2e/test_gemm_paths.py runs each path; tests/kernels/test_gemm.py tests the timing.
os.environ.setdefault("KVSERVE_CPU_GEMM_MEASURE", "0")
# Engine processes keep glibc's malloc whether or not this machine has tcmalloc, so a test run
# here measures what a fresh CI machine runs (tests/unit/kvserve/test_allocator.py checks the
# preload itself).
os.environ.setdefault("KVSERVE_PRELOAD_ALLOCATOR", "0")

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
# (and by pytest-xdist's workers, which see the marker and keep it), and whether the user's
# cache held the default model's conversion then.
if not os.environ.get("KVSERVE_TEST_SESSION_CACHE"):
    from kvserve.shared.env import CACHE_DIR  # noqa: E402
    from tests.support.cache_dir import (  # noqa: E402
        DEFAULT_MODEL_CONVERTED_HERE,
        default_model_converted,
        make_session_cache_dir,
    )

    _converted = default_model_converted(CACHE_DIR.get())
    os.environ[DEFAULT_MODEL_CONVERTED_HERE] = "0" if _converted else "1"
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


def pytest_collection_modifyitems(items) -> None:
    """The modules that share the API server (tests/support/api_server.py) run back to back,
    where the first of them was collected; the server is stopped after the last."""
    from tests.support.api_server import uses_shared_server

    shared = [item for item in items if uses_shared_server(item.nodeid)]
    if shared:
        first = items.index(shared[0])
        others = [item for item in items if not uses_shared_server(item.nodeid)]
        items[:] = others[:first] + shared + others[first:]


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile (a module's tests on one worker, so its module fixtures are built once),
    except that some modules are run as one unit, and the longest units go first
    (tests/support/scheduling.py)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from collections import OrderedDict

    from xdist.scheduler import LoadFileScheduling

    from tests.support.scheduling import longest_first, unit_of

    class LongestUnitsFirst(LoadFileScheduling):
        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            # schedule() fills the whole queue before it hands out the first unit.
            if not self._ordered:
                order = longest_first(list(self.workqueue))
                self.workqueue = OrderedDict((unit, self.workqueue[unit]) for unit in order)
                self._ordered = True
            super()._assign_work_unit(node)

    return LongestUnitsFirst(config, log)


_TRIM_GROWTH_BYTES = 512 << 20
_rss_low = 0  # this process's lowest RSS since it last trimmed


@pytest.hookimpl(trylast=True)  # after the test's fixtures are torn down
def pytest_runtest_teardown(item, nextitem) -> None:
    """Stop the shared API server after the last module that uses it; hand freed memory back
    to the OS once this process has grown by 512 MiB over its lowest point since it last did:
    an engine's weights and KV cache, freed by a test or its module's fixtures, otherwise stay
    in glibc's fragmented heap (~1 GiB an engine), counted in the suite's peak."""
    global _rss_low
    import psutil

    from tests.support.api_server import release_shared_api_server, uses_shared_server
    from tests.support.resources import release_freed_memory

    if uses_shared_server(item.nodeid) and (
        nextitem is None or not uses_shared_server(nextitem.nodeid)
    ):
        release_shared_api_server()

    rss = psutil.Process().memory_info().rss
    if rss - _rss_low < _TRIM_GROWTH_BYTES:
        _rss_low = min(_rss_low, rss)
        return
    _rss_low = release_freed_memory()
