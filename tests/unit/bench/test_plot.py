"""`kvserve bench plot`: which charts a set of results gets, and that they are written."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from kvserve.benchmarks import plot


def fake_result(label: str, rate, concurrency, seed: int) -> dict:
    """A result JSON with the fields plot reads, from random latencies."""
    rng = np.random.default_rng(seed)
    num = 20
    return {
        "label": label,
        "request_rate": rate,
        "max_concurrency": concurrency,
        "output_throughput": float(rng.uniform(10, 100)),
        "ttfts": rng.uniform(0.05, 0.5, num).tolist(),
        "itls": [rng.uniform(0.01, 0.05, 7).tolist() for _ in range(num)],
        "e2els": rng.uniform(0.5, 2.0, num).tolist(),
        "errors": [""] * (num - 1) + ["HTTP 500"],
    }


def test_sweep_axis_and_curve_names():
    by_rate = [fake_result("a", 1.0, None, 0), fake_result("a", 2.0, None, 1)]
    by_concurrency = [fake_result("a", "inf", 8, 0), fake_result("a", "inf", 32, 1)]
    assert plot.sweep_axis(by_rate) == "request_rate"
    assert plot.sweep_axis(by_concurrency) == "max_concurrency"
    assert plot.sweep_axis([fake_result("a", "inf", 32, 0), fake_result("b", "inf", 32, 1)]) is None
    assert plot.curve_name(by_concurrency[1], "/x/run.json") == "a c=32"
    assert plot.curve_name({**by_rate[0], "label": None}, "/x/run.json") == "run 1 req/s"


def test_writes_cdfs_and_rate_sweep(tmp_path, capsys):
    paths = []
    for i, (label, rate) in enumerate(
        [("kvserve", 1.0), ("kvserve", 2.0), ("vllm", 1.0), ("vllm", 2.0)]
    ):
        paths.append(str(tmp_path / f"r{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(fake_result(label, rate, None, i), f)
    out_dir = tmp_path / "plots"
    assert plot.run(argparse.Namespace(results=paths, output_dir=str(out_dir))) == 0
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == [
        "cdf_e2el.png",
        "cdf_itl.png",
        "cdf_ttft.png",
        "output_throughput_vs_request_rate.png",
        "p99_ttft_vs_request_rate.png",
    ]
    assert all((out_dir / name).stat().st_size > 1000 for name in names)
    assert sorted(capsys.readouterr().out.split()) == sorted(str(out_dir / n) for n in names)


def test_rejects_files_that_are_not_serve_results(tmp_path):
    path = tmp_path / "throughput.json"
    path.write_text(json.dumps({"elapsed_time": 1.0}))
    with pytest.raises(SystemExit, match="no per-request ttfts"):
        plot.run(argparse.Namespace(results=[str(path)], output_dir=str(tmp_path)))
