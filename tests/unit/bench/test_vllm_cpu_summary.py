"""The side-by-side summary takes ratios only within a round, and their median and range."""

import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).parents[3] / "bench" / "vllm_cpu" / "summarize.py"
_spec = importlib.util.spec_from_file_location("vllm_cpu_summarize", _PATH)
summarize = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summarize)


def _write_round(out: Path, rnd: int, kv_tok: float, vllm_tok: float, kv_ttft: float) -> None:
    for system, tok in (("kvserve", kv_tok), ("vllm", vllm_tok)):
        tag = f"{system}_bfloat16_r{rnd}"
        (out / f"{tag}_throughput.txt").write_text(
            f"Throughput: 1.00 requests/s, 3.00 total tokens/s, {tok:.2f} output tokens/s\n"
        )
        ttft = kv_ttft if system == "kvserve" else 1000.0
        (out / f"{tag}_c32.json").write_text(
            json.dumps({"output_throughput": tok, "p99_ttft_ms": ttft, "mean_tpot_ms": 50.0})
        )
        (out / f"{tag}_startup.txt").write_text("8\n" if system == "kvserve" else "60\n")


def test_ratios_per_round_median_and_range(tmp_path):
    _write_round(tmp_path, 1, kv_tok=300, vllm_tok=200, kv_ttft=500)  # 1.5x, TTFT 0.5
    _write_round(tmp_path, 2, kv_tok=100, vllm_tok=100, kv_ttft=2000)  # 1.0x, TTFT 2.0
    _write_round(tmp_path, 3, kv_tok=240, vllm_tok=200, kv_ttft=900)  # 1.2x, TTFT 0.9
    (tmp_path / "unrelated.json").write_text("{}")
    runs = summarize.load(tmp_path)
    assert runs[("kvserve", "bfloat16", 1, "throughput")] == {"output_tokens_per_second": 300.0}
    text = summarize.summarize(runs)
    offline = next(line for line in text.splitlines() if "offline out tok/s" in line)
    assert "300 100 240" in offline
    assert "1.20 [1.00-1.50] (higher is better)" in offline
    ttft = next(line for line in text.splitlines() if "c32 P99 TTFT" in line)
    assert "0.90 [0.50-2.00] (lower is better)" in ttft
    startup = next(line for line in text.splitlines() if "start to healthy" in line)
    assert "0.13 [0.13-0.13]" in startup
    assert "float32" not in text


def test_a_round_missing_one_system_gives_no_ratio(tmp_path):
    _write_round(tmp_path, 1, kv_tok=300, vllm_tok=200, kv_ttft=500)
    for path in tmp_path.glob("vllm_*"):
        path.unlink()
    text = summarize.summarize(summarize.load(tmp_path))
    offline = next(line for line in text.splitlines() if "offline out tok/s" in line)
    assert "300" in offline and "better" not in offline


def test_batch1_runs_are_summarized(tmp_path):
    for rnd, (ours, theirs) in enumerate([(30.0, 40.0), (33.0, 44.0)], start=1):
        for system, tpot in (("kvserve", ours), ("vllm", theirs)):
            (tmp_path / f"{system}_float32_r{rnd}_b1.json").write_text(
                json.dumps({"mean_tpot_ms": tpot, "mean_ttft_ms": 100.0})
            )
    text = summarize.summarize(summarize.load(tmp_path))
    line = next(line for line in text.splitlines() if "batch-1 mean TPOT" in line)
    assert "30.0 33.0" in line and "40.0 44.0" in line
    assert "0.75 [0.75-0.75] (lower is better)" in line
