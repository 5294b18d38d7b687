"""Helpers shared by the tests; no test lives here.

Test modules import helpers from this package only, never from each other (fixtures stay in
conftest.py files, where pytest injects them). One module per topic:

    ports.py          a free TCP port
    cache_dir.py      the session's $KVSERVE_CACHE_DIR (user's models, own GEMM plans)
    waiting.py        poll a condition until it holds (threads and asyncio)
    processes.py      wait for processes to exit; the engine child of a launcher
    models.py         tiny random-weight models: a numpy Llama folder, HF models, a GGUF
    kv.py             the leaked-block checks every scheduler and engine test ends with
    scheduler.py      a small Scheduler, requests and a fake model's outputs
    engine.py         a real engine-core process behind an MPEngineClient
    server.py         `kvserve serve` and friends as a user runs them: launch, /health, stop
    api_server.py     uvicorn in a thread of the test process over an in-process engine
    inproc_client.py  InprocEngineClient: an EngineCore in a thread, for the HTTP tests
    metrics.py        Prometheus samples of /metrics
    kernels.py        paged batches, tolerances and naive oracles for the kernel tests
    distributed.py    gloo process groups of the multi-rank worker tests
    scheduling.py     which modules pytest-xdist's workers take first, and which together

Importing any of them does not import torch, except kernels.py and distributed.py.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
