"""`kvserve kv-events`: subscribe to an engine's KV cache events and print them.

One JSON object per event on stdout (`seq`, `ts`, `dp_rank`, `type` and the event's fields,
hashes in hex), in sequence order. With --replay the buffered batches from --from-seq come
first, then the live ones, each sequence number once: the SUB socket connects before the
replay is asked for, so nothing falls between the two. A gap in the live sequence (the PUB
socket dropped batches for a slow reader) is logged.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator

import zmq

from kvserve.shared.kv_events import END_SEQ, decode_batch, event_to_json
from kvserve.shared.launch_options import KvEventsOptions
from kvserve.shared.logging import init_logger
from kvserve.shared.transport import make_socket

logger = init_logger(__name__)

_REPLAY_TIMEOUT_MS = 10_000


def run_kv_events(options: KvEventsOptions) -> int:
    ctx = zmq.Context()
    try:
        sub = make_socket(ctx, options.addr, zmq.SUB, bind=False)
        if options.topic:
            sub.setsockopt(zmq.UNSUBSCRIBE, b"")
            sub.setsockopt(zmq.SUBSCRIBE, options.topic.encode())
        num_printed = 0
        for seq, payload in _batches(ctx, sub, options):
            batch = decode_batch(payload)
            for event in batch.events:
                print(json.dumps(event_to_json(seq, batch, event)), flush=True)
                num_printed += 1
                if options.max_events is not None and num_printed >= options.max_events:
                    return 0
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        ctx.destroy(linger=0)


def _batches(
    ctx: zmq.Context, sub: zmq.Socket, options: KvEventsOptions
) -> Iterator[tuple[int, bytes]]:
    """(seq, payload) of the replayed batches, then of the live ones, each seq once."""
    last_seq = -1
    if options.replay is not None:
        time.sleep(0.2)  # let the subscription reach the publisher before replay is asked
        for seq, payload in _replay(ctx, options.replay, options.from_seq):
            last_seq = seq
            yield seq, payload
    timeout_ms = None if options.idle_timeout_s is None else int(options.idle_timeout_s * 1000)
    while sub.poll(timeout_ms):
        _, seq_frame, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_frame, "big")
        if seq <= last_seq:
            continue  # already printed from the replay
        if last_seq >= 0 and seq != last_seq + 1:
            logger.warning(
                "KV events %d..%d were lost (the publisher dropped them)", last_seq + 1, seq - 1
            )
        last_seq = seq
        yield seq, payload


def _replay(ctx: zmq.Context, addr: str, from_seq: int) -> Iterator[tuple[int, bytes]]:
    replay = make_socket(ctx, addr, zmq.DEALER, bind=False)
    try:
        replay.send_multipart([b"", from_seq.to_bytes(8, "big")])
        while True:
            if not replay.poll(_REPLAY_TIMEOUT_MS):
                print(f"kvserve kv-events: no answer from replay {addr}", file=sys.stderr)
                return
            _, _, seq_frame, payload = replay.recv_multipart()
            if seq_frame == END_SEQ:
                return
            yield int.from_bytes(seq_frame, "big"), payload
    finally:
        replay.close(linger=0)
