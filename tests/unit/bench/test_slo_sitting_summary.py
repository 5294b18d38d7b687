"""The SLO sitting's summary (bench/slo_sitting/summarize.py): each figure's median and range
over rounds per server, ratios taken within a round."""

import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).parents[3] / "bench" / "slo_sitting" / "summarize.py"
_spec = importlib.util.spec_from_file_location("slo_sitting_summarize", _PATH)
summarize = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summarize)


def _write(out: Path, name: str, result: dict) -> None:
    (out / f"{name}.json").write_text(json.dumps(result))


def _row(text: str, label: str) -> list[str]:
    [line] = [line for line in text.splitlines() if line.startswith(f"| {label} |")]
    return [cell.strip() for cell in line.strip("|").split("|")][1:]


def test_figures_and_ratios_per_round(tmp_path):
    for rnd, (vllm, slo) in enumerate(((1.0, 2.5), (2.0, 3.0)), start=1):
        for server, goodput in (("vllm", vllm), ("fcfs", 1.0), ("slo", slo)):
            short = {"request_goodput": goodput, "p99_ttft_ms": 100.0 * rnd}
            _write(tmp_path, f"a_{server}_r{rnd}_mixed", {"classes": {"short": short}})
        for run, itl in (("alone", 20.0), ("doc", 30.0 * rnd)):
            _write(tmp_path, f"b_slo_r{rnd}_{run}", {"classes": {"chat": {"p99_itl_ms": itl}}})
        _write(tmp_path, f"c_fairslo_r{rnd}_mix", {"tenants": {"light": {"p99_ttft_ms": 300.0}}})
        _write(tmp_path, f"c_fairslo_r{rnd}_alone", {"tenants": {"light": {"p99_ttft_ms": 200.0}}})
        _write(tmp_path, f"d_before_r{rnd}_c32", {"output_throughput": 500.0})
        _write(tmp_path, f"d_after_r{rnd}_c32", {"output_throughput": 490.0})
    _write(tmp_path, "calibration", {"median_ttft_ms": 1.0})  # not a sitting run
    text = summarize.summarize(summarize.load(tmp_path))
    goodput = "goodput req/s (short class, its targets)"
    assert _row(text, goodput) == ["1.5 [1-2]", "1 [1-1]", "2.75 [2.5-3]"]
    assert _row(text, "short P99 TTFT ms") == ["150 [100-200]"] * 3
    # Ratios within each round: 2.5 / 1 and 3 / 2.
    assert _row(text, "goodput: targets / vLLM") == ["2 [1.5-2.5]", "2"]
    assert _row(text, "goodput: targets / fcfs") == ["2.75 [2.5-3]", "2"]
    assert _row(text, "slo: ITL P99 beside / alone") == ["2.25 [1.5-3]", "2"]
    assert _row(text, "vllm: ITL P99 beside / alone") == ["-", "0"]  # no run
    assert _row(text, "fairslo: light P99 TTFT beside / alone") == ["1.5 [1.5-1.5]", "2"]
    assert _row(text, "tok/s: after / before") == ["0.98 [0.98-0.98]", "2"]
