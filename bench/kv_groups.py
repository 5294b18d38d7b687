"""KV bytes per long request, and how many fit, with and without KV cache groups (Gemma 3).

Builds Gemma 3 shaped models on the meta device (no weights, no memory) with the shipped
model class, asks the shipped code for the groups (`plan_kv_cache_groups`, what the worker
runs at start-up) and for the bytes of one block (`kv_cache_bytes_per_block` over every
layer: one table for all; `group_kv_cache_bytes_per_block`: a page of one group's layers),
and divides the budget by it as `Worker.determine_num_blocks` does. Then it drives the real
block managers (KVCacheManager: one table, every block kept; GroupedKVCacheManager: a table
per group, windows give back) with requests of `--tokens` prompt tokens, prefilled in chunks
of the scheduler's default token budget, then one decoded token each, admitting requests one
after another until the next one no longer fits. The bytes per request are the blocks it
holds once decoding, times the block bytes.

    .venv/bin/python bench/kv_groups.py [--dtype bfloat16] [--budget-gib 4] [--tokens 32768]
"""

from __future__ import annotations

import argparse

import torch

from kvserve.services.scheduler.core.kv_cache_groups import GroupedKVCacheManager
from kvserve.services.scheduler.core.kv_cache_manager import KVCacheManager
from kvserve.services.scheduler.core.request import Request, make_block_hasher
from kvserve.services.worker.kv_cache_groups import (
    group_kv_cache_bytes_per_block,
    plan_kv_cache_groups,
)
from kvserve.services.worker.layers.attention import Attention, kv_cache_bytes_per_block
from kvserve.services.worker.models.gemma3 import Gemma3ForCausalLM
from kvserve.shared.config import EngineConfig, SchedulerConfig
from kvserve.shared.hashing import get_hash_fn
from kvserve.shared.sampling_params import SamplingParams

BLOCK_SIZE = 16


def _configs() -> dict:
    import transformers as tf

    def gemma3(num_layers: int, hidden: int, kv_heads: int, heads: int) -> object:
        return tf.Gemma3TextConfig(
            vocab_size=262144,
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=256,
            sliding_window=1024,
            layer_types=[
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                for i in range(num_layers)
            ],
            max_position_embeddings=131072,
        )

    return {
        "tiny-but-long (6 layers, 5 sliding in 6, window 1024, 1 KV head x 256)": gemma3(
            6, 256, 1, 4
        ),
        "Gemma 3 4B shape (34 layers, 5 sliding in 6, window 1024, 4 KV heads x 256)": gemma3(
            34, 2560, 4, 8
        ),
    }


def fill(manager: KVCacheManager, num_tokens: int, chunk: int) -> tuple[int, int]:
    """Admit requests of num_tokens until one no longer fits: (how many fit, blocks the
    first one holds while decoding)."""
    hasher = make_block_hasher(BLOCK_SIZE, get_hash_fn("sha256"))
    num_fit, first_blocks = 0, 0
    while True:
        prompt = [num_fit + 1, *range(num_tokens - 1)]  # a distinct first block each
        request = Request(f"r{num_fit}", prompt, SamplingParams(), block_hasher=hasher)
        while request.num_computed_tokens < num_tokens:
            step = min(chunk, num_tokens - request.num_computed_tokens)
            if manager.allocate_slots(request, step) is None:
                return num_fit, first_blocks
            request.num_computed_tokens += step
        request.append_output_token_ids(1)
        if manager.allocate_slots(request, 1) is None:
            return num_fit, first_blocks
        request.num_computed_tokens += 1
        if num_fit == 0:
            first_blocks = manager.num_total_blocks - manager.num_free_blocks
        num_fit += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--tokens", type=int, default=32768)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    budget = int(args.budget_gib * 2**30)
    chunk = SchedulerConfig().max_num_batched_tokens
    print(
        f"dtype {args.dtype}, block {BLOCK_SIZE} tokens, budget {args.budget_gib:g} GiB, "
        f"requests of {args.tokens} prompt tokens (+1 decoded), prefill chunks of {chunk}"
    )
    for name, config in _configs().items():
        with torch.device("meta"):
            model = Gemma3ForCausalLM(config)
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        groups = plan_kv_cache_groups(EngineConfig(), layers, single_stage=True)
        one_table = kv_cache_bytes_per_block(layers, BLOCK_SIZE, dtype)
        grouped = group_kv_cache_bytes_per_block(layers, groups, BLOCK_SIZE, dtype)
        print(f"\n{name}: {len(groups)} groups of {len(groups[0].layer_indices)} layers")
        print("| cache | block bytes | blocks in budget | KV bytes / request | requests that fit |")
        print("|---|---:|---:|---:|---:|")
        rows = []
        for label, per_block, manager in (
            ("one table, every block (before)", one_table, None),
            ("KV cache groups (after)", grouped, groups),
        ):

            def make(num_blocks: int, groups=manager) -> KVCacheManager:
                if groups is None:
                    return KVCacheManager(num_blocks, BLOCK_SIZE)
                return GroupedKVCacheManager(num_blocks, BLOCK_SIZE, groups)

            num_blocks = budget // per_block  # Worker.determine_num_blocks
            num_fit, _ = fill(make(num_blocks), args.tokens, chunk)
            # One request alone in a pool that holds it whole: the blocks it keeps decoding.
            room = len(groups) * (args.tokens // BLOCK_SIZE + 2) + 1
            _, num_request_blocks = fill(make(room), args.tokens, chunk)
            request_bytes = num_request_blocks * per_block
            rows.append(request_bytes)
            print(
                f"| {label} | {per_block:,} | {num_blocks:,} | {request_bytes / 2**20:,.1f} MiB "
                f"| {num_fit} |"
            )
        print(f"KV bytes per request, before / after: {rows[0] / rows[1]:.2f}x")


if __name__ == "__main__":
    main()
