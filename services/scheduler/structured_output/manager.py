"""StructuredOutputManager: grammars compile off the busy loop, cached by key, and each step's
token bitmask is filled for the whole batch at once.

    add_request ──compile(params)──▶ cache hit? ──yes──▶ the cached Future
                                        │ no
                                        ▼
                             thread pool: XgrammarBackend.compile (drops the GIL)
    schedule():  a request WAITING_FOR_GRAMMAR whose Future is done becomes WAITING with a
                 Grammar (its matcher), or FINISHED_ERROR when the compile raised;
                 grammar_bitmask(sampling grammars) -> bytes for the SchedulerOutput
    update_from_output(): Grammar.accept_tokens(sampled tokens)

The backend (tokenizer info, compiler) is built on the pool at the first structured request,
so an engine that never sees one never loads xgrammar.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from kvserve.shared.config import StructuredOutputsConfig
from kvserve.shared.logging import init_logger
from kvserve.shared.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from kvserve.services.scheduler.structured_output.grammar import Grammar, XgrammarBackend

logger = init_logger(__name__)

# Compiles in flight at once; each is one xgrammar thread. Compiling drops the GIL, so the busy
# loop keeps stepping meanwhile.
_NUM_COMPILE_THREADS = 2
# Compiled grammars kept (each holds its token-mask cache: up to a few MB).
_CACHE_SIZE = 256

CacheKey = tuple[str, str, bool]


class StructuredOutputManager:
    """
    Args:
        model_dir: the resolved model folder (vocabulary size, EOS ids).
        tokenizer_dir: the tokenizer's folder.
        config: --structured-outputs-config.
        max_num_seqs: rows the step bitmask may need.
    """

    def __init__(
        self,
        model_dir: str,
        tokenizer_dir: str,
        config: StructuredOutputsConfig,
        max_num_seqs: int,
    ):
        self.model_dir = model_dir
        self.tokenizer_dir = tokenizer_dir
        self.config = config
        self.max_num_seqs = max_num_seqs
        self._pool: ThreadPoolExecutor | None = None
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._bitmask: np.ndarray | None = None
        self._cache: OrderedDict[CacheKey, Future[Any]] = OrderedDict()
        self._num_queries = 0
        self._num_hits = 0
        # Appended by pool threads, swapped out by the busy loop (both GIL-atomic).
        self._compile_times: list[float] = []

    # ------------------------------------------------------------------ compiling

    def compile(self, params: StructuredOutputsParams) -> Future[Any]:
        """The compiled grammar of `params`, as a Future: the cached one, or a new compile.

        A failed compile stays cached too, so a bad schema sent again fails at once.
        """
        key = params.cache_key(self.config.disable_any_whitespace)
        self._num_queries += 1
        future = self._cache.get(key)
        if future is not None:
            self._num_hits += 1
            self._cache.move_to_end(key)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_NUM_COMPILE_THREADS, thread_name_prefix="grammar")
        future = self._pool.submit(self._compile, params, key[2])
        self._cache[key] = future
        while len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams, disable_any_whitespace: bool) -> Any:
        backend = self._get_backend()
        start = time.perf_counter()
        try:
            return backend.compile(params, disable_any_whitespace)
        finally:
            self._compile_times.append(time.perf_counter() - start)

    def _get_backend(self) -> XgrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                start = time.perf_counter()
                from kvserve.services.scheduler.structured_output.grammar import XgrammarBackend

                self._backend = XgrammarBackend(self.model_dir, self.tokenizer_dir)
                logger.info(
                    "structured outputs: xgrammar ready in %.2f s (vocabulary of %d)",
                    time.perf_counter() - start,
                    self._backend.vocab_size,
                )
            return self._backend

    def make_grammar(self, future: Future[Any]) -> Grammar:
        """A fresh matcher of a finished compile; raises the compile's error if it failed."""
        compiled = future.result()
        assert self._backend is not None, "a compile finished, so the backend exists"
        return self._backend.make_grammar(compiled)

    @staticmethod
    def wait_any(futures: Iterable[Future[Any]], timeout_s: float) -> None:
        """Block until one compile finishes or timeout_s passes (an engine with nothing else
        to do waits here instead of spinning)."""
        concurrent.futures.wait(list(futures), timeout_s, concurrent.futures.FIRST_COMPLETED)

    # ------------------------------------------------------------------ each step

    def grammar_bitmask(
        self, grammars: list[Grammar], drafts: list[list[int]] | None = None
    ) -> bytes:
        """The allowed next tokens of each grammar, one row each, as SchedulerOutput bytes;
        with drafts (speculative decoding), 1 + len(drafts[i]) rows for grammars[i], one per
        position it verifies (draft_masks.py)."""
        if not grammars:
            return b""
        backend = self._backend
        assert backend is not None, "a grammar exists, so the backend does"
        num_rows = len(grammars) + (sum(len(d) for d in drafts) if drafts else 0)
        if self._bitmask is None or len(self._bitmask) < num_rows:
            num_alloc = max(num_rows, self.max_num_seqs)
            self._bitmask = np.empty((num_alloc, backend.bitmask_width), dtype=np.int32)
        rows = self._bitmask[:num_rows]
        if num_rows == len(grammars):
            backend.fill_bitmask(grammars, rows)
        else:
            from kvserve.services.scheduler.structured_output.draft_masks import (
                fill_verify_bitmask,
            )

            assert drafts is not None
            fill_verify_bitmask(backend, grammars, drafts, rows)
        return rows.tobytes()

    def take_stats(self) -> tuple[int, int, list[float]]:
        """(cache queries, cache hits, compile seconds) since the last call."""
        queries, hits = self._num_queries, self._num_hits
        self._num_queries = self._num_hits = 0
        times, self._compile_times = self._compile_times, []
        return queries, hits, times

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
