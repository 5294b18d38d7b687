"""Which blocks of each KV cache group the store connector looks up, loads and saves.

Each group keys its blocks under the request's block hashes plus its own suffix (b"" for
group 0; services/scheduler/core/kv_cache_groups.py), so the store holds every group's
blocks apart, in one pool of the engine's layout. A full group's blocks form a chain: a hit
of k blocks needs all of them. A sliding-window or chunked group needs only the blocks that
its first query past the hit reads (`KVCacheGroupSpec.first_needed_token`): that is all it
loads, and all it saves, as the local prefix hit would give it. One group of every layer (no
groups) is one full group: the walk is then the plain chain it always was.

    window 16, block size 4, hit of 6 blocks past 2 local ones (blocks 2..7):
        full group:     load blocks 2 3 4 5 6 7
        sliding group:  load blocks         5 6 7   (keys from 24 - 16 + 1 = 9 on)

A load lists every group's blocks in one transfer, group after group; the store answers how
many of it, from the first, it loaded, and `loaded_end` turns that into the longest hit
every group still serves (the rest is recomputed).
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.services.kv_store.transfers import KVBlockTransfer
from kvserve.shared.kv_cache_groups import KVCacheGroupSpec

Range = tuple[int, int]  # blocks [start, end) of one group


class GroupBlocks:
    """The engine's KV cache groups as the store connector walks them.

    Args:
        groups: the KV cache manager's groups (one full group without groups).
        hash_suffixes: each group's key suffix, as the manager caches its blocks.
        block_size: tokens per block.
    """

    def __init__(self, groups: list[KVCacheGroupSpec], hash_suffixes: list[bytes], block_size: int):
        self.groups = groups
        self.hash_suffixes = hash_suffixes
        self.block_size = block_size

    def first_needed_block(self, group: KVCacheGroupSpec, num_blocks: int) -> int:
        """The first block a query at token num_blocks * block_size reads in `group`."""
        return group.first_needed_token(num_blocks * self.block_size) // self.block_size

    def load_ranges(self, num_local: int, end: int) -> list[Range]:
        """Per group, the blocks a hit of `end` blocks takes from the store when the engine's
        own cache gives the first `num_local` (a windowed group's before its window: none)."""
        return [(max(num_local, self.first_needed_block(group, end)), end) for group in self.groups]

    def save_ranges(self, first: int, num_full: int) -> list[Range]:
        """Per group, the blocks to save when the request's full blocks grow from `first` to
        `num_full`: all of a full group's; of a windowed group's, those a hit at num_full - 1
        or num_full blocks reads (a prompt's hit ends there: its last token is recomputed)."""
        ranges = []
        for group in self.groups:
            start = first if group.is_full else self.first_needed_block(group, num_full - 1)
            ranges.append((max(first, start), num_full))
        return ranges

    def hit_end(
        self, block_hashes: list[bytes], num_local: int, lookup: Callable[[list[bytes]], int]
    ) -> int:
        """The longest hit (in blocks, from 0) whose blocks past `num_local` the store holds
        in every group. `lookup(hashes)`: how many of them, from the first, it holds."""
        end = len(block_hashes)
        for group, suffix in zip(self.groups, self.hash_suffixes):
            if group.is_full and end > num_local:
                end = num_local + lookup(_keys(block_hashes, num_local, end, suffix))
        # A windowed group may lack any block: check the window of the candidate end, and
        # on a miss at block m, try m (the first end whose window leaves m out).
        windowed = [(g, s) for g, s in zip(self.groups, self.hash_suffixes) if not g.is_full]
        while end > num_local:
            for group, suffix in windowed:
                start = max(num_local, self.first_needed_block(group, end))
                num_held = lookup(_keys(block_hashes, start, end, suffix))
                if num_held < end - start:
                    end = start + num_held
                    break
            else:
                return end
        return num_local

    def transfer(
        self,
        req_id: str,
        block_hashes: list[bytes],
        group_block_ids: list[list[int]],
        ranges: list[Range],
    ) -> KVBlockTransfer | None:
        """One transfer of every group's blocks in `ranges`, group after group (None: none)."""
        hashes: list[bytes] = []
        block_ids: list[int] = []
        for (start, end), suffix, ids in zip(ranges, self.hash_suffixes, group_block_ids):
            hashes += _keys(block_hashes, start, end, suffix)
            block_ids += ids[start:end]
        assert 0 not in block_ids, f"request {req_id} would move the null block"
        return KVBlockTransfer(req_id, hashes, block_ids) if hashes else None

    def loaded_end(self, num_local: int, ranges: list[Range], num_loaded: int) -> int:
        """The longest hit every group serves when the first `num_loaded` blocks of the
        transfer of `ranges` (load_ranges' of the end asked) loaded."""
        loaded = []  # per group: blocks [start, start + count) arrived
        offset = 0
        for start, end in ranges:
            loaded.append((start, min(max(num_loaded - offset, 0), end - start)))
            offset += end - start
        end = ranges[0][1] if ranges else num_local
        while end > num_local:
            needed = self.load_ranges(num_local, end)
            if all(
                start <= need_start and need_end <= start + count
                for (start, count), (need_start, need_end) in zip(loaded, needed)
            ):
                return end
            end -= 1
        return num_local


def _keys(block_hashes: list[bytes], start: int, end: int, suffix: bytes) -> list[bytes]:
    return [block_hash + suffix for block_hash in block_hashes[start:end]]
