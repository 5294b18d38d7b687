"""bench/gpu_check.py runs on a CPU too, so the GPU machine never meets an untried script."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests.support.models import TINY_KV_CACHE_MEMORY

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench", "gpu_check.py")


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_attention_check_reports_bandwidth_per_shape(gpu_check, capsys):
    gpu_check.main(["attention", "--target", "0"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["shape"] for r in lines] == [s[0] for s in gpu_check.ATTENTION_SHAPES]
    for r in lines:
        assert r["kv_gbps"] > 0 and r["copy_gbps"] > 0 and r["ok"]


def test_greedy_check_compares_with_hf(gpu_check, tiny_llama_dir, capsys):
    argv = ["greedy", "--model", tiny_llama_dir, "--max-tokens", "8"]
    assert gpu_check.main([*argv, "--kv-cache-memory", str(TINY_KV_CACHE_MEMORY)]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result == {
        "check": "greedy_equals_hf",
        "device": "cpu",
        "prompts": len(gpu_check.PROMPTS),
        "equal": len(gpu_check.PROMPTS),
        "divergences": [],
        "ok": True,
    }


def test_cuda_graphs_check_compares_with_enforce_eager(gpu_check, tiny_llama_dir, capsys):
    argv = ["cuda_graphs", "--model", tiny_llama_dir, "--max-tokens", "4"]
    argv += ["--batch-sizes", "1", "2", "--num-steps", "2"]
    assert gpu_check.main([*argv, "--kv-cache-memory", str(TINY_KV_CACHE_MEMORY)]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["check"] == "cuda_graphs" and result["ok"]
    assert result["equal"] == result["prompts"] == len(gpu_check.PROMPTS)
    assert (result["captured"], result["replays"]) == ([], 0)  # a CPU captures none
    assert set(result["decode_step_ms"]) == {"eager", "graphs"}
    assert list(result["decode_step_ms"]["eager"]) == list(result["speedup"]) == ["1", "2"]
    assert result["summary"].startswith("ok: greedy equal 4/4, 0 sizes captured")
