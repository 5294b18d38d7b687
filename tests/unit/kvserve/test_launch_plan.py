"""Which children `kvserve serve` starts for which flags (kvserve/launch/serve.py's
`FrontEnd`): nothing is started here, each child is a context manager not yet entered."""

from __future__ import annotations

import pytest

from kvserve.cli import parse_options
from kvserve.launch.engines import EngineLaunch
from kvserve.launch.serve import FrontEnd, expect_key_file_targets
from kvserve.shared.transport import CoordinatorAddresses, EngineAddresses


def _plan(*argv: str) -> FrontEnd:
    command, options = parse_options(["serve", *argv])
    assert command == "serve"
    return FrontEnd(options)


def _launch(plan: FrontEnd) -> EngineLaunch:
    addresses = EngineAddresses("ipc:///tmp/in", "ipc:///tmp/out")
    return EngineLaunch(
        model_dir="/m", addresses=addresses, num_local_engines=plan.num_local_engines
    )


def test_one_engine_core_has_no_other_children():
    plan = _plan()
    assert (plan.num_engines, plan.num_local_engines) == (1, 1)
    assert plan.kv_store() is None and plan.coordinator() is None
    assert plan.registration(EngineAddresses("ipc:///a", "ipc:///b"), None) is None
    assert plan.engine_addresses().input_addr.startswith("ipc://")
    engines = plan.engine_cores(_launch(plan), None)
    assert list(engines.configs) == [0] and not engines.restart
    topology = plan.engine_topology(None, None)
    assert (
        topology.num_engines == 1
        and topology.load_table_addr is None
        and not topology.wait_for_restarts
    )


@pytest.mark.parametrize("restart", [False, True])
def test_data_parallel_adds_the_coordinator(restart):
    plan = _plan("-dp", "2", *(["--restart-dead-engines"] if restart else []))
    assert (plan.num_engines, plan.num_local_engines) == (2, 2)
    assert plan.kv_store() is None and plan.coordinator() is not None
    engines = plan.engine_cores(_launch(plan), None)
    assert list(engines.configs) == [0, 1] and engines.restart == restart
    topology = plan.engine_topology(CoordinatorAddresses("ipc:///s", "ipc:///p"), None)
    assert topology.load_table_addr == "ipc:///p" and topology.wait_for_restarts == restart


def test_pd_adds_the_kv_store_and_gives_each_engine_its_role():
    plan = _plan("--prefill-size", "1", "--decode-size", "2")
    assert (plan.num_engines, plan.num_local_engines) == (3, 3)
    assert plan.kv_store() is not None and plan.coordinator() is not None
    engines = plan.engine_cores(_launch(plan), "ipc:///tmp/kv-store")
    transfers = [engines.configs[index].kv_transfer_config for index in range(3)]
    assert [t.kv_role for t in transfers] == ["kv_producer", "kv_consumer", "kv_consumer"]
    assert {t.store_address for t in transfers} == {"ipc:///tmp/kv-store"}
    topology = plan.engine_topology(None, "ipc:///tmp/kv-store")
    assert topology.kv_store_address == "ipc:///tmp/kv-store"


def test_pd_passes_the_disk_tier_to_its_kv_store():
    plan = _plan(
        "--prefill-size", "1", "--decode-size", "1", "--kv-store-size", "1G",
        "--kv-store-disk-path", "/var/kv", "--kv-store-disk-bytes", "2G",
    )  # fmt: skip
    store = plan.options.pd.store_options("ipc:///tmp/kv-store")
    assert (store.address, store.size) == ("ipc:///tmp/kv-store", 1 << 30)
    assert (store.disk_path, store.disk_bytes) == ("/var/kv", 2 << 30)
    without = _plan("--prefill-size", "1", "--decode-size", "1").options.pd
    assert without.store_options("ipc:///s").disk_path is None


def test_a_disk_tier_of_no_bytes_is_refused(capsys):
    with pytest.raises(SystemExit):
        _plan(
            "--prefill-size", "1", "--decode-size", "1", "--kv-store-disk-path", "/d",
            "--kv-store-disk-bytes", "0",
        )  # fmt: skip
    assert "--kv-store-disk-bytes must be positive, got 0" in capsys.readouterr().err


def test_the_offload_disk_tier_reaches_each_engines_config_and_needs_the_offload_tier(capsys):
    plan = _plan("--kv-offloading-size", "2", "--kv-offloading-disk-path", "/var/kv")
    (config,) = plan.engine_cores(_launch(plan), None).configs.values()
    assert config.cache.kv_offloading_disk_path == "/var/kv"
    assert config.cache.kv_offloading_disk_bytes == 16 << 30
    with pytest.raises(SystemExit):
        _plan("--kv-offloading-disk-path", "/var/kv")
    assert "--kv-offloading-disk-path needs --kv-offloading-size" in capsys.readouterr().err


def test_multi_node_binds_tcp_and_answers_headless_nodes():
    plan = _plan("-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "h")
    assert (plan.num_engines, plan.num_local_engines) == (2, 1)
    assert plan.engine_addresses() == EngineAddresses("tcp://h:*", "tcp://h:*")
    assert plan.registration(EngineAddresses("tcp://h:1", "tcp://h:2"), None) is not None
    assert list(plan.engine_cores(_launch(plan), None).configs) == [0]
    assert plan.engine_topology(None, None).wait_for_restarts  # the remote node may rejoin


@pytest.mark.parametrize(
    ("key_file", "timed"),
    [
        ("a:sk-1 slo_ttft_ms=500\nb:sk-2\n", True),
        ("a:sk-1 slo_tpot_ms=80\n", True),
        ("a:sk-1 weight=2\n", False),
        ("a:sk-1 slo_ttft_ms=-1\n", False),  # the api names the bad line
    ],
)
def test_a_key_file_with_latency_targets_turns_on_the_start_up_step_timing(
    tmp_path, key_file, timed
):
    path = tmp_path / "keys.txt"
    path.write_text(key_file)
    _, options = parse_options(["serve", "--api-key-file", str(path)])
    assert not options.engine.scheduler.slo_step_timing
    timing = expect_key_file_targets(options).engine.scheduler.slo_step_timing
    assert timing is timed
    _, options = parse_options(["serve", "--api-key-file", str(path), "--slo-step-timing"])
    assert expect_key_file_targets(options).engine.scheduler.slo_step_timing
