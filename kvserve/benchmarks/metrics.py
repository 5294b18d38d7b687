"""The numbers of a serving benchmark, computed from its request records, named as vLLM's.

Per request: TTFT (to the first chunk with text), TPOT = (E2EL - TTFT) / (output tokens - 1),
ITL (each gap between chunks) and E2EL. Summaries: mean, median, std and the asked percentiles
of each, in milliseconds, plus throughputs and goodput (requests per second that met every
given SLO).
"""

from __future__ import annotations

import numpy as np

from kvserve.benchmarks.endpoint_client import RequestRecord

# metric key -> (section header, short name), in vLLM's order and words.
METRIC_SECTIONS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
_WIDTH = 50


def percentile_key(p: float) -> str:
    """'99' for 99.0, '99.9' for 99.9: the pNN part of a metric name."""
    return str(int(p)) if float(p).is_integer() else str(p)


def parse_metric_percentiles(text: str) -> list[float]:
    """'50,90,99' -> [50.0, 90.0, 99.0], each in (0, 100]."""
    try:
        percentiles = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(
            f"--metric-percentiles takes numbers like 50,90,99, got {text!r}"
        ) from None
    if not percentiles or any(not 0 < p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles must be in (0, 100], got {text!r}")
    return percentiles


def parse_percentile_metrics(text: str) -> list[str]:
    """'ttft,itl' -> ['ttft', 'itl'], each one of METRIC_SECTIONS."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in METRIC_SECTIONS]
    if not names or unknown:
        raise ValueError(
            f"--percentile-metrics takes a comma list of {','.join(METRIC_SECTIONS)}, got {text!r}"
        )
    return names


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:200', 'tpot:50'] -> {'ttft': 200.0, 'tpot': 50.0} (SLOs in milliseconds)."""
    slos = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(
                f"--goodput takes KEY:MS pairs with KEY in "
                f"{', '.join(GOODPUT_METRICS)}, got {item!r}"
            )
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(
                f"--goodput {item!r}: {value!r} is not a number of milliseconds"
            ) from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: an SLO cannot be negative")
    return slos


def output_len_of(record: RequestRecord, tokenizer) -> int:
    """Generated tokens: the server's usage when it sent one, else the text re-tokenized."""
    if not record.success:
        return 0
    if record.output_tokens is not None:
        return record.output_tokens
    return len(tokenizer.encode(record.generated_text, add_special_tokens=False))


def tpot_of(record: RequestRecord, output_len: int) -> float | None:
    """Seconds per output token after the first; None when there is no second token."""
    if not record.success or output_len < 2:
        return None
    return (record.latency - record.ttft) / (output_len - 1)


def meets_slos(
    ttft_ms: float, tpot_ms: float | None, e2el_ms: float, slos: dict[str, float]
) -> bool:
    """Whether one request met every SLO given (a request without a TPOT meets that one)."""
    values = {"ttft": ttft_ms, "tpot": tpot_ms, "e2el": e2el_ms}
    return all((value := values[name]) is None or value <= slo for name, slo in slos.items())


def _summarize(name: str, values_ms: list[float], percentiles: list[float]) -> dict:
    # vLLM reports 0 for a metric without samples (e.g. TPOT when every output is 1 token).
    values = np.asarray(values_ms or [0.0], dtype=np.float64)
    summary = {
        f"mean_{name}_ms": float(values.mean()),
        f"median_{name}_ms": float(np.median(values)),
        f"std_{name}_ms": float(values.std()),
        f"max_{name}_ms": float(values.max()),
    }
    for p in percentiles:
        summary[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(values, p))
    return summary


def compute_metrics(
    records: list[RequestRecord],
    tokenizer,
    duration_s: float,
    percentiles: list[float],
    slos: dict[str, float],
    bench_start: float,
    request_slos: list[dict[str, float]] | None = None,
) -> tuple[dict, dict]:
    """(summary, per-request detail) of one run.

    Args:
        records: one per request sent, failed ones included.
        tokenizer: counts output tokens when the server sent no usage.
        duration_s: wall time of the whole run.
        percentiles: the pNN to report for every metric.
        slos: goodput SLOs in ms (empty: no goodput).
        bench_start: perf_counter() at the start of the run (start times are relative).
        request_slos: each request's own SLOs (a --tenants tenant's, a --mix class's),
            over `slos`; a request left with none is not judged (goodput counts the
            requests that met every target they had).
    """
    assert duration_s > 0, "a run takes time"
    output_lens = [output_len_of(r, tokenizer) for r in records]
    tpots = [tpot_of(r, n) for r, n in zip(records, output_lens)]
    ok = [r.success for r in records]
    ttfts_ms = [r.ttft * 1000 for r, s in zip(records, ok) if s]
    tpots_ms = [t * 1000 for t in tpots if t is not None]
    itls_ms = [gap * 1000 for r, s in zip(records, ok) if s for gap in r.itl]
    e2els_ms = [r.latency * 1000 for r, s in zip(records, ok) if s]
    num_completed = sum(ok)
    total_input = sum(r.prompt_len for r, s in zip(records, ok) if s)
    total_output = sum(output_lens)
    summary = {
        "duration": duration_s,
        "completed": num_completed,
        "failed": len(records) - num_completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": num_completed / duration_s,
        "request_goodput": None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    targets = [slos | own for own in request_slos] if request_slos else [slos] * len(records)
    if any(targets):
        num_good = sum(
            meets_slos(r.ttft * 1000, None if t is None else t * 1000, r.latency * 1000, target)
            for r, t, target in zip(records, tpots, targets)
            if r.success and target
        )
        summary["request_goodput"] = num_good / duration_s
    for name, values in (
        ("ttft", ttfts_ms),
        ("tpot", tpots_ms),
        ("itl", itls_ms),
        ("e2el", e2els_ms),
    ):
        summary.update(_summarize(name, values, percentiles))
    detail = {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": output_lens,
        "ttfts": [r.ttft for r in records],
        "tpots": tpots,
        "itls": [r.itl for r in records],
        "e2els": [r.latency for r in records],
        "start_times": [r.start_time - bench_start for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
    }
    return summary, detail


def _line(label: str, value, fmt: str = "") -> str:
    return f"{label:<40} {value:<10{fmt}}"


def format_report(
    summary: dict,
    percentile_metrics: list[str],
    percentiles: list[float],
    max_concurrency: int | None,
    request_rate: float,
) -> str:
    """The result block that `vllm bench serve` prints, in its layout."""
    lines = [
        f"{' Serving Benchmark Result ':=^{_WIDTH}}",
        _line("Successful requests:", summary["completed"]),
        _line("Failed requests:", summary["failed"]),
    ]
    if max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_line("Request rate configured (RPS):", request_rate, ".2f"))
    lines += [
        _line("Benchmark duration (s):", summary["duration"], ".2f"),
        _line("Total input tokens:", summary["total_input_tokens"]),
        _line("Total generated tokens:", summary["total_output_tokens"]),
        _line("Request throughput (req/s):", summary["request_throughput"], ".2f"),
    ]
    if summary["request_goodput"] is not None:
        lines.append(_line("Request goodput (req/s):", summary["request_goodput"], ".2f"))
    lines += [
        _line("Output token throughput (tok/s):", summary["output_throughput"], ".2f"),
        _line("Total Token throughput (tok/s):", summary["total_token_throughput"], ".2f"),
    ]
    for name in percentile_metrics:
        header, short = METRIC_SECTIONS[name]
        lines.append(f"{header:-^{_WIDTH}}")
        lines.append(_line(f"Mean {short} (ms):", summary[f"mean_{name}_ms"], ".2f"))
        lines.append(_line(f"Median {short} (ms):", summary[f"median_{name}_ms"], ".2f"))
        for p in percentiles:
            key = percentile_key(p)
            lines.append(_line(f"P{key} {short} (ms):", summary[f"p{key}_{name}_ms"], ".2f"))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)
