"""The engine core's KV-event publisher: vLLM's ZmqEventPublisher, on kvserve's sockets.

The engine step only puts a batch on a queue; a background thread numbers it, encodes it,
sends it on the PUB socket and keeps it for replay, and answers replay requests on the
ROUTER socket between batches. Wire format: shared/kv_events.py. Both sockets come from
`make_socket`, so tcp:// ones are CURVE servers (or clients) with the deployment keys, as
every other socket of kvserve.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque

import msgspec
import zmq

from kvserve.shared.config import KVEventsConfig
from kvserve.shared.kv_events import END_SEQ, KVEventBatch, seq_bytes
from kvserve.shared.logging import init_logger
from kvserve.shared.transport import make_socket

logger = init_logger(__name__)

_POLL_MS = 100  # how often the idle thread checks for replay requests and shutdown


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """Engine `rank`'s address: tcp port + rank (port 0 stays 0), a `_dp{rank}` suffix on
    ipc:// and inproc:// (vLLM refuses ipc:// with DP; a suffix keeps the engines apart)."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"kv_events_config endpoint {endpoint!r} has no numeric port")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard tcp://, ipc:// and inproc://; connect to the others."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Publishes each step's KVEventBatch in order, numbered from 0, without blocking it.

    Args:
        config: --kv-events-config (publishing).
        data_parallel_rank: this engine's DP index: its port offset and every batch's stamp.
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int) -> None:
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = (
            offset_endpoint(config.replay_endpoint, data_parallel_rank)
            if config.replay_endpoint is not None
            else None
        )
        self._topic = config.topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = make_socket(self._ctx, self.endpoint, zmq.PUB, is_bind_endpoint(self.endpoint))
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._replay: zmq.Socket | None = None
        if self.replay_endpoint is not None:
            self._replay = make_socket(self._ctx, self.replay_endpoint, zmq.ROUTER, bind=True)
            self._replay.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a gone client: drop, not raise
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info(
            "KV events on %s (replay %s), DP rank %d",
            self.endpoint,
            self.replay_endpoint,
            data_parallel_rank,
        )

    def publish(self, batch: KVEventBatch) -> None:
        """Queue one step's batch; a full queue drops it with a warning (the step never
        waits; a subscriber sees the gap in sequence numbers and can resync)."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            logger.warning("KV event queue full: a batch of %d events dropped", len(batch.events))

    def shutdown(self) -> None:
        """Send what is queued (1 s at most), then close."""
        self._queue.put(None)
        self._thread.join(timeout=1.0)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seqs = itertools.count()
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None and poller.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=_POLL_MS / 1000)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq, payload = next(seqs), encoder.encode(batch)
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        """[client, b"", start seq] -> every buffered batch from it, then the END_SEQ mark."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("malformed KV event replay request (%d frames) ignored", len(frames))
            return
        client_id, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client_id, b"", self._topic, seq_bytes(seq), payload))
        self._replay.send_multipart((client_id, b"", b"", END_SEQ, b""))
