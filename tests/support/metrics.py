"""Samples of a server's Prometheus /metrics text."""

from __future__ import annotations

from tests.support.http import http_get

_MISSING = object()


def metrics_text(url: str) -> str:
    """GET url/metrics (a server's base URL); fails the test unless it answers 200."""
    response = http_get(url + "/metrics", timeout=5)
    assert response.status_code == 200, response.text
    return response.text


def read_metric(text: str, name: str, default: float | object = _MISSING, **labels: str) -> float:
    """The value of the first sample `name{...} value` whose labels include `labels`.

    Args:
        text: the /metrics output.
        name: the metric name, as in `kvserve:num_requests_running`.
        default: returned when no sample matches (else KeyError).
        labels: label values the sample must carry, as in engine="1".
    """
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        if all(label in line for label in wanted):
            return float(line.rsplit(" ", 1)[1])
    if default is _MISSING:
        raise KeyError(f"metric {name}{labels or ''} not in the /metrics output")
    return default


IDLE_GAUGES = (
    "kvserve:num_requests_running",
    "kvserve:num_requests_waiting",
    "kvserve:num_requests_waiting_for_grammar",
    "kvserve:kv_cache_usage_perc",
)


def engine_idle(url: str) -> bool:
    """Every engine's gauges of work in flight are 0: no request and no KV block left."""
    samples = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text(url).splitlines()
        if line.split("{", 1)[0] in IDLE_GAUGES
    ]
    return len(samples) >= len(IDLE_GAUGES) and not any(samples)
