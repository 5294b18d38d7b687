"""TTFT of a request whose 2,048-token prefix the KV store holds, against recomputing it.

One `kvserve kv-store` process; a producer engine computes and saves the prompt once; then
rounds alternate (A B A B ...) between a consumer engine loading the prefix from the store
and a plain engine recomputing it, both `LLM(dtype=float32)` in this process, each round
with the local prefix cache emptied first. TTFT here is the engine's time for a request of
max_tokens=1 (the whole prefill plus one sampled token), median over the rounds.

    .venv/bin/python bench/kv_store_ttft.py --rounds 5 --prompt-len 2048
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np


def _start_store(size: str) -> tuple[subprocess.Popen, str]:
    path = os.path.join(tempfile.gettempdir(), f"kvserve-ttft-{uuid.uuid4().hex[:8]}")
    command = [sys.executable, "-m", "kvserve.cli", "kv-store", "--address", f"ipc://{path}"]
    process = subprocess.Popen([*command, "--size", size])
    while not os.path.exists(path):
        if process.poll() is not None:
            raise SystemExit("the store exited at start-up")
        time.sleep(0.05)
    return process, f"ipc://{path}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    options = parser.parse_args()

    from kvserve import LLM, SamplingParams

    store, address = _start_store("2G")
    try:
        transfer = {"kv_connector": "KvStoreConnector",
                    "kv_connector_extra_config": {"store_address": address}}  # fmt: skip
        rng = np.random.default_rng(0)
        prompt = rng.integers(1000, 40000, options.prompt_len).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=1)
        producer = LLM(
            dtype=options.dtype, kv_transfer_config={**transfer, "kv_role": "kv_producer"}
        )
        producer.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        producer.engine_core.shutdown()
        del producer
        consumer = LLM(
            dtype=options.dtype, kv_transfer_config={**transfer, "kv_role": "kv_consumer"}
        )
        plain = LLM(dtype=options.dtype)
        times: dict[str, list[float]] = {"store": [], "recompute": []}
        tokens = {}
        for _ in range(options.rounds):
            for name, llm in (("store", consumer), ("recompute", plain)):
                assert llm.reset_prefix_cache()
                start = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
                times[name].append(time.perf_counter() - start)
                tokens[name] = out[0].outputs[0].token_ids
        hits = consumer.stats_totals.external_prefix_cache_hits
        assert tokens["store"] == tokens["recompute"], tokens
    finally:
        store.terminate()
        store.wait()
    store_ms = statistics.median(times["store"]) * 1e3
    recompute_ms = statistics.median(times["recompute"]) * 1e3
    ratios = [r / s for s, r in zip(times["store"], times["recompute"])]
    print(f"prompt {options.prompt_len} tokens, {options.dtype}, {options.rounds} rounds")
    print(f"TTFT from the store:  {store_ms:8.1f} ms (median; {hits} external hit tokens)")
    print(f"TTFT recomputing:     {recompute_ms:8.1f} ms (median)")
    print(f"recompute / store:    {statistics.median(ratios):8.2f}x (median of per-round ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
