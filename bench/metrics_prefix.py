"""What `--metrics-prefix vllm` costs a scrape: the api's /metrics rendered under kvserve's
names and under vLLM's (the renaming view of services/api/observability/metric_names.py), in
process.

    .venv/bin/python bench/metrics_prefix.py [--scrapes 300]

An EngineClient of one engine (no engine process: the series exist from the start, as on a
server) and its ApiMetrics, with LoRA on; prints the median time of one render and the size
of the text in each mode.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

from kvserve.services.api.engine_client.client import EngineClient
from kvserve.services.api.observability.metrics import ApiMetrics


def median_render_ms(metrics: ApiMetrics, scrapes: int) -> tuple[float, int]:
    times = []
    for _ in range(scrapes):
        start = time.perf_counter()
        text, _ = metrics.render()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), len(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=300)
    args = parser.parse_args()
    client = EngineClient(SimpleNamespace(tokenizer=None), max_model_len=8192, model_name="m")
    for pass_index in range(2):  # the first pass warms up; the second is printed
        for prefix in ("kvserve", "vllm"):
            metrics = ApiMetrics(client, "m", max_loras=4, metrics_prefix=prefix)
            ms, size = median_render_ms(metrics, args.scrapes)
            client.stat_loggers.remove(metrics)
            if pass_index == 1:
                print(f"--metrics-prefix {prefix:8s} render median {ms:.3f} ms, {size} bytes")


if __name__ == "__main__":
    main()
