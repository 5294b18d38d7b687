"""KV bytes a P/D transfer moves for one long Gemma 3 prompt, with and without KV cache groups.

Computed, not timed, by the shipped code: the groups and the bytes of one store block come
from `plan_kv_cache_groups` and the block sizing of Gemma 3 shaped models built on the meta
device (as bench/kv_groups.py does); then the shipped Scheduler with the store connector
(`StoreSchedulerConnector` over a `SharedStorageBackend` folder) runs a P/D prefill engine
(kv_producer: the prompt in chunks of the default token budget, one token decoded) and a
decode engine (kv_consumer: its external hit), each step's runner output made by hand (no
model runs). The store blocks listed in the metadata's saves and loads, times the bytes of
one store block (every layer's page without groups, one group's with them), are what the
workers would copy. The folder holds one tiny file per block (a 1 x 1 layout), so the walk's
lookups see what was saved.

    .venv/bin/python bench/kv_groups_store.py [--dtype bfloat16] [--tokens 32768]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from kvserve.services.kv_store.backends import SharedStorageBackend
from kvserve.services.kv_store.scheduler_connector import StoreSchedulerConnector
from kvserve.services.kv_store.transfers import StoreConnectorOutput, decode_meta, encode
from kvserve.services.scheduler.core.scheduler import Scheduler, SchedulerFeatures
from kvserve.services.worker.kv_cache_groups import (
    group_kv_cache_bytes_per_block,
    plan_kv_cache_groups,
)
from kvserve.services.worker.layers.attention import Attention, kv_cache_bytes_per_block
from kvserve.services.worker.models.gemma3 import Gemma3ForCausalLM
from kvserve.shared.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from kvserve.shared.messages import EngineCoreRequest, KvFingerprint, ModelRunnerOutput
from kvserve.shared.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from kv_groups import BLOCK_SIZE, _configs  # noqa: E402 - the same shapes as kv_groups.py

# Each saved block is a file of this layout: its bytes do not matter, only that it is there.
_TINY = KvFingerprint(
    model="bench", dtype="float32", block_size=BLOCK_SIZE, num_layers=1, num_kv_heads=1,
    head_size=1,
)  # fmt: skip


def _engine(folder: str, role: str, groups, num_blocks: int, max_model_len: int) -> Scheduler:
    config = KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role=role,
        kv_connector_extra_config={"shared_storage_path": folder},
    )
    return Scheduler(
        SchedulerConfig(),
        CacheConfig(block_size=BLOCK_SIZE),
        num_blocks,
        max_model_len,
        features=SchedulerFeatures(
            kv_cache_groups=groups,
            kv_connector=StoreSchedulerConnector(config, _TINY, BLOCK_SIZE),
        ),
    )


def _run(engine: Scheduler, prompt: list[int], req_id: str, folder: str) -> tuple[int, int]:
    """Step one request to its end: (store blocks saved, store blocks loaded)."""
    backend = SharedStorageBackend(folder, _TINY)
    cache = [torch.zeros(2, engine.kv_cache_manager.block_pool.num_blocks, BLOCK_SIZE, 1, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request(EngineCoreRequest(req_id, prompt, params))
    num_saved = num_loaded = 0
    while engine.has_requests():
        so = engine.schedule()
        meta = decode_meta(so.kv_connector_metadata)
        for save in meta.saves:
            backend.put(save.block_hashes, cache, save.block_ids)
            num_saved += len(save.block_hashes)
        loaded = {load.req_id: len(load.block_hashes) for load in meta.loads}
        num_loaded += sum(loaded.values())
        # What a model would return: a token once the prompt is all computed.
        req_ids = list(so.num_scheduled_tokens)
        requests = [engine.requests[req_id] for req_id in req_ids]
        sampled = [[7] if r.num_computed_tokens >= r.num_tokens else [] for r in requests]
        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)
        out.kv_connector_output = encode(StoreConnectorOutput(loaded=loaded))
        engine.update_from_output(so, out)
    return num_saved, num_loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=32768)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    chunk = SchedulerConfig().max_num_batched_tokens
    print(
        f"dtype {args.dtype}, block {BLOCK_SIZE} tokens, one prompt of {args.tokens} tokens, "
        f"prefill chunks of {chunk}, P/D: prefill engine saves, decode engine loads"
    )
    prompt = [1, *range(args.tokens - 1)]
    for name, config in _configs().items():
        with torch.device("meta"):
            model = Gemma3ForCausalLM(config)
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        groups = plan_kv_cache_groups(EngineConfig(), layers, single_stage=True)
        print(f"\n{name}: {len(groups)} groups of {len(groups[0].layer_indices)} layers")
        print(
            "| transfer | block bytes | blocks saved | bytes saved | blocks loaded | bytes loaded |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        # Room for the whole prompt in every group: nothing is evicted or preempted.
        num_blocks = len(groups) * (args.tokens // BLOCK_SIZE + 2) + 1
        totals = []
        for label, engine_groups, per_block in (
            ("one table (before)", None, kv_cache_bytes_per_block(layers, BLOCK_SIZE, dtype)),
            (
                "per KV cache group (after)",
                groups,
                group_kv_cache_bytes_per_block(layers, groups, BLOCK_SIZE, dtype),
            ),
        ):
            with tempfile.TemporaryDirectory() as folder:
                prefill = _engine(folder, "kv_producer", engine_groups, num_blocks, args.tokens + 1)
                num_saved, _ = _run(prefill, prompt, "p", folder)
                decode = _engine(folder, "kv_consumer", engine_groups, num_blocks, args.tokens + 1)
                _, num_loaded = _run(decode, prompt, "d", folder)
            saved, loaded = num_saved * per_block, num_loaded * per_block
            totals.append((saved, loaded))
            print(
                f"| {label} | {per_block:,} | {num_saved:,} | {saved / 2**20:,.1f} MiB "
                f"| {num_loaded:,} | {loaded / 2**20:,.1f} MiB |"
            )
        (saved0, loaded0), (saved1, loaded1) = totals
        print(f"before / after: saved {saved0 / saved1:.2f}x, loaded {loaded0 / loaded1:.2f}x")


if __name__ == "__main__":
    main()
