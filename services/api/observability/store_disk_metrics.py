"""The KV store's disk tier on /metrics (kvserve's own series; vLLM has none).

The store counts these since it started (`kvserve kv-store --disk-path`); each engine whose KV
connector talks to it reads them at most once a second (kv_store/scheduler_connector.py) and
sends them in its SchedulerStats, so every engine of one store reports the same figures, as
`kvserve:kv_store_hits` does. All read 0 for a store without a disk tier.

- kvserve:kv_store_disk_bytes              bytes of block files held (headers included)
- kvserve:kv_store_disk_blocks             block files held (written or being written)
- kvserve:kv_store_disk_blocks_written     block files written whole (spills and pins)
- kvserve:kv_store_disk_blocks_read        blocks read back from disk (verified)
- kvserve:kv_store_disk_blocks_evicted     unpinned block files deleted to make room
- kvserve:kv_store_disk_checksum_failures  files found torn, truncated, corrupted or foreign
"""

from __future__ import annotations

# (name, help, reader of one engine's SchedulerStats): gauges, since a store restart resets
# them and several engines repeat one store's figures (summing them would double-count).
DISK_GAUGES = (
    (
        "kvserve:kv_store_disk_bytes",
        "Bytes of block files the KV store's disk tier holds (headers included).",
        lambda stats: stats.kv_store_disk_bytes,
    ),
    (
        "kvserve:kv_store_disk_blocks",
        "Block files the KV store's disk tier holds (written or being written).",
        lambda stats: stats.kv_store_disk_blocks,
    ),
    (
        "kvserve:kv_store_disk_blocks_written",
        "Block files the KV store's disk tier wrote whole since the store started.",
        lambda stats: stats.kv_store_disk_writes,
    ),
    (
        "kvserve:kv_store_disk_blocks_read",
        "Blocks the KV store read back from its disk tier since it started.",
        lambda stats: stats.kv_store_disk_reads,
    ),
    (
        "kvserve:kv_store_disk_blocks_evicted",
        "Unpinned block files the KV store's disk tier deleted to make room since it started.",
        lambda stats: stats.kv_store_disk_evictions,
    ),
    (
        "kvserve:kv_store_disk_checksum_failures",
        "Disk-tier files found torn, truncated, corrupted or foreign (each read as a miss).",
        lambda stats: stats.kv_store_disk_checksum_failures,
    ),
)
