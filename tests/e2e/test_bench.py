"""`kvserve bench serve/latency/plot` as a user runs them, against a real `kvserve serve`.

One server for the module; each benchmark is a real `kvserve bench` process streaming real
HTTP. The checks are on the saved result JSON: every request accounted for, ordered
percentiles, exact output lengths with ignore_eos, and the server-side prefix-cache delta.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.server import serving

pytestmark = pytest.mark.slow

MODEL_NAME = "smollm2-bench"
API_KEY = "bench-key"
# The bench takes its key from $OPENAI_API_KEY when --api-key is not given.
BENCH_ENV = {**os.environ, "OPENAI_API_KEY": API_KEY}
BENCH_TIMEOUT_S = 180  # a loaded 2-core machine; these runs take seconds when it is idle


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("serve") / "serve.log")
    with serving(
        [
            "--max-model-len",
            "512",
            "--kv-cache-memory",
            "128M",
            "--served-model-name",
            MODEL_NAME,
            "--api-key",
            API_KEY,
            "--uvicorn-log-level",
            "warning",
        ],
        log_path,
    ) as url:
        yield url


def kvserve(*args: str) -> str:
    """Run `kvserve ARGS`; its stdout (fails the test with the output on a non-zero exit)."""
    done = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=BENCH_TIMEOUT_S,
        check=False,
        env=BENCH_ENV,
    )
    assert done.returncode == 0, f"kvserve {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def bench_serve(base_url: str, result_dir, name: str, *args: str) -> dict:
    stdout = kvserve(
        "bench",
        "serve",
        "--base-url",
        base_url,
        "--disable-tqdm",
        "--seed",
        "1",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        f"{name}.json",
        "--label",
        name,
        *args,
    )
    assert "============ Serving Benchmark Result ============" in stdout
    with open(result_dir / f"{name}.json") as f:
        return json.load(f)


def check_accounting(result: dict, num_prompts: int) -> None:
    assert result["completed"] + result["failed"] == num_prompts
    assert result["completed"] == num_prompts, result["errors"]
    assert result["errors"] == [""] * num_prompts
    for key in (
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "e2els",
        "generated_texts",
        "start_times",
    ):
        assert len(result[key]) == num_prompts, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert (
            0
            < result[f"p50_{metric}_ms"]
            <= result[f"p90_{metric}_ms"]
            <= result[f"p99_{metric}_ms"]
            <= result[f"max_{metric}_ms"]
        ), metric
    assert result["total_output_tokens"] == sum(result["output_lens"])
    assert all(text for text in result["generated_texts"])


@pytest.fixture(scope="module")
def random_result(base_url, tmp_path_factory) -> dict:
    result_dir = tmp_path_factory.mktemp("bench")
    result = bench_serve(
        base_url,
        result_dir,
        "random",
        "--dataset-name",
        "random",
        "--num-prompts",
        "8",
        "--random-input-len",
        "32",
        "--random-output-len",
        "8",
        "--ignore-eos",
        "--max-concurrency",
        "4",
        "--goodput",
        "ttft:60000",
        "e2el:120000",
    )
    result["path"] = str(result_dir / "random.json")
    return result


def test_random_with_max_concurrency(random_result):
    check_accounting(random_result, 8)
    assert random_result["model_id"] == MODEL_NAME  # looked up from /v1/models
    assert random_result["max_concurrency"] == 4
    assert random_result["output_lens"] == [8] * 8
    assert random_result["input_lens"] == [32] * 8
    # One chunk per token, unless the detokenizer held back a partial character.
    assert all(1 <= len(itl) <= 7 for itl in random_result["itls"])
    assert 0 < random_result["request_goodput"] <= random_result["request_throughput"]
    assert random_result["server_prefix_cache_queries"] == sum(random_result["input_lens"])
    assert 0 < random_result["server_peak_kv_cache_usage"] <= 1


def test_prefix_dataset_hits_the_prefix_cache(base_url, tmp_path):
    result = bench_serve(
        base_url,
        tmp_path,
        "prefix",
        "--dataset-name",
        "prefix",
        "--num-prompts",
        "6",
        "--prefix-num-groups",
        "2",
        "--prefix-len",
        "64",
        "--prefix-suffix-len",
        "8",
        "--prefix-output-len",
        "4",
        "--ignore-eos",
        "--request-rate",
        "8",
        "--burstiness",
        "1",
    )
    check_accounting(result, 6)
    assert result["request_rate"] == 8.0
    assert result["output_lens"] == [4] * 6
    # Poisson arrivals: the sends are spread out, not all at time zero.
    assert result["start_times"] == sorted(result["start_times"])
    assert result["start_times"][-1] > 0.05
    assert result["server_prefix_cache_hit_rate"] > 0
    assert result["server_num_preemptions"] == 0


def test_sharegpt_on_the_chat_endpoint(base_url, tmp_path, default_model_dir):
    from kvserve.benchmarks.datasets import load_tokenizer

    exchanges = [
        ("What is the capital of France? Answer briefly.", "Paris is the capital."),
        ("Name three primary colors, please.", "Red, yellow and blue."),
        ("Say hello in Spanish, just the word.", "Hola, my friend!"),
    ]
    path = tmp_path / "sharegpt.jsonl"
    with open(path, "w") as f:
        f.writelines(
            json.dumps(
                {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
            )
            + "\n"
            for q, a in exchanges
        )
    result = bench_serve(
        base_url,
        tmp_path,
        "sharegpt",
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(path),
        "--num-prompts",
        "4",
        "--ignore-eos",
        "--endpoint",
        "/v1/chat/completions",
        "--max-concurrency",
        "4",
    )
    check_accounting(result, 4)
    assert result["backend"] == "openai-chat"
    tokenizer = load_tokenizer(default_model_dir)
    expected = {
        len(tokenizer.encode(q, add_special_tokens=False)): len(
            tokenizer.encode(a, add_special_tokens=False)
        )
        for q, a in exchanges
    }
    assert len(expected) == len(exchanges)  # prompt lengths tell the exchanges apart
    for input_len, output_len in zip(result["input_lens"], result["output_lens"]):
        assert output_len == expected[input_len]


def test_failed_requests_are_counted(base_url, tmp_path):
    # max_tokens over max_model_len: the server answers 400 to every request.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "bench",
            "serve",
            "--base-url",
            base_url,
            "--disable-tqdm",
            "--num-prompts",
            "3",
            "--random-input-len",
            "16",
            "--random-output-len",
            "4096",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "failed.json",
        ],
        capture_output=True,
        text=True,
        timeout=BENCH_TIMEOUT_S,
        check=False,
        env=BENCH_ENV,
    )
    assert done.returncode == 1, done.stderr  # nothing completed: no benchmark ran
    assert "Failed requests:                         3" in done.stdout
    result = json.loads((tmp_path / "failed.json").read_text())
    assert result["completed"] == 0 and result["failed"] == 3
    assert all(error.startswith("HTTP 400") for error in result["errors"])


def test_plot_of_serve_results(random_result, tmp_path):
    stdout = kvserve("bench", "plot", random_result["path"], "--output-dir", str(tmp_path))
    paths = stdout.split()
    assert sorted(os.path.basename(p) for p in paths) == [
        "cdf_e2el.png",
        "cdf_itl.png",
        "cdf_ttft.png",
    ]
    assert all(os.path.getsize(p) > 1000 for p in paths)


def test_latency_offline(tmp_path):
    out = tmp_path / "latency.json"
    stdout = kvserve(
        "bench",
        "latency",
        "--input-len",
        "16",
        "--output-len",
        "3",
        "--batch-size",
        "2",
        "--num-iters-warmup",
        "1",
        "--num-iters",
        "2",
        "--max-model-len",
        "128",
        "--kv-cache-memory",
        "32M",
        "--disable-tqdm",
        "--output-json",
        str(out),
    )
    assert "Avg latency:" in stdout and "99% percentile latency:" in stdout
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 2 and all(x > 0 for x in result["latencies"])
    percentiles = [result["percentiles"][p] for p in ("10", "25", "50", "75", "90", "99")]
    assert percentiles == sorted(percentiles)
    assert min(result["latencies"]) <= result["avg_latency"] <= max(result["latencies"])
