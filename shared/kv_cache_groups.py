"""KV cache groups: the attention layers split by what of the context they read.

A full-attention layer reads every key; a sliding-window layer (window W) reads the last W
keys only; a chunked-local layer (chunk C, Llama 4) reads the keys of its own chunk. Layers of
one kind form groups of EQUAL layer count, and every group has its own block table per
request over one shared pool of blocks: block id b is page b of each of the cache's
`group_size` tensors, and tensor j serves layer j of every group. So one block holds the same
bytes whatever group it serves, and a sliding group gives back the blocks that fall out of
its window while the full group keeps all of its own.

    Gemma 3, 6 layers, 5 sliding in 6:  group size 1, 6 groups, 1 cache tensor
        groups:  [s: 0] [s: 1] [s: 2] [s: 3] [s: 4] [full: 5]
    Gemma 2, 4 layers alternating:      group size 2, 2 groups, 2 cache tensors
        groups:  [s: 0, 2] [full: 1, 3]
    Llama, Mistral (one kind):           one group of every layer (today's single table)

The worker derives the groups from its layers (`make_kv_cache_groups`) and sizes the cache
by `group_size` layers a block; the scheduler's GroupedKVCacheManager
(services/scheduler/core/kv_cache_groups.py) gives each group its blocks, and block ids
travel group-major: G equal slices, one per group (services/worker/input_batch.py).
"""

from __future__ import annotations

import msgspec


class KVCacheGroupSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One group of attention layers that share a block table.

    Args:
        layer_indices: the layers, as indices into the runner's attention-layer list; the
            j-th is bound to cache tensor j.
        sliding_window: the layers' window W (a query at p sees keys > p - W); 0: none.
        chunk_size: the layers' chunk C (a query at p sees keys from p // C * C); 0: none.
    """

    layer_indices: list[int]
    sliding_window: int = 0
    chunk_size: int = 0

    @property
    def is_full(self) -> bool:
        """Every key stays visible: the group never gives blocks back."""
        return self.sliding_window == 0 and self.chunk_size == 0

    @property
    def spec_kind(self) -> str:
        """vLLM's name for the kind (`KVCacheSpecKind`, in KV events)."""
        if self.chunk_size:
            return "chunked_local_attention"
        return "sliding_window" if self.sliding_window else "full_attention"

    def first_needed_token(self, num_computed_tokens: int) -> int:
        """The first key position any query from `num_computed_tokens` on still reads."""
        first = 0
        if self.sliding_window:
            first = max(first, num_computed_tokens - self.sliding_window + 1)
        if self.chunk_size:
            first = max(first, num_computed_tokens // self.chunk_size * self.chunk_size)
        return first


def hash_suffix(group_index: int) -> bytes:
    """What group `group_index` appends to a block hash to key its own blocks (group 0:
    nothing, so its keys are the request's hashes)."""
    return group_index.to_bytes(2, "little") if group_index else b""


def make_kv_cache_groups(kinds: list[tuple[int, int]]) -> list[KVCacheGroupSpec]:
    """Group layers by kind: `kinds[i]` is layer i's (sliding_window, chunk_size), 0 for none.

    One kind gives one group of every layer. Several give groups of the smallest kind's
    layer count, in the order of their first layers; a kind whose count is no multiple of
    it ends in a shorter group (its missing tensors are unused padding).
    """
    by_kind: dict[tuple[int, int], list[int]] = {}
    for index, kind in enumerate(kinds):
        by_kind.setdefault(kind, []).append(index)
    group_size = min((len(layers) for layers in by_kind.values()), default=0)
    groups = []
    for (window, chunk), layers in by_kind.items():
        for start in range(0, len(layers), group_size):
            groups.append(
                KVCacheGroupSpec(
                    layer_indices=layers[start : start + group_size],
                    sliding_window=window,
                    chunk_size=chunk,
                )
            )
    groups.sort(key=lambda group: group.layer_indices[0])
    return groups


def group_size_of(groups: list[KVCacheGroupSpec]) -> int:
    """Cache tensors the groups share: the largest group's layer count."""
    return max(len(group.layer_indices) for group in groups)


def is_single_full_group(groups: list[KVCacheGroupSpec] | None) -> bool:
    """Today's layout: one table for every layer, no block ever given back."""
    return groups is None or (len(groups) == 1 and groups[0].is_full)
