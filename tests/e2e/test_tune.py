"""`kvserve tune` end to end at a tiny size: real `kvserve serve` processes and the real bench
client, two configurations and two rates, on the tiny random Llama."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvserve.benchmarks.tune import best_run, meets, parse_slos
from tests.support.models import TINY_KV_CACHE_MEMORY

pytestmark = pytest.mark.slow


def _tune(model_dir: str, out_dir: str, *slos: str) -> subprocess.CompletedProcess:
    argv = [
        sys.executable,
        "-m",
        "kvserve.cli",
        "tune",
        "--model",
        model_dir,
        "--tokenizer",
        model_dir,
        "--serve-args",
        f"--kv-cache-memory {TINY_KV_CACHE_MEMORY} --max-model-len 256",
        "--max-num-seqs",
        "2",
        "8",
        "--max-num-batched-tokens",
        "256",
        "--request-rate",
        "inf",
        "20",
        "--num-prompts",
        "6",
        "--random-input-len",
        "16",
        "--random-output-len",
        "8",
        "--ignore-eos",
        "--output-dir",
        out_dir,
        *[arg for slo in slos for arg in ("--slo", slo)],
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600)


def test_tune_finds_a_configuration_within_loose_slos(tiny_llama_dir, tmp_path):
    done = _tune(tiny_llama_dir, str(tmp_path), "ttft_p99_ms=60000", "tpot_p99_ms=60000")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.load(open(tmp_path / "tune.json"))
    assert [e["config"]["max_num_seqs"] for e in report["sweep"]] == [2, 8]
    for entry in report["sweep"]:
        assert entry["error"] is None
        # Loose SLOs: the first (highest) rate already meets them, so the sweep stops there.
        assert [r["request_rate"] for r in entry["runs"]] == ["inf"]
        assert entry["runs"][0]["completed"] == 6
    best = report["best"]
    assert best["run"]["goodput"] > 0
    # The printed winner is the command line of the best configuration.
    assert best["command"] in done.stdout
    assert "--max-num-seqs" in best["command"]
    assert os.path.getsize(tmp_path / "tune.png") > 0


def test_tune_reports_when_no_configuration_meets_the_slos(tiny_llama_dir, tmp_path):
    done = _tune(tiny_llama_dir, str(tmp_path), "ttft_p99_ms=0.001")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no configuration met the SLOs" in done.stdout
    report = json.load(open(tmp_path / "tune.json"))
    assert report["best"] is None
    # Every rate was tried for every configuration before giving up.
    assert all(len(entry["runs"]) == 2 for entry in report["sweep"])


def test_slo_parsing_and_the_winner_rule():
    assert parse_slos(["ttft_p99_ms=500", "tpot_mean_ms=50"]) == {
        "p99_ttft_ms": 500.0,
        "mean_tpot_ms": 50.0,
    }
    for bad in (["ttft=5"], ["latency_p99_ms=5"], ["ttft_p99_ms=fast"], ["ttft_top_ms=1"], []):
        with pytest.raises(ValueError):
            parse_slos(bad)
    assert meets({"p99_ttft_ms": 400.0}, {"p99_ttft_ms": 500.0})
    assert not meets({"p99_ttft_ms": 600.0}, {"p99_ttft_ms": 500.0})
    assert not meets({}, {"p99_ttft_ms": 500.0})
    run = {"meets_slos": True, "goodput": 1.0, "output_throughput": 10.0}
    sweep = [
        {"config": "a", "runs": [{**run, "goodput": 3.0}]},
        {"config": "b", "runs": [{**run, "goodput": 9.0, "meets_slos": False}, run]},
    ]
    assert best_run(sweep)[0]["config"] == "a"
    assert best_run([{"config": "c", "runs": [{**run, "meets_slos": False}]}]) is None
