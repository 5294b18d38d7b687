"""EngineLoadTable and the coordinator process's publish loop over real sockets."""

from __future__ import annotations

import time

import msgspec
import zmq

from kvserve.services.coordinator.coordinator import start_coordinator_process
from kvserve.services.coordinator.load_table import EngineLoadTable
from kvserve.shared.transport import CoordinatorAddresses, make_socket
from kvserve.shared.wire import EngineLoad, LoadTable


def test_rows_update_and_flag_changes():
    table = EngineLoadTable(stale_after_s=3.0)
    table.update(EngineLoad(1, 2, 3), now=0.0)
    table.update(EngineLoad(0, 0, 1), now=0.0)
    assert table.changed and len(table) == 2 and 1 in table
    assert table.snapshot() == [EngineLoad(0, 0, 1), EngineLoad(1, 2, 3)]
    table.changed = False
    table.update(EngineLoad(1, 2, 3), now=1.0)  # same load: a keepalive, not a change
    assert not table.changed
    table.update(EngineLoad(1, 0, 4), now=1.0)
    assert table.changed


def test_silent_engines_drop_out():
    table = EngineLoadTable(stale_after_s=3.0)
    table.update(EngineLoad(0, 0, 0), now=0.0)
    table.update(EngineLoad(1, 0, 0), now=2.0)
    table.changed = False
    assert table.drop_stale(now=4.0) == [0]
    assert table.changed and table.snapshot() == [EngineLoad(1, 0, 0)]
    assert table.drop_stale(now=4.5) == []


def test_coordinator_process_publishes_what_engines_report():
    process, addresses = start_coordinator_process(CoordinatorAddresses.tcp("127.0.0.1"))
    ctx = zmq.Context()
    try:
        assert ":*" not in addresses.stats_addr  # the bound ports, not the wildcard
        sub = make_socket(ctx, addresses.publish_addr, zmq.SUB, bind=False)
        push = make_socket(ctx, addresses.stats_addr, zmq.PUSH, bind=False)
        decoder = msgspec.msgpack.Decoder(LoadTable)
        deadline = time.monotonic() + 20
        loads = []
        while loads != [EngineLoad(0, 1, 2), EngineLoad(1, 0, 5)]:
            assert time.monotonic() < deadline, f"table never showed both engines: {loads}"
            push.send(msgspec.msgpack.encode(EngineLoad(0, 1, 2)))
            push.send(msgspec.msgpack.encode(EngineLoad(1, 0, 5)))
            if sub.poll(200):
                loads = decoder.decode(sub.recv()).loads
        push.send(b"not a load")  # a stray peer does not stop the coordinator
        push.send(msgspec.msgpack.encode(EngineLoad(1, 7, 0)))
        while EngineLoad(1, 7, 0) not in loads:
            assert time.monotonic() < deadline, loads
            if sub.poll(200):
                loads = decoder.decode(sub.recv()).loads
        assert process.is_alive()
    finally:
        ctx.destroy(linger=0)
        process.terminate()
        process.join(10)
    assert process.exitcode == 0
