"""KV cache events through a real `kvserve serve` (the tiny model, 8 usable KV blocks):
a subscriber sees BlockStored for a prompt's full blocks with kvserve's own hashes, parents
and tokens, then BlockRemoved when a longer prompt evicts them, every batch numbered from 0
without a gap; a late subscriber replays the same batches; `kvserve kv-events` prints them."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
import zmq

from kvserve.shared.kv_events import END_SEQ, BlockRemoved, BlockStored, decode_batch
from tests.support.scheduler import make_hashed_request
from tests.support.server import DP_MODEL_NAME, start_tiny_server

BLOCK_SIZE = 16
NUM_BLOCKS = 9  # block 0 is the null block: 8 usable, 128 tokens
FIRST_PROMPT = [(7 * i) % 200 + 1 for i in range(40)]  # 2 full blocks and 8 tokens
SECOND_PROMPT = [(11 * i) % 200 + 3 for i in range(120)]  # 121 tokens with its output: 8 blocks


def _complete(url: str, prompt: list[int]) -> None:
    response = httpx.post(
        url + "/v1/completions",
        json={"model": DP_MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0},
        timeout=60,
    )
    assert response.status_code == 200, response.text


def _receive(sub: zmq.Socket, quiet_s: float = 1.5) -> list[tuple[bytes, int, bytes]]:
    """(topic, seq, payload) of every message until none came for quiet_s."""
    messages = []
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        messages.append((topic, int.from_bytes(seq, "big"), payload))
    return messages


def test_subscriber_sees_stored_then_removed_blocks_and_a_late_one_replays(
    tiny_llama_dir, tmp_path
):
    events_addr, replay_addr = f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events_addr,
        "replay_endpoint": replay_addr,
        "topic": "kv",
    }
    server = start_tiny_server(
        tiny_llama_dir,
        tmp_path,
        "--kv-events-config",
        json.dumps(config),
        "--num-gpu-blocks-override",
        str(NUM_BLOCKS),
        "--max-model-len",
        "128",
        "--block-size",
        str(BLOCK_SIZE),
    )
    ctx = zmq.Context()
    try:
        server.wait_healthy()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(events_addr)
        time.sleep(1.0)  # PUB drops what it sends before the subscription arrives
        _complete(server.url, FIRST_PROMPT)
        _complete(server.url, SECOND_PROMPT)
        messages = _receive(sub)
        assert [seq for _, seq, _ in messages] == list(range(len(messages))), server.log()
        assert {topic for topic, _, _ in messages} == {b"kv"}
        events = [event for _, _, payload in messages for event in decode_batch(payload).events]

        first_hashes = make_hashed_request("a", FIRST_PROMPT, BLOCK_SIZE).block_hashes
        assert len(first_hashes) == 2
        stored = [event for event in events if isinstance(event, BlockStored)]
        assert stored[0] == BlockStored(
            block_hashes=first_hashes,
            parent_block_hash=None,
            token_ids=FIRST_PROMPT[:32],
            block_size=BLOCK_SIZE,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        # The second prompt needs every block: the first prompt's go, tail first.
        removed = [event.block_hashes for event in events if isinstance(event, BlockRemoved)]
        assert removed == [[first_hashes[1]], [first_hashes[0]]]
        second_hashes = make_hashed_request("b", SECOND_PROMPT, BLOCK_SIZE).block_hashes
        assert [h for event in stored[1:] for h in event.block_hashes] == second_hashes
        assert events.index(stored[0]) < events.index(BlockRemoved([first_hashes[1]], "GPU"))

        # A late subscriber asks the replay socket for everything from seq 0.
        replay = ctx.socket(zmq.DEALER)
        replay.connect(replay_addr)
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert replay.poll(10_000), "no replay answer"
            _, topic, seq, payload = replay.recv_multipart()
            if seq == END_SEQ:
                break
            replayed.append((topic, int.from_bytes(seq, "big"), payload))
        assert replayed == messages

        printed = subprocess.run(
            [sys.executable, "-m", "kvserve.cli", "kv-events", "--addr", events_addr,
             "--replay", replay_addr, "--topic", "kv", "--max-events", str(len(events))],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert printed.returncode == 0, printed.stderr
        lines = [json.loads(line) for line in printed.stdout.splitlines()]
        assert [line["type"] for line in lines] == [type(event).__name__ for event in events]
        assert lines[0]["block_hashes"] == [h.hex() for h in first_hashes]
        assert lines[0]["token_ids"] == FIRST_PROMPT[:32] and lines[0]["dp_rank"] == 0
        assert [line["seq"] for line in lines] == sorted(line["seq"] for line in lines)
    finally:
        ctx.destroy(linger=0)
        server.stop()


@pytest.mark.parametrize("flag", ['{"publisher": "kafka"}'])
def test_bad_kv_events_config_is_refused(flag, tiny_llama_dir, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", tiny_llama_dir, "--kv-events-config", flag],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "kafka" in result.stderr
