"""What --kv-events-config costs the engine step: the block pool's event recording, and the
publisher's `publish` on the step thread, with the shipped code.

    .venv/bin/python bench/kv_events_cost.py [--requests 2000]

1. A KVCacheManager (block 16, 257 blocks) admits and frees prompts of 512 tokens, each new
   one evicting the last one's blocks, events off and on (on: `take_events` once a request,
   as once a step): the median µs per admitted request.
2. A KVEventPublisher on ipc:// with a subscriber: the step thread's `publish` of a batch of
   one 32-block BlockStored and 32 BlockRemoved (median µs), and how many such batches a
   second reach the subscriber.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import zmq

from kvserve.services.scheduler.core.kv_cache_manager import KVCacheManager
from kvserve.services.scheduler.engine.kv_event_publisher import KVEventPublisher
from kvserve.shared.config import KVEventsConfig
from kvserve.shared.kv_events import BlockRemoved, BlockStored, KVEventBatch
from tests.support.scheduler import make_hashed_request

BLOCK_SIZE = 16
PROMPT_TOKENS = 512


def admit_free_us(num_requests: int, events: bool) -> tuple[float, int]:
    manager = KVCacheManager(257, BLOCK_SIZE, True, max_model_len=4096)
    if events:
        manager.enable_kv_events()
    requests = [
        make_hashed_request(str(i), [(i * 7 + t) % 30000 for t in range(PROMPT_TOKENS)], BLOCK_SIZE)
        for i in range(num_requests)
    ]
    times, num_events = [], 0
    for request in requests:
        start = time.perf_counter()
        hit_blocks, num_hit = manager.get_computed_blocks(request)
        manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit_blocks)
        num_events += len(manager.take_events())
        manager.free(request)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times), num_events


def publish_cost(num_batches: int) -> tuple[float, float]:
    hashes = [bytes([i]) * 32 for i in range(PROMPT_TOKENS // BLOCK_SIZE)]
    events: list = [
        BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=list(range(512)),
                    block_size=BLOCK_SIZE, lora_id=None, medium="GPU", lora_name=None),
        *(BlockRemoved(block_hashes=[h], medium="GPU") for h in hashes),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        config = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{folder}/ev"
        )
        publisher = KVEventPublisher(config, 0)
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(publisher.endpoint)
        time.sleep(0.5)
        times = []
        start_all = time.perf_counter()
        for _ in range(num_batches):
            start = time.perf_counter()
            publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))
            times.append((time.perf_counter() - start) * 1e6)
        for _ in range(num_batches):
            sub.recv_multipart()
        rate = num_batches / (time.perf_counter() - start_all)
        publisher.shutdown()
        ctx.destroy(linger=0)
    print(f"batch: {len(events)} events")
    return statistics.median(times), rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    for events in (False, True):
        best = min(admit_free_us(args.requests, events) for _ in range(3))
        print(f"admit+free of a {PROMPT_TOKENS}-token prompt, events {'on' if events else 'off'}: "
              f"{best[0]:.1f} us ({best[1]} events)")  # fmt: skip
    publish_us, rate = publish_cost(args.requests)
    print(f"publish() on the step thread: {publish_us:.1f} us; delivered {rate:,.0f} batches/s")


if __name__ == "__main__":
    main()
