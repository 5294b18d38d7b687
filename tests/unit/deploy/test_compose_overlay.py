"""The suite's overlay of compose.yaml (tests/data/compose/measure-off.yaml) changes only what
it says it changes: each engine's command is compose.yaml's word for word but for the KV cache
size, and its environment only adds the start-up timing switches."""

from __future__ import annotations

import yaml

from tests.support import REPO_ROOT

OVERLAY = REPO_ROOT / "tests" / "data" / "compose" / "measure-off.yaml"
TIMING_SWITCHES = {
    "KVSERVE_NATIVE_DECODE_MEASURE": "0",
    "KVSERVE_PREFILL_ROUTE_MEASURE": "0",
    "KVSERVE_CPU_GEMM_MEASURE": "0",
}


def _load(path) -> dict:
    return yaml.safe_load(path.read_text())["services"]


def test_the_overlay_changes_only_the_engines_kv_cache_size_and_timings() -> None:
    compose, overlay = _load(REPO_ROOT / "compose.yaml"), _load(OVERLAY)
    assert sorted(overlay) == ["engine-0", "engine-1"]
    for name, service in overlay.items():
        command = list(compose[name]["command"])
        size = command.index("--kv-cache-memory") + 1
        assert command[size] == "4GiB"
        command[size] = "512MiB"
        assert service["command"] == command, name
        assert service["environment"] == TIMING_SWITCHES, name
